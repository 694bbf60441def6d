package scm

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// pipefailEnv: 4 datanodes on two racks, out of safe mode, with their
// pipelines created. beat sends every datanode a heartbeat listing the
// open pipelines it is in (report adds to a datanode's request), then
// ticks once.
func pipefailEnv(t *testing.T) (*env, []uint64, func(report func(dn uint64, req *metapb.HeartbeatRequest))) {
	t.Helper()
	// The slow-disk rule stays at its defaults (2m interval and minimum
	// age): the clock never moves, so it cannot close anything here.
	e := newEnv(t, Config{PipelineLimit: 2, SafeModeMinDatanodes: 4})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/r%d", i%2)))
	}
	beat := func(report func(dn uint64, req *metapb.HeartbeatRequest)) {
		t.Helper()
		for _, id := range ids {
			req := &metapb.HeartbeatRequest{DatanodeId: id}
			for _, p := range e.st.Pipelines() {
				if p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, id) {
					req.Pipelines = append(req.Pipelines, &metapb.PipelineReport{PipelineId: p.Id})
				}
			}
			if report != nil {
				report(id, req)
			}
			if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.m.Tick(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	return e, ids, beat
}

// A member's report that its replica of a pipeline failed closes the
// pipeline at the next tick (no unhealthy replica, slow-disk rule not
// involved), with a reason naming the datanode and its directory, and
// its open containers go CLOSING. A report by a non-member, or of an
// unknown pipeline, changes nothing. Fails without pipefail.go (the
// pipeline stays open).
func TestFailedPipelineReportClosesAtOnce(t *testing.T) {
	e, ids, beat := pipefailEnv(t)
	beat(nil)
	beat(nil)
	var p *metapb.Pipeline
	for _, x := range e.st.OpenPipelines(metapb.Replication_THREE) {
		p = x
		break
	}
	if p == nil {
		t.Fatal("no pipeline of three")
	}
	member := p.Datanodes[0]
	var outsider uint64
	for _, id := range ids {
		if !slices.Contains(p.Datanodes, id) {
			outsider = id
		}
	}
	if outsider == 0 {
		t.Fatalf("pipeline %v has every datanode", p.Datanodes)
	}
	const reason = "raft log directory /disk3/raftA failed"
	// The outsider names p (and an unknown pipeline) failed: nothing.
	for range 3 {
		beat(func(dn uint64, req *metapb.HeartbeatRequest) {
			if dn == outsider {
				req.Pipelines = append(req.Pipelines, &metapb.PipelineReport{PipelineId: p.Id, Failed: reason},
					&metapb.PipelineReport{PipelineId: 999999, Failed: reason})
			}
		})
	}
	if got := e.st.Pipeline(p.Id); got.State != metapb.PipelineState_PIPELINE_OPEN {
		t.Fatalf("a non-member's report closed pipeline %d: %v %q", p.Id, got.State, got.CloseReason)
	}
	open := 0
	for _, c := range e.st.OpenContainers() {
		if c.PipelineId == p.Id {
			open++
		}
	}
	if open == 0 {
		t.Fatalf("pipeline %d has no open container in SCM", p.Id)
	}
	// A member reports it failed, once: closed at that tick.
	beat(func(dn uint64, req *metapb.HeartbeatRequest) {
		if dn != member {
			return
		}
		for _, r := range req.Pipelines {
			if r.PipelineId == p.Id {
				r.Failed = reason
			}
		}
	})
	got := e.st.Pipeline(p.Id)
	if got.State != metapb.PipelineState_PIPELINE_CLOSED {
		t.Fatalf("pipeline %d reported failed by member %d: %v", p.Id, member, got.State)
	}
	if want := fmt.Sprintf("failed on datanode %d: %s", member, reason); got.CloseReason != want {
		t.Fatalf("close reason %q, want %q", got.CloseReason, want)
	}
	for _, c := range e.st.Containers() {
		if c.PipelineId == p.Id && c.State == metapb.ContainerState_CONTAINER_OPEN {
			t.Fatalf("container %d of the failed pipeline still OPEN", c.Id)
		}
	}
	if len(e.m.pipeFailed) != 0 {
		t.Fatalf("pending failures left: %v", e.m.pipeFailed)
	}
	// Other pipelines were not touched by the failure.
	for _, x := range e.st.Pipelines() {
		if x.Id != p.Id && strings.HasPrefix(x.CloseReason, "failed on") {
			t.Fatalf("pipeline %d closed too: %q", x.Id, x.CloseReason)
		}
	}
}

// A datanode that reports every Raft log directory failed gets no new
// pipeline (of one or of three) and ListDatanodes shows its counts; once
// it reports a healthy directory (a restart), it gets pipelines again.
// Fails without the placement check (it gets pipelines at once).
func TestNoPipelineWithoutHealthyLogDir(t *testing.T) {
	e, ids, beat := pipefailEnv(t)
	bad := ids[0]
	failed := func(dn uint64, req *metapb.HeartbeatRequest) {
		req.LogDirs = 2
		if dn == bad {
			req.LogDirsFailed = 2
		}
	}
	in := func(dn uint64) (n int) {
		for _, p := range e.st.Pipelines() {
			if p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, dn) {
				n++
			}
		}
		return n
	}
	for range 4 {
		beat(failed)
	}
	if len(e.st.OpenPipelines(metapb.Replication_THREE)) == 0 || in(ids[1]) == 0 {
		t.Fatal("no pipelines on the healthy datanodes")
	}
	if n := in(bad); n != 0 {
		t.Fatalf("datanode %d without a healthy log directory is in %d open pipelines", bad, n)
	}
	r, err := e.m.ListDatanodes()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range r.Datanodes {
		want := uint32(0)
		if d.Details.Id == bad {
			want = 2
		}
		if d.LogDirs != 2 || d.LogDirsFailed != want || d.State != metapb.NodeState_HEALTHY {
			t.Fatalf("datanode %d: log dirs %d failed %d, state %v", d.Details.Id, d.LogDirs, d.LogDirsFailed, d.State)
		}
	}
	// Restarted with a healthy directory (one of two failed is enough).
	for range 4 {
		beat(func(dn uint64, req *metapb.HeartbeatRequest) {
			req.LogDirs = 2
			if dn == bad {
				req.LogDirsFailed = 1
			}
		})
	}
	if n := in(bad); n == 0 {
		t.Fatalf("datanode %d with a healthy log directory again is in no pipeline", bad)
	}
}
