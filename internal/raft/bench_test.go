package raft

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkCommit measures commits per second and commit latency of 4 KiB
// proposals on 3 hosts over loopback TCP with fsync on, for 1, 8 and 64
// groups (leaders spread over the hosts), with `inflight` concurrent
// proposers per group. fsyncs/entry is per host: the fsyncs one host's log
// store issued divided by the entries committed (every host stores every
// entry), so 1.0 means no group commit at all.
func BenchmarkCommit(b *testing.B) {
	for _, inflight := range []int{1, 8} {
		for _, groups := range []int{1, 8, 64} {
			b.Run(fmt.Sprintf("inflight=%d/groups=%d", inflight, groups), func(b *testing.B) {
				benchCommit(b, groups, inflight)
			})
		}
	}
}

func benchCommit(b *testing.B, groups, inflight int) {
	c := newTCPCluster(b, 3, 100*time.Millisecond)
	all := []uint64{1, 2, 3}
	for id, h := range c.hosts {
		for g := 1; g <= groups; g++ {
			if _, err := h.AddGroup(GroupConfig{ID: uint64(g), Peers: all, StateMachine: &kvSM{}}); err != nil {
				b.Fatal(err)
			}
		}
		_ = id
	}
	for g := 1; g <= groups; g++ {
		grp, _ := c.hosts[uint64(g%3+1)].Group(uint64(g))
		grp.Campaign()
	}
	leaders := make([]*Group, groups+1)
	deadline := time.Now().Add(30 * time.Second)
	for g := 1; g <= groups; g++ {
		for leaders[g] = c.leaderOf(uint64(g), all); leaders[g] == nil; leaders[g] = c.leaderOf(uint64(g), all) {
			if time.Now().After(deadline) {
				b.Fatalf("group %d has no leader", g)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	payload := make([]byte, 4096)
	// Warm up: every group commits once.
	for g := 1; g <= groups; g++ {
		if _, err := leaders[g].Propose(context.Background(), payload, nil); err != nil {
			b.Fatal(err)
		}
	}
	syncs := func() int64 {
		var n int64
		for _, h := range c.hosts {
			for _, d := range h.LogDirs() {
				n += d.Fsyncs
			}
		}
		return n
	}
	s0 := syncs()
	var next atomic.Int64
	lat := make([][]time.Duration, groups*inflight)
	var failed atomic.Int64
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < groups*inflight; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g := leaders[w%groups+1]
			for next.Add(1) <= int64(b.N) {
				t0 := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, err := g.Propose(ctx, payload, nil)
				cancel()
				if err != nil {
					failed.Add(1)
					continue
				}
				lat[w] = append(lat[w], time.Since(t0))
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	var all2 []time.Duration
	for _, l := range lat {
		all2 = append(all2, l...)
	}
	if len(all2) == 0 {
		b.Fatal("nothing committed")
	}
	sort.Slice(all2, func(i, j int) bool { return all2[i] < all2[j] })
	n := float64(len(all2))
	b.ReportMetric(n/elapsed.Seconds(), "commits/s")
	b.ReportMetric(float64(all2[len(all2)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(all2[len(all2)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(syncs()-s0)/3/n, "fsyncs/entry/host")
	if f := failed.Load(); f > 0 {
		b.ReportMetric(float64(f), "failed")
	}
}
