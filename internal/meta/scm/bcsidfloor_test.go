package scm

import (
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// floorEnv: container cid CLOSED on ids[:3]; the replica on ids[0], at
// BCSID 10, was dropped from it (a ReplicasRemovedOp carrying its last
// reported BCSID: the container's floor is 10); the other two then went
// UNHEALTHY by an apply bug at BCSIDs b1 and b2, and a recovery started.
type floorEnv struct {
	*env
	ids     []uint64
	cid     uint64
	reports map[uint64][]*metapb.ContainerReport
}

func newFloorEnv(t *testing.T, b1, b2 uint64) *floorEnv {
	t.Helper()
	e := &floorEnv{env: newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1}), reports: map[uint64][]*metapb.ContainerReport{}}
	for i := range 5 {
		e.ids = append(e.ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	e.cid = e.closedOn(t, 300, e.ids[:3]...)
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{
		ContainerId: e.cid, DatanodeIds: []uint64{e.ids[0]}, Bcsids: []uint64{10}, Reason: "replaced by healthy replicas"}}}); err != nil {
		t.Fatal(err)
	}
	if f := e.st.Container(e.cid).GetBcsidFloor(); f.GetBcsid() != 10 || f.GetDatanodeId() != e.ids[0] || f.GetUnixMs() != e.clk.Now().UnixMilli() {
		t.Fatalf("floor after the drop: %v", f)
	}
	sick := func(b uint64) *metapb.ContainerReport {
		return &metapb.ContainerReport{ContainerId: e.cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UsedBytes: 300, BlockCount: 3, Bcsid: b, UnhealthyReason: recoverBug}
	}
	e.reports[e.ids[1]] = []*metapb.ContainerReport{sick(b1)}
	e.reports[e.ids[2]] = []*metapb.ContainerReport{sick(b2)}
	e.round(t)
	e.round(t)
	if c := e.st.Container(e.cid); !slices.Equal(c.UnhealthyReplicas, e.ids[1:3]) {
		t.Fatalf("after the bug: %v", c)
	}
	e.start(t, 0)
	e.round(t)
	// Recovered CLOSED at the same BCSIDs.
	e.reports[e.ids[1]] = []*metapb.ContainerReport{closedRep(e.cid, b1)}
	e.reports[e.ids[2]] = []*metapb.ContainerReport{closedRep(e.cid, b2)}
	for range 3 {
		e.round(t)
	}
	return e
}

func (e *floorEnv) round(t *testing.T) {
	t.Helper()
	for _, id := range e.ids {
		e.report(t, id, e.reports[id]...)
	}
	e.tick(t)
}

func (e *floorEnv) start(t *testing.T, acceptDropped uint64) *metapb.RecoverContainerResponse {
	t.Helper()
	resp, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: e.cid, AcceptDroppedFloor: acceptDropped})
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	return resp
}

