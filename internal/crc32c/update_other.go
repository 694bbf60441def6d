//go:build !amd64

package crc32c

import "hash/crc32"

// hasFold: no folding loop on this architecture (hash/crc32 has its own
// hardware paths: ARMv8 CRC32, POWER8, s390x).
var hasFold = false

// foldAVX512 exists only on amd64; never called here (hasFold is false).
func foldAVX512(uint32, []byte) uint32 { panic("crc32c: no folding loop on this architecture") }

func update(crc uint32, p []byte) uint32 { return crc32.Update(crc, table, p) }
