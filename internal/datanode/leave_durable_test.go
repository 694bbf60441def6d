package datanode

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

func openMemDatanode(t *testing.T, fs vfs.FS) *Datanode {
	t.Helper()
	d, err := New(Config{DataDir: "/dn", MetaAddrs: []string{"127.0.0.1:1"}, TLS: pki.Insecure(), FS: fs,
		TickInterval: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	// What Start does, without an SCM to register with: a Raft host, then
	// the pipelines the datanode had joined.
	d.ident.ID = 1
	h, err := raft.NewHost(raft.HostConfig{ID: 1, LogDirs: d.cfg.LogDirs, ListenAddr: "127.0.0.1:0", Resolve: d.resolveRaft,
		Security: d.raftSecurity(), TickInterval: d.cfg.TickInterval, FS: d.cfg.FS, Logger: d.log, CompactEvery: 4096, CompactKeep: 1024})
	if err != nil {
		d.Close()
		t.Fatal(err)
	}
	d.host = h
	if err := d.restorePipelines(); err != nil {
		d.Close()
		t.Fatal(err)
	}
	return d
}

// blocksThere reports which of the blocks (lid -> data) of container cid
// the datanode holds, whole.
func blocksThere(d *Datanode, cid uint64, blocks map[uint64][]byte) (missing []uint64) {
	for lid, data := range blocks {
		got := make([]byte, len(data))
		if _, err := d.store.ReadAt(storage.ContainerID(cid), storage.LocalID(lid), got, 0); err != nil || !bytes.Equal(got, data) {
			missing = append(missing, lid)
		}
	}
	return missing
}

// TestLeavePipelineKeepsCommits: leaving a pipeline drops its Raft log,
// so nothing may be left for a replay from it: a power loss at any file
// operation of the leave (every sync, rename, remove) leaves either the
// pipeline still listed, so a restart rejoins it, or every block it
// committed durable in storage, with no log to replay them from (the
// image after the leave). Fails if Apply does not make its block commits
// durable before it returns (the leave's images after the pipelines file
// is saved then lack the commits applied since the last persist).
func TestLeavePipelineKeepsCommits(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	d := openMemDatanode(t, fs)
	const pid, cid = 7, 3
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		d.Close()
		t.Fatal(err)
	}
	blocks := putUntilUnpersisted(t, d, pid, cid)

	var (
		mu      sync.Mutex
		capture bool
		images  []*vfs.MemFS
		ops     []string
	)
	fs.SetInject(func(op, path string) error {
		if op == "sync" || op == "rename" || op == "remove" || op == "syncdir" {
			mu.Lock()
			if capture {
				images = append(images, fs.Crash()) // power loss just before op
				ops = append(ops, op+" "+path)
			}
			mu.Unlock()
		}
		return nil
	})
	mu.Lock()
	capture = true
	mu.Unlock()
	if err := d.leavePipeline(pid); err != nil {
		d.Close()
		t.Fatal(err)
	}
	mu.Lock()
	capture = false
	images = append(images, fs.Crash())
	ops = append(ops, "after the leave")
	mu.Unlock()
	fs.SetInject(nil)
	d.Close()
	if missing := blocksThere(openAndClose(t, fs), cid, blocks); len(missing) > 0 {
		t.Fatalf("after a clean leave and restart, blocks %v are missing", missing)
	}

	sawReplay, sawDropped := false, false
	for i, img := range images {
		d2 := openMemDatanode(t, img)
		d2.mu.Lock()
		_, listed := d2.pipelines[pid]
		d2.mu.Unlock()
		missing := blocksThere(d2, cid, blocks)
		if listed {
			// Rejoined: its log replays what storage lacks.
			for deadline := time.Now().Add(20 * time.Second); len(missing) > 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				sawReplay = true
				missing = blocksThere(d2, cid, blocks)
			}
		}
		d2.Close()
		sawDropped = sawDropped || !listed
		if len(missing) > 0 {
			t.Fatalf("power loss before %q (image %d, pipeline listed: %v): blocks %v lost", ops[i], i, listed, missing)
		}
	}
	t.Logf("%d crash images; some showed blocks only after the rejoin: %v", len(images), sawReplay)
	if !sawDropped {
		t.Error("no crash image without the pipeline: nothing checked that the commits outlive its log")
	}
	if !strings.Contains(strings.Join(ops, ","), "rename") {
		t.Fatalf("no rename among the leave's operations: %v", ops)
	}
}

