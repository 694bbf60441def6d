package scm

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// closedOn creates a container on datanodes dns through a pipeline of its
// own and closes both: a CLOSED container holding used bytes.
func (e *env) closedOn(t *testing.T, used uint64, dns ...uint64) uint64 {
	t.Helper()
	res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: dns}}})
	if err != nil {
		t.Fatal(err)
	}
	pid := res.(*metapb.Pipeline).Id
	res, err = e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: pid}}})
	if err != nil {
		t.Fatal(err)
	}
	cid := res.(*metapb.Container).Id
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: []uint64{pid}, Reason: "test"}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: cid, UsedBytes: used}}}); err != nil {
		t.Fatal(err)
	}
	return cid
}

// fleet is a test cluster of datanodes that report what they hold and
// finish the copies SCM gives them.
type fleet struct {
	e       *env
	ids     []uint64
	holds   map[uint64]map[uint64]uint64 // datanode -> container -> bcsid
	silent  map[uint64]bool
	lastCmd map[uint64][]*metapb.DatanodeCommand
}

func newFleet(t *testing.T, e *env, racks ...string) *fleet {
	f := &fleet{e: e, holds: map[uint64]map[uint64]uint64{}, silent: map[uint64]bool{}}
	for i, r := range racks {
		id := e.register(t, fmt.Sprintf("dn%c", 'a'+i), r)
		f.ids = append(f.ids, id)
		f.holds[id] = map[uint64]uint64{}
	}
	return f
}

func (f *fleet) hold(cid, bcsid uint64, dns ...uint64) {
	for _, d := range dns {
		f.holds[d][cid] = bcsid
	}
}

// round: every live datanode sends a full report and carries out its
// copies (the copy takes the source's committed index) and deletions;
// then one SCM tick, a second later.
func (f *fleet) round(t *testing.T) {
	t.Helper()
	f.lastCmd = map[uint64][]*metapb.DatanodeCommand{}
	for _, id := range f.ids {
		if f.silent[id] {
			continue
		}
		var reps []*metapb.ContainerReport
		for cid, b := range f.holds[id] {
			reps = append(reps, closedRep(cid, b))
		}
		r := f.e.report(t, id, reps...)
		f.lastCmd[id] = r.Commands
		for _, c := range r.Commands {
			if rc := c.GetReplicateContainer(); rc != nil {
				for _, s := range rc.Sources {
					if b, ok := f.holds[s.Id][rc.ContainerId]; ok {
						f.holds[id][rc.ContainerId] = b
						break
					}
				}
			}
			if dc := c.GetDeleteContainer(); dc != nil {
				delete(f.holds[id], dc.ContainerId)
			}
		}
	}
	f.e.tick(t)
	f.e.clk.Advance(time.Second)
}

func (f *fleet) opState(t *testing.T, dn uint64) *metapb.DatanodeStatus {
	t.Helper()
	r, err := f.e.m.ListDatanodes()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range r.Datanodes {
		if d.Details.Id == dn {
			return d
		}
	}
	t.Fatalf("datanode %d not listed", dn)
	return nil
}

// locations is how many replicas of c are offered as locations.
func locations(e *env, cid uint64) int {
	_, dns := e.st.ContainerReplicas(cid)
	return len(dns)
}

