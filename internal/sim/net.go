package sim

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/raft"
)

// NetConfig is how hostile the simulated network is. The simulator varies
// it per seed.
type NetConfig struct {
	MinDelay, MaxDelay time.Duration // each message's latency, uniform (so messages reorder)
	Drop               float64       // probability a message is lost
	Duplicate          float64       // probability a message arrives twice
	// MaxSnapshotBytes bounds a snapshot held in flight.
	MaxSnapshotBytes int
}

// network is the simulated network: raft.Transport for every host, with
// every message's fate (lost, late, twice) drawn from the seed and its
// delivery an event on the simulator's clock. A partition cuts links both
// ways until healed. A message to a host that is down, or that restarted
// since the message was sent, is lost.
type network struct {
	clk *clock
	rng *rand.Rand
	cfg NetConfig

	handlers map[uint64]raft.Handler // hosts up now
	epoch    map[uint64]int          // incarnation of each host
	cut      map[[2]uint64]bool

	sent, dropped, duplicated, delivered int
	trace                                func(string)
}

func newNetwork(clk *clock, rng *rand.Rand, cfg NetConfig) *network {
	if cfg.MaxSnapshotBytes <= 0 {
		cfg.MaxSnapshotBytes = 64 << 20
	}
	return &network{clk: clk, rng: rng, cfg: cfg, handlers: map[uint64]raft.Handler{},
		epoch: map[uint64]int{}, cut: map[[2]uint64]bool{}, trace: func(string) {}}
}

// transport returns the raft.Transport of host id.
func (n *network) transport(id uint64) raft.Transport { return &simTransport{net: n, id: id} }

// down takes host id off the network: what is in flight to it is lost.
func (n *network) down(id uint64) {
	delete(n.handlers, id)
	n.epoch[id]++
}

// partition cuts every link between a host of a and one of b.
func (n *network) partition(a, b []uint64) {
	for _, x := range a {
		for _, y := range b {
			n.cut[[2]uint64{x, y}] = true
			n.cut[[2]uint64{y, x}] = true
		}
	}
}

func (n *network) heal() { n.cut = map[[2]uint64]bool{} }

// route decides one message's fate: its delays (none: lost; two:
// duplicated).
func (n *network) route(from, to uint64) []time.Duration {
	n.sent++
	if n.cut[[2]uint64{from, to}] || n.handlers[to] == nil {
		n.dropped++
		return nil
	}
	if chance(n.rng, n.cfg.Drop) {
		n.dropped++
		return nil
	}
	delay := func() time.Duration {
		d := n.cfg.MinDelay
		if span := n.cfg.MaxDelay - n.cfg.MinDelay; span > 0 {
			d += time.Duration(n.rng.Int64N(int64(span)))
		}
		return d
	}
	ds := []time.Duration{delay()}
	if chance(n.rng, n.cfg.Duplicate) {
		n.duplicated++
		ds = append(ds, delay())
	}
	return ds
}

// deliver schedules fn on host to after d, unless to went down meanwhile.
func (n *network) deliver(to uint64, d time.Duration, what string, fn func(h raft.Handler)) {
	ep := n.epoch[to]
	n.clk.after(d, what, func() {
		h := n.handlers[to]
		if h == nil || n.epoch[to] != ep {
			n.dropped++
			return
		}
		n.delivered++
		fn(h)
	})
}

type simTransport struct {
	net *network
	id  uint64
}

func (t *simTransport) Start(h raft.Handler) error {
	t.net.handlers[t.id] = h
	return nil
}

func (t *simTransport) Addr() string { return fmt.Sprintf("sim:%d", t.id) }

func (t *simTransport) Close() error {
	if t.net.handlers[t.id] != nil {
		t.net.down(t.id)
	}
	return nil
}

