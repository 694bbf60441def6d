package scm

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Reports against replicas (a client's read, a datanode's scrubber found
// a replica failing its checksums) are recorded through Raft
// (ReplicaReportsOp), so they survive a leader change and a restart, and
// are listed. Only the datanode holding the replica condemns it: its own
// report (authenticated by its certificate: its scrubber, or its
// re-verification of a block a read found damaged) queues the replica to
// be recorded unhealthy (ReplicaCorrupt), which the replication manager
// repairs, as its UNHEALTHY container report does. A client's report does
// not: a faulty client (or network path, or a forged report) must not
// condemn healthy replicas. The datanode re-verifies on its own what a
// client read found damaged (a read that fails its checksums there makes
// the block a scrubber "suspect", internal/datanode/scrub.go), and
// reports what it confirms. Each reporter is rate-limited here, before
// anything is proposed; State bounds what is stored.

// Rate limit of one reporter: reportBurst at once, then reportRate per
// second. At most maxReporters are tracked (the map is reset when full:
// a reporter then gets a fresh burst, which the total cap still bounds).
const (
	reportRate   = 10.0
	reportBurst  = 50.0
	maxReporters = 1024
)

type bucket struct {
	tokens float64
	at     time.Time
}

// allowReport takes a token from reporter's bucket. Callers hold m.mu.
func (m *Manager) allowReport(reporter string, now time.Time) bool {
	if m.reporters == nil || len(m.reporters) >= maxReporters {
		m.reporters = map[string]*bucket{}
	}
	b := m.reporters[reporter]
	if b == nil {
		b = &bucket{tokens: reportBurst, at: now}
		m.reporters[reporter] = b
	}
	b.tokens = min(reportBurst, b.tokens+now.Sub(b.at).Seconds()*reportRate)
	b.at = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// ReportCorrupt records a report that datanode dn's replica of a block
// failed its checksums. reporter names who reports it (for the rate limit
// and the record). byHolder: the caller is datanode dn itself,
// authenticated by its certificate; only then is the replica condemned
// (recorded unhealthy, then replaced). A report from anyone else is kept
// as a record only: the datanode confirms or not.
func (m *Manager) ReportCorrupt(ctx context.Context, req *metapb.ReportCorruptReplicaRequest, reporter string, byHolder bool) error {
	cid, lid, dn := req.GetBlock().GetContainerId(), req.GetBlock().GetLocalId(), req.GetDatanodeId()
	if cid == 0 || lid == 0 || dn == 0 {
		// Block local ID 0 is never allocated; {cid, 0, dn} is the key of
		// SCM's own record of why it recorded the replica unhealthy, which
		// a report must not overwrite.
		return status.Errorf(codes.InvalidArgument, "report corrupt replica: block (container and local ID) and datanode_id are required (got block %v, datanode %d)", req.GetBlock(), dn)
	}
	c := m.st.Container(cid)
	if c == nil {
		return status.Errorf(codes.NotFound, "report corrupt replica: container %d not found", cid)
	}
	if !slices.Contains(c.Replicas, dn) {
		return status.Errorf(codes.FailedPrecondition, "report corrupt replica: datanode %d is not a replica of container %d (replicas %v)", dn, cid, c.Replicas)
	}
	m.mu.Lock()
	if !m.syncLeadership() {
		m.mu.Unlock()
		return notLeader()
	}
	ok := m.allowReport(reporter, m.cfg.Now())
	m.mu.Unlock()
	if !ok {
		return status.Errorf(codes.ResourceExhausted, "report corrupt replica: %s reports faster than %.0f per second", reporter, reportRate)
	}
	r := &metapb.CorruptReplica{Block: &metapb.BlockID{ContainerId: cid, LocalId: lid}, DatanodeId: dn, Reason: cleanReason(req.GetReason(), maxReasonBytes), Reporter: cleanReason(reporter, maxReasonBytes)}
	res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaReports{ReplicaReports: &metapb.ReplicaReportsOp{Reports: []*metapb.CorruptReplica{r}}}})
	if err != nil {
		return err
	}
	if n, _ := res.(int); n == 0 {
		m.log.Warn("scm: corrupt replica report not stored (store full, or the replica is gone)", "container", cid, "datanode", dn, "stored", m.st.ReplicaReportCount())
	}
	if !byHolder {
		m.log.Warn("scm: corrupt replica reported by a client; recorded, the replica is condemned only if its datanode confirms it",
			"container", cid, "datanode", dn, "reporter", reporter)
		return nil
	}
	m.ReplicaCorrupt(cid, dn, fmt.Sprintf("block %d: %s", lid, req.GetReason()))
	return nil
}

