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
				benchCommit(b, groups, inflight, 0)
			})
		}
	}
}

// BenchmarkCommitData proposes data kept out of the log (an in-memory
// DataStateMachine), the datanode's path: WriteData on every replica, the
// leader's MsgApps hydrated on the send queue.
func BenchmarkCommitData(b *testing.B) {
	for _, size := range []int{64 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("inflight=8/groups=8/data=%dKiB", size>>10), func(b *testing.B) {
			benchCommit(b, 8, 8, size)
		})
	}
}

// benchDataSM is an in-memory DataStateMachine.
type benchDataSM struct {
	kvSM
	mu   sync.Mutex
	data map[uint64][]byte
}

func (s *benchDataSM) WriteData(index, term uint64, meta, data []byte) error {
	s.mu.Lock()
	if s.data == nil {
		s.data = map[uint64][]byte{}
	}
	s.data[index] = data
	s.mu.Unlock()
	return nil
}

func (s *benchDataSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.data[index], nil
}

func (s *benchDataSM) Apply(ents []Entry) []any {
	s.mu.Lock()
	for _, e := range ents {
		delete(s.data, e.Index-min(e.Index, 512)) // keep memory bounded
	}
	s.mu.Unlock()
	return s.kvSM.Apply(ents)
}

func benchCommit(b *testing.B, groups, inflight, dataBytes int) {
	c := newTCPCluster(b, 3, 100*time.Millisecond)
	all := []uint64{1, 2, 3}
	for id, h := range c.hosts {
		for g := 1; g <= groups; g++ {
			var sm StateMachine = &kvSM{}
			if dataBytes > 0 {
				sm = &benchDataSM{}
			}
			if _, err := h.AddGroup(GroupConfig{ID: uint64(g), Peers: all, StateMachine: sm}); err != nil {
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
	var data []byte
	if dataBytes > 0 {
		payload = make([]byte, 64)
		data = make([]byte, dataBytes)
	}
	// Warm up: every group commits once.
	for g := 1; g <= groups; g++ {
		if _, err := leaders[g].Propose(context.Background(), payload, data); err != nil {
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
				_, err := g.Propose(ctx, payload, data)
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
