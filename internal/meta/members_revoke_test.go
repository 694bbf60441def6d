package meta

import (
	"context"
	"crypto/tls"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// refusedHandshake dials addr with creds (TLS, as a meta node) and
// reports the error of the first read: a server that refuses the
// client's certificate answers with a TLS alert (TLS 1.3: after the
// client's side of the handshake is done).
func refusedHandshake(addr string, creds *pki.Credentials) error {
	conn, err := tls.Dial("tcp", addr, creds.ClientTLS(pki.RoleMeta))
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(3 * time.Second))
	_, err = conn.Read(make([]byte, 1))
	return err
}

// 3 → 4 → remove 4: RemoveMember revokes node 4's identity on every
// remaining node (its certificate was never recorded by the CA, as an
// initial member's made offline), its raft and gRPC connections are
// closed, a new handshake with its certificate is refused, and the
// cluster still commits.
func TestRemoveMemberRevokes(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	L := membersLeader(t, c)
	ctx := context.Background()
	peers := map[uint64]Peer{}
	for id, s := range c.servers {
		peers[id] = Peer{RaftAddr: s.RaftAddr(), GRPCAddr: s.GRPCAddr()}
	}
	creds4 := nodeCreds(4)
	n4, err := New(Config{NodeID: 4, DataDir: filepath.Join(c.dir, "4"), Peers: peers, Join: true, TLS: creds4, Admins: testAdmins,
		TickInterval: 20 * time.Millisecond, ElectionTicks: 10, Logger: quiet, CA: testCA(), CAKeySecret: testSealSecret})
	if err != nil {
		t.Fatal(err)
	}
	if err := n4.Start(); err != nil {
		t.Fatal(err)
	}
	defer n4.Close()
	aconn, err := grpc.NewClient(L.GRPCAddr(), clientDial()...)
	if err != nil {
		t.Fatal(err)
	}
	defer aconn.Close()
	admin := metapb.NewMembersClient(aconn)
	if _, err := admin.AddMember(ctx, &metapb.AddMemberRequest{Id: 4, RaftAddr: n4.RaftAddr(), GrpcAddr: n4.GRPCAddr()}); err != nil {
		t.Fatalf("AddMember 4: %v", err)
	}
	waitFor(t, 20*time.Second, "node 4 a voter of every group, with the CA", func() bool {
		for _, g := range metaGroups {
			if !slices.Contains(n4.group(g.id).Voters(), 4) {
				return false
			}
		}
		ca, _, _ := n4.ca.state.CA()
		return ca != nil
	})
	// Node 4's connections: raft (every remaining node) and a gRPC one of
	// its certificate to the members leader.
	conn4, err := grpc.NewClient(L.GRPCAddr(), creds4.GRPCDialOption(pki.RoleMeta))
	if err != nil {
		t.Fatal(err)
	}
	defer conn4.Close()
	as4 := metapb.NewMembersClient(conn4)
	if _, err := as4.ListMembers(ctx, &metapb.ListMembersRequest{}); err != nil {
		t.Fatalf("ListMembers with node 4's certificate: %v", err)
	}
	id4 := metaIdentity(4)
	// The members leader sends node 4 the members group's heartbeats
	// (its own raft connection) and serves conn4: both watched. The
	// other nodes talk to node 4 only where they lead a group.
	waitFor(t, 10*time.Second, "node 4's raft and gRPC connections to the members leader", func() bool {
		return L.cfg.TLS.WatchedOf(id4) >= 2
	})
	resp, err := admin.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: 4})
	if err != nil {
		t.Fatalf("RemoveMember 4: %v", err)
	}
	removed := time.Now()
	if !resp.GetMember().GetRemoved() || !resp.GetMember().GetRevoked() {
		t.Fatalf("RemoveMember 4: %v, want removed and revoked", resp.GetMember())
	}
	const bound = 5 * time.Second
	waitFor(t, bound, "node 4 revoked on every node, its connections closed", func() bool {
		for _, s := range c.servers {
			if !s.identityRevoked(4) || !s.cfg.TLS.IsRevoked(creds4.Leaf()) || s.cfg.TLS.WatchedOf(id4) != 0 {
				return false
			}
		}
		return conn4.GetState() != connectivity.Ready
	})
	t.Logf("node 4's connections closed on every node %v after RemoveMember returned", time.Since(removed).Round(time.Millisecond))
	for id, s := range c.servers {
		for _, addr := range []string{s.RaftAddr(), s.GRPCAddr()} {
			if err := refusedHandshake(addr, creds4); err == nil || !strings.Contains(err.Error(), "bad certificate") {
				t.Errorf("node %d at %s: a handshake with node 4's certificate: %v, want refused (bad certificate)", id, addr, err)
			}
		}
		// Another certificate of node 4 (made offline) too.
		if err := refusedHandshake(s.GRPCAddr(), nodeCreds(4)); err == nil || !strings.Contains(err.Error(), "bad certificate") {
			t.Errorf("node %d: a new certificate of node 4: %v, want refused", id, err)
		}
	}
	// Another identity's handshake passes TLS (gRPC then closes the raw
	// connection: no HTTP/2 preface).
	if err := refusedHandshake(L.GRPCAddr(), nodeCreds(5)); err != nil && strings.Contains(err.Error(), "bad certificate") {
		t.Errorf("a handshake of node 5's certificate: %v", err)
	}
	lm, err := admin.ListMembers(ctx, &metapb.ListMembersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range lm.GetMembers() {
		if m.GetId() == 4 && (!m.GetRemoved() || !m.GetRevoked()) {
			t.Errorf("ListMembers row of node 4: %v", m)
		}
	}
	// The cluster still commits: a row in the members group, a token in
	// the CA group.
	cmd, _ := marshalMembers(&metapb.MembersCommand{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: 5, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}})
	if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
		t.Fatalf("members group after the removal: %v", err)
	}
	if _, err := metapb.NewCaClient(aconn).CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{Role: string(pki.RoleMeta), IdentityId: "5"}); err != nil {
		t.Fatalf("CA group after the removal: %v", err)
	}
}

