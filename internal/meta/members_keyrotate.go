package meta

// A removed meta node's token keys are rotated (docs/ARCHITECTURE.md,
// "Meta membership"). Every meta replica holds the block token keys (SCM
// group, scm/secretkeys.go) and the user-token keys (user-token group,
// usertoken_state.go), so a removed (or stolen) node could sign block
// tokens for any block and user tokens for any user with them. Once its
// removal has committed, a forced rotation records a new key in each
// group (active after the group's activation delay, as a scheduled
// rotation's: no token in flight fails) and gives every key recorded
// before it a retire time, the new key's activation + token lifetime +
// activation delay, when the keys are dropped: the removed node's copies
// stop working within one token lifetime instead of the next scheduled
// rotation's (24 h) plus one.
//
// Durable and once per member: the op names the member and each group's
// Apply records it and refuses a second op for it. The reconciler below
// runs on every meta node every second (runUserTokens's tick) and acts
// where this node leads the SCM group (block token keys) or the
// user-token group (user-token keys): it proposes one rotation for all
// the removed rows of the member table whose rotation its group has not
// recorded (after an upgrade, every node removed before it: one new
// key, not one per node). A
// leader that crashes between the removal and the rotation leaves it to
// the next leader (TestKeyRotationAfterLeaderCrash).
//
// Order: as the revocation (members_revoke.go), only once the node left
// every meta group in this node's view (stillInGroup): a key recorded
// while it is still a replica would reach it.
//
// Upgrade gate: the forced rotation is a top-level op of each group's
// command (ScmCommand and UserTokenCommand forced_key_rotation), so a
// binary that does not know it halts its replica of the group at the
// entry (applyhalt: an unknown top-level field; applyhalt checks nothing
// nested, which is why it is not a field of SecretKeysOp /
// UserTokenKeysOp: TestForcedRotationHaltsOlderReplica, in this package
// and in scm). A halted replica serves nothing of that group until
// upgraded, so a leader proposes a forced rotation only once every other
// voter of the group answered ListMembers with forced_key_rotation,
// asked right before each proposal (not cached: a voter rolled back to
// an older binary after an earlier probe is seen; the probes run only
// while a rotation is pending). A voter that does
// not answer is not waited for (a dead node is what removals are for;
// should it come back on an older binary, its replica halts at the
// entry until upgraded, and does not diverge); one that answers without
// the flag (or without the Members service) holds the rotation back,
// logged once a minute, until it runs this binary
// (TestKeyRotationUpgradeGate).
//
// What remains: the CA key. Every meta node holds the cluster CA's key,
// so a removed node can still mint certificates (for a new identity, not
// its revoked one) until the CA is re-keyed; nothing does that yet.