func (e *floorEnv) status(t *testing.T) *metapb.RecoverContainerResponse {
	t.Helper()
	resp, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: e.cid, StatusOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// TestRecoverBelowDroppedReplicaFloor: the replica at BCSID 10 was dropped
// from the container's replica list; the two left recover CLOSED at 7.
// Every replica SCM still lists reports, none is missing, 7 is the newest
// reported: before the floor they were counted at once, losing what the
// dropped 10 acknowledged. Now they are "blocked", the reason names the
// dropped replica's datanode, its BCSID and when; only
// --accept-dropped-replicas counts them, the op records the accepted floor
// and the reason, and Apply lowers the floor to 7, so the replication
// manager copies the container from them.
func TestRecoverBelowDroppedReplicaFloor(t *testing.T) {
	e := newFloorEnv(t, 7, 7)
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 2 {
		t.Fatalf("replicas below the floor were counted without --accept-dropped-replicas: unhealthy %v", c.UnhealthyReplicas)
	}
	resp := e.status(t)
	if resp.Done || resp.GetBcsidFloor().GetBcsid() != 10 || resp.GetBcsidFloor().GetDatanodeId() != e.ids[0] {
		t.Fatalf("status: done %v floor %v", resp.Done, resp.GetBcsidFloor())
	}
	for _, r := range resp.Replicas {
		if r.Status != "blocked" || !strings.Contains(r.Reason, "datanode "+strconv.FormatUint(e.ids[0], 10)) ||
			!strings.Contains(r.Reason, "dropped") || !strings.Contains(r.Reason, "--accept-dropped-replicas=10") || !strings.Contains(r.Reason, "2023-11-14T22:13:20Z") ||
			!strings.Contains(r.Reason, "accept losing BCSIDs 8 to 10") {
			t.Fatalf("replica %d: %s %q, want blocked naming the dropped replica, when, and the flag with the floor", r.DatanodeId, r.Status, r.Reason)
		}
		// Bringing the dropped replica's datanode back comes first.
		if i, j := strings.Index(r.Reason, "bring datanode "+strconv.FormatUint(e.ids[0], 10)+" back"), strings.Index(r.Reason, "--accept-dropped-replicas"); i < 0 || i > j {
			t.Fatalf("replica %d: %q, want \"bring datanode %d back\" before the flag", r.DatanodeId, r.Reason, e.ids[0])
		}
	}
	// Accepting a floor below the container's (not the one the status
	// shows, or one raised since) is refused, and nothing is accepted.
	if _, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: e.cid, AcceptDroppedFloor: 9}); code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "floor is now 10") {
		t.Fatalf("accepting floor 9 under 10: %v, want FailedPrecondition", err)
	}
	if st := e.status(t); st.AcceptedDroppedFloor != 0 {
		t.Fatalf("after the refused acceptance the recovery accepts %d", st.AcceptedDroppedFloor)
	}
	e.round(t)
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 2 {
		t.Fatalf("counted after a refused acceptance: %v", c)
	}
	if resp := e.start(t, 10); resp.AcceptedDroppedFloor != 10 {
		t.Fatalf("restart with the flag: %v", resp)
	}
	e.round(t)
	c := e.st.Container(e.cid)
	if len(c.UnhealthyReplicas) != 0 {
		t.Fatalf("with --accept-dropped-replicas the recovered replicas are still not counted: %v", c.UnhealthyReplicas)
	}
	if f := c.GetBcsidFloor(); f.GetBcsid() != 7 || !strings.Contains(f.GetReason(), "lowered from 10") {
		t.Fatalf("floor after the accepted loss: %v, want 7 (lowered from 10)", f)
	}
	var ops []*metapb.ReplicaRecoveredOp
	for _, x := range e.fr.cmds() {
		if op := x.GetReplicaRecovered(); op != nil && op.AcceptedFloor != 0 {
			ops = append(ops, op)
		}
	}
	if len(ops) == 0 || ops[0].AcceptedFloor != 10 || !strings.Contains(ops[0].Reason, "accepted losing BCSIDs 8 to 10") {
		t.Fatalf("the op does not record the accepted floor: %v", ops)
	}
	// Counted again, the container is copied back to its factor from them.
	for range 2 {
		e.round(t)
	}
	h, _ := e.m.ContainerHealth(10)
	if len(h.Copies) != 1 || h.Copies[0].ContainerId != e.cid {
		t.Fatalf("after the accepted recovery: copies %v, want one of %d", h.Copies, e.cid)
	}
}

// TestRecoverAtFloorCounts: the same floor (10, from the dropped replica),
// but a replica left recovers at 10: it is counted without any flag, the
// 7 is stale, the floor stays.
func TestRecoverAtFloorCounts(t *testing.T) {
	e := newFloorEnv(t, 10, 7)
	c := e.st.Container(e.cid)
	if !slices.Equal(c.UnhealthyReplicas, []uint64{e.ids[2]}) {
		t.Fatalf("unhealthy %v, want only the 7 on %d", c.UnhealthyReplicas, e.ids[2])
	}
	if c.GetBcsidFloor().GetBcsid() != 10 {
		t.Fatalf("floor %v, want 10", c.GetBcsidFloor())
	}
	st := map[uint64]string{}
	for _, r := range e.status(t).Replicas {
		st[r.DatanodeId] = r.Status
	}
	if st[e.ids[1]] != "healthy" || st[e.ids[2]] != "stale" {
		t.Fatalf("statuses %v", st)
	}
}