// Send copies each message as the wire would (the sender may reuse
// nothing) and schedules its deliveries. Messages of one Send to one
// host travel separately, so they may reorder.
func (t *simTransport) Send(to uint64, msgs []raft.Outgoing) {
	for _, o := range msgs {
		ds := t.net.route(t.id, to)
		if len(ds) == 0 {
			continue
		}
		c, ok := materialize(o)
		if !ok {
			continue
		}
		from := t.id
		what := fmt.Sprintf("msg %d->%d g%d %v", from, to, o.Group, msgType(c))
		for _, d := range ds {
			m := c
			if len(ds) > 1 {
				m, _ = materialize(c) // each copy its own
			}
			t.net.deliver(to, d, what, func(h raft.Handler) { h.HandleMessages(from, []raft.Outgoing{m}) })
		}
	}
}

func msgType(o raft.Outgoing) string {
	if o.Msg == nil {
		return "applied"
	}
	return o.Msg.GetType().String()
}

// SendSnapshot reads the whole snapshot now (on the simulator's
// goroutine) and delivers it later like a message; a lost one fails here,
// as a broken connection would.
func (t *simTransport) SendSnapshot(_ context.Context, to, group uint64, m *pb.Message, body io.Reader) error {
	ds := t.net.route(t.id, to)
	if len(ds) == 0 {
		return fmt.Errorf("sim: snapshot of group %d from %d to %d lost", group, t.id, to)
	}
	b, err := io.ReadAll(io.LimitReader(body, int64(t.net.cfg.MaxSnapshotBytes)+1))
	if err != nil {
		return err
	}
	if len(b) > t.net.cfg.MaxSnapshotBytes {
		return fmt.Errorf("sim: snapshot of group %d over %d bytes", group, t.net.cfg.MaxSnapshotBytes)
	}
	mc, err := cloneMsg(m)
	if err != nil {
		return err
	}
	from := t.id
	t.net.deliver(to, ds[0], fmt.Sprintf("snap %d->%d g%d", from, to, group), func(h raft.Handler) {
		if err := h.HandleSnapshot(from, group, mc, bytes.NewReader(b)); err != nil {
			t.net.trace(fmt.Sprintf("snapshot %d->%d g%d refused: %v", from, to, group, err))
		}
	})
	return nil
}

// QueueSnapshot (raft.SnapshotSender, manual mode) delivers a whole
// snapshot like a message and reports the receiver's answer back to the
// sender after the return trip; a lost one is reported lost.
func (t *simTransport) QueueSnapshot(to, group uint64, m *pb.Message, data []byte, done func(error)) {
	from := t.id
	ds := t.net.route(from, to)
	if len(ds) == 0 {
		t.net.clk.after(t.net.cfg.MaxDelay, fmt.Sprintf("snap %d->%d g%d lost", from, to, group), func() {
			done(fmt.Errorf("sim: snapshot of group %d from %d to %d lost", group, from, to))
		})
		return
	}
	mc, err := cloneMsg(m)
	if err != nil {
		done(err)
		return
	}
	b := append([]byte(nil), data...)
	ep := t.net.epoch[to]
	t.net.clk.after(ds[0], fmt.Sprintf("snap %d->%d g%d at %d (%d bytes)", from, to, group, m.GetSnapshot().GetMetadata().GetIndex(), len(b)), func() {
		h := t.net.handlers[to]
		var err error
		if h == nil || t.net.epoch[to] != ep {
			err = fmt.Errorf("sim: host %d down", to)
		} else {
			err = h.HandleSnapshot(from, group, mc, bytes.NewReader(b))
		}
		if err != nil {
			t.net.trace(fmt.Sprintf("snapshot %d->%d g%d refused: %v", from, to, group, err))
		}
		t.net.clk.after(ds[0], "", func() { done(err) })
	})
}

// cloneMsg copies a message through its wire encoding.
func cloneMsg(m *pb.Message) (*pb.Message, error) {
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	c := &pb.Message{}
	if err := proto.Unmarshal(b, c); err != nil {
		return nil, err
	}
	return c, nil
}

// partitionSides splits ids (sorted) into two non-empty random sides.
func partitionSides(r *rand.Rand, ids []uint64) (a, b []uint64) {
	ids = append([]uint64(nil), ids...)
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	k := 1 + r.IntN(len(ids)-1)
	return ids[:k], ids[k:]
}
