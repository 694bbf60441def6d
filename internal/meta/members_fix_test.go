package meta

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/vfs"
)

// membersLeader waits for the members group's leader.
func membersLeader(t *testing.T, c *cluster) *Server {
	t.Helper()
	var l *Server
	waitFor(t, 10*time.Second, "a members leader", func() bool {
		for _, s := range c.servers {
			if s.memGroup != nil && s.memGroup.IsLeader() {
				l = s
				return true
			}
		}
		return false
	})
	return l
}

// An add interrupted after the members group (the review's probe), the
// joined node restarted without --join, the add finished: every group
// has the same voters on every node. Before the joined marker, node 4
// bootstrapped its fresh groups locally with --peers ∪ table as voters.
func TestMembersInterruptedAddRestart(t *testing.T) {
	c := newCluster(t, 3, scm.Config{})
	L := membersLeader(t, c)
	ctx := context.Background()
	peers := map[uint64]Peer{}
	for id, s := range c.servers {
		peers[id] = Peer{RaftAddr: s.RaftAddr(), GRPCAddr: s.GRPCAddr()}
	}
	cfg := Config{NodeID: 4, DataDir: filepath.Join(c.dir, "4"), Peers: peers, Join: true, TLS: nodeCreds(4), Admins: testAdmins,
		TickInterval: 20 * time.Millisecond, ElectionTicks: 10, Logger: quiet}
	n4, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := n4.Start(); err != nil {
		t.Fatal(err)
	}
	for _, m := range []*metapb.MemberInfo{
		{Id: 4, RaftAddr: n4.RaftAddr(), GrpcAddr: n4.GRPCAddr()},
		{Id: 5, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}, // a row in no group
	} {
		cmd, _ := marshalMembers(&metapb.MembersCommand{Op: &metapb.MembersCommand_SetMember{SetMember: m}})
		if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := L.changeGroup(ctx, MembersGroup, 4, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "node 4 has its row", func() bool { return n4.members.Get(4) != nil })
	cfg.RaftAddr, cfg.GRPCAddr = n4.RaftAddr(), n4.GRPCAddr()
	n4.Close()
	cfg.Join = false // as the CLI forces once raft/ exists
	if n4, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	defer n4.Close()
	if err := n4.Start(); err != nil {
		t.Fatal(err)
	}
	if v := n4.nsGroup.Voters(); len(v) != 0 {
		t.Errorf("restarted joined node 4 bootstrapped the namespace group with voters %v (the group's are %v)", v, L.nsGroup.Voters())
	}
	for _, g := range metaGroups {
		if g.id == MembersGroup {
			continue
		}
		waitFor(t, 20*time.Second, "finishing the add", func() bool {
			_, err := L.changeGroup(ctx, g.id, 4, false)
			return err == nil
		})
	}
	all := []*Server{n4}
	for _, s := range c.servers {
		all = append(all, s)
	}
	for _, g := range metaGroups {
		waitFor(t, 20*time.Second, "voters equal on every node", func() bool {
			want := []uint64{1, 2, 3, 4}
			for _, s := range all {
				if v := slices.Sorted(slices.Values(s.group(g.id).Voters())); !slices.Equal(v, want) {
					return false
				}
			}
			return true
		})
	}
	for _, g := range metaGroups {
		for _, s := range all {
			if v := s.group(g.id).Voters(); len(v) != 4 {
				t.Errorf("group %s on node %d: voters %v", g.name, s.cfg.NodeID, v)
			}
		}
	}
}

// The markers: a first start records the initial voters, which later
// --peers do not change; a joined directory stays joined.
func TestBootMembership(t *testing.T) {
	fs := vfs.Default
	dir := filepath.Join(t.TempDir(), "d")
	joined, ids, err := bootMembership(fs, dir, 2, false, []uint64{3, 1, 2}, false)
	if err != nil || joined || !slices.Equal(ids, []uint64{1, 2, 3}) {
		t.Fatalf("first start: %v %v %v", joined, ids, err)
	}
	joined, ids, err = bootMembership(fs, dir, 2, false, []uint64{1, 2, 4}, true)
	if err != nil || joined || !slices.Equal(ids, []uint64{1, 2, 3}) {
		t.Fatalf("restart with other --peers: %v %v %v", joined, ids, err)
	}
	if err := checkJoinDir(fs, dir); err == nil {
		t.Fatal("--join accepted an initial member's directory")
	}
	jd := filepath.Join(t.TempDir(), "j")
	if err := writeMarker(fs, jd, JoinedMarker, []byte("joined\n")); err != nil {
		t.Fatal(err)
	}
	if joined, ids, err = bootMembership(fs, jd, 4, false, []uint64{1, 2, 3, 4}, true); err != nil || !joined || ids != nil {
		t.Fatalf("joined directory: %v %v %v", joined, ids, err)
	}
	// A directory without markers whose node is not in --peers joined.
	od := filepath.Join(t.TempDir(), "o")
	if joined, _, err = bootMembership(fs, od, 4, false, []uint64{1, 2, 3}, true); err != nil || !joined {
		t.Fatalf("old joined directory: %v %v", joined, err)
	}
	if ok, _ := vfs.Exists(fs, filepath.Join(od, JoinedMarker)); !ok {
		t.Fatal("no joined marker written")
	}
	// An empty directory whose node is not in --peers (a mistyped --id, a
	// wiped member started without --join) is no member: nothing recorded
	// (New then refuses it).
	ed := filepath.Join(t.TempDir(), "e")
	if joined, ids, err = bootMembership(fs, ed, 4, false, []uint64{1, 2, 3}, false); err != nil || joined || ids != nil {
		t.Fatalf("empty directory not in --peers: %v %v %v, want neither joined nor initial", joined, ids, err)
	}
	for _, m := range []string{JoinedMarker, InitialMarker} {
		if ok, _ := vfs.Exists(fs, filepath.Join(ed, m)); ok {
			t.Fatalf("%s written for an empty directory not in --peers", m)
		}
	}
	// With state (a raft directory) and no marker: joined.
	rd := filepath.Join(t.TempDir(), "r")
	if err := os.MkdirAll(filepath.Join(rd, "raft"), 0o755); err != nil {
		t.Fatal(err)
	}
	if joined, _, err = bootMembership(fs, rd, 4, false, []uint64{1, 2, 3}, false); err != nil || !joined {
		t.Fatalf("directory with state not in --peers: %v %v, want joined", joined, err)
	}
	// A single-node service.
	if _, ids, err = bootMembership(fs, filepath.Join(t.TempDir(), "s"), 7, false, nil, false); err != nil || !slices.Equal(ids, []uint64{7}) {
		t.Fatalf("single node: %v %v", ids, err)
	}
}

// A wiped member restarted with Join under its old ID is refused (the
// review's probe: before, it was a voter again with no admin step); a
// new ID may join; a Join with no member answering is refused.
func TestJoinWipedMemberRefused(t *testing.T) {
	c := newCluster(t, 3, scm.Config{})
	waitFor(t, 10*time.Second, "rows for the initial members", func() bool {
		for _, s := range c.servers {
			if len(s.members.Table()) != 3 {
				return false
			}
		}
		return true
	})
	var victim uint64
	waitFor(t, 10*time.Second, "a namespace leader", func() bool {
		for id, s := range c.servers {
			if s.nsGroup.IsLeader() {
				victim = id
			}
		}
		return victim != 0
	})
	vs := c.servers[victim]
	dir := vs.cfg.DataDir
	peers := map[uint64]Peer{}
	for id, s := range c.servers {
		if id != victim {
			peers[id] = Peer{RaftAddr: s.RaftAddr(), GRPCAddr: s.GRPCAddr()}
		}
	}
	vs.Close()
	delete(c.servers, victim)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	cfg := Config{NodeID: victim, DataDir: dir, Peers: peers, Join: true, TLS: nodeCreds(victim), Admins: testAdmins,
		TickInterval: 20 * time.Millisecond, ElectionTicks: 10, Logger: quiet}
	if n, err := New(cfg); err == nil {
		n.Close()
		t.Fatalf("Join under wiped member %d's ID accepted", victim)
	} else if !strings.Contains(err.Error(), "already has a row") {
		t.Fatalf("Join under wiped member %d's ID: %v", victim, err)
	}
	if ok, _ := vfs.Exists(vfs.Default, filepath.Join(dir, JoinedMarker)); ok {
		t.Error("a refused Join wrote the joined marker")
	}
	cfg.NodeID, cfg.TLS, cfg.DataDir = 9, nodeCreds(9), filepath.Join(c.dir, "9")
	n, err := New(cfg)
	if err != nil {
		t.Fatalf("Join under a new ID: %v", err)
	}
	n.Close()
	cfg.NodeID, cfg.TLS, cfg.DataDir = 10, nodeCreds(10), filepath.Join(c.dir, "10")
	cfg.Peers = map[uint64]Peer{1: {RaftAddr: "127.0.0.1:1", GRPCAddr: "127.0.0.1:1"}}
	cfg.ProposeTimeout = 2 * time.Second
	if n, err := New(cfg); err == nil {
		n.Close()
		t.Fatal("Join with no member answering accepted")
	}
}

// A group leader adds only a node whose row is in the member table and
// not removed, and takes ChangeGroupMember only from the members leader:
// a concurrent or stale RemoveMember cannot leave a removed ID a voter.
func TestChangeGroupMemberRefusals(t *testing.T) {
	c := newCluster(t, 3, scm.Config{})
	L := membersLeader(t, c)
	ctx := context.Background()
	if _, err := L.changeGroup(ctx, NamespaceGroup, 9, false); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "no row") {
		t.Fatalf("add of an ID without a row: %v", err)
	}
	for _, op := range []*metapb.MembersCommand{
		{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}},
		{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: 9}},
	} {
		cmd, _ := marshalMembers(op)
		if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
	// As a RemoveMember that ran between an AddMember's row and its
	// group changes would leave it.
	if _, err := L.changeGroup(ctx, ScmGroup, 9, false); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "was removed") {
		t.Fatalf("add of a removed ID: %v", err)
	}
	for _, s := range c.servers {
		for _, mg := range metaGroups {
			if slices.Contains(s.group(mg.id).Voters(), 9) {
				t.Fatalf("removed node 9 is a voter of %s on node %d", mg.name, s.cfg.NodeID)
			}
		}
	}
	// ChangeGroupMember from a live meta node that does not lead the
	// members group (a stale leader, or one this node does not know as
	// leader yet) is refused with a retryable Unavailable (a removed
	// node's certificate is refused before, as PermissionDenied:
	// TestRemovedMetaLosesRights).
	var gl *Server
	waitFor(t, 10*time.Second, "a namespace leader", func() bool {
		for _, s := range c.servers {
			if s.nsGroup.IsLeader() {
				gl = s
				return true
			}
		}
		return false
	})
	var other uint64
	for id := range c.servers {
		if id != L.cfg.NodeID && id != gl.cfg.NodeID {
			other = id
		}
	}
	conn2, err := grpc.NewClient(gl.GRPCAddr(), nodeCreds(other).GRPCDialOption(pki.RoleMeta))
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close()
	_, err = metapb.NewMembersClient(conn2).ChangeGroupMember(ctx, &metapb.ChangeGroupMemberRequest{Group: NamespaceGroup, Id: 9, Remove: true})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("ChangeGroupMember from node %d (not the members leader): %v, want Unavailable", other, err)
	}
}

