package meta

// Meta membership (docs/ARCHITECTURE.md, "Meta membership"): an admin
// lists, adds and removes meta nodes (basalt admin meta ...). The member
// table (node ID → raft and gRPC addresses, or removed) is the state of
// its own Raft group, MembersGroup; every node resolves and admits raft
// peers by --peers overlaid with that table. A change is made by the
// leader of the members group: an add records the addresses first, then
// adds the node as a voter to every meta group (one ConfChange per group,
// made by that group's leader, asked over ChangeGroupMember when it is
// another node); a remove takes the node out of every group first, then
// marks it removed in the table. Each step checks what is already done,
// so a retry of an interrupted call completes it.
//
// The quorum rule (quorumCheck): a change is refused unless the voters
// that are live now (the group leader and the followers it heard from in
// the last election timeout; a node being added counts as not live) are a
// majority of the configuration after the change. Adding a node to a
// group that already has a dead voter would otherwise raise the quorum
// past what the live nodes can reach (3 voters, one dead, + a new node:
// 4 voters, quorum 3, 2 live), and removing a live node where another is
// dead would leave a configuration the live ones cannot commit in. As in
// etcd, one exception: a group of one live voter may grow to two (it
// stalls until the new node, started with --join beforehand, catches up).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	fs2 "io/fs"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/vfs"
)

func init() {
	adminMethods[metapb.Members_ListMembers_FullMethodName] = true
	adminMethods[metapb.Members_AddMember_FullMethodName] = true
	adminMethods[metapb.Members_RemoveMember_FullMethodName] = true
	methodRoles[metapb.Members_ChangeGroupMember_FullMethodName] = onlyMeta
}

// groupNames names the meta groups, in the order a change visits them.
var metaGroups = []struct {
	id   uint64
	name string
}{{MembersGroup, "members"}, {NamespaceGroup, "namespace"}, {ScmGroup, "scm"}, {CaGroup, "ca"}, {UserTokenGroup, "usertoken"}}

func groupName(id uint64) string {
	for _, g := range metaGroups {
		if g.id == id {
			return g.name
		}
	}
	return fmt.Sprint(id)
}

func (s *Server) group(id uint64) *raft.Group {
	switch id {
	case NamespaceGroup:
		return s.nsGroup
	case ScmGroup:
		return s.scmGroup
	case CaGroup:
		return s.ca.group
	case UserTokenGroup:
		return s.utGroup
	case MembersGroup:
		return s.memGroup
	}
	return nil
}

// validateHostPort accepts HOST:PORT with a numeric port 1..65535.
func validateHostPort(a string) error {
	if a == "" || len(a) > maxMemberAddrLen {
		return fmt.Errorf("address %q: want HOST:PORT of at most %d bytes", clip(a), maxMemberAddrLen)
	}
	h, p, err := net.SplitHostPort(a)
	if err != nil || h == "" {
		return fmt.Errorf("address %q: want HOST:PORT", clip(a))
	}
	if n, err := strconv.ParseUint(p, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("address %q: port %q: want 1 to 65535", clip(a), clip(p))
	}
	return nil
}

// quorumCheck applies the quorum rule (see the top of this file) to one
// group: voters are its voters, live those of them that are live, id the
// node added (remove false) or removed.
func quorumCheck(voters, live []uint64, id uint64, remove bool) error {
	after := slices.Clone(voters)
	if remove {
		after = slices.DeleteFunc(after, func(v uint64) bool { return v == id })
		if len(after) == 0 {
			return errors.New("it is the last member")
		}
	} else {
		after = append(after, id)
	}
	n := 0
	for _, v := range after {
		if v != id && slices.Contains(live, v) {
			n++
		}
	}
	// As etcd's strict reconfiguration check: a single live member may
	// grow to two (nothing else could; the group waits for the new one).
	if !remove && len(voters) == 1 && n == 1 {
		return nil
	}
	if need := len(after)/2 + 1; n < need {
		return fmt.Errorf("after the change %d voters %v would need %d live ones to commit, and only %d of them are live now (live: %v)%s",
			len(after), after, need, n, live, map[bool]string{false: "; remove dead members first", true: "; bring the dead members back or remove them first"}[remove])
	}
	return nil
}

