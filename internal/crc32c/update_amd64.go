package crc32c

import (
	"hash/crc32"

	"golang.org/x/sys/cpu"
)

// foldAVX512 is in crc32c_amd64.s. crc is the non-inverted state; len(p)
// must be at least 256 and a multiple of 16.
//
//go:noescape
func foldAVX512(crc uint32, p []byte) uint32

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
