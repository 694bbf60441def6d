package raft

import (
	"fmt"
	"testing"
	"testing/cryptotest"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// A replica that installs a snapshot acknowledges it (the append response
// makes the leader count it at the snapshot's index), so the snapshot must
// be durable in its log store before that response leaves: etcd raft's
// Ready.MustSync does not cover a Ready that carries only a snapshot.
// Before the fix a crash right after the install lost it, and on restart
// etcd raft found the leader's commit beyond the replica's last index
// ("tocommit(N) is out of range"; the simulator's defect D2).
func TestInstalledSnapshotIsSyncedBeforeAck(t *testing.T) {
	cryptotest.SetGlobalRandom(t, 7)
	net := &fifoNet{hosts: map[uint64]*Host{}}
	crashable := vfs.NewCrashableMem()
	for id := uint64(1); id <= 3; id++ {
		fs := newMemFS()
		if id == 3 {
			fs = crashable
		}
		h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log"}, FS: fs, Transport: &fifoTransport{net: net, id: id},
			Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 4, CompactKeep: 1, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &kvSM{}}); err != nil {
			t.Fatal(err)
		}
	}
	quiesce := func(ids ...uint64) {
		for range 1000 {
			did := false
			for _, id := range ids {
				for net.hosts[id].Poll() {
					did = true
				}
			}
			if !net.deliver() && !did {
				return
			}
		}
		t.Fatal("no quiescence")
	}
	g := func(id uint64) *Group { gr, _ := net.hosts[id].Group(1); return gr }
	g(1).Campaign()
	quiesce(1, 2, 3)
	if !g(1).IsLeader() {
		t.Fatal("host 1 did not become the leader")
	}
	// Host 3 is cut off while hosts 1 and 2 commit and truncate, so it
	// can only catch up by a snapshot.
	net.down = 3
	for range 30 { // long enough for the leader to see host 3 inactive
		net.hosts[1].Tick()
		net.hosts[2].Tick()
		quiesce(1, 2)
	}
	for i := range 20 {
		if err := g(1).ProposeAsync([]byte(fmt.Sprintf("v%d", i)), nil, func(_ Result, err error) {
			if err != nil {
				t.Errorf("proposal %d: %v", i, err)
			}
		}); err != nil {
			t.Fatal(err)
		}
		quiesce(1, 2)
	}
	net.down = 0
	for round := 0; round < 200 && testCounter(net.hosts[3].metrics.snapshotsReceived) == 0; round++ {
		for id := uint64(1); id <= 3; id++ {
			net.hosts[id].Tick()
		}
		quiesce(1, 2, 3)
	}
	if testCounter(net.hosts[3].metrics.snapshotsReceived) == 0 {
		t.Fatal("host 3 received no snapshot: the test does not test what it says")
	}
	acked := g(3).Status().Applied
	// Power loss now: only what host 3 synced survives.
	after := crashable.CrashClone(vfs.CrashCloneCfg{})
	ls, err := openLogStore("/log", after)
	if err != nil {
		t.Fatal(err)
	}
	defer ls.close()
	gl, err := ls.load(1)
	if err != nil {
		t.Fatal(err)
	}
	if gl.last < acked || gl.truncIndex < acked {
		t.Fatalf("after a crash host 3's log ends at %d (snapshot at %d), but it had installed and acknowledged index %d",
			gl.last, gl.truncIndex, acked)
	}
}
