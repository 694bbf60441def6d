package scm

// Finding 1 of the session 18 review (reproductions by the reviewer): a
// BCSID floor must never sit above every healthy replica the container
// keeps. A write is acknowledged only once every pipeline member applied
// it, so what one replica holds above a healthy kept one was never
// acknowledged; a floor above them all strands the container (missing,
// no copy source, for good). Both fail with the floor at the highest
// closed BCSID and with the drop's BCSID uncapped.

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// floorCluster: datanodes that report what they hold (state per replica) and
// carry out copies and deletes.
type floorCluster struct {
	e      *env
	ids    []uint64
	holds  map[uint64]map[uint64]*metapb.ContainerReport
	silent map[uint64]bool
}

func (r *floorCluster) round(t *testing.T) {
	t.Helper()
	for _, id := range r.ids {
		if r.silent[id] {
			continue
		}
		var reps []*metapb.ContainerReport
		for _, rep := range r.holds[id] {
			reps = append(reps, rep)
		}
		resp := r.e.report(t, id, reps...)
		for _, c := range resp.Commands {
			if rc := c.GetReplicateContainer(); rc != nil {
				for _, s := range rc.Sources {
					if b, ok := r.holds[s.Id][rc.ContainerId]; ok && !r.silent[s.Id] {
						r.holds[id][rc.ContainerId] = closedRep(rc.ContainerId, b.Bcsid)
						t.Logf("copy of %d to %d from %d at %d", rc.ContainerId, id, s.Id, b.Bcsid)
						break
					}
				}
			}
			if dc := c.GetDeleteContainer(); dc != nil {
				delete(r.holds[id], dc.ContainerId)
			}
		}
	}
	r.e.tick(t)
	r.e.clk.Advance(r.e.m.cfg.HeartbeatInterval)
}

func newFloorCluster(t *testing.T) *floorCluster {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, CopyTimeout: time.Minute})
	r := &floorCluster{e: e, holds: map[uint64]map[uint64]*metapb.ContainerReport{}, silent: map[uint64]bool{}}
	for i := range 5 {
		id := e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1")
		r.ids = append(r.ids, id)
		r.holds[id] = map[uint64]*metapb.ContainerReport{}
	}
	return r
}

func healthOf(t *testing.T, e *env, cid uint64) string {
	h, err := e.m.ContainerHealth(1000)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range h.Worst {
		if c.ContainerId == cid {
			return c.Health
		}
	}
	return "healthy"
}

// An UNHEALTHY replica (volume failed) reporting a higher BCSID than the
// two healthy ones (which closed locally, a few unacknowledged entries
// behind): the manager copies from a healthy one, then drops the
// unhealthy one.
func TestFloorUnhealthyVictimAboveHealthy(t *testing.T) {
	r := newFloorCluster(t)
	e, ids := r.e, r.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	r.holds[ids[0]][cid] = &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UsedBytes: 100, Bcsid: 12, UnhealthyReason: "volume failed"}
	r.holds[ids[1]][cid] = closedRep(cid, 10)
	r.holds[ids[2]][cid] = closedRep(cid, 10)
	for range 12 {
		r.round(t)
	}
	c := e.st.Container(cid)
	t.Logf("container: replicas %v unhealthy %v state %v; health %s", c.Replicas, c.UnhealthyReplicas, c.State, healthOf(t, e, cid))
	if hs := healthOf(t, e, cid); hs != "healthy" {
		t.Fatalf("container %d ends %s, want healthy (every healthy replica holds BCSID 10)", cid, hs)
	}
	// The drop of the UNHEALTHY 12 still records a floor, capped at the
	// healthy kept replicas' 10: a restored old image below 10 stays out.
	if slices.Contains(c.Replicas, ids[0]) {
		t.Fatalf("the unhealthy replica was never dropped: %v", c)
	}
	if f := c.GetBcsidFloor(); f.GetBcsid() != 10 || f.GetDatanodeId() != ids[0] {
		t.Fatalf("floor %v, want 10 from the drop of datanode %d", f, ids[0])
	}
}

