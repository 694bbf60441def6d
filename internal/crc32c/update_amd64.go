package crc32c

import (
	"hash/crc32"

	"golang.org/x/sys/cpu"
)

// foldAVX512Acc is in crc32c_amd64.s. crc is the non-inverted state;
// len(p) must be at least 256 and a multiple of 16. It stores in acc 16
// bytes whose raw CRC (from 0) is the raw CRC of p from crc.
//
//go:noescape
func foldAVX512Acc(crc uint32, p []byte, acc *[16]byte)

// foldAVX512 is the raw (non-inverted) CRC of p from crc, under the same
// conditions on p.
func foldAVX512(crc uint32, p []byte) uint32 {
	var acc [16]byte
	foldAVX512Acc(crc, p, &acc)
	return raw16(&acc)
}

// raw16 is the raw CRC (from 0) of 16 bytes: the CRC is linear, so it is
// the XOR of each byte's contribution at its position. (hash/crc32's
// Update(^0, acc[:]) gives the same, ^raw16, but its slice escapes through
// an indirect call: a heap allocation per call, 29 ns for 512 bytes
// instead of about 12.)
func raw16(acc *[16]byte) uint32 {
	var c uint32
	for i, b := range acc {
		c ^= byteAt[i][b]
	}
	return c
}

// byteAt[i][b] is the raw CRC of 16 bytes that are zero but for b at
// index i.
var byteAt = func() (t [16][256]uint32) {
	for b := range 256 {
		c := table[b] // raw CRC of the single byte b
		for i := 15; i >= 0; i-- {
			t[i][b] = c
			c = table[byte(c)] ^ c>>8 // one zero byte more
		}
	}
	return t
}()

// hasFold: the CPU (and the OS, which must save the ZMM registers) has
// AVX-512 and the 512-bit carry-less multiply.
var hasFold = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL &&
	cpu.X86.HasAVX512VPCLMULQDQ && cpu.X86.HasPCLMULQDQ

// foldMin is the shortest input given to the folding loop; shorter ones go
// to hash/crc32 (SSE 4.2), which is as fast there (BenchmarkUpdate).
const foldMin = 256

func update(crc uint32, p []byte) uint32 {
	if !hasFold || len(p) < foldMin {
		return crc32.Update(crc, table, p)
	}
	n := len(p) &^ 15
	crc = ^foldAVX512(^crc, p[:n])
	if n == len(p) {
		return crc
	}
	return crc32.Update(crc, table, p[n:])
}
