package storage

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestPanicAfterSpansMarkedKeepsRewrite (second review of the guard
// branch, session 15): a panic after persist marked a rewritten deferred chunk durable
// (before it is handed to the flusher) runs the generation undos although
// the early commit succeeded; an older flush of the same key then deletes
// the new key, and the committed rewrite is lost in a crash.
func TestPanicAfterSpansMarkedKeepsRewrite(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("posix only")
	}
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	d := s.volumes[0].defer_
	fresh := blockBytes(1, 99, 4<<10)
	var ran atomic.Bool
	hookErr := make(chan error, 1)
	hook := func() {
		if !ran.CompareAndSwap(false, true) {
			return
		}
		hookErr <- func() error {
			if err := s.AbortBlock(1, 1); err != nil {
				return err
			}
			sum := DefaultChecksum.Compute(fresh)
			if err := s.WriteChunk(1, 1, 0, fresh, sum, true); err != nil {
				return err
			}
			panicAt(s, "persist: spans marked")
			func() {
				defer func() { t.Logf("recovered: %v", recover()) }()
				s.Sync()
			}()
			ok, err := s.HasChunk(1, 1, 0, int64(len(fresh)))
			t.Logf("HasChunk after the panicked round: %v %v", ok, err)
			if err := s.PutBlockDeferred(1, BlockData{LocalID: 1, Length: int64(len(fresh)), BCSID: 1,
				Chunks: []ChunkInfo{{Offset: 0, Length: int64(len(fresh)), Checksum: sum}}}); err != nil {
				return err
			}
			return s.SyncCommits()
		}()
	}
	d.afterSync.Store(&hook)
	data := blockBytes(1, 1, 4<<10)
	if err := s.WriteChunk(1, 1, 0, data, DefaultChecksum.Compute(data), true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	s.flushDeferred(s.volumes[0])
	select {
	case err := <-hookErr:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no flush ran")
	}
	d.afterSync.Store(nil)
	t.Logf("deferred keys after the flush: %d", countDeferredKeys(t, s))
	if err := smallBlock(s, 1, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	s2 := openOn(t, fs.Crash(), Options{})
	defer s2.Close()
	checkBlock(t, s2, 1, 1, fresh)
}
