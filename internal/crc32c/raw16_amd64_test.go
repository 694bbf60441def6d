package crc32c

import (
	"hash/crc32"
	"testing"
)

// TestRaw16: raw16 is the raw CRC (from 0) of its 16 bytes, which
// hash/crc32 gives inverted: Update(^0, acc) == ^raw16(acc). Runs without
// AVX-512 too.
func TestRaw16(t *testing.T) {
	p := randomBytes(16*1000, 13)
	for i := 0; i < 1000; i++ {
		acc := [16]byte(p[16*i:])
		if got, want := raw16(&acc), ^crc32.Update(0xffffffff, castagnoli, acc[:]); got != want {
			t.Fatalf("raw16(%x) = %#x, want %#x", acc, got, want)
		}
	}
	for i := range 16 {
		var acc [16]byte
		acc[i] = 0x80
		if got, want := raw16(&acc), ^crc32.Update(0xffffffff, castagnoli, acc[:]); got != want {
			t.Fatalf("raw16(one bit at byte %d) = %#x, want %#x", i, got, want)
		}
	}
}
