package storage

import (
	"bytes"
	"errors"
	"sync"
	"testing"
)

// inlineBlock is smallBlock through WriteSmallChunk: the PutSmallFile
// apply path (write, Sync, PutBlockDeferred).
func inlineBlock(s *Store, cid ContainerID, lid LocalID) error {
	data := blockBytes(cid, lid, 4<<10)
	sum := DefaultChecksum.Compute(data)
	if err := s.WriteSmallChunk(cid, lid, data, sum, true); err != nil {
		return err
	}
	if err := s.Sync(); err != nil {
		return err
	}
	return s.PutBlockDeferred(cid, BlockData{LocalID: lid, Length: int64(len(data)), BCSID: uint64(lid),
		Chunks: []ChunkInfo{{Offset: 0, Length: int64(len(data)), Checksum: sum}}})
}

func skipUnlessPosix(t *testing.T) {
	t.Helper()
	if onBackend() != "posix" {
		t.Skip("inline blocks are a posix-backend feature (deferred writes)")
	}
}

// blockFiles counts the block files of container cid on s's first volume.
func blockFiles(t *testing.T, s *Store, cid ContainerID) int {
	t.Helper()
	files, err := s.volumes[0].files.ListBlocks(cid)
	if err != nil {
		t.Fatal(err)
	}
	return len(files)
}

// TestInlineBlockLifecycle: a small block written by WriteSmallChunk has
// no file, and every path that reads, checks, copies or deletes blocks
// knows it: ReadAt, ReadWritten before the commit, VerifyBlock,
// OpenBlockFile (refused: no file to pass), a reopen, Export/Import (the
// copy is an ordinary file block), DeleteBlocks; it cannot be extended.
func TestInlineBlockLifecycle(t *testing.T) {
	skipUnlessPosix(t)
	fs := newCrashFS()
	s := openOn(t, fs, Options{})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 4<<10)
	sum := DefaultChecksum.Compute(data)
	if err := s.WriteSmallChunk(1, 1, data, sum, true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	got, err := s.ReadWritten(1, 1, 0, int64(len(data)), sum)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("ReadWritten of an uncommitted inline chunk: %v", err)
	}
	if err := s.WriteChunk(1, 1, 4<<10, data, sum, true); !errors.Is(err, ErrChunkOverlap) {
		t.Fatalf("a second chunk after an inline one: %v, want ErrChunkOverlap", err)
	}
	if err := s.PutBlock(1, BlockData{LocalID: 1, Length: 4 << 10, BCSID: 1,
		Chunks: []ChunkInfo{{Offset: 0, Length: 4 << 10, Checksum: sum}}}); err != nil {
		t.Fatal(err)
	}
	if n := blockFiles(t, s, 1); n != 0 {
		t.Fatalf("%d block files for an inline block", n)
	}
	bd, err := s.GetBlock(1, 1)
	if err != nil || !bd.Inline {
		t.Fatalf("GetBlock: %+v, %v; want an inline block", bd, err)
	}
	checkBlock(t, s, 1, 1, data)
	if got, err := s.ReadChunk(1, 1, 100, 1000); err != nil || !bytes.Equal(got, data[100:1100]) {
		t.Fatalf("unaligned read of an inline block: %v", err)
	}
	if n, err := s.VerifyBlock(1, 1, VerifyOptions{}); err != nil || n != int64(len(data)) {
		t.Fatalf("VerifyBlock: %d, %v", n, err)
	}
	if _, _, err := s.OpenBlockFile(1, 1); !errors.Is(err, ErrNoBlockFile) {
		t.Fatalf("OpenBlockFile of an inline block: %v, want ErrNoBlockFile", err)
	}
	if err := s.WriteChunk(1, 1, 4<<10, data, sum, true); !errors.Is(err, ErrChunkOverlap) {
		t.Fatalf("extending an inline block: %v, want ErrChunkOverlap", err)
	}
	if err := s.AbortBlock(1, 1); err != nil {
		t.Fatalf("abort of a committed inline block: %v", err)
	}
	// A block file one: the container holds both kinds.
	if err := smallBlock(s, 1, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	s.Close()

	s = openOn(t, fs.Restart(), Options{})
	if n := blockFiles(t, s, 1); n != 1 {
		t.Fatalf("%d block files after a restart, want 1 (the inline block's data stays in its key)", n)
	}
	checkBlock(t, s, 1, 1, data)
	checkBlock(t, s, 1, 2, blockBytes(1, 2, 4<<10))
	if rep, _ := s.Container(1); rep.State == StateUnhealthy {
		t.Fatalf("container UNHEALTHY after a clean restart: %+v", rep)
	}
	if err := s.CloseContainer(1); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := s.Export(1, &buf); err != nil {
		t.Fatal(err)
	}
	t2 := openOn(t, newCrashFS(), Options{})
	defer t2.Close()
	if _, err := t2.Import(bytes.NewReader(buf.Bytes())); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, t2, 1, 1, data)
	checkBlock(t, t2, 1, 2, blockBytes(1, 2, 4<<10))

	if err := s.DeleteBlocks(1, []LocalID{1}); err != nil {
		t.Fatal(err)
	}
	if _, c, err := s.volumes[0].db.Get(makeDeferredKey(1, 1, 0)); err == nil {
		c.Close()
		t.Fatal("inline data left after DeleteBlocks")
	}
	if _, err := s.GetBlock(1, 1); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("deleted inline block: %v", err)
	}
	s.Close()
}

