package meta

// A removed meta node's certificates are revoked (docs/ARCHITECTURE.md,
// "Meta membership"). RemoveMember takes the node out of every group,
// then marks its row removed; the leader of the CA group then revokes
// the node's identity (basalt://meta/ID): one CA command that records
// the identity itself in the revoked list (pki.Credentials.SetRevoked
// refuses every certificate naming it, whatever its serial, so also a
// certificate the CA never recorded: the initial members' are made
// offline) and every serial the CA issued to it (for binaries that match
// serials only). Every meta node applies it and refuses the node's
// handshakes; the raft transport's and the gRPC server's open
// connections from it are closed (pki.Credentials.Watch); datanodes
// learn it with GetRevocations (enroll.Agent) and do the same.
//
// Order: the revocation comes after the removal has committed, never
// before. Revoked first, a node would lose its connections while still a
// voter of groups whose quorum may need it (3 voters, one dead: revoking
// the third before its removal stalls every group), and a removal the
// quorum rule then refuses would leave a revoked voter. Between the
// removed row and the revocation the node is already refused new raft
// connections (Authenticate) and gRPC calls (auth.go). The revocation is
// durable without the caller: the CA group's leader (reconcileRevocations)
// revokes every removed row that is not revoked yet, at each change of
// the table and every election timeout, so a members leader that crashes
// right after the removed row commits leaves the revocation to the next
// CA leader. RemoveMember waits a bounded time for it and reports it
// (MemberInfo.revoked).

import (
	"context"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// testSkipRevoke stops every reconcileRevocations (tests: a leader that
// dies between the removal and the revocation).
var testSkipRevoke atomic.Bool

// metaIdentity is node id's certificate identity.
func metaIdentity(id uint64) string {
	return pki.Identity{Role: pki.RoleMeta, ID: strconv.FormatUint(id, 10)}.String()
}

// identityRevoked: this node's CA state has the identity of meta node id
// in its revoked list.
func (s *Server) identityRevoked(id uint64) bool {
	if s.ca == nil || s.ca.state == nil {
		return false
	}
	serials, _ := s.ca.state.Revocations()
	_, found := slices.BinarySearch(serials, metaIdentity(id))
	return found
}

// pokeRevocations wakes the reconciler (the member table changed).
func (s *Server) pokeRevocations() {
	select {
	case s.revokePoke <- struct{}{}:
	default:
	}
}

// runRevokeRemoved runs reconcileRevocations on every table change and
// every election timeout; it acts only where this node leads the CA
// group.
func (s *Server) runRevokeRemoved(ctx context.Context) {
	if s.cfg.TLS.IsInsecure() {
		return // no certificates (benchmarks)
	}
	t := time.NewTicker(max(s.electionTimeout(), 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.revokePoke:
		}
		s.reconcileRevocations(ctx)
	}
}

// reconcileRevocations revokes, on the CA group's leader, the identity
// of every removed member whose identity is not revoked yet. The table
// read may lag the members group: a row removed meanwhile is revoked at
// the next round. Only rows marked removed are revoked, and RemoveMember
// marks a row after the node left every group, so no voter is revoked.
func (s *Server) reconcileRevocations(ctx context.Context) {
	if testSkipRevoke.Load() || s.ca == nil || s.ca.group == nil || !s.ca.group.IsLeader() || s.ca.halted() != nil {
		return
	}
	for _, m := range s.members.Table() {
		id := m.GetId()
		if !m.GetRemoved() || s.identityRevoked(id) {
			continue
		}
		ident := metaIdentity(id)
		pctx, cancel := s.withTimeout(ctx)
		// Serial: the identity itself (never a hexadecimal serial, so it
		// cannot name a certificate by serial; the RPC refuses it there,
		// this command is made here only). Identity: every serial the
		// CA issued to it. A binary of before this change applies the
		// same command the same way (it records both), so replicas agree.
		v, err := s.ca.propose(pctx, &metapb.CaCommand{Op: &metapb.CaCommand_Revoke{Revoke: &metapb.RevokeCertificateRequest{Serial: ident, Identity: ident}}})
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("meta: revoking the certificates of a removed meta node (retried)", "id", id, "err", err)
			}
			return
		}
		s.log.Info("meta: revoked the certificates of a removed meta node", "id", id, "identity", ident, "serials", v)
	}
}

// waitRevoked waits until this node's CA state has revoked meta node id,
// at most d; it reports whether it has.
func (s *Server) waitRevoked(ctx context.Context, id uint64, d time.Duration) bool {
	s.pokeRevocations()
	deadline := time.Now().Add(d)
	for !s.identityRevoked(id) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}
