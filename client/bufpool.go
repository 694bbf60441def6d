package client

import (
	"context"
	"sync"
	"sync/atomic"
)

// bufPool hands out at most cap buffers of size bytes: the bound on the
// data a writer holds that is not yet committed on every replica. get
// blocks when all are out. Buffers come from a process-wide free list per
// size so that many short PutKeys do not each allocate megabytes.
type bufPool struct {
	size  int
	slots chan struct{}
	out   atomic.Int64 // buffers handed out (for tests and assertions)
	free  *sync.Pool
}

var freeLists sync.Map // size → *sync.Pool

func newBufPool(size, count int) *bufPool {
	fl, _ := freeLists.LoadOrStore(size, &sync.Pool{New: func() any { b := make([]byte, size); return &b }})
	return &bufPool{size: size, slots: make(chan struct{}, count), free: fl.(*sync.Pool)}
}

// buffer is a pooled byte slice shared by the chunks cut from it; it goes
// back to the pool when the last of them is committed.
type buffer struct {
	pool *bufPool
	data []byte
	refs atomic.Int32
}

// get waits for a free slot, or until ctx is done or stop is closed (the
// writer's pipeline failed and will not release buffers by itself).
func (p *bufPool) get(ctx context.Context, stop <-chan struct{}) (*buffer, error) {
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-stop:
		return nil, errPipelineFailed
	}
	p.out.Add(1)
	b := &buffer{pool: p, data: (*p.free.Get().(*[]byte))[:p.size]}
	b.refs.Store(1)
	return b, nil
}

func (b *buffer) ref() { b.refs.Add(1) }

func (b *buffer) unref() {
	switch n := b.refs.Add(-1); {
	case n == 0:
		d := b.data[:cap(b.data)]
		b.data = nil
		b.pool.free.Put(&d)
		b.pool.out.Add(-1)
		<-b.pool.slots
	case n < 0:
		panic("client: buffer released twice")
	}
}
