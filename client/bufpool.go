package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// bufPool hands out at most cap buffers of size bytes: the bound on the
// data a writer holds that is not yet committed on every replica. get
// blocks when all are out. Buffers come from a process-wide free list per
// size so that many short PutKeys do not each allocate megabytes.
//
// With a BufferBudget (PutOptions.BufferBudget) the pool also draws on
// the budget: admit reserves its first reserve buffers (blocking, before
// any data is read), and each buffer beyond them is taken from the budget
// as data arrives (tryGet) and given back when released. A writer whose
// tryGet fails commits what it holds (so its own buffers come back) and
// then waits in get; since its reserve is its own, it always progresses.
type bufPool struct {
	size  int
	slots chan struct{}
	out   atomic.Int64 // buffers handed out (for tests and assertions)
	free  *sync.Pool

	budget   *BufferBudget
	reserve  int // buffers reserved from budget by admit
	mu       sync.Mutex
	admitted bool
	closed   bool
	extra    int // buffers out beyond the reserve (taken from budget)
	held     int // buffers out
}

var freeLists sync.Map // size → *sync.Pool

func newBufPool(size, count int) *bufPool {
	fl, _ := freeLists.LoadOrStore(size, &sync.Pool{New: func() any { b := make([]byte, size); return &b }})
	return &bufPool{size: size, slots: make(chan struct{}, count), free: fl.(*sync.Pool)}
}

// minReserveBuffers is what a pool with a budget reserves at admission (or
// its capacity, if smaller).
const minReserveBuffers = 2

// admit makes the pool draw on budget (nil: none), reserving its first
// buffers; it waits for the budget, or until ctx is done.
func (p *bufPool) admit(ctx context.Context, budget *BufferBudget) error {
	if budget == nil {
		return nil
	}
	n := min(minReserveBuffers, cap(p.slots))
	if err := budget.acquire(ctx, int64(n*p.size)); err != nil {
		return err
	}
	p.mu.Lock()
	p.budget, p.reserve, p.admitted = budget, n, true
	p.mu.Unlock()
	return nil
}

// close gives the reserve back to the budget once every buffer is back.
func (p *bufPool) close() {
	p.mu.Lock()
	p.closed = true
	p.settle()
	p.mu.Unlock()
}

// settle releases the reserve of a closed pool with nothing out (p.mu
// held).
func (p *bufPool) settle() {
	if p.closed && p.admitted && p.held == 0 {
		p.admitted = false
		p.budget.release(int64(p.reserve * p.size))
	}
}

// buffer is a pooled byte slice shared by the chunks cut from it; it goes
// back to the pool when the last of them is committed.
type buffer struct {
	pool *bufPool
	data []byte
	refs atomic.Int32
}

// errNoBuffer: tryGet found the pool at its cap; errBudgetFull: the
// shared budget had no room (beyond the pool's reserve).
var (
	errNoBuffer   = errors.New("no write buffer free")
	errBudgetFull = errors.New("the write buffer budget is spent")
)

// take accounts for a buffer about to be handed out, against the reserve
// or the budget; false if neither has room (p.mu held).
func (p *bufPool) take() bool {
	if p.budget == nil || p.held < p.reserve {
		p.held++
		return true
	}
	if !p.budget.tryAcquire(int64(p.size)) {
		return false
	}
	p.held++
	p.extra++
	return true
}

// tryGet is get without waiting: errNoBuffer if the pool is at its cap,
// errBudgetFull if the budget has no room now.
func (p *bufPool) tryGet() (*buffer, error) {
	select {
	case p.slots <- struct{}{}:
	default:
		return nil, errNoBuffer
	}
	p.mu.Lock()
	ok := p.take()
	p.mu.Unlock()
	if !ok {
		<-p.slots
		return nil, errBudgetFull
	}
	return p.hand(), nil
}

func (p *bufPool) hand() *buffer {
	p.out.Add(1)
	if p.budget != nil {
		p.budget.hold(int64(p.size))
	}
	b := &buffer{pool: p, data: (*p.free.Get().(*[]byte))[:p.size]}
	b.refs.Store(1)
	return b
}

