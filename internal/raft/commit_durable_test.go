package raft

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/cryptotest"
	"time"

	bvfs "github.com/basalt-store/basalt/internal/vfs"
)

// TestLoneReplicaReplaysApplied: a follower applies an entry it learned was
// committed from a later message (so the leader's wait-for-all counts it),
// loses power, and restarts without its peers. It must apply the entry
// again from its own log: the commit index that let Apply see the entry
// was synced before Apply ran (state machines make applied effects
// durable through this replay). Fails if the store loop syncs only when
// etcd raft's MustSync says so (it ignores the commit index).
func TestLoneReplicaReplaysApplied(t *testing.T) {
	cryptotest.SetGlobalRandom(t, 3)
	net := &fifoNet{hosts: map[uint64]*Host{}}
	fss := map[uint64]*bvfs.MemFS{}
	sms := map[uint64]*lagSM{}
	hosts := map[uint64]*Host{}
	for id := uint64(1); id <= 3; id++ {
		fss[id] = bvfs.NewMem(bvfs.MemOptions{})
		h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log"}, FS: fss[id], Transport: &fifoTransport{net: net, id: id},
			Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 1 << 20, CompactKeep: 4, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		hosts[id] = h
		sms[id] = &lagSM{}
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[id]}); err != nil {
			t.Fatal(err)
		}
	}
	quiesce := func() {
		for range 1000 {
			did := false
			for _, h := range hosts {
				for h.Poll() {
					did = true
				}
			}
			if !net.deliver() && !did {
				return
			}
		}
	}
	var lead *Group
	for range 500 {
		for _, h := range hosts {
			h.Tick()
		}
		quiesce()
		for _, h := range hosts {
			if g, _ := h.Group(1); g.IsLeader() {
				lead = g
			}
		}
		if lead != nil {
			break
		}
	}
	if lead == nil {
		t.Fatal("no leader")
	}
	quiesce()
	if err := lead.ProposeAsync([]byte("x"), nil, func(Result, error) {}); err != nil {
		t.Fatal(err)
	}
	quiesce()
	for range 3 {
		for _, h := range hosts {
			h.Tick()
		}
		quiesce()
	}
	target := sms[lead.host.id].kvSM.AppliedIndex()
	var f uint64
	for id := uint64(1); id <= 3; id++ {
		t.Logf("host %d applied %d", id, sms[id].kvSM.AppliedIndex())
		if id != lead.host.id {
			f = id
		}
	}
	if sms[f].kvSM.AppliedIndex() < target {
		t.Fatalf("follower %d did not apply %d", f, target)
	}
	img := fss[f].Crash() // power loss on follower f; the other two never come back
	for _, h := range hosts {
		h.Close()
	}
	net2 := &fifoNet{hosts: map[uint64]*Host{}}
	h, err := NewHost(HostConfig{ID: f, LogDirs: []string{"/log"}, FS: img, Transport: &fifoTransport{net: net2, id: f},
		Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 1 << 20, CompactKeep: 4, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	sm := &lagSM{} // durable applied index 0: nothing persisted yet
	g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sm})
	if err != nil {
		t.Fatal(err)
	}
	for range 200 {
		h.Tick()
		for h.Poll() {
		}
		net2.q = nil
	}
	_, last := g.log.bounds()
	t.Logf("restarted follower %d: log last %d, persisted commit %d, re-applied %d (entry %d was applied and acknowledged before the crash)",
		f, last, g.log.hs.GetCommit(), sm.kvSM.AppliedIndex(), target)
	if sm.kvSM.AppliedIndex() < target {
		t.Errorf("lone replica cannot replay entry %d it had applied: its log holds it but its commit index (%d) was not synced", target, g.log.hs.GetCommit())
	}
}

// syncCheckSM records any entry handed to Apply above the commit index
// synced in its group's log.
type syncCheckSM struct {
	kvSM
	g   atomic.Pointer[Group]
	bad atomic.Uint64 // an index applied ahead of the synced commit
}

func (s *syncCheckSM) Apply(ents []Entry) []any {
	if g := s.g.Load(); g != nil && len(ents) > 0 {
		g.log.mu.Lock()
		synced := g.log.syncedCommit
		g.log.mu.Unlock()
		if last := ents[len(ents)-1].Index; last > synced {
			s.bad.CompareAndSwap(0, last)
		}
	}
	return s.kvSM.Apply(ents)
}

// TestApplyWaitsForSyncedCommit: with the store loops running (not Manual),
// no replica hands an entry to its state machine before a commit index at
// or past it is synced in its log, both when proposals come one at a time
// (followers learn each commit from an empty append: the entries wait
// for the loop's own sync) and in bursts (they ride on the next append's
// fsync). Every entry still reaches every replica. Fails if committed
// entries go to Apply as etcd raft hands them out.
func TestApplyWaitsForSyncedCommit(t *testing.T) {
	net := NewMemNetwork(7)
	sms := map[uint64]*syncCheckSM{}
	hosts := map[uint64]*Host{}
	for id := uint64(1); id <= 3; id++ {
		h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log"}, FS: bvfs.NewMem(bvfs.MemOptions{}), Transport: net.Transport(id),
			TickInterval: 2 * time.Millisecond, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 1 << 20, CompactKeep: 8, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		hosts[id] = h
		sms[id] = &syncCheckSM{}
		g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[id]})
		if err != nil {
			t.Fatal(err)
		}
		sms[id].g.Store(g)
	}
	var lead *Group
	for deadline := time.Now().Add(20 * time.Second); lead == nil; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		for _, h := range hosts {
			if g, _ := h.Group(1); g.IsLeader() {
				lead = g
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var want []string
	for i := range 20 { // one at a time
		v := fmt.Sprintf("one-%d", i)
		if _, err := lead.Propose(ctx, []byte(v), nil); err != nil {
			t.Fatal(err)
		}
		want = append(want, v)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for i := range 200 { // bursts
		v := fmt.Sprintf("burst-%d", i)
		want = append(want, v)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := lead.Propose(ctx, []byte(v), nil); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	slices.Sort(want)
	for id, sm := range sms {
		var got []string
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			got = slices.Sorted(slices.Values(sm.values()))
			if slices.Equal(got, want) || time.Now().After(deadline) {
				break
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("host %d applied %d values, want %d", id, len(got), len(want))
		}
		if b := sm.bad.Load(); b != 0 {
			t.Errorf("host %d: entry %d handed to Apply above the commit index synced in its log", id, b)
		}
	}
}