// The crash point: the removal commits, the CA group's leader dies before
// it revokes; the next CA leader revokes the removed node.
func TestRevocationAfterLeaderCrash(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	L := membersLeader(t, c)
	ctx := context.Background()
	testSkipRevoke.Store(true)
	defer testSkipRevoke.Store(false)
	for _, op := range []*metapb.MembersCommand{
		{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}},
		{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: 9}},
	} {
		cmd, _ := marshalMembers(op)
		if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "node 9 removed in every table", func() bool {
		for _, s := range c.servers {
			if !s.members.Removed(9) {
				return false
			}
		}
		return true
	})
	time.Sleep(3 * L.electionTimeout())
	for id, s := range c.servers {
		if s.identityRevoked(9) {
			t.Fatalf("node %d revoked node 9 with revocations stopped", id)
		}
	}
	var dead uint64
	waitFor(t, 10*time.Second, "a CA leader", func() bool {
		if l := c.caLeader(); l != nil {
			dead = l.cfg.NodeID
			return true
		}
		return false
	})
	c.servers[dead].Close()
	testSkipRevoke.Store(false)
	creds9 := nodeCreds(9)
	waitFor(t, 20*time.Second, "node 9 revoked by the next CA leader", func() bool {
		for id, s := range c.servers {
			if id != dead && (!s.identityRevoked(9) || !s.cfg.TLS.IsRevoked(creds9.Leaf())) {
				return false
			}
		}
		return true
	})
}

// countingHandler counts log records whose message contains sub.
type countingHandler struct {
	sub string
	n   *atomic.Int64
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.sub) {
		h.n.Add(1)
	}
	return nil
}
func (h countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countingHandler) WithGroup(string) slog.Handler      { return h }

// A row marked removed while the node is still a voter (the corner of an
// AddNode applied after a RemoveMember that saw "already removed"; here
// the row is written directly, for a stopped node, so that the others
// lead every group): the reconciler does not revoke a voter (it logs
// that, rate-limited), and revokes it once a RemoveMember has taken it
// out of every group.
func TestReconcilerSkipsAVoter(t *testing.T) {
	var skips atomic.Int64
	log := slog.New(countingHandler{sub: "still a member of a meta group", n: &skips})
	c := newCACluster(t, 3, func(cfg *Config) { cfg.Logger = log })
	waitCA(t, c)
	L := membersLeader(t, c)
	ctx := context.Background()
	var v *Server
	for id, s := range c.servers {
		if id != L.cfg.NodeID && (v == nil || !s.ca.group.IsLeader()) {
			v = s
		}
	}
	vid := v.cfg.NodeID
	v.Close()
	for _, op := range []*metapb.MembersCommand{
		{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: vid, RaftAddr: v.RaftAddr(), GrpcAddr: v.GRPCAddr()}}},
		{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: vid}},
	} {
		cmd, _ := marshalMembers(op)
		if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "the row removed on the members leader", func() bool { return L.members.Removed(vid) })
	time.Sleep(5 * L.electionTimeout())
	for id, s := range c.servers {
		if id != vid && s.identityRevoked(vid) {
			t.Fatalf("node %d revoked node %d, a voter of every meta group", id, vid)
		}
	}
	// Once per minute per ID on each CA leader, not every election
	// timeout.
	if n := skips.Load(); n == 0 || n > 2 {
		t.Errorf("the skip was logged %d times in %v, want at most once per CA leader", n, 5*L.electionTimeout())
	}
	aconn, err := grpc.NewClient(L.GRPCAddr(), clientDial()...)
	if err != nil {
		t.Fatal(err)
	}
	defer aconn.Close()
	admin := metapb.NewMembersClient(aconn)
	var resp *metapb.MemberChangeResponse
	waitFor(t, 30*time.Second, "RemoveMember of the voter", func() bool {
		resp, err = admin.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: vid})
		if err != nil {
			t.Logf("RemoveMember %d: %v", vid, err)
			time.Sleep(500 * time.Millisecond)
		}
		return err == nil
	})
	if !resp.GetMember().GetRevoked() {
		waitFor(t, 10*time.Second, "the removed node revoked", func() bool { return L.identityRevoked(vid) })
	}
	for _, mg := range metaGroups {
		if slices.Contains(L.group(mg.id).Voters(), vid) {
			t.Fatalf("node %d still a voter of the %s group", vid, mg.name)
		}
	}
}

