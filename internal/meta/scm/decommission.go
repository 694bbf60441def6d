package scm

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Decommission and maintenance (Ozone's NodeDecommissionManager). An
// operator sets a datanode's operational state through Raft
// (SetDatanodeOpState); the leader acts on it every round:
//
//   - DECOMMISSIONING and ENTERING_MAINTENANCE: the datanode gets no new
//     pipelines and no new blocks; its open pipelines are closed (their
//     open containers close through the pipelines' logs, CLOSING ->
//     CLOSED, and new pipelines replace them on the other datanodes).
//   - The replication manager does not count its replicas toward a
//     container's factor, but copies from them when they are live.
//   - DECOMMISSIONING -> DECOMMISSIONED once no container holding data
//     lists it: each got its full count of healthy replicas elsewhere,
//     and then its replica here was dropped (and deleted).
//   - ENTERING_MAINTENANCE -> IN_MAINTENANCE once each of its containers
//     has min(2, factor) healthy replicas elsewhere. Its replicas are
//     kept: the datanode may go down without repairs, and comes back
//     into service at the end time or on recommission, when one replica
//     too many is dropped again.
//
// The transitions are proposed with the state they expect, so an
// operator's recommission in between is never undone.

// inService reports whether datanode dn takes new pipelines and blocks.
func (m *Manager) inService(dn uint64) bool {
	st := m.st.OpState(dn).State
	return st == metapb.NodeOpState_IN_SERVICE || st == metapb.NodeOpState_NODE_OP_STATE_UNSPECIFIED
}

func isMaintenance(st metapb.NodeOpState) bool {
	return st == metapb.NodeOpState_ENTERING_MAINTENANCE || st == metapb.NodeOpState_IN_MAINTENANCE
}

func isDecommission(st metapb.NodeOpState) bool {
	return st == metapb.NodeOpState_DECOMMISSIONING || st == metapb.NodeOpState_DECOMMISSIONED
}

// lostMembers returns the OPEN pipelines that lost a member, and why: a
// member is dead or stale, leaves service, or holds a replica recorded
// unhealthy of one of the pipeline's unclosed containers.
func (m *Manager) lostMembers(stale, dead []uint64) ([]uint64, string) {
	var out []uint64
	var whys []string
	unhealthyOn := map[uint64][]uint64{} // pipeline -> datanodes
	for _, c := range m.st.ClosingContainers() {
		if len(c.UnhealthyReplicas) > 0 {
			unhealthyOn[c.PipelineId] = append(unhealthyOn[c.PipelineId], c.UnhealthyReplicas...)
		}
	}
	for _, p := range slices.Concat(m.st.OpenPipelines(metapb.Replication_ONE), m.st.OpenPipelines(metapb.Replication_THREE)) {
		why := ""
		for _, id := range p.Datanodes {
			switch {
			case slices.Contains(dead, id):
				why = fmt.Sprintf("datanode %d dead", id)
			case slices.Contains(stale, id):
				why = fmt.Sprintf("datanode %d stale", id)
			case !m.inService(id):
				why = fmt.Sprintf("datanode %d %v", id, m.st.OpState(id).State)
			case slices.Contains(unhealthyOn[p.Id], id):
				why = fmt.Sprintf("datanode %d holds an unhealthy replica", id)
			default:
				continue
			}
			break
		}
		if why != "" {
			out = append(out, p.Id)
			if len(whys) < 8 {
				whys = append(whys, fmt.Sprintf("pipeline %d: %s", p.Id, why))
			}
		}
	}
	return out, fmt.Sprint(whys)
}

// stillClosing reports whether datanode n should keep its replica of
// closed pipeline p a while longer: it still reports one of p's
// containers open or closing, and p closed less than two command retry
// intervals ago. The containers then close through p's log, so every
// replica closes after the same last write; after that the pipeline goes
// anyway (a replica left behind is lagging and replaced). Callers hold
// m.mu.
func (m *Manager) stillClosing(p *metapb.Pipeline, n *nodeSoft, now time.Time) bool {
	if now.UnixMilli()-p.ClosedUnixMs >= (2 * m.cfg.CommandRetryInterval).Milliseconds() {
		return false
	}
	for cid, rep := range n.containers {
		if rep.State != metapb.ContainerState_CONTAINER_OPEN && rep.State != metapb.ContainerState_CONTAINER_CLOSING {
			continue
		}
		if c := m.st.Container(cid); c != nil && c.PipelineId == p.Id {
			return true
		}
	}
	return false
}

// closeUnreportedLocked tells datanode dn to close the CLOSING containers
// of pipelines it is still in that its last full report did not list (a
// replica created since, or not reported yet): closing goes through the
// pipeline's log, proposed by its leader, so telling every member is
// what makes sure the leader hears it. Callers hold m.mu.
func (m *Manager) closeUnreportedLocked(dn uint64, n *nodeSoft, due func(string) bool, cmds []*metapb.DatanodeCommand) []*metapb.DatanodeCommand {
	for _, c := range m.st.ClosingContainers() {
		if !n.pipelines[c.PipelineId] || n.containers[c.Id] != nil || !slices.Contains(c.Replicas, dn) {
			continue
		}
		if due("xc" + strconv.FormatUint(c.Id, 10)) {
			cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CloseContainer{CloseContainer: &metapb.CloseContainerCommand{ContainerId: c.Id, PipelineId: c.PipelineId}}})
		}
	}
	return cmds
}

