package raft

import (
	"fmt"
	"sync/atomic"
	"testing"
	"testing/cryptotest"
)

// lagSM is a state machine whose applied entries become durable later (the
// datanode's container state machine: its block commits are synced by the
// persist that moves its durable index): AppliedIndex is what the test
// says is durable, not what Apply saw.
type lagSM struct {
	kvSM
	durable atomic.Uint64
}

func (s *lagSM) AppliedIndex() uint64 { return s.durable.Load() }

// TestCompactionFollowsDurableIndex: the host truncates a group's log only
// up to the state machine's durable applied index (less CompactKeep), never
// up to what Apply saw; after a restart it applies again every entry after
// the durable index, in order, from its own log.
func TestCompactionFollowsDurableIndex(t *testing.T) {
	cryptotest.SetGlobalRandom(t, 5)
	fs := newMemFS()
	net := &fifoNet{hosts: map[uint64]*Host{}}
	const keep = 4
	start := func(durable uint64) (*Host, *Group, *lagSM) {
		h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/log"}, FS: fs, Transport: &fifoTransport{net: net, id: 1},
			Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 16, CompactKeep: keep, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		sm := &lagSM{}
		sm.durable.Store(durable)
		g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: sm})
		if err != nil {
			t.Fatal(err)
		}
		g.Campaign()
		for range 1000 {
			if g.IsLeader() {
				break
			}
			if !h.Poll() {
				h.Tick()
			}
		}
		if !g.IsLeader() {
			t.Fatal("never the leader")
		}
		for h.Poll() {
		}
		return h, g, sm
	}
	propose := func(h *Host, g *Group, sm *lagSM, n int, durable uint64) {
		for i := range n {
			if err := g.ProposeAsync(fmt.Appendf(nil, "v%d", i), nil, func(Result, error) {}); err != nil {
				t.Fatal(err)
			}
			for h.Poll() {
			}
			if first, _ := g.log.bounds(); first-1 > durable-keep {
				t.Fatalf("log truncated through %d with the durable applied index at %d (applied %d): entries a crash would need are gone", first-1, durable, sm.kvSM.AppliedIndex())
			}
		}
	}

	h, g, sm := start(0)
	sm.durable.Store(10)
	propose(h, g, sm, 100, 10)
	if applied := sm.kvSM.AppliedIndex(); applied < 100 {
		t.Fatalf("applied %d, want 100 entries or more", applied)
	}
	// The durable index moves: truncation follows it.
	sm.durable.Store(90)
	propose(h, g, sm, 20, 90)
	if first, _ := g.log.bounds(); first-1 <= 10 {
		t.Fatalf("log still starts at %d after the durable index moved to 90", first)
	}
	last := sm.kvSM.AppliedIndex()
	h.Close()

	// Restart with the durable index at 90: every entry after it is
	// applied again, in order, from the log.
	h, _, sm = start(90)
	defer h.Close()
	sm.mu.Lock()
	at := append([]uint64(nil), sm.at...)
	sm.mu.Unlock()
	if len(at) == 0 || at[0] != 91 {
		t.Fatalf("after the restart the first entry applied is %v, want 91", at[:min(len(at), 1)])
	}
	if got := sm.kvSM.AppliedIndex(); got < last {
		t.Fatalf("after the restart applied %d, want at least %d (every entry after the durable index)", got, last)
	}
}