// The CA refuses the revocation (its revoked list is full): the
// reconciler backs off (doubling, up to a minute) instead of appending a
// refused entry to the CA group's log every election timeout.
func TestReconcilerBacksOffWhenRefused(t *testing.T) {
	old := maxRevocations
	maxRevocations = 0
	t.Cleanup(func() { maxRevocations = old }) // after the cluster's cleanup
	var refusals atomic.Int64
	log := slog.New(countingHandler{sub: "the CA refused to revoke", n: &refusals})
	c := newCACluster(t, 3, func(cfg *Config) { cfg.Logger = log })
	waitCA(t, c)
	L := membersLeader(t, c)
	ctx := context.Background()
	for _, op := range []*metapb.MembersCommand{
		{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}},
		{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: 9}},
	} {
		cmd, _ := marshalMembers(op)
		if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "a refused revocation", func() bool { return refusals.Load() > 0 })
	start := refusals.Load()
	d := 15 * L.electionTimeout()
	time.Sleep(d)
	// Every election timeout: 15 more. Backed off from 2 election
	// timeouts, doubling: 3 more (at 2, 6 and 14).
	if n := refusals.Load() - start; n > 5 {
		t.Fatalf("%d refused revocations in %v (election timeout %v): not backed off", n, d, L.electionTimeout())
	}
	for _, s := range c.servers {
		if s.identityRevoked(9) {
			t.Fatal("node 9 revoked with a full list")
		}
	}
}

// RemoveMember waits for the revocation without the membership lock: a
// slow CA leader (here: revocations stopped) holds up that call only,
// not the next membership change.
func TestRemoveMemberWaitsForRevocationUnlocked(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	L := membersLeader(t, c)
	ctx := context.Background()
	testSkipRevoke.Store(true)
	defer testSkipRevoke.Store(false)
	cmd, _ := marshalMembers(&metapb.MembersCommand{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}})
	if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
		t.Fatal(err)
	}
	aconn, err := grpc.NewClient(L.GRPCAddr(), clientDial()...)
	if err != nil {
		t.Fatal(err)
	}
	defer aconn.Close()
	admin := metapb.NewMembersClient(aconn)
	type result struct {
		resp *metapb.MemberChangeResponse
		err  error
	}
	removed := make(chan result, 1)
	go func() {
		r, err := admin.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: 9})
		removed <- result{r, err}
	}()
	waitFor(t, 10*time.Second, "node 9's row removed", func() bool { return L.members.Removed(9) })
	// RemoveMember now waits for a revocation that does not come (up to
	// 5 s); another membership call takes the lock meanwhile.
	start := time.Now()
	_, err = admin.AddMember(ctx, &metapb.AddMemberRequest{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"})
	took := time.Since(start)
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("AddMember of removed node 9: %v, want FailedPrecondition", err)
	}
	if took > 2*time.Second {
		t.Fatalf("AddMember took %v while RemoveMember waited for the revocation (blocked by it)", took)
	}
	select {
	case r := <-removed:
		t.Fatalf("RemoveMember returned (%v, %v) before AddMember (%v): the test did not overlap them", r.resp, r.err, took)
	default:
	}
	r := <-removed
	if r.err != nil || !r.resp.GetMember().GetRemoved() || r.resp.GetMember().GetRevoked() {
		t.Fatalf("RemoveMember 9 with revocations stopped: %v, %v; want removed, not revoked", r.resp, r.err)
	}
}