// TestLaggingReplicaIsReplaced: a replica that reports its CLOSED
// container with a committed index (BCSID) below the others' lacks
// writes they have: it does not count, a copy of a replica with the
// highest index replaces it, and only then is it dropped and deleted.
func TestLaggingReplicaIsReplaced(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r1", "/r2")
	ids := f.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	f.hold(cid, 9, ids[0], ids[1])
	f.hold(cid, 7, ids[2]) // closed after missing two writes
	f.round(t)
	h, err := e.m.ContainerHealth(10)
	if err != nil {
		t.Fatal(err)
	}
	if h.Counts[HealthUnderReplicated] != 1 || len(h.Copies) != 1 {
		t.Fatalf("health with a lagging replica: %v", h)
	}
	if cp := h.Copies[0]; slices.Contains(cp.Sources, ids[2]) || slices.Contains([]uint64{ids[0], ids[1], ids[2]}, cp.Target) {
		t.Fatalf("copy %v: the lagging replica must be neither source nor target", cp)
	}
	r, err := e.m.Replicas(cid, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, ri := range r.Containers[0].Replicas {
		want := "healthy"
		if ri.DatanodeId == ids[2] {
			want = "lagging"
		}
		if ri.Health != want || ri.Bcsid == 0 {
			t.Fatalf("replica %v: want %s", ri, want)
		}
	}
	for i := 0; i < 6 && slices.Contains(e.st.Container(cid).Replicas, ids[2]); i++ {
		f.round(t)
	}
	c := e.st.Container(cid)
	if slices.Contains(c.Replicas, ids[2]) || len(c.Replicas) != 3 {
		t.Fatalf("replicas %v: the lagging one should be replaced", c.Replicas)
	}
	for _, r := range c.Replicas {
		if f.holds[r][cid] != 9 {
			t.Fatalf("replica on %d has bcsid %d, want 9", r, f.holds[r][cid])
		}
	}
	for i := 0; i < 3 && f.holds[ids[2]][cid] != 0; i++ {
		f.round(t)
	}
	if _, ok := f.holds[ids[2]][cid]; ok {
		t.Fatal("the lagging replica was never deleted")
	}
	if h, _ := e.m.ContainerHealth(10); h.Counts[HealthHealthy] != 1 || h.CopiesDone != 1 {
		t.Fatalf("health at the end: %v", h)
	}
}

// TestDecommissionDrains decommissions a datanode holding replicas of two
// containers: it gets no pipelines or blocks any more, its replicas stop
// counting but serve as sources, every container gets 3 replicas
// elsewhere while never offering fewer than 3 locations, and then it is
// DECOMMISSIONED with nothing left on it.
func TestDecommissionDrains(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 2, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r1", "/r2", "/r2")
	ids := f.ids
	victim := ids[0]
	c1 := e.closedOn(t, 100, ids[0], ids[1], ids[2])
	c2 := e.closedOn(t, 200, ids[0], ids[3], ids[4])
	f.hold(c1, 5, ids[0], ids[1], ids[2])
	f.hold(c2, 6, ids[0], ids[3], ids[4])
	f.round(t)
	f.round(t)
	if h, _ := e.m.ContainerHealth(10); h.Counts[HealthHealthy] != 2 {
		t.Fatalf("before: %v", h)
	}
	d, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING})
	if err != nil || d.OpState != metapb.NodeOpState_DECOMMISSIONING {
		t.Fatalf("decommission: %v %v", d, err)
	}
	if _, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING, MaintenanceEndUnixMs: 1}); code(err) != codes.InvalidArgument {
		t.Fatalf("decommission with an end time: %v", err)
	}
	f.round(t)
	for _, p := range e.st.Pipelines() {
		if p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, victim) {
			t.Fatalf("pipeline %d with the decommissioning datanode still open", p.Id)
		}
	}
	for range 20 {
		if bl := e.alloc(t, metapb.Replication_THREE); slices.ContainsFunc(bl.Datanodes, func(d *metapb.DatanodeDetails) bool { return d.Id == victim }) {
			t.Fatalf("block allocated on the decommissioning datanode: %v", bl)
		}
	}
	h, _ := e.m.ContainerHealth(10)
	if h.Counts[HealthUnderReplicated] != 2 || len(h.Copies) != 2 {
		t.Fatalf("its replicas must not count: %v", h)
	}
	if d := f.opState(t, victim); d.DrainContainers != 2 || d.DrainLeft != 2 || d.DrainBytesLeft != 300 {
		t.Fatalf("drain progress %v", d)
	}
	rounds := 0
	for ; f.opState(t, victim).OpState != metapb.NodeOpState_DECOMMISSIONED; rounds++ {
		if rounds == 20 {
			t.Fatalf("not DECOMMISSIONED after %d rounds: %v; health %v", rounds, f.opState(t, victim), h)
		}
		f.round(t)
		for _, cid := range []uint64{c1, c2} {
			if n := locations(e, cid); n < 3 {
				t.Fatalf("round %d: container %d offers %d locations", rounds, cid, n)
			}
		}
	}
	for _, cid := range []uint64{c1, c2} {
		c := e.st.Container(cid)
		if slices.Contains(c.Replicas, victim) || len(c.Replicas) != 3 {
			t.Fatalf("container %d replicas %v after the drain", cid, c.Replicas)
		}
	}
	f.round(t)
	if len(f.holds[victim]) != 0 {
		t.Fatalf("decommissioned datanode still holds %v", f.holds[victim])
	}
	// Asking again changes nothing; recommission brings it back.
	if d, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING}); err != nil || d.OpState != metapb.NodeOpState_DECOMMISSIONED {
		t.Fatalf("decommission again: %v %v", d, err)
	}
	if d, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_IN_SERVICE}); err != nil || d.OpState != metapb.NodeOpState_IN_SERVICE {
		t.Fatalf("recommission: %v %v", d, err)
	}
	t.Logf("drained in %d rounds", rounds)
}

