package meta

// Upgrades of the metadata service (docs/ARCHITECTURE.md, "Upgrades";
// namespace/layout.go for layout versions and the apply halt).
//
// This file is the server's part: the Upgrade gRPC service (status of
// every member, finalize), the record of a fresh cluster's layout, and
// what a replica whose namespace apply halted does: it refuses reads and
// proposals (UNAVAILABLE, ReasonReplicaHalted: a client tries another
// replica) and gives up leadership (a halted leader's state stops before
// the halt index, so it can neither serve reads nor see its proposals
// applied; it transfers leadership to another member, again whenever it
// is elected). The rest of the process (SCM, CA, user tokens) stays up.
//
// The other groups (SCM, CA, user tokens) halt alike (applyhalt): a
// halted group refuses its reads and proposals on this replica
// (ReasonReplicaHalted) and gives up its leadership to a replica that
// can lead the group (none: it keeps it). While its SCM group is halted,
// a replica also gives up the namespace's leadership, to a replica
// halted in neither (namespace reads attach SCM state from the local
// replica); a CA or user-token halt leaves the namespace alone. The SCM
// and user-token leaders follow the namespace leader, but not to a
// replica halted in their group (colocate, runUserTokens).

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
)

func init() {
	adminMethods[metapb.Upgrade_FinalizeLayout_FullMethodName] = true
	// Status fans out to every member: operators (and meta nodes) only.
	adminMethods[metapb.Upgrade_GetLayoutStatus_FullMethodName] = true
}

// setupUpgrade wires the namespace state's halt to the log and metrics and
// registers the Upgrade service. Called by New.
func (s *Server) setupUpgrade(reg prometheus.Registerer) {
	report := func(h namespace.Halt) {
		s.log.Error("meta: namespace apply HALTED: this replica cannot apply a committed entry; upgrade this replica's binary and restart it (it resumes from that entry)",
			"index", h.Index, "op", h.Op, "reason", h.Reason)
	}
	s.nsState.OnHalt(report)
	if h := s.nsState.Halted(); h != nil {
		report(*h)
	}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "basalt", Subsystem: "meta", Name: "namespace_apply_halted_index",
		Help: "The namespace log entry this replica stopped applying at (a command its binary cannot apply: upgrade it); 0 while it applies.",
	}, func() float64 {
		if h := s.nsState.Halted(); h != nil {
			return float64(h.Index)
		}
		return 0
	}), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "basalt", Subsystem: "meta", Name: "layout_version",
		Help:        "Layout versions: software (this binary supports) and finalized (the cluster's, as this replica applied it).",
		ConstLabels: prometheus.Labels{"kind": "software"},
	}, func() float64 { return float64(s.nsState.SupportedLayout()) }), prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "basalt", Subsystem: "meta", Name: "layout_version",
		Help:        "Layout versions: software (this binary supports) and finalized (the cluster's, as this replica applied it).",
		ConstLabels: prometheus.Labels{"kind": "finalized"},
	}, func() float64 { return float64(s.nsState.FinalizedLayout()) }))
	for _, g := range s.haltGroups() {
		report := func(h applyhalt.Halt) {
			s.log.Error("meta: "+g.name+" apply HALTED: this replica cannot apply a committed entry; if the reason names an op or field unknown to this binary, upgrade it and restart it (it resumes from that entry); an entry that does not decode under a current binary is damaged, and an upgrade does not cure it (docs/ARCHITECTURE.md, Upgrades)",
				"group", g.name, "index", h.Index, "op", h.Op, "reason", h.Reason)
		}
		g.halt.OnHalt(report)
		if h := g.halt.Halted(); h != nil {
			report(*h)
		}
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: "basalt", Subsystem: "meta", Name: "apply_halted_index",
			Help:        "The log entry of the group (scm, ca, usertoken) this replica stopped applying at (a command its binary cannot apply: upgrade it); 0 while it applies. The namespace's: basalt_meta_namespace_apply_halted_index.",
			ConstLabels: prometheus.Labels{"group": g.name},
		}, func() float64 {
			if h := g.halt.Halted(); h != nil {
				return float64(h.Index)
			}
			return 0
		}))
	}
	metapb.RegisterUpgradeServer(s.grpc, &upgradeServer{s: s})
}

