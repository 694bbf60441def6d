package storage

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

var simSeeds = flag.Int("storage.seeds", 12, "seeds TestCrashSimulation runs")
var simSeed = flag.Uint64("storage.seed", 0, "run TestCrashSimulation for this one seed")

// TestCrashSimulation drives a store on crashFS with a seeded random mix of
// chunk writes (each acknowledged by WriteChunkDurable, some failed by an
// ENOSPC flush; on even seeds a third of the blocks are small one-chunk
// blocks written by WriteSmallChunk, kept inline when committed so),
// commits, aborts, deletes and power losses (some in the
// middle of a Sync) that keep a random part of what was not synced,
// and checks after every crash what the acknowledgements promised:
//   - every acknowledged PutBlock reads back byte for byte, and nothing
//     else is visible;
//   - every acknowledged chunk not yet committed is still held
//     (HasChunk, ReadWritten) and can be committed;
//   - a PutBlock naming a chunk that was never acknowledged is refused.
//
// A failure prints its seed; -storage.seed=N replays it exactly.
func TestCrashSimulation(t *testing.T) {
	seeds := make([]uint64, 0, *simSeeds)
	if *simSeed != 0 {
		seeds = append(seeds, *simSeed)
	} else {
		for i := range *simSeeds {
			seeds = append(seeds, uint64(i+1))
		}
	}
	var total simStats
	for _, seed := range seeds {
		st, err := simulate(seed, 250)
		total.crashes += st.crashes
		total.commits += st.commits
		total.refused += st.refused
		total.failed += st.failed
		total.inline += st.inline
		if err != nil {
			t.Fatalf("seed %d: %v (replay: go test ./internal/storage -run TestCrashSimulation -storage.seed=%d)", seed, err, seed)
		}
	}
	t.Logf("%d seeds: %d power losses, %d commits (%d of inline blocks), %d PutBlocks of unacknowledged chunks refused, %d writes failed by ENOSPC at sync", len(seeds), total.crashes, total.commits, total.inline, total.refused, total.failed)
	if total.crashes == 0 || total.commits == 0 || total.refused == 0 || total.failed == 0 {
		t.Fatal("the simulation exercised nothing")
	}
	if onBackend() == "posix" && len(seeds) > 1 && total.inline == 0 {
		t.Fatal("no inline block was committed: the simulation did not exercise them")
	}
}

type simStats struct{ crashes, commits, refused, failed, inline int }

type simBlock struct {
	small     bool // one chunk, written by WriteSmallChunk (inline.go)
	committed int  // chunks acknowledged by PutBlock
	acked     int  // chunks acknowledged by WriteChunkDurable (≥ committed)
	chunks    []ChunkInfo
	data      []byte
	bcsid     uint64
}

