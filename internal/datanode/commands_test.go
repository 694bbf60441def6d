package datanode_test

import (
	"context"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/vfs"
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

func missingDeleteCmd(tx uint64) *metapb.DatanodeCommand {
	return &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_DeleteBlocks{DeleteBlocks: &metapb.DeleteBlocksCommand{
		TxId: tx, ContainerId: 1 << 40, LocalIds: []uint64{1}}}}
}

// TestCommandsRunInOrderOneAtATime: queued commands run one at a time in
// the order they came (SCM relies on it: a container's delete after its
// replication, a pipeline's close after its create); at Close the one
// running finishes, the queued ones are dropped (counted as abandoned)
// and nothing runs after Close returns.
func TestCommandsRunInOrderOneAtATime(t *testing.T) {
	e := startEnv(t)
	dn := e.c.Datanode(0)
	var (
		mu       sync.Mutex
		order    []uint64
		inFlight int
		most     int
		hold     = make(chan struct{})
		closed   bool
		afterRun bool
	)
	dn.SetCommandHook(func(c *metapb.DatanodeCommand) {
		tx := c.GetDeleteBlocks().GetTxId()
		if tx < 1000 {
			return // SCM's own commands
		}
		mu.Lock()
		if closed {
			afterRun = true
		}
		order = append(order, tx)
		inFlight++
		most = max(most, inFlight)
		mu.Unlock()
		if tx == 1100 {
			<-hold
		} else {
			time.Sleep(5 * time.Millisecond)
		}
		mu.Lock()
		inFlight--
		mu.Unlock()
	})
	for tx := uint64(1001); tx <= 1020; tx++ {
		dn.QueueCommand(missingDeleteCmd(tx))
	}
	waitFor := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			mu.Lock()
			got := len(order)
			mu.Unlock()
			if got >= n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d commands ran in 20 s", got, n)
			}
		}
	}
	waitFor(20)
	mu.Lock()
	for i, tx := range order {
		if tx != uint64(1001+i) {
			t.Fatalf("commands ran in the order %v", order)
		}
	}
	if most != 1 {
		t.Fatalf("%d commands ran at once, want 1", most)
	}
	mu.Unlock()

	// Close while 1100 runs and 1101..1104 wait.
	dn.QueueCommand(missingDeleteCmd(1100))
	for tx := uint64(1101); tx <= 1104; tx++ {
		dn.QueueCommand(missingDeleteCmd(tx))
	}
	waitFor(21)
	done := make(chan struct{})
	go func() { dn.Close(); close(done) }()
	time.Sleep(100 * time.Millisecond) // Close is waiting for the running command
	close(hold)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return after the running command finished")
	}
	mu.Lock()
	closed = true
	ran := len(order)
	mu.Unlock()
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if ran != 21 || afterRun || len(order) != 21 {
		t.Fatalf("ran %v (after Close: %v); want 1001..1020 and 1100 only", order, afterRun)
	}
	if st := dn.CommandStats(); st.Abandoned < 4 || st.Waiting != 0 {
		t.Fatalf("stats after Close %+v: want the 4 queued commands abandoned", st)
	}
}

// slowSaveFS makes the sync of the datanode's pipelines.json take delay
// while armed.
type slowSaveFS struct {
	vfs.FS
	file  string
	delay time.Duration
	armed atomic.Bool
	slow  atomic.Int32
}

func (f *slowSaveFS) Create(name string, cat pvfs.DiskWriteCategory) (pvfs.File, error) {
	file, err := f.FS.Create(name, cat)
	if err != nil || name != f.file+".tmp" || !f.armed.Load() {
		return file, err
	}
	return &slowSyncFile{File: file, fs: f}, nil
}

type slowSyncFile struct {
	pvfs.File
	fs *slowSaveFS
}

func (f *slowSyncFile) Sync() error {
	f.fs.slow.Add(1)
	time.Sleep(f.fs.delay)
	return f.File.Sync()
}

// TestSlowPipelinesSaveKeepsHeartbeats: leaving a pipeline writes
// pipelines.json with an fsync; on a slow data-directory disk (here 3 s,
// above SCM's 2 s stale interval) that write no longer holds the lock
// heartbeats take, so SCM never sees the datanode STALE. Before, the file
// was written under d.mu and the heartbeat waited for it.
func TestSlowPipelinesSaveKeepsHeartbeats(t *testing.T) {
	var slow *slowSaveFS
	e := startEnvWith(t, func(c *cluster.Config) {
		c.DatanodeConfig = func(i int, dc *datanode.Config) {
			if i == 0 {
				fs := dc.FS
				if fs == nil {
					fs = vfs.Default
				}
				slow = &slowSaveFS{FS: fs, file: filepath.Join(dc.DataDir, "pipelines.json"), delay: 3 * time.Second}
				dc.FS = slow
			}
		}
	})
	e.block() // pipelines open
	dn := e.c.Datanode(0)
	slow.armed.Store(true)
	victim := e.c.Datanode(1).ID()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := e.mc.Scm.SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING}); err != nil {
		t.Fatal(err)
	}
	var (
		started time.Time
		worst   time.Duration
	)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("datanode %d wrote no slow pipelines.json within 30 s of the decommission", dn.ID())
		}
		if slow.slow.Load() > 0 && started.IsZero() {
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
				t.Fatalf("datanode %d is %v to SCM while it writes pipelines.json slowly", dn.ID(), d.GetState())
			}
			if !started.IsZero() {
				worst = max(worst, time.Since(time.UnixMilli(d.GetLastHeartbeatUnixMs())))
			}
		}
		if !started.IsZero() && time.Since(started) > 4*time.Second {
			break
		}
	}
	t.Logf("longest heartbeat gap SCM saw during slow pipelines.json writes: %v (%d slow writes)", worst, slow.slow.Load())
	if worst > 1500*time.Millisecond {
		t.Fatalf("SCM heard nothing from datanode %d for %v while pipelines.json was written", dn.ID(), worst)
	}
}