// haltGroup is a group other than the namespace whose apply can halt.
type haltGroup struct {
	id    uint64
	name  string
	halt  *applyhalt.Group
	group func() *raft.Group // set by Start
}

// haltGroups: SCM, CA, user tokens.
func (s *Server) haltGroups() []haltGroup {
	return []haltGroup{
		{ScmGroup, "scm", s.scmState.Halt(), func() *raft.Group { return s.scmGroup }},
		{CaGroup, "ca", s.ca.state.halt, func() *raft.Group { return s.ca.group }},
		{UserTokenGroup, "usertoken", s.ut.halt, func() *raft.Group { return s.utGroup }},
	}
}

// groupHaltedErr refuses a read or proposal of a halted group (SCM, CA,
// user tokens) on this replica: UNAVAILABLE, ReasonReplicaHalted (a
// client tries another replica).
func (s *Server) groupHaltedErr(name string, g *applyhalt.Group) error {
	h := g.Halted()
	if h == nil {
		return nil
	}
	st, _ := status.Newf(codes.Unavailable, "meta node %d: %s replica halted at entry %d (%s); another replica can answer", s.cfg.NodeID, name, h.Index, h.Reason).
		WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonReplicaHalted, Domain: metapb.ReasonDomain})
	return st.Err()
}

// handOver transfers g's leadership to a voter that can lead it: one
// that answers its layout status and is halted neither in the group
// (name) nor in the others listed in also. If there is none (every live
// replica halted too), this replica keeps the leadership: a transfer to
// a halted or dead replica would only come back, and etcd raft drops
// proposals while a transfer is pending (review drift 1).
func (s *Server) handOver(ctx context.Context, g *raft.Group, name string, also ...string) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var to uint64
	for _, r := range s.memberLayouts(ctx) {
		if r.NodeId == s.cfg.NodeID || r.Error != "" || !slices.Contains(g.Voters(), r.NodeId) || layoutHalted(r, name) {
			continue
		}
		if slices.ContainsFunc(also, func(n string) bool { return layoutHalted(r, n) }) {
			continue
		}
		to = r.NodeId
		break
	}
	if to == 0 {
		if time.Since(s.lastKeepLog) > 10*time.Second {
			s.lastKeepLog = time.Now()
			s.log.Warn("meta: " + name + " replica halted, but no other replica can lead the group (all halted or unreachable): keeping its leadership")
		}
		return
	}
	s.log.Warn("meta: "+name+" replica halted: transferring leadership", "to", to)
	g.TransferLeader(to)
}

// layoutHalted: the replica r is halted in group name ("namespace",
// "scm", "ca", "usertoken").
func layoutHalted(r *metapb.ReplicaLayout, name string) bool {
	if name == "namespace" {
		return r.HaltedIndex != 0 || r.HaltedReason != ""
	}
	return slices.ContainsFunc(r.GroupHalts, func(h *metapb.GroupHalt) bool { return h.Group == name })
}

// peerHaltedIn: replica id says it is halted in group name. Asked before
// colocating a group's leadership on it (the SCM and user-token leaders
// follow the namespace leader, but not to a replica that cannot lead
// them); a replica that does not answer counts as not halted (raft
// decides).
func (s *Server) peerHaltedIn(ctx context.Context, id uint64, name string) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	r := s.askLayout(ctx, id)
	return r.Error == "" && layoutHalted(r, name)
}

// haltedErr refuses a namespace read or proposal on a halted replica.
func (s *Server) haltedErr() error {
	h := s.nsState.Halted()
	if h == nil {
		return nil
	}
	st, _ := status.Newf(codes.Unavailable, "meta node %d: namespace replica halted at entry %d (%s); another replica can answer", s.cfg.NodeID, h.Index, h.Reason).
		WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonReplicaHalted, Domain: metapb.ReasonDomain})
	return st.Err()
}

