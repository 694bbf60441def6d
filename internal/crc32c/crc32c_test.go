package crc32c

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"
	"time"
)

func TestCombineMatchesDirect(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 300<<10)
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	lens := []int{0, 1, 3, 63, 512, 4095, 65536, 65537, 200 << 10}
	for _, la := range lens {
		for _, lb := range lens {
			if la+lb > len(buf) {
				continue
			}
			a, b := buf[:la], buf[la:la+lb]
			want := Checksum(buf[:la+lb])
			if got := Combine(Checksum(a), Checksum(b), int64(lb)); got != want {
				t.Fatalf("Combine(%d, %d) = %08x, want %08x", la, lb, got, want)
			}
			if lb > 0 {
				if got := ShiftFor(int64(lb)).Combine(Checksum(a), Checksum(b)); got != want {
					t.Fatalf("Shift(%d).Combine after %d = %08x, want %08x", lb, la, got, want)
				}
			}
		}
	}
}

func TestWindows(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, total := range []int{0, 1, 1000, 64 << 10, 64<<10 + 1, 1<<20 - 7, 3 << 20} {
		data := make([]byte, total)
		for i := range data {
			data[i] = byte(r.Uint32())
		}
		const bpc = 64 << 10
		var sums []byte
		for i := 0; i < total; i += bpc {
			sums = binary.BigEndian.AppendUint32(sums, Checksum(data[i:min(i+bpc, total)]))
		}
		got, ok := Windows(sums, bpc, int64(total))
		if !ok || got != Checksum(data) {
			t.Fatalf("total %d: Windows = %08x, %v; want %08x", total, got, ok, Checksum(data))
		}
		if _, ok := Windows(append(sums, 0, 0, 0, 0), bpc, int64(total)); ok {
			t.Fatalf("total %d: one sum too many accepted", total)
		}
	}
}

// BenchmarkWindows: combining the 16 window sums of 1 MiB, against
// summing the MiB again (what combining saves).
func BenchmarkWindows(b *testing.B) {
	data := make([]byte, 1<<20)
	var sums []byte
	for i := 0; i < len(data); i += 64 << 10 {
		sums = binary.BigEndian.AppendUint32(sums, Checksum(data[i:i+64<<10]))
	}
	b.Run("combine", func(b *testing.B) {
		for range b.N {
			Windows(sums, 64<<10, 1<<20)
		}
	})
	b.Run("rehash", func(b *testing.B) {
		b.SetBytes(1 << 20)
		for range b.N {
			Checksum(data)
		}
	})
}

// TestCombineEdgeCases: no input loops forever (multmodp(0, b) did, and so
// did the zero Shift's Combine), and a shift for an empty B (n <= 0)
// returns A, as Combine does, whatever B's CRC.
func TestCombineEdgeCases(t *testing.T) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, b := range []uint32{0, 1, 1 << 31, 0xffffffff, 0x82f63b78} {
			if p := multmodp(0, b); p != 0 {
				t.Errorf("multmodp(0, %#x) = %#x, want 0", b, p)
			}
			if p := multmodp(b, 0); p != 0 {
				t.Errorf("multmodp(%#x, 0) = %#x, want 0", b, p)
			}
		}
		a, b := Checksum([]byte("hello")), Checksum([]byte(" world"))
		for _, n := range []int64{0, -1, -1 << 40} {
			if got := ShiftFor(n).Combine(a, 0); got != a {
				t.Errorf("ShiftFor(%d).Combine(a, 0) = %#x, want a = %#x", n, got, a)
			}
			if got := ShiftFor(n).Combine(a, b); got != Combine(a, b, n) {
				t.Errorf("ShiftFor(%d).Combine = %#x, Combine = %#x", n, got, Combine(a, b, n))
			}
		}
		var zero Shift
		if got := zero.Combine(a, 0); got != a {
			t.Errorf("zero Shift's Combine(a, 0) = %#x, want %#x", got, a)
		}
		if got, want := ShiftFor(6).Combine(a, b), Checksum([]byte("hello world")); got != want {
			t.Errorf("ShiftFor(6).Combine = %#x, want %#x", got, want)
		}
		// Random lengths, empty A and B included, against the direct sum.
		r := rand.New(rand.NewPCG(3, 4))
		for i := 0; i < 3000 && !t.Failed(); i++ {
			la, lb := r.IntN(300), r.IntN(300)
			if i%7 == 0 {
				lb = 0
			}
			if i%11 == 0 {
				la = 0
			}
			d := make([]byte, la+lb)
			for j := range d {
				d[j] = byte(r.Uint32())
			}
			ca, cb, want := Checksum(d[:la]), Checksum(d[la:]), Checksum(d)
			if got := Combine(ca, cb, int64(lb)); got != want {
				t.Errorf("Combine, |A| %d |B| %d: %#x want %#x", la, lb, got, want)
			}
			if got := ShiftFor(int64(lb)).Combine(ca, cb); got != want {
				t.Errorf("ShiftFor(%d).Combine, |A| %d: %#x want %#x", lb, la, got, want)
			}
			bpc := int64(1 + r.IntN(64))
			var s []byte
			for o := 0; o < len(d); o += int(bpc) {
				s = binary.BigEndian.AppendUint32(s, Checksum(d[o:min(o+int(bpc), len(d))]))
			}
			if c, ok := Windows(s, bpc, int64(len(d))); !ok || c != want {
				t.Errorf("Windows, %d bytes, windows of %d: %#x %v, want %#x", len(d), bpc, c, ok, want)
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("a CRC combination did not return in 30 s (an endless loop)")
	}
}
