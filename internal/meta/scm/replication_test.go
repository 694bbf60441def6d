package scm

import (
	"slices"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func TestClassify(t *testing.T) {
	three := func(reps ...uint64) *metapb.Container {
		return &metapb.Container{Id: 7, Replication: metapb.Replication_THREE, State: metapb.ContainerState_CONTAINER_CLOSED, Replicas: reps}
	}
	for _, tc := range []struct {
		name   string
		c      *metapb.Container
		status map[uint64]ReplicaStatus // default healthy
		health string
		bad    []uint64
	}{
		{"three healthy", three(1, 2, 3), nil, HealthHealthy, nil},
		{"dead replica", three(1, 2, 3), map[uint64]ReplicaStatus{2: ReplicaDead}, HealthUnderReplicated, []uint64{2}},
		{"unhealthy and missing", three(1, 2, 3), map[uint64]ReplicaStatus{1: ReplicaUnhealthy, 3: ReplicaMissing}, HealthUnderReplicated, []uint64{1, 3}},
		{"copy recorded, dead not yet dropped", three(1, 2, 3, 4), map[uint64]ReplicaStatus{3: ReplicaDead}, HealthHealthy, []uint64{3}},
		{"one too many", three(1, 2, 3, 4), nil, HealthOverReplicated, nil},
		{"none left", three(1, 2, 3), map[uint64]ReplicaStatus{1: ReplicaDead, 2: ReplicaUnhealthy, 3: ReplicaMissing}, HealthMissing, []uint64{1, 2, 3}},
		{"replication one", &metapb.Container{Replication: metapb.Replication_ONE, Replicas: []uint64{5}}, nil, HealthHealthy, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := Classify(tc.c, func(dn uint64) ReplicaStatus { return tc.status[dn] })
			if cl.Health != tc.health || !slices.Equal(cl.Bad, tc.bad) {
				t.Fatalf("got %s bad %v, want %s bad %v", cl.Health, cl.Bad, tc.health, tc.bad)
			}
		})
	}
}

