// Package md5x is MD5 over many independent messages at once, with a
// state that is plain data.
//
// A State is an MD5 chaining value and the count of bytes hashed so far,
// between 64-byte blocks. Any State can be advanced alone (the scalar
// path: crypto/md5, its state imported and exported) or beside up to 15
// others in one pass of the 16-lane AVX-512 kernel (Lanes), and can move
// between the two at any block boundary: a body's hash may enter the
// lanes when other bodies have data ready and leave them when it is
// alone, without losing anything.
//
// MD5's 64 steps form one latency chain, so a kernel pass costs about
// the same whether 1 or 16 lanes are occupied: the cost per byte falls
// nearly linearly with the occupied lanes. A lone state is therefore
// better off on the scalar path, which has no gathers.
package md5x

import (
	"crypto/md5"
	"encoding"
	"encoding/binary"
	"os"
	"sync"
	"sync/atomic"
)

// BlockSize is MD5's block size: States advance by whole blocks.
const BlockSize = 64

var zeroBlock [BlockSize]byte

// Size is an MD5 sum's length.
const Size = md5.Size

// MaxLanes is how many States one kernel pass advances.
const MaxLanes = 16

// State is an MD5 state between blocks: plain data, copyable.
type State struct {
	S   [4]uint32
	Len uint64 // bytes hashed (a multiple of BlockSize)
}

// NewState returns the state of an empty message.
func NewState() State {
	return State{S: [4]uint32{0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476}}
}

// forceScalar: the kernel is not used (tests, or BASALT_MD5X=scalar).
var forceScalar atomic.Bool

func init() {
	if os.Getenv("BASALT_MD5X") == "scalar" {
		forceScalar.Store(true)
	}
}

// SetScalar forces (true) or allows (false) the scalar path for Lanes,
// and returns the previous setting.
func SetScalar(on bool) bool { return forceScalar.Swap(on) }

// HasLanes reports whether Lanes runs the AVX-512 kernel.
func HasLanes() bool { return hasAVX512 && !forceScalar.Load() }

// Blocks advances s over p, whose length must be a multiple of
// BlockSize, on the scalar path.
func (s *State) Blocks(p []byte) {
	if len(p)%BlockSize != 0 {
		panic("md5x: Blocks of a partial block")
	}
	if len(p) == 0 {
		return
	}
	h := scalarPool.Get().(*scalar)
	h.run(s, p)
	scalarPool.Put(h)
}

// Scalar advances States on the scalar path without the shared pool (a
// caller that hashes many blocks keeps one: no allocation per call, also
// under the race detector, whose sync.Pool drops entries). Not safe for
// concurrent use.
type Scalar struct{ s *scalar }

// NewScalar returns a Scalar.
func NewScalar() *Scalar { return &Scalar{s: newScalar()} }

// Blocks advances st over p (a multiple of BlockSize).
func (x *Scalar) Blocks(st *State, p []byte) {
	if len(p)%BlockSize != 0 {
		panic("md5x: Blocks of a partial block")
	}
	if len(p) > 0 {
		x.s.run(st, p)
	}
}

// Load takes st into x, to be advanced by Write and given back by Store
// (a state advanced in steps moves in and out once, not at every step).
func (x *Scalar) Load(st *State) { x.s.load(st) }

// Write advances the loaded state over p (a multiple of BlockSize).
func (x *Scalar) Write(p []byte) {
	if len(p)%BlockSize != 0 {
		panic("md5x: Write of a partial block")
	}
	x.s.h.Write(p)
}

// Store gives the loaded state back into st.
func (x *Scalar) Store(st *State) { x.s.store(st) }

// scalar is crypto/md5 with its state moved in and out through its
// binary form ("md5\x01", a b c d, a 64-byte buffer, the length).
type scalar struct {
	h   interface{ Write([]byte) (int, error) }
	buf []byte
}

func newScalar() *scalar {
	return &scalar{h: md5.New(), buf: make([]byte, 0, 4+16+BlockSize+8)}
}

var scalarPool = sync.Pool{New: func() any { return newScalar() }}

func (h *scalar) run(s *State, p []byte) {
	h.load(s)
	h.h.Write(p)
	h.store(s)
}

func (h *scalar) load(s *State) {
	b := append(h.buf[:0], "md5\x01"...)
	for _, v := range s.S {
		b = binary.BigEndian.AppendUint32(b, v)
	}
	b = append(b, zeroBlock[:]...)
	b = binary.BigEndian.AppendUint64(b, s.Len)
	if err := h.h.(encoding.BinaryUnmarshaler).UnmarshalBinary(b); err != nil {
		panic("md5x: crypto/md5 state: " + err.Error())
	}
	h.buf = b
}

