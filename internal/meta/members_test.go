package meta

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestQuorumCheck: the rule that keeps a membership change from leaving
// a group that the live voters cannot commit in.
func TestQuorumCheck(t *testing.T) {
	for _, c := range []struct {
		name          string
		voters, live  []uint64
		id            uint64
		remove, allow bool
	}{
		{"remove the dead one of 3", []uint64{1, 2, 3}, []uint64{1, 2}, 3, true, true},
		{"remove a live one while another is dead", []uint64{1, 2, 3}, []uint64{1, 2}, 2, true, false},
		{"remove a live one of 3, all live", []uint64{1, 2, 3}, []uint64{1, 2, 3}, 3, true, true},
		{"remove the last member", []uint64{1}, []uint64{1}, 1, true, false},
		{"remove from 2, the other live", []uint64{1, 2}, []uint64{1, 2}, 2, true, true},
		{"add to 3 with one dead", []uint64{1, 2, 3}, []uint64{1, 2}, 4, false, false},
		{"add to 3 all live", []uint64{1, 2, 3}, []uint64{1, 2, 3}, 4, false, true},
		{"add to 2 live (the replacement)", []uint64{1, 2}, []uint64{1, 2}, 4, false, true},
		{"add to 2 with one dead", []uint64{1, 2}, []uint64{1}, 4, false, false},
		{"add to 1", []uint64{1}, []uint64{1}, 2, false, true},
		{"add to 5 with two dead", []uint64{1, 2, 3, 4, 5}, []uint64{1, 2, 3}, 6, false, false},
		{"add to 5 with one dead", []uint64{1, 2, 3, 4, 5}, []uint64{1, 2, 3, 4}, 6, false, true},
	} {
		err := quorumCheck(c.voters, c.live, c.id, c.remove)
		if (err == nil) != c.allow {
			t.Errorf("%s: quorumCheck(%v, live %v, %d, remove %v) = %v, want allowed %v", c.name, c.voters, c.live, c.id, c.remove, err, c.allow)
		}
	}
}

func TestValidateAddMember(t *testing.T) {
	ok := &metapb.AddMemberRequest{Id: 4, RaftAddr: "10.0.0.4:9863", GrpcAddr: "meta4.example:9862"}
	if err := validateAddMember(ok); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []*metapb.AddMemberRequest{
		{Id: 0, RaftAddr: "a:1", GrpcAddr: "a:2"},
		{Id: 4, RaftAddr: "", GrpcAddr: "a:2"},
		{Id: 4, RaftAddr: "a:1", GrpcAddr: "a"},
		{Id: 4, RaftAddr: ":1", GrpcAddr: "a:2"},
		{Id: 4, RaftAddr: "a:0", GrpcAddr: "a:2"},
		{Id: 4, RaftAddr: "a:70000", GrpcAddr: "a:2"},
		{Id: 4, RaftAddr: "a:1", GrpcAddr: strings.Repeat("h", 300) + ":2"},
	} {
		if err := validateAddMember(bad); err == nil {
			t.Errorf("validateAddMember(%v) accepted", bad)
		}
	}
}

