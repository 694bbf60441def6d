package storage

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func cpuNow() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkVerifyBlock: the scrubber's work, VerifyBlock of 4 blocks of
// 64 MiB (16 chunks of 4 MiB, CRC32C per 64 KiB) with a 4 MiB buffer,
// unthrottled. "direct" reads bypass the page cache (O_DIRECT, what the
// scrubber does on a real disk); "cached" uses the page cache, so it shows
// the CPU cost alone. Reports MB/s and CPU seconds per GiB verified.
//
//	go test -run '^$' -bench BenchmarkVerifyBlock -benchtime 8x ./internal/storage/
func BenchmarkVerifyBlock(b *testing.B) {
	const blocks, size = 4, 64 << 20
	for _, tc := range []struct {
		name string
		dio  DirectIO
	}{{"direct", DirectAuto}, {"cached", DirectOff}} {
		b.Run(tc.name, func(b *testing.B) {
			s := openStore(b, Options{Volumes: []string{benchDir(b)}, DirectIO: tc.dio})
			mustCreate(b, s, 1)
			for lid := LocalID(1); lid <= blocks; lid++ {
				writeBlock(b, s, 1, lid, blockBytes(1, lid, size), 4<<20, DefaultChecksum, uint64(lid))
			}
			buf := AlignedBuffer(4 << 20)
			b.SetBytes(blocks * size)
			b.ResetTimer()
			cpu0 := cpuNow()
			for range b.N {
				for lid := LocalID(1); lid <= blocks; lid++ {
					if n, err := s.VerifyBlock(1, lid, VerifyOptions{Buf: buf}); err != nil || n != size {
						b.Fatal(n, err)
					}
				}
			}
			cpu := cpuNow() - cpu0
			gib := float64(b.N) * blocks * size / (1 << 30)
			b.ReportMetric(cpu.Seconds()/gib, "cpu-s/GiB")
		})
	}
}
