package scm

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The replication manager removes nothing (a replica dropped, a stray copy
// deleted, a datanode let go) on the strength of replicas it has not seen,
// and a client's corruption report condemns no replica.

// failover makes the env's manager lose and regain leadership: its soft
// state (what datanodes reported) starts over, as on a new leader.
func (e *env) failover(t *testing.T) {
	t.Helper()
	e.fr.mu.Lock()
	e.fr.leader = false
	e.fr.mu.Unlock()
	e.m.ContainerHealth(1)
	e.fr.mu.Lock()
	e.fr.leader = true
	e.fr.mu.Unlock()
	e.m.ContainerHealth(1)
}

// deletes returns the DeleteContainer commands in a heartbeat's answer.
func deletes(r *metapb.HeartbeatResponse) []*metapb.DeleteContainerCommand {
	var out []*metapb.DeleteContainerCommand
	for _, c := range r.Commands {
		if dc := c.GetDeleteContainer(); dc != nil {
			out = append(out, dc)
		}
	}
	return out
}

// TestFailoverKeepsTheOnlySeenReplica: container X has four recorded
// replicas (one too many); after a failover only the fourth datanode
// reports. The three others count as healthy (not heard yet), but the
// only replica the new leader has seen must not be picked as the one too
// many, nor a copy nobody records be deleted while the replicas that make
// the count are unseen. Once every datanode reported, the extra replica
// goes.
func TestFailoverKeepsTheOnlySeenReplica(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r1", "/r2")
	ids := f.ids
	x := e.closedOn(t, 100, ids[0], ids[1], ids[2])
	f.hold(x, 5, ids[0], ids[1], ids[2])
	f.round(t)
	f.round(t)
	if !e.st.SafeModeExited() {
		t.Fatal("no safe mode exit")
	}
	// The old leader recorded a copy on ids[3] (the end of a maintenance,
	// a mis-replication fix), and ids[4] holds a copy nobody recorded (a
	// copy the old leader scheduled), then it lost leadership.
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: x, DatanodeId: ids[3]}}}); err != nil {
		t.Fatal(err)
	}
	f.hold(x, 5, ids[3], ids[4])
	e.failover(t)
	// The new leader hears only ids[3] and ids[4]; ids[0..2] have not
	// reported yet (their disks may be gone).
	for range 4 {
		for _, dn := range ids[3:] {
			if d := deletes(e.report(t, dn, closedRep(x, 5))); len(d) > 0 {
				t.Fatalf("datanode %d told to delete %v while the replicas that make the count (%v) are unseen", dn, d, e.st.Container(x).Replicas)
			}
		}
		e.tick(t)
		e.clk.Advance(time.Second)
	}
	if got := e.st.Container(x).Replicas; !slices.Contains(got, ids[3]) {
		t.Fatalf("the only replica seen (datanode %d) was dropped: replicas %v", ids[3], got)
	}
	// Everyone reports: X is over-replicated for real now and sheds one,
	// and the unrecorded copy on ids[4] is deleted.
	for i := 0; len(e.st.Container(x).Replicas) != 3 || f.holds[ids[4]][x] != 0; i++ {
		if i == 10 {
			t.Fatalf("replicas %v, ids[4] holds %v: want 3 replicas and the stray copy deleted", e.st.Container(x).Replicas, f.holds[ids[4]])
		}
		f.round(t)
	}
}

