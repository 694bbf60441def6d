package raft

import (
	"context"
	"fmt"
	"io"
	"math/rand"
	"sync"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// MemNetwork is an in-memory network for tests: it connects hosts in one
// process and can drop, delay (and so reorder) and partition their traffic,
// with a seeded random source so a failing schedule can be replayed.
type MemNetwork struct {
	mu       sync.Mutex
	rnd      *rand.Rand
	hosts    map[uint64]*memTransport
	blocked  map[[2]uint64]bool
	dropRate float64
	minDelay time.Duration
	maxDelay time.Duration
}

// NewMemNetwork makes an empty network.
func NewMemNetwork(seed int64) *MemNetwork {
	return &MemNetwork{rnd: rand.New(rand.NewSource(seed)), hosts: make(map[uint64]*memTransport), blocked: make(map[[2]uint64]bool)}
}

// Transport returns the transport for host id (pass it in HostConfig).
func (n *MemNetwork) Transport(id uint64) Transport {
	return &memTransport{net: n, id: id, stopc: make(chan struct{})}
}

// SetDropRate drops each message with probability p.
func (n *MemNetwork) SetDropRate(p float64) {
	n.mu.Lock()
	n.dropRate = p
	n.mu.Unlock()
}

// SetDelay delays each message by a random duration in [lo, hi]; messages
// with different delays arrive out of order.
func (n *MemNetwork) SetDelay(lo, hi time.Duration) {
	n.mu.Lock()
	n.minDelay, n.maxDelay = lo, hi
	n.mu.Unlock()
}

// Partition cuts every link between the hosts in a and those in b.
func (n *MemNetwork) Partition(a, b []uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, x := range a {
		for _, y := range b {
			n.blocked[[2]uint64{x, y}] = true
			n.blocked[[2]uint64{y, x}] = true
		}
	}
}

// Isolate cuts host id from every other host.
func (n *MemNetwork) Isolate(id uint64) {
	n.mu.Lock()
	var others []uint64
	for h := range n.hosts {
		if h != id {
			others = append(others, h)
		}
	}
	n.mu.Unlock()
	n.Partition([]uint64{id}, others)
}

// Heal removes all partitions.
func (n *MemNetwork) Heal() {
	n.mu.Lock()
	n.blocked = make(map[[2]uint64]bool)
	n.mu.Unlock()
}

// route decides the fate of one message: deliver after delay, or drop.
func (n *MemNetwork) route(from, to uint64) (*memTransport, time.Duration, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	dst, ok := n.hosts[to]
	if !ok || n.blocked[[2]uint64{from, to}] {
		return nil, 0, false
	}
	if n.dropRate > 0 && n.rnd.Float64() < n.dropRate {
		return nil, 0, false
	}
	d := n.minDelay
	if n.maxDelay > n.minDelay {
		d += time.Duration(n.rnd.Int63n(int64(n.maxDelay - n.minDelay)))
	}
	return dst, d, true
}

type memTransport struct {
	net   *MemNetwork
	id    uint64
	h     Handler
	stopc chan struct{}
	once  sync.Once

	mu    sync.Mutex
	inbox []memDelivery
	wake  chan struct{}
}

type memDelivery struct {
	from uint64
	msgs []Outgoing
}

func (t *memTransport) Start(h Handler) error {
	t.h = h
	t.wake = make(chan struct{}, 1)
	t.net.mu.Lock()
	t.net.hosts[t.id] = t
	t.net.mu.Unlock()
	go t.deliverLoop()
	return nil
}

func (t *memTransport) Addr() string { return fmt.Sprintf("mem:%d", t.id) }

func (t *memTransport) Close() error {
	t.once.Do(func() {
		t.net.mu.Lock()
		if t.net.hosts[t.id] == t {
			delete(t.net.hosts, t.id)
		}
		t.net.mu.Unlock()
		close(t.stopc)
	})
	return nil
}

// Send copies each message (as a real network would) and routes it.
func (t *memTransport) Send(to uint64, msgs []Outgoing) {
	for _, o := range msgs {
		dst, d, ok := t.net.route(t.id, to)
		if !ok {
			continue
		}
		c := o.Materialize()
		if d == 0 {
			dst.push(t.id, []Outgoing{c})
			continue
		}
		from := t.id
		time.AfterFunc(d, func() { dst.push(from, []Outgoing{c}) })
	}
}

func (t *memTransport) push(from uint64, msgs []Outgoing) {
	t.mu.Lock()
	t.inbox = append(t.inbox, memDelivery{from, msgs})
	t.mu.Unlock()
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

func (t *memTransport) deliverLoop() {
	for {
		select {
		case <-t.stopc:
			return
		case <-t.wake:
		}
		for {
			t.mu.Lock()
			box := t.inbox
			t.inbox = nil
			t.mu.Unlock()
			if len(box) == 0 {
				break
			}
			for _, d := range box {
				select {
				case <-t.stopc:
					return
				default:
				}
				t.h.HandleMessages(d.from, d.msgs)
			}
		}
	}
}

func (t *memTransport) SendSnapshot(ctx context.Context, to, group uint64, m *pb.Message, body io.Reader) error {
	dst, _, ok := t.net.route(t.id, to)
	if !ok {
		return fmt.Errorf("memnet: host %d unreachable from %d", to, t.id)
	}
	return dst.h.HandleSnapshot(t.id, group, cloneMessage(m), body)
}
