package scm

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestRecoverMissingContainer walks SCM's part of basalt admin container
// recover (recover.go). An apply bug marks container cid UNHEALTHY on all
// three replicas (the third stopped two entries earlier: BCSID 7, the
// others 9); it is MISSING. Then:
//   - a container with healthy replicas is refused (re-replication repairs
//     it), and so is one never unhealthy;
//   - the recovery sends each UNHEALTHY replica's datanode one
//     RecoverContainerCommand carrying SCM's record of the apply bug, once
//     it no longer runs the container's pipeline, not again while it
//     runs, and not to a datanode that reported a failure;
//   - the replicas reported CLOSED with the newest BCSID are counted again
//     (through Raft), the stale one (BCSID 7) stays recorded unhealthy;
//   - the container closes, is no longer missing, and the replication
//     manager copies it back to its factor from the recovered replicas.
//
// Without recover.go and ReplicaRecoveredOp nothing takes a replica off
// unhealthy_replicas: the container stays missing for good.
func TestRecoverMissingContainer(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1})
	var ids []uint64
	for i := range 5 {
		ids = append(ids, e.register(t, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids[:3]}}}); err != nil {
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
	cid, good := cids[0], cids[1]
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: good, UsedBytes: 100}}}); err != nil {
		t.Fatal(err)
	}
	const bug = "entry 12 (PutBlock) failed in apply: runtime error: index out of range [3] with length 0"
	sick := func(bcsid uint64, why string) *metapb.ContainerReport {
		return &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UsedBytes: 300, BlockCount: 3, Bcsid: bcsid, UnhealthyReason: why}
	}
	reports := map[uint64][]*metapb.ContainerReport{
		ids[0]: {sick(9, bug), closedRep(good, 5)}, ids[1]: {sick(9, bug), closedRep(good, 5)}, ids[2]: {sick(7, "entry 10 (WriteChunk) failed in apply: runtime error: x"), closedRep(good, 5)},
	}
	round := func() map[uint64][]*metapb.DatanodeCommand {
		t.Helper()
		out := map[uint64][]*metapb.DatanodeCommand{}
		for _, id := range ids {
			out[id] = e.report(t, id, reports[id]...).Commands
		}
		e.tick(t)
		return out
	}
	round()
	round()
	c := e.st.Container(cid)
	if len(c.UnhealthyReplicas) != 3 || c.State != metapb.ContainerState_CONTAINER_CLOSING {
		t.Fatalf("after the bug: %v", c)
	}
	if h, _ := e.m.ContainerHealth(10); h.Counts[HealthMissing] != 1 {
		t.Fatalf("health after the bug: %v", h.Counts)
	}

	// Refused: healthy replicas; unknown.
	if _, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: good}); code(err) != codes.FailedPrecondition {
		t.Fatalf("recover a healthy container: %v, want FailedPrecondition", err)
	}
	if _, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: 999}); code(err) != codes.NotFound {
		t.Fatalf("recover an unknown container: %v, want NotFound", err)
	}
	// Progress before the start.
	resp, err := e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: cid, StatusOnly: true})
	if err != nil || resp.Running || resp.Done || resp.Replicas[0].Status != "not started" {
		t.Fatalf("status before the start: %v, %v", resp, err)
	}
	resp, err = e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: cid})
	if err != nil || !resp.Running || resp.Done || resp.NewestBcsid != 9 {
		t.Fatalf("start: %v, %v", resp, err)
	}
	// A datanode still running the container's pipeline gets nothing yet
	// (it would refuse: the pipeline may still write the container).
	if r := e.hb(t, ids[0], []uint64{FirstPipelineID}, reports[ids[0]]...); len(r.Commands) > 0 {
		if _, ok := findCmd(r.Commands, (*metapb.DatanodeCommand).GetRecoverContainer); ok {
			t.Fatal("a datanode still running the pipeline got the recover command")
		}
	}
	resp, _ = e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: cid, StatusOnly: true})
	if !strings.Contains(resp.Replicas[0].Reason, "still runs pipeline") {
		t.Fatalf("status of a replica whose datanode runs the pipeline: %v", resp.Replicas[0])
	}
	cmds := round()
	for _, id := range ids[:3] {
		rc, ok := findCmd(cmds[id], (*metapb.DatanodeCommand).GetRecoverContainer)
		if !ok || rc.ContainerId != cid || !strings.Contains(rc.RecordedReason, "failed in apply: runtime error") {
			t.Fatalf("datanode %d got %v, want a recover command with SCM's record", id, cmds[id])
		}
	}
	for _, id := range ids[3:] {
		if _, ok := findCmd(cmds[id], (*metapb.DatanodeCommand).GetRecoverContainer); ok {
			t.Fatalf("datanode %d holds no replica but got a recover command", id)
		}
	}
	// Still running: not sent again; a reported failure is not retried
	// on its own either.
	e.clk.Advance(2 * e.m.cfg.CommandRetryInterval)
	reports[ids[2]] = []*metapb.ContainerReport{sick(7, recoverFailedPrefix+"recover refused: ...; was: ..."), closedRep(good, 5)}
	cmds = round()
	for _, id := range ids {
		if _, ok := findCmd(cmds[id], (*metapb.DatanodeCommand).GetRecoverContainer); ok {
			t.Fatalf("datanode %d got the recover command again while it runs", id)
		}
	}
	e.clk.Advance(e.m.recoverResend())
	cmds = round()
	if _, ok := findCmd(cmds[ids[0]], (*metapb.DatanodeCommand).GetRecoverContainer); !ok {
		t.Fatal("a command not answered within recoverResend was not sent again")
	}
	if _, ok := findCmd(cmds[ids[2]], (*metapb.DatanodeCommand).GetRecoverContainer); ok {
		t.Fatal("a replica that reported a failed recovery got the command again unasked")
	}

	// Recovered: ids[0] and ids[1] with BCSID 9, ids[2] with 7 (stale).
	for _, id := range ids[:3] {
		reports[id] = []*metapb.ContainerReport{closedRep(cid, 9), closedRep(good, 5)}
	}
	reports[ids[2]][0] = closedRep(cid, 7)
	round()
	c = e.st.Container(cid)
	if !slices.Equal(c.UnhealthyReplicas, []uint64{ids[2]}) {
		t.Fatalf("after the recovery: unhealthy %v, want only the stale %d", c.UnhealthyReplicas, ids[2])
	}
	all := map[uint64][]*metapb.DatanodeCommand{}
	for range 3 {
		for id, cs := range round() {
			all[id] = append(all[id], cs...)
		}
	}
	c = e.st.Container(cid)
	if c.State != metapb.ContainerState_CONTAINER_CLOSED {
		t.Fatalf("container after the recovery: %v, want CLOSED", c)
	}
	h, _ := e.m.ContainerHealth(10)
	if h.Counts[HealthMissing] != 0 || len(h.Copies) != 1 || h.Copies[0].ContainerId != cid {
		t.Fatalf("health after the recovery: %v (copies %v), want not missing, one copy", h.Counts, h.Copies)
	}
	resp, err = e.m.RecoverContainer(e.ctx, &metapb.RecoverContainerRequest{ContainerId: cid, StatusOnly: true})
	if err != nil || !resp.Done {
		t.Fatalf("status after the recovery: %v, %v", resp, err)
	}
	st := map[uint64]string{}
	for _, r := range resp.Replicas {
		st[r.DatanodeId] = r.Status
	}
	if st[ids[0]] != "healthy" || st[ids[1]] != "healthy" || st[ids[2]] != "stale" {
		t.Fatalf("replica statuses %v", st)
	}
	for id, cs := range round() {
		all[id] = append(all[id], cs...)
	}
	rc, ok := findCmd(all[h.Copies[0].Target], (*metapb.DatanodeCommand).GetReplicateContainer)
	if !ok || rc.ContainerId != cid || len(rc.Sources) != 2 {
		t.Fatalf("copy target got %v", all[h.Copies[0].Target])
	}
	for _, s := range rc.Sources {
		if s.Id == ids[2] {
			t.Fatal("the stale replica is a copy source")
		}
	}
}
