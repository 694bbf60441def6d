package client

import (
	"math/bits"
	"sync"
)

// dirtyPool is the gRPC buffer pool of the client's datanode connections
// (mem.BufferPool). gRPC's default pool clears every buffer it hands out;
// on a read that cleared each 16 KiB frame buffer before the frame was
// read into it (memclr was 10% of a GET's CPU). gRPC fills the buffers it
// gets before reading them, so clearing buys nothing here. Buffers are
// pooled by power-of-two class from 256 B to 4 MiB; larger ones are not
// pooled.
type dirtyPool struct {
	classes [dirtyMaxShift - dirtyMinShift + 1]sync.Pool
}

const (
	dirtyMinShift = 8
	dirtyMaxShift = 22
)

var dnBufPool = &dirtyPool{}

// class is the index of the smallest class holding size bytes, or -1.
func dirtyClass(size int) int {
	if size <= 1<<dirtyMinShift {
		return 0
	}
	s := bits.Len(uint(size - 1))
	if s > dirtyMaxShift {
		return -1
	}
	return s - dirtyMinShift
}

func (p *dirtyPool) Get(size int) *[]byte {
	c := dirtyClass(size)
	if c < 0 {
		b := make([]byte, size)
		return &b
	}
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:size]
		return b
	}
	b := make([]byte, size, 1<<(c+dirtyMinShift))
	return &b
}

func (p *dirtyPool) Put(b *[]byte) {
	c := dirtyClass(cap(*b))
	if c < 0 || cap(*b) != 1<<(c+dirtyMinShift) {
		return // not one of ours
	}
	p.classes[c].Put(b)
}
