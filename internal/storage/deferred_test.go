package storage

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// smallBlock writes one 4 KiB chunk as block lid, makes it durable (Sync)
// and commits it with PutBlockDeferred: the pipeline apply path.
func smallBlock(s *Store, cid ContainerID, lid LocalID) error {
	data := blockBytes(cid, lid, 4<<10)
	sum := DefaultChecksum.Compute(data)
	if err := s.WriteChunk(cid, lid, 0, data, sum, true); err != nil {
		return err
	}
	if err := s.Sync(); err != nil {
		return err
	}
	return s.PutBlockDeferred(cid, BlockData{LocalID: lid, Length: int64(len(data)), BCSID: uint64(lid),
		Chunks: []ChunkInfo{{Offset: 0, Length: int64(len(data)), Checksum: sum}}})
}

// TestDeferredCommitNeedsSyncCommits: a deferred commit is not durable by
// itself (a power loss takes it) and is durable once SyncCommits returns.
// This is what makes the next test able to fail.
func TestDeferredCommitNeedsSyncCommits(t *testing.T) {
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	mustCreate(t, s, 1)
	if err := smallBlock(s, 1, 1); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s, 1, 1, blockBytes(1, 1, 4<<10)) // readable at once
	s2 := openOn(t, fs.Crash(), Options{})
	if _, err := s2.GetBlock(1, 1); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("a deferred commit without SyncCommits survived a power loss (err %v): the crash FS kept an unsynced WAL write", err)
	}
	s2.Close()
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	s3 := openOn(t, fs.Crash(), Options{})
	defer s3.Close()
	checkBlock(t, s3, 1, 1, blockBytes(1, 1, 4<<10))
	s.Close()
}

// TestAcknowledgedSmallWritesSurviveCrash: writers commit small blocks
// concurrently with PutBlockDeferred and acknowledge a block only after
// their SyncCommits returned; power losses at random moments while they
// run must keep every block acknowledged before the loss, intact.
func TestAcknowledgedSmallWritesSurviveCrash(t *testing.T) {
	ackedSmallCrash(t, smallBlock)
}

// ackedSmallCrash is TestAcknowledgedSmallWritesSurviveCrash with write
// as the way a small block is stored.
func ackedSmallCrash(t *testing.T, write func(s *Store, cid ContainerID, lid LocalID) error) {
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	mustCreate(t, s, 2)
	var (
		mu    sync.Mutex
		acked []blockRef
		stop  atomic.Bool
		next  atomic.Uint64
		wg    sync.WaitGroup
		errc  = make(chan error, 8)
	)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cid := ContainerID(1 + w%2)
			for !stop.Load() {
				lid := LocalID(next.Add(1))
				if err := write(s, cid, lid); err != nil {
					errc <- err
					return
				}
				if err := s.SyncCommits(); err != nil {
					errc <- err
					return
				}
				mu.Lock()
				acked = append(acked, blockRef{lid: lid, c: &container{id: cid}})
				mu.Unlock()
			}
		}()
	}
	r := rand.New(rand.NewPCG(15, uint64(time.Now().UnixNano())))
	deadline := time.Now().Add(20 * time.Second)
	checked, crashes := 0, 0
	for crashes < 6 && time.Now().Before(deadline) {
		time.Sleep(time.Duration(5+r.IntN(40)) * time.Millisecond)
		mu.Lock()
		before := append([]blockRef(nil), acked...)
		mu.Unlock()
		after := fs.Crash()
		crashes++
		s2 := openOn(t, after, Options{})
		for _, b := range before {
			checkBlock(t, s2, b.c.id, b.lid, blockBytes(b.c.id, b.lid, 4<<10))
		}
		checked += len(before)
		s2.Close()
	}
	stop.Store(true)
	wg.Wait()
	select {
	case err := <-errc:
		t.Fatal(err)
	default:
	}
	if checked == 0 {
		t.Fatal("no acknowledged block was checked after a crash: the test exercised nothing")
	}
	t.Logf("%d crashes, %d acknowledged blocks checked", crashes, checked)
}

