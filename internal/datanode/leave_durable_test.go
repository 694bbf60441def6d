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
// which is what makes the block commits applied since the last persist
// durable. A power loss at any file operation of the leave (every sync,
// rename, remove) leaves either the pipeline still listed, so a restart
// rejoins it and applies its entries again from its log, or every block
// it committed durable in storage. Fails with the pipeline dropped from
// the pipelines file before its commits are synced (a crash in between
// loses the last commits with no log to replay them from).
func TestLeavePipelineKeepsCommits(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	d := openMemDatanode(t, fs)
	const pid, cid = 7, 3
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		d.Close()
		t.Fatal(err)
	}
	blocks := putUntilUnsynced(t, d, pid, cid)

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

	sawUnsynced := false
	for i, img := range images {
		d2 := openMemDatanode(t, img)
		d2.mu.Lock()
		_, listed := d2.pipelines[pid]
		d2.mu.Unlock()
		missing := blocksThere(d2, cid, blocks)
		if listed {
			// Rejoined: its log replays what storage lacks.
			for deadline := time.Now().Add(20 * time.Second); len(missing) > 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				sawUnsynced = true
				missing = blocksThere(d2, cid, blocks)
			}
		}
		d2.Close()
		if len(missing) > 0 {
			t.Fatalf("power loss before %q (image %d, pipeline listed: %v): blocks %v lost", ops[i], i, listed, missing)
		}
	}
	t.Logf("%d crash images; some relied on replay from the kept log: %v", len(images), sawUnsynced)
	if !sawUnsynced {
		t.Error("no crash image needed the replay: the leave had nothing unsynced to lose")
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

// TestLeavePipelineSyncFailureKeepsLog: if the block commits applied since
// the last persist cannot be synced when the datanode leaves a pipeline,
// the leave fails and keeps everything that lets a restart find them
// again: the pipeline stays in the pipelines file, its Raft log and its
// files stay, and the container is marked UNHEALTHY (recorded in the
// pipeline's unhealthy list). The old leave dropped the pipeline and its
// log and deleted that list regardless.
func TestLeavePipelineSyncFailureKeepsLog(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	var fail atomic.Bool
	fs.SetInject(func(op, path string) error {
		if fail.Load() && op == "sync" && strings.HasPrefix(path, "/dn/data/") && strings.HasSuffix(path, ".block") {
			return errors.New("injected: disk gone")
		}
		return nil
	})
	d := openMemDatanode(t, fs)
	defer d.Close()
	const pid, cid = 7, 3
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		t.Fatal(err)
	}
	putUntilUnsynced(t, d, pid, cid)
	d.mu.Lock()
	sm := d.sms[pid]
	d.mu.Unlock()
	// The volume fails under another writer (Pebble takes a failed WAL
	// sync as fatal) before the leave syncs the commits.
	if _, err := d.store.CreateContainer(99, storage.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := d.store.WriteChunk(99, 1, 0, randBytes(9, 1<<20), storage.ChecksumData{}, false); err != nil {
		t.Fatal(err)
	}
	fail.Store(true)
	if err := d.store.SyncContainers([]storage.ContainerID{99}); !errors.Is(err, storage.ErrVolumeFailed) {
		t.Fatalf("sync on the failing disk: %v, want ErrVolumeFailed", err)
	}
	if err := d.leavePipeline(pid); err == nil {
		t.Fatal("leaving a pipeline whose commits could not be synced succeeded")
	}
	if _, ok := sm.lacks(cid); !ok {
		t.Fatalf("container %d not recorded UNHEALTHY after its commits could not be synced", cid)
	}
	img := fs.Crash()
	b, err := vfs.ReadFile(img, d.pipelinesFile())
	if err != nil || !strings.Contains(strings.Join(strings.Fields(string(b)), ""), `"id":"7"`) {
		t.Fatalf("pipelines file after the failed leave: %q, %v; want pipeline %d still listed", b, err, pid)
	}
	if b, err := vfs.ReadFile(img, sm.sickFile); err != nil || !strings.Contains(string(b), "not synced") {
		t.Fatalf("unhealthy list after the failed leave: %q, %v", b, err)
	}
	if !slices.Contains(d.host.StoredGroups(), pid) {
		t.Fatalf("pipeline %d's Raft log dropped by the failed leave (stored groups %v)", pid, d.host.StoredGroups())
	}
	// The loss is recorded now, so persist moves the index on; a repeated
	// close still keeps the log and the list until a restart.
	if err := d.leavePipeline(pid); err == nil {
		t.Fatal("second leave after the failed sync succeeded")
	}
	if b, err := vfs.ReadFile(fs.Crash(), sm.sickFile); err != nil || !strings.Contains(string(b), "not synced") {
		t.Fatalf("unhealthy list after the second leave: %q, %v", b, err)
	}
}

// putUntilUnsynced puts small blocks into cid through pipeline pid (a
// single-replica group this datanode leads) until at least one commit is
// left for a persist to sync: an apply's own persist may have synced
// them all on a slow machine. It returns the blocks put.
func putUntilUnsynced(t *testing.T, d *Datanode, pid, cid uint64) map[uint64][]byte {
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
	unsynced := func() bool {
		sm.persistMu.Lock()
		defer sm.persistMu.Unlock()
		return len(sm.unsyncedCommits) > 0
	}
	blocks := map[uint64][]byte{}
	for i := 0; i < 6 || !unsynced(); i++ {
		if i == 100 {
			t.Fatal("every commit synced by the apply's own persists")
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