// get waits for a free slot (and room in the budget), or until ctx is
// done or stop is closed (the writer's pipeline failed and will not
// release buffers by itself).
func (p *bufPool) get(ctx context.Context, stop <-chan struct{}) (*buffer, error) {
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-stop:
		return nil, errPipelineFailed
	}
	for {
		p.mu.Lock()
		var wake <-chan struct{}
		if p.budget != nil {
			// Before trying: a release after this point closes wake.
			wake = p.budget.wakeup()
		}
		ok := p.take()
		p.mu.Unlock()
		if ok {
			return p.hand(), nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			<-p.slots
			return nil, ctx.Err()
		case <-stop:
			<-p.slots
			return nil, errPipelineFailed
		}
	}
}

func (b *buffer) ref() { b.refs.Add(1) }

func (b *buffer) unref() {
	switch n := b.refs.Add(-1); {
	case n == 0:
		p := b.pool
		d := b.data[:cap(b.data)]
		b.data = nil
		p.free.Put(&d)
		p.out.Add(-1)
		if p.budget != nil {
			p.budget.hold(-int64(p.size))
		}
		p.mu.Lock()
		p.held--
		switch {
		case p.extra > 0:
			p.extra--
			p.budget.release(int64(p.size))
		case p.budget != nil:
			p.budget.notify() // a reserved buffer is free: wake this pool's get
		}
		p.settle()
		p.mu.Unlock()
		<-p.slots
	case n < 0:
		panic("client: buffer released twice")
	}
}

// BufferBudget is a byte budget shared by the write buffers of many
// PutKeys (PutOptions.BufferBudget): an S3 gateway's uploads together
// hold at most its limit in buffers, whatever each may hold alone
// (Config.MaxBufferBytes). Each PutKey reserves two chunk buffers of it
// when it starts (waiting for them if need be) and takes more as data
// arrives while there is room; with none, it commits what it holds and
// goes on with its own buffers. The limit must hold at least two chunks.
type BufferBudget struct {
	mu      sync.Mutex
	limit   int64
	used    int64
	peak    int64
	waiters int // admissions waiting: extra buffers yield to them
	wake    chan struct{}
	// held and peakHeld: the bytes of the buffers actually handed out
	// (at most used: a reserve need not be in use).
	held, peakHeld int64
}

func (b *BufferBudget) hold(n int64) {
	b.mu.Lock()
	b.held += n
	b.peakHeld = max(b.peakHeld, b.held)
	b.mu.Unlock()
}

// NewBufferBudget returns a budget of limit bytes.
func NewBufferBudget(limit int64) *BufferBudget {
	return &BufferBudget{limit: limit, wake: make(chan struct{})}
}

// Used is the bytes taken from the budget now (reserves included); Peak
// the most ever taken; Limit the limit.
func (b *BufferBudget) Used() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used
}

func (b *BufferBudget) Peak() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.peak
}

func (b *BufferBudget) Limit() int64 { return b.limit }

func (b *BufferBudget) tryAcquire(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.waiters > 0 || b.used+n > b.limit {
		return false
	}
	b.used += n
	b.peak = max(b.peak, b.used)
	return true
}

// acquire waits until n bytes are free.
func (b *BufferBudget) acquire(ctx context.Context, n int64) error {
	if n > b.limit {
		return fmt.Errorf("%w: %d bytes of write buffers wanted, the budget is %d", ErrLimit, n, b.limit)
	}
	b.mu.Lock()
	b.waiters++
	defer func() {
		b.mu.Lock()
		b.waiters--
		b.mu.Unlock()
	}()
	for {
		if b.used+n <= b.limit {
			b.used += n
			b.peak = max(b.peak, b.used)
			b.mu.Unlock()
			return nil
		}
		wake := b.wake
		b.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
		b.mu.Lock()
	}
}

func (b *BufferBudget) release(n int64) {
	b.mu.Lock()
	b.used -= n
	if b.used < 0 {
		panic("client: buffer budget released twice")
	}
	close(b.wake)
	b.wake = make(chan struct{})
	b.mu.Unlock()
}

// notify wakes every waiter (a pool's own buffer came back).
func (b *BufferBudget) notify() {
	b.mu.Lock()
	close(b.wake)
	b.wake = make(chan struct{})
	b.mu.Unlock()
}

func (b *BufferBudget) wakeup() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.wake
}
