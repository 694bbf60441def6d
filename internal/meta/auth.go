package meta

import (
	"context"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
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
//   - the remaining SCM reads (listings, GetContainers, safe mode) anyone
//     with a certificate.
//
// An RPC nobody listed here (added later) is open to clients and meta
// nodes only: a new datanode-facing RPC must be listed to be reachable.
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
		metapb.Scm_ListCorruptReplicas_FullMethodName:  anyRole,
		metapb.Scm_GetContainerHealth_FullMethodName:   anyRole,
	}
)

// authorize checks the caller's certificate against the method (see
// above). With insecure credentials (benchmarks only) anything goes.
func (s *Server) authorize(ctx context.Context, method string, req any) error {
	if s.cfg.TLS.IsInsecure() {
		return nil
	}
	roles, ok := methodRoles[method]
	if !ok {
		roles = clientsAndMeta
	}
	id, err := pki.RequireRole(ctx, methodName(method), roles...)
	if err != nil {
		return err
	}
	if id.Role != pki.RoleDatanode {
		return nil
	}
	switch r := req.(type) {
	case *metapb.RegisterDatanodeRequest:
		if u := r.GetDetails().GetUuid(); u != id.ID {
			return status.Errorf(codes.PermissionDenied, "meta node %d: RegisterDatanode of datanode %q by %s: a datanode registers only under its certificate's UUID",
				s.cfg.NodeID, clip(u), id)
		}
	case *metapb.HeartbeatRequest:
		// An unknown ID gets "reregister" from the handler, which changes
		// nothing.
		if d := s.scmState.Datanode(r.GetDatanodeId()); d != nil && d.GetUuid() != id.ID {
			return status.Errorf(codes.PermissionDenied, "meta node %d: heartbeat of datanode %d (%s) by %s", s.cfg.NodeID, r.GetDatanodeId(), d.GetUuid(), id)
		}
	}
	return nil
}

// clip bounds an attacker's string in an error.
func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}