// Replicas closed at 12, 10, 10 (the 12 a leader that applied two entries
// the followers never did: not acknowledged, the client waits for all).
// The 12 is then lost with its datanode.
func TestFloorCloseNewestLost(t *testing.T) {
	r := newFloorCluster(t)
	e, ids := r.e, r.ids
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
	r.holds[ids[0]][cid] = closedRep(cid, 12)
	r.holds[ids[1]][cid] = closedRep(cid, 10)
	r.holds[ids[2]][cid] = closedRep(cid, 10)
	r.round(t)
	// ids[0] is lost right after the close, before anything is copied
	// from it.
	r.silent[ids[0]] = true
	closed := e.st.Container(cid)
	if closed.State != metapb.ContainerState_CONTAINER_CLOSED {
		t.Fatalf("not closed: %v", closed)
	}
	for range 200 {
		r.round(t)
	}
	c := e.st.Container(cid)
	t.Logf("container: %v; health %s", c, healthOf(t, e, cid))
	if hs := healthOf(t, e, cid); hs != "healthy" {
		t.Fatalf("container %d ends %s, want healthy", cid, hs)
	}
	// The close's floor: the lowest BCSID its healthy closed replicas
	// reported (10), not the 12 nobody acknowledged.
	if f := closed.GetBcsidFloor(); f.GetBcsid() != 10 {
		t.Fatalf("close floor %v, want 10", f)
	}
}

// TestFloorReplacedDropCarriesBcsid (review should-fix 5): the main drop
// path, driven by the manager: a replica's datanode dies (its last report
// CLOSED at 10 known to the leader), the manager copies the container
// from a healthy replica, records the copy, then drops the dead replica
// ("replaced by healthy replicas"). The op carries its BCSID (10, within
// the kept replicas' 10) and the floor names it. Fails with the bcsids
// taken out of the "replaced" op.
func TestFloorReplacedDropCarriesBcsid(t *testing.T) {
	r := newFloorCluster(t)
	e, ids := r.e, r.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	for _, id := range ids[:3] {
		r.holds[id][cid] = closedRep(cid, 10)
	}
	r.round(t)
	r.silent[ids[0]] = true
	for range 200 {
		r.round(t)
		if !slices.Contains(e.st.Container(cid).Replicas, ids[0]) {
			break
		}
	}
	var op *metapb.ReplicasRemovedOp
	for _, x := range e.fr.cmds() {
		if o := x.GetReplicasRemoved(); o != nil && o.ContainerId == cid {
			op = o
		}
	}
	if op == nil || !slices.Equal(op.DatanodeIds, []uint64{ids[0]}) || op.Reason != "replaced by healthy replicas" || !slices.Equal(op.Bcsids, []uint64{10}) {
		t.Fatalf("drop op %v, want datanode %d replaced with its BCSID 10", op, ids[0])
	}
	c := e.st.Container(cid)
	if f := c.GetBcsidFloor(); f.GetBcsid() != 10 || f.GetDatanodeId() != ids[0] || !strings.Contains(f.GetReason(), "replaced") {
		t.Fatalf("floor %v, want 10 from the replaced datanode %d", f, ids[0])
	}
	if hs := healthOf(t, e, cid); hs != "healthy" {
		t.Fatalf("container ends %s, want healthy", hs)
	}
}

// TestFloorDropCountsOnlyDropped (review should-fix 5): Apply raises the
// floor only by the BCSIDs of replicas the op really drops; a datanode
// the op names that is not a replica (a stale or hand-made op) adds
// nothing. Fails with the only-really-dropped filter taken out of Apply.
func TestFloorDropCountsOnlyDropped(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	cid := e.closedOn(t, 100, ids[:3]...)
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{
		ContainerId: cid, DatanodeIds: []uint64{ids[4], ids[0]}, Bcsids: []uint64{20, 5}, Reason: "test"}}}); err != nil {
		t.Fatal(err)
	}
	c := e.st.Container(cid)
	if f := c.GetBcsidFloor(); slices.Contains(c.Replicas, ids[0]) || f.GetBcsid() != 5 || f.GetDatanodeId() != ids[0] {
		t.Fatalf("after dropping %d (5) and naming non-member %d (20): %v, want the floor 5 from %d", ids[0], ids[4], c, ids[0])
	}
}
