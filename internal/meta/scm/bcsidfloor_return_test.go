package scm

import (
	"slices"
	"strings"
	"testing"
)

// TestFloorDroppedReplicaReturns (review should-fix 3; the reviewer's
// repro): the dropped replica's datanode (it held 10, the floor) comes
// back reporting its copy CLOSED at 10 while the two replicas left hold 7
// and the container is missing. The copy is adopted without the operator
// accepting any loss, the floor stays 10, and the recovered 7s are the
// ones left lagging. Before, the copy was adopted only after
// --accept-dropped-replicas, which recorded a loss of 8-10 that never
// happened and lowered the floor to 7.
func TestFloorDroppedReplicaReturns(t *testing.T) {
	e := newFloorEnv(t, 7, 7)
	e.reports[e.ids[0]] = append(e.reports[e.ids[0]], closedRep(e.cid, 10))
	for range 6 {
		e.round(t)
		e.clk.Advance(e.m.cfg.HeartbeatInterval)
	}
	c := e.st.Container(e.cid)
	if !slices.Contains(c.Replicas, e.ids[0]) {
		t.Fatalf("the returned copy at the floor (datanode %d) is not adopted: %v", e.ids[0], c)
	}
	if f := c.GetBcsidFloor(); f.GetBcsid() != 10 {
		t.Fatalf("floor %v, want 10 (no loss accepted)", f)
	}
	for _, x := range e.fr.cmds() {
		if op := x.GetReplicaRecovered(); op != nil && (op.AcceptedFloor != 0 || strings.Contains(op.Reason, "accepted")) {
			t.Fatalf("a loss was recorded: %v", op)
		}
	}
}

// TestFloorMissingNoFloorNoAdoption: without a floor nothing bounds what
// the dead replicas held, so a copy on another datanode is not adopted
// while the container is missing (as before the floor).
func TestFloorMissingNoFloorNoAdoption(t *testing.T) {
	r := newFloorCluster(t)
	e, ids := r.e, r.ids
	cid := e.closedOn(t, 100, ids[:3]...)
	for _, id := range ids[:3] {
		r.holds[id][cid] = closedRep(cid, 10)
	}
	r.round(t)
	for _, id := range ids[:3] {
		r.silent[id] = true
	}
	for range 200 {
		r.round(t)
	}
	if hs := healthOf(t, e, cid); hs != "missing" {
		t.Fatalf("container %s, want missing", hs)
	}
	r.holds[ids[3]][cid] = closedRep(cid, 3) // an old copy turns up
	for range 10 {
		r.round(t)
	}
	c := e.st.Container(cid)
	t.Logf("container %v health %s", c, healthOf(t, e, cid))
	if slices.Contains(c.Replicas, ids[3]) || c.GetBcsidFloor() != nil {
		t.Fatalf("a copy adopted while missing without a floor: %v", c)
	}
	if hs := healthOf(t, e, cid); hs != "missing" {
		t.Fatalf("container %s, want missing", hs)
	}
}
