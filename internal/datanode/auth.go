package datanode

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/stream"
)

// A datanode's certificate names its UUID (basalt://datanode/<uuid>);
// SCM knows each datanode by that UUID and the ID it assigned. So the
// other datanodes' raft transports and stream servers authenticate a
// peer by looking its ID up in SCM's list (refreshed when an ID is not
// known yet, at most once a second) and comparing the UUID with the
// certificate's: a certificate proves one datanode, and an ID or an
// address SCM does not have opens nothing.

// peerRefreshEvery bounds how often peers that are unknown (or whose
// registration does not match) make the datanode ask SCM again: callers
// wait for the next refresh rather than fail, and they are few (they hold
// one of the bounded handshake slots of the raft or stream port).
const peerRefreshEvery = 100 * time.Millisecond

// knownPeer returns what SCM registered for datanode id, asking SCM again
// if it is not known or what is known does not pass check (a datanode
// that restarted on other ports).
func (d *Datanode) knownPeer(id uint64, check func(*metapb.DatanodeDetails) bool) (*metapb.DatanodeDetails, bool) {
	lookup := func() (*metapb.DatanodeDetails, bool, bool) {
		d.mu.Lock()
		defer d.mu.Unlock()
		p, ok := d.peers[id]
		return p, ok, ok && (check == nil || check(p))
	}
	p, ok, good := lookup()
	if good {
		return p, ok
	}
	d.refreshMu.Lock()
	defer d.refreshMu.Unlock()
	if p, ok, good = lookup(); good {
		return p, ok // another caller's refresh found it
	}
	if wait := peerRefreshEvery - time.Since(d.peersRefreshed); wait > 0 {
		time.Sleep(wait)
	}
	d.refreshPeers()
	d.peersRefreshed = time.Now()
	p, ok, _ = lookup()
	return p, ok
}

// isPeer checks that the verified certificate in cs is datanode id's.
func (d *Datanode) isPeer(id uint64, cs *tls.ConnectionState) error {
	pid, err := pki.PeerIdentity(cs)
	if err != nil {
		return err
	}
	if pid.Role != pki.RoleDatanode {
		return fmt.Errorf("%s is not a datanode", pid)
	}
	p, ok := d.knownPeer(id, nil)
	if !ok {
		return fmt.Errorf("datanode %d is not registered with SCM", id)
	}
	if p.GetUuid() != pid.ID {
		return fmt.Errorf("datanode %d is %s, the certificate is %s's", id, p.GetUuid(), pid.ID)
	}
	return nil
}

func (d *Datanode) raftSecurity() *raft.Security {
	if d.cfg.TLS.IsInsecure() {
		return nil
	}
	return &raft.Security{Server: d.cfg.TLS.ServerTLS(pki.RoleDatanode), Client: d.cfg.TLS.ClientTLS(pki.RoleDatanode), Authenticate: d.isPeer,
		Watch: d.cfg.TLS.Watch}
}

func (d *Datanode) streamSecurity() *stream.Security {
	if d.cfg.TLS.IsInsecure() {
		return nil
	}
	return &stream.Security{
		Server: d.cfg.TLS.ServerTLS(pki.RoleClient, pki.RoleDatanode),
		Client: d.cfg.TLS.ClientTLS(pki.RoleDatanode),
		Watch:  d.cfg.TLS.Watch, // a revocation closes the opener's open streams
		Upstream: func(cs *tls.ConnectionState, h *stream.Header) error {
			pid, err := pki.PeerIdentity(cs)
			if err == nil && h.Hop > 0 && pid.Role != pki.RoleDatanode {
				err = fmt.Errorf("%s may not open hop %d of a stream (only datanodes forward)", pid, h.Hop)
			}
			return err
		},
		Target: func(t stream.Target) error {
			p, ok := d.knownPeer(t.ID, func(p *metapb.DatanodeDetails) bool { return p.GetStreamAddr() == t.Addr })
			if !ok {
				return fmt.Errorf("route names datanode %d, which SCM has not registered", t.ID)
			}
			if p.GetStreamAddr() != t.Addr {
				return fmt.Errorf("route names datanode %d at %q, but it registered %q", t.ID, t.Addr, p.GetStreamAddr())
			}
			return nil
		},
		Verify: func(t stream.Target, cs *tls.ConnectionState) error { return d.isPeer(t.ID, cs) },
	}
}

// datanodeOnly are the RPCs only other datanodes call: a container's
// whole contents (replication) and a replica's apply status.
var datanodeOnly = map[string]bool{
	datanodepb.Datanode_ExportContainer_FullMethodName: true,
	datanodepb.Datanode_ApplyStatus_FullMethodName:     true,
}

// needCert are the RPCs that carry no block token: a caller without a
// certificate may not call them (nor datanodeOnly).
var needCert = map[string]bool{
	datanodepb.Datanode_Info_FullMethodName: true,
}

// grpcServerOption: the gRPC port verifies a client certificate if one
// is presented and also takes TLS connections without one (clients that
// authenticate to the metadata service with a user token): every data
// RPC is authorized by its block token (token.go), which only the
// metadata service issues, so the certificate adds nothing there; the
// RPCs without a token (needCert, datanodeOnly) still need a
// certificate, as node-to-node streams and raft do.
func (d *Datanode) grpcServerOption() grpc.ServerOption {
	if d.cfg.TLS.IsInsecure() {
		return d.cfg.TLS.GRPCServerOption()
	}
	return d.cfg.TLS.GRPCServerOptionCertOptional() // watched: a revocation closes the peer's connections
}

func (d *Datanode) authUnary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	// A certificate revoked after its connection was made (pki/enroll
	// keeps the revoked list).
	if err := d.cfg.TLS.RefuseRevoked(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	if datanodeOnly[info.FullMethod] && !d.cfg.TLS.IsInsecure() {
		if _, err := pki.RequireRole(ctx, info.FullMethod, pki.RoleDatanode); err != nil {
			return nil, err
		}
	}
	if needCert[info.FullMethod] && !d.cfg.TLS.IsInsecure() {
		if _, err := pki.RequireRole(ctx, info.FullMethod, pki.RoleClient, pki.RoleDatanode, pki.RoleMeta); err != nil {
			return nil, err
		}
	}
	return handler(ctx, req)
}

func (d *Datanode) authStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := d.cfg.TLS.RefuseRevoked(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	if datanodeOnly[info.FullMethod] && !d.cfg.TLS.IsInsecure() {
		if _, err := pki.RequireRole(ss.Context(), info.FullMethod, pki.RoleDatanode); err != nil {
			return err
		}
	}
	return handler(srv, ss)
}

// StoredUUID is the UUID of the datanode whose DataDir is dir ("" if it
// has not started there yet), for provisioning its certificate.
func StoredUUID(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, "datanode.json"))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	var id identity
	if err := json.Unmarshal(b, &id); err != nil {
		return "", fmt.Errorf("datanode: identity file in %s: %w", dir, err)
	}
	return id.UUID, nil
}