func openAndClose(t *testing.T, fs vfs.FS) *Datanode {
	d := openMemDatanode(t, fs)
	t.Cleanup(func() { d.Close() })
	return d
}

// TestLeavePipelinePersistFailureKeepsLog: if the applied index cannot be
// persisted when the datanode leaves a pipeline (its file cannot be
// written), the leave fails and keeps everything: the pipeline stays in
// the pipelines file, its Raft log and its files stay, and the state
// machine applies nothing more; once the index can be written a repeated
// leave succeeds. The old leave dropped the pipeline and its log
// regardless of the index.
func TestLeavePipelinePersistFailureKeepsLog(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	var failFile atomic.Value // a path prefix whose syncs fail, or ""
	failFile.Store("")
	fs.SetInject(func(op, path string) error {
		if f := failFile.Load().(string); f != "" && op == "sync" && strings.HasPrefix(path, f) {
			return errors.New("injected: disk full")
		}
		return nil
	})
	d := openMemDatanode(t, fs)
	defer d.Close()
	const pid, cid = 7, 3
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		t.Fatal(err)
	}
	blocks := putUntilUnpersisted(t, d, pid, cid)
	d.mu.Lock()
	sm := d.sms[pid]
	d.mu.Unlock()
	failFile.Store(sm.file)
	if err := d.leavePipeline(pid); err == nil {
		t.Fatal("leaving a pipeline whose applied index could not be persisted succeeded")
	}
	img := fs.Crash()
	b, err := vfs.ReadFile(img, d.pipelinesFile())
	if err != nil || !strings.Contains(strings.Join(strings.Fields(string(b)), ""), `"id":"7"`) {
		t.Fatalf("pipelines file after the failed leave: %q, %v; want pipeline %d still listed", b, err, pid)
	}
	if !slices.Contains(d.host.StoredGroups(), pid) {
		t.Fatalf("pipeline %d's Raft log dropped by the failed leave (stored groups %v)", pid, d.host.StoredGroups())
	}
	d.mu.Lock()
	_, kept := d.sms[pid]
	d.mu.Unlock()
	if !kept {
		t.Fatal("failed leave forgot the pipeline's state machine")
	}
	if missing := blocksThere(d, cid, blocks); len(missing) > 0 {
		t.Fatalf("blocks %v gone after the failed leave", missing)
	}
	failFile.Store("")
	if err := d.leavePipeline(pid); err != nil {
		t.Fatalf("repeated leave once the index can be written: %v", err)
	}
	if slices.Contains(d.host.StoredGroups(), pid) {
		t.Fatalf("pipeline %d's Raft log kept after the leave", pid)
	}
	if missing := blocksThere(openAndClose(t, fs.Crash()), cid, blocks); len(missing) > 0 {
		t.Fatalf("blocks %v lost after the leave and a power loss", missing)
	}
}

// putUntilUnpersisted puts small blocks into cid through pipeline pid (a
// single-replica group this datanode leads) until at least one applied
// entry is above the persisted applied index: an apply's own persist may
// have covered them all on a slow machine. It returns the blocks put.
func putUntilUnpersisted(t *testing.T, d *Datanode, pid, cid uint64) map[uint64][]byte {
	t.Helper()
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
	d.mu.Lock()
	sm := d.sms[pid]
	d.mu.Unlock()
	unsynced := func() bool { return sm.durable.Load() < sm.applied.Load() }
	blocks := map[uint64][]byte{}
	for i := 0; i < 6 || !unsynced(); i++ {
		if i == 100 {
			t.Fatal("every entry covered by the apply's own persists")
		}
		lid := uint64(100 + i)
		data := randBytes(lid, 4096)
		if _, err := g.Propose(ctx, smallFileEntry(0, cid, lid, data).Meta, data); err != nil {
			t.Fatalf("put block %d: %v", lid, err)
		}
		blocks[lid] = data
	}
	return blocks
}
