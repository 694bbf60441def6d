package datanode_test

import (
	"bytes"

	"errors"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestLogDirFailedClosesPipeline: datanode 1 has two Raft log directories
// on an error-injecting FS. The WAL sync of the one holding pipeline P's
// log fails (EIO): the datanode stays up, its replica of P stops, it reports
// P's open container UNHEALTHY, and SCM closes P and the container (which
// closes on the other two replicas). A GET of the object written before
// still works on those replicas, and a container CLOSED on datanode 1
// before the failure keeps serving reads there. Before: the log store's
// Pebble panicked (quietLogger.Fatalf) and took the datanode down.
func TestLogDirFailedClosesPipeline(t *testing.T) {
	e, ffs := startFaultLogEnv(t, 21100, "raftA", "raftB")
	dn0 := e.c.Datanode(0)
	ctx := testCtx(t)

	// b0: written, then its container closed through its pipeline on every
	// replica (datanode 1 included) before the failure.
	b0 := e.block()
	d0 := randBytes(4096, 10)
	if _, err := e.putSmall(b0, smallBlock(b0, d0), d0); err != nil {
		t.Fatal(err)
	}
	c0 := b0.GetId().GetContainerId()
	if err := e.leaderOf(b0.GetPipelineId()).Execute(&metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CloseContainer{
		CloseContainer: &metapb.CloseContainerCommand{ContainerId: c0, PipelineId: b0.GetPipelineId()}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "container closed on datanode 1", func() bool {
		r, err := dn0.Store().Container(storage.ContainerID(c0))
		return err == nil && r.State == storage.StateClosed
	})

	// b1: an open container; its pipeline's log on datanode 1 is the
	// directory that fails.
	var b1 *metapb.BlockLocation
	for range 200 {
		b := e.block()
		if b.GetId().GetContainerId() != c0 {
			b1 = b
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if b1 == nil {
		t.Fatal("no block outside the closed container")
	}
	d1 := randBytes(4096, 11)
	if _, err := e.putSmall(b1, smallBlock(b1, d1), d1); err != nil {
		t.Fatal(err)
	}
	p, c1 := b1.GetPipelineId(), b1.GetId().GetContainerId()
	dir := dn0.PipelineLogDir(p)
	if dir == "" {
		t.Fatalf("pipeline %d has no log dir on datanode 1", p)
	}
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, dir+"/") && strings.HasSuffix(path, ".log") {
			return syscall.EIO
		}
		return nil
	})
	defer ffs.SetInject(nil)
	// An entry in P's log: datanode 1's save of it fails.
	_ = e.leaderOf(p).Execute(&metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CloseContainer{
		CloseContainer: &metapb.CloseContainerCommand{ContainerId: c1, PipelineId: p}}})

	waitFor(t, 60*time.Second, "log dir failed on datanode 1", func() bool {
		for _, st := range dn0.LogDirs() {
			if st.Dir == dir && st.Failed {
				return true
			}
		}
		return false
	})
	for _, st := range dn0.LogDirs() {
		if st.Dir != dir && st.Failed {
			t.Fatalf("the other log dir failed too: %+v", st)
		}
	}
	if e.c.Datanode(0) == nil {
		t.Fatal("datanode 1 is gone")
	}
	waitFor(t, 60*time.Second, "SCM closes the pipeline and the container", func() bool {
		pl, err := e.mc.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
		if err != nil {
			return false
		}
		closed := false
		for _, x := range pl.GetPipelines() {
			if x.GetId() == p && x.GetState() == metapb.PipelineState_PIPELINE_CLOSED {
				closed = true
			}
		}
		cs, err := e.mc.Scm.GetContainers(ctx, &metapb.GetContainersRequest{ContainerIds: []uint64{c1}})
		if err != nil || len(cs.GetContainers()) != 1 {
			return false
		}
		return closed && cs.GetContainers()[0].GetContainer().GetState() == metapb.ContainerState_CONTAINER_CLOSED
	})
	// The object in the closed container reads back on the healthy replicas.
	for _, d := range b1.GetDatanodes() {
		if d.GetId() == dn0.ID() {
			continue
		}
		_, dn := e.byID(d.GetId())
		if got := readAll(t, dn.Addr(), bid(b1)); !bytes.Equal(got, d1) {
			t.Fatalf("datanode %d: block of the closed container reads %d bytes, differing", d.GetId(), len(got))
		}
	}
	// The container closed before the failure serves on datanode 1.
	if got := readAll(t, dn0.Addr(), bid(b0)); !bytes.Equal(got, d0) {
		t.Fatalf("datanode 1: block of a container closed before the failure reads %d bytes, differing", len(got))
	}
	if r, err := dn0.Store().Container(storage.ContainerID(c1)); err != nil && !errors.Is(err, storage.ErrContainerNotFound) {
		t.Fatal(err)
	} else if err == nil && r.State != storage.StateUnhealthy && r.State != storage.StateClosed {
		t.Fatalf("datanode 1's replica of the container in the failed pipeline: %v", r.State)
	}
}

// startFaultLogEnv starts a cluster (BasePort port) whose first datanode
// keeps its Raft logs in the given directories (under its data dir) on an
// error-injecting FS, returned.
func startFaultLogEnv(t *testing.T, port int, logDirs ...string) (*env, *vfs.FaultFS) {
	t.Helper()
	var ffs *vfs.FaultFS
	e := startEnvWith(t, func(c *cluster.Config) {
		c.BasePort = port
		c.DatanodeConfig = func(i int, dc *datanode.Config) {
			if i != 0 {
				return
			}
			base := dc.FS
			if base == nil {
				base = vfs.Default
			}
			ffs = vfs.NewFaultFS(base)
			dc.FS = ffs
			for _, d := range logDirs {
				dc.LogDirs = append(dc.LogDirs, filepath.Join(dc.DataDir, d))
			}
		}
	})
	return e, ffs
}
