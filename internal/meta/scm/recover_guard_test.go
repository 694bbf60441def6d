package scm

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// recoverEnv: container cid of pipeline 1 on ids[:3], UNHEALTHY on all
// three by an apply bug at the given BCSIDs (recorded through Raft), a
// closed container good beside it, and a recovery started.
type recoverEnv struct {
	*env
	ids       []uint64
	cid, good uint64
	reports   map[uint64][]*metapb.ContainerReport
}

const recoverBug = "entry 12 (PutBlock) failed in apply: runtime error: index out of range [3] with length 0"

func newRecoverEnv(t *testing.T, bcsids [3]uint64) *recoverEnv {
	t.Helper()
	e := &recoverEnv{env: newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1}), reports: map[uint64][]*metapb.ContainerReport{}}
	for i := range 5 {
		e.ids = append(e.ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: e.ids[:3]}}}); err != nil {
		t.Fatal(err)
	}
	var cids []uint64
	for range 2 {
		res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: FirstPipelineID}}})
		if err != nil {
			t.Fatal(err)
		}
		cids = append(cids, res.(*metapb.Container).Id)
	}
	e.cid, e.good = cids[0], cids[1]
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: e.good, UsedBytes: 100}}}); err != nil {
		t.Fatal(err)
	}
	for i, id := range e.ids[:3] {
		e.set(id, e.sick(bcsids[i]))
	}
	e.round(t)
	e.round(t)
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 3 {
		t.Fatalf("after the bug: %v", c)
	}
	e.start(t, false)
	e.round(t)
	return e
}

func (e *recoverEnv) sick(bcsid uint64) *metapb.ContainerReport {
	return &metapb.ContainerReport{ContainerId: e.cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UsedBytes: 300, BlockCount: 3, Bcsid: bcsid, UnhealthyReason: recoverBug}
}

// set makes dn report rep (nil: it no longer lists cid) beside good.
func (e *recoverEnv) set(dn uint64, rep *metapb.ContainerReport) {
	e.reports[dn] = []*metapb.ContainerReport{closedRep(e.good, 5)}
	if rep != nil {
		e.reports[dn] = append(e.reports[dn], rep)
	}
}

// round: the given datanodes (all with a report when none given) send a
// full report, then a tick.
func (e *recoverEnv) round(t *testing.T, only ...uint64) map[uint64][]*metapb.DatanodeCommand {
	t.Helper()
	if only == nil {
		only = e.ids
	}
	out := map[uint64][]*metapb.DatanodeCommand{}
	for _, id := range only {
		out[id] = e.report(t, id, e.reports[id]...).Commands
	}
	e.tick(t)
	return out
}

func (e *recoverEnv) start(t *testing.T, acceptMissing bool) *metapb.RecoverContainerResponse {
	t.Helper()
	resp, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: e.cid, AcceptMissingReplicas: acceptMissing})
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	return resp
}

func (e *recoverEnv) statuses(t *testing.T) (map[uint64]string, *metapb.RecoverContainerResponse) {
	t.Helper()
	resp, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: e.cid, StatusOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	st := map[uint64]string{}
	for _, r := range resp.Replicas {
		st[r.DatanodeId] = r.Status
	}
	return st, resp
}

// TestRecoverMissingNewerReplicaBlocks (review should-fix 1): replicas at
// BCSIDs 9, 9 and 7; the two 9s are then lost (their live datanodes no
// longer list the container), the 7 recovers CLOSED. It may lack blocks
// the 9s acknowledged, so it is not counted ("blocked", the 9s "missing")
// until the operator passes --accept-missing-replicas; then it is, and
// the op records the accepted loss.
func TestRecoverMissingNewerReplicaBlocks(t *testing.T) {
	e := newRecoverEnv(t, [3]uint64{9, 9, 7})
	e.set(e.ids[0], nil)
	e.set(e.ids[1], nil)
	e.set(e.ids[2], closedRep(e.cid, 7))
	for range 3 {
		e.round(t)
	}
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 3 {
		t.Fatalf("a BCSID-7 replica was counted while the 9s are missing: unhealthy %v", c.UnhealthyReplicas)
	}
	st, resp := e.statuses(t)
	if st[e.ids[0]] != "missing" || st[e.ids[1]] != "missing" || st[e.ids[2]] != "blocked" || resp.Done {
		t.Fatalf("statuses %v, done %v", st, resp.Done)
	}
	if r := resp.Replicas[2]; !strings.Contains(r.Reason, "--accept-missing-replicas") {
		t.Fatalf("blocked reason %q does not name the flag", r.Reason)
	}

	if resp := e.start(t, true); !resp.AcceptMissingReplicas {
		t.Fatalf("restart with the flag: %v", resp)
	}
	e.round(t)
	if c := e.st.Container(e.cid); slices.Contains(c.UnhealthyReplicas, e.ids[2]) {
		t.Fatalf("with --accept-missing-replicas the recovered replica is still not counted: %v", c.UnhealthyReplicas)
	}
	var op *metapb.ReplicaRecoveredOp
	for _, c := range e.fr.cmds() {
		if x := c.GetReplicaRecovered(); x != nil {
			op = x
		}
	}
	if op == nil || !strings.Contains(op.Reason, "accepted losing") {
		t.Fatalf("the op does not record the accepted loss: %v", op)
	}
}