// onMembersChanged updates what depends on the member table: the
// forwarding client's addresses. (peer() reads the table directly.)
func (s *Server) onMembersChanged() {
	s.log.Info("meta: member table changed", "members", s.members.Table())
	if err := s.rebuildForwarder(); err != nil {
		s.log.Error("meta: forwarding client for the new member table", "err", err)
	}
	s.pokeRevocations() // a removed row: its certificates (members_revoke.go)
}

// fwd is the client to the other meta nodes, nil on a single node.
func (s *Server) fwd() *metaclient.Client { return s.fwdp.Load() }

// rebuildForwarder (re)makes the forwarding client over every member's
// gRPC address (this node's too: SCM leadership can move here while a
// forwarded call is in flight, and the others' hints then name this
// node; without its address the call would wait out its deadline). The
// client follows leader hints only to addresses it was given, so a
// member added later must be in it.
// fwdGrace: how long a replaced forwarding client stays open for the
// calls in flight on it (three of its call timeouts).
var fwdGrace = 30 * time.Second

func (s *Server) rebuildForwarder() error {
	var addrs []string
	for _, id := range s.memberIDs() {
		if p, _ := s.peer(id); p.GRPCAddr != "" {
			addrs = append(addrs, p.GRPCAddr)
		}
	}
	s.fwdMu.Lock()
	defer s.fwdMu.Unlock()
	if s.fwdClosed || len(addrs) <= 1 || slices.Equal(addrs, s.fwdAddrs) {
		return nil
	}
	c, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 10 * time.Second,
		DialOptions: []grpc.DialOption{s.cfg.TLS.GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		return err
	}
	if old := s.fwdp.Swap(c); old != nil {
		// Calls may be in flight on it: closed after a grace period
		// (or by Close).
		s.fwdOld = append(s.fwdOld, old)
		time.AfterFunc(fwdGrace, func() {
			s.fwdMu.Lock()
			defer s.fwdMu.Unlock()
			if i := slices.Index(s.fwdOld, old); i >= 0 && !s.fwdClosed {
				s.fwdOld = slices.Delete(s.fwdOld, i, i+1)
				old.Close()
			}
		})
	}
	s.fwdAddrs = addrs
	return nil
}

// membersServer serves the Members service.
type membersServer struct {
	metapb.UnimplementedMembersServer
	s *Server
}

func (m *membersServer) requireAdmin(ctx context.Context, call string) error {
	if m.s.cfg.TLS.IsInsecure() {
		return nil
	}
	c, ok := namespace.CallerOf(ctx)
	if !ok || !c.Admin {
		return status.Errorf(codes.PermissionDenied, "meta node %d: %s: admins only", m.s.cfg.NodeID, call)
	}
	return nil
}

func (m *membersServer) notLeader(g *raft.Group, gid uint64) error {
	nl := &metapb.NotLeader{GroupId: gid}
	if l := g.Leader(); l != 0 && l != m.s.cfg.NodeID {
		nl.LeaderId = l
		if p, ok := m.s.peer(l); ok {
			nl.LeaderAddr = p.GRPCAddr
		}
	}
	st, _ := status.Newf(codes.Unavailable, "meta node %d: not the leader of the %s group (leader: node %d, %s)", m.s.cfg.NodeID, groupName(gid), nl.LeaderId, nl.LeaderAddr).WithDetails(nl)
	return st.Err()
}

func (m *membersServer) ListMembers(ctx context.Context, _ *metapb.ListMembersRequest) (*metapb.ListMembersResponse, error) {
	if err := m.requireAdmin(ctx, "ListMembers"); err != nil {
		return nil, err
	}
	s := m.s
	resp := &metapb.ListMembersResponse{NodeId: s.cfg.NodeID, ForcedKeyRotation: true}
	seen := map[uint64]bool{}
	for _, mi := range s.members.Table() {
		mi.Source = "table"
		mi.Revoked = mi.GetRemoved() && s.identityRevoked(mi.GetId())
		mi.KeysRotated = mi.GetRemoved() && s.keysRotatedFor(mi.GetId())
		seen[mi.GetId()] = true
		resp.Members = append(resp.Members, mi)
	}
	s.peersMu.RLock()
	for _, id := range peerIDs(s.peers) {
		if !seen[id] {
			p := s.peers[id]
			resp.Members = append(resp.Members, &metapb.MemberInfo{Id: id, RaftAddr: p.RaftAddr, GrpcAddr: p.GRPCAddr, Source: "peers"})
		}
	}
	s.peersMu.RUnlock()
	slices.SortFunc(resp.Members, func(a, b *metapb.MemberInfo) int { return cmp.Compare(a.GetId(), b.GetId()) })
	for _, mg := range metaGroups {
		g := s.group(mg.id)
		if g == nil {
			continue
		}
		st := g.Status()
		gs := &metapb.GroupStatus{Group: mg.id, Name: mg.name, Leader: st.Leader, Voters: st.Voters, Commit: st.Commit, Applied: st.Applied}
		for _, id := range peerIDsOf(st.Followers) {
			f := st.Followers[id]
			gs.Members = append(gs.Members, &metapb.GroupMemberStatus{Id: id, Match: f.Match, Applied: f.Applied, Active: f.Active || id == s.cfg.NodeID})
		}
		resp.Groups = append(resp.Groups, gs)
	}
	return resp, nil
}