// TestAcknowledgedInlineWritesSurviveCrash: TestAcknowledgedSmallWrites-
// SurviveCrash with inline blocks (their bytes only in the WAL).
func TestAcknowledgedInlineWritesSurviveCrash(t *testing.T) {
	skipUnlessPosix(t)
	ackedSmallCrash(t, inlineBlock)
}

// TestInlineCrashBeforeCommit: power lost after an inline chunk's Sync and
// before its PutBlock: the chunk is held after Open (its deferred key
// became a block file), and the PutBlock the log applies again commits it
// (as a file block). Lost before its Sync: not held, PutBlock refused.
func TestInlineCrashBeforeCommit(t *testing.T) {
	skipUnlessPosix(t)
	fs := newCrashFS()
	o := Options{KeepUncommitted: true}
	s := openOn(t, fs, o)
	defer s.Close()
	mustCreate(t, s, 1)
	bdOf := func(lid LocalID) (BlockData, []byte) {
		data := blockBytes(1, lid, 4<<10)
		sum := DefaultChecksum.Compute(data)
		return BlockData{LocalID: lid, Length: 4 << 10, BCSID: uint64(lid),
			Chunks: []ChunkInfo{{Offset: 0, Length: 4 << 10, Checksum: sum}}}, data
	}
	bd1, data1 := bdOf(1)
	if err := s.WriteSmallChunk(1, 1, data1, bd1.Chunks[0].Checksum, true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	bd2, data2 := bdOf(2)
	if err := s.WriteSmallChunk(1, 2, data2, bd2.Chunks[0].Checksum, true); err != nil {
		t.Fatal(err)
	}
	s2 := openOn(t, fs.Crash(), o)
	defer s2.Close()
	if ok, err := s2.HasChunk(1, 1, 0, 4<<10); !ok || err != nil {
		t.Fatalf("synced inline chunk not held after a crash: %v, %v", ok, err)
	}
	if err := s2.PutBlockDeferred(1, bd1); err != nil {
		t.Fatal(err)
	}
	if err := s2.SyncCommits(); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s2, 1, 1, data1)
	if ok, _ := s2.HasChunk(1, 2, 0, 4<<10); ok {
		t.Fatal("an inline chunk never synced is held after a crash")
	}
	if err := s2.PutBlock(1, bd2); !errors.Is(err, ErrChunkMissing) {
		t.Fatalf("PutBlock of a lost inline chunk: %v, want ErrChunkMissing", err)
	}
}

