package raft

import (
	"fmt"
	"testing"

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
	crashable := vfs.NewCrashableMem()
	m := newManualTrio(t, 7, func(id uint64) vfs.FS {
		if id == 3 {
			return crashable
		}
		return nil
	}, 4, 1)
	net, quiesce, g := m.net, m.quiesce, m.g
	m.lead()
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
