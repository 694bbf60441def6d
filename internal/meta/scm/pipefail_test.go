package scm

import (
	"bytes"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

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
	// A member reports it failed, once. Until the next tick, allocation
	// neither hands out p nor creates a container on it.
	req := &metapb.HeartbeatRequest{DatanodeId: member, Pipelines: []*metapb.PipelineReport{{PipelineId: p.Id, Failed: reason}}}
	if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
		t.Fatal(err)
	}
	before := len(e.st.Containers())
	allocs := 0
	for range 20 {
		r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE})
		if err != nil {
			continue // no other pipeline of three may be usable
		}
		allocs++
		if r.Blocks[0].PipelineId == p.Id {
			t.Fatalf("block allocated on pipeline %d after member %d reported it failed, before the tick", p.Id, member)
		}
	}
	for _, c := range e.st.Containers()[before:] {
		if c.PipelineId == p.Id {
			t.Fatalf("container %d created on pipeline %d reported failed", c.Id, p.Id)
		}
	}
	t.Logf("%d of 20 allocations before the tick, none on pipeline %d", allocs, p.Id)
	// Closed at the next tick.
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
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

// Every pipeline of one reported failed by its member, no tick yet:
// allocation of ONE finds no pipeline, hands out none of them and creates
// no container on them (without the check in pickContainer, all 20 went
// to a failed pipeline: review finding 1).
func TestFailedPipelineNotAllocatedBeforeTick(t *testing.T) {
	e, _, beat := pipefailEnv(t)
	beat(nil)
	beat(nil)
	ones := e.st.OpenPipelines(metapb.Replication_ONE)
	if len(ones) == 0 {
		t.Fatal("no pipeline of one")
	}
	failed := map[uint64]bool{}
	for _, p := range ones {
		failed[p.Id] = true
		req := &metapb.HeartbeatRequest{DatanodeId: p.Datanodes[0], Pipelines: []*metapb.PipelineReport{{PipelineId: p.Id, Failed: "raft log directory /x failed"}}}
		if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	before := len(e.st.Containers())
	for range 20 {
		r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_ONE})
		if err == nil && failed[r.Blocks[0].PipelineId] {
			t.Fatalf("block allocated on pipeline %d reported failed", r.Blocks[0].PipelineId)
		}
	}
	if n := len(e.st.Containers()) - before; n != 0 {
		t.Fatalf("%d containers created while every pipeline of one was reported failed", n)
	}
}

// A pipeline on a datanode that then reports every Raft log directory
// failed, and never lists the pipeline (its group never started there,
// so it is never reported failed): allocation skips it at once, and the
// next tick closes it with a reason naming the datanode, which a
// non-admin sees with the path part hidden (scmserver.go's pattern).
// Without the fix it stays OPEN and takes blocks (review finding 2).
func TestNoLogDirsClosesOpenPipelines(t *testing.T) {
	e, ids, beat := pipefailEnv(t)
	beat(nil)
	beat(nil)
	bad := ids[0]
	var mine []uint64
	for _, p := range e.st.Pipelines() {
		if p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, bad) {
			mine = append(mine, p.Id)
		}
	}
	if len(mine) == 0 {
		t.Fatalf("datanode %d in no pipeline", bad)
	}
	// Its counts arrive, without any pipeline; no tick yet.
	req := &metapb.HeartbeatRequest{DatanodeId: bad, LogDirs: 1, LogDirsFailed: 1}
	if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
		t.Fatal(err)
	}
	for _, repl := range []metapb.Replication{metapb.Replication_ONE, metapb.Replication_THREE} {
		for range 20 {
			r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: repl})
			if err == nil && slices.Contains(mine, r.Blocks[0].PipelineId) {
				t.Fatalf("%v block allocated on pipeline %d of datanode %d with no healthy log directory", repl, r.Blocks[0].PipelineId, bad)
			}
		}
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("failed on datanode %d: every raft log directory failed", bad)
	for _, id := range mine {
		p := e.st.Pipeline(id)
		if p.State != metapb.PipelineState_PIPELINE_CLOSED || p.CloseReason != want {
			t.Fatalf("pipeline %d of datanode %d with every log directory failed: %v %q, want CLOSED %q", id, bad, p.State, p.CloseReason, want)
		}
	}
	for _, p := range e.st.Pipelines() {
		if !slices.Contains(mine, p.Id) && strings.HasPrefix(p.CloseReason, "failed on") {
			t.Fatalf("pipeline %d (not on datanode %d) closed too: %q", p.Id, bad, p.CloseReason)
		}
	}
	// Further beats (the datanode still reports no pipeline): none of its
	// own again, and the healthy datanodes keep theirs.
	for range 3 {
		beat(func(dn uint64, req *metapb.HeartbeatRequest) {
			req.LogDirs = 1
			if dn == bad {
				req.LogDirsFailed = 1
				req.Pipelines = nil
			}
		})
	}
	for _, p := range e.st.OpenPipelines(metapb.Replication_ONE) {
		if slices.Contains(p.Datanodes, bad) {
			t.Fatalf("open pipeline %d on datanode %d", p.Id, bad)
		}
	}
	if len(e.st.OpenPipelines(metapb.Replication_ONE)) == 0 {
		t.Fatal("no pipeline of one left on the healthy datanodes")
	}
}