// Replicas returns container cid's replicas with their health as this
// leader counts them and the reports against them; cid 0: up to limit
// containers that have a report or a replica that does not count.
func (m *Manager) Replicas(cid uint64, limit int) (*metapb.GetContainerReplicasResponse, error) {
	if limit <= 0 {
		limit = 100
	}
	limit = min(limit, 1000)
	var cs []*metapb.Container
	if cid != 0 {
		c := m.st.Container(cid)
		if c == nil {
			return nil, status.Errorf(codes.NotFound, "container %d not found", cid)
		}
		cs = []*metapb.Container{c}
	}
	reports := m.st.ReplicaReports(cid)
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return nil, notLeader()
	}
	resp := &metapb.GetContainerReplicasResponse{}
	if cid == 0 {
		with := map[uint64]bool{}
		for _, r := range reports {
			with[r.Block.ContainerId] = true
		}
		for _, h := range m.repl.all {
			with[h.ContainerId] = true
		}
		// And those with a replica that does not count as healthy now
		// (a lagging one, one on a datanode leaving service, ...).
		for _, c := range m.st.Containers() {
			if c.State != metapb.ContainerState_CONTAINER_CLOSED || with[c.Id] || c.UsedBytes == 0 && !reportedAny(m, c) {
				continue
			}
			for _, r := range c.Replicas {
				if m.replicaStatusLocked(c, r) != ReplicaHealthy {
					with[c.Id] = true
					break
				}
			}
		}
		for id := range with {
			if c := m.st.Container(id); c != nil {
				cs = append(cs, c)
			}
		}
		slices.SortFunc(cs, func(a, b *metapb.Container) int { return cmp.Compare(a.Id, b.Id) })
		if len(cs) > limit {
			cs, resp.Truncated = cs[:limit], true
		}
	}
	byC := map[uint64][]*metapb.CorruptReplica{}
	for _, r := range reports {
		byC[r.Block.ContainerId] = append(byC[r.Block.ContainerId], r)
	}
	for _, c := range cs {
		cr := &metapb.ContainerReplicas{Container: c, Reports: byC[c.Id]}
		if c.State == metapb.ContainerState_CONTAINER_CLOSED {
			cr.Health = Classify(c, func(dn uint64) ReplicaStatus { return m.replicaStatusLocked(c, dn) }).Health
		}
		for _, r := range c.Replicas {
			ri := &metapb.ReplicaInfo{DatanodeId: r, Health: m.replicaStatusLocked(c, r).String(), OpState: m.st.OpState(r).State}
			if ri.OpState == metapb.NodeOpState_NODE_OP_STATE_UNSPECIFIED {
				ri.OpState = metapb.NodeOpState_IN_SERVICE
			}
			if n := m.nodes[r]; n != nil {
				ri.NodeState = n.state
				if ri.NodeState == metapb.NodeState_STALE && ri.Health == ReplicaHealthy.String() {
					ri.Health = "stale"
				}
				if rep := n.containers[c.Id]; rep != nil {
					ri.ReportedState, ri.Bcsid, ri.UsedBytes, ri.BlockCount = rep.State, rep.Bcsid, rep.UsedBytes, rep.BlockCount
					ri.UnhealthyReason = rep.UnhealthyReason
				}
			}
			cr.Replicas = append(cr.Replicas, ri)
		}
		resp.Containers = append(resp.Containers, cr)
	}
	return resp, nil
}
