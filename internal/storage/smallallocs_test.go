package storage

import (
	"testing"

	"github.com/basalt-store/basalt/internal/vfs"
)

// smallWriteAllocsMax bounds the heap allocations of one small block's
// whole storage path on a replica (WriteSmallChunk, its share of a Sync,
// PutBlockDeferred, its share of SyncCommits), in batches of 32 as a
// pipeline applies them (issue 15: server CPU per small PUT). Measured
// (session 8): 14.5, steady from run to run; 16.5 before a new block's
// record lookup stopped building an error for its miss (lookupBlock).
const smallWriteAllocsMax = 16

// TestSmallWriteAllocs keeps the small-write path's allocations bounded
// on a real Pebble store and disk, so a change that adds per-write
// garbage fails here in seconds instead of in a benchmark.
func TestSmallWriteAllocs(t *testing.T) {
	skipUnlessPosix(t)
	s, err := Open(Options{Volumes: []string{t.TempDir()}, FS: vfs.Default, ContainerSize: 1 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 4<<10)
	sum := DefaultChecksum.Compute(data)
	const batch = 32
	lid := LocalID(0)
	bds := make([]BlockData, batch)
	round := func() {
		for i := range bds {
			lid++
			bds[i] = BlockData{LocalID: lid, Length: 4 << 10, BCSID: uint64(lid),
				Chunks: []ChunkInfo{{Offset: 0, Length: 4 << 10, Checksum: sum}}}
			if err := s.WriteSmallChunk(1, lid, data, sum, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Sync(); err != nil {
			t.Fatal(err)
		}
		for i := range bds {
			if err := s.PutBlockDeferred(1, bds[i]); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.SyncCommits(); err != nil {
			t.Fatal(err)
		}
	}
	round() // warm up (first table, caches)
	per := testing.AllocsPerRun(20, round) / batch
	t.Logf("%.1f allocations per small block (bound %d)", per, smallWriteAllocsMax)
	if per > smallWriteAllocsMax {
		t.Errorf("%.1f allocations per small block written, committed and synced; want at most %d", per, smallWriteAllocsMax)
	}
}
