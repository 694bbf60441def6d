package storage

import (
	"hash/crc32"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// benchDir puts benchmark volumes on the disk under test: BASALT_BENCH_DIR
// if set (scripts/bench-storage.sh sets it next to its dd file), else a
// temporary directory.
func benchDir(b *testing.B) string {
	if d := os.Getenv("BASALT_BENCH_DIR"); d != "" {
		dir, err := os.MkdirTemp(d, "bench")
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { os.RemoveAll(dir) })
		return dir
	}
	return b.TempDir()
}

const (
	benchBlock = 256 << 20
	benchChunk = 4 << 20
)

type benchChunkData struct {
	data []byte
	sum  ChecksumData
}

// benchChunks is one 256 MiB block as the client would send it: 4 MiB
// chunks with CRC32C checksums computed up front (the client's work).
func benchChunks() ([]benchChunkData, BlockData) {
	var cs []benchChunkData
	bd := BlockData{Length: benchBlock}
	for off := 0; off < benchBlock; off += benchChunk {
		p := blockBytes(1, LocalID(off/benchChunk%8), benchChunk)
		s := DefaultChecksum.Compute(p)
		cs = append(cs, benchChunkData{p, s})
		bd.Chunks = append(bd.Chunks, ChunkInfo{int64(off), benchChunk, s})
	}
	return cs, bd
}

// BenchmarkWriteBlock: WriteChunk ×64 + PutBlock (fsync at commit) of a
// 256 MiB block.
func BenchmarkWriteBlock(b *testing.B) {
	cs, bd := benchChunks()
	for _, tc := range []struct {
		name   string
		dio    DirectIO
		verify bool
	}{
		{"direct", DirectAuto, false},
		{"direct-verify", DirectAuto, true},
		{"buffered", DirectOff, false},
	} {
		b.Run(tc.name, func(b *testing.B) {
			s, err := Open(Options{Volumes: []string{benchDir(b)}, DirectIO: tc.dio, ContainerSize: 4 << 30})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			if _, err := s.CreateContainer(1, CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(benchBlock)
			b.ResetTimer()
			for i := range b.N {
				lid := LocalID(i)
				for j, c := range cs {
					if err := s.WriteChunk(1, lid, int64(j*benchChunk), c.data, c.sum, tc.verify); err != nil {
						b.Fatal(err)
					}
				}
				bd.LocalID = lid
				if err := s.PutBlock(1, bd); err != nil {
					b.Fatal(err)
				}
				if i%8 == 7 { // bound disk use; not timed
					b.StopTimer()
					ids := []LocalID{}
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
	}
}

// BenchmarkReadAt: verified 4 MiB ReadAt over a 256 MiB block, page cache
// dropped before each pass so the disk is measured.
func BenchmarkReadAt(b *testing.B) {
	cs, bd := benchChunks()
	for _, tc := range []struct {
		name string
		dio  DirectIO
	}{{"direct", DirectAuto}, {"buffered", DirectOff}} {
		b.Run(tc.name, func(b *testing.B) {
			dir := benchDir(b)
			s, err := Open(Options{Volumes: []string{dir}, DirectIO: tc.dio})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			if _, err := s.CreateContainer(1, CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			for j, c := range cs {
				if err := s.WriteChunk(1, 1, int64(j*benchChunk), c.data, c.sum, false); err != nil {
					b.Fatal(err)
				}
			}
			bd.LocalID = 1
			if err := s.PutBlock(1, bd); err != nil {
				b.Fatal(err)
			}
			path := filepath.Join(dir, "basalt/containers/1/1.block")
			buf := AlignedBuffer(benchChunk)
			b.SetBytes(benchBlock)
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				dropCache(b, path)
				b.StartTimer()
				for off := int64(0); off < benchBlock; off += benchChunk {
					if _, err := s.ReadAt(1, 1, buf, off); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

func dropCache(b *testing.B, path string) {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkCRC32C: checksum throughput of one core over 4 MiB.
func BenchmarkCRC32C(b *testing.B) {
	p := blockBytes(1, 1, benchChunk)
	b.SetBytes(benchChunk)
	for range b.N {
		crc32.Checksum(p, castagnoli)
	}
}

// BenchmarkVerify64K: CRC32C verification as reads do it, 64 KiB windows.
func BenchmarkVerify64K(b *testing.B) {
	p := blockBytes(1, 1, benchChunk)
	d := DefaultChecksum.Compute(p)
	b.SetBytes(benchChunk)
	for range b.N {
		if d.Verify(p) >= 0 {
			b.Fatal("mismatch")
		}
	}
}
