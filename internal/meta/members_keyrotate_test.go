package meta

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Short key durations: tokens live 3 s, keys sign 1 s after recording.
const (
	krLifetime = 3 * time.Second
	krDelay    = time.Second
	// krBound: how long after the removal the rotation may take.
	krBound = 5 * time.Second
)

func newKeyRotateCluster(t *testing.T) *cluster {
	return newClusterWith(t, 3, scm.Config{LoopInterval: 20 * time.Millisecond,
		SecretKeys: scm.SecretKeyConfig{TokenLifetime: krLifetime, ActivationDelay: krDelay}},
		func(cfg *Config) {
			cfg.UserTokens = UserTokenConfig{Lifetime: krLifetime, ActivationDelay: krDelay}
		})
}

// waitKeys waits until every server holds a block token key and a
// user-token key that sign now.
func waitKeys(t *testing.T, c *cluster) {
	t.Helper()
	waitFor(t, 20*time.Second, "block token and user-token keys on every node", func() bool {
		for _, s := range c.servers {
			if _, ok := s.scmState.TokenKeys().SigningKey(time.Now()); !ok || s.ut.signingKey(time.Now().UnixMilli()) == nil {
				return false
			}
		}
		return true
	})
}

// removeRow records member id and marks it removed (as RemoveMember does
// once the node left every group; here it never joined one).
func removeRow(t *testing.T, L *Server, id uint64) {
	t.Helper()
	for _, op := range []*metapb.MembersCommand{
		{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: id, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}},
		{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: id}},
	} {
		cmd, _ := marshalMembers(op)
		if _, err := propose(context.Background(), L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
}

func keyIDs(keys []*metapb.SecretKey) []uint64 {
	var ids []uint64
	for _, k := range keys {
		ids = append(ids, k.Id)
	}
	return ids
}

// forgedBlockToken is what a removed node holding key k can make: a
// write token for any block, valid for a day.
func forgedBlockToken(t *testing.T, k *metapb.SecretKey) []byte {
	t.Helper()
	ks, err := blocktoken.NewKeySet([]blocktoken.Key{{ID: k.Id, Secret: k.Secret}})
	if err != nil {
		t.Fatal(err)
	}
	tok, err := ks.Issue(time.Now(), blocktoken.Claims{Block: blocktoken.Block{Container: 7, Local: 7}, Modes: blocktoken.Write,
		ExpiryUnixMs: time.Now().Add(24 * time.Hour).UnixMilli(), Pipeline: 1})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// forgedUserToken: an admin user token signed with k, valid for a day.
func forgedUserToken(k *metapb.SecretKey) string {
	now := time.Now()
	return signUserToken(k, userToken{Admin: true, User: "mallory", Renewer: "mallory", Seq: 1 << 40, IssueMs: now.UnixMilli(),
		ExpiryMs: now.Add(24 * time.Hour).UnixMilli(), MaxMs: now.Add(24 * time.Hour).UnixMilli(), CertSerial: "0badc0de"})
}

// inFlight is a genuine token pair signed by the keys that sign now.
type inFlight struct {
	block    []byte
	user     string
	expiry   time.Time
	blockKey uint64
	userKey  uint64
}

func issueInFlight(t *testing.T, s *Server) inFlight {
	t.Helper()
	now := time.Now()
	tok, err := s.scmMgr.IssueToken(context.Background(), &metapb.BlockID{ContainerId: 3, LocalId: 4}, blocktoken.Read, "alice")
	if err != nil {
		t.Fatal(err)
	}
	c, err := blocktoken.Decode(tok)
	if err != nil {
		t.Fatal(err)
	}
	uk := s.ut.signingKey(now.UnixMilli())
	ut := signUserToken(uk, userToken{User: "alice", Renewer: "alice", Seq: 1 << 41, IssueMs: now.UnixMilli(),
		ExpiryMs: now.Add(krLifetime).UnixMilli(), MaxMs: now.Add(7 * 24 * time.Hour).UnixMilli(), CertSerial: "0a11ce"})
	return inFlight{block: tok, user: ut, expiry: now.Add(krLifetime - 100*time.Millisecond), blockKey: c.KeyID, userKey: uk.Id}
}

// check reports an error if a server refuses the tokens (before expiry).
func (f inFlight) check(t *testing.T, c *cluster, what string) {
	t.Helper()
	now := time.Now()
	if now.After(f.expiry) {
		return
	}
	for id, s := range c.servers {
		if _, err := s.scmState.TokenKeys().Verify(f.block, blocktoken.Block{Container: 3, Local: 4}, blocktoken.Read, now); err != nil {
			t.Fatalf("%s: node %d refuses a block token signed with key %d before its expiry: %v", what, id, f.blockKey, err)
		}
		if _, err := s.verifyUserToken(context.Background(), f.user, now); err != nil {
			t.Fatalf("%s: node %d refuses a user token signed with key %d before its expiry: %v", what, id, f.userKey, err)
		}
	}
}

// Removing a member rotates both key sets within a bound: a new block
// token key and user-token key are recorded on every node, every key
// present at the removal carries a retire time ≤ removal + lifetime +
// 2 × activation delay (+ the rotation's bound) and is dropped then, so
// tokens the removed node forges with them are refused from then on;
// each old key's retire time is exactly the new key's activation +
// lifetime + activation delay (review finding 3); the genuine tokens
// issued with the old keys (just before the removal, and just before the
// new keys activate, the old keys' last) verify on every node until they
// expire; ListMembers says "keys rotated".
func TestRemovedMemberRotatesKeys(t *testing.T) {
	c := newKeyRotateCluster(t)
	waitKeys(t, c)
	L := membersLeader(t, c)
	oldBlock := slices.Clone(L.scmState.SecretKeys())
	oldUser := slices.Clone(L.ut.Keys())
	forgedB := forgedBlockToken(t, oldBlock[len(oldBlock)-1])
	forgedU := forgedUserToken(oldUser[len(oldUser)-1])
	before := issueInFlight(t, L)
	removeRow(t, L, 9)
	removed := time.Now()
	waitFor(t, krBound, "the keys rotated for node 9 on every node", func() bool {
		for _, s := range c.servers {
			if !s.keysRotatedFor(9) {
				return false
			}
		}
		return true
	})
	t.Logf("rotated on every node %v after the removal", time.Since(removed).Round(time.Millisecond))
	// Each old key retires exactly at its group's new key's activation +
	// lifetime + activation delay (the delay: the clock-skew margin; both
	// groups use krLifetime and krDelay here), on every node.
	newKey := func(old, now []*metapb.SecretKey) *metapb.SecretKey {
		for _, k := range now {
			if !slices.Contains(keyIDs(old), k.Id) {
				return k
			}
		}
		return nil
	}
	for id, s := range c.servers {
		for _, set := range []struct {
			name     string
			old, now []*metapb.SecretKey
		}{{"block token", oldBlock, s.scmState.SecretKeys()}, {"user-token", oldUser, s.ut.Keys()}} {
			nk := newKey(set.old, set.now)
			if nk == nil {
				t.Fatalf("node %d: no new %s key: %v", id, set.name, keyIDs(set.now))
			}
			want := nk.ActivateUnixMs + (krLifetime + krDelay).Milliseconds()
			for _, k := range set.now {
				if k.Id != nk.Id && k.RetireUnixMs != want {
					t.Errorf("node %d: old %s key %d retires %v after the new key %d activates, want exactly %v (lifetime + activation delay)",
						id, set.name, k.Id, time.Duration(k.RetireUnixMs-nk.ActivateUnixMs)*time.Millisecond, nk.Id, krLifetime+krDelay)
				}
			}
		}
	}
	// The old keys sign until the new ones activate: a pair issued at the
	// last moment (just before the earlier of the two activations) must
	// be an old-key pair and live to its expiry.
	nb, nu := newKey(oldBlock, L.scmState.SecretKeys()), newKey(oldUser, L.ut.Keys())
	time.Sleep(time.Until(time.UnixMilli(min(nb.ActivateUnixMs, nu.ActivateUnixMs)).Add(-200 * time.Millisecond)))
	after := issueInFlight(t, L)
	if after.blockKey != before.blockKey || after.userKey != before.userKey {
		t.Fatalf("the pair issued just before the new keys activate is signed with keys %d, %d, want the old %d, %d",
			after.blockKey, after.userKey, before.blockKey, before.userKey)
	}
	limit := removed.Add(krLifetime + 2*krDelay + krBound).UnixMilli()
	floor := removed.Add(krLifetime + krDelay).UnixMilli()
	for id, s := range c.servers {
		for _, set := range []struct {
			name     string
			old, now []*metapb.SecretKey
		}{{"block token", oldBlock, s.scmState.SecretKeys()}, {"user-token", oldUser, s.ut.Keys()}} {
			if len(set.now) != len(set.old)+1 {
				t.Fatalf("node %d: %s keys %v after the rotation, want %v and one new", id, set.name, keyIDs(set.now), keyIDs(set.old))
			}
			for _, k := range set.now {
				isOld := slices.Contains(keyIDs(set.old), k.Id)
				switch {
				case isOld && (k.RetireUnixMs < floor || k.RetireUnixMs > limit):
					t.Errorf("node %d: old %s key %d retires at %v, want in [removal + %v, removal + %v]", id, set.name, k.Id,
						time.UnixMilli(k.RetireUnixMs).Sub(removed), krLifetime+krDelay, krLifetime+2*krDelay+krBound)
				case !isOld && k.RetireUnixMs != 0:
					t.Errorf("node %d: the new %s key %d has a retire time", id, set.name, k.Id)
				case !isOld && k.ActivateUnixMs < removed.UnixMilli()+krDelay.Milliseconds():
					t.Errorf("node %d: the new %s key %d activates %v after the removal, want ≥ %v", id, set.name, k.Id,
						time.UnixMilli(k.ActivateUnixMs).Sub(removed), krDelay)
				}
			}
		}
	}
	aconn, err := grpc.NewClient(L.GRPCAddr(), clientDial()...)
	if err != nil {
		t.Fatal(err)
	}
	defer aconn.Close()
	lm, err := metapb.NewMembersClient(aconn).ListMembers(context.Background(), &metapb.ListMembersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range lm.GetMembers() {
		if m.GetKeysRotated() != (m.GetId() == 9) {
			t.Errorf("ListMembers row %v: keys_rotated %v", m.GetId(), m.GetKeysRotated())
		}
	}
	// The genuine tokens verify until they expire; the keys go at their
	// retire time (+ a loop round), and the forged tokens with them.
	retire := time.UnixMilli(limit)
	for time.Now().Before(after.expiry) {
		before.check(t, c, "issued before the removal")
		after.check(t, c, "issued after the rotation")
		time.Sleep(50 * time.Millisecond)
	}
	waitFor(t, time.Until(retire)+3*time.Second, "the old keys dropped on every node", func() bool {
		for _, s := range c.servers {
			for _, k := range keyIDs(oldBlock) {
				if s.scmState.TokenKeys().Has(k) {
					return false
				}
			}
			for _, k := range keyIDs(oldUser) {
				if s.ut.key(k) != nil {
					return false
				}
			}
		}
		return true
	})
	t.Logf("old keys dropped %v after the removal", time.Since(removed).Round(time.Millisecond))
	for id, s := range c.servers {
		if _, err := s.scmState.TokenKeys().Verify(forgedB, blocktoken.Block{Container: 7, Local: 7}, blocktoken.Write, time.Now()); err == nil {
			t.Errorf("node %d accepts a block token forged with an old key", id)
		}
		if _, err := s.verifyUserToken(context.Background(), forgedU, time.Now()); err == nil {
			t.Errorf("node %d accepts a user token forged with an old key", id)
		}
	}
}

// The crash point: the removal commits, the leader of SCM and of the
// user-token group dies before it rotates; the next leaders rotate, once
// per group for both removed nodes, and a second forced op for a member
// is refused by Apply.
func TestKeyRotationAfterLeaderCrash(t *testing.T) {
	c := newKeyRotateCluster(t)
	waitKeys(t, c)
	L := membersLeader(t, c)
	testSkipKeyRotation.Store(true)
	defer testSkipKeyRotation.Store(false)
	nBlock, nUser := len(L.scmState.SecretKeys()), len(L.ut.Keys())
	removeRow(t, L, 9)
	removeRow(t, L, 10)
	waitFor(t, 10*time.Second, "nodes 9 and 10 removed in every table", func() bool {
		for _, s := range c.servers {
			if !s.members.Removed(9) || !s.members.Removed(10) {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * time.Second) // two reconciler rounds
	for id, s := range c.servers {
		if s.scmState.KeysRotatedFor(9) || s.ut.keysRotatedFor(9) {
			t.Fatalf("node %d rotated for node 9 with rotations stopped", id)
		}
	}
	// The SCM leader (the user-token group's follows the namespace
	// leader, as SCM's: usually the same node) dies.
	var dead uint64
	waitFor(t, 10*time.Second, "an SCM leader", func() bool {
		for id, s := range c.servers {
			if s.scmGroup.IsLeader() {
				dead = id
				return true
			}
		}
		return false
	})
	c.servers[dead].Close()
	testSkipKeyRotation.Store(false)
	var live *Server
	waitFor(t, 20*time.Second, "the keys rotated for node 9 by the next leaders", func() bool {
		for id, s := range c.servers {
			if id == dead {
				continue
			}
			live = s
			if !s.keysRotatedFor(9) || !s.keysRotatedFor(10) {
				return false
			}
		}
		return true
	})
	// A few more reconciler rounds: still one rotation per group (for
	// both removed nodes).
	time.Sleep(2 * time.Second)
	if n := len(live.scmState.SecretKeys()); n != nBlock+1 {
		t.Errorf("%d block token keys, want %d (one rotation)", n, nBlock+1)
	}
	if n := len(live.ut.Keys()); n != nUser+1 {
		t.Errorf("%d user-token keys, want %d (one rotation)", n, nUser+1)
	}
	// A second forced op for the member (a leader that did not see the
	// first applied yet) is refused whole.
	var sl *Server
	waitFor(t, 10*time.Second, "an SCM leader among the live nodes", func() bool {
		for id, s := range c.servers {
			if id != dead && s.scmGroup.IsLeader() {
				sl = s
				return true
			}
		}
		return false
	})
	cmd := &metapb.ScmCommand{Op: &metapb.ScmCommand_ForcedKeyRotation{ForcedKeyRotation: &metapb.ForcedKeyRotationOp{Members: []uint64{9}, RetireUnixMs: 1,
		Add: &metapb.SecretKey{Id: 1000, Secret: make([]byte, blocktoken.SecretSize), CreatedUnixMs: 1, ActivateUnixMs: 1}}}}
	b, _ := proto.Marshal(cmd)
	v, err := (&scmRaft{s: sl}).Propose(context.Background(), b)
	if err == nil {
		err, _ = v.(error)
	}
	if err == nil || len(sl.scmState.SecretKeys()) != nBlock+1 {
		t.Fatalf("a second forced rotation for node 9: %v, %d keys; want refused, %d keys", err, len(sl.scmState.SecretKeys()), nBlock+1)
	}
}

// The user-token state records a forced rotation durably: the old keys'
// retire time and the member survive a reopen; a second op for the
// member is refused whole, as one without a key.
func TestUTStateForcedRotationReloads(t *testing.T) {
	dir := t.TempDir()
	opts := store.Options{SyncInterval: -1, Logger: quiet}
	st, err := openUTState(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UnixMilli()
	forced := func(id uint64, member uint64) *metapb.UserTokenCommand {
		add := utKeyCmd(now, id, now+1000).GetKeys().Add
		return &metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_ForcedKeyRotation{ForcedKeyRotation: &metapb.ForcedKeyRotationOp{
			Add: add, Members: []uint64{member}, RetireUnixMs: now + 5000}}}
	}
	res := utApply(t, st, 1, utKeyCmd(now, 1, now), forced(2, 9), forced(3, 9),
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_ForcedKeyRotation{ForcedKeyRotation: &metapb.ForcedKeyRotationOp{Members: []uint64{8}, RetireUnixMs: 1}}})
	if res[1] != nil || status.Code(res[2].(error)) != codes.AlreadyExists || status.Code(res[3].(error)) != codes.InvalidArgument {
		t.Fatalf("results %v", res)
	}
	st.Close()
	if st, err = openUTState(dir, opts); err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !st.keysRotatedFor(9) || st.keysRotatedFor(8) || st.keyRetire(1) != now+5000 || st.keyRetire(2) != 0 || st.key(3) != nil {
		t.Fatalf("reopened: rotated for 9 %v, for 8 %v, key 1 retires %d, key 2 %d, keys %v", st.keysRotatedFor(9), st.keysRotatedFor(8),
			st.keyRetire(1), st.keyRetire(2), keyIDs(st.Keys()))
	}
}

// A user token signed with a key a removed node held is not renewed past
// that key's retire time (the key is gone then, and the token with it):
// the renewal answers the capped expiry, so the client knows to get a
// new token. Lifetime 1 h: without the cap a renewal 3 s after the
// rotation would answer an expiry past the retire time.
func TestRenewalCappedAtKeyRetire(t *testing.T) {
	c := newClusterWith(t, 3, scm.Config{LoopInterval: 20 * time.Millisecond}, func(cfg *Config) {
		cfg.UserTokens = UserTokenConfig{Lifetime: time.Hour, ActivationDelay: krDelay}
	})
	waitKeys(t, c)
	L := membersLeader(t, c)
	now := time.Now()
	old := L.ut.signingKey(now.UnixMilli())
	tok := signUserToken(old, userToken{User: "alice", Renewer: "alice", Seq: 1 << 42, IssueMs: now.UnixMilli(),
		ExpiryMs: now.Add(time.Hour).UnixMilli(), MaxMs: now.Add(7 * 24 * time.Hour).UnixMilli(), CertSerial: "0a11ce"})
	removeRow(t, L, 9)
	var retire int64
	waitFor(t, krBound, "the user-token keys rotated for node 9", func() bool {
		for _, s := range c.servers {
			if !s.ut.keysRotatedFor(9) {
				return false
			}
		}
		retire = L.ut.keyRetire(old.Id)
		return retire != 0
	})
	// Renew once now + Lifetime is past the retire time.
	time.Sleep(time.Until(time.UnixMilli(retire).Add(-time.Hour + 500*time.Millisecond)))
	var ut *Server
	waitFor(t, 10*time.Second, "a user-token leader", func() bool {
		for _, s := range c.servers {
			if s.utGroup.IsLeader() {
				ut = s
				return true
			}
		}
		return false
	})
	ctx := namespace.WithCaller(context.Background(), namespace.Caller{User: "alice"})
	resp, err := (&userTokenServer{s: ut}).RenewUserToken(ctx, &metapb.RenewUserTokenRequest{Token: tok})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetExpiryUnixMs() != retire {
		t.Fatalf("renewed until %v, want the old key's retire time %v", time.UnixMilli(resp.GetExpiryUnixMs()).UTC(), time.UnixMilli(retire).UTC())
	}
}

// oldMembers is the Members service of a meta node on a binary without
// forced key rotations: ListMembers answers without the flag.
type oldMembers struct {
	metapb.UnimplementedMembersServer
}

func (oldMembers) ListMembers(context.Context, *metapb.ListMembersRequest) (*metapb.ListMembersResponse, error) {
	return &metapb.ListMembersResponse{NodeId: 2}, nil
}

// A voter on an older binary (its ListMembers answers without
// forced_key_rotation) holds the rotation back: its replica would halt
// at the entry. Once it answers with the flag (upgraded), the rotation
// goes through.
func TestKeyRotationUpgradeGate(t *testing.T) {
	c := newKeyRotateCluster(t)
	waitKeys(t, c)
	L := membersLeader(t, c)
	var other uint64
	waitFor(t, 10*time.Second, "a node that leads neither SCM nor the user-token group", func() bool {
		for id, s := range c.servers {
			if !s.scmGroup.IsLeader() && !s.utGroup.IsLeader() && s.nsGroup.Leader() != id {
				other = id
				return true
			}
		}
		return false
	})
	upgrade := olderVoter(t, c, other)
	removeRow(t, L, 9)
	time.Sleep(3 * time.Second) // three reconciler rounds
	for id, s := range c.servers {
		if s.scmState.KeysRotatedFor(9) || s.ut.keysRotatedFor(9) {
			t.Fatalf("node %d: the keys were rotated with node %d on an older binary", id, other)
		}
	}
	upgrade()
	waitFor(t, krBound, "the keys rotated for node 9 once node "+fmt.Sprint(other)+" is upgraded", func() bool {
		for _, s := range c.servers {
			if !s.keysRotatedFor(9) {
				return false
			}
		}
		return true
	})
}

// TestForcedRotationHaltsOlderReplica (review finding 1): a user-token
// replica whose binary does not know the forced rotation (hidden: the
// UserTokenCommand ops this release added) applies the entries before it
// and halts at the command the leader builds (forcedUTKeysCmd), nothing
// of it applied; a replica that knows the op applies it. Before, the
// rotation was two fields of UserTokenKeysOp, which an older binary
// skipped: it applied a plain key addition and diverged. (The SCM side:
// scm.TestForcedRotationHaltsOlderReplica.)
func TestForcedRotationHaltsOlderReplica(t *testing.T) {
	newOps := []int32{6} // UserTokenCommand ops unknown to the release before
	opts := store.Options{SyncInterval: -1, Logger: quiet}
	now := time.Now()
	first := utKeyCmd(now.UnixMilli(), 1, now.UnixMilli())
	forced, err := forcedUTKeysCmd(UserTokenConfig{}.withDefaults(), now, []*metapb.SecretKey{first.GetKeys().Add}, []uint64{9})
	if err != nil {
		t.Fatal(err)
	}
	old, err := openUTState(t.TempDir(), opts, newOps...)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	res := utApply(t, old, 1, first, forced)
	h := old.halt.Halted()
	if res[0] != nil || h == nil || h.Index != 2 || h.Op != newOps[0] || !errors.Is(res[1].(error), applyhalt.ErrHalted) {
		t.Fatalf("older replica: results %v, halt %+v (want a halt at entry 2, op %d)", res, h, newOps[0])
	}
	if old.keysRotatedFor(9) || len(old.Keys()) != 1 || old.keyRetire(1) != 0 || old.AppliedIndex() != 1 {
		t.Fatalf("older replica applied part of the rotation: rotated for 9 %v, keys %v, applied %d", old.keysRotatedFor(9), keyIDs(old.Keys()), old.AppliedIndex())
	}
	cur, err := openUTState(t.TempDir(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.Close()
	if res := utApply(t, cur, 1, first, forced); res[0] != nil || res[1] != nil || cur.halt.Halted() != nil || !cur.keysRotatedFor(9) || cur.keyRetire(1) == 0 {
		t.Fatalf("current replica: results %v, halt %+v, rotated for 9 %v", res, cur.halt.Halted(), cur.keysRotatedFor(9))
	}
}

// A voter that answered with the flag once (the rotation for node 9 went
// through) and then runs an older binary again (rolled back) holds the
// next rotation (node 10) back: the gate asks before every proposal
// (review nit 7: a cached answer trusted it, and before finding 1's fix
// its replica then applied half of the op).
func TestKeyRotationGateReprobes(t *testing.T) {
	c := newKeyRotateCluster(t)
	waitKeys(t, c)
	L := membersLeader(t, c)
	var other uint64
	waitFor(t, 10*time.Second, "a node that leads neither SCM nor the user-token group", func() bool {
		for id, s := range c.servers {
			if !s.scmGroup.IsLeader() && !s.utGroup.IsLeader() && s.nsGroup.Leader() != id {
				other = id
				return true
			}
		}
		return false
	})
	rotated := func(id uint64) func() bool {
		return func() bool {
			for _, s := range c.servers {
				if !s.keysRotatedFor(id) {
					return false
				}
			}
			return true
		}
	}
	removeRow(t, L, 9)
	waitFor(t, krBound, "the keys rotated for node 9", rotated(9))
	upgrade := olderVoter(t, c, other)
	removeRow(t, L, 10)
	time.Sleep(3 * time.Second) // three reconciler rounds
	for id, s := range c.servers {
		if s.scmState.KeysRotatedFor(10) || s.ut.keysRotatedFor(10) {
			t.Fatalf("node %d: the keys were rotated for node 10 with node %d rolled back to an older binary", id, other)
		}
	}
	upgrade()
	waitFor(t, krBound, "the keys rotated for node 10 once node "+fmt.Sprint(other)+" is upgraded again", rotated(10))
}

// The Go client, holding a token signed with a key that a forced rotation
// retires, replaces it with a token of the new key well before the
// retire time (review finding 4): a renewal answered capped (or that
// extends it by less than half its lifetime) is final. Before, the client
// renewed the capped token at three quarters of what was left, ever more
// often, and got a new token only once it expired at the retire time.
func TestClientReplacesCappedToken(t *testing.T) {
	const life = 4 * time.Second
	c := newUTCluster(t, 1, UserTokenConfig{Lifetime: life, ActivationDelay: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	waitKeys(t, c)
	ak := s3Key(t, c, "alice")
	cl := c.keyClient(ak.AccessKeyId, ak.SecretAccessKey)
	keyOf := func(tok string) uint64 {
		t.Helper()
		parts, err := metaclient.DecodeTokenURL(tok)
		if err != nil {
			t.Fatal(err)
		}
		ut, err := parseUserToken(parts.Identifier)
		if err != nil {
			t.Fatal(err)
		}
		return ut.KeyID
	}
	first, err := cl.Token(ctx)
	mustOK(t, "first token", err)
	s := c.servers[1]
	removeRow(t, membersLeader(t, c), 9)
	var retire time.Time
	waitFor(t, krBound, "the user-token keys rotated for node 9", func() bool {
		r := s.ut.keyRetire(keyOf(first))
		retire = time.UnixMilli(r)
		return r != 0
	})
	for time.Now().Before(retire) {
		tok, err := cl.Token(ctx)
		mustOK(t, "token", err)
		if tok != first {
			if keyOf(tok) == keyOf(first) {
				t.Fatalf("replaced by another token of the retiring key %d", keyOf(tok))
			}
			if left := time.Until(retire); left < 500*time.Millisecond {
				t.Fatalf("replaced only %v before the old key's retire time", left)
			}
			t.Logf("replaced %v before the old key's retire time", time.Until(retire).Round(time.Millisecond))
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("the client still held its token of the retiring key at the key's retire time")
}

// olderVoter stands in for node other running an older binary, as the
// other nodes see it: they reach its Members service at a server that
// answers ListMembers without forced_key_rotation (oldMembers). upgrade
// points them back at the real node.
func olderVoter(t *testing.T, c *cluster, other uint64) (upgrade func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	old := grpc.NewServer(nodeCreds(other).GRPCServerOption())
	metapb.RegisterMembersServer(old, oldMembers{})
	go old.Serve(lis)
	t.Cleanup(old.Stop)
	setOther := func(grpcAddr string) {
		for id, s := range c.servers {
			if id != other {
				s.SetPeer(other, Peer{RaftAddr: c.servers[other].RaftAddr(), GRPCAddr: grpcAddr})
			}
		}
	}
	setOther(lis.Addr().String())
	return func() { setOther(c.servers[other].GRPCAddr()) }
}
