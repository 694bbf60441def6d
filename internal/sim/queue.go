package sim

import (
	"container/heap"
	"time"
)

// event is something the simulator does at a simulated instant. Events at
// the same instant run in the order they were scheduled (seq), so the run
// depends on the seed alone.
type event struct {
	at   time.Duration
	seq  uint64
	what string // for the trace
	fn   func()
}

type eventQueue []*event

func (q eventQueue) Len() int { return len(q) }
func (q eventQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q eventQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *eventQueue) Push(x any)   { *q = append(*q, x.(*event)) }
func (q *eventQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	return e
}

// clock is the simulated time and the queue of what happens next. Nothing
// in the simulator reads the wall clock.
type clock struct {
	now time.Duration
	seq uint64
	q   eventQueue
}

// at schedules fn after d (at least now: events never run in the past).
func (c *clock) after(d time.Duration, what string, fn func()) {
	if d < 0 {
		d = 0
	}
	c.seq++
	heap.Push(&c.q, &event{at: c.now + d, seq: c.seq, what: what, fn: fn})
}

// next pops the earliest event and advances the clock to it.
func (c *clock) next() (*event, bool) {
	if len(c.q) == 0 {
		return nil, false
	}
	e := heap.Pop(&c.q).(*event)
	if e.at > c.now {
		c.now = e.at
	}
	return e, true
}

// advance moves time forward by d without running anything: simulated I/O
// latency is charged here, and the events it passes run late, in order.
func (c *clock) advance(d time.Duration) {
	if d > 0 {
		c.now += d
	}
}
