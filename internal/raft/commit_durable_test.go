package raft

import (
	"testing"
	"testing/cryptotest"

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