func TestChooseTarget(t *testing.T) {
	c := func(id uint64, rack string, avail uint64, inFlight int) TargetCandidate {
		return TargetCandidate{ID: id, Rack: rack, Available: avail, AvailableKnown: true, InFlight: inFlight}
	}
	for _, tc := range []struct {
		name         string
		cands        []TargetCandidate
		replicaRacks []string
		racks        int
		need         uint64
		want         uint64
		ok           bool
	}{
		{"most free space", []TargetCandidate{c(4, "/r1", 10, 0), c(5, "/r1", 30, 0), c(6, "/r1", 20, 0)}, []string{"/r1", "/r1"}, 1, 5, 5, true},
		{"rack rule beats free space", []TargetCandidate{c(4, "/r1", 100, 0), c(5, "/r2", 10, 0)}, []string{"/r1", "/r1"}, 2, 5, 5, true},
		{"replicas already on two racks", []TargetCandidate{c(4, "/r1", 100, 0), c(5, "/r2", 10, 0)}, []string{"/r1", "/r2"}, 2, 5, 4, true},
		{"no room off rack: same rack rather than none", []TargetCandidate{c(4, "/r1", 100, 0), c(5, "/r2", 1, 0)}, []string{"/r1", "/r1"}, 2, 5, 4, true},
		{"fewest in flight among equals", []TargetCandidate{c(4, "/r1", 10, 2), c(5, "/r1", 10, 1)}, nil, 1, 5, 5, true},
		{"unknown free space counts as room", []TargetCandidate{{ID: 9, Rack: "/r1"}}, []string{"/r1"}, 1, 5, 9, true},
		{"no room anywhere", []TargetCandidate{c(4, "/r1", 1, 0)}, []string{"/r1"}, 1, 5, 0, false},
		{"no candidates", nil, []string{"/r1"}, 1, 5, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := ChooseTarget(tc.cands, tc.replicaRacks, tc.racks, tc.need)
			if got != tc.want || ok != tc.ok {
				t.Fatalf("got %d %v, want %d %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

func closedRep(cid, bcsid uint64) *metapb.ContainerReport {
	return &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_CLOSED, UsedBytes: 100, Bcsid: bcsid}
}

func findCmd[T any](cmds []*metapb.DatanodeCommand, get func(*metapb.DatanodeCommand) T) (T, bool) {
	var zero T
	for _, c := range cmds {
		if v := get(c); any(v) != any(zero) {
			return v, true
		}
	}
	return zero, false
}

// TestReplicationRepairsUnhealthyReplica walks one repair through the
// manager: a replica reported UNHEALTHY makes its CLOSED container
// under-replicated; a copy goes to a target off the healthy replicas'
// rack; a leader change in the middle loses only the schedule (the new
// leader adopts the target's verified copy from its report); the copy is
// recorded through Raft, and only then the unhealthy replica is dropped
// and its datanode told to delete it.
func TestReplicationRepairsUnhealthyReplica(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	racks := []string{"/dc1/r1", "/dc1/r1", "/dc1/r2", "/dc1/r1", "/dc1/r2"}
	var ids []uint64
	for i, r := range racks {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), r))
	}
	// A CLOSED container on the first three.
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids[:3]}}}); err != nil {
		t.Fatal(err)
	}
	res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: FirstPipelineID}}})
	if err != nil {
		t.Fatal(err)
	}
	cid := res.(*metapb.Container).Id
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: cid, UsedBytes: 100}}}); err != nil {
		t.Fatal(err)
	}
	reports := map[uint64][]*metapb.ContainerReport{ids[0]: {closedRep(cid, 9)}, ids[1]: {closedRep(cid, 9)},
		ids[2]: {{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, Bcsid: 9}}}
	round := func() map[uint64][]*metapb.DatanodeCommand {
		t.Helper()
		out := map[uint64][]*metapb.DatanodeCommand{}
		for _, id := range ids {
			out[id] = e.report(t, id, reports[id]...).Commands
		}
		e.tick(t)
		return out
	}
	round() // the unhealthy replica is recorded, classified, a copy scheduled
	h, err := e.m.ContainerHealth(10)
	if err != nil {
		t.Fatal(err)
	}
	if h.Counts[HealthUnderReplicated] != 1 || h.Counts[HealthUnhealthyReplicas] != 1 || len(h.Copies) != 1 {
		t.Fatalf("health %v", h)
	}
	// Healthy replicas are both on r1: the copy goes to r2, to the only
	// datanode there that is not a replica.
	if got := h.Copies[0].Target; got != ids[4] {
		t.Fatalf("copy to %d, want %d (rack rule)", got, ids[4])
	}
	cmds := round()
	rc, ok := findCmd(cmds[ids[4]], (*metapb.DatanodeCommand).GetReplicateContainer)
	if !ok || rc.ContainerId != cid || len(rc.Sources) != 2 {
		t.Fatalf("target got %v", cmds[ids[4]])
	}

	// Leader change: the schedule is gone, the replicated state is not.
	e.fr.mu.Lock()
	e.fr.leader = false
	e.fr.mu.Unlock()
	e.m.NodeState(ids[0]) // notices
	e.fr.mu.Lock()
	e.fr.leader = true
	e.fr.mu.Unlock()

	// The target finished and reports the verified copy.
	reports[ids[4]] = []*metapb.ContainerReport{closedRep(cid, 9)}
	round()
	c := e.st.Container(cid)
	if !slices.Contains(c.Replicas, ids[4]) || !slices.Contains(c.Replicas, ids[2]) {
		t.Fatalf("after the copy: replicas %v (want the new one added, the old one still there)", c.Replicas)
	}
	cmds = round()
	c = e.st.Container(cid)
	if slices.Contains(c.Replicas, ids[2]) || len(c.Replicas) != 3 || len(c.UnhealthyReplicas) != 0 {
		t.Fatalf("after the next round: replicas %v unhealthy %v", c.Replicas, c.UnhealthyReplicas)
	}
	cmds = round()
	if dc, ok := findCmd(cmds[ids[2]], (*metapb.DatanodeCommand).GetDeleteContainer); !ok || dc.ContainerId != cid {
		t.Fatalf("the dropped replica's datanode got %v", cmds[ids[2]])
	}
	for _, id := range []uint64{ids[0], ids[1], ids[4]} {
		if _, ok := findCmd(cmds[id], (*metapb.DatanodeCommand).GetDeleteContainer); ok {
			t.Fatalf("datanode %d told to delete a live replica", id)
		}
	}
	h, _ = e.m.ContainerHealth(10)
	if h.Counts[HealthHealthy] != 1 || h.Counts[HealthUnderReplicated] != 0 {
		t.Fatalf("health at the end %v", h)
	}
}

// TestMissingContainerIsCounted: a CLOSED container with no healthy
// replica is classified missing (an alarm), and nothing is scheduled.
func TestMissingContainerIsCounted(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids[:3]}}})
	res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: FirstPipelineID}}})
	if err != nil {
		t.Fatal(err)
	}
	cid := res.(*metapb.Container).Id
	e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: cid, UsedBytes: 100}}})
	for range 2 {
		for _, id := range ids {
			e.report(t, id) // full reports without the container: every replica missing
		}
		e.tick(t)
	}
	h, err := e.m.ContainerHealth(10)
	if err != nil {
		t.Fatal(err)
	}
	if h.Counts[HealthMissing] != 1 || len(h.Copies) != 0 || len(h.Worst) == 0 || h.Worst[0].ContainerId != cid {
		t.Fatalf("health %v", h)
	}
}