import (
	"context"
	"slices"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// keyRotateLoop is reconcileKeyRotations's state (runUserTokens's
// goroutine only).
type keyRotateLoop struct {
	// heldLogged: when the gate last logged a holdback.
	heldLogged time.Time
	// warned: when a refused or failed rotation was last logged as a
	// WARN (at most once a minute; the rest at DEBUG: a refusal such as
	// more than scm.MaxForcedRotations removed nodes repeats every round).
	warned time.Time
}

// warn logs a failed rotation at WARN at most once a minute.
func (l *keyRotateLoop) warn(s *Server, msg string, args ...any) {
	if time.Since(l.warned) >= time.Minute {
		l.warned = time.Now()
		s.log.Warn(msg, args...)
		return
	}
	s.log.Debug(msg, args...)
}

func newKeyRotateLoop() *keyRotateLoop { return &keyRotateLoop{} }

// olderVoter is the first other voter of group gid that answers
// ListMembers without forced_key_rotation (an older binary), 0 if none;
// voters that do not answer are skipped. Asked anew before every
// proposal (review nit 7: a cached answer would trust a voter rolled back
// since).
func (s *Server) olderVoter(ctx context.Context, gid uint64) uint64 {
	var ids []uint64
	for _, v := range s.group(gid).Voters() {
		if v != s.cfg.NodeID {
			ids = append(ids, v)
		}
	}
	if len(ids) == 0 {
		return 0
	}
	slices.Sort(ids)
	ctx, cancel := context.WithTimeout(ctx, min(s.cfg.ProposeTimeout, 3*time.Second))
	defer cancel()
	older := make([]bool, len(ids))
	done := make(chan struct{}, len(ids))
	for i, v := range ids {
		go func() {
			defer func() { done <- struct{}{} }()
			p, found := s.peer(v)
			if !found || p.GRPCAddr == "" {
				return
			}
			conn, err := grpc.NewClient(p.GRPCAddr, s.cfg.TLS.GRPCDialOption(pki.RoleMeta))
			if err != nil {
				return
			}
			defer conn.Close()
			r, err := metapb.NewMembersClient(conn).ListMembers(ctx, &metapb.ListMembersRequest{})
			switch {
			case status.Code(err) == codes.Unimplemented, err == nil && !r.GetForcedKeyRotation():
				older[i] = true
			}
		}()
	}
	for range ids {
		<-done
	}
	var first uint64
	for i, v := range ids {
		if older[i] && first == 0 {
			first = v
		}
	}
	return first
}

// testSkipKeyRotation stops every reconcileKeyRotations (tests: a leader
// that dies between the removal and the rotation).
var testSkipKeyRotation atomic.Bool

// keysRotatedFor reports whether this node's SCM and user-token states
// both record the forced rotation for removed meta node id.
func (s *Server) keysRotatedFor(id uint64) bool {
	return s.scmState != nil && s.scmState.KeysRotatedFor(id) && s.ut != nil && s.ut.keysRotatedFor(id)
}

// reconcileKeyRotations proposes the missing forced rotations for removed
// meta nodes in the groups this node leads (runUserTokens's goroutine
// only). Errors are logged and retried at the next round (an op refused
// because another leader's came first is followed by one for what is
// left); other refusals are not expected (more than
// scm.MaxForcedRotations removed nodes).
func (s *Server) reconcileKeyRotations(ctx context.Context, l *keyRotateLoop) {
	if testSkipKeyRotation.Load() || s.members == nil {
		return
	}
	scmLeads := s.scmGroup != nil && s.scmGroup.IsLeader() && s.scmState.Halt().Halted() == nil
	utLeads := s.utGroup != nil && s.utGroup.IsLeader() && s.ut.halt.Halted() == nil
	if !scmLeads && !utLeads {
		return
	}
	// One op per group covers every removed node pending (after an
	// upgrade: every node removed before it).
	var scmTodo, utTodo []uint64
	for _, m := range s.members.Table() {
		id := m.GetId()
		if !m.GetRemoved() {
			continue
		}
		needSCM := scmLeads && !s.scmState.KeysRotatedFor(id)
		needUT := utLeads && !s.ut.keysRotatedFor(id)
		if !needSCM && !needUT {
			continue
		}
		if g := s.stillInGroup(id); g != "" {
			continue // logged by the revocation reconciler
		}
		if needSCM {
			scmTodo = append(scmTodo, id)
		}
		if needUT {
			utTodo = append(utTodo, id)
		}
	}
	held := func(group string, gid uint64, todo []uint64) bool {
		v := s.olderVoter(ctx, gid)
		if v != 0 && time.Since(l.heldLogged) >= time.Minute {
			l.heldLogged = time.Now()
			s.log.Error("meta: the token keys of removed meta nodes are not rotated while a voter runs an older binary (its replica would halt at the rotation): upgrade every meta node",
				"group", group, "voter", v, "removed", todo)
		}
		return v != 0
	}
	if len(scmTodo) > 0 && held("scm", ScmGroup, scmTodo) {
		scmTodo = nil
	}
	if len(utTodo) > 0 && held("usertoken", UserTokenGroup, utTodo) {
		utTodo = nil
	}
	if len(scmTodo) > 0 {
		if err := s.scmMgr.RotateSecretKeysFor(ctx, scmTodo); err != nil && ctx.Err() == nil {
			l.warn(s, "meta: rotating the block token keys for removed meta nodes (retried)", "ids", scmTodo, "err", err)
		}
	}
	if len(utTodo) > 0 {
		if err := s.rotateUserTokenKeysFor(ctx, utTodo); err != nil && ctx.Err() == nil {
			l.warn(s, "meta: rotating the user-token keys for removed meta nodes (retried)", "ids", utTodo, "err", err)
		}
	}
}