func (h *scalar) store(s *State) {
	b, err := h.h.(encoding.BinaryAppender).AppendBinary(h.buf[:0])
	if err != nil || len(b) != 4+16+BlockSize+8 {
		panic("md5x: crypto/md5 state")
	}
	for i := range s.S {
		s.S[i] = binary.BigEndian.Uint32(b[4+4*i:])
	}
	s.Len = binary.BigEndian.Uint64(b[4+16+BlockSize:])
	h.buf = b
}

// Lanes advances states[i] over data[i] for each i: every data[i] has
// the same length, a multiple of BlockSize, and len(states) is at most
// MaxLanes. With AVX-512 (and not forced scalar) one kernel pass does
// them all; otherwise each goes scalar.
func Lanes(states []*State, data [][]byte) {
	if len(states) != len(data) || len(states) > MaxLanes {
		panic("md5x: Lanes of a bad count")
	}
	if len(states) == 0 {
		return
	}
	n := len(data[0])
	for _, d := range data {
		if len(d) != n || n%BlockSize != 0 {
			panic("md5x: Lanes of unequal or partial blocks")
		}
	}
	if n == 0 {
		return
	}
	if !HasLanes() {
		for i, s := range states {
			s.Blocks(data[i])
		}
		return
	}
	var k kernelArgs
	for i := range MaxLanes {
		j := i
		if j >= len(states) {
			j = 0 // an empty lane repeats lane 0 (its result is dropped)
		}
		for w := range 4 {
			k.st[w*MaxLanes+i] = states[j].S[w]
		}
		k.ptrs[i] = &data[j][0]
	}
	runKernel(&k, n/BlockSize)
	for i, s := range states {
		for w := range 4 {
			s.S[w] = k.st[w*MaxLanes+i]
		}
		s.Len += uint64(n)
	}
}

// Sum returns the MD5 of the message hashed into s followed by tail
// (any length).
func (s State) Sum(tail []byte) [Size]byte {
	full := len(tail) &^ (BlockSize - 1)
	s.Blocks(tail[:full])
	tail = tail[full:]
	// Padding: 0x80, zeros, the length in bits (little endian), to a
	// block boundary.
	var pad [2 * BlockSize]byte
	n := copy(pad[:], tail)
	pad[n] = 0x80
	end := BlockSize
	if n+1+8 > BlockSize {
		end = 2 * BlockSize
	}
	binary.LittleEndian.PutUint64(pad[end-8:], (s.Len+uint64(n))<<3)
	s.Blocks(pad[:end])
	var out [Size]byte
	for i, v := range s.S {
		binary.LittleEndian.PutUint32(out[4*i:], v)
	}
	return out
}

// Digest is a hash.Hash on a State, advanced on the scalar path; its
// State and pending partial block may be taken out and advanced in the
// lanes (see Full).
type Digest struct {
	St   State
	buf  [BlockSize]byte
	nbuf int
}

// New returns an empty Digest.
func New() *Digest { return &Digest{St: NewState()} }

func (d *Digest) Reset()         { *d = Digest{St: NewState()} }
func (d *Digest) Size() int      { return Size }
func (d *Digest) BlockSize() int { return BlockSize }

// Write hashes p on the scalar path.
func (d *Digest) Write(p []byte) (int, error) {
	n := len(p)
	p = d.Fill(p)
	full := len(p) &^ (BlockSize - 1)
	d.St.Blocks(p[:full])
	d.Keep(p[full:])
	return n, nil
}

// Fill completes a pending partial block from p and hashes it; it
// returns the rest of p, to be hashed (whole blocks) into St and then
// Kept.
func (d *Digest) Fill(p []byte) []byte {
	if d.nbuf > 0 {
		n := copy(d.buf[d.nbuf:], p)
		d.nbuf += n
		p = p[n:]
		if d.nbuf == BlockSize {
			d.St.Blocks(d.buf[:])
			d.nbuf = 0
		}
	}
	return p
}

// Keep stores the tail (less than a block) after the whole blocks of
// what Fill returned were hashed into St.
func (d *Digest) Keep(tail []byte) {
	if d.nbuf+len(tail) >= BlockSize {
		panic("md5x: Keep of a whole block")
	}
	d.nbuf += copy(d.buf[d.nbuf:], tail)
}

// Sum appends the MD5 of what was written to b.
func (d *Digest) Sum(b []byte) []byte {
	s := d.St.Sum(d.buf[:d.nbuf])
	return append(b, s[:]...)
}
