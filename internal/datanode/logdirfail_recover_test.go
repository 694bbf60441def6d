package datanode

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestLogDirFailedSingleVoterRecover (review finding 2): the raft log
// directory of a single-voter pipeline (RF=ONE) fails. Its replica is the
// only one, so SCM can close its containers on no healthy replica: the
// container, marked UNHEALTHY ("raft log directory ... failed"), would stay
// CLOSING for good. The operator's `container recover` takes it: once the
// pipeline is left, RecoverContainer verifies every committed block and
// makes the replica CLOSED, readable, with every acknowledged block.
// Before, the reason was not recoverable (ErrRecoverRefused: "another
// cause").
func TestLogDirFailedSingleVoterRecover(t *testing.T) {
	ffs := vfs.NewFaultFS(vfs.NewMem(vfs.MemOptions{}))
	d, err := New(Config{DataDir: "/dn", MetaAddrs: []string{"127.0.0.1:1"}, TLS: pki.Insecure(), FS: ffs,
		TickInterval: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	d.ident.ID = 1
	h, err := raft.NewHost(raft.HostConfig{ID: 1, LogDirs: d.cfg.LogDirs, ListenAddr: "127.0.0.1:21510", Resolve: d.resolveRaft,
		Security: d.raftSecurity(), TickInterval: d.cfg.TickInterval, FS: d.cfg.FS, Logger: d.log,
		OnLogDirFailed: d.onLogDirFailed})
	if err != nil {
		t.Fatal(err)
	}
	d.host = h
	const pid, cid = 7, 3
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		t.Fatal(err)
	}
	g, err := d.host.Group(pid)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); !g.IsLeader(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("single-replica pipeline elected no leader")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	blocks := map[uint64][]byte{}
	for lid := uint64(1); lid <= 3; lid++ {
		data, err := putBlockVia(ctx, g, cid, lid)
		if err != nil {
			t.Fatalf("block %d: %v", lid, err)
		}
		blocks[lid] = data
	}
	logDir := d.cfg.LogDirs[0] + "/"
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, logDir) && strings.HasSuffix(path, ".log") {
			return syscall.EIO
		}
		return nil
	})
	defer ffs.SetInject(nil)
	if _, err := putBlockVia(ctx, g, cid, 9); err == nil {
		t.Fatal("a write acknowledged after the log directory failed")
	}
	for deadline := time.Now().Add(20 * time.Second); stateOf(t, d, cid) != storage.StateUnhealthy; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("container %d is %v after its log directory failed, want UNHEALTHY", cid, stateOf(t, d, cid))
		}
	}
	why := reportOf(d, cid).GetUnhealthyReason()
	t.Logf("reason: %s", why)
	if !errors.Is(g.Failure(), raft.ErrLogDirFailed) || !recoverableReason(why) {
		t.Fatalf("group failure %v, reason %q: want ErrLogDirFailed and a recoverable reason", g.Failure(), why)
	}
	// SCM closes the pipeline (its replica is unhealthy): it is left here.
	if err := d.leavePipeline(pid); err != nil {
		t.Fatal(err)
	}
	st, err := d.RecoverContainer(cid, "")
	if err != nil {
		t.Fatalf("recover: %v", err)
	}
	if st.Blocks != 3 {
		t.Fatalf("verified %+v, want 3 blocks", st)
	}
	if s := stateOf(t, d, cid); s != storage.StateClosed {
		t.Fatalf("container %d is %v after recover, want CLOSED", cid, s)
	}
	if missing := blocksThere(d, cid, blocks); len(missing) > 0 {
		t.Fatalf("blocks %v missing after recover", missing)
	}
	if r := reportOf(d, cid); r.GetState() != metapb.ContainerState_CONTAINER_CLOSED || r.GetBcsid() == 0 {
		t.Fatalf("report %v, want CLOSED with its BCSID", r)
	}
}