// A removed node's meta certificate no longer authorizes anything, and
// no bootstrap token is made for a removed ID.
func TestRemovedMetaLosesRights(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	L := membersLeader(t, c)
	ctx := context.Background()
	conn, err := grpc.NewClient(L.GRPCAddr(), nodeCreds(9).GRPCDialOption(pki.RoleMeta))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	n9 := metapb.NewMembersClient(conn)
	if _, err := n9.ListMembers(ctx, &metapb.ListMembersRequest{}); err != nil {
		t.Fatalf("ListMembers by meta node 9 before its removal: %v", err)
	}
	for _, op := range []*metapb.MembersCommand{
		{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}}},
		{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: 9}},
	} {
		cmd, _ := marshalMembers(op)
		if _, err := propose(ctx, L, L.memGroup, cmd); err != nil {
			t.Fatal(err)
		}
	}
	// Refused by the authorization (PermissionDenied), or, once the CA
	// leader revoked node 9 (members_revoke.go), its connection closed
	// and the handshake refused.
	if _, err := n9.ListMembers(ctx, &metapb.ListMembersRequest{}); status.Code(err) != codes.PermissionDenied && (status.Code(err) != codes.Unavailable || !L.identityRevoked(9)) {
		t.Fatalf("ListMembers by removed meta node 9: %v", err)
	}
	aconn, err := grpc.NewClient(L.GRPCAddr(), clientDial()...)
	if err != nil {
		t.Fatal(err)
	}
	defer aconn.Close()
	ca := metapb.NewCaClient(aconn)
	waitFor(t, 20*time.Second, "a meta token for new node 10 (the CA)", func() bool {
		_, err := ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{Role: string(pki.RoleMeta), IdentityId: "10"})
		return err == nil
	})
	if _, err := ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{Role: string(pki.RoleMeta), IdentityId: "9"}); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "was removed") {
		t.Fatalf("a meta token for removed node 9: %v", err)
	}
}

