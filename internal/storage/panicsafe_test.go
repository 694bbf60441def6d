package storage

import (
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/vfs"
)

// Panic safety of storage's locks: a runtime error inside a call that
// holds a block's lock (or a space reservation) is recovered by the
// caller's guard (the datanode's apply and WriteData guards, a request
// handler's), and the process goes on. The lock must not stay held (every
// later request on the block would wait for it for good), nor the
// reservation stay counted.

// openLeaky opens a store that is closed after the test only if it
// passed: Close would wait for a lock a failed test left held.
func openLeaky(t *testing.T) *Store {
	t.Helper()
	s, err := Open(Options{Volumes: []string{t.TempDir()}, ContainerSize: 1 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			s.Close()
		}
	})
	return s
}

// panicAt makes s's test hook hit a runtime error (a nil map write) at
// point, once.
func panicAt(s *Store, point string) {
	s.testHook = func(p string) {
		if p == point {
			s.testHook = nil
			var m map[int]int
			m[0] = 1 // runtime error
		}
	}
}

// recoverRuntime runs f and returns the runtime error it panicked with.
func recoverRuntime(t *testing.T, f func()) {
	t.Helper()
	defer func() {
		t.Helper()
		if _, ok := recover().(runtime.Error); !ok {
			t.Fatal("no runtime error from the injected panic")
		}
	}()
	f()
	t.Fatal("returned without the injected panic")
}

// within fails the test if f does not return within 5 s (a lock left
// held).
func within(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s did not return in 5 s: a lock left held by the recovered panic", what)
	}
}

// TestPanicInCloseReleasesBlockLock: CloseContainer panics while it holds
// the lock of a block with uncommitted data (discardUncommitted); the
// next request on that block (HasChunk, as a replica's apply asks)
// completes.
func TestPanicInCloseReleasesBlockLock(t *testing.T) {
	s := openLeaky(t)
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 4096)
	if err := s.WriteChunk(1, 7, 0, data, DefaultChecksum.Compute(data), true); err != nil {
		t.Fatal(err)
	}
	panicAt(s, "discard uncommitted: block locked")
	recoverRuntime(t, func() { s.CloseContainer(1) })
	within(t, "HasChunk on the block", func() {
		if _, err := s.HasChunk(1, 7, 0, 4096); err != nil {
			t.Errorf("HasChunk: %v", err)
		}
	})
	within(t, "CloseContainer again", func() {
		if err := s.CloseContainer(1); err != nil {
			t.Errorf("CloseContainer again: %v", err)
		}
	})
}

// TestPanicInDeleteBlocksReleasesBlockLock: DeleteBlocks panics while it
// holds the lock of a deleted block that has uncommitted data past its
// committed length (dropOpenBlock); the next request on the block
// completes, and so does a write into another block of the container.
func TestPanicInDeleteBlocksReleasesBlockLock(t *testing.T) {
	s := openLeaky(t)
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 8192)
	writeBlock(t, s, 1, 7, data[:4096], 4096, DefaultChecksum, 1)
	if err := s.WriteChunk(1, 7, 4096, data[4096:], DefaultChecksum.Compute(data[4096:]), true); err != nil {
		t.Fatal(err)
	}
	panicAt(s, "drop open block: block locked")
	recoverRuntime(t, func() { s.DeleteBlocks(1, []LocalID{7}) })
	within(t, "HasChunk on the block", func() {
		if _, err := s.HasChunk(1, 7, 4096, 4096); err != nil {
			t.Errorf("HasChunk: %v", err)
		}
	})
	within(t, "a write into another block", func() {
		if _, err := tryWriteBlock(s, 1, 8, data[:4096], 4096, DefaultChecksum, 2); err != nil {
			t.Errorf("write into block 8: %v", err)
		}
	})
}

// TestPanicInWriteReleasesReservation: a write that panics after it
// reserved its bytes in the container (writeLocked) gives them back, so
// the container does not fill up with bytes nothing holds; the next write
// into the block completes.
func TestPanicInWriteReleasesReservation(t *testing.T) {
	s := openLeaky(t)
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 4096)
	panicAt(s, "write: space reserved")
	recoverRuntime(t, func() { s.WriteChunk(1, 7, 0, data, DefaultChecksum.Compute(data), true) })
	c := s.containers[1]
	c.mu.Lock()
	pending := c.pending
	c.mu.Unlock()
	if pending != 0 {
		t.Errorf("container's pending bytes after the recovered panic: %d, want 0", pending)
	}
	within(t, "the write again", func() {
		if _, err := tryWriteBlock(s, 1, 7, data, 4096, DefaultChecksum, 1); err != nil {
			t.Errorf("write again: %v", err)
		}
	})
}

// TestPanicInSyncRoundFinishesRound: a sync round panics with its blocks
// locked and the round registered (the datanode's SyncData guard recovers
// such a panic from SyncContainers). The round still finishes: the block
// is unlocked, the next SyncContainers does not wait for the dead round,
// the chunk it did not make durable is forgotten (not reported held), and
// written again it syncs and is held.
func TestPanicInSyncRoundFinishesRound(t *testing.T) {
	s := openLeaky(t)
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 4096)
	if err := s.WriteChunk(1, 7, 0, data, DefaultChecksum.Compute(data), true); err != nil {
		t.Fatal(err)
	}
	panicAt(s, "sync round: blocks locked")
	recoverRuntime(t, func() { s.SyncContainers([]ContainerID{1}) })
	within(t, "HasChunk on the block", func() {
		if ok, err := s.HasChunk(1, 7, 0, 4096); ok || err != nil {
			t.Errorf("HasChunk after the panicked round = %v, %v; want false (forgotten), nil", ok, err)
		}
	})
	within(t, "the next SyncContainers", func() {
		if err := s.SyncContainers([]ContainerID{1}); err != nil {
			t.Errorf("next SyncContainers: %v", err)
		}
	})
	within(t, "the chunk written again and synced", func() {
		if err := s.WriteChunk(1, 7, 0, data, DefaultChecksum.Compute(data), true); err != nil {
			t.Errorf("write again: %v", err)
		}
		if err := s.SyncContainers([]ContainerID{1}); err != nil {
			t.Errorf("sync again: %v", err)
		}
		if ok, err := s.HasChunk(1, 7, 0, 4096); !ok || err != nil {
			t.Errorf("HasChunk after the rewrite = %v, %v; want true", ok, err)
		}
	})
}