// The bounds on what a datanode sends: a huge failed reason with control
// characters is kept cleaned and at most maxFailedReasonBytes (so the
// close reason still has the "failed on datanode N: " prefix the server
// hides the rest of), failed > total is taken as all failed, and the
// non-member reports logged per datanode stop at maxFailWarned with one
// line saying so.
func TestPipelineFailureInputBounds(t *testing.T) {
	t.Run("reason", func(t *testing.T) {
		e, _, beat := pipefailEnv(t)
		beat(nil)
		beat(nil)
		p := e.st.OpenPipelines(metapb.Replication_ONE)[0]
		long := "raft log directory /d\nINJECTED\x00\x1b[31m" + strings.Repeat("é", 5000) + " failed"
		beat(func(dn uint64, req *metapb.HeartbeatRequest) {
			for _, r := range req.Pipelines {
				if r.PipelineId == p.Id && dn == p.Datanodes[0] {
					r.Failed = long
				}
			}
		})
		got := e.st.Pipeline(p.Id)
		if got.State != metapb.PipelineState_PIPELINE_CLOSED {
			t.Fatalf("pipeline %d: %v", p.Id, got.State)
		}
		prefix := fmt.Sprintf("failed on datanode %d: ", p.Datanodes[0])
		rest, ok := strings.CutPrefix(got.CloseReason, prefix)
		if !ok || len(rest) > maxFailedReasonBytes || !utf8.ValidString(rest) || strings.ContainsAny(rest, "\n\x00\x1b") {
			t.Fatalf("close reason (%d bytes) %.120q…", len(got.CloseReason), got.CloseReason)
		}
		if !strings.HasPrefix(rest, "raft log directory /d INJECTED") {
			t.Fatalf("close reason lost its start: %q", got.CloseReason)
		}
	})
	t.Run("clamp", func(t *testing.T) {
		e, ids, beat := pipefailEnv(t)
		beat(func(dn uint64, req *metapb.HeartbeatRequest) {
			req.LogDirs = 2
			if dn == ids[0] {
				req.LogDirsFailed = 7
			}
		})
		r, err := e.m.ListDatanodes()
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range r.Datanodes {
			if d.Details.Id == ids[0] && (d.LogDirs != 2 || d.LogDirsFailed != 2) {
				t.Fatalf("datanode %d reported 7 of 2 failed: listed %d/%d", ids[0], d.LogDirsFailed, d.LogDirs)
			}
		}
		for _, p := range e.st.Pipelines() {
			if p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, ids[0]) {
				t.Fatalf("pipeline %d on datanode %d that reported 7 of 2 failed", p.Id, ids[0])
			}
		}
	})
	t.Run("warned", func(t *testing.T) {
		e, ids, _ := pipefailEnv(t)
		var buf bytes.Buffer
		e.m.log = slog.New(slog.NewTextHandler(&buf, nil))
		req := &metapb.HeartbeatRequest{DatanodeId: ids[0]}
		for i := range 3 * maxFailWarned {
			req.Pipelines = append(req.Pipelines, &metapb.PipelineReport{PipelineId: uint64(500000 + i), Failed: "x"})
		}
		for range 3 {
			if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
				t.Fatal(err)
			}
		}
		out := buf.String()
		if n := strings.Count(out, "not a member of; ignored"); n != maxFailWarned {
			t.Fatalf("%d non-member lines logged, want %d", n, maxFailWarned)
		}
		if n := strings.Count(out, "further ones are ignored without a log line"); n != 1 {
			t.Fatalf("%d cap lines logged, want 1:\n%s", n, out)
		}
		e.m.mu.Lock()
		n := len(e.m.nodes[ids[0]].failWarned)
		e.m.mu.Unlock()
		if n > maxFailWarned {
			t.Fatalf("failWarned holds %d", n)
		}
		if len(e.m.pipeFailed) != 0 {
			t.Fatalf("non-member reports queued: %v", e.m.pipeFailed)
		}
	})
}