// TestFailedCopyGoesElsewhere: a copy the target reports failed is given
// up at once and scheduled on another datanode (here the only one left,
// on the healthy replicas' own rack: better than staying
// under-replicated); one whose target dies is given up too.
func TestFailedCopyGoesElsewhere(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	racks := []string{"/dc1/r1", "/dc1/r1", "/dc1/r2", "/dc1/r1", "/dc1/r2"}
	var ids []uint64
	for i, r := range racks {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), r))
	}
	e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids[:3]}}})
	res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: FirstPipelineID}}})
	if err != nil {
		t.Fatal(err)
	}
	cid := res.(*metapb.Container).Id
	e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: cid, UsedBytes: 100}}})
	reports := map[uint64][]*metapb.ContainerReport{ids[0]: {closedRep(cid, 9)}, ids[1]: {closedRep(cid, 9)},
		ids[2]: {{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, Bcsid: 9}}}
	for _, id := range ids {
		e.report(t, id, reports[id]...)
	}
	e.tick(t)
	target := func() uint64 {
		t.Helper()
		h, err := e.m.ContainerHealth(10)
		if err != nil {
			t.Fatal(err)
		}
		if len(h.Copies) != 1 {
			return 0
		}
		return h.Copies[0].Target
	}
	if got := target(); got != ids[4] {
		t.Fatalf("first copy to %d, want %d", got, ids[4])
	}
	// The target fails the copy on every source.
	if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: ids[4], CopyFailures: []*metapb.CopyFailure{{ContainerId: cid, Message: "no source"}}}); err != nil {
		t.Fatal(err)
	}
	if got := target(); got != 0 {
		t.Fatalf("failed copy still in flight to %d", got)
	}
	e.tick(t)
	if got := target(); got != ids[3] {
		t.Fatalf("second copy to %d, want %d", got, ids[3])
	}
	// That target dies: given up (and nowhere left to go for now).
	e.clk.Advance(11 * time.Second)
	for _, id := range ids[:3] {
		e.report(t, id, reports[id]...)
	}
	e.report(t, ids[4])
	e.tick(t)
	h, _ := e.m.ContainerHealth(10)
	if len(h.Copies) != 0 || h.CopiesFailed != 2 {
		t.Fatalf("after the target died: %v", h)
	}
}

// TestEmptyContainerOfClosedPipelineCloses: a container no replica ever
// got a write for (datanodes create containers on the first write) does
// not stay CLOSING forever once its pipeline closed: full reports sent
// after the close that lack it close it empty, and it counts as healthy,
// with nothing to copy. One replica that lacks a container the others hold
// does not hold the close up either; it is repaired as missing.
func TestEmptyContainerOfClosedPipelineCloses(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids[:3]}}})
	var cids []uint64
	for range 2 {
		res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: FirstPipelineID}}})
		if err != nil {
			t.Fatal(err)
		}
		cids = append(cids, res.(*metapb.Container).Id)
	}
	e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: []uint64{FirstPipelineID}, Reason: "test"}}})
	e.clk.Advance(time.Second)
	// cids[0]: nobody has it. cids[1]: two replicas closed it, the third lacks it.
	reports := map[uint64][]*metapb.ContainerReport{ids[0]: {closedRep(cids[1], 5)}, ids[1]: {closedRep(cids[1], 5)}}
	for range 3 {
		for _, id := range ids {
			e.report(t, id, reports[id]...)
		}
		e.tick(t)
	}
	if c := e.st.Container(cids[0]); c.State != metapb.ContainerState_CONTAINER_CLOSED || c.UsedBytes != 0 {
		t.Fatalf("empty container: %v", c)
	}
	if c := e.st.Container(cids[1]); c.State != metapb.ContainerState_CONTAINER_CLOSED || c.UsedBytes != 100 {
		t.Fatalf("container with data: %v", c)
	}
	h, _ := e.m.ContainerHealth(10)
	if len(h.Copies) != 1 || h.Copies[0].ContainerId != cids[1] || h.Copies[0].Target != ids[3] {
		t.Fatalf("health %v", h)
	}
}