// TestPanicInPersistUndoesAndWaits: persist panics after its early commit
// started on its own goroutine (a block too large to defer is synced now)
// with a small deferred chunk in the same round. The panic waits for the
// early commit before the batch closes (run with -race), keeps the
// deferred key's generation (the early batch committed: the key stands,
// and an older flush of the same key must not delete it; undoing it lost
// a rewrite, TestPanicAfterSpansMarkedKeepsRewrite; the flusher never gets
// the key, the next Open replays it), and the round finishes: both blocks
// can be written again and synced.
func TestPanicInPersistUndoesAndWaits(t *testing.T) {
	s := openLeaky(t)
	mustCreate(t, s, 1)
	v := s.containers[1].vol
	if v.defer_ == nil {
		t.Skip("no deferred writes on this volume's file system")
	}
	small := blockBytes(1, 7, 4096)
	big := blockBytes(1, 8, int(s.opts.DeferredMax)+4096)
	write := func() {
		t.Helper()
		if err := s.WriteChunk(1, 7, 0, small, DefaultChecksum.Compute(small), true); err != nil {
			t.Fatal(err)
		}
		if err := s.WriteChunk(1, 8, 0, big, DefaultChecksum.Compute(big), true); err != nil {
			t.Fatal(err)
		}
	}
	write()
	panicAt(s, "persist: early commit started")
	recoverRuntime(t, func() { s.SyncContainers([]ContainerID{1}) })
	v.defer_.genMu.Lock()
	gens := len(v.defer_.gens)
	v.defer_.genMu.Unlock()
	if gens != 1 {
		t.Errorf("deferred generations after the panicked persist: %d, want 1 (the committed key's generation stands)", gens)
	}
	for _, lid := range []LocalID{7, 8} {
		if ok, err := s.HasChunk(1, lid, 0, 4096); ok || err != nil {
			t.Errorf("block %d: HasChunk after the panicked round = %v, %v; want false (forgotten), nil", lid, ok, err)
		}
	}
	within(t, "the chunks written again and synced", func() {
		write()
		if err := s.SyncContainers([]ContainerID{1}); err != nil {
			t.Errorf("sync again: %v", err)
		}
	})
	for _, lid := range []LocalID{7, 8} {
		if ok, err := s.HasChunk(1, lid, 0, 4096); !ok || err != nil {
			t.Errorf("block %d: HasChunk after the rewrite = %v, %v; want true", lid, ok, err)
		}
	}
}

// TestPanicInSyncRoundOfOneOfTwoVolumes: with two volumes the rounds run
// on goroutines of their own; a runtime error in one is raised again on
// the caller's goroutine (as with one volume, where the round runs on
// it), still a runtime error, after the other volume's round returned;
// the process is not taken down, and the next sync of both completes.
func TestPanicInSyncRoundOfOneOfTwoVolumes(t *testing.T) {
	root := t.TempDir()
	a, b := filepath.Join(root, "a"), filepath.Join(root, "b")
	fs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{a: {Capacity: 1 << 40}, b: {Capacity: 1 << 40}}, 1)
	s, err := Open(Options{Volumes: []string{a, b}, FS: fs, ContainerSize: 1 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			s.Close()
		}
	})
	// Containers go to the volume with the most room: a block written
	// into the first one sends the next to the other volume.
	on := map[string]ContainerID{}
	for cid := ContainerID(1); len(on) < 2 && cid < 6; cid++ {
		r, err := s.CreateContainer(cid, CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := on[r.Volume]; !ok {
			on[r.Volume] = cid
		}
		p := blockBytes(cid, 100, 1<<20)
		if err := s.WriteChunk(cid, 100, 0, p, DefaultChecksum.Compute(p), true); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if len(on) < 2 {
		t.Fatalf("containers not on both volumes: %v", on)
	}
	ids := []ContainerID{on[a], on[b]}
	for _, cid := range ids {
		data := blockBytes(cid, 7, 4096)
		if err := s.WriteChunk(cid, 7, 0, data, DefaultChecksum.Compute(data), true); err != nil {
			t.Fatal(err)
		}
	}
	var once sync.Once
	s.testHook = func(p string) {
		if p == "sync round: blocks locked" {
			hit := false
			once.Do(func() { hit = true })
			if hit {
				var m map[int]int
				m[0] = 1 // runtime error, in one of the two rounds
			}
		}
	}
	recoverRuntime(t, func() { s.SyncContainers(ids) })
	s.testHook = nil
	within(t, "the next SyncContainers of both volumes", func() {
		if err := s.SyncContainers(ids); err != nil {
			t.Errorf("next SyncContainers: %v", err)
		}
	})
	held := 0
	for _, cid := range ids {
		if ok, _ := s.HasChunk(cid, 7, 0, 4096); ok {
			held++
		}
	}
	if held != 1 {
		t.Errorf("chunks held after one of two rounds panicked: %d, want 1", held)
	}
}
