package storage

import (
	"runtime"
	"testing"
	"time"
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