// TestMaintenanceKeepsTwo: a datanode entering maintenance needs no copy
// of a container with two healthy replicas elsewhere; once
// IN_MAINTENANCE it may be down without repairs. A second datanode
// entering maintenance leaves a container with one healthy replica, so
// that one gets a copy. Maintenance ends at its end time (and on
// recommission), and the replica then too many is dropped.
func TestMaintenanceKeepsTwo(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r1", "/r2")
	ids := f.ids
	c1 := e.closedOn(t, 100, ids[0], ids[1], ids[2])
	c2 := e.closedOn(t, 100, ids[0], ids[3], ids[4])
	f.hold(c1, 5, ids[0], ids[1], ids[2])
	f.hold(c2, 5, ids[0], ids[3], ids[4])
	f.round(t)
	end := e.clk.Now().Add(time.Hour)
	if _, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[0], State: metapb.NodeOpState_ENTERING_MAINTENANCE,
		MaintenanceEndUnixMs: e.clk.Now().Add(-time.Second).UnixMilli()}); code(err) != codes.InvalidArgument {
		t.Fatalf("maintenance ending in the past: %v", err)
	}
	if _, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[0], State: metapb.NodeOpState_ENTERING_MAINTENANCE, MaintenanceEndUnixMs: end.UnixMilli()}); err != nil {
		t.Fatal(err)
	}
	for i := 0; f.opState(t, ids[0]).OpState != metapb.NodeOpState_IN_MAINTENANCE; i++ {
		if i == 10 {
			t.Fatalf("not IN_MAINTENANCE: %v", f.opState(t, ids[0]))
		}
		f.round(t)
	}
	if h, _ := e.m.ContainerHealth(10); len(h.Copies) != 0 || h.CopiesDone != 0 || h.Counts[HealthUnderReplicated] != 0 {
		t.Fatalf("a copy for maintenance with two replicas elsewhere: %v", h)
	}
	// Down for longer than the dead interval: no repair.
	f.silent[ids[0]] = true
	for range 12 {
		f.round(t)
	}
	if h, _ := e.m.ContainerHealth(10); len(h.Copies) != 0 || h.CopiesDone != 0 {
		t.Fatalf("repair of a datanode in maintenance: %v", h)
	}
	if !slices.Contains(e.st.Container(c1).Replicas, ids[0]) {
		t.Fatal("replica in maintenance dropped")
	}
	f.silent[ids[0]] = false
	// A second datanode: c1 is left with one healthy replica (ids[2]).
	if _, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[1], State: metapb.NodeOpState_ENTERING_MAINTENANCE}); err != nil {
		t.Fatal(err)
	}
	for i := 0; f.opState(t, ids[1]).OpState != metapb.NodeOpState_IN_MAINTENANCE; i++ {
		if i == 10 {
			t.Fatalf("second datanode not IN_MAINTENANCE: %v", f.opState(t, ids[1]))
		}
		f.round(t)
	}
	c := e.st.Container(c1)
	if len(c.Replicas) != 4 || !slices.Contains(c.Replicas, ids[0]) || !slices.Contains(c.Replicas, ids[1]) {
		t.Fatalf("c1 replicas %v: want the two in maintenance kept and one copy added", c.Replicas)
	}
	if len(e.st.Container(c2).Replicas) != 3 {
		t.Fatalf("c2 replicas %v: it had two healthy ones all along", e.st.Container(c2).Replicas)
	}
	// The end time passes for the first; the second is recommissioned.
	e.clk.Advance(time.Hour)
	f.round(t)
	if st := f.opState(t, ids[0]).OpState; st != metapb.NodeOpState_IN_SERVICE {
		t.Fatalf("after the end time: %v", st)
	}
	if _, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[1], State: metapb.NodeOpState_IN_SERVICE}); err != nil {
		t.Fatal(err)
	}
	for i := 0; len(e.st.Container(c1).Replicas) != 3; i++ {
		if i == 6 {
			t.Fatalf("c1 replicas %v after maintenance: want one too many dropped", e.st.Container(c1).Replicas)
		}
		f.round(t)
	}
}