// TestDeadNodeIsNotLetGo: a datanode leaving service that dies with the
// only copy of a container on it stays DECOMMISSIONING (or
// ENTERING_MAINTENANCE): its replica, now on a dead datanode, still counts
// as drain work, and a datanode is let go only while live and reported.
func TestDeadNodeIsNotLetGo(t *testing.T) {
	for _, tc := range []struct {
		to, done metapb.NodeOpState
	}{
		{metapb.NodeOpState_DECOMMISSIONING, metapb.NodeOpState_DECOMMISSIONED},
		{metapb.NodeOpState_ENTERING_MAINTENANCE, metapb.NodeOpState_IN_MAINTENANCE},
	} {
		t.Run(tc.to.String(), func(t *testing.T) {
			e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
			f := newFleet(t, e, "/r1", "/r1", "/r2", "/r2")
			ids := f.ids
			res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_ONE, Datanodes: []uint64{ids[0]}}}})
			if err != nil {
				t.Fatal(err)
			}
			pid := res.(*metapb.Pipeline).Id
			res, err = e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: pid}}})
			if err != nil {
				t.Fatal(err)
			}
			cid := res.(*metapb.Container).Id
			for _, op := range []*metapb.ScmCommand{
				{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: []uint64{pid}, Reason: "t"}}},
				{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: cid, UsedBytes: 100}}},
			} {
				if _, err := e.m.propose(e.ctx, op); err != nil {
					t.Fatal(err)
				}
			}
			f.hold(cid, 5, ids[0])
			// A round in which copies never finish (slow): every live
			// datanode reports what it holds; the other containers are
			// whole.
			round := func() {
				for _, c := range e.st.Containers() {
					if c.Id != cid {
						for _, r := range c.Replicas {
							f.hold(c.Id, 1, r)
						}
					}
				}
				for _, id := range ids {
					if f.silent[id] {
						continue
					}
					var reps []*metapb.ContainerReport
					for c, b := range f.holds[id] {
						reps = append(reps, closedRep(c, b))
					}
					e.report(t, id, reps...)
				}
				e.tick(t)
				e.clk.Advance(time.Second)
			}
			round()
			if _, err := e.m.SetOpState(e.ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[0], State: tc.to}); err != nil {
				t.Fatal(err)
			}
			for range 3 {
				round()
			}
			if st := f.opState(t, ids[0]).OpState; st != tc.to {
				t.Fatalf("op state %v before the crash, want %v (the copy is not done)", st, tc.to)
			}
			f.silent[ids[0]] = true // it dies mid-copy
			for range 20 {
				round()
			}
			if st := f.opState(t, ids[0]).OpState; st != tc.to {
				t.Fatalf("op state %v while container %d's only replica is on the dead datanode (replicas %v)", st, cid, e.st.Container(cid).Replicas)
			}
		})
	}
}

// TestClientCorruptReportIsRecordedOnly: a client's corruption report is
// stored and listed but condemns no replica (a faulty client would
// otherwise have every healthy replica but one replaced); the holding
// datanode's own report (it re-verified the block) or its UNHEALTHY
// container report does, and the replica is replaced.
func TestClientCorruptReportIsRecordedOnly(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	f := newFleet(t, e, "/r1", "/r1", "/r2", "/r2")
	ids := f.ids
	x := e.closedOn(t, 100, ids[0], ids[1], ids[2])
	f.hold(x, 5, ids[0], ids[1], ids[2])
	f.round(t)
	report := func(dn uint64, who string, byHolder bool) {
		t.Helper()
		if err := e.m.ReportCorrupt(e.ctx, &metapb.ReportCorruptReplicaRequest{Block: &metapb.BlockID{ContainerId: x, LocalId: 7}, DatanodeId: dn, Reason: "checksum mismatch"}, who, byHolder); err != nil {
			t.Fatal(err)
		}
	}
	// One client fails every replica but the last (and then the last).
	for _, dn := range ids[:3] {
		report(dn, "client 10.0.0.9", false)
	}
	// Another datanode is not the holder either.
	report(ids[1], fmt.Sprintf("datanode %d", ids[3]), false)
	for range 3 {
		f.round(t)
	}
	if c := e.st.Container(x); len(c.UnhealthyReplicas) > 0 || len(c.Replicas) != 3 {
		t.Fatalf("clients' reports condemned replicas: %v unhealthy, replicas %v", c.UnhealthyReplicas, c.Replicas)
	}
	if got := len(e.st.ReplicaReports(x)); got != 3 {
		t.Fatalf("%d reports stored, want 3 (one per replica)", got)
	}
	// The datanode re-verifies ids[0]'s block and reports it: condemned,
	// then replaced by a copy on ids[3].
	report(ids[0], fmt.Sprintf("datanode %d", ids[0]), true)
	for i := 0; slices.Contains(e.st.Container(x).Replicas, ids[0]); i++ {
		if i == 10 {
			t.Fatalf("replicas %v, unhealthy %v: the replica its datanode condemned was not replaced", e.st.Container(x).Replicas, e.st.Container(x).UnhealthyReplicas)
		}
		f.round(t)
	}
	if got := e.st.Container(x).Replicas; len(got) != 3 || !slices.Contains(got, ids[3]) {
		t.Fatalf("replicas %v, want ids[1..3]", got)
	}
}