// runUpgrade: a halted leader steps down; a fresh cluster's leader records
// the layout every member supports.
func (s *Server) runUpgrade(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	lastInit, used := time.Time{}, false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, hg := range s.haltGroups() {
			if g := hg.group(); hg.halt.Halted() != nil && g.IsLeader() {
				s.handOver(ctx, g, hg.name)
			}
		}
		g := s.nsGroup
		if !g.IsLeader() {
			continue
		}
		if s.nsState.Halted() != nil {
			s.handOver(ctx, g, "namespace")
			continue
		}
		if s.scmState.Halt().Halted() != nil {
			// Namespace reads attach SCM state from this replica (the read
			// barrier refuses while SCM is halted): the namespace goes to
			// a replica that can serve both, if there is one. A CA or
			// user-token halt leaves the namespace where it is.
			s.handOver(ctx, g, "namespace", "scm")
			continue
		}
		if !used && !s.nsState.LayoutRecorded() && time.Since(lastInit) > 2*time.Second {
			if used = !s.nsState.Empty(); used {
				continue // a namespace never empties again
			}
			lastInit = time.Now()
			if err := s.initLayout(ctx); err != nil && ctx.Err() == nil {
				s.log.Debug("meta: recording the new cluster's layout version", "err", err)
			}
		}
	}
}

// runRevocationPull: while the CA group is halted here, its applied
// revocations stop at the halt. The committed entries past it are read
// for their revocations (caState.scanPastHalt); an op this binary does
// not know cannot be, so the node also takes the revocation list from
// another replica, at once when the group halts (a poll every 100 ms)
// and every 2 s after. Its own goroutine: a slow peer delays no
// hand-over. (A halted replica's own GetRevocations refuses with
// ReasonReplicaHalted: the client asks another.)
func (s *Server) runRevocationPull(ctx context.Context) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.ca.state.halt.Halted() == nil || time.Since(last) < 2*time.Second {
			continue
		}
		last = time.Now()
		s.pullRevocations(ctx)
	}
}

// pullRevocations takes the revocation list from another replica.
func (s *Server) pullRevocations(ctx context.Context) {
	if s.fwd() == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	r, err := s.fwd().Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{})
	if err != nil {
		s.log.Warn("meta: CA replica halted: the revocation list could not be fetched from another replica (revocations by ops this binary knows are read from the local log)", "err", err)
		return
	}
	s.ca.state.setPulled(r.Serials)
}

// awaitLayout records a fresh cluster's layout before its first write
// (namespace.Config.AwaitLayout): the leader asks the members and
// proposes the LayoutOp, waiting at most 5 s; should that fail (a member
// not answering), the write goes on and the cluster stays at layout 1
// until `basalt admin upgrade finalize`. One at a time; on a follower,
// nothing (writes are proposed by the leader).
func (s *Server) awaitLayout(ctx context.Context) {
	if !s.nsGroup.IsLeader() {
		return
	}
	s.layoutInitMu.Lock()
	defer s.layoutInitMu.Unlock()
	if s.nsState.LayoutRecorded() || !s.nsState.Empty() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.initLayout(ctx); err != nil && ctx.Err() == nil {
		s.log.Warn("meta: recording the new cluster's layout version before its first write", "err", err)
	}
}

// initLayout records a fresh cluster's layout version: the lowest every
// member supports (a member that does not answer, or an older binary
// without the Upgrade service, leaves it unrecorded, i.e. layout 1).
func (s *Server) initLayout(ctx context.Context) error {
	reps := s.memberLayouts(ctx)
	v := uint32(namespace.MaxLayoutVersion)
	for _, r := range reps {
		if r.Error != "" {
			return fmt.Errorf("member %d: %s", r.NodeId, r.Error)
		}
		v = min(v, r.SoftwareVersion)
	}
	_, err := s.proposeLayout(ctx, &metapb.LayoutOp{Version: v, Init: true, Replicas: reps})
	return err
}

