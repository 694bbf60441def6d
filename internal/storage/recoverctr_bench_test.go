package storage

import "testing"

// BenchmarkRecoverUnhealthy: how fast a recovery verifies a container
// (16 blocks of 4 MiB, 1 MiB chunks, CRC32C): each iteration marks it
// UNHEALTHY and recovers it, reading and checking every committed byte
// and committing CLOSED with a synced Pebble write. Not a hot path: it
// says how long an operator waits per replica.
func BenchmarkRecoverUnhealthy(b *testing.B) {
	s := openStore(b, Options{})
	mustCreate(b, s, 1)
	const blocks, size = 16, 4 << 20
	for i := range blocks {
		writeBlock(b, s, 1, LocalID(i+1), blockBytes(1, LocalID(i+1), size), 1<<20, DefaultChecksum, uint64(i+1))
	}
	b.SetBytes(blocks * size)
	b.ResetTimer()
	for range b.N {
		if err := s.MarkUnhealthy(1, "bench"); err != nil {
			b.Fatal(err)
		}
		if _, err := s.RecoverUnhealthy(1, VerifyOptions{}, nil); err != nil {
			b.Fatal(err)
		}
	}
}