func membersCmd(t *testing.T, c *metapb.MembersCommand) []byte {
	t.Helper()
	b, err := proto.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestMembersStateApply: the member table's commands, the refusals
// (invalid rows, a removed ID set again, unknown commands) and that the
// table survives a reopen.
func TestMembersStateApply(t *testing.T) {
	dir := t.TempDir()
	opts := store.Options{SyncInterval: -1}
	s, err := openMembersState(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	s.changed = func() { calls++ }
	set := func(id uint64, r, g string) []byte {
		return membersCmd(t, &metapb.MembersCommand{Op: &metapb.MembersCommand_SetMember{SetMember: &metapb.MemberInfo{Id: id, RaftAddr: r, GrpcAddr: g}}})
	}
	rm := func(id uint64) []byte {
		return membersCmd(t, &metapb.MembersCommand{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: id}})
	}
	unknown := []byte{0xa2, 0x06, 0x00} // field 100, a newer binary's op
	res := s.Apply([]store.Entry{
		{Index: 1, Cmd: set(4, "h:1", "h:2")},
		{Index: 2, Cmd: set(0, "h:1", "h:2")},
		{Index: 3, Cmd: set(5, "h", "h:2")},
		{Index: 4, Cmd: rm(3)},
		{Index: 5, Cmd: set(3, "h:1", "h:2")},
		{Index: 6, Cmd: unknown},
		{Index: 7}, // a raft entry
		{Index: 8, Cmd: []byte{}},
	})
	wantCodes := []codes.Code{codes.OK, codes.InvalidArgument, codes.InvalidArgument, codes.OK, codes.FailedPrecondition, codes.Unimplemented, codes.OK, codes.OK}
	for i, r := range res {
		var code codes.Code
		if err, _ := r.(error); err != nil {
			code = status.Code(err)
		}
		if code != wantCodes[i] {
			t.Errorf("entry %d: %v, want %v", i+1, r, wantCodes[i])
		}
	}
	if calls != 1 {
		t.Errorf("changed called %d times, want 1", calls)
	}
	if s.AppliedIndex() != 8 {
		t.Errorf("applied %d, want 8", s.AppliedIndex())
	}
	check := func(s *membersState) {
		t.Helper()
		tb := s.Table()
		if len(tb) != 2 || tb[0].GetId() != 3 || !tb[0].GetRemoved() || tb[1].GetId() != 4 || tb[1].GetRaftAddr() != "h:1" || tb[1].GetGrpcAddr() != "h:2" || tb[1].GetRemoved() {
			t.Fatalf("table %v", tb)
		}
	}
	check(s)
	// Remove keeps the addresses, for the record.
	s.Apply([]store.Entry{{Index: 9, Cmd: rm(4)}})
	if m := s.Get(4); !m.GetRemoved() || m.GetRaftAddr() != "h:1" {
		t.Fatalf("removed 4: %v", m)
	}
	s.Close()
	s, err = openMembersState(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if m := s.Get(4); !m.GetRemoved() || s.AppliedIndex() != 9 || !s.Get(3).GetRemoved() {
		t.Fatalf("after reopen: 4 %v, applied %d", m, s.AppliedIndex())
	}
}

// TestCheckJoinDir: --join needs a data directory without state.
func TestCheckJoinDir(t *testing.T) {
	dir := t.TempDir()
	if err := checkJoinDir(vfs.Default, dir); err != nil {
		t.Fatalf("empty directory: %v", err)
	}
	if err := checkJoinDir(vfs.Default, filepath.Join(dir, "none")); err != nil {
		t.Fatalf("missing directory: %v", err)
	}
	// A TLS directory (written by --bootstrap-token) is no state.
	if err := os.MkdirAll(filepath.Join(dir, "tls"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := checkJoinDir(vfs.Default, dir); err != nil {
		t.Fatalf("with tls/: %v", err)
	}
	for _, sub := range []string{"raft", "namespace", "members"} {
		d := t.TempDir()
		if err := os.MkdirAll(filepath.Join(d, sub), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := checkJoinDir(vfs.Default, d); err == nil || !strings.Contains(err.Error(), "holds state") {
			t.Errorf("with %s/: %v", sub, err)
		}
	}
}

// TestMembersRPCRules: the Members RPCs on a real in-process cluster of
// three: admins only; AddMember/RemoveMember only on the members group's
// leader (NotLeader for group 5 elsewhere); AlreadyExists for a member;
// no removing the serving node; with a follower stopped, the quorum rule
// refuses adding a node and removing the live follower; removing the
// stopped one changes every group and its ID cannot come back; a node
// started with Join is added, catches up in every group and the others
// resolve it from the member table.
func TestMembersRPCRules(t *testing.T) {
	c := newCluster(t, 3, scm.Config{})
	var leader uint64
	waitFor(t, 10*time.Second, "a members leader", func() bool {
		for id, s := range c.servers {
			if s.memGroup.IsLeader() {
				leader = id
				return true
			}
		}
		return false
	})
	dial := func(id uint64, opts []grpc.DialOption) metapb.MembersClient {
		conn, err := grpc.NewClient(c.servers[id].GRPCAddr(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return metapb.NewMembersClient(conn)
	}
	adm := dial(leader, clientDial())
	ctx := context.Background()
	code := func(err error) codes.Code { return status.Code(err) }

	bob := dial(leader, []grpc.DialOption{testCreds(pki.RoleClient, "bob").GRPCDialOption(pki.RoleMeta)})
	if _, err := bob.ListMembers(ctx, &metapb.ListMembersRequest{}); code(err) != codes.PermissionDenied {
		t.Fatalf("ListMembers by a non-admin: %v", err)
	}
	if _, err := bob.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: 3}); code(err) != codes.PermissionDenied {
		t.Fatalf("RemoveMember by a non-admin: %v", err)
	}
	var other, stopped uint64
	for id := range c.servers {
		if id != leader {
			if other == 0 {
				other = id
			} else {
				stopped = id
			}
		}
	}
	waitFor(t, 10*time.Second, "the follower to know the leader", func() bool { return c.servers[other].memGroup.Leader() == leader })
	_, err := dial(other, clientDial()).AddMember(ctx, &metapb.AddMemberRequest{Id: 9, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"})
	st, _ := status.FromError(err)
	var nl *metapb.NotLeader
	for _, d := range st.Details() {
		nl, _ = d.(*metapb.NotLeader)
	}
	if st.Code() != codes.Unavailable || nl == nil || nl.GroupId != MembersGroup || nl.LeaderId != leader {
		t.Fatalf("AddMember on a follower: %v %v", err, nl)
	}
	if _, err := adm.AddMember(ctx, &metapb.AddMemberRequest{Id: 0, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}); code(err) != codes.InvalidArgument {
		t.Fatalf("AddMember of ID 0: %v", err)
	}
	if _, err := adm.AddMember(ctx, &metapb.AddMemberRequest{Id: other, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}); code(err) != codes.AlreadyExists {
		t.Fatalf("AddMember of a member: %v", err)
	}
	if _, err := adm.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: leader}); code(err) != codes.FailedPrecondition {
		t.Fatalf("RemoveMember of the serving node: %v", err)
	}
	if _, err := adm.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: 77}); code(err) != codes.NotFound {
		t.Fatalf("RemoveMember of a stranger: %v", err)
	}

	// The leader records the initial members; a node of them restarted
	// on an empty directory is refused by CheckNotWiped, a new ID is not.
	waitFor(t, 10*time.Second, "rows for the initial members", func() bool {
		for _, s := range c.servers {
			if len(s.members.Table()) != 3 {
				return false
			}
		}
		return true
	})
	initial := map[uint64]Peer{}
	for id, s := range c.servers {
		initial[id] = Peer{RaftAddr: s.RaftAddr(), GRPCAddr: s.GRPCAddr()}
	}
	if err := CheckNotWiped(ctx, nodeCreds(stopped), stopped, initial, 5*time.Second, false); err == nil || !strings.Contains(err.Error(), "has run in this cluster before") {
		t.Fatalf("CheckNotWiped of a member: %v", err)
	}
	if err := CheckNotWiped(ctx, nodeCreds(9), 9, initial, 5*time.Second, false); err != nil {
		t.Fatalf("CheckNotWiped of a new ID: %v", err)
	}

	// A follower stops.
	c.servers[stopped].Close()
	delete(c.servers, stopped)
	waitFor(t, 10*time.Second, "the leader to notice", func() bool {
		f, ok := c.servers[leader].memGroup.Status().Followers[stopped]
		return ok && !f.Active
	})
	if _, err := adm.AddMember(ctx, &metapb.AddMemberRequest{Id: 4, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}); code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "remove dead members first") {
		t.Fatalf("AddMember with a member down: %v", err)
	}
	if _, err := adm.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: other}); code(err) != codes.FailedPrecondition {
		t.Fatalf("RemoveMember of a live member with another down: %v", err)
	}
	r, err := adm.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: stopped})
	if err != nil || len(r.Groups) != 5 || !r.Member.Removed {
		t.Fatalf("RemoveMember of the stopped node: %v %v", r, err)
	}
	for _, s := range c.servers {
		for _, mg := range metaGroups {
			g := s.group(mg.id)
			waitFor(t, 10*time.Second, "the removal everywhere", func() bool { return !slices.Contains(g.Voters(), stopped) })
		}
		waitFor(t, 10*time.Second, "the removed row", func() bool { return s.members.Get(stopped).GetRemoved() })
		if _, ok := s.peer(stopped); ok {
			t.Fatalf("node %d still resolves removed node %d", s.cfg.NodeID, stopped)
		}
	}
	if _, err := adm.AddMember(ctx, &metapb.AddMemberRequest{Id: stopped, RaftAddr: "127.0.0.1:1", GrpcAddr: "127.0.0.1:2"}); code(err) != codes.FailedPrecondition {
		t.Fatalf("AddMember of a removed ID: %v", err)
	}
	if err := CheckNotWiped(ctx, nodeCreds(stopped), stopped, initial, 5*time.Second, false); err == nil || !strings.Contains(err.Error(), "was removed") {
		t.Fatalf("CheckNotWiped of a removed member: %v", err)
	}

	// Node 6 joins.
	peers := map[uint64]Peer{}
	for id, s := range c.servers {
		peers[id] = Peer{RaftAddr: s.RaftAddr(), GRPCAddr: s.GRPCAddr()}
	}
	if c.servers[leader].members.Get(4) != nil {
		t.Fatal("the refused AddMember 4 left a row (the upgrade gate refuses before the row)")
	}
	n4, err := New(Config{NodeID: 6, DataDir: filepath.Join(c.dir, "6"), Peers: peers, Join: true, TLS: nodeCreds(6), Admins: testAdmins,
		TickInterval: 20 * time.Millisecond, ElectionTicks: 10, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := n4.Start(); err != nil {
		t.Fatal(err)
	}
	c.servers[6] = n4
	r, err = adm.AddMember(ctx, &metapb.AddMemberRequest{Id: 6, RaftAddr: n4.RaftAddr(), GrpcAddr: n4.GRPCAddr()})
	if err != nil || len(r.Groups) != 5 {
		t.Fatalf("AddMember 6: %v %v", r, err)
	}
	for _, mg := range metaGroups {
		g := n4.group(mg.id)
		lead := c.servers[leader].group(mg.id)
		waitFor(t, 20*time.Second, "node 6 to catch up in "+mg.name, func() bool {
			return slices.Contains(g.Voters(), 6) && g.Status().Applied >= lead.Status().Commit
		})
	}
	if p, ok := c.servers[other].peer(6); !ok || p.GRPCAddr != n4.GRPCAddr() {
		t.Fatalf("node %d resolves node 6 as %v %v", other, p, ok)
	}
	// Its forwarding client (SCM, CA calls to their leaders) knows node 6:
	// it follows leader hints only to addresses it was given.
	s := c.servers[other]
	s.fwdMu.Lock()
	fa := slices.Clone(s.fwdAddrs)
	s.fwdMu.Unlock()
	if !slices.Contains(fa, n4.GRPCAddr()) || slices.Contains(fa, "") {
		t.Fatalf("node %d forwards to %v, not to node 6 (%s)", other, fa, n4.GRPCAddr())
	}
	if _, err := New(Config{NodeID: 5, DataDir: filepath.Join(c.dir, "6"), Peers: peers, Join: true, TLS: nodeCreds(5), Logger: quiet}); err == nil || !strings.Contains(err.Error(), "holds state") {
		t.Fatalf("Join with a used directory: %v", err)
	}
}