func (s *Server) proposeLayout(ctx context.Context, op *metapb.LayoutOp) (uint32, error) {
	if err := namespace.CheckLayoutOp(op); err != nil {
		return 0, err // before the log: above this binary it would halt every replica
	}
	if op.Version > s.nsState.SupportedLayout() {
		return 0, status.Errorf(codes.FailedPrecondition, "meta node %d: layout %d is above this binary's (%d)", s.cfg.NodeID, op.Version, s.nsState.SupportedLayout())
	}
	cmd, err := proto.Marshal(&metapb.NsCommand{NowUnixMs: time.Now().UnixMilli(), Op: &metapb.NsCommand_Layout{Layout: op}})
	if err != nil {
		return 0, err
	}
	// Through nsRaft: refused on a halted replica, and ErrHalted is
	// outcome-unknown (the others may have applied it).
	res, err := (&nsRaft{s}).Propose(ctx, cmd)
	if err != nil {
		return 0, err
	}
	v, _ := res.(uint32)
	return v, nil
}

// selfLayout is this replica's ReplicaLayout.
func (s *Server) selfLayout() *metapb.ReplicaLayout {
	r := &metapb.ReplicaLayout{NodeId: s.cfg.NodeID, SoftwareVersion: s.nsState.SupportedLayout(),
		AppliedIndex: s.nsState.AppliedIndex(), FinalizedVersion: s.nsState.FinalizedLayout(), Addr: s.GRPCAddr()}
	if h := s.nsState.Halted(); h != nil {
		r.HaltedIndex, r.HaltedReason = h.Index, h.Reason
	}
	for _, g := range s.haltGroups() {
		if h := g.halt.Halted(); h != nil {
			r.GroupHalts = append(r.GroupHalts, &metapb.GroupHalt{Group: g.name, Index: h.Index, Op: h.Op, Reason: h.Reason})
		}
	}
	return r
}

// memberLayouts asks every voter of the namespace group (this one
// included) for its ReplicaLayout; one that cannot be asked has Error set.
func (s *Server) memberLayouts(ctx context.Context) []*metapb.ReplicaLayout {
	voters := s.nsGroup.Voters()
	out := make([]*metapb.ReplicaLayout, len(voters))
	var wg sync.WaitGroup
	for i, id := range voters {
		if id == s.cfg.NodeID {
			out[i] = s.selfLayout()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = s.askLayout(ctx, id)
		}()
	}
	wg.Wait()
	slices.SortFunc(out, func(a, b *metapb.ReplicaLayout) int { return int(a.NodeId) - int(b.NodeId) })
	return out
}