func simulate(seed uint64, ops int) (st simStats, err error) {
	const (
		nBlocks   = 6
		chunkSize = 12 << 10 // three pages: crashes can tear a chunk
		maxChunks = 4
	)
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	fs := newCrashFS()
	// Some block-file flushes fail with ENOSPC (a thin-provisioned disk):
	// the write they carried is not acknowledged.
	// Decided before the op, not in the injector, which the flushes of one
	// Sync call from several goroutines: a seed must replay exactly.
	ffs := vfs.NewFaultFS(fs)
	var failPath atomic.Pointer[string]
	inject := func(op, path string) error {
		if p := failPath.Load(); op == "sync" && p != nil && isBlockData(path, *p) {
			return unix.ENOSPC
		}
		return nil
	}
	ffs.SetInject(inject)
	o := Options{FS: ffs, Volumes: []string{crashVol}, ContainerSize: 1 << 30, KeepUncommitted: true, OutOfOrderWrites: true, MaxBlockSize: maxChunks * chunkSize}
	if seed%2 == 0 {
		// Even seeds write every chunk as a deferred write (its bytes in
		// the WAL, the file synced later or replayed at Open); odd seeds
		// sync block files, which is where ENOSPC flushes are injected.
		o.DeferredMax = chunkSize
	} else {
		o.DeferredMax = -1
	}
	s, err := Open(o)
	if err != nil {
		return st, err
	}
	defer func() { s.Close() }()
	if _, err := s.CreateContainer(1, CreateOptions{}); err != nil {
		return st, err
	}
	blocks := map[LocalID]*simBlock{}
	nextLID := LocalID(1)
	var index uint64
	fresh := func() LocalID {
		lid := nextLID
		nextLID++
		data := blockBytes(1, lid, maxChunks*chunkSize)
		b := &simBlock{data: data, chunks: chunked(data, chunkSize)}
		if o.DeferredMax > 0 && r.IntN(3) == 0 {
			// A small block: kept inline (no file) when it is written
			// as one chunk by WriteSmallChunk and committed as such.
			b.small, b.chunks = true, b.chunks[:1]
		}
		blocks[lid] = b
		return lid
	}
	// write writes chunk ch of block lid, acknowledged (durable) or not.
	write := func(lid LocalID, b *simBlock, ch ChunkInfo, durable bool) error {
		data := b.data[ch.Offset : ch.Offset+ch.Length]
		if !b.small {
			if durable {
				return s.WriteChunkDurable(1, lid, ch.Offset, data, ch.Checksum, true)
			}
			return s.WriteChunk(1, lid, ch.Offset, data, ch.Checksum, true)
		}
		if err := s.WriteSmallChunk(1, lid, data, ch.Checksum, true); err != nil || !durable {
			return err
		}
		return s.awaitDurable(1, lid, ch.Offset, ch.Length)
	}
	pick := func() LocalID {
		if len(blocks) < nBlocks || r.IntN(8) == 0 {
			return fresh()
		}
		lids := make([]LocalID, 0, len(blocks))
		for lid := range blocks {
			lids = append(lids, lid)
		}
		// Map order is random: sort for a replayable choice.
		for i := range lids {
			for j := i + 1; j < len(lids); j++ {
				if lids[j] < lids[i] {
					lids[i], lids[j] = lids[j], lids[i]
				}
			}
		}
		return lids[r.IntN(len(lids))]
	}
	for op := range ops {
		lid := pick()
		b := blocks[lid]
		switch k := r.IntN(20); {
		case k < 9: // write the next chunk
			if b.acked == len(b.chunks) {
				continue
			}
			ch := b.chunks[b.acked]
			if r.IntN(5) == 0 {
				p := fmt.Sprintf("/%d.block", lid)
				failPath.Store(&p)
			}
			err := write(lid, b, ch, true)
			failPath.Store(nil)
			if errors.Is(err, ErrDiskFull) {
				st.failed++
				continue // not acknowledged; resent later
			}
			if err != nil {
				return st, fmt.Errorf("op %d: write block %d chunk %d: %w", op, lid, b.acked, err)
			}
			b.acked++
		case k < 11: // a write that is never acknowledged (no Sync)
			if b.acked == len(b.chunks) {
				continue
			}
			ch := b.chunks[b.acked]
			if err := write(lid, b, ch, false); err != nil {
				return st, fmt.Errorf("op %d: unsynced write block %d: %w", op, lid, err)
			}
			// Not acknowledged: the model does not count it, but the
			// store may keep it; a later durable write of the same chunk
			// is a re-delivery.
		case k < 15: // commit what is acknowledged
			if b.acked == b.committed {
				continue
			}
			index++
			bd := blockOf(lid, b.chunks[:b.acked], max(index, b.bcsid))
			if err := s.PutBlock(1, bd); err != nil {
				return st, fmt.Errorf("op %d: put block %d with %d chunks: %w", op, lid, b.acked, err)
			}
			b.committed, b.bcsid = b.acked, bd.BCSID
			st.commits++
			if got, err := s.GetBlock(1, lid); err == nil && got.Inline {
				st.inline++
			}
		case k < 16: // a PutBlock past the acknowledged chunks
			if b.acked == len(b.chunks) {
				continue
			}
			index++
			bd := blockOf(lid, b.chunks[:b.acked+1], max(index, b.bcsid))
			err := s.PutBlock(1, bd)
			if err == nil {
				// Allowed only if the unacknowledged chunk was written in
				// this process (WriteChunk without Sync, then PutBlock
				// synced it): then it is acknowledged now.
				b.acked++
				b.committed, b.bcsid = b.acked, bd.BCSID
			} else if errors.Is(err, ErrChunkMissing) {
				st.refused++
			} else {
				return st, fmt.Errorf("op %d: put block %d past acknowledged data: %w", op, lid, err)
			}
		case k < 17: // abort uncommitted data
			if err := s.AbortBlock(1, lid); err != nil {
				return st, fmt.Errorf("op %d: abort block %d: %w", op, lid, err)
			}
			b.acked = b.committed
		case k < 18: // delete a committed block
			if b.committed == 0 {
				continue
			}
			if err := s.DeleteBlocks(1, []LocalID{lid}); err != nil {
				return st, fmt.Errorf("op %d: delete block %d: %w", op, lid, err)
			}
			delete(blocks, lid)
		default: // power loss
			if b.acked < len(b.chunks) && r.IntN(2) == 0 {
				// ... in the middle of a Sync: the chunk record is on
				// disk, the block file's flush never happened, and the
				// write was never acknowledged.
				fs.skipSync = func(name string) bool { return isBlockData(name, ".block") }
				ch := b.chunks[b.acked]
				if err := write(lid, b, ch, true); err != nil {
					return st, fmt.Errorf("op %d: write block %d before the crash: %w", op, lid, err)
				}
			}
			st.crashes++
			crashed := fs.CrashPartial(r, r.IntN(101))
			s.Close()
			fs = crashed
			ffs = vfs.NewFaultFS(fs)
			ffs.SetInject(inject)
			o.FS = ffs
			if s, err = Open(o); err != nil {
				return st, fmt.Errorf("op %d: reopen after crash: %w", op, err)
			}
			if err := simCheck(s, blocks); err != nil {
				return st, fmt.Errorf("op %d: after crash: %w", op, err)
			}
		}
	}
	return st, simCheck(s, blocks)
}

