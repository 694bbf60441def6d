package raft

import (
	"context"
	"errors"
	"testing"
	"time"
)

func appliedWaiters(g *Group) int {
	g.pmu.Lock()
	defer g.pmu.Unlock()
	return len(g.appliedWaiter)
}

// A WaitApplied that gives up (its context ends, or the group stops)
// leaves no waiter behind: an index never reached must not hold memory
// (and a scan on every apply) for good.
func TestWaitAppliedDropsWaitersThatGiveUp(t *testing.T) {
	c := newTCPCluster(t, 1, 20*time.Millisecond)
	g, err := c.hosts[1].AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: newLoggedSM()})
	if err != nil {
		t.Fatal(err)
	}
	const n = 2000
	for i := 0; i < n; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Microsecond)
		if err := g.WaitApplied(ctx, 1<<62); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("WaitApplied(2^62) = %v, want deadline exceeded", err)
		}
		cancel()
	}
	if left := appliedWaiters(g); left != 0 {
		t.Fatalf("%d of %d timed-out waiters left in the group", left, n)
	}

	// Waiters blocked when the group stops return ErrStopped and are gone.
	errc := make(chan error, 8)
	for i := 0; i < cap(errc); i++ {
		go func() { errc <- g.WaitApplied(context.Background(), 1<<62) }()
	}
	deadline := time.Now().Add(10 * time.Second)
	for appliedWaiters(g) != cap(errc) {
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters registered, want %d", appliedWaiters(g), cap(errc))
		}
		time.Sleep(time.Millisecond)
	}
	if err := c.hosts[1].StopGroup(1); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < cap(errc); i++ {
		select {
		case err := <-errc:
			if !errors.Is(err, ErrStopped) {
				t.Fatalf("WaitApplied after stop = %v, want ErrStopped", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("WaitApplied still blocked 10s after the group stopped")
		}
	}
	if left := appliedWaiters(g); left != 0 {
		t.Fatalf("%d waiters left after the group stopped", left)
	}
	if g.LastIndex() == 0 {
		t.Fatal("LastIndex 0 on a group that elected a leader")
	}
}
