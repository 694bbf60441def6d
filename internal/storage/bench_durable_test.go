package storage

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
)

// syncStore calls Store.Sync where the store has it, so this file also
// builds against the store before Sync existed (PutBlock synced the data
// itself then) and one command compares the two.
func syncStore(b *testing.B, s *Store) {
	if sy, ok := any(s).(interface{ Sync() error }); ok {
		if err := sy.Sync(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDurableWrite is the datanode's write path with its
// acknowledgements: every WriteChunk is followed by Sync (one raft entry
// per Ready, the worst case for group commit), then PutBlock commits.
//   - block-128MiB-1MiB: a large block in 1 MiB chunks (CRC32C per 64 KiB).
//   - small-4KiB: a one-chunk 4 KiB block (PutSmallFile).
//   - small-4KiB-x8: eight writers at once, each WriteChunk+Sync+PutBlock on
//     its own block: concurrent Syncs share rounds.
//
// go test ./internal/storage -run '^$' -bench BenchmarkDurableWrite -benchtime 20x
func BenchmarkDurableWrite(b *testing.B) {
	const (
		block = 128 << 20
		chunk = 1 << 20
		small = 4 << 10
	)
	big := blockBytes(1, 1, chunk)
	bigSum := DefaultChecksum.Compute(big)
	tiny := blockBytes(1, 2, small)
	tinySum := DefaultChecksum.Compute(tiny)
	open := func(b *testing.B) *Store {
		s, err := Open(Options{Volumes: []string{benchDir(b)}, ContainerSize: 4 << 30})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		if _, err := s.CreateContainer(1, CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		return s
	}
	b.Run("block-128MiB-1MiB", func(b *testing.B) {
		s := open(b)
		bd := BlockData{Length: block}
		for off := int64(0); off < block; off += chunk {
			bd.Chunks = append(bd.Chunks, ChunkInfo{off, chunk, bigSum})
		}
		b.SetBytes(block)
		b.ResetTimer()
		for i := range b.N {
			lid := LocalID(i)
			for off := int64(0); off < block; off += chunk {
				if err := s.WriteChunk(1, lid, off, big, bigSum, false); err != nil {
					b.Fatal(err)
				}
				syncStore(b, s)
			}
			bd.LocalID, bd.BCSID = lid, uint64(i+1)
			if err := s.PutBlock(1, bd); err != nil {
				b.Fatal(err)
			}
			if i%8 == 7 { // bound disk use; not timed
				b.StopTimer()
				var ids []LocalID
				for k := i - 7; k <= i; k++ {
					ids = append(ids, LocalID(k))
				}
				if err := s.DeleteBlocks(1, ids); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		}
	})
	smallBlock := func(s *Store, lid LocalID) error {
		if err := s.WriteChunk(1, lid, 0, tiny, tinySum, false); err != nil {
			return err
		}
		if sy, ok := any(s).(interface{ Sync() error }); ok {
			if err := sy.Sync(); err != nil {
				return err
			}
		}
		return s.PutBlock(1, BlockData{LocalID: lid, Length: small, BCSID: uint64(lid) + 1, Chunks: []ChunkInfo{{0, small, tinySum}}})
	}
	b.Run("small-4KiB", func(b *testing.B) {
		s := open(b)
		b.SetBytes(small)
		b.ResetTimer()
		for i := range b.N {
			if err := smallBlock(s, LocalID(i)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("small-4KiB-x8", func(b *testing.B) {
		s := open(b)
		var next atomic.Uint64
		b.SetBytes(small)
		b.ResetTimer()
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					if i >= uint64(b.N) {
						return
					}
					if err := smallBlock(s, LocalID(i)); err != nil {
						errs <- fmt.Errorf("block %d: %w", i, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
	})
}

// BenchmarkSmallBatch is a pipeline's Ready batch of small blocks as the
// datanode stores it: 32 one-chunk 4 KiB blocks written (WriteData), one
// Sync (SyncData, before the entries are acknowledged), then their commits
// (Apply). ns/op is per block.
//   - sync-each: block files synced by Sync, every PutBlock a WAL flush
//     (the datanode before issue 15's group commit).
//   - group-commit: block files synced by Sync, PutBlockDeferred for all
//     and one SyncCommits.
//   - deferred-writes: the default: Sync puts the blocks' bytes in the
//     WAL (no file or directory sync), then group commit.
//
// go test ./internal/storage -run '^$' -bench BenchmarkSmallBatch -benchtime 2000x
func BenchmarkSmallBatch(b *testing.B) {
	const small, batch = 4 << 10, 32
	tiny := blockBytes(1, 2, small)
	tinySum := DefaultChecksum.Compute(tiny)
	for _, v := range []struct {
		name     string
		deferMax int64
		group    bool
	}{{"sync-each", -1, false}, {"group-commit", -1, true}, {"deferred-writes", 0, true}} {
		b.Run(v.name, func(b *testing.B) {
			s, err := Open(Options{Volumes: []string{benchDir(b)}, ContainerSize: 4 << 30, DeferredMax: v.deferMax})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			if _, err := s.CreateContainer(1, CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(small)
			b.ResetTimer()
			for first := 0; first < b.N; first += batch {
				n := min(batch, b.N-first)
				for i := range n {
					if err := s.WriteChunk(1, LocalID(first+i), 0, tiny, tinySum, false); err != nil {
						b.Fatal(err)
					}
				}
				if err := s.Sync(); err != nil {
					b.Fatal(err)
				}
				for i := range n {
					lid := LocalID(first + i)
					bd := BlockData{LocalID: lid, Length: small, BCSID: uint64(lid) + 1, Chunks: []ChunkInfo{{0, small, tinySum}}}
					if v.group {
						err = s.PutBlockDeferred(1, bd)
					} else {
						err = s.PutBlock(1, bd)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				if v.group {
					if err := s.SyncCommits(); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