// hb sends a full report from dn listing the pipelines it runs.
func (e *env) hb(t *testing.T, dn uint64, pipelines []uint64, reps ...*metapb.ContainerReport) *metapb.HeartbeatResponse {
	t.Helper()
	req := &metapb.HeartbeatRequest{DatanodeId: dn, FullReport: true, Containers: reps}
	for _, p := range pipelines {
		req.Pipelines = append(req.Pipelines, &metapb.PipelineReport{PipelineId: p})
	}
	r, err := e.m.Heartbeat(e.ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestReplicationWaitsForLaggingPipelineMember: a member of a closed
// pipeline whose log apply lags (slow disk) has not created the container
// yet when the others closed it. While it still runs the pipeline (its log
// may still write into the container) it is not missing: no copy is made
// (one would be imported while the log writes: "import in progress"). Once
// it left the pipeline and still lacks the container, the copy is made.
func TestReplicationWaitsForLaggingPipelineMember(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	cid := e.closedOn(t, 100, ids[:3]...)
	pid := e.st.Container(cid).PipelineId
	var lagCmds []*metapb.DatanodeCommand
	round := func(lagging []uint64) {
		t.Helper()
		e.hb(t, ids[0], nil, closedRep(cid, 9))
		e.hb(t, ids[1], nil, closedRep(cid, 9))
		// ids[2] still runs the pipeline and has not applied the
		// container's first write.
		lagCmds = append(lagCmds, e.hb(t, ids[2], lagging).Commands...)
		e.hb(t, ids[3], nil)
		e.tick(t)
	}
	for range 2 {
		round([]uint64{pid})
		e.clk.Advance(time.Second)
		h, err := e.m.ContainerHealth(10)
		if err != nil {
			t.Fatal(err)
		}
		if len(h.Copies) != 0 || h.Counts[HealthHealthy] != 1 {
			t.Fatalf("a copy scheduled while the lagging member %d still runs pipeline %d: %v", ids[2], pid, h)
		}
	}
	// The grace is bounded: SCM tells it to leave the closed pipeline.
	if cp, ok := findCmd(lagCmds, (*metapb.DatanodeCommand).GetClosePipeline); !ok || cp.PipelineId != pid {
		t.Fatalf("the lagging member got %v, want ClosePipeline %d", lagCmds, pid)
	}
	round(nil) // it left the pipeline: its replica is missing now
	h, err := e.m.ContainerHealth(10)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Copies) != 1 || h.Copies[0].Target != ids[3] {
		t.Fatalf("after the member left the pipeline: %v (want a copy to %d)", h, ids[3])
	}
}

// TestReplicationTargetNotOnContainerPipeline: a datanode that still runs
// the container's pipeline is never a copy target, even once it is no
// longer a recorded replica: its log may still write into the container,
// and an import there fails those writes ("import in progress") and
// leaves the replica UNHEALTHY.
func TestReplicationTargetNotOnContainerPipeline(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	a, b, c, d, x := ids[0], ids[1], ids[2], ids[3], ids[4]
	cid := e.closedOn(t, 100, a, b, c)
	pid := e.st.Container(cid).PipelineId
	// c lagged, a copy went to d, c was dropped; c still runs the pipeline
	// and has not applied the container yet.
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: cid, DatanodeId: d}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{ContainerId: cid, DatanodeIds: []uint64{c}, Reason: "test"}}}); err != nil {
		t.Fatal(err)
	}
	// Then b's replica goes UNHEALTHY: the container needs a copy.
	var xCmds []*metapb.DatanodeCommand
	for range 2 {
		e.hb(t, a, nil, closedRep(cid, 9))
		e.hb(t, b, nil, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, Bcsid: 9})
		e.hb(t, c, []uint64{pid})
		e.hb(t, d, nil, closedRep(cid, 9))
		if cmds := e.hb(t, x, nil).Commands; len(cmds) > 0 {
			xCmds = cmds
		}
		e.tick(t)
	}
	h, err := e.m.ContainerHealth(10)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Copies) != 1 || h.Copies[0].Target != x {
		t.Fatalf("copies %v: want one to %d, never to %d (it runs the container's pipeline %d)", h.Copies, x, c, pid)
	}
	// The command names the container's pipeline: a target running it
	// refuses the copy.
	if rc, ok := findCmd(xCmds, (*metapb.DatanodeCommand).GetReplicateContainer); !ok || rc.ContainerId != cid || rc.PipelineId != pid {
		t.Fatalf("target %d got %v, want a copy of container %d naming pipeline %d", x, rc, cid, pid)
	}
	if cmds := e.hb(t, c, []uint64{pid}).Commands; len(cmds) > 0 {
		if _, ok := findCmd(cmds, (*metapb.DatanodeCommand).GetReplicateContainer); ok {
			t.Fatalf("datanode %d, in the container's pipeline, told to import it: %v", c, cmds)
		}
	}
}