// TestInlineBatchSyncs is TestSmallBatchSyncs for inline blocks, and
// counts files: a batch of 32 inline blocks costs no block file and no
// more syncs than deferred writes (the WAL flushes of Sync and
// SyncCommits), and the deferred-write flusher has nothing to do after.
func TestInlineBatchSyncs(t *testing.T) {
	skipUnlessPosix(t)
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
			if err := s.WriteSmallChunk(1, lid, data, DefaultChecksum.Compute(data), true); err != nil {
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
	// One WAL flush at Sync and one at SyncCommits; the 256 KiB written
	// may also rotate Pebble's first (small) memtable: a directory sync
	// and the new WAL's.
	n := fs.syncCount() - base
	if n > 4 {
		t.Fatalf("%d syncs for a batch of %d inline blocks, want at most 4", n, batch)
	}
	if f := blockFiles(t, s, 1); f != 0 {
		t.Fatalf("%d block files created for %d inline blocks, want 0", f, batch)
	}
	v := s.volumes[0]
	v.defer_.mu.Lock()
	pending := len(v.defer_.pending)
	v.defer_.mu.Unlock()
	v.defer_.genMu.Lock()
	gens := len(v.defer_.gens)
	v.defer_.genMu.Unlock()
	if pending != 0 || gens != 0 {
		t.Fatalf("deferred-write flusher state after inline commits: %d pending, %d generations; want none", pending, gens)
	}
	for i := range batch {
		lid := LocalID(i + 1)
		checkBlock(t, s, 1, lid, blockBytes(1, lid, 4<<10))
	}
	t.Logf("%d syncs, 0 block files for a batch of %d inline blocks", n, batch)
}

// TestInlineSpanRefusesOtherCommitShapes: a PutBlock that is not exactly
// a small chunk's commit (shorter, two chunks without checksums, other
// checksums) is refused with ErrBadBlockData — before the fix it
// committed a FILE block over an inline span (no file after a Sync: the
// first read failed and the container went UNHEALTHY; without a Sync an
// empty file: zeros). The refusal does not depend on the chunk being
// inline: a volume with deferred writes off (DeferredMax < 0, the chunk
// has a file) refuses alike, as every replica must. The exact commit then
// still succeeds and reads the data back.
func TestInlineSpanRefusesOtherCommitShapes(t *testing.T) {
	skipUnlessPosix(t)
	data := blockBytes(1, 1, 4<<10)
	sum := DefaultChecksum.Compute(data)
	half := DefaultChecksum.Compute(data[:2048])
	shapes := map[string]BlockData{
		"short":        {LocalID: 1, Length: 2048, Chunks: []ChunkInfo{{Offset: 0, Length: 2048}}},
		"two-no-sums":  {LocalID: 1, Length: 4096, Chunks: []ChunkInfo{{Offset: 0, Length: 2048}, {Offset: 2048, Length: 2048}}},
		"short-summed": {LocalID: 1, Length: 2048, Chunks: []ChunkInfo{{Offset: 0, Length: 2048, Checksum: half}}},
		"other-sums":   {LocalID: 1, Length: 4096, Chunks: []ChunkInfo{{Offset: 0, Length: 4096, Checksum: DefaultChecksum.Compute(make([]byte, 4096))}}},
	}
	for _, deferMax := range []int64{0, -1} {
		for _, synced := range []bool{true, false} {
			for name, bd := range shapes {
				s := openOn(t, newCrashFS(), Options{DeferredMax: deferMax})
				mustCreate(t, s, 1)
				if err := s.WriteSmallChunk(1, 1, data, sum, true); err != nil {
					t.Fatal(err)
				}
				if synced {
					if err := s.Sync(); err != nil {
						t.Fatal(err)
					}
				}
				bd.BCSID = 1
				if err := s.PutBlock(1, bd); !errors.Is(err, ErrBadBlockData) {
					t.Errorf("deferMax=%d synced=%v %s: PutBlock = %v, want ErrBadBlockData", deferMax, synced, name, err)
				}
				if err := s.PutBlock(1, BlockData{LocalID: 1, Length: 4096, BCSID: 2,
					Chunks: []ChunkInfo{{Offset: 0, Length: 4096, Checksum: sum}}}); err != nil {
					t.Fatalf("deferMax=%d synced=%v %s: exact commit after the refusal: %v", deferMax, synced, name, err)
				}
				buf := make([]byte, 4096)
				if _, err := s.ReadAt(1, 1, buf, 0); err != nil || !bytes.Equal(buf, data) {
					t.Errorf("deferMax=%d synced=%v %s: read after commit: err=%v equal=%v", deferMax, synced, name, err, bytes.Equal(buf, data))
				}
				if rep, _ := s.Container(1); rep.State == StateUnhealthy {
					t.Errorf("deferMax=%d synced=%v %s: container UNHEALTHY", deferMax, synced, name)
				}
				s.Close()
			}
		}
	}
}

// TestDeleteContainerDropsInlineGens: deleting a container whose inline
// block was synced but not committed forgets the deferred key's
// generation (the flusher never had the key, so nothing else would:
// before, deferrer.gens kept one entry per such block for good).
func TestDeleteContainerDropsInlineGens(t *testing.T) {
	skipUnlessPosix(t)
	s := openOn(t, newCrashFS(), Options{})
	defer s.Close()
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 4<<10)
	if err := s.WriteSmallChunk(1, 1, data, DefaultChecksum.Compute(data), true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	d := s.volumes[0].defer_
	gens := func() int {
		d.genMu.Lock()
		defer d.genMu.Unlock()
		return len(d.gens)
	}
	if n := gens(); n != 1 {
		t.Fatalf("%d generations after the inline chunk's Sync, want 1", n)
	}
	if err := s.DeleteContainer(1, true); err != nil {
		t.Fatal(err)
	}
	if n := gens(); n != 0 {
		t.Fatalf("%d generations left after DeleteContainer, want 0", n)
	}
}

// TestSmallChunkTakesNoSecondChunk: a block whose chunk was written by
// WriteSmallChunk takes no other chunk, whether the chunk is inline or
// (deferred writes off) has a file: every replica refuses alike. Before,
// only an inline chunk refused it, so replicas with other volume
// settings diverged (and then disagreed on the small chunk's commit).
func TestSmallChunkTakesNoSecondChunk(t *testing.T) {
	skipUnlessPosix(t)
	for _, deferMax := range []int64{0, -1} {
		s := openOn(t, newCrashFS(), Options{DeferredMax: deferMax})
		mustCreate(t, s, 1)
		data := blockBytes(1, 1, 4<<10)
		sum := DefaultChecksum.Compute(data)
		if err := s.WriteSmallChunk(1, 1, data, sum, true); err != nil {
			t.Fatal(err)
		}
		if err := s.WriteChunk(1, 1, 4096, data, sum, true); !errors.Is(err, ErrChunkOverlap) {
			t.Errorf("deferMax=%d: second chunk: %v, want ErrChunkOverlap", deferMax, err)
		}
		if err := s.PutBlock(1, BlockData{LocalID: 1, Length: 4096, BCSID: 1,
			Chunks: []ChunkInfo{{Offset: 0, Length: 4096, Checksum: sum}}}); err != nil {
			t.Errorf("deferMax=%d: commit of the small chunk: %v", deferMax, err)
		}
		s.Close()
	}
}

// TestSmallFlagSurvivesRestart: a replica that restarts between a small
// chunk's Sync and its commit still knows the chunk was written by
// WriteSmallChunk (the chunk record, synced in the same batch, says so):
// it refuses a PutBlock of another shape and a second chunk, as the
// replicas that did not restart do, and commits the exact shape. Before,
// the recovered span lost the flag and this replica alone accepted them.
func TestSmallFlagSurvivesRestart(t *testing.T) {
	skipUnlessPosix(t)
	data := blockBytes(1, 1, 4<<10)
	sum := DefaultChecksum.Compute(data)
	half := DefaultChecksum.Compute(data[:2048])
	shapes := map[string]BlockData{
		"short":        {LocalID: 1, Length: 2048, Chunks: []ChunkInfo{{Offset: 0, Length: 2048}}},
		"two-no-sums":  {LocalID: 1, Length: 4096, Chunks: []ChunkInfo{{Offset: 0, Length: 2048}, {Offset: 2048, Length: 2048}}},
		"short-summed": {LocalID: 1, Length: 2048, Chunks: []ChunkInfo{{Offset: 0, Length: 2048, Checksum: half}}},
		"other-sums":   {LocalID: 1, Length: 4096, Chunks: []ChunkInfo{{Offset: 0, Length: 4096, Checksum: DefaultChecksum.Compute(make([]byte, 4096))}}},
	}
	for _, deferMax := range []int64{0, -1} {
		for name, bd := range shapes {
			o := Options{DeferredMax: deferMax, KeepUncommitted: true}
			fs := newCrashFS()
			s := openOn(t, fs, o)
			mustCreate(t, s, 1)
			if err := s.WriteSmallChunk(1, 1, data, sum, true); err != nil {
				t.Fatal(err)
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			s2 := openOn(t, fs.Crash(), o)
			if ok, err := s2.HasChunk(1, 1, 0, 4096); !ok || err != nil {
				t.Fatalf("deferMax=%d: synced small chunk not held after a restart: %v, %v", deferMax, ok, err)
			}
			if err := s2.WriteChunk(1, 1, 4096, data, sum, true); !errors.Is(err, ErrChunkOverlap) {
				t.Errorf("deferMax=%d %s: second chunk after a restart: %v, want ErrChunkOverlap", deferMax, name, err)
			}
			bd.BCSID = 1
			if err := s2.PutBlock(1, bd); !errors.Is(err, ErrBadBlockData) {
				t.Errorf("deferMax=%d %s: PutBlock after a restart = %v, want ErrBadBlockData", deferMax, name, err)
			}
			if err := s2.PutBlock(1, BlockData{LocalID: 1, Length: 4096, BCSID: 2,
				Chunks: []ChunkInfo{{Offset: 0, Length: 4096, Checksum: sum}}}); err != nil {
				t.Fatalf("deferMax=%d %s: exact commit after a restart: %v", deferMax, name, err)
			}
			checkBlock(t, s2, 1, 1, data)
			s2.Close()
			s.Close()
		}
	}
}
