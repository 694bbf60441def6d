package raft

import (
	"context"
	"errors"
	"testing"
	"time"

	bvfs "github.com/basalt-store/basalt/internal/vfs"
)

// TestLogDiskFull: below LogReserveBytes, CheckLogSpace refuses while the
// group still commits (Pebble keeps its reserve, no fatal ENOSPC); a host
// restarted on a disk filled to the last byte removes the ballast and comes
// up instead of hanging in Pebble's open.
func TestLogDiskFull(t *testing.T) {
	fs := bvfs.NewMem(bvfs.MemOptions{Capacity: 64 << 20})
	cfg := HostConfig{ID: 1, LogDirs: []string{"/raft"}, FS: fs, TickInterval: 2 * time.Millisecond,
		LogReserveBytes: 4 << 20, LogBallastBytes: 4 << 20, Logger: testLogger()}
	net := NewMemNetwork(1)
	cfg.Transport = net.Transport(1)
	h, err := NewHost(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sm := &kvSM{}
	g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: sm})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	propose := func(v string) error {
		for {
			_, err := g.Propose(ctx, []byte(v), nil)
			if errors.Is(err, ErrNotLeader) || errors.Is(err, ErrProposalDropped) {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			return err
		}
	}
	if err := propose("a"); err != nil {
		t.Fatal(err)
	}
	if err := g.CheckLogSpace(1 << 20); err != nil {
		t.Fatalf("CheckLogSpace on an empty disk: %v", err)
	}
	// Another user fills the disk up to the reserve.
	fs.SetCapacity(fs.Used() + 2<<20)
	h.loops[0].store.space.Refresh()
	if err := g.CheckLogSpace(1); !errors.Is(err, ErrLogDiskFull) {
		t.Fatalf("CheckLogSpace below the reserve = %v, want ErrLogDiskFull", err)
	}
	// What is already in flight still commits: Pebble has its reserve.
	if err := propose("b"); err != nil {
		t.Fatal(err)
	}
	h.Close()

	// Restart on a disk with no byte left.
	crashed := fs.Crash()
	crashed.SetCapacity(crashed.Used())
	cfg.FS = crashed
	cfg.Transport = NewMemNetwork(1).Transport(1)
	done := make(chan error, 1)
	go func() {
		h2, err := NewHost(cfg)
		if err == nil {
			h = h2
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("NewHost on a full disk still blocked after 30s")
	}
	defer h.Close()
	if h.loops[0].store.space.HasBallast() {
		t.Fatal("ballast kept on a full disk")
	}
	sm2 := &kvSM{}
	g, err = h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: sm2})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.CheckLogSpace(1); !errors.Is(err, ErrLogDiskFull) {
		t.Fatalf("CheckLogSpace after a full restart = %v, want ErrLogDiskFull", err)
	}
}