// TestReplicationNoSourceBelowFloor: a container closed with its replicas
// at BCSID 10 (the close records the floor); two of them are lost with
// their datanodes, and the third comes back reporting 7 (say, a volume
// restored from an old image). The newest live replica is 7: before the
// floor it counted as healthy and was the copy source, spreading the
// older data. Now it is lagging: no copy is scheduled, and the container
// is missing (the alarm).
func TestReplicationNoSourceBelowFloor(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids[:3]}}}); err != nil {
		t.Fatal(err)
	}
	res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: FirstPipelineID}}})
	if err != nil {
		t.Fatal(err)
	}
	cid := res.(*metapb.Container).Id
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CloseContainers{CloseContainers: &metapb.CloseContainersOp{ContainerIds: []uint64{cid}, Reason: "test"}}}); err != nil {
		t.Fatal(err)
	}
	// The close, through the manager: every replica reports CLOSED at 10.
	for range 2 {
		for _, id := range ids {
			if id == ids[0] || id == ids[1] || id == ids[2] {
				e.report(t, id, closedRep(cid, 10))
			} else {
				e.report(t, id)
			}
		}
		e.tick(t)
	}
	c := e.st.Container(cid)
	if c.State != metapb.ContainerState_CONTAINER_CLOSED || c.GetBcsidFloor().GetBcsid() != 10 {
		t.Fatalf("after the close: %v, want CLOSED with floor 10", c)
	}
	// ids[0] and ids[1] go silent (stale: no copy source); then ids[2]
	// reports 7, and they die.
	for i := range 12 {
		e.clk.Advance(e.m.cfg.HeartbeatInterval)
		b := uint64(10)
		if i >= 6 {
			b = 7
		}
		e.report(t, ids[2], closedRep(cid, b))
		e.report(t, ids[3])
		e.report(t, ids[4])
		e.tick(t)
	}
	h, _ := e.m.ContainerHealth(10)
	for _, cp := range h.Copies {
		if cp.ContainerId == cid {
			t.Fatalf("a copy of %d was scheduled from a replica below its floor: %v", cid, h.Copies)
		}
	}
	if h.Counts[HealthMissing] != 1 {
		t.Fatalf("health %v, want the container missing", h.Counts)
	}
	e.m.mu.Lock()
	st := e.m.replicaStatusLocked(e.st.Container(cid), ids[2])
	e.m.mu.Unlock()
	if st != ReplicaLagging {
		t.Fatalf("the replica below the floor is %v, want lagging", st)
	}
}

// TestReplicationDropRecordsFloor: the replication manager's own drop (one
// replica too many) carries the BCSID the victim last reported, and Apply
// raises the floor to it, naming the victim; an op of an older leader
// (no bcsids) drops as before and leaves the floor.
func TestReplicationDropRecordsFloor(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	cid := e.closedOn(t, 100, ids[:3]...)
	cid2 := e.closedOn(t, 0, ids[1:4]...) // empty: the manager leaves it alone
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: cid, DatanodeId: ids[3]}}}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		for _, id := range ids[:4] {
			e.report(t, id, closedRep(cid, 12))
		}
		e.report(t, ids[4])
		e.tick(t)
	}
	var op *metapb.ReplicasRemovedOp
	for _, x := range e.fr.cmds() {
		if r := x.GetReplicasRemoved(); r != nil {
			op = r
		}
	}
	if op == nil || len(op.DatanodeIds) != 1 || !slices.Equal(op.Bcsids, []uint64{12}) {
		t.Fatalf("drop op %v, want one victim with its BCSID 12", op)
	}
	c := e.st.Container(cid)
	if f := c.GetBcsidFloor(); len(c.Replicas) != 3 || f.GetBcsid() != 12 || f.GetDatanodeId() != op.DatanodeIds[0] || !strings.Contains(f.GetReason(), "over-replicated") {
		t.Fatalf("after the drop: %v", c)
	}

	// An older leader's op: no bcsids. The floor stays what it was.
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{ContainerId: cid2, DatanodeIds: []uint64{ids[3]}, Reason: "old"}}}); err != nil {
		t.Fatal(err)
	}
	if c := e.st.Container(cid2); len(c.Replicas) != 2 || c.BcsidFloor != nil {
		t.Fatalf("an op without bcsids: %v, want two replicas and no floor", c)
	}
	// More BCSIDs than datanodes: refused before anything changes.
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{ContainerId: cid2, DatanodeIds: []uint64{ids[2]}, Bcsids: []uint64{1, 2}}}}); code(err) != codes.InvalidArgument {
		t.Fatalf("two BCSIDs for one datanode: %v, want InvalidArgument", err)
	}
}

