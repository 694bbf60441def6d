package storage

import (
	"crypto/rand"
	"syscall"
	"testing"
	"time"
)

// TestInlineValuesNotRewrittenByCompactions: small blocks' data kept in the
// volume's store (inline blocks) goes into blob files at the flush, and
// compacting the whole store down to the last level rewrites only keys
// and references, not the 4 KiB values; every block still reads back,
// after the compaction and after a reopen. Without value separation the
// compaction writes every value again (8 MiB here).
func TestInlineValuesNotRewrittenByCompactions(t *testing.T) {
	skipUnlessPosix(t)
	dir := t.TempDir()
	s := openStore(t, Options{Volumes: []string{dir}})
	mustCreate(t, s, 1)
	const blocks, size = 2048, 4 << 10
	deadline := time.Now().Add(2 * time.Minute)
	for lo := 1; lo <= blocks; lo += 128 {
		if time.Now().After(deadline) {
			t.Fatal("writes too slow")
		}
		for lid := lo; lid < lo+128; lid++ {
			data := blockBytes(1, LocalID(lid), size)
			if err := s.WriteSmallChunk(1, LocalID(lid), data, DefaultChecksum.Compute(data), true); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Sync(); err != nil {
			t.Fatal(err)
		}
		for lid := lo; lid < lo+128; lid++ {
			data := blockBytes(1, LocalID(lid), size)
			if err := s.PutBlockDeferred(1, BlockData{LocalID: LocalID(lid), Length: size, BCSID: uint64(lid),
				Chunks: []ChunkInfo{{Offset: 0, Length: size, Checksum: DefaultChecksum.Compute(data)}}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.SyncCommits(); err != nil {
			t.Fatal(err)
		}
	}
	db := s.volumes[0].db
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	before := db.Metrics()
	if err := db.Compact(t.Context(), []byte{0}, []byte{0xff, 0xff, 0xff, 0xff}, false); err != nil {
		t.Fatal(err)
	}
	after := db.Metrics()
	var compacted uint64
	for l := range after.Levels {
		compacted += after.Levels[l].TableBytesCompacted + after.Levels[l].BlobBytesCompacted -
			before.Levels[l].TableBytesCompacted - before.Levels[l].BlobBytesCompacted
	}
	values := uint64(blocks * size)
	t.Logf("values %d B; blob files %d (%d B live); compaction wrote %d B", values,
		after.BlobFiles.LiveCount, after.BlobFiles.LiveSize, compacted)
	if after.BlobFiles.LiveSize < values {
		t.Errorf("blob files hold %d B, want the %d B of inline values", after.BlobFiles.LiveSize, values)
	}
	if compacted > values/4 {
		t.Errorf("compacting the store wrote %d B for %d B of inline values: values rewritten", compacted, values)
	}
	check := func(s *Store) {
		for lid := 1; lid <= blocks; lid += 97 {
			checkBlock(t, s, 1, LocalID(lid), blockBytes(1, LocalID(lid), size))
		}
	}
	check(s)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, Options{Volumes: []string{dir}})
	check(s2)
	if bd, err := s2.GetBlock(1, blocks); err != nil || !bd.Inline {
		t.Fatalf("block %d after reopen: %+v, %v", blocks, bd, err)
	}
}

// BenchmarkInlineBlocksCPU: the process CPU (user + system, background
// flushes and compactions included: the store's compaction debt is paid
// before the clock stops) per small inline block written, synced and
// committed in batches of 64, with and without value separation.
//
//	go test ./internal/storage -run '^$' -bench BenchmarkInlineBlocksCPU -benchtime 40000x
func BenchmarkInlineBlocksCPU(b *testing.B) {
	if onBackend() != "posix" {
		b.Skip("inline blocks are a posix-backend feature (deferred writes)")
	}
	for _, sep := range []bool{false, true} {
		name := "separated"
		if !sep {
			name = "in-sstables"
		}
		b.Run(name, func(b *testing.B) {
			old := valueSeparation
			valueSeparation = sep
			defer func() { valueSeparation = old }()
			s := openStore(b, Options{Volumes: []string{b.TempDir()}})
			mustCreate(b, s, 1)
			const size = 4 << 10
			data := make([]byte, size)
			rand.Read(data)
			sum := DefaultChecksum.Compute(data)
			cpu0 := cpuTime()
			b.ResetTimer()
			for lo := 1; lo <= b.N; lo += 64 {
				hi := min(lo+64, b.N+1)
				for lid := lo; lid < hi; lid++ {
					if err := s.WriteSmallChunk(1, LocalID(lid), data, sum, false); err != nil {
						b.Fatal(err)
					}
				}
				if err := s.Sync(); err != nil {
					b.Fatal(err)
				}
				for lid := lo; lid < hi; lid++ {
					if err := s.PutBlockDeferred(1, BlockData{LocalID: LocalID(lid), Length: size, BCSID: uint64(lid),
						Chunks: []ChunkInfo{{Offset: 0, Length: size, Checksum: sum}}}); err != nil {
						b.Fatal(err)
					}
				}
				if err := s.SyncCommits(); err != nil {
					b.Fatal(err)
				}
			}
			db := s.volumes[0].db
			for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				m := db.Metrics()
				if m.Compact.EstimatedDebt == 0 && m.Compact.NumInProgress == 0 && m.Flush.NumInProgress == 0 {
					break
				}
			}
			b.StopTimer()
			m := db.Metrics()
			var compacted uint64
			for l := 1; l < len(m.Levels); l++ { // L0's figures count the flushes
				compacted += m.Levels[l].TableBytesCompacted + m.Levels[l].BlobBytesCompacted
			}
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N)/1e3, "cpu-µs/block")
			b.ReportMetric(float64(compacted)/float64(b.N), "compacted-B/block")
		})
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
