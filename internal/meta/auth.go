package meta

import (
	"context"
	"strings"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/pki"
)

// Who may call what. Every connection to the gRPC port is mutual TLS with
// a certificate from the cluster CA (pki), so every call has a verified
// identity; the role decides which RPCs it may call:
//
//   - the datanode protocol (RegisterDatanode, Heartbeat) only datanodes,
//     and only in their own name: the UUID registered must be the
//     certificate's, and a heartbeat's datanode ID must be registered
//     under the certificate's UUID;
//   - the block protocol between meta nodes (AllocateBlocks, DeleteBlocks)
//     only meta nodes;
//   - corruption reports datanodes, clients and meta nodes;
//   - the namespace clients and meta nodes, never datanodes;
//   - the remaining SCM reads (listings, GetContainers, safe mode, the
//     replication manager's health summary) anyone with a certificate;
//   - the replica records (GetContainerReplicas, ListCorruptReplicas)
//     admins only (adminMethods): their reasons are the datanodes' and
//     reporters' free-text error strings (a scrubber's or a disk's error
//     can carry block file names, block IDs and errno text) and a client
//     report's reporter names the client's IP address. ListDatanodes
//     and ListPipelines stay open, but show datanode-local paths (volume
//     and slow-disk paths, a close reason "slow disk on datanode N:
//     <path>") to admins and meta nodes only; others see "(hidden)"
//     (scmserver.go showsPaths).
//
// An RPC nobody listed here (added later) is open to clients and meta
// nodes only: a new datanode-facing RPC must be listed to be reachable.
//
// Past the role, a call runs for a user (caller): the namespace's
// Authorizer checks owners and modes for it, and adminMethods need an
// admin (Config.Admins). See docs/ARCHITECTURE.md, "Security".
var (
	anyRole        = []pki.Role{pki.RoleMeta, pki.RoleDatanode, pki.RoleClient}
	clientsAndMeta = []pki.Role{pki.RoleClient, pki.RoleMeta}
	onlyMeta       = []pki.Role{pki.RoleMeta}
	onlyDatanodes  = []pki.Role{pki.RoleDatanode}

	methodRoles = map[string][]pki.Role{
		metapb.Scm_RegisterDatanode_FullMethodName:     onlyDatanodes,
		metapb.Scm_Heartbeat_FullMethodName:            onlyDatanodes,
		metapb.Scm_AllocateBlocks_FullMethodName:       onlyMeta,
		metapb.Scm_DeleteBlocks_FullMethodName:         onlyMeta,
		metapb.Scm_ReportCorruptReplica_FullMethodName: anyRole,
		metapb.Scm_GetContainers_FullMethodName:        anyRole,
		metapb.Scm_ListDatanodes_FullMethodName:        anyRole,
		metapb.Scm_ListPipelines_FullMethodName:        anyRole,
		metapb.Scm_ListContainers_FullMethodName:       anyRole,
		metapb.Scm_GetSafeMode_FullMethodName:          anyRole,
		// Counts, container and datanode IDs, copies in flight: no
		// more than the listings above show.
		metapb.Scm_GetContainerHealth_FullMethodName: anyRole,
		// GetContainerReplicas and ListCorruptReplicas: not listed
		// (clients and meta nodes), and adminMethods.
	}
)

// adminMethods are the SCM RPCs that change the cluster, and those whose
// answers carry what datanodes and reporters said about replicas: admins
// only (the namespace's admin-only RPCs are checked by its Authorizer).
// A method here must not allow datanodes in methodRoles: authorize checks
// admins only for callers other than datanodes.
var adminMethods = map[string]bool{
	metapb.Scm_SetDatanodeOpState_FullMethodName: true,
	// Replica health with the datanodes' unhealthy reasons and the stored
	// corruption reports (free-text errors with file names, block IDs
	// and errno text; reporters' client IPs): basalt admin container
	// info|replicas. (ListDatanodes and ListPipelines hide directory
	// paths from non-admins: scmserver.go showsPaths.)
	metapb.Scm_GetContainerReplicas_FullMethodName: true,
	metapb.Scm_ListCorruptReplicas_FullMethodName:  true,
	metapb.Scm_RecoverContainer_FullMethodName:     true, // basalt admin container recover
	// Cache pools pin data in the datanodes' cache tiers (docs/CACHE.md):
	// administrators only, as in HDFS. Directives: admins and whoever may
	// write the pool (checked in cache_server.go). Listing stays open.
	metapb.Scm_AddCachePool_FullMethodName:    true,
	metapb.Scm_ModifyCachePool_FullMethodName: true,
	metapb.Scm_RemoveCachePool_FullMethodName: true,
}

