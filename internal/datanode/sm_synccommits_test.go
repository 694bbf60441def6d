package datanode

import (
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// A pipeline's Apply makes its batch's block commits durable on its own
// containers' volumes only: a stalled disk holding other pipelines'
// containers does not stall it (SyncCommits synced every volume, so one
// slow disk stalled every pipeline of the datanode).
func TestApplyNotStalledByOtherVolume(t *testing.T) {
	dir := t.TempDir()
	fast, slow := filepath.Join(dir, "fast"), filepath.Join(dir, "slow")
	lfs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{
		fast: {Capacity: 1 << 40},
		slow: {Capacity: 1 << 40},
	}, 1)
	ffs := vfs.NewFaultFS(lfs)
	st, err := storage.Open(storage.Options{Volumes: []string{fast, slow}, FS: ffs, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var released atomic.Bool
	unblock := func() {
		if released.CompareAndSwap(false, true) {
			close(release)
		}
	}
	t.Cleanup(func() { unblock(); st.Close() })
	// Containers go to the volume with the most room: a block written
	// into the first one sends the next to the other volume.
	on := map[string]storage.ContainerID{}
	for cid := storage.ContainerID(1); len(on) < 2 && cid < 8; cid++ {
		r, err := st.CreateContainer(cid, storage.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := on[r.Volume]; !ok {
			on[r.Volume] = cid
		}
		p := randBytes(uint64(cid), 1<<20)
		if err := st.WriteChunk(cid, 100, 0, p, storage.DefaultChecksum.Compute(p), true); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Sync(); err != nil {
		t.Fatal(err)
	}
	fc, ok1 := on[fast]
	sc, ok2 := on[slow]
	if !ok1 || !ok2 {
		t.Fatalf("containers not on both volumes: %v", on)
	}
	// Another pipeline's block commit on the slow volume, not synced yet.
	p := randBytes(1, 4096)
	sum := storage.DefaultChecksum.Compute(p)
	if err := st.WriteChunk(sc, 1, 0, p, sum, true); err != nil {
		t.Fatal(err)
	}
	if err := st.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := st.PutBlockDeferred(sc, storage.BlockData{LocalID: 1, Length: 4096, BCSID: 1,
		Chunks: []storage.ChunkInfo{{Offset: 0, Length: 4096, Checksum: sum}}}); err != nil {
		t.Fatal(err)
	}
	// The slow disk stalls its syncs; its pipeline's flush hangs on it.
	var blocked atomic.Int32
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, slow+string(filepath.Separator)) {
			blocked.Add(1)
			<-release
		}
		return nil
	})
	slowDone := make(chan error, 1)
	go func() { slowDone <- st.SyncCommitsFor([]storage.ContainerID{sc}) }()
	deadline := time.Now().Add(10 * time.Second)
	for blocked.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the slow volume's WAL sync never started")
		}
		time.Sleep(time.Millisecond)
	}

	sm, err := newContainerSM(1000, st, vfs.Default, filepath.Join(dir, "sm"), &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	data := randBytes(2, 4096)
	e := smallFileEntry(7, uint64(fc), 42, data)
	if err := sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	applied := make(chan any, 1)
	go func() { applied <- sm.Apply([]raft.Entry{e})[0] }()
	select {
	case res := <-applied:
		if err, ok := res.(error); ok {
			t.Fatalf("apply on the fast volume: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Apply of a batch on the fast volume waited for the stalled volume's WAL sync")
	}
	unblock()
	select {
	case err := <-slowDone:
		if err != nil {
			t.Fatalf("slow volume's SyncCommitsFor: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("slow volume's SyncCommitsFor never returned")
	}
}
