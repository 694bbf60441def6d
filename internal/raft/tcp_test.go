package raft

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// tcpCluster is n hosts on real loopback TCP with real log directories.
type tcpCluster struct {
	t     testing.TB
	dir   string
	mu    sync.Mutex
	addrs map[uint64]string
	hosts map[uint64]*Host
	reg   map[uint64]*prometheus.Registry
	// security, if set, gives each host's transport its Security.
	security func(id uint64) *Security
}

func newTCPCluster(t testing.TB, n int, tick time.Duration) *tcpCluster {
	return newTCPClusterWith(t, n, tick, nil)
}

func newTCPClusterWith(t testing.TB, n int, tick time.Duration, security func(id uint64) *Security) *tcpCluster {
	c := &tcpCluster{t: t, dir: t.TempDir(), addrs: map[uint64]string{}, hosts: map[uint64]*Host{}, reg: map[uint64]*prometheus.Registry{}, security: security}
	for id := uint64(1); id <= uint64(n); id++ {
		c.start(id, tick)
	}
	t.Cleanup(func() {
		for _, h := range c.hosts {
			h.Close()
		}
	})
	return c
}

func (c *tcpCluster) resolve(id uint64) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	a, ok := c.addrs[id]
	if !ok {
		return "", fmt.Errorf("unknown host %d", id)
	}
	return a, nil
}

func (c *tcpCluster) start(id uint64, tick time.Duration) *Host {
	c.reg[id] = prometheus.NewRegistry()
	var sec *Security
	if c.security != nil {
		sec = c.security(id)
	}
	h, err := NewHost(HostConfig{
		ID: id, LogDirs: []string{filepath.Join(c.dir, fmt.Sprint(id), "log")},
		ListenAddr: "127.0.0.1:0", Resolve: c.resolve, TickInterval: tick, Security: sec,
		Registerer: c.reg[id], Logger: testLogger(),
	})
	if err != nil {
		c.t.Fatal(err)
	}
	c.mu.Lock()
	c.addrs[id] = h.Addr()
	c.hosts[id] = h
	c.mu.Unlock()
	return h
}

func (c *tcpCluster) leaderOf(group uint64, among []uint64) *Group {
	for _, id := range among {
		if g, err := c.hosts[id].Group(group); err == nil && g.IsLeader() {
			return g
		}
	}
	return nil
}