// TestReplicaReportsSurviveLeaderChange: reports against replicas are
// validated, bounded (reason size, per-reporter rate, total), stored
// through Raft with the reason a replica was recorded unhealthy, and are
// still there for a new leader over the reopened state; dropping the
// replica drops its reports.
func TestReplicaReportsSurviveLeaderChange(t *testing.T) {
	dir := t.TempDir()
	e := newEnvAt(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1}, dir)
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r2")
	ids := f.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	f.hold(cid, 5, ids[:3]...)
	f.round(t)
	report := func(dn, block uint64, reason, who string) error {
		return e.m.ReportCorrupt(e.ctx, &metapb.ReportCorruptReplicaRequest{Block: &metapb.BlockID{ContainerId: cid, LocalId: block}, DatanodeId: dn, Reason: reason}, who,
			who == fmt.Sprintf("datanode %d", dn))
	}
	if err := report(0, 1, "x", "a"); code(err) != codes.InvalidArgument {
		t.Fatalf("no datanode: %v", err)
	}
	if err := report(ids[3], 1, "x", "a"); code(err) != codes.FailedPrecondition {
		t.Fatalf("not a replica: %v", err)
	}
	if err := e.m.ReportCorrupt(e.ctx, &metapb.ReportCorruptReplicaRequest{Block: &metapb.BlockID{ContainerId: 999, LocalId: 1}, DatanodeId: ids[0]}, "a", false); code(err) != codes.NotFound {
		t.Fatalf("unknown container: %v", err)
	}
	huge := strings.Repeat("é", 1<<19) // 1 MiB of two-byte runes
	if err := report(ids[0], 17, huge, "client 10.0.0.1"); err != nil {
		t.Fatal(err)
	}
	// One reporter is rate-limited.
	limited := 0
	for i := range 100 {
		if err := report(ids[0], uint64(100+i), "flood", "client 10.0.0.2"); code(err) == codes.ResourceExhausted {
			limited++
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if limited < 40 {
		t.Fatalf("%d of 100 reports limited, want at least 40", limited)
	}
	f.round(t)
	// Clients' reports are recorded, but condemn nothing: the datanode
	// re-verifies, and its own report does.
	if slices.Contains(e.st.Container(cid).UnhealthyReplicas, ids[0]) {
		t.Fatal("a client's report condemned the replica")
	}
	if err := report(ids[0], 16, "scrubber: checksum mismatch", fmt.Sprintf("datanode %d", ids[0])); err != nil {
		t.Fatal(err)
	}
	f.round(t) // ids[0] recorded unhealthy, with its reason
	rs := e.st.ReplicaReports(cid)
	var onBad []*metapb.CorruptReplica
	for _, r := range rs {
		if len(r.Reason) > maxReasonBytes {
			t.Fatalf("reason of %d bytes stored", len(r.Reason))
		}
		if r.DatanodeId == ids[0] {
			onBad = append(onBad, r)
		}
	}
	if len(onBad) != 3+100-limited || onBad[0].Block.LocalId != 0 || onBad[0].Reporter != "scm" || onBad[1].Block.LocalId != 16 || onBad[1].Reporter != fmt.Sprintf("datanode %d", ids[0]) ||
		onBad[2].Block.LocalId != 17 || onBad[2].Reporter != "client 10.0.0.1" {
		t.Fatalf("reports against datanode %d: %v", ids[0], onBad)
	}
	if !slices.Contains(e.st.Container(cid).UnhealthyReplicas, ids[0]) {
		t.Fatal("the corrupt replica was not recorded unhealthy")
	}
	before := len(rs)

	// A leader change over the reopened state (a restart of the node).
	e.st.Close()
	e = newEnvAt(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1}, dir)
	defer e.st.Close()
	f.e = e
	if got := len(e.st.ReplicaReports(cid)); got != before {
		t.Fatalf("%d reports after the restart, want %d", got, before)
	}
	f.round(t)
	r, err := e.m.Replicas(cid, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Containers) != 1 || len(r.Containers[0].Reports) != before {
		t.Fatalf("replicas: %v", r)
	}
	for _, ri := range r.Containers[0].Replicas {
		if ri.DatanodeId == ids[0] && ri.Health != "unhealthy" {
			t.Fatalf("replica %v after the leader change", ri)
		}
	}
	// The total is capped.
	for i := 0; i < MaxReplicaReports/MaxReportsPerOp+2; i++ {
		op := &metapb.ReplicaReportsOp{}
		for j := range MaxReportsPerOp {
			op.Reports = append(op.Reports, &metapb.CorruptReplica{Block: &metapb.BlockID{ContainerId: cid, LocalId: uint64(1_000_000 + i*MaxReportsPerOp + j)}, DatanodeId: ids[2], Reason: "forged"})
		}
		if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaReports{ReplicaReports: op}}); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.st.ReplicaReportCount(); n != MaxReplicaReports {
		t.Fatalf("%d reports stored, want the cap %d", n, MaxReplicaReports)
	}
	// The replaced replica's reports go with it.
	for i := 0; slices.Contains(e.st.Container(cid).Replicas, ids[0]); i++ {
		if i == 8 {
			t.Fatalf("unhealthy replica never replaced: %v", e.st.Container(cid))
		}
		f.round(t)
	}
	for _, r := range e.st.ReplicaReports(cid) {
		if r.DatanodeId == ids[0] {
			t.Fatalf("report against a dropped replica kept: %v", r)
		}
	}
}