// SetOpState decommissions, puts into maintenance or recommissions a
// datanode.
func (m *Manager) SetOpState(ctx context.Context, req *metapb.SetDatanodeOpStateRequest) (*metapb.DatanodeStatus, error) {
	switch req.State {
	case metapb.NodeOpState_IN_SERVICE, metapb.NodeOpState_DECOMMISSIONING, metapb.NodeOpState_ENTERING_MAINTENANCE:
	default:
		return nil, status.Errorf(codes.InvalidArgument, "datanode %d: state %v: want IN_SERVICE, DECOMMISSIONING or ENTERING_MAINTENANCE", req.DatanodeId, req.State)
	}
	if m.st.Datanode(req.DatanodeId) == nil {
		return nil, status.Errorf(codes.NotFound, "datanode %d not registered", req.DatanodeId)
	}
	if req.MaintenanceEndUnixMs != 0 {
		if req.State != metapb.NodeOpState_ENTERING_MAINTENANCE {
			return nil, status.Errorf(codes.InvalidArgument, "datanode %d: an end time is for maintenance only", req.DatanodeId)
		}
		if req.MaintenanceEndUnixMs <= m.cfg.Now().UnixMilli() {
			return nil, status.Errorf(codes.InvalidArgument, "datanode %d: maintenance end %s is not in the future", req.DatanodeId, time.UnixMilli(req.MaintenanceEndUnixMs).UTC().Format(time.RFC3339))
		}
	}
	cur := m.st.OpState(req.DatanodeId).State
	op := &metapb.SetNodeOpStateOp{DatanodeId: req.DatanodeId, State: req.State, MaintenanceEndUnixMs: req.MaintenanceEndUnixMs}
	switch {
	case req.State == metapb.NodeOpState_DECOMMISSIONING && isDecommission(cur):
		op = nil // already on its way out (or out)
	case req.State == metapb.NodeOpState_ENTERING_MAINTENANCE && cur == metapb.NodeOpState_IN_MAINTENANCE:
		op.State = cur // a new end time
	case req.State == metapb.NodeOpState_ENTERING_MAINTENANCE && isDecommission(cur):
		return nil, status.Errorf(codes.FailedPrecondition, "datanode %d is %v: recommission it first", req.DatanodeId, cur)
	}
	if op != nil {
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_SetNodeOpState{SetNodeOpState: op}}); err != nil {
			return nil, err
		}
		m.log.Info("scm: datanode operational state set", "datanode", req.DatanodeId, "from", cur, "to", op.State, "maintenance_end_ms", op.MaintenanceEndUnixMs)
	}
	resp, err := m.ListDatanodes()
	if err != nil {
		return nil, err
	}
	for _, d := range resp.Datanodes {
		if d.GetDetails().GetId() == req.DatanodeId {
			return d, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "datanode %d not registered", req.DatanodeId)
}

