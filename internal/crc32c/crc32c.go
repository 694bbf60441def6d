// Package crc32c combines CRC32C (Castagnoli) checksums: given crc(A) and
// crc(B) it returns crc(A‖B) without the bytes (zlib's crc32_combine, a
// multiplication by x^(8·len(B)) modulo the polynomial in GF(2)). Writers
// that already sum every 64 KiB window of what they send get the CRC of a
// packet, a chunk or a whole object from those sums instead of a second
// pass over the data.
package crc32c

import "hash/crc32"

// poly is the reflected Castagnoli polynomial.
const poly = 0x82f63b78

var table = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the CRC32C of p (hardware-accelerated where available: on
// amd64 with AVX-512 and VPCLMULQDQ a 4-way folding loop, otherwise
// hash/crc32's SSE 4.2 code).
func Checksum(p []byte) uint32 { return update(0, p) }

// Update extends crc with p; Update(0, p) == Checksum(p), and both equal
// hash/crc32's results for the Castagnoli table.
func Update(crc uint32, p []byte) uint32 { return update(crc, p) }

// x2n[k] is x^(2^k) modulo the polynomial.
var x2n [32]uint32

func init() {
	p := uint32(1) << 30 // x^1
	x2n[0] = p
	for k := 1; k < 32; k++ {
		p = multmodp(p, p)
		x2n[k] = p
	}
}

// multmodp multiplies a and b modulo the polynomial (reflected bit order:
// the top bit is x^0). Any input terminates: a == 0 gives 0.
func multmodp(a, b uint32) uint32 {
	if a == 0 {
		return 0
	}
	m := uint32(1) << 31
	var p uint32
	for {
		if a&m != 0 {
			p ^= b
			if a&(m-1) == 0 {
				break
			}
		}
		m >>= 1
		if b&1 != 0 {
			b = b>>1 ^ poly
		} else {
			b >>= 1
		}
	}
	return p
}

// x8n is x^(8·n) modulo the polynomial: the operator that shifts a CRC
// past n zero bytes.
func x8n(n int64) uint32 {
	p := uint32(1) << 31 // x^0
	for k := 3; n > 0; k++ {
		if n&1 != 0 {
			p = multmodp(x2n[k&31], p)
		}
		n >>= 1
	}
	return p
}

// Combine returns the CRC32C of A‖B from crcA = CRC32C(A), crcB = CRC32C(B)
// and lenB = len(B).
func Combine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA // B is empty: its CRC32C is 0
	}
	return multmodp(x8n(lenB), crcA) ^ crcB
}

// Shift is a precomputed Combine for one length of B, for sums of windows
// of a fixed size: ShiftFor(n).Combine(a, b) == Combine(a, b, n) for every
// n. The zero Shift is ShiftFor(0) (and of any n <= 0): B is empty, so its
// Combine returns crcA, as Combine does for lenB <= 0.
type Shift uint32

// ShiftFor returns the shift for B of n bytes; n <= 0 gives the zero
// Shift (an empty B).
func ShiftFor(n int64) Shift {
	if n <= 0 {
		return 0
	}
	return Shift(x8n(n)) // never 0: x^(8n) is a unit modulo the polynomial
}

// Combine returns the CRC32C of A‖B where B has the shift's length.
func (s Shift) Combine(crcA, crcB uint32) uint32 {
	if s == 0 {
		return crcA // B is empty
	}
	return multmodp(uint32(s), crcA) ^ crcB
}

// Windows returns the CRC32C of data of length total whose consecutive
// windows of bpc bytes (the last one shorter if total is not a multiple)
// have the big-endian CRC32Cs in sums (4 bytes each). ok is false when
// sums does not hold exactly one CRC per window.
func Windows(sums []byte, bpc, total int64) (crc uint32, ok bool) {
	if bpc <= 0 || total < 0 {
		return 0, false
	}
	n := (total + bpc - 1) / bpc
	if int64(len(sums)) != 4*n {
		return 0, false
	}
	full := ShiftFor(bpc)
	for i := int64(0); i < n; i++ {
		s := uint32(sums[4*i])<<24 | uint32(sums[4*i+1])<<16 | uint32(sums[4*i+2])<<8 | uint32(sums[4*i+3])
		if l := min(bpc, total-i*bpc); l == bpc {
			crc = full.Combine(crc, s)
		} else {
			crc = Combine(crc, s, l)
		}
	}
	return crc, true
}