func peerIDsOf(m map[uint64]raft.FollowerStatus) []uint64 {
	ids := make([]uint64, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// validateAddMember checks an AddMember request's own fields.
func validateAddMember(req *metapb.AddMemberRequest) error {
	if req.GetId() == 0 {
		return errors.New("node ID must be nonzero")
	}
	if err := validateHostPort(req.GetRaftAddr()); err != nil {
		return fmt.Errorf("raft %w", err)
	}
	if err := validateHostPort(req.GetGrpcAddr()); err != nil {
		return fmt.Errorf("gRPC %w", err)
	}
	return nil
}

// leadMembers checks that this node leads the members group and that its
// table is current (a read barrier).
func (m *membersServer) leadMembers(ctx context.Context) error {
	g := m.s.memGroup
	if !g.IsLeader() {
		return m.notLeader(g, MembersGroup)
	}
	ctx, cancel := m.s.withTimeout(ctx)
	defer cancel()
	if err := g.ReadIndex(ctx); err != nil {
		var nle *raft.NotLeaderError
		if errors.As(err, &nle) || errors.Is(err, raft.ErrNotLeader) {
			return m.notLeader(g, MembersGroup)
		}
		return status.Errorf(codes.Unavailable, "meta node %d: members group read barrier: %v", m.s.cfg.NodeID, err)
	}
	return nil
}

func (m *membersServer) AddMember(ctx context.Context, req *metapb.AddMemberRequest) (*metapb.MemberChangeResponse, error) {
	if err := m.requireAdmin(ctx, "AddMember"); err != nil {
		return nil, err
	}
	if err := validateAddMember(req); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "AddMember: %v", err)
	}
	m.s.memberOpMu.Lock()
	defer m.s.memberOpMu.Unlock()
	if err := m.leadMembers(ctx); err != nil {
		return nil, err
	}
	s, id := m.s, req.GetId()
	if err := s.checkVotersServeMembers(ctx, id, false); err != nil {
		return nil, err
	}
	want := &metapb.MemberInfo{Id: id, RaftAddr: req.GetRaftAddr(), GrpcAddr: req.GetGrpcAddr()}
	row := s.members.Get(id)
	if row.GetRemoved() {
		return nil, status.Errorf(codes.FailedPrecondition, "AddMember: node %d was removed from the cluster; its ID may not come back (a node that kept its old state could rejoin with votes and entries the others no longer count on): give the replacement a new ID", id)
	}
	inAll, inAny := true, false
	for _, mg := range metaGroups {
		if slices.Contains(s.group(mg.id).Voters(), id) {
			inAny = true
		} else {
			inAll = false
		}
	}
	sameAddrs := row != nil && row.GetRaftAddr() == want.GetRaftAddr() && row.GetGrpcAddr() == want.GetGrpcAddr()
	if !sameAddrs && row == nil {
		if p, ok := s.staticPeer(id); ok && inAny {
			sameAddrs = p.RaftAddr == want.GetRaftAddr() && p.GRPCAddr == want.GetGrpcAddr()
		}
	}
	switch {
	case inAll:
		return nil, status.Errorf(codes.AlreadyExists, "AddMember: node %d is already a member of every meta group", id)
	case inAny && !sameAddrs:
		return nil, status.Errorf(codes.AlreadyExists, "AddMember: node %d is already a member of some meta groups under other addresses (remove it first, or retry with its recorded addresses)", id)
	}
	if !sameAddrs || row == nil {
		cmd, err := marshalMembers(&metapb.MembersCommand{Op: &metapb.MembersCommand_SetMember{SetMember: want}})
		if err != nil {
			return nil, err
		}
		res, err := propose(ctx, s, s.memGroup, cmd)
		if err != nil {
			return nil, err
		}
		if err, _ := res.(error); err != nil {
			return nil, err
		}
	}
	resp := &metapb.MemberChangeResponse{Member: want}
	for _, mg := range metaGroups {
		gc, err := s.changeGroup(ctx, mg.id, id, false)
		if err != nil {
			return resp, status.Errorf(status.Code(err), "AddMember: node %d: done so far %v; %s group: %v (retry to complete)", id, outcomes(resp.Groups), mg.name, err)
		}
		resp.Groups = append(resp.Groups, gc)
	}
	return resp, nil
}