// drainStat is a datanode's drain progress at the last replication round.
type drainStat struct {
	containers int    // containers holding data with a replica on it
	left       int    // of those, still short of replicas elsewhere
	bytesLeft  uint64 // their bytes
}

// fillOpStatus adds the operational state and drain progress to a
// datanode's status. Callers hold m.mu.
func (m *Manager) fillOpStatus(ds *metapb.DatanodeStatus) {
	o := m.st.OpState(ds.GetDetails().GetId())
	ds.OpState = o.State
	if ds.OpState == metapb.NodeOpState_NODE_OP_STATE_UNSPECIFIED {
		ds.OpState = metapb.NodeOpState_IN_SERVICE
	}
	ds.MaintenanceEndUnixMs = o.MaintenanceEndUnixMs
	ds.OpSinceUnixMs = o.SinceUnixMs
	d := m.repl.drain[ds.GetDetails().GetId()]
	ds.DrainContainers, ds.DrainLeft, ds.DrainBytesLeft = uint32(d.containers), uint32(d.left), d.bytesLeft
}

// opTransitionsLocked returns the operational-state changes the last
// round allows: drained datanodes become DECOMMISSIONED or
// IN_MAINTENANCE, and maintenance past its end time ends. blocked holds
// the datanodes with an unclosed container holding data, or an open
// pipeline. Callers hold m.mu.
func (m *Manager) opTransitionsLocked(now time.Time, blocked map[uint64]bool) []*metapb.SetNodeOpStateOp {
	var out []*metapb.SetNodeOpStateOp
	for id, o := range m.st.OpStates() {
		d := m.repl.drain[id]
		// A datanode is let go (DECOMMISSIONED, IN_MAINTENANCE) only
		// while it is live and this leader has its full report: a dead
		// one may hold the only copy of what it had not handed over yet.
		n := m.nodes[id]
		seen := n != nil && n.state == metapb.NodeState_HEALTHY && n.fullReported
		switch o.State {
		case metapb.NodeOpState_ENTERING_MAINTENANCE, metapb.NodeOpState_IN_MAINTENANCE:
			if o.MaintenanceEndUnixMs != 0 && now.UnixMilli() >= o.MaintenanceEndUnixMs {
				out = append(out, &metapb.SetNodeOpStateOp{DatanodeId: id, State: metapb.NodeOpState_IN_SERVICE, Expect: []metapb.NodeOpState{o.State}})
				continue
			}
			if o.State == metapb.NodeOpState_ENTERING_MAINTENANCE && d.left == 0 && !blocked[id] && seen {
				out = append(out, &metapb.SetNodeOpStateOp{DatanodeId: id, State: metapb.NodeOpState_IN_MAINTENANCE,
					MaintenanceEndUnixMs: o.MaintenanceEndUnixMs, Expect: []metapb.NodeOpState{o.State}})
			}
		case metapb.NodeOpState_DECOMMISSIONING:
			if d.containers == 0 && !blocked[id] && seen {
				out = append(out, &metapb.SetNodeOpStateOp{DatanodeId: id, State: metapb.NodeOpState_DECOMMISSIONED, Expect: []metapb.NodeOpState{o.State}})
			}
		}
	}
	slices.SortFunc(out, func(a, b *metapb.SetNodeOpStateOp) int { return cmp.Compare(a.DatanodeId, b.DatanodeId) })
	return out
}
