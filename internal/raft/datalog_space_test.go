package raft

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	bvfs "github.com/basalt-store/basalt/internal/vfs"
)

// TestDataLoggerOffWhenLogDiskLow: with room on the log disk, a
// DataLogger's small data stays in the log (no SyncData before the
// append); once the log disk is below LogReserveBytes (as a follower's can
// be: only the leader checks CheckLogSpace before proposing), the data
// goes to the state machine (WriteData, then SyncData before the append)
// and the log keeps it elided, as before DataLogger. Fails without the
// check (SyncData never called for logged-size data).
func TestDataLoggerOffWhenLogDiskLow(t *testing.T) {
	fs := bvfs.NewMem(bvfs.MemOptions{Capacity: 64 << 20})
	cfg := HostConfig{ID: 1, LogDirs: []string{"/raft"}, FS: fs, TickInterval: 2 * time.Millisecond,
		LogReserveBytes: 4 << 20, Logger: testLogger()}
	cfg.Transport = NewMemNetwork(1).Transport(1)
	h, err := NewHost(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	sm := newLoggedSM()
	g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: sm})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	propose := func(v string, data []byte) uint64 {
		t.Helper()
		for {
			r, err := g.Propose(ctx, []byte(v), data)
			if errors.Is(err, ErrNotLeader) || errors.Is(err, ErrProposalDropped) {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			return r.Index
		}
	}
	syncs := func() int {
		sm.mu3.Lock()
		defer sm.mu3.Unlock()
		return sm.syncs
	}
	data := bytes.Repeat([]byte("d"), 1000)
	propose("a", nil)
	s0 := syncs()
	propose("b", data)
	if n := syncs() - s0; n != 0 {
		t.Fatalf("room on the log disk: %d SyncData calls for data kept in the log, want 0", n)
	}
	// Another user fills the disk down to the reserve.
	fs.SetCapacity(fs.Used() + 2<<20)
	h.loops[0].store.space.Refresh()
	s1 := syncs()
	idx := propose("c", data)
	if n := syncs() - s1; n == 0 {
		t.Fatal("log disk below its reserve: the data stayed in the log (no SyncData); want it in the state machine")
	}
	sm.mu3.Lock()
	got := sm.written[idx]
	sm.mu3.Unlock()
	if !bytes.Equal(got, data) {
		t.Fatalf("entry %d: the state machine holds %d bytes, want its data", idx, len(got))
	}
}