// TestNewLeaderAllocatesAtOnce: a leader of a cluster that left safe mode
// before allocates on the recorded pipelines before any datanode has
// reached it (they may still be heartbeating a hung old leader), and
// leaves safe mode on the first report it gets.
func TestNewLeaderAllocatesAtOnce(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 3, PipelineLimit: 1})
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), "")
	}
	e.tick(t)
	e.tick(t)
	if !e.st.SafeModeExited() {
		t.Fatal("safe mode exit not recorded")
	}
	e.fr.mu.Lock()
	e.fr.leader = false
	e.fr.mu.Unlock()
	e.m.NodeState(1)
	e.fr.mu.Lock()
	e.fr.leader = true
	e.fr.mu.Unlock()
	start := time.Now()
	if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE}); err != nil {
		t.Fatalf("allocation right after the leader change: %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("allocation waited %v", d)
	}
	if sm, _ := e.m.SafeMode(); !sm.InSafeMode {
		t.Fatal("out of safe mode before any report")
	}
	e.heartbeatAll(t, 2)
	if sm, _ := e.m.SafeMode(); sm.InSafeMode {
		t.Fatalf("still in safe mode after a report: %v", sm)
	}
}

// TestDeleteTxCompletesAfterRepair: a delete transaction pending on a
// container whose replica went UNHEALTHY completes once the container is
// repaired: the unhealthy replica no longer owes it, the new replica is
// sent it and answers, and it is purged.
func TestDeleteTxCompletesAfterRepair(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r2")
	ids := f.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	f.hold(cid, 5, ids[:3]...)
	f.round(t)
	e.addDeletes(t, cid, 1)
	// ids[2] goes UNHEALTHY before it carries the deletion out.
	e.report(t, ids[2], &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, Bcsid: 5})
	delete(f.holds[ids[2]], cid)
	done := map[uint64]bool{}
	for i := 0; pendingFor(t, e.st, cid) > 0; i++ {
		if i == 10 {
			t.Fatalf("delete tx still pending; container %v, acked by %v", e.st.Container(cid), done)
		}
		// Live replicas answer the deletions they are sent; ids[1] only
		// once the repair is recorded, so the new replica owes it too.
		repaired := slices.Contains(e.st.Container(cid).Replicas, ids[3])
		for id, cmds := range f.lastCmd {
			if id == ids[1] && !repaired {
				continue
			}
			for _, c := range cmds {
				if db := c.GetDeleteBlocks(); db != nil && f.holds[id][db.ContainerId] != 0 {
					if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, DeletedBlockTxs: []uint64{db.TxId}}); err != nil {
						t.Fatal(err)
					}
					done[id] = true
				}
			}
		}
		f.round(t)
	}
	c := e.st.Container(cid)
	if slices.Contains(c.Replicas, ids[2]) || !slices.Contains(c.Replicas, ids[3]) || !done[ids[3]] {
		t.Fatalf("container %v, answered by %v: want repaired onto %d, which answered", c, done, ids[3])
	}
}

