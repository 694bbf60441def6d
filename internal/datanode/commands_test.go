package datanode_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestSlowCommandKeepsHeartbeats: a command from a heartbeat answer that
// takes longer than SCM's stale interval (here: every command on
// datanode 1 waits 3 s; the interval is 10 heartbeats, 2 s) no longer
// stops the datanode's heartbeats, so SCM never sees it STALE. Before,
// commands ran inside the heartbeat loop: one slow disk under a pipeline
// join or a container close got a healthy datanode marked STALE and all
// its pipelines closed (cluster.TestSlowDisksAvoided, session 17).
func TestSlowCommandKeepsHeartbeats(t *testing.T) {
	e := startEnv(t)
	e.block() // pipelines open
	dn := e.c.Datanode(0)
	var (
		mu   sync.Mutex
		ran  int
		stop = make(chan struct{})
	)
	dn.SetCommandHook(func(*metapb.DatanodeCommand) {
		mu.Lock()
		ran++
		mu.Unlock()
		select {
		case <-time.After(3 * time.Second):
		case <-stop:
		}
	})
	t.Cleanup(func() { close(stop); dn.SetCommandHook(nil) })
	// Decommissioning another datanode makes SCM close its pipelines:
	// datanode 0 gets ClosePipeline (and CloseContainer) commands.
	victim := e.c.Datanode(1).ID()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := e.mc.Scm.SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING}); err != nil {
		t.Fatal(err)
	}
	var (
		started time.Time
		worst   time.Duration
	)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("datanode %d ran no command within 20 s of the decommission", dn.ID())
		}
		mu.Lock()
		n := ran
		mu.Unlock()
		if n > 0 && started.IsZero() {
			started = time.Now()
		}
		resp, err := e.mc.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range resp.GetDatanodes() {
			if d.GetDetails().GetId() != dn.ID() {
				continue
			}
			if d.GetState() != metapb.NodeState_HEALTHY {
				t.Fatalf("datanode %d is %v to SCM while a command runs (%d commands started)", dn.ID(), d.GetState(), n)
			}
			if !started.IsZero() {
				worst = max(worst, time.Since(time.UnixMilli(d.GetLastHeartbeatUnixMs())))
			}
		}
		if !started.IsZero() && time.Since(started) > 4*time.Second {
			break
		}
	}
	t.Logf("longest heartbeat gap SCM saw while commands were held: %v", worst)
	if worst > 1500*time.Millisecond {
		t.Fatalf("SCM heard nothing from datanode %d for %v while a command ran (heartbeat every 200 ms)", dn.ID(), worst)
	}
	if st := dn.CommandStats(); st.Queued == 0 {
		t.Fatalf("command stats %+v: nothing queued", st)
	}
}
