package crc32c

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"
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