func (m *membersServer) RemoveMember(ctx context.Context, req *metapb.RemoveMemberRequest) (*metapb.MemberChangeResponse, error) {
	if err := m.requireAdmin(ctx, "RemoveMember"); err != nil {
		return nil, err
	}
	id := req.GetId()
	if id == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "RemoveMember: node ID must be nonzero")
	}
	resp, err := m.removeMember(ctx, id)
	if err != nil {
		return resp, err
	}
	// Its certificates: revoked by the CA group's leader once the row is
	// removed (members_revoke.go), here or on another node; reported if
	// done within a few seconds (the reconciler finishes it otherwise).
	// Waited for without memberOpMu: the row is committed, and a slow CA
	// leader must not hold up other membership changes.
	resp.Member.Revoked = m.s.waitRevoked(ctx, id, min(m.s.cfg.ProposeTimeout, 5*time.Second))
	return resp, nil
}

// removeMember is RemoveMember up to the committed removed row, under
// memberOpMu.
func (m *membersServer) removeMember(ctx context.Context, id uint64) (*metapb.MemberChangeResponse, error) {
	m.s.memberOpMu.Lock()
	defer m.s.memberOpMu.Unlock()
	if err := m.leadMembers(ctx); err != nil {
		return nil, err
	}
	s := m.s
	if id == s.cfg.NodeID {
		return nil, status.Errorf(codes.FailedPrecondition, "RemoveMember: node %d leads the members group and serves this call; stop it first (its groups elect other leaders), then remove it through another node", id)
	}
	row := s.members.Get(id)
	_, static := s.staticPeer(id)
	inAny := false
	for _, mg := range metaGroups {
		if slices.Contains(s.group(mg.id).Voters(), id) {
			inAny = true
		}
	}
	if !inAny && row == nil && !static {
		return nil, status.Errorf(codes.NotFound, "RemoveMember: node %d is not a member", id)
	}
	if err := s.checkVotersServeMembers(ctx, id, true); err != nil {
		return nil, err
	}
	resp := &metapb.MemberChangeResponse{Member: row}
	if resp.Member == nil {
		resp.Member = &metapb.MemberInfo{Id: id}
	}
	for _, mg := range metaGroups {
		gc, err := s.changeGroup(ctx, mg.id, id, true)
		if err != nil {
			return resp, status.Errorf(status.Code(err), "RemoveMember: node %d: done so far %v; %s group: %v (retry to complete)", id, outcomes(resp.Groups), mg.name, err)
		}
		resp.Groups = append(resp.Groups, gc)
	}
	if !row.GetRemoved() {
		cmd, err := marshalMembers(&metapb.MembersCommand{Op: &metapb.MembersCommand_RemoveMember{RemoveMember: id}})
		if err != nil {
			return nil, err
		}
		res, err := propose(ctx, s, s.memGroup, cmd)
		if err != nil {
			return resp, err
		}
		if err, _ := res.(error); err != nil {
			return resp, err
		}
	}
	resp.Member.Removed = true
	return resp, nil
}

func outcomes(gs []*metapb.GroupChange) []string {
	out := make([]string, len(gs))
	for i, g := range gs {
		out[i] = g.GetName() + ": " + g.GetOutcome()
	}
	return out
}

func marshalMembers(c *metapb.MembersCommand) ([]byte, error) {
	b, err := proto.Marshal(c)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "members: %v", err)
	}
	return b, nil
}

