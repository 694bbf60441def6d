// Castagnoli CRC folding with AVX-512 VPCLMULQDQ: four 64-byte
// accumulators 256 bytes apart, folded into one, then to 16 bytes, which
// are stored; the Go caller takes their CRC (raw16 in update_amd64.go).
//
// Fold constants for a distance of D bits, reflected and shifted left by
// one: low = x^(D+32) mod P, high = x^(D-32) mod P (x^k mod P values,
// recomputed from the polynomial in TestFoldConstants).

#include "textflag.h"

// func foldAVX512Acc(crc uint32, p []byte, acc *[16]byte)
// crc is the non-inverted CRC state; len(p) >= 256 and a multiple of 16.
// Stores in acc 16 bytes whose raw CRC (initial value 0) is that of p
// from crc.
TEXT ·foldAVX512Acc(SB), NOSPLIT, $0-40
	MOVL crc+0(FP), AX
	MOVQ p_base+8(FP), SI
	MOVQ p_len+16(FP), CX

	VMOVDQU64 (SI), Z1
	VMOVDQU64 64(SI), Z2
	VMOVDQU64 128(SI), Z3
	VMOVDQU64 192(SI), Z4
	VPXORQ    Z0, Z0, Z0
	VMOVQ     AX, X0
	VPXORQ    Z0, Z1, Z1 // merge the initial CRC into the first 4 bytes
	ADDQ      $256, SI
	SUBQ      $256, CX

	VMOVDQU64 k2048<>+0(SB), Z0
	CMPQ      CX, $256
	JB        fold4

loop256:
	// Prefetch 2 KiB ahead (measured: 4 MiB inputs, which miss the 2 MiB
	// L2, 17 -> 22-30 GB/s). A prefetch past the end of p never faults.
	PREFETCHT0 2048(SI)
	PREFETCHT0 2112(SI)
	PREFETCHT0 2176(SI)
	PREFETCHT0 2240(SI)
	VMOVDQU64  (SI), Z11
	VMOVDQU64  64(SI), Z12
	VMOVDQU64  128(SI), Z13
	VMOVDQU64  192(SI), Z14
	VPCLMULQDQ $0x11, Z0, Z1, Z5
	VPCLMULQDQ $0, Z0, Z1, Z1
	VPCLMULQDQ $0x11, Z0, Z2, Z6
	VPCLMULQDQ $0, Z0, Z2, Z2
	VPCLMULQDQ $0x11, Z0, Z3, Z7
	VPCLMULQDQ $0, Z0, Z3, Z3
	VPCLMULQDQ $0x11, Z0, Z4, Z8
	VPCLMULQDQ $0, Z0, Z4, Z4
	VPTERNLOGD $0x96, Z11, Z5, Z1
	VPTERNLOGD $0x96, Z12, Z6, Z2
	VPTERNLOGD $0x96, Z13, Z7, Z3
	VPTERNLOGD $0x96, Z14, Z8, Z4
	ADDQ       $256, SI
	SUBQ       $256, CX
	CMPQ       CX, $256
	JAE        loop256

fold4:
	// Fold the four accumulators into Z1, 64 bytes at a time.
	VMOVDQU64  k512<>+0(SB), Z0
	VPCLMULQDQ $0x11, Z0, Z1, Z5
	VPCLMULQDQ $0, Z0, Z1, Z1
	VPTERNLOGD $0x96, Z2, Z5, Z1
	VPCLMULQDQ $0x11, Z0, Z1, Z5
	VPCLMULQDQ $0, Z0, Z1, Z1
	VPTERNLOGD $0x96, Z3, Z5, Z1
	VPCLMULQDQ $0x11, Z0, Z1, Z5
	VPCLMULQDQ $0, Z0, Z1, Z1
	VPTERNLOGD $0x96, Z4, Z5, Z1

	CMPQ CX, $64
	JB   lanes

loop64:
	VMOVDQU64  (SI), Z11
	VPCLMULQDQ $0x11, Z0, Z1, Z5
	VPCLMULQDQ $0, Z0, Z1, Z1
	VPTERNLOGD $0x96, Z11, Z5, Z1
	ADDQ       $64, SI
	SUBQ       $64, CX
	CMPQ       CX, $64
	JAE        loop64

lanes:
	// Fold the four 128-bit lanes of Z1 into X1, as above with the
	// 128-bit distance, then any whole 16-byte blocks left.
	VMOVDQU       k128<>+0(SB), X0
	VEXTRACTI32X4 $1, Z1, X2
	VEXTRACTI32X4 $2, Z1, X3
	VEXTRACTI32X4 $3, Z1, X4
	VPCLMULQDQ    $0x11, X0, X1, X5
	VPCLMULQDQ    $0, X0, X1, X1
	VPTERNLOGD    $0x96, X2, X5, X1
	VPCLMULQDQ    $0x11, X0, X1, X5
	VPCLMULQDQ    $0, X0, X1, X1
	VPTERNLOGD    $0x96, X3, X5, X1
	VPCLMULQDQ    $0x11, X0, X1, X5
	VPCLMULQDQ    $0, X0, X1, X1
	VPTERNLOGD    $0x96, X4, X5, X1

	CMPQ CX, $16
	JB   done

loop16:
	VMOVDQU    (SI), X11
	VPCLMULQDQ $0x11, X0, X1, X5
	VPCLMULQDQ $0, X0, X1, X1
	VPTERNLOGD $0x96, X11, X5, X1
	ADDQ       $16, SI
	SUBQ       $16, CX
	CMPQ       CX, $16
	JAE        loop16

done:
	// Each fold keeps the accumulator congruent, modulo P, to the input
	// read so far (initial CRC merged) at the same end position, so the
	// raw CRC of these 16 bytes is that of the input.
	MOVQ    acc+32(FP), DI
	VMOVDQU X1, (DI)
	VZEROUPPER
	RET

// Fold by 2048 bits (256 bytes), for each of the four 128-bit lanes.
DATA k2048<>+0(SB)/8, $0x0dcb17aa4
DATA k2048<>+8(SB)/8, $0x0b9e02b86
DATA k2048<>+16(SB)/8, $0x0dcb17aa4
DATA k2048<>+24(SB)/8, $0x0b9e02b86
DATA k2048<>+32(SB)/8, $0x0dcb17aa4
DATA k2048<>+40(SB)/8, $0x0b9e02b86
DATA k2048<>+48(SB)/8, $0x0dcb17aa4
DATA k2048<>+56(SB)/8, $0x0b9e02b86
GLOBL k2048<>(SB), RODATA, $64

// Fold by 512 bits (64 bytes).
DATA k512<>+0(SB)/8, $0x0740eef02
DATA k512<>+8(SB)/8, $0x09e4addf8
DATA k512<>+16(SB)/8, $0x0740eef02
DATA k512<>+24(SB)/8, $0x09e4addf8
DATA k512<>+32(SB)/8, $0x0740eef02
DATA k512<>+40(SB)/8, $0x09e4addf8
DATA k512<>+48(SB)/8, $0x0740eef02
DATA k512<>+56(SB)/8, $0x09e4addf8
GLOBL k512<>(SB), RODATA, $64

// Fold by 128 bits.
DATA k128<>+0(SB)/8, $0xf20c0dfe
DATA k128<>+8(SB)/8, $0x14cd00bd6
GLOBL k128<>(SB), RODATA, $16
