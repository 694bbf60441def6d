package crc32c

import (
	"encoding/binary"
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
// an indirect call: a heap allocation per call, which doubled the time
// for 512 bytes.)
func raw16(acc *[16]byte) uint32 {
	lo, hi := binary.LittleEndian.Uint64(acc[:8]), binary.LittleEndian.Uint64(acc[8:])
	t := &byteAt
	a := t[0][byte(lo)] ^ t[1][byte(lo>>8)] ^ t[2][byte(lo>>16)] ^ t[3][byte(lo>>24)]
	b := t[4][byte(lo>>32)] ^ t[5][byte(lo>>40)] ^ t[6][byte(lo>>48)] ^ t[7][byte(lo>>56)]
	c := t[8][byte(hi)] ^ t[9][byte(hi>>8)] ^ t[10][byte(hi>>16)] ^ t[11][byte(hi>>24)]
	d := t[12][byte(hi>>32)] ^ t[13][byte(hi>>40)] ^ t[14][byte(hi>>48)] ^ t[15][byte(hi>>56)]
	return a ^ b ^ c ^ d
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
	var acc [16]byte
	foldAVX512Acc(^crc, p[:n], &acc)
	crc = ^raw16(&acc)
	if n == len(p) {
		return crc
	}
	return crc32.Update(crc, table, p[n:])
}