// ChangeGroupMember: one group's change, on that group's leader.
func (m *membersServer) ChangeGroupMember(ctx context.Context, req *metapb.ChangeGroupMemberRequest) (*metapb.GroupChange, error) {
	g := m.s.group(req.GetGroup())
	if g == nil || req.GetId() == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "ChangeGroupMember: group %d, node %d", req.GetGroup(), req.GetId())
	}
	if !g.IsLeader() {
		return nil, m.notLeader(g, req.GetGroup())
	}
	// Only the members group's current leader (which serializes the
	// changes) or this node itself: not any meta certificate.
	if !m.s.cfg.TLS.IsInsecure() {
		c, _ := namespace.CallerOf(ctx)
		l := m.s.memGroup.Leader()
		self := pki.Identity{Role: pki.RoleMeta, ID: strconv.FormatUint(m.s.cfg.NodeID, 10)}.String()
		if c.User != self && (l == 0 || c.User != (pki.Identity{Role: pki.RoleMeta, ID: strconv.FormatUint(l, 10)}).String()) {
			// Right after an election this node may not know the new
			// members leader yet: a meta node gets a retryable answer
			// (its changeGroup stops once it no longer leads group 5);
			// anyone else is refused.
			if id, err := pki.ParseIdentity(c.User); err == nil && id.Role == pki.RoleMeta {
				return nil, status.Errorf(codes.Unavailable, "meta node %d: ChangeGroupMember from %s, which does not lead the members group as far as this node knows (node %d does): retry", m.s.cfg.NodeID, clip(c.User), l)
			}
			return nil, status.Errorf(codes.PermissionDenied, "meta node %d: ChangeGroupMember from %s, which does not lead the members group (node %d does)", m.s.cfg.NodeID, clip(c.User), l)
		}
	}
	return m.s.changeLocal(ctx, req.GetGroup(), g, req.GetId(), req.GetRemove())
}

// metaIDRemoved: the meta identity ID (a node ID) is removed in this
// node's member table.
func (s *Server) metaIDRemoved(id string) bool {
	n, err := strconv.ParseUint(id, 10, 64)
	return err == nil && s.members != nil && s.members.Removed(n)
}

// refuseRemovedMeta refuses (FailedPrecondition) a meta identity whose
// node ID is removed in the member table, read after a barrier on the
// members group: no token or certificate for a removed node.
func (s *Server) refuseRemovedMeta(ctx context.Context, id string) error {
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	if err := s.membersBarrier(ctx); err != nil {
		return status.Errorf(codes.Unavailable, "meta node %d: members group read barrier: %v", s.cfg.NodeID, err)
	}
	if s.metaIDRemoved(id) {
		return status.Errorf(codes.FailedPrecondition, "meta node %d: meta node %s was removed from the cluster; its ID may not come back: give the new node a new ID", s.cfg.NodeID, clip(id))
	}
	return nil
}

// membersBarrier is a read barrier on the members group that waits, until
// ctx ends, while the group has no leader known here (a cluster just
// started, an election under way): callers such as CreateBootstrapToken
// would otherwise fail at once in the first second of a cluster.
func (s *Server) membersBarrier(ctx context.Context) error {
	for {
		err := s.memGroup.ReadIndex(ctx)
		var nl *raft.NotLeaderError
		if err == nil || !errors.As(err, &nl) || nl.Leader != 0 {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(max(s.electionTimeout()/10, 10*time.Millisecond)):
		}
	}
}

// checkVotersServeMembers is the upgrade gate of membership changes:
// every voter of any group (this node's view; target excluded) must serve
// the Members service, so every member hosts the members group, resolves
// added nodes from the table and can make its groups' changes. A voter
// that answers Unimplemented runs an older binary: refused at once (no
// retry). One that does not answer is refused for an add; for a remove it
// is skipped (a dead node is what removals are for; the quorum rule
// guards the rest). The calls run in parallel, a few seconds at most.
func (s *Server) checkVotersServeMembers(ctx context.Context, target uint64, remove bool) error {
	var ids []uint64
	for _, mg := range metaGroups {
		for _, v := range s.group(mg.id).Voters() {
			if v != s.cfg.NodeID && v != target && !slices.Contains(ids, v) {
				ids = append(ids, v)
			}
		}
	}
	slices.Sort(ids)
	ctx, cancel := context.WithTimeout(ctx, min(s.cfg.ProposeTimeout, 3*time.Second))
	defer cancel()
	errs := make([]error, len(ids))
	done := make(chan struct{}, len(ids))
	for i, v := range ids {
		go func() {
			defer func() { done <- struct{}{} }()
			p, ok := s.peer(v)
			if !ok || p.GRPCAddr == "" {
				errs[i] = status.Errorf(codes.Unavailable, "no gRPC address")
				return
			}
			conn, err := grpc.NewClient(p.GRPCAddr, s.cfg.TLS.GRPCDialOption(pki.RoleMeta))
			if err != nil {
				errs[i] = err
				return
			}
			defer conn.Close()
			_, errs[i] = metapb.NewMembersClient(conn).ListMembers(ctx, &metapb.ListMembersRequest{})
		}()
	}
	for range ids {
		<-done
	}
	op := "AddMember"
	if remove {
		op = "RemoveMember"
	}
	for i, err := range errs {
		switch {
		case err == nil:
		case status.Code(err) == codes.Unimplemented:
			return status.Errorf(codes.FailedPrecondition, "%s: member %d does not serve the Members service (an older binary): upgrade every meta node before changing the membership", op, ids[i])
		case !remove:
			return status.Errorf(codes.FailedPrecondition, "%s: member %d does not answer ListMembers (%v): every member must run a binary with the Members service and be up; remove dead members first", op, ids[i], err)
		}
	}
	return nil
}