// TestRecoverWaitsForDeadDatanode (review should-fix 4): replicas at 9
// (its datanode then dies), 7 and 7, the 7s recovered CLOSED: nothing is
// counted while the 9's datanode is dead (status "dead", the 7s
// "waiting"); once it is back and reports 9, the 7s are "stale" and still
// not counted.
func TestRecoverWaitsForDeadDatanode(t *testing.T) {
	e := newRecoverEnv(t, [3]uint64{9, 7, 7})
	e.set(e.ids[1], closedRep(e.cid, 7))
	e.set(e.ids[2], closedRep(e.cid, 7))
	rest := []uint64{e.ids[1], e.ids[2], e.ids[3], e.ids[4]}
	for range 12 {
		e.clk.Advance(e.m.cfg.HeartbeatInterval)
		e.round(t, rest...)
	}
	st, resp := e.statuses(t)
	if st[e.ids[0]] != "dead" || st[e.ids[1]] != "waiting" || st[e.ids[2]] != "waiting" || resp.Done {
		t.Fatalf("statuses with the 9's datanode dead: %v (done %v)", st, resp.Done)
	}
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 3 {
		t.Fatalf("a BCSID-7 replica was counted while the datanode of the 9 is dead: unhealthy %v", c.UnhealthyReplicas)
	}
	e.round(t)
	st, _ = e.statuses(t)
	if st[e.ids[1]] != "stale" || st[e.ids[2]] != "stale" {
		t.Fatalf("statuses once the 9 reported: %v", st)
	}
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 3 {
		t.Fatalf("a stale replica was counted: unhealthy %v", c.UnhealthyReplicas)
	}
}

// TestRecoverWaitsForFullReports (review should-fix 4): after a failover
// the 7s report CLOSED to the new leader, the 9's datanode has not sent it
// a full report yet: nothing is counted (even with
// --accept-missing-replicas, which accepts a replica a live datanode no
// longer lists, never one not heard), its status is "waiting".
func TestRecoverWaitsForFullReports(t *testing.T) {
	e := newRecoverEnv(t, [3]uint64{9, 7, 7})
	e.set(e.ids[1], closedRep(e.cid, 7))
	e.set(e.ids[2], closedRep(e.cid, 7))
	e.failover(t)
	e.start(t, true)
	rest := []uint64{e.ids[1], e.ids[2], e.ids[3], e.ids[4]}
	for range 3 {
		e.round(t, rest...)
	}
	st, resp := e.statuses(t)
	if st[e.ids[0]] != "waiting" || !strings.Contains(resp.Replicas[0].Reason, "full report") {
		t.Fatalf("statuses before the 9 reported: %v", resp.Replicas)
	}
	if c := e.st.Container(e.cid); len(c.UnhealthyReplicas) != 3 {
		t.Fatalf("a BCSID-7 replica was counted before the datanode of the 9 reported: unhealthy %v", c.UnhealthyReplicas)
	}
}

// TestRecoverRetryAfterFailure (review should-fix 3): a replica whose
// last recovery failed shows "failed" only for a report sent after its
// last command: once the operator runs recover again the retry is
// "waiting" (so --wait does not stop), and "failed" again only if the
// datanode reports a new failure.
func TestRecoverRetryAfterFailure(t *testing.T) {
	e := newRecoverEnv(t, [3]uint64{9, 9, 9})
	failed := e.sick(9)
	failed.UnhealthyReason = recoverFailedPrefix + "block 2 failed verification; was: " + recoverBug
	e.clk.Advance(e.m.cfg.HeartbeatInterval)
	e.set(e.ids[0], failed)
	e.round(t)
	if st, _ := e.statuses(t); st[e.ids[0]] != "failed" {
		t.Fatalf("after a failure reported: %v", st)
	}
	e.start(t, false) // the operator runs it again
	if st, _ := e.statuses(t); st[e.ids[0]] != "waiting" {
		t.Fatalf("rerun, command not sent yet: %v, want waiting", st)
	}
	cmds := e.round(t) // the command goes out; the report still carries the old failure
	if _, ok := findCmd(cmds[e.ids[0]], (*metapb.DatanodeCommand).GetRecoverContainer); !ok {
		t.Fatalf("the rerun sent no command: %v", cmds[e.ids[0]])
	}
	if st, _ := e.statuses(t); st[e.ids[0]] != "waiting" {
		t.Fatalf("retry running: %v, want waiting", st)
	}
	e.clk.Advance(e.m.cfg.HeartbeatInterval)
	e.round(t)
	if st, _ := e.statuses(t); st[e.ids[0]] != "failed" {
		t.Fatalf("a failure reported after the retry's command: %v, want failed", st)
	}
}

// cmds decodes every command proposed so far.
func (f *fakeRaft) cmds() []*metapb.ScmCommand {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*metapb.ScmCommand
	for _, b := range f.props {
		c := &metapb.ScmCommand{}
		if proto.Unmarshal(b, c) == nil {
			out = append(out, c)
		}
	}
	return out
}
