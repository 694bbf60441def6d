package raft

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestSharedReadBarriersLinearizable: reads on every replica, concurrent
// with writes and with the leader isolated midway, each see every write
// that completed before they began: a read that joined a barrier already
// in flight (confirmed, perhaps, before the write) would not.
func TestSharedReadBarriersLinearizable(t *testing.T) {
	c := newMemCluster(t, 3, 7, 1)
	lead := c.waitLeader(1)
	var done atomic.Uint64 // highest index whose Propose returned
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var bad atomic.Value
	var okReads, failReads, writes atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			wrote := false
			for _, id := range c.ids {
				g := c.group(id, 1)
				if !g.IsLeader() {
					continue
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				res, err := g.Propose(ctx, []byte(fmt.Sprint("v", i)), nil)
				cancel()
				if err != nil {
					continue
				}
				wrote = true
				writes.Add(1)
				for {
					o := done.Load()
					if res.Index <= o || done.CompareAndSwap(o, res.Index) {
						break
					}
				}
			}
			if !wrote {
				time.Sleep(time.Millisecond) // no leader: election
			}
		}
	}()
	for r := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			host := c.ids[r%3]
			g := c.group(host, 1)
			for {
				select {
				case <-stop:
					return
				default:
				}
				w := done.Load()
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				err := g.ReadIndex(ctx)
				cancel()
				if err != nil {
					failReads.Add(1)
					time.Sleep(time.Millisecond)
					continue
				}
				okReads.Add(1)
				if a := g.Status().Applied; a < w {
					bad.Store(fmt.Sprintf("host %d: read began after index %d completed, returned with applied %d", host, w, a))
				}
			}
		}()
	}
	// Phases bounded by time, each long enough to see reads and writes
	// even on a loaded machine.
	waitProgress := func(what string, d time.Duration) {
		r0, w0 := okReads.Load(), writes.Load()
		end := time.Now().Add(d)
		for time.Now().Before(end) || okReads.Load() < r0+100 || writes.Load() < w0+10 {
			if time.Now().After(end.Add(10 * time.Second)) {
				close(stop)
				wg.Wait()
				t.Fatalf("%s: no progress (reads %d, writes %d)", what, okReads.Load()-r0, writes.Load()-w0)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitProgress("before isolation", time.Second)
	c.net.Isolate(lead)
	time.Sleep(1500 * time.Millisecond)
	c.net.Heal()
	waitProgress("after healing", time.Second)
	close(stop)
	wg.Wait()
	t.Logf("reads ok %d failed %d, writes %d to index %d, barriers %d", okReads.Load(), failReads.Load(), writes.Load(), done.Load(),
		c.group(1, 1).ReadBarriers()+c.group(2, 1).ReadBarriers()+c.group(3, 1).ReadBarriers())
	if b := bad.Load(); b != nil {
		t.Fatal(b)
	}
}

// TestReadIndexOutlivesBarrierTimeout: a barrier that gets no answer in
// its time (a follower cut off from the leader) does not fail its reads
// with a deadline of its own: they go on to the next barrier while their
// context allows, and succeed once the follower hears the leader again.
func TestReadIndexOutlivesBarrierTimeout(t *testing.T) {
	c := newMemCluster(t, 3, 13, 1)
	lead := c.waitLeader(1)
	var f uint64
	for _, id := range c.ids {
		if id != lead {
			f = id
			break
		}
	}
	g := c.group(f, 1)
	idx := c.propose(1, "a")
	c.net.Partition([]uint64{f}, []uint64{lead})
	b0 := g.ReadBarriers()
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		errc <- g.ReadIndex(ctx)
	}()
	// The first barrier goes unanswered and times out (after 1s here);
	// heal once the read is on its next one.
	end := time.Now().Add(20 * time.Second)
	for g.ReadBarriers() < b0+2 {
		if time.Now().After(end) {
			t.Fatalf("the read sent no second barrier (barriers %d)", g.ReadBarriers()-b0)
		}
		select {
		case err := <-errc:
			if errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("the read failed with its barrier's timeout: %v", err)
			}
			if err == nil {
				// Under load the third member can miss the leader long
				// enough to vote for the cut-off follower, which then
				// leads and answers its own read: Raft, not a bug.
				t.Logf("the read succeeded before healing (leader now %d)", c.waitLeader(1))
				return
			}
			var nle *NotLeaderError
			if !errors.As(err, &nle) {
				t.Fatalf("the read returned %v before the follower heard the leader again", err)
			}
			return // it knew no leader: a retryable NotLeaderError
		case <-time.After(10 * time.Millisecond):
		}
	}
	c.net.Heal()
	select {
	case err := <-errc:
		var nle *NotLeaderError
		switch {
		case err == nil:
		case errors.As(err, &nle):
			// The cut-off follower may have lost its leader (its election
			// timer ran out; pre-vote keeps it from disrupting) in the
			// moment the read moved to its next barrier: a retryable
			// NotLeaderError is an answer, a barrier's deadline is not.
			// Once it hears the leader again, a read succeeds.
			t.Logf("read while the follower knew no leader: %v", err)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			for {
				err := g.ReadIndex(ctx)
				if err == nil {
					break
				}
				if !errors.As(err, &nle) {
					t.Fatalf("read after healing: %v", err)
				}
				time.Sleep(20 * time.Millisecond)
			}
		default:
			t.Fatalf("read after healing: %v", err)
		}
	case <-time.After(25 * time.Second):
		t.Fatal("the read did not return")
	}
	if a := g.Status().Applied; a < idx {
		t.Fatalf("applied %d < %d", a, idx)
	}
}
