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

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

// revokeLoop is runRevokeRemoved's state (its goroutine only).
type revokeLoop struct {
	// backoff is the wait after the CA refused a revocation (it applied
	// and refused, e.g. the revoked list is full): doubled per refusal up
	// to maxRevokeBackoff, reset by a success or a table change. Without
	// it every election timeout would append one refused entry to the
	// CA group's log, forever.
	backoff time.Duration
	retryAt time.Time
	// skipLogged: when the reconciler last logged that it skips a
	// removed ID that is still a voter or learner (at most once per
	// revokeSkipLogEvery per ID).
	skipLogged map[uint64]time.Time
}

const (
	maxRevokeBackoff   = time.Minute
	revokeSkipLogEvery = time.Minute
)

// runRevokeRemoved runs reconcileRevocations on every table change and
// every election timeout (backed off after a refusal); it acts only
// where this node leads the CA group.
func (s *Server) runRevokeRemoved(ctx context.Context) {
	if s.cfg.TLS.IsInsecure() {
		return // no certificates (benchmarks)
	}
	et := max(s.electionTimeout(), 100*time.Millisecond)
	t := time.NewTicker(et)
	defer t.Stop()
	l := &revokeLoop{skipLogged: map[uint64]time.Time{}}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if time.Now().Before(l.retryAt) {
				continue
			}
		case <-s.revokePoke:
			l.retryAt = time.Time{} // the table changed: try at once
		}
		switch refused := s.reconcileRevocations(ctx, l); {
		case refused:
			l.backoff = min(max(2*l.backoff, 2*et), maxRevokeBackoff)
			l.retryAt = time.Now().Add(l.backoff)
		default:
			l.backoff, l.retryAt = 0, time.Time{}
		}
	}
}

// stillInGroup is the first meta group whose configuration (as this
// node has applied it) still has id as a voter or learner, "" if none.
func (s *Server) stillInGroup(id uint64) string {
	for _, mg := range metaGroups {
		g := s.group(mg.id)
		if g == nil {
			continue
		}
		st := g.Status()
		if slices.Contains(st.Voters, id) || slices.Contains(st.Learners, id) || slices.Contains(g.Voters(), id) {
			return mg.name
		}
	}
	return ""
}

// reconcileRevocations revokes, on the CA group's leader, the identity
// of every removed member whose identity is not revoked yet; it reports
// whether the CA refused a revocation (a status from the apply or the
// disk reserve, not a lost leadership or a timeout). The table read may
// lag the members group: a row removed meanwhile is revoked at the next
// round.
//
// RemoveMember marks a row only after the node left every group, but a
// row can be marked while the node is (again) a voter: an AddNode left in
// a group's log by an AddMember that timed out applies after a
// RemoveMember that saw "already removed". So the invariant is checked
// here, locally: an ID that is still a voter or learner of any meta group
// in this node's view is skipped (and logged, rate-limited) until it
// leaves (admin meta remove again); a lagging view only delays the
// revocation. A revoked voter would keep its group one live voter short.
func (s *Server) reconcileRevocations(ctx context.Context, l *revokeLoop) (refused bool) {
	if testSkipRevoke.Load() || s.ca == nil || s.ca.group == nil || !s.ca.group.IsLeader() || s.ca.halted() != nil {
		return false
	}
	for _, m := range s.members.Table() {
		id := m.GetId()
		if !m.GetRemoved() || s.identityRevoked(id) {
			continue
		}
		if g := s.stillInGroup(id); g != "" {
			if time.Since(l.skipLogged[id]) >= revokeSkipLogEvery {
				l.skipLogged[id] = time.Now()
				s.log.Error("meta: a removed meta node is still a member of a meta group: its certificates are not revoked until it leaves every group (remove it again: basalt admin meta remove)", "id", id, "group", g)
			}
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
			if ctx.Err() != nil {
				return false
			}
			switch status.Code(err) {
			case codes.Unavailable, codes.DeadlineExceeded, codes.Unknown, codes.Canceled:
				s.log.Warn("meta: revoking the certificates of a removed meta node (retried)", "id", id, "err", err)
				return false
			}
			s.log.Warn("meta: the CA refused to revoke the certificates of a removed meta node (retried, backing off)", "id", id, "err", err)
			return true
		}
		delete(l.skipLogged, id)
		s.log.Info("meta: revoked the certificates of a removed meta node", "id", id, "identity", ident, "serials", v)
	}
	return false
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
