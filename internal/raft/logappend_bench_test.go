package raft

import (
	"fmt"
	"testing"
)

// BenchmarkLogAppend measures the log append path of one store loop per
// entry, without network or disk: a Manual host, one single-voter group,
// an in-memory FS (its fsync is free, so the per-call cost of the store's
// guards, logfatal.go, is as visible as it can be). Each iteration
// proposes one entry (64-byte metadata) and polls until it is applied:
// Ready taken, the batch (entry + HardState) committed with sync, Advance,
// apply.
func BenchmarkLogAppend(b *testing.B) {
	net := &fifoNet{hosts: map[uint64]*Host{}}
	h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/log"}, FS: newMemFS(), Transport: &fifoTransport{net: net, id: 1},
		Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 1024, CompactKeep: 64, Logger: testLogger()})
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: &benchNullSM{}})
	if err != nil {
		b.Fatal(err)
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
		b.Fatal("never the leader")
	}
	for h.Poll() {
	}
	meta := []byte(fmt.Sprintf("%064d", 0))
	var failed error
	done := func(_ Result, err error) {
		if err != nil {
			failed = err
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if err := g.ProposeAsync(meta, nil, done); err != nil {
			b.Fatal(err)
		}
		for h.Poll() {
		}
	}
	b.StopTimer()
	if failed != nil {
		b.Fatal(failed)
	}
}

// benchNullSM applies by counting.
type benchNullSM struct{ kvSM }

func (s *benchNullSM) Apply(ents []Entry) []any {
	s.mu.Lock()
	s.applied = ents[len(ents)-1].Index
	s.mu.Unlock()
	return make([]any, len(ents))
}