// TestSyncCommitsShareFlushes: concurrent deferred commits made durable by
// concurrent SyncCommits cost far fewer WAL syncs than commits (the point
// of deferring). It runs on the crash FS, which counts WAL syncs.
func TestSyncCommitsShareFlushes(t *testing.T) {
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	const writers, each = 8, 25
	blockOf := func(lid LocalID) ([]byte, ChecksumData) {
		data := blockBytes(1, lid, 4<<10)
		return data, DefaultChecksum.Compute(data)
	}
	for lid := LocalID(1); lid <= writers*each; lid++ {
		data, sum := blockOf(lid)
		if err := s.WriteChunk(1, lid, 0, data, sum, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	// Only the commits are counted (backends differ in what a chunk's
	// Sync costs).
	base := fs.walSyncCount()
	var wg sync.WaitGroup
	errc := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				lid := LocalID(w*each + i + 1)
				_, sum := blockOf(lid)
				if err := s.PutBlockDeferred(1, BlockData{LocalID: lid, Length: 4 << 10, BCSID: uint64(lid),
					Chunks: []ChunkInfo{{Offset: 0, Length: 4 << 10, Checksum: sum}}}); err != nil {
					errc <- err
					return
				}
				// Eight commits per SyncCommits, as a Ready batch of
				// eight entries would give.
				if i%8 == 7 || i == each-1 {
					if err := s.SyncCommits(); err != nil {
						errc <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	syncs := fs.walSyncCount() - base
	// Four SyncCommits per writer, fewer where they are shared; PutBlock
	// would cost a WAL sync per block (25 per writer).
	if limit := int64(writers * 4); syncs > limit {
		t.Fatalf("%d WAL syncs for %d deferred commits, want at most %d", syncs, writers*each, limit)
	}
	for lid := LocalID(1); lid <= writers*each; lid++ {
		data, _ := blockOf(lid)
		checkBlock(t, s, 1, lid, data)
	}
	t.Logf("%d WAL syncs for %d blocks", syncs, writers*each)
}

// countDeferredKeys returns how many deferred keys s's volume holds.
func countDeferredKeys(t *testing.T, s *Store) int {
	t.Helper()
	it, err := s.volumes[0].db.NewIter(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	n := 0
	for ok := it.First(); ok; ok = it.Next() {
		if _, _, _, okd := parseDeferredKey(it.Key()); okd {
			n++
		}
	}
	return n
}

// TestDeferredWriteReplayedAfterCrash: a small block's Sync syncs neither
// its file nor its directory entry (its bytes are in the WAL); a power
// loss before the flusher ran loses the file, and Open writes it back
// from the deferred key. After the flusher ran, the file itself is
// durable and the keys are gone.
func TestDeferredWriteReplayedAfterCrash(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("deferred writes are a posix-backend feature")
	}
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	mustCreate(t, s, 1)
	for lid := LocalID(1); lid <= 3; lid++ {
		if err := smallBlock(s, 1, lid); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	if n := countDeferredKeys(t, s); n != 3 {
		t.Fatalf("%d deferred keys after three small blocks, want 3", n)
	}
	crashed := fs.Crash()
	if _, err := crashed.Stat(crashVol + "/basalt/containers/1/1.block"); err == nil {
		t.Fatal("the block file survived the crash by itself: its Sync synced the file after all")
	}
	s2 := openOn(t, crashed, Options{})
	for lid := LocalID(1); lid <= 3; lid++ {
		checkBlock(t, s2, 1, lid, blockBytes(1, lid, 4<<10))
	}
	if n := countDeferredKeys(t, s2); n != 0 {
		t.Fatalf("%d deferred keys left after Open replayed them", n)
	}
	if rep, _ := s2.Container(1); rep.State != StateOpen {
		t.Fatalf("container %v after replay, want OPEN", rep.State)
	}
	s2.Close()

	// The flusher: files synced, keys deleted; a crash then needs no replay.
	s.flushDeferred(s.volumes[0])
	if n := countDeferredKeys(t, s); n != 0 {
		t.Fatalf("%d deferred keys after a flush", n)
	}
	if n := s.containers[1].deferredKeys.Load(); n != 0 {
		t.Fatalf("container counts %d deferred writes after a flush", n)
	}
	crashed = fs.Crash()
	if _, err := crashed.Stat(crashVol + "/basalt/containers/1/2.block"); err != nil {
		t.Fatalf("block file not durable after the flusher ran: %v", err)
	}
	s3 := openOn(t, crashed, Options{})
	defer s3.Close()
	for lid := LocalID(1); lid <= 3; lid++ {
		checkBlock(t, s3, 1, lid, blockBytes(1, lid, 4<<10))
	}
	s.Close()
}

// TestDeferredBlockExtendedSurvivesCrash: a block whose first chunk was a
// deferred write and whose next chunk is synced normally keeps both after
// a power loss (the second Sync syncs the directory entry the deferred
// write left unsynced).
func TestDeferredBlockExtendedSurvivesCrash(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("deferred writes are a posix-backend feature")
	}
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 4<<10+256<<10)
	first := ChunkInfo{Offset: 0, Length: 4 << 10, Checksum: DefaultChecksum.Compute(data[:4<<10])}
	big := ChunkInfo{Offset: 4 << 10, Length: 256 << 10, Checksum: DefaultChecksum.Compute(data[4<<10:])}
	writeChunks(t, s, 1, 7, data, []ChunkInfo{first})
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	writeChunks(t, s, 1, 7, data, []ChunkInfo{big})
	if err := s.PutBlock(1, blockOf(7, []ChunkInfo{first, big}, 1)); err != nil {
		t.Fatal(err)
	}
	// Replay restores only the first chunk; the second must be in a file
	// whose directory entry PutBlock synced.
	s2 := openOn(t, fs.Crash(), Options{})
	defer s2.Close()
	checkBlock(t, s2, 1, 7, data)
}

// TestDeferredFlushOnDisk: on the operating system's file system the
// flusher syncs with one syncfs and deletes the deferred keys; the blocks
// read back after a restart.
func TestDeferredFlushOnDisk(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("deferred writes are a posix-backend feature")
	}
	dir := t.TempDir()
	s, err := Open(Options{Volumes: []string{dir}, ContainerSize: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	mustCreate(t, s, 1)
	for lid := LocalID(1); lid <= 20; lid++ {
		if err := smallBlock(s, 1, lid); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.volumes[0].files.(*Posix).syncFS(); !ok || err != nil {
		t.Fatalf("syncfs on %s: ok %v, err %v", dir, ok, err)
	}
	s.flushDeferred(s.volumes[0])
	if n := countDeferredKeys(t, s); n != 0 {
		t.Fatalf("%d deferred keys after a flush", n)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(Options{Volumes: []string{dir}, ContainerSize: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	for lid := LocalID(1); lid <= 20; lid++ {
		checkBlock(t, s2, 1, lid, blockBytes(1, lid, 4<<10))
	}
}

// TestSmallBatchSyncs is the regression check of issue 15's small-object
// path: a batch of 32 one-chunk 4 KiB blocks written by concurrent
// writers, made durable (Sync) and committed (PutBlockDeferred, one
// SyncCommits) costs a handful of syncs, not one per block: before group
// commit and deferred writes it cost 32 block-file syncs, a directory
// sync and a WAL sync at Sync and 32 WAL syncs to commit.
func TestSmallBatchSyncs(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("deferred writes are a posix-backend feature")
	}
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	const batch = 32
	base := fs.syncCount()
	var wg sync.WaitGroup
	errc := make(chan error, batch)
	for i := range batch {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lid := LocalID(i + 1)
			data := blockBytes(1, lid, 4<<10)
			if err := s.WriteChunk(1, lid, 0, data, DefaultChecksum.Compute(data), true); err != nil {
				errc <- err
			}
		}()
	}
	wg.Wait()
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	for i := range batch {
		lid := LocalID(i + 1)
		data := blockBytes(1, lid, 4<<10)
		if err := s.PutBlockDeferred(1, BlockData{LocalID: lid, Length: 4 << 10, BCSID: uint64(lid),
			Chunks: []ChunkInfo{{Offset: 0, Length: 4 << 10, Checksum: DefaultChecksum.Compute(data)}}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if n := fs.syncCount() - base; n > 4 {
		t.Fatalf("%d syncs for a batch of %d small blocks, want at most 4", n, batch)
	} else {
		t.Logf("%d syncs for a batch of %d small blocks", n, batch)
	}
}

// TestDeferredFlushKeepsKeySetAgain: a block aborted and written again at
// the same offset after the flusher synced the files, but before it
// deleted the keys, keeps its new deferred key (its bytes are only in the
// page cache): a power loss then must not lose the acknowledged chunk.
// The flusher deleted keys by name, so it deleted the new one.
func TestDeferredFlushKeepsKeySetAgain(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("deferred writes are a posix-backend feature")
	}
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	d := s.volumes[0].defer_
	fresh := blockBytes(1, 99, 4<<10) // other bytes for block 1
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
			if err := s.Sync(); err != nil {
				return err
			}
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
	s.flushDeferred(s.volumes[0]) // or the background flusher did
	select {
	case err := <-hookErr:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no flush ran")
	}
	d.afterSync.Store(nil)
	if n := countDeferredKeys(t, s); n != 1 {
		t.Errorf("%d deferred keys after the flush, want 1 (the rewrite's)", n)
	}
	// Any later WAL sync makes the flusher's (unsynced) deletions durable.
	if err := smallBlock(s, 1, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	// The rewrite is acknowledged (durable commit); crash before the
	// flusher synced its file.
	s2 := openOn(t, fs.Crash(), Options{})
	defer s2.Close()
	checkBlock(t, s2, 1, 1, fresh)
}

// TestDeferredRewriteDropsKey: a chunk that was a durable deferred write,
// written again without checksums (rewriteLocked), loses its deferred key
// with its record: left, Open would write the old bytes over the rewrite.
func TestDeferredRewriteDropsKey(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("deferred writes are a posix-backend feature")
	}
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	old := blockBytes(1, 1, 4<<10)
	if err := s.WriteChunk(1, 1, 0, old, DefaultChecksum.Compute(old), true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if n := countDeferredKeys(t, s); n != 1 {
		t.Fatalf("%d deferred keys, want 1", n)
	}
	fresh := blockBytes(1, 99, 4<<10)
	if err := s.WriteChunk(1, 1, 0, fresh, ChecksumData{}, true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := s.PutBlock(1, BlockData{LocalID: 1, Length: int64(len(fresh)), BCSID: 1,
		Chunks: []ChunkInfo{{Offset: 0, Length: int64(len(fresh))}}}); err != nil {
		t.Fatal(err)
	}
	if n := countDeferredKeys(t, s); n != 0 {
		t.Errorf("%d deferred keys after the rewrite, want 0", n)
	}
	crashed := fs.Crash()
	if _, err := crashed.Stat(crashVol + "/basalt/containers/1/1.block"); err != nil {
		t.Fatalf("before Open: %v", err)
	}
	s2 := openOn(t, crashed, Options{Logf: t.Logf})
	s2.Close()
	f, err := crashed.Open(crashVol + "/basalt/containers/1/1.block")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, len(fresh))
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, fresh) {
		t.Fatal("after a crash and Open the block file holds the old bytes, not the rewrite's")
	}
}