// checkAddRow: a node is added to a group only if the member table (read
// after a barrier on the members group) has its row, not removed. A
// concurrent or stale RemoveMember can then not leave a removed ID as a
// voter nobody resolves.
func (s *Server) checkAddRow(ctx context.Context, gid, id uint64) error {
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	if err := s.membersBarrier(ctx); err != nil {
		return status.Errorf(codes.Unavailable, "meta node %d: members group read barrier: %v", s.cfg.NodeID, err)
	}
	switch row := s.members.Get(id); {
	case row == nil:
		return status.Errorf(codes.FailedPrecondition, "%s group: node %d has no row in the member table (add it with basalt admin meta add)", groupName(gid), id)
	case row.GetRemoved():
		return status.Errorf(codes.FailedPrecondition, "%s group: node %d was removed from the cluster; it may not be a voter again", groupName(gid), id)
	}
	return nil
}

// changeLocal makes one membership change in group g, which this node
// leads, unless it is made already.
func (s *Server) changeLocal(ctx context.Context, gid uint64, g *raft.Group, id uint64, remove bool) (*metapb.GroupChange, error) {
	gc := &metapb.GroupChange{Group: gid, Name: groupName(gid)}
	s.changeMu.Lock()
	defer s.changeMu.Unlock()
	st := g.Status()
	if st.Role != "leader" {
		return nil, &raft.NotLeaderError{Group: gid, Leader: st.Leader}
	}
	voters := slices.Clone(st.Voters)
	member := slices.Contains(st.Voters, id)
	switch {
	case !remove && member:
		gc.Outcome = "already a member"
		return gc, nil
	case remove && !member:
		gc.Outcome = "already removed"
		return gc, nil
	case remove && id == s.cfg.NodeID:
		return nil, status.Errorf(codes.FailedPrecondition, "node %d leads the %s group: stop it first (another node takes over), then remove it", id, gc.Name)
	}
	if !remove {
		if err := s.checkAddRow(ctx, gid, id); err != nil {
			return nil, err
		}
	}
	// A leader learns who is live from their answers: right after an
	// election nobody is yet. A refusal stands only after two election
	// timeouts of refusals.
	deadline := time.Now().Add(2 * s.electionTimeout())
	for {
		var live []uint64
		for v, f := range st.Followers {
			if v == s.cfg.NodeID || f.Active {
				live = append(live, v)
			}
		}
		slices.Sort(live)
		err := quorumCheck(st.Voters, live, id, remove)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return nil, status.Errorf(codes.FailedPrecondition, "%s group: %v", gc.Name, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(s.electionTimeout() / 10):
		}
		if st = g.Status(); st.Role != "leader" || !slices.Equal(st.Voters, voters) {
			return nil, &raft.NotLeaderError{Group: gid, Leader: st.Leader}
		}
	}
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	var err error
	if remove {
		err, gc.Outcome = g.RemoveMember(ctx, id), "removed"
	} else {
		err, gc.Outcome = g.AddMember(ctx, id), "added"
	}
	if err != nil {
		return nil, err
	}
	return gc, nil
}

