package datanode_test

import (
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestLogDirFailedReportsPipelineFailed: datanode 1 has one Raft log
// directory, on an error-injecting FS, holding both its pipeline of one
// (P1: nothing written to it, so no open container on the datanode to
// report UNHEALTHY) and its pipeline of three. The directory's WAL sync
// fails. SCM closes P1 within a few heartbeats, with a reason naming the
// datanode and the directory (the datanode reports it failed), lists the
// datanode with 1 of 1 log directories failed, still HEALTHY, and places
// no new pipeline on it. Before: P1 stayed open until SCM's slow-disk rule
// (2 minutes' interval and minimum age by default) and SCM created new
// pipelines on the datanode that could not start.
func TestLogDirFailedReportsPipelineFailed(t *testing.T) {
	e, ffs := startFaultLogEnv(t, 21200, "raftA")
	dn0 := e.c.Datanode(0)
	ctx := testCtx(t)
	listPipes := func() []*metapb.Pipeline {
		pl, err := e.mc.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
		if err != nil {
			return nil
		}
		return pl.GetPipelines()
	}
	// A block in a pipeline of three with datanode 1; its log on datanode 1
	// is the directory that fails.
	b := e.block()
	if !slices.ContainsFunc(b.GetDatanodes(), func(d *metapb.DatanodeDetails) bool { return d.GetId() == dn0.ID() }) {
		t.Fatalf("block's pipeline %d lacks datanode 1", b.GetPipelineId())
	}
	d := randBytes(4096, 12)
	if _, err := e.putSmall(b, smallBlock(b, d), d); err != nil {
		t.Fatal(err)
	}
	p3 := b.GetPipelineId()
	dir := dn0.PipelineLogDir(p3)
	if dir == "" {
		t.Fatalf("pipeline %d has no log dir on datanode 1", p3)
	}
	var p1 uint64
	waitFor(t, 30*time.Second, "datanode 1's pipeline of one, started there", func() bool {
		for _, p := range listPipes() {
			if p.GetReplication() == metapb.Replication_ONE && p.GetState() == metapb.PipelineState_PIPELINE_OPEN &&
				slices.Equal(p.GetDatanodes(), []uint64{dn0.ID()}) && dn0.PipelineLogDir(p.GetId()) == dir {
				p1 = p.GetId()
				return true
			}
		}
		return false
	})
	if err := dn0.Heartbeat(); err != nil {
		t.Fatal(err)
	}
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, dir+"/") && strings.HasSuffix(path, ".log") {
			return syscall.EIO
		}
		return nil
	})
	defer ffs.SetInject(nil)
	// An entry in the pipeline of three: datanode 1's save of it fails.
	_ = e.leaderOf(p3).Execute(&metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CloseContainer{
		CloseContainer: &metapb.CloseContainerCommand{ContainerId: b.GetId().GetContainerId(), PipelineId: p3}}})
	waitFor(t, 60*time.Second, "log dir failed on datanode 1", func() bool {
		for _, st := range dn0.LogDirs() {
			if st.Dir == dir && st.Failed {
				return true
			}
		}
		return false
	})
	failedAt := time.Now()
	// Heartbeats every 200 ms: closed within a few (10 s allows for a
	// loaded machine; the slow-disk rule would take 2 minutes).
	var reason string
	waitFor(t, 10*time.Second, "SCM closes the pipeline of one", func() bool {
		for _, p := range listPipes() {
			if p.GetId() == p1 && p.GetState() == metapb.PipelineState_PIPELINE_CLOSED {
				reason = p.GetCloseReason()
				return true
			}
		}
		return false
	})
	t.Logf("pipeline %d closed %v after its log directory failed: %q", p1, time.Since(failedAt).Round(time.Millisecond), reason)
	if !strings.Contains(reason, "datanode "+strconv.FormatUint(dn0.ID(), 10)) || !strings.Contains(reason, dir) || strings.Contains(reason, "slow disk") {
		t.Fatalf("close reason %q: want the datanode %d and the directory %s", reason, dn0.ID(), dir)
	}
	var st *metapb.DatanodeStatus
	waitFor(t, 10*time.Second, "ListDatanodes shows the failed log directory", func() bool {
		r, err := e.mc.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
		if err != nil {
			return false
		}
		for _, x := range r.GetDatanodes() {
			if x.GetDetails().GetId() == dn0.ID() {
				st = x
			}
		}
		return st != nil && st.GetLogDirs() == 1 && st.GetLogDirsFailed() == 1
	})
	if st.GetState() != metapb.NodeState_HEALTHY {
		t.Fatalf("datanode 1 with its log directory failed: %v, want HEALTHY (its closed containers serve)", st.GetState())
	}
	// No new pipeline goes on it (SCM ticks every 50 ms).
	waitFor(t, 10*time.Second, "every pipeline with datanode 1 closed", func() bool {
		for _, p := range listPipes() {
			if p.GetState() == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.GetDatanodes(), dn0.ID()) {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * time.Second)
	for _, p := range listPipes() {
		if p.GetState() == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.GetDatanodes(), dn0.ID()) {
			t.Fatalf("pipeline %d placed on datanode 1 after its only log directory failed", p.GetId())
		}
	}
}