// caller is who a call runs for (namespace.Caller): the certificate's
// user; for a gateway's certificate the end user it names in the
// on-behalf-of metadata, if any (see metaclient.WithUser). Meta nodes
// (forwarding) and the users in Config.Admins are admins.
func (s *Server) caller(ctx context.Context, id pki.Identity) (namespace.Caller, error) {
	if id.Role == pki.RoleMeta {
		// A removed member loses its rights (members.go): its
		// certificate stays valid until it expires or is revoked.
		if s.metaIDRemoved(id.ID) {
			return namespace.Caller{}, status.Errorf(codes.PermissionDenied, "meta node %d: %s was removed from the cluster (basalt admin meta remove)", s.cfg.NodeID, id)
		}
		return namespace.Caller{User: id.String(), Admin: true}, nil
	}
	c := namespace.Caller{User: id.ID}
	if id.IsGateway() {
		if c, ok, err := s.gatewayTokenCaller(ctx); ok {
			return c, err // a user token (WebHDFS delegation=) names the end user
		}
		// One header at a time: FromIncomingContext would copy all of
		// them on every call (issue 15: CPU per lookup).
		users := metadata.ValueFromIncomingContext(ctx, metaclient.OnBehalfOfHeader)
		if a := metadata.ValueFromIncomingContext(ctx, metaclient.AnonymousHeader); len(a) > 0 && a[0] == "true" {
			if len(users) > 0 {
				return c, status.Errorf(codes.InvalidArgument, "%s: a call is anonymous or on behalf of a user, not both", id)
			}
			return namespace.Caller{Anonymous: true, Request: requestInfo(ctx, true)}, nil
		}
		if len(users) == 0 {
			c.Request = requestInfo(ctx, true)
			c.Gateway = true
			return c, nil
		}
		u := users[0]
		if len(users) > 1 || u == "" || len(u) > maxUserBytes || !utf8.ValidString(u) || strings.ContainsFunc(u, unicode.IsControl) {
			return c, status.Errorf(codes.InvalidArgument, "%s: on-behalf-of user %q: want one name of 1 to %d characters", id, clip(u), maxUserBytes)
		}
		c.User = u
		if a := metadata.ValueFromIncomingContext(ctx, metaclient.OnBehalfOfAdminHeader); len(a) > 0 && a[0] == "true" {
			c.Admin = true
		}
	}
	// Any other caller's on-behalf-of metadata is ignored: it acts as the
	// certificate's user.
	if s.admins[c.User] {
		c.Admin = true
	}
	c.Groups = s.cfg.Groups[c.User]
	c.Request = requestInfo(ctx, id.IsGateway())
	return c, nil
}

// maxUserBytes bounds an end user's name.
const maxUserBytes = 128

// authorize checks the caller's certificate against the method (see
// above) and returns ctx with the call's namespace.Caller. With insecure
// credentials (benchmarks only) anything goes.
func (s *Server) authorize(ctx context.Context, method string, req any) (context.Context, error) {
	if s.cfg.TLS.IsInsecure() {
		return ctx, nil
	}
	if certlessCall(ctx, method) {
		return ctx, nil // no certificate: the handler checks a bootstrap token (ca.go)
	}
	if ctx, ok, err := s.authorizeByToken(ctx, method); ok {
		return ctx, err // no client certificate: a user token (usertoken.go)
	}
	if err := s.cfg.TLS.RefuseRevoked(ctx, methodName(method)); err != nil {
		return ctx, err // revoked after this connection was made (ca.go)
	}
	roles, ok := methodRoles[method]
	if !ok {
		roles = clientsAndMeta
	}
	id, err := pki.RequireRole(ctx, methodName(method), roles...)
	if err != nil {
		return ctx, err
	}
	if id.Role != pki.RoleDatanode {
		c, err := s.caller(ctx, id)
		if err != nil {
			return ctx, err
		}
		if adminMethods[method] && !c.Admin {
			return ctx, status.Errorf(codes.PermissionDenied, "meta node %d: %s: %s is not an admin (admins: basalt meta --admins)", s.cfg.NodeID, methodName(method), c)
		}
		return namespace.WithCaller(ctx, c), nil
	}
	switch r := req.(type) {
	case *metapb.RegisterDatanodeRequest:
		if u := r.GetDetails().GetUuid(); u != id.ID {
			return ctx, status.Errorf(codes.PermissionDenied, "meta node %d: RegisterDatanode of datanode %q by %s: a datanode registers only under its certificate's UUID",
				s.cfg.NodeID, clip(u), id)
		}
	case *metapb.HeartbeatRequest:
		// An unknown ID gets "reregister" from the handler, which changes
		// nothing.
		if d := s.scmState.Datanode(r.GetDatanodeId()); d != nil && d.GetUuid() != id.ID {
			return ctx, status.Errorf(codes.PermissionDenied, "meta node %d: heartbeat of datanode %d (%s) by %s", s.cfg.NodeID, r.GetDatanodeId(), d.GetUuid(), id)
		}
	}
	return ctx, nil
}

// clip bounds an attacker's string in an error.
func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}