// TestAllocationPrefersPipelinesWithALeader: a pipeline created moments
// ago whose datanodes have not reported a leader for it yet is not
// chosen while another one is ready (writes to it would fail, and the
// client would exclude it); without any ready one, allocation falls back
// to the rest.
func TestAllocationPrefersPipelinesWithALeader(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 2, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/r%d", i%2)))
	}
	e.tick(t)
	three := e.st.OpenPipelines(metapb.Replication_THREE)
	if len(three) < 2 {
		t.Fatalf("%d THREE pipelines", len(three))
	}
	// No leader reported anywhere: the fallback.
	e.alloc(t, metapb.Replication_THREE)
	ready, half := three[1], three[0]
	report := func(dn uint64, reps ...*metapb.PipelineReport) {
		t.Helper()
		if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: dn, Pipelines: reps}); err != nil {
			t.Fatal(err)
		}
	}
	// half: a leader, but one member has not joined yet (a V2 stream
	// through it would be refused "not in pipeline"): not ready.
	reported := map[uint64][]*metapb.PipelineReport{}
	for i, dn := range half.Datanodes[:len(half.Datanodes)-1] {
		reported[dn] = append(reported[dn], &metapb.PipelineReport{PipelineId: half.Id, IsLeader: i == 0})
	}
	for i, dn := range ready.Datanodes {
		reported[dn] = append(reported[dn], &metapb.PipelineReport{PipelineId: ready.Id, IsLeader: i == 0})
	}
	for dn, reps := range reported {
		report(dn, reps...)
	}
	for range 20 {
		if bl := e.alloc(t, metapb.Replication_THREE); bl.PipelineId != ready.Id {
			t.Fatalf("block in pipeline %d, want the one with a leader and every member, %d (not %d, a member missing)", bl.PipelineId, ready.Id, half.Id)
		}
	}
	// Old enough, the others count as ready again.
	e.clk.Advance(pipelineReadyGrace * time.Second)
	seen := map[uint64]bool{}
	for range 40 {
		seen[e.alloc(t, metapb.Replication_THREE).PipelineId] = true
	}
	if len(seen) < 2 {
		t.Fatalf("after the grace, blocks only in %v", seen)
	}
}

// TestCopyBandwidthIsSent: the per-target bandwidth is shared by the
// copies a target may have in flight, and each copy command carries its
// share.
func TestCopyBandwidthIsSent(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, CopyBandwidthPerTarget: 64 << 20, MaxCopiesPerTarget: 2})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r2")
	cid := e.closedOn(t, 100, f.ids[:3]...)
	f.hold(cid, 5, f.ids[0], f.ids[1])
	f.round(t)
	f.round(t)
	var got *metapb.ReplicateContainerCommand
	for _, c := range f.lastCmd[f.ids[3]] {
		if rc := c.GetReplicateContainer(); rc != nil {
			got = rc
		}
	}
	if got == nil || got.MaxBytesPerSec != 32<<20 {
		t.Fatalf("copy command %v: want a cap of 32 MiB/s", got)
	}
}

// TestMisReplicatedMovesToAnotherRack: a container with its 3 replicas on
// one rack while the cluster has two is mis-replicated: a copy goes to the
// other rack (only there), and then one replica on the crowded rack is
// dropped, leaving 3 replicas on two racks.
func TestMisReplicatedMovesToAnotherRack(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r1", "/r1", "/r2")
	ids := f.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	f.hold(cid, 5, ids[:3]...)
	f.round(t)
	h, _ := e.m.ContainerHealth(10)
	if h.Counts[HealthMisReplicated] != 1 || len(h.Copies) != 1 || h.Copies[0].Target != ids[4] {
		t.Fatalf("health %v: want mis_replicated with a copy to %d (the other rack, not %d)", h, ids[4], ids[3])
	}
	for i := 0; ; i++ {
		c := e.st.Container(cid)
		if len(c.Replicas) == 3 && slices.Contains(c.Replicas, ids[4]) {
			break
		}
		if i == 8 {
			t.Fatalf("replicas %v", c.Replicas)
		}
		f.round(t)
	}
	f.round(t)
	if h, _ := e.m.ContainerHealth(10); h.Counts[HealthMisReplicated] != 0 || h.Counts[HealthHealthy] == 0 {
		t.Fatalf("health at the end %v", h)
	}
}