// TestFloorApplyDeterministic: replaying the log of a run that set floors
// every way (a drop, a close, an accepted recovery lowering one) on a
// fresh state machine gives the same containers, floors included, as the
// leader's; a snapshot restored elsewhere, and a reopened state, keep them.
func TestFloorApplyDeterministic(t *testing.T) {
	e := newFloorEnv(t, 7, 7)
	e.start(t, 10)
	for range 3 {
		e.round(t)
	}
	// And a floor set by a close, raised by a drop.
	// (on a pipeline the manager created: one of our own could collide
	// with it)
	open := e.st.OpenPipelines(metapb.Replication_THREE)
	if len(open) == 0 {
		t.Fatal("no open pipeline")
	}
	res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: open[0].Id}}})
	if err != nil {
		t.Fatal(err)
	}
	c2 := res.(*metapb.Container).Id
	dropped := res.(*metapb.Container).Replicas[0]
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: c2, UsedBytes: 100, Bcsid: 21}}}); err != nil {
		t.Fatal(err)
	}
	if f := e.st.Container(c2).GetBcsidFloor(); f.GetBcsid() != 21 || f.GetDatanodeId() != 0 {
		t.Fatalf("floor after the close: %v, want 21", f)
	}
	e.clk.Advance(time.Second)
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{ContainerId: c2, DatanodeIds: []uint64{dropped}, Bcsids: []uint64{33}, Reason: "dead datanode"}}}); err != nil {
		t.Fatal(err)
	}
	if f := e.st.Container(c2).GetBcsidFloor(); f.GetBcsid() != 33 || f.GetDatanodeId() != dropped {
		t.Fatalf("floor after the drop: %v, want 33 from %d", f, dropped)
	}
	want := map[uint64]*metapb.Container{}
	floors := 0
	for _, c := range e.st.Containers() {
		want[c.Id] = c
		if c.GetBcsidFloor().GetBcsid() != 0 {
			floors++
		}
	}
	if floors < 2 {
		t.Fatalf("only %d containers with a floor: the run sets none to compare", floors)
	}
	same := func(what string, st *State) {
		t.Helper()
		got := st.Containers()
		if len(got) != len(want) {
			t.Fatalf("%s: %d containers, want %d", what, len(got), len(want))
		}
		for _, c := range got {
			if !proto.Equal(c, want[c.Id]) {
				t.Fatalf("%s: container %d\n got %v\nwant %v", what, c.Id, c, want[c.Id])
			}
		}
	}
	// Replay every entry, with its index, on a fresh replica.
	fresh := openState(t, t.TempDir())
	defer fresh.Close()
	e.fr.mu.Lock()
	props := slices.Clone(e.fr.props)
	e.fr.mu.Unlock()
	for i, p := range props {
		fresh.Apply([]store.Entry{{Index: uint64(i + 1), Cmd: p}})
	}
	same("replayed", fresh)

	idx, rc, err := e.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	other := openState(t, t.TempDir())
	defer other.Close()
	err = other.Restore(idx, rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	same("restored", other)
}