// proposeAll proposes one entry in every group (concurrently) and returns
// how many committed before the deadline.
func (c *tcpCluster) proposeAll(groups int, among []uint64, val string, timeout time.Duration) int {
	var ok atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(timeout)
	for g := 1; g <= groups; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				lg := c.leaderOf(uint64(g), among)
				if lg == nil {
					time.Sleep(20 * time.Millisecond)
					continue
				}
				ctx, cancel := context.WithDeadline(context.Background(), deadline)
				_, err := lg.Propose(ctx, []byte(val), nil)
				cancel()
				if err == nil {
					ok.Add(1)
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	return int(ok.Load())
}

func TestTCPManyGroupsSurviveHostLoss(t *testing.T) {
	var groups = 200
	if raceEnabled {
		groups = 50 // 200 groups under the race detector overrun 2 cores
	}
	c := newTCPCluster(t, 3, 50*time.Millisecond)
	sms := map[uint64]map[uint64]*kvSM{}
	for id, h := range c.hosts {
		sms[id] = map[uint64]*kvSM{}
		for g := uint64(1); g <= uint64(groups); g++ {
			sms[id][g] = &kvSM{}
			if _, err := h.AddGroup(GroupConfig{ID: g, Peers: []uint64{1, 2, 3}, StateMachine: sms[id][g]}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Spread leadership: host (g%3)+1 campaigns for group g.
	for g := uint64(1); g <= uint64(groups); g++ {
		grp, _ := c.hosts[g%3+1].Group(g)
		grp.Campaign()
	}
	all := []uint64{1, 2, 3}
	if n := c.proposeAll(groups, all, "one", 60*time.Second); n != groups {
		t.Fatalf("only %d of %d groups committed with all hosts up", n, groups)
	}
	leaders := map[uint64]int{}
	for g := uint64(1); g <= uint64(groups); g++ {
		if lg := c.leaderOf(g, all); lg != nil {
			leaders[lg.host.id]++
		}
	}
	t.Logf("leaders per host: %v", leaders)
	// One connection per pair of hosts.
	for id, h := range c.hosts {
		tr := h.transport.(*TCPTransport)
		tr.mu.Lock()
		n := len(tr.conns)
		tr.mu.Unlock()
		if n != 2 {
			t.Errorf("host %d has %d connections, want 2 (one per peer)", id, n)
		}
	}
	// Heartbeats travel coalesced, not as one protobuf per group (they
	// are periodic: wait a few heartbeat ticks for the first).
	for deadline := time.Now().Add(5 * time.Second); testCounter(c.hosts[1].metrics.heartbeatsCoalesced) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Error("no coalesced heartbeats within 5 s")
			break
		}
	}

	// Kill host 3 (stop without warning its peers): every group keeps a
	// majority, and those it led elect a new leader.
	c.hosts[3].Close()
	delete(c.hosts, 3)
	rest := []uint64{1, 2}
	start := time.Now()
	if n := c.proposeAll(groups, rest, "two", 60*time.Second); n != groups {
		t.Fatalf("after losing host 3 only %d of %d groups committed", n, groups)
	}
	t.Logf("all %d groups committed again %v after host 3 died", groups, time.Since(start))
	for g := uint64(1); g <= uint64(groups); g++ {
		for _, id := range rest {
			vals := sms[id][g].values()
			if len(vals) < 1 || vals[len(vals)-1] != "two" {
				// Followers may apply a moment after the leader.
				deadline := time.Now().Add(5 * time.Second)
				for time.Now().Before(deadline) {
					vals = sms[id][g].values()
					if len(vals) >= 2 && vals[len(vals)-1] == "two" {
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			if len(vals) != 2 || vals[0] != "one" || vals[1] != "two" {
				t.Fatalf("host %d group %d values %v", id, g, vals)
			}
		}
	}
}

func TestTCPSnapshotAndReconnect(t *testing.T) { testTCPSnapshotAndReconnect(t, nil) }

// TestTCPSnapshotAndReconnectTLS: the same over authenticated
// connections (snapshots have connections of their own).
func TestTCPSnapshotAndReconnectTLS(t *testing.T) {
	testTCPSnapshotAndReconnect(t, metaSecurity(t, 3))
}

func testTCPSnapshotAndReconnect(t *testing.T, security func(id uint64) *Security) {
	c := newTCPClusterWith(t, 3, 10*time.Millisecond, security)
	sms := map[uint64]*kvSM{}
	for id, h := range c.hosts {
		sms[id] = &kvSM{}
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[id]}); err != nil {
			t.Fatal(err)
		}
	}
	all := []uint64{1, 2, 3}
	if c.proposeAll(1, all, "a", 10*time.Second) != 1 {
		t.Fatal("no commit")
	}
	var lead uint64
	for _, id := range all {
		if g, _ := c.hosts[id].Group(1); g.IsLeader() {
			lead = id
		}
	}
	f := lead%3 + 1
	c.hosts[f].Close()
	delete(c.hosts, f)
	rest := []uint64{}
	for _, id := range all {
		if id != f {
			rest = append(rest, id)
		}
	}
	// Wait until the leader sees f as inactive, else it holds back log
	// truncation for it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		lg := c.leaderOf(1, rest)
		if lg != nil && !lg.Status().Followers[f].Active {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("leader still sees the stopped follower as active")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Past CompactEvery (2048) so the restarted follower needs a snapshot.
	for i := 0; i < 2400; i += 100 {
		var wg sync.WaitGroup
		for j := 0; j < 100; j++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					lg := c.leaderOf(1, rest)
					if lg == nil {
						time.Sleep(10 * time.Millisecond)
						continue
					}
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					_, err := lg.Propose(ctx, []byte("x"), nil)
					cancel()
					if err == nil || !errors.Is(err, ErrNotLeader) {
						return
					}
				}
			}()
		}
		wg.Wait()
	}
	h := c.start(f, 10*time.Millisecond)
	if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[f]}); err != nil {
		t.Fatal(err)
	}
	lg := c.leaderOf(1, rest)
	want := len(sms[lg.host.id].values())
	deadline = time.Now().Add(20 * time.Second)
	for len(sms[f].values()) < want {
		if time.Now().After(deadline) {
			t.Fatalf("restarted follower has %d values, want %d", len(sms[f].values()), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if testCounter(c.hosts[f].metrics.snapshotsReceived) == 0 {
		t.Fatal("follower caught up without a snapshot; the test did not exercise snapshot install")
	}
}
