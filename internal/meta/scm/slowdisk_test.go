package scm

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Pipelines a member reports on its slow disk are closed one per
// CloseInterval, oldest first, none younger than MinAge; the datanode's
// slow disks show in ListDatanodes.
func TestSlowDiskPipelinesClosedOneAtATime(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, Config{PipelineLimit: 2, SafeModeMinDatanodes: 6, Registerer: reg,
		SlowDisk: SlowDiskConfig{CloseInterval: 10 * time.Second, MinAge: 5 * time.Second}})
	var ids []uint64
	for i := range 6 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/r%d", i%2)))
	}
	slowDN := ids[0]
	beat := func() {
		t.Helper()
		for _, id := range ids {
			req := &metapb.HeartbeatRequest{DatanodeId: id}
			for _, p := range e.st.Pipelines() {
				if p.State != metapb.PipelineState_PIPELINE_OPEN {
					continue
				}
				for _, m := range p.Datanodes {
					if m == id {
						r := &metapb.PipelineReport{PipelineId: p.Id}
						if id == slowDN {
							r.SlowDisk = "/disk7/raft"
						}
						req.Pipelines = append(req.Pipelines, r)
					}
				}
			}
			if id == slowDN {
				req.SlowDisks = []*metapb.SlowDisk{{Path: "/disk7/raft", Kind: "log", MedianFlushUs: 60000, PeersMedianUs: 6000, LimitUs: 20000}}
			}
			if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.m.Tick(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	closedSlow := func() (n int) {
		for _, p := range e.st.Pipelines() {
			if strings.Contains(p.CloseReason, "slow disk") {
				if !strings.Contains(p.CloseReason, fmt.Sprintf("datanode %d", slowDN)) {
					t.Fatalf("close reason %q", p.CloseReason)
				}
				n++
			}
		}
		return n
	}
	beat()
	beat()
	withSlow := 0
	for _, p := range e.st.Pipelines() {
		for _, m := range p.Datanodes {
			if m == slowDN && len(p.Datanodes) == 3 {
				withSlow++
			}
		}
	}
	if withSlow < 2 {
		t.Fatalf("datanode %d in %d pipelines of three", slowDN, withSlow)
	}
	if n := closedSlow(); n != 0 {
		t.Fatalf("%d closed before MinAge", n)
	}
	e.clk.Advance(6 * time.Second)
	beat()
	if n := closedSlow(); n != 1 {
		t.Fatalf("after MinAge: %d closed, want 1", n)
	}
	for range 4 { // 8 s more: still inside CloseInterval
		e.clk.Advance(2 * time.Second)
		beat()
	}
	if n := closedSlow(); n != 1 {
		t.Fatalf("inside CloseInterval: %d closed, want 1", n)
	}
	e.clk.Advance(3 * time.Second)
	beat()
	if n := closedSlow(); n != 2 {
		t.Fatalf("after CloseInterval: %d closed, want 2", n)
	}
	if v := testutil.ToFloat64(e.m.slow.counter); v != 2 {
		t.Fatalf("basalt_scm_slow_disk_pipeline_closes_total %v, want 2", v)
	}
	if n, err := testutil.GatherAndCount(reg, "basalt_scm_slow_disk_pipeline_closes_total"); err != nil || n != 1 {
		t.Fatalf("registered: %d %v", n, err)
	}
	r, err := e.m.ListDatanodes()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range r.Datanodes {
		if want := d.Details.Id == slowDN; (len(d.SlowDisks) == 1) != want {
			t.Fatalf("datanode %d slow disks %v", d.Details.Id, d.SlowDisks)
		}
	}
}

// CloseInterval < 0: never closed for a slow disk.
func TestSlowDiskClosingOff(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 2, SafeModeMinDatanodes: 3, SlowDisk: SlowDiskConfig{CloseInterval: -1}})
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), ""))
	}
	for range 3 {
		for _, id := range ids {
			req := &metapb.HeartbeatRequest{DatanodeId: id}
			for _, p := range e.st.Pipelines() {
				req.Pipelines = append(req.Pipelines, &metapb.PipelineReport{PipelineId: p.Id, SlowDisk: "/x"})
			}
			if _, err := e.m.Heartbeat(e.ctx, req); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.m.Tick(e.ctx); err != nil {
			t.Fatal(err)
		}
		e.clk.Advance(time.Hour / 1000)
	}
	for _, p := range e.st.Pipelines() {
		if p.State != metapb.PipelineState_PIPELINE_OPEN {
			t.Fatalf("pipeline %d closed: %q", p.Id, p.CloseReason)
		}
	}
}