// changeGroup makes one membership change in group gid: here if this
// node leads it, else on its leader (ChangeGroupMember), retrying while
// the leadership moves, until ctx (or ProposeTimeout) ends.
func (s *Server) changeGroup(ctx context.Context, gid uint64, id uint64, remove bool) (*metapb.GroupChange, error) {
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	g := s.group(gid)
	var last error
	for {
		var gc *metapb.GroupChange
		var err error
		if !s.memGroup.IsLeader() {
			// A stale call (leadership moved): the new leader serializes.
			return nil, status.Errorf(codes.FailedPrecondition, "meta node %d no longer leads the members group (node %d does): retry there", s.cfg.NodeID, s.memGroup.Leader())
		}
		if g.IsLeader() {
			gc, err = s.changeLocal(ctx, gid, g, id, remove)
		} else if l := g.Leader(); l == 0 {
			err = fmt.Errorf("no leader known")
		} else {
			gc, err = s.askLeader(ctx, l, &metapb.ChangeGroupMemberRequest{Group: gid, Id: id, Remove: remove})
		}
		if err == nil {
			return gc, nil
		}
		if c := status.Code(err); c == codes.FailedPrecondition || c == codes.InvalidArgument || c == codes.PermissionDenied || c == codes.Unimplemented {
			return nil, err
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, status.Errorf(codes.Unavailable, "%s group: %v (last: %v)", groupName(gid), ctx.Err(), last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// askLeader sends a ChangeGroupMember to node leader.
func (s *Server) askLeader(ctx context.Context, leader uint64, req *metapb.ChangeGroupMemberRequest) (*metapb.GroupChange, error) {
	p, ok := s.peer(leader)
	if !ok || p.GRPCAddr == "" {
		return nil, fmt.Errorf("no gRPC address for node %d", leader)
	}
	conn, err := grpc.NewClient(p.GRPCAddr, s.cfg.TLS.GRPCDialOption(pki.RoleMeta))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return metapb.NewMembersClient(conn).ChangeGroupMember(ctx, req)
}

// checkJoinDir refuses to join with a data directory that holds state: a
// node that was a member keeps its log and votes (restart it without
// --join); one whose state is partly gone must not pretend to be new.
func checkJoinDir(fs vfs.FS, dir string) error {
	for _, sub := range []string{"raft", "namespace", "scm", "ca", "usertoken", "members", InitialMarker} {
		if _, err := fs.Stat(filepath.Join(dir, sub)); err == nil {
			return fmt.Errorf("meta: --join with data directory %s, which holds state (%s/): a node joins with an empty data directory; a member restarts without --join", dir, sub)
		} else if !errors.Is(err, fs2.ErrNotExist) {
			return fmt.Errorf("meta: --join: %w", err)
		}
	}
	return nil
}

// electionTimeout is the raft election timeout (TickInterval ×
// ElectionTicks, with raft's defaults).
func (s *Server) electionTimeout() time.Duration {
	if s.cfg.TickInterval < 0 {
		return time.Second // manual ticks (tests)
	}
	return cmp.Or(s.cfg.TickInterval, 100*time.Millisecond) * time.Duration(cmp.Or(s.cfg.ElectionTicks, 10))
}

// runMemberRecords: the members group's leader records in the table
// every voter it has heard from that has no row (the initial members of
// --peers), with its addresses from Peers. The row says the node has run:
// CheckNotWiped refuses to bootstrap a node whose ID has one.
func (s *Server) runMemberRecords(ctx context.Context) {
	t := time.NewTicker(max(s.electionTimeout(), 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		g := s.memGroup
		if !g.IsLeader() {
			continue
		}
		st := g.Status()
		for _, v := range st.Voters {
			if s.members.Get(v) != nil {
				continue
			}
			if f := st.Followers[v]; v != s.cfg.NodeID && (!f.Active || f.Match == 0) {
				continue
			}
			p, ok := s.staticPeer(v)
			m := &metapb.MemberInfo{Id: v, RaftAddr: p.RaftAddr, GrpcAddr: p.GRPCAddr}
			if !ok || validateMemberInfo(m) != nil {
				continue
			}
			cmd, err := proto.Marshal(&metapb.MembersCommand{Op: &metapb.MembersCommand_SetMember{SetMember: m}})
			if err != nil {
				continue
			}
			if _, err := propose(ctx, s, g, cmd); err != nil && ctx.Err() == nil {
				s.log.Debug("meta: recording a member", "id", v, "err", err)
			}
		}
	}
}

// CheckNotWiped is the guard against restarting a meta node under its
// old ID on an empty data directory (which would bootstrap the groups
// again, forgetting its votes and the entries it acknowledged): call it
// before the first start of a node whose data directory is empty, with
// the node's credentials and --peers. It asks the other members for
// their member table (a few seconds at most; nodes that do not answer are
// skipped, so it passes when no other member runs, as at a cluster's
// first start); if one records that this ID has run (or was removed), it
// refuses. See docs/ARCHITECTURE.md, "Meta membership".
//
// join (basalt meta --join): the ID must also be new to every group: it is
// refused if any answering member lists it as a voter of a group (a wiped
// member restarted with --join under its old ID would otherwise be taken
// back by the leaders with its vote and log forgotten), and if no member
// answers at all (a join needs the members up anyway).
func CheckNotWiped(ctx context.Context, creds *pki.Credentials, self uint64, peers map[uint64]Peer, timeout time.Duration, join bool) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	type answer struct {
		from    uint64
		row     *metapb.MemberInfo
		voter   string // a group that lists self as a voter
		refused bool   // the member refused this node's certificate at the handshake
		err     error
	}
	ch := make(chan answer, len(peers))
	n := 0
	for id, p := range peers {
		if id == self || p.GRPCAddr == "" {
			continue
		}
		n++
		go func() {
			conn, err := grpc.NewClient(p.GRPCAddr, creds.GRPCDialOption(pki.RoleMeta))
			if err != nil {
				ch <- answer{from: id, err: err}
				return
			}
			defer conn.Close()
			r, err := metapb.NewMembersClient(conn).ListMembers(ctx, &metapb.ListMembersRequest{})
			a := answer{from: id, err: err}
			if status.Code(err) == codes.PermissionDenied && strings.Contains(err.Error(), "was removed from the cluster") {
				// A removed node's certificate is refused (auth.go).
				a.row = &metapb.MemberInfo{Id: self, Removed: true}
			}
			// The TLS alert of a member that refuses the certificate: a
			// removed node's are revoked (members_revoke.go), so its
			// handshakes fail before any RPC could say so.
			a.refused = err != nil && strings.Contains(err.Error(), "tls: bad certificate")
			for _, m := range r.GetMembers() {
				if err == nil && m.GetId() == self && m.GetSource() == "table" {
					a.row = m
				}
			}
			for _, g := range r.GetGroups() {
				if slices.Contains(g.GetVoters(), self) {
					a.voter = g.GetName()
				}
			}
			ch <- a
		}()
	}
	answered := 0
	var lastErr error
	for ; n > 0; n-- {
		a := <-ch
		if a.err == nil {
			answered++
		} else {
			lastErr = a.err
		}
		switch {
		case a.row.GetRemoved():
			return fmt.Errorf("meta: node %d was removed from the cluster (member table of node %d): it may not run again under this ID; join a new node with a new ID (basalt meta --join, basalt admin meta add)", self, a.from)
		case a.refused:
			return fmt.Errorf("meta: node %d: member %d refuses this node's certificate at the TLS handshake (%v): the node was removed from the cluster (a removed node's certificates are revoked; it may not run again under this ID: join a new node with a new ID), or its certificate was revoked or names a wrong role or identity (a certificate from another CA is refused with \"unknown certificate authority\", not matched here)", self, a.from, a.err)
		case a.row != nil && join:
			return fmt.Errorf("meta: --join as node %d, but node %d's member table already has a row for it: the ID has been used (or added before this node ever started). Join under a new ID; remove this one first if it is a voter (basalt admin meta remove %d)", self, a.from, self)
		case a.row != nil:
			return fmt.Errorf("meta: node %d has run in this cluster before (member table of node %d), but its data directory is empty: its votes and the entries it acknowledged are gone, and bootstrapping it again could lose committed metadata. Remove it (basalt admin meta remove %d) and join a replacement with a new ID (basalt meta --join; docs/ARCHITECTURE.md, \"Meta membership\")", self, a.from, self)
		case a.voter != "" && join:
			return fmt.Errorf("meta: --join as node %d, but node %d lists it as a voter of the %s group: a member may not join again on an empty directory (its votes and log are gone). Remove it (basalt admin meta remove %d) and join under a new ID", self, a.from, a.voter, self)
		}
	}
	if join && answered == 0 {
		return fmt.Errorf("meta: --join as node %d: no member of --peers answered (to check that the ID is new): %v", self, lastErr)
	}
	return nil
}