// askLayout is one member's GetLayoutStatus (a peer RPC, 5 s at most).
func (s *Server) askLayout(ctx context.Context, id uint64) *metapb.ReplicaLayout {
	fail := func(format string, args ...any) *metapb.ReplicaLayout {
		return &metapb.ReplicaLayout{NodeId: id, Error: fmt.Sprintf(format, args...)}
	}
	p, ok := s.peer(id)
	if !ok || p.GRPCAddr == "" {
		return fail("no gRPC address known")
	}
	cc, err := grpc.NewClient(p.GRPCAddr, s.cfg.TLS.GRPCDialOption(pki.RoleMeta))
	if err != nil {
		return fail("%v", err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := metapb.NewUpgradeClient(cc).GetLayoutStatus(ctx, &metapb.GetLayoutStatusRequest{})
	if status.Code(err) == codes.Unimplemented {
		return fail("an older binary without layout versions (layout 1): upgrade it")
	}
	if err != nil {
		return fail("%v", err)
	}
	r := resp.GetSelf()
	if r == nil || r.NodeId != id || r.SoftwareVersion == 0 || r.SoftwareVersion > namespace.MaxLayoutVersion {
		return fail("answered an invalid layout report (node %d, version %d)", r.GetNodeId(), r.GetSoftwareVersion())
	}
	r.Addr = p.GRPCAddr
	if len(r.HaltedReason) > 1024 {
		r.HaltedReason = r.HaltedReason[:1024]
	}
	if len(r.GroupHalts) > 8 {
		r.GroupHalts = r.GroupHalts[:8]
	}
	for _, h := range r.GroupHalts {
		if len(h.Group) > 32 {
			h.Group = h.Group[:32]
		}
		if len(h.Reason) > 1024 {
			h.Reason = h.Reason[:1024]
		}
	}
	r.Error = ""
	return r
}

type upgradeServer struct {
	metapb.UnimplementedUpgradeServer
	s *Server
}

func (u *upgradeServer) GetLayoutStatus(ctx context.Context, req *metapb.GetLayoutStatusRequest) (*metapb.GetLayoutStatusResponse, error) {
	s := u.s
	resp := &metapb.GetLayoutStatusResponse{Self: s.selfLayout(), FinalizedVersion: s.nsState.FinalizedLayout()}
	for _, f := range namespace.LayoutFeatures() {
		resp.Features = append(resp.Features, &metapb.LayoutFeature{Name: f.Name, Version: f.Version, Description: f.Description,
			Finalized: f.Version <= resp.FinalizedVersion})
	}
	if req.All {
		resp.Replicas = s.memberLayouts(ctx)
	}
	return resp, nil
}

// FinalizeLayout records a higher finalized layout version once every
// member supports it (Ozone's finalize: from then on the new commands may
// be proposed, and no binary below it may rejoin).
func (u *upgradeServer) FinalizeLayout(ctx context.Context, req *metapb.FinalizeLayoutRequest) (*metapb.FinalizeLayoutResponse, error) {
	s := u.s
	if err := s.haltedErr(); err != nil {
		return nil, err
	}
	if !s.nsGroup.IsLeader() {
		return nil, &raft.NotLeaderError{Group: NamespaceGroup, Leader: s.nsGroup.Leader()}
	}
	target := req.Version
	if target == 0 {
		target = s.nsState.SupportedLayout()
	}
	if target > s.nsState.SupportedLayout() {
		return nil, status.Errorf(codes.FailedPrecondition, "meta node %d: layout %d is above this leader's binary (%d)", s.cfg.NodeID, target, s.nsState.SupportedLayout())
	}
	reps := s.memberLayouts(ctx)
	var missing []string
	for _, r := range reps {
		switch {
		case r.Error != "":
			missing = append(missing, fmt.Sprintf("node %d: %s", r.NodeId, r.Error))
		case r.HaltedIndex != 0:
			missing = append(missing, fmt.Sprintf("node %d halted at entry %d: %s", r.NodeId, r.HaltedIndex, r.HaltedReason))
		case r.SoftwareVersion < target:
			missing = append(missing, fmt.Sprintf("node %d supports layout %d", r.NodeId, r.SoftwareVersion))
		}
	}
	if len(missing) > 0 {
		return &metapb.FinalizeLayoutResponse{FinalizedVersion: s.nsState.FinalizedLayout(), Replicas: reps},
			status.Errorf(codes.FailedPrecondition, "meta node %d: cannot finalize layout %d: not every member supports it (%v)", s.cfg.NodeID, target, missing)
	}
	if target <= s.nsState.FinalizedLayout() {
		return &metapb.FinalizeLayoutResponse{FinalizedVersion: s.nsState.FinalizedLayout(), Replicas: reps}, nil
	}
	v, err := s.proposeLayout(ctx, &metapb.LayoutOp{Version: target, Replicas: reps})
	if err != nil {
		return nil, err
	}
	s.log.Info("meta: layout finalized", "version", v)
	return &metapb.FinalizeLayoutResponse{FinalizedVersion: v, Replicas: reps}, nil
}
