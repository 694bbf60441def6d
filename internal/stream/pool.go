package stream

import (
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/basalt-store/basalt/internal/storage"
)

// Packet buffers come from pools by power-of-two size class, 64 KiB to
// MaxPacketSize. They are 4 KiB-aligned (storage.AlignedBuffer) so that
// storage writes them with O_DIRECT straight from this memory: the payload
// is copied once, from the socket into the buffer, and the same buffer
// feeds both the downstream writev and the block file.
const minClassShift = 16

// 64 KiB … 16 MiB: 9 classes. Each class keeps up to freeBytes of
// buffers in a bounded free list in front of its sync.Pool: a sync.Pool is
// emptied by every other GC, and a datanode streaming at disk speed would
// then allocate (and zero) a fresh megabyte per packet. The free list is a
// stack: the buffer returned last, whose lines the CRC and the write just
// read, is the one handed out next, so the copy of the next packet into it
// (crypto/tls copies each decrypted record out of its own buffer) writes
// to cache rather than to memory. A queue handed out the coldest buffer.
const (
	numClasses = 9
	freeBytes  = 64 << 20
	// bufSlack is capacity past every buffer's class size: room for the
	// AEAD tag of a secured stream's payload record (tagLen), which is
	// read and opened in place behind the payload. A whole page, so that
	// the buffer stays a multiple of the O_DIRECT alignment.
	bufSlack = 4096
)

type freeList struct {
	mu   sync.Mutex
	bufs []*[]byte
}

var (
	pools [numClasses]sync.Pool
	free  [numClasses]freeList
)

func init() {
	for c := range free {
		free[c].bufs = make([]*[]byte, 0, max(1, freeBytes>>(c+minClassShift)))
	}
}

func classOf(n int) int {
	if n <= 1<<minClassShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minClassShift
}

// getBuf returns a buffer of at least n bytes (n ≤ MaxPacketSize), with
// capacity for at least bufSlack bytes more.
func getBuf(n int) *[]byte {
	c := classOf(n)
	f := &free[c]
	f.mu.Lock()
	if k := len(f.bufs); k > 0 {
		b := f.bufs[k-1]
		f.bufs[k-1] = nil
		f.bufs = f.bufs[:k-1]
		f.mu.Unlock()
		return b
	}
	f.mu.Unlock()
	if b, ok := pools[c].Get().(*[]byte); ok {
		return b
	}
	size := 1 << (c + minClassShift)
	b := storage.AlignedBuffer(size + bufSlack)[:size]
	return &b
}

func putBuf(b *[]byte) {
	c := classOf(cap(*b) - bufSlack)
	f := &free[c]
	f.mu.Lock()
	if len(f.bufs) < cap(f.bufs) {
		f.bufs = append(f.bufs, b)
		f.mu.Unlock()
		return
	}
	f.mu.Unlock()
	pools[c].Put(b)
}

// copied counts payload bytes this package copied in user space (the
// Writer gathering small writes into a packet). The datanode path copies
// nothing: tests and benchmarks read it through CopiedBytes.
var copied atomic.Uint64

// CopiedBytes is the number of payload bytes this package has copied in
// user space since the process started.
func CopiedBytes() uint64 { return copied.Load() }

// summed counts payload bytes Writers passed through CRC32C (the chunk
// list's windows; the packet CRC is combined from them): one per byte sent.
var summed atomic.Uint64

// SummedBytes is the number of payload bytes Writers have summed with
// CRC32C since the process started.
func SummedBytes() uint64 { return summed.Load() }