// Review side note: a pipeline of one closed for a failed log directory
// leaves CLOSING the empty containers SCM made for it (fillContainers),
// which the datanode never created (it creates one on its first write, and
// none came). No replica will ever report them closed; they close empty on
// the existing path once the member's full report (sent after the close,
// one goes every FullReportEvery heartbeats) lacks them (closedReports), so
// they do not stay CLOSING and block decommission. An acknowledged write
// would have created and reported the container: with it reported, the
// container does not close here (it waits for the replica's close or for
// recovery).
func TestFailedPipelineEmptyContainersClose(t *testing.T) {
	e, _, beat := pipefailEnv(t)
	beat(nil)
	beat(nil)
	p := e.st.OpenPipelines(metapb.Replication_ONE)[0]
	dn := p.Datanodes[0]
	var cs []uint64
	for _, c := range e.st.OpenContainers() {
		if c.PipelineId == p.Id {
			cs = append(cs, c.Id)
		}
	}
	if len(cs) < 2 {
		t.Fatalf("pipeline %d has %d open containers, want 2+", p.Id, len(cs))
	}
	// The datanode holds (and reports) the first one: it got a write.
	held := &metapb.ContainerReport{ContainerId: cs[0], State: metapb.ContainerState_CONTAINER_OPEN, UsedBytes: 4096, Bcsid: 3}
	req := &metapb.HeartbeatRequest{DatanodeId: dn, FullReport: true, Containers: []*metapb.ContainerReport{held},
		Pipelines: []*metapb.PipelineReport{{PipelineId: p.Id, Failed: "raft log directory /x failed"}}}
	if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if s := e.st.Pipeline(p.Id).State; s != metapb.PipelineState_PIPELINE_CLOSED {
		t.Fatalf("pipeline %d: %v", p.Id, s)
	}
	for _, id := range cs {
		if s := e.st.Container(id).State; s != metapb.ContainerState_CONTAINER_CLOSING {
			t.Fatalf("container %d: %v, want CLOSING", id, s)
		}
	}
	// Its next full report, after the close: the held replica is still
	// OPEN (it cannot close: its pipeline's log stopped), the others absent.
	e.clk.Advance(time.Second)
	for range 3 {
		req := &metapb.HeartbeatRequest{DatanodeId: dn, FullReport: true, Containers: []*metapb.ContainerReport{held}}
		if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
			t.Fatal(err)
		}
		if err := e.m.Tick(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	if s := e.st.Container(cs[0]).State; s != metapb.ContainerState_CONTAINER_CLOSING {
		t.Fatalf("container %d the datanode holds: %v, want still CLOSING", cs[0], s)
	}
	for _, id := range cs[1:] {
		c := e.st.Container(id)
		if c.State != metapb.ContainerState_CONTAINER_CLOSED || c.UsedBytes != 0 {
			t.Fatalf("empty container %d of the failed pipeline: %v used %d, want CLOSED empty", id, c.State, c.UsedBytes)
		}
	}
}