// The upgrade gate: a member that does not serve the Members service (an
// older binary answers Unimplemented) stops AddMember at once, before the
// row is recorded.
func TestMembershipUpgradeGate(t *testing.T) {
	c := newCluster(t, 3, scm.Config{})
	L := membersLeader(t, c)
	var other uint64
	for id := range c.servers {
		if id != L.cfg.NodeID {
			other = id
		}
	}
	// An "old binary": a meta node's gRPC port without the Members service.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	old := grpc.NewServer(nodeCreds(other).GRPCServerOption())
	go old.Serve(lis)
	defer old.Stop()
	L.SetPeer(other, Peer{RaftAddr: c.servers[other].RaftAddr(), GRPCAddr: lis.Addr().String()})
	conn, err := grpc.NewClient(L.GRPCAddr(), clientDial()...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	_, err = metapb.NewMembersClient(conn).AddMember(context.Background(), &metapb.AddMemberRequest{Id: 7, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "older binary") {
		t.Fatalf("AddMember with a member on an older binary: %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the refusal took %v", d)
	}
	if L.members.Get(7) != nil {
		t.Error("the refused add recorded a row")
	}
}

// A replaced forwarding client is closed after the grace period.
func TestReplacedForwarderClosed(t *testing.T) {
	defer func(g time.Duration) { fwdGrace = g }(fwdGrace)
	fwdGrace = 50 * time.Millisecond
	c := newCluster(t, 3, scm.Config{})
	s := c.servers[1]
	p, _ := s.staticPeer(2)
	p.GRPCAddr = "127.0.0.1:1" // another address: a new client
	s.SetPeer(2, p)
	if err := s.rebuildForwarder(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the old forwarding client closed", func() bool {
		s.fwdMu.Lock()
		defer s.fwdMu.Unlock()
		return len(s.fwdOld) == 0
	})
}