// TestReplicationSourceUnreportedBelowFloor: with a floor set, a replica
// whose datanode has not sent this leader a full report yet (after a
// failover) counts as healthy for its grace period, but its BCSID is not
// known: it is no copy source (it may be an old replica). Only the
// replica reported at the floor is.
func TestReplicationSourceUnreportedBelowFloor(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	cid := e.closedOn(t, 100, ids[:3]...)
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: cid, DatanodeId: ids[3]}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{
		ContainerId: cid, DatanodeIds: []uint64{ids[3]}, Bcsids: []uint64{10}, Reason: "over-replicated"}}}); err != nil {
		t.Fatal(err)
	}
	e.failover(t)
	// ids[0] silent (dies), ids[1] reports 10 in full, ids[2] only
	// heartbeats (no full report yet).
	for range 12 {
		e.clk.Advance(e.m.cfg.HeartbeatInterval)
		e.report(t, ids[1], closedRep(cid, 10))
		if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: ids[2]}); err != nil {
			t.Fatal(err)
		}
		e.report(t, ids[3])
		e.report(t, ids[4])
		e.tick(t)
	}
	h, _ := e.m.ContainerHealth(10)
	var cp *metapb.ReplicationCopy
	for _, x := range h.Copies {
		if x.ContainerId == cid {
			cp = x
		}
	}
	if cp == nil {
		t.Fatalf("no copy of %d scheduled: %v (counts %v)", cid, h.Copies, h.Counts)
	}
	if !slices.Equal(cp.Sources, []uint64{ids[1]}) {
		t.Fatalf("copy sources %v, want only %d (reported at the floor)", cp.Sources, ids[1])
	}
}

// TestRecoverNotRefusedForReplicaBelowFloor: a CLOSED replica below the
// floor is lagging but no copy source, so it is no reason to refuse the
// recovery of the container's UNHEALTHY replica (before, any lagging
// replica "counted": recover said the replication manager would repair
// the container from it, which it cannot).
func TestRecoverNotRefusedForReplicaBelowFloor(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	cid := e.closedOn(t, 300, ids[:3]...)
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{
		ContainerId: cid, DatanodeIds: []uint64{ids[0]}, Bcsids: []uint64{10}, Reason: "replaced by healthy replicas"}}}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		e.report(t, ids[1], closedRep(cid, 7))
		e.report(t, ids[2], &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UsedBytes: 300, Bcsid: 7, UnhealthyReason: recoverBug})
		e.report(t, ids[3])
		e.report(t, ids[4])
		e.tick(t)
	}
	if _, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: cid}); err != nil {
		t.Fatalf("recover with only a replica below the floor besides the unhealthy one: %v", err)
	}
}

// TestFloorRecoveredOpNotRefusedByApply (review finding 2): Apply refuses
// no ReplicaRecoveredOp on account of the floor, state an older binary
// does not keep (a refusal there made mixed-version replicas diverge in
// unhealthy_replicas). An op below the floor without the acceptance (an
// older leader's, or one racing a floor raised since) applies as on an
// old binary: the replica leaves unhealthy_replicas, the floor stays, and
// the replication manager takes the replica for lagging (never a source).
// An op with accepted_floor at least the floor lowers it.
func TestFloorRecoveredOpNotRefusedByApply(t *testing.T) {
	e := newFloorEnv(t, 7, 7)
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaRecovered{ReplicaRecovered: &metapb.ReplicaRecoveredOp{ContainerId: e.cid, DatanodeId: e.ids[1], Bcsid: 7}}}); err != nil {
		t.Fatalf("ReplicaRecovered below the floor, no acceptance (an older leader's op): %v, want applied", err)
	}
	c := e.st.Container(e.cid)
	if slices.Contains(c.UnhealthyReplicas, e.ids[1]) || c.GetBcsidFloor().GetBcsid() != 10 {
		t.Fatalf("after the op: %v, want datanode %d off unhealthy_replicas and the floor still 10", c, e.ids[1])
	}
	e.m.mu.Lock()
	st := e.m.replicaStatusLocked(c, e.ids[1])
	e.m.mu.Unlock()
	if st != ReplicaLagging {
		t.Fatalf("replica below the floor: %v, want lagging", st)
	}
	// accepted_floor below the floor (it rose since): the floor stays.
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaRecovered{ReplicaRecovered: &metapb.ReplicaRecoveredOp{ContainerId: e.cid, DatanodeId: e.ids[2], Bcsid: 7, AcceptedFloor: 9}}}); err != nil {
		t.Fatal(err)
	}
	if f := e.st.Container(e.cid).GetBcsidFloor(); f.GetBcsid() != 10 {
		t.Fatalf("floor after an op accepting 9 under 10: %v, want 10", f)
	}
}
