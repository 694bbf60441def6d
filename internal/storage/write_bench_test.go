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
