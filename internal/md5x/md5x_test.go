package md5x

import (
	"bytes"
	"crypto/md5"
	"fmt"
	"math/rand/v2"
	"testing"
)

// both runs f with the kernel allowed and with the scalar path forced.
func both(t *testing.T, f func(t *testing.T)) {
	t.Run("lanes", func(t *testing.T) {
		if !hasAVX512 {
			t.Skip("no AVX-512")
		}
		old := SetScalar(false)
		defer SetScalar(old)
		f(t)
	})
	t.Run("scalar", func(t *testing.T) {
		old := SetScalar(true)
		defer SetScalar(old)
		f(t)
	})
}

func randBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestSumLengths: Digest and State.Sum agree with crypto/md5 for every
// length 0..300, written whole and in random pieces.
func TestSumLengths(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	data := randBytes(r, 300)
	for n := 0; n <= 300; n++ {
		want := md5.Sum(data[:n])
		d := New()
		d.Write(data[:n])
		if got := d.Sum(nil); !bytes.Equal(got, want[:]) {
			t.Fatalf("len %d: %x, want %x", n, got, want)
		}
		d.Reset()
		for p := data[:n]; len(p) > 0; {
			k := min(len(p), r.IntN(70)+1)
			d.Write(p[:k])
			p = p[k:]
		}
		if got := d.Sum(nil); !bytes.Equal(got, want[:]) {
			t.Fatalf("len %d in pieces: %x, want %x", n, got, want)
		}
		if got := NewState().Sum(data[:n]); got != want {
			t.Fatalf("State.Sum len %d: %x, want %x", n, got, want)
		}
	}
}

// lanesRun hashes msgs the way a gateway does: each message's state
// enters a pass of random lanes at random block boundaries, goes scalar
// alone at others, and all end with their tails.
func lanesRun(t *testing.T, r *rand.Rand, msgs [][]byte, off []int) {
	t.Helper()
	st := make([]State, len(msgs))
	pos := make([]int, len(msgs))
	for i := range st {
		st[i] = NewState()
	}
	for {
		var ready []int
		for i, m := range msgs {
			if len(m)-pos[i] >= BlockSize {
				ready = append(ready, i)
			}
		}
		if len(ready) == 0 {
			break
		}
		r.Shuffle(len(ready), func(i, j int) { ready[i], ready[j] = ready[j], ready[i] })
		ready = ready[:1+r.IntN(min(len(ready), MaxLanes))]
		blocks := 1 + r.IntN(40)
		for _, i := range ready {
			blocks = min(blocks, (len(msgs[i])-pos[i])/BlockSize)
		}
		if len(ready) == 1 && r.IntN(2) == 0 {
			i := ready[0]
			p := msgs[i][pos[i] : pos[i]+blocks*BlockSize]
			if blocks > 1 && r.IntN(2) == 0 { // loaded once, advanced in two steps
				x := NewScalar()
				x.Load(&st[i])
				h := (blocks / 2) * BlockSize
				x.Write(p[:h])
				x.Write(p[h:])
				x.Store(&st[i])
			} else {
				st[i].Blocks(p)
			}
			pos[i] += blocks * BlockSize
			continue
		}
		var ss []*State
		var ds [][]byte
		for _, i := range ready {
			ss = append(ss, &st[i])
			ds = append(ds, msgs[i][pos[i]:pos[i]+blocks*BlockSize])
			pos[i] += blocks * BlockSize
		}
		Lanes(ss, ds)
	}
	for i, m := range msgs {
		want := md5.Sum(m)
		if got := st[i].Sum(m[pos[i]:]); got != want {
			t.Fatalf("message %d (len %d, offset %d) of %d: %x, want %x", i, len(m), off[i], len(msgs), got, want)
		}
	}
}

// TestLanesVsCryptoMD5: random lane counts 1..16, lengths 0..300 and up
// to MiBs, unaligned starts, states entering and leaving the lanes.
func TestLanesVsCryptoMD5(t *testing.T) {
	both(t, func(t *testing.T) {
		r := rand.New(rand.NewPCG(3, 4))
		for round := range 60 {
			nm := 1 + r.IntN(MaxLanes+4)
			msgs := make([][]byte, nm)
			off := make([]int, nm)
			for i := range msgs {
				var n int
				switch r.IntN(3) {
				case 0:
					n = r.IntN(301)
				case 1:
					n = r.IntN(64 << 10)
				default:
					if round%10 == 0 {
						n = r.IntN(3 << 20)
					} else {
						n = r.IntN(256 << 10)
					}
				}
				off[i] = r.IntN(64)
				msgs[i] = randBytes(r, n+off[i])[off[i]:]
			}
			lanesRun(t, r, msgs, off)
		}
	})
}

// TestLanesEachLane: a wrong block in any one lane (a lane's pointer,
// message word or state slot mixed up) shows: each lane count 1..16,
// each lane's message different.
func TestLanesEachLane(t *testing.T) {
	both(t, func(t *testing.T) {
		r := rand.New(rand.NewPCG(5, 6))
		for n := 1; n <= MaxLanes; n++ {
			ss := make([]*State, n)
			ds := make([][]byte, n)
			for i := range ss {
				s := NewState()
				ss[i] = &s
				ds[i] = randBytes(r, 3*BlockSize)
			}
			Lanes(ss, ds)
			for i := range ss {
				if want := md5.Sum(ds[i]); ss[i].Sum(nil) != want {
					t.Fatalf("%d lanes: lane %d wrong", n, i)
				}
			}
		}
	})
}

// FuzzMD5x compares with crypto/md5: the data split into up to 16
// messages at the fuzzer's points, hashed in passes of the lanes.
func FuzzMD5x(f *testing.F) {
	f.Add([]byte("abc"), uint64(1))
	f.Add(bytes.Repeat([]byte{0x5a}, 1000), uint64(77))
	f.Fuzz(func(t *testing.T, data []byte, seed uint64) {
		r := rand.New(rand.NewPCG(seed, 9))
		nm := 1 + int(seed%MaxLanes)
		msgs := make([][]byte, nm)
		off := make([]int, nm)
		for i := range msgs {
			a, b := r.IntN(len(data)+1), r.IntN(len(data)+1)
			if a > b {
				a, b = b, a
			}
			msgs[i], off[i] = data[a:b], a
		}
		lanesRun(t, r, msgs, off)
		d := New()
		d.Write(data)
		if want := md5.Sum(data); !bytes.Equal(d.Sum(nil), want[:]) {
			t.Fatalf("Digest: wrong sum")
		}
	})
}

func BenchmarkMD5x(b *testing.B) {
	const size = 256 << 10
	data := make([][]byte, MaxLanes)
	for i := range data {
		data[i] = make([]byte, size)
	}
	b.Run("crypto-md5", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			md5.Sum(data[0])
		}
	})
	b.Run("scalar", func(b *testing.B) {
		s := NewState()
		b.SetBytes(size)
		for b.Loop() {
			s.Blocks(data[0])
		}
	})
	for _, n := range []int{1, 2, 4, 8, 12, 16} {
		b.Run(fmt.Sprintf("lanes-%d", n), func(b *testing.B) {
			if !hasAVX512 {
				b.Skip("no AVX-512")
			}
			ss := make([]*State, n)
			for i := range ss {
				s := NewState()
				ss[i] = &s
			}
			b.SetBytes(int64(n) * size)
			for b.Loop() {
				Lanes(ss, data[:n])
			}
		})
	}
}
