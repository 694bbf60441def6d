package crc32c

import (
	"hash/crc32"
	"math/bits"
	"math/rand/v2"
	"testing"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func randomBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestUpdateMatchesStdlib: every length 0..4096 at every alignment 0..63
// (and a few large lengths), from a zero and a non-zero starting CRC, is
// hash/crc32's Castagnoli result.
func TestUpdateMatchesStdlib(t *testing.T) {
	if !hasFold {
		t.Log("CPU without AVX-512 VPCLMULQDQ: checking the fallback only")
	}
	buf := randomBytes(4096+64, 1)
	for align := 0; align < 64; align++ {
		for n := 0; n <= 4096; n++ {
			p := buf[align : align+n]
			if got, want := Checksum(p), crc32.Checksum(p, castagnoli); got != want {
				t.Fatalf("Checksum(len %d, align %d) = %#x, want %#x", n, align, got, want)
			}
			if got, want := Update(0xdeadbeef, p), crc32.Update(0xdeadbeef, castagnoli, p); got != want {
				t.Fatalf("Update(len %d, align %d) = %#x, want %#x", n, align, got, want)
			}
		}
	}
	big := randomBytes(9<<20+77, 2)
	for _, n := range []int{64 << 10, 1 << 20, 4<<20 + 13, 9<<20 + 77} {
		for _, align := range []int{0, 1, 31, 63} {
			p := big[align:n]
			if got, want := Checksum(p), crc32.Checksum(p, castagnoli); got != want {
				t.Fatalf("Checksum(len %d, align %d) = %#x, want %#x", len(p), align, got, want)
			}
		}
	}
}

// TestFoldEveryLength calls the assembly directly for every length it
// accepts up to 8 KiB (Update only gives it foldMin and more).
func TestFoldEveryLength(t *testing.T) {
	if !hasFold {
		t.Skip("CPU without AVX-512 VPCLMULQDQ")
	}
	buf := randomBytes(8192+16, 3)
	for _, align := range []int{0, 1, 8, 15} {
		for n := 256; n <= 8192; n += 16 {
			p := buf[align : align+n]
			for _, c := range []uint32{0, 0x12345678, 0xffffffff} {
				got := ^foldAVX512(^c, p)
				if want := crc32.Update(c, castagnoli, p); got != want {
					t.Fatalf("foldAVX512(crc %#x, len %d, align %d) = %#x, want %#x", c, n, align, got, want)
				}
			}
		}
	}
}

// TestFoldConstants: the constants in crc32c_amd64.s are x^(D±32) mod P,
// bit-reflected and shifted left by one, for the fold distances used.
func TestFoldConstants(t *testing.T) {
	const p = uint64(0x11EDC6F41) // Castagnoli, normal order, 33 bits
	xmod := func(e int) uint64 {
		r := uint64(1)
		for i := 0; i < e; i++ {
			r <<= 1
			if r&(1<<32) != 0 {
				r ^= p
			}
		}
		return r
	}
	k := func(e int) uint64 { return uint64(bits.Reverse32(uint32(xmod(e)))) << 1 }
	for _, c := range []struct {
		name string
		got  uint64
		e    int
	}{
		{"k2048 low", 0x0dcb17aa4, 2048 + 32}, {"k2048 high", 0x0b9e02b86, 2048 - 32},
		{"k512 low", 0x0740eef02, 512 + 32}, {"k512 high", 0x09e4addf8, 512 - 32},
		{"k128 low", 0xf20c0dfe, 128 + 32}, {"k128 high", 0x14cd00bd6, 128 - 32},
		{"k64", 0xdd45aab8, 64},
	} {
		if want := k(c.e); c.got != want {
			t.Errorf("%s = %#x, want %#x", c.name, c.got, want)
		}
	}
}

func FuzzUpdate(f *testing.F) {
	f.Add(uint32(0), []byte("hello"), uint8(0))
	f.Add(uint32(1), randomBytes(1000, 4), uint8(3))
	f.Add(uint32(0xffffffff), randomBytes(5000, 5), uint8(17))
	f.Fuzz(func(t *testing.T, crc uint32, p []byte, skip uint8) {
		if int(skip) < len(p) {
			p = p[skip:]
		}
		if got, want := Update(crc, p), crc32.Update(crc, castagnoli, p); got != want {
			t.Fatalf("Update(%#x, len %d) = %#x, want %#x", crc, len(p), got, want)
		}
	})
}

var sink uint32

func benchSizes(b *testing.B, f func([]byte) uint32) {
	for _, s := range []struct {
		name string
		n    int
	}{{"512", 512}, {"1KiB", 1 << 10}, {"4KiB", 4 << 10}, {"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"4MiB", 4 << 20}} {
		p := randomBytes(s.n, 9)
		b.Run(s.name, func(b *testing.B) {
			b.SetBytes(int64(s.n))
			for b.Loop() {
				sink = f(p)
			}
		})
	}
}

// BenchmarkStdlib is hash/crc32's Castagnoli (SSE 4.2) for comparison with
// BenchmarkChecksum.
func BenchmarkStdlib(b *testing.B) {
	benchSizes(b, func(p []byte) uint32 { return crc32.Checksum(p, castagnoli) })
}

func BenchmarkChecksum(b *testing.B) { benchSizes(b, Checksum) }

func TestHashMatchesStdlib(t *testing.T) {
	p := randomBytes(100000, 11)
	h, w := New(), crc32.New(castagnoli)
	for i := 0; i < len(p); {
		n := min(len(p)-i, 1+i%7919)
		h.Write(p[i : i+n])
		w.Write(p[i : i+n])
		i += n
	}
	if h.Sum32() != w.Sum32() || string(h.Sum([]byte("x"))) != string(w.Sum([]byte("x"))) {
		t.Fatalf("New() sums %#x, hash/crc32 %#x", h.Sum32(), w.Sum32())
	}
	h.Reset()
	if h.Sum32() != 0 || h.Size() != 4 || h.BlockSize() != 1 {
		t.Fatal("Reset/Size/BlockSize")
	}
}

// TestFallbackMatchesStdlib runs Update with the folding loop switched off
// (the path of CPUs without AVX-512 VPCLMULQDQ).
func TestFallbackMatchesStdlib(t *testing.T) {
	defer func(h bool) { hasFold = h }(hasFold)
	hasFold = false
	p := randomBytes(70000, 12)
	for _, n := range []int{0, 1, 255, 256, 4096, 70000} {
		if got, want := Update(5, p[:n]), crc32.Update(5, castagnoli, p[:n]); got != want {
			t.Fatalf("len %d: %#x, want %#x", n, got, want)
		}
	}
}