func simCheck(s *Store, blocks map[LocalID]*simBlock) error {
	rep, err := s.Container(1)
	if err != nil {
		return err
	}
	if rep.State != StateOpen {
		return fmt.Errorf("container %s", rep.State)
	}
	visible, err := s.ListBlocks(1, 0, 1<<20)
	if err != nil {
		return err
	}
	want := 0
	for _, b := range blocks {
		if b.committed > 0 {
			want++
		}
	}
	if len(visible) != want || rep.BlockCount != int64(want) {
		return fmt.Errorf("%d blocks visible, %d counted, %d committed", len(visible), rep.BlockCount, want)
	}
	for lid, b := range blocks {
		end := int64(0)
		for _, ch := range b.chunks[:b.committed] {
			end += ch.Length
		}
		if b.committed > 0 {
			got, err := s.ReadChunk(1, lid, 0, end)
			if err != nil {
				return fmt.Errorf("committed block %d: %w", lid, err)
			}
			if !bytes.Equal(got, b.data[:end]) {
				return fmt.Errorf("committed block %d reads back different data", lid)
			}
		}
		for i := b.committed; i < b.acked; i++ {
			ch := b.chunks[i]
			if ok, err := s.HasChunk(1, lid, ch.Offset, ch.Length); !ok || err != nil {
				return fmt.Errorf("acknowledged chunk %d of block %d not held: %v", i, lid, err)
			}
			got, err := s.ReadWritten(1, lid, ch.Offset, ch.Length, ch.Checksum)
			if err != nil || !bytes.Equal(got, b.data[ch.Offset:ch.Offset+ch.Length]) {
				return fmt.Errorf("acknowledged chunk %d of block %d: %v", i, lid, err)
			}
		}
	}
	return nil
}
