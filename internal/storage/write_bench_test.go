package storage

import (
	"testing"

	"github.com/basalt-store/basalt/internal/vfs"
)

// BenchmarkWriteChunkMem: WriteChunk of 512-byte chunks, in order, into
// new blocks (1,024 chunks each; run it with -benchtime 60000x: the
// blocks stay open) on the in-memory vfs, nothing synced: storage's per-chunk CPU
// (checksum check, block lock, space reservation, the write into the
// file). Written to run unchanged on main, for A/B of writeLocked's
// deferred reservation release.
func BenchmarkWriteChunkMem(b *testing.B) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), KeepUncommitted: true, ContainerSize: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	mustCreate(b, s, 1)
	data := blockBytes(1, 1, 512)
	sum := DefaultChecksum.Compute(data)
	const perBlock = 1024
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		lid := LocalID(i/perBlock + 1)
		if err := s.WriteChunk(1, lid, int64(i%perBlock)*512, data, sum, true); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSyncRoundMem: one 4 KiB chunk written, then a SyncContainers
// round that makes it durable (block lock, persist: the chunk record's
// Pebble commit; the file sync is free on the in-memory vfs): the sync
// round's CPU per batch. Chunks go in order into blocks of 256. Written to
// run unchanged on the branch before, for A/B of syncRound's and persist's
// deferred clean-up (run it with -benchtime 20000x).
func BenchmarkSyncRoundMem(b *testing.B) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), KeepUncommitted: true, ContainerSize: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	mustCreate(b, s, 1)
	data := blockBytes(1, 1, 4096)
	sum := DefaultChecksum.Compute(data)
	const perBlock = 256
	ids := []ContainerID{1}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		lid := LocalID(i/perBlock + 1)
		if err := s.WriteChunk(1, lid, int64(i%perBlock)*4096, data, sum, true); err != nil {
			b.Fatal(err)
		}
		if err := s.SyncContainers(ids); err != nil {
			b.Fatal(err)
		}
	}
}
