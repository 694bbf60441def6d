package raft

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	bvfs "github.com/basalt-store/basalt/internal/vfs"
	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	pb "go.etcd.io/raft/v3/raftpb"
)

// tapTransport records the acknowledgements (a MsgAppResp or vote granted)
// host 1 sends for group 1 once its log directory failed.
type tapTransport struct {
	Transport
	host atomic.Pointer[Host] // host 1, once started
	mu   sync.Mutex
	bad  []string
}

func (t *tapTransport) Send(to uint64, msgs []Outgoing) {
	if h := t.host.Load(); h != nil && h.loops[0].store.failed() != nil {
		for _, o := range msgs {
			m := o.Msg
			if o.Group != 1 || m == nil || m.GetReject() {
				continue
			}
			switch m.GetType() {
			case pb.MsgAppResp, pb.MsgVoteResp, pb.MsgPreVoteResp, pb.MsgSnapStatus:
				t.mu.Lock()
				t.bad = append(t.bad, fmt.Sprintf("%v to %d index %d term %d", m.GetType(), m.GetTo(), m.GetIndex(), m.GetTerm()))
				t.mu.Unlock()
			}
		}
	}
	t.Transport.Send(to, msgs)
}

// fatalCluster: three hosts, groups 1 and 2 on each; host 1 has two log
// directories on an error-injecting FS, /a (group 1) and /b (group 2).
type fatalCluster struct {
	*memCluster
	ffs *bvfs.FaultFS
	tap *tapTransport
	h1  *Host
}

func newFatalCluster(t *testing.T) *fatalCluster {
	c := &fatalCluster{memCluster: &memCluster{t: t, net: NewMemNetwork(7), fs: map[uint64]vfs.FS{}, hosts: map[uint64]*Host{},
		sms: map[uint64]map[uint64]*kvSM{}, groups: []uint64{1, 2}, ids: []uint64{1, 2, 3}}}
	c.ffs = bvfs.NewFaultFS(bvfs.NewMem(bvfs.MemOptions{}))
	t.Cleanup(func() {
		for _, h := range c.hosts {
			h.Close()
		}
	})
	for _, id := range c.ids {
		c.sms[id] = map[uint64]*kvSM{1: {}, 2: {}}
		cfg := HostConfig{ID: id, LogDirs: []string{"/log"}, FS: vfs.NewMem(), Transport: c.net.Transport(id),
			TickInterval: 2 * time.Millisecond, ElectionTicks: 10, HeartbeatTicks: 1, Logger: testLogger()}
		if id == 1 {
			c.tap = &tapTransport{Transport: cfg.Transport}
			cfg.LogDirs, cfg.FS, cfg.Transport = []string{"/a", "/b"}, c.ffs, c.tap
		}
		h, err := NewHost(cfg)
		if err != nil {
			t.Fatal(err)
		}
		c.hosts[id] = h
		if id == 1 {
			c.tap.host.Store(h)
		}
		for _, g := range c.groups {
			gr, err := h.AddGroup(GroupConfig{ID: g, Peers: c.ids, StateMachine: c.sms[id][g]})
			if err != nil {
				t.Fatal(err)
			}
			if want := map[uint64]string{1: "/a", 2: "/b"}[g]; id == 1 && gr.Status().LogDir != want {
				t.Fatalf("host 1 group %d on %s, want %s", g, gr.Status().LogDir, want)
			}
		}
	}
	c.h1 = c.hosts[1]
	return c
}

// proposeSome commits one value on group g, through whichever of among
// leads, retrying on any error with a fresh value (an unknown outcome may
// still commit: values are only checked for growth).
func (c *fatalCluster) proposeSome(g uint64, prefix string, among ...uint64) {
	c.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		lead := c.waitLeader(g, among...)
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.group(lead, g).Propose(ctx, []byte(fmt.Sprintf("%s-%d", prefix, i)), nil)
		cancel()
		if err == nil {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.t.Fatalf("group %d: nothing committed among %v", g, among)
}

// waitSame waits until the hosts' state machines of group g hold the same
// values, at least n of them.
func (c *fatalCluster) waitSame(g uint64, n int, hosts ...uint64) {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		first := c.sms[hosts[0]][g].values()
		same := len(first) >= n
		for _, h := range hosts[1:] {
			same = same && equalStrings(first, c.sms[h][g].values())
		}
		if same {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	for _, h := range hosts {
		c.t.Logf("host %d group %d: %v", h, g, c.sms[h][g].values())
	}
	c.t.Fatalf("group %d: hosts %v do not reach the same %d+ values", g, hosts, n)
}

// checkFailedDir: host 1's /a failed (its cause matching want), group 1 on
// host 1 stopped with ErrLogDirFailed and gets nothing more, group 1 goes
// on on hosts 2 and 3, group 2 goes on on all three (host 1's /b), a new
// group avoids /a, and no acknowledgement left host 1 for group 1 after
// the failure.
func (c *fatalCluster) checkFailedDir(want string) {
	t := c.t
	g1 := c.group(1, 1)
	deadline := time.Now().Add(10 * time.Second)
	for !(g1.Stopped() && testCounter(c.h1.metrics.logDirFailures) == 1) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if !g1.Stopped() || !errors.Is(g1.Failure(), ErrLogDirFailed) {
		t.Fatalf("host 1 group 1: stopped %v, failure %v; want stopped with ErrLogDirFailed", g1.Stopped(), g1.Failure())
	}
	st := c.h1.LogDirs()
	if !st[0].Failed || !strings.Contains(st[0].Error, want) || st[1].Failed {
		t.Fatalf("log dirs %+v: want /a failed (%q), /b not", st, want)
	}
	if n := testCounter(c.h1.metrics.logDirFailures); n != 1 {
		t.Fatalf("log_dir_failures_total = %v, want 1", n)
	}
	seen := len(c.sms[1][1].values())
	// Group 1 commits on hosts 2 and 3; group 2 on all three.
	for i := range 3 {
		c.proposeSome(1, fmt.Sprintf("after%d", i), 2, 3)
		c.proposeSome(2, fmt.Sprintf("b-after%d", i))
	}
	c.waitSame(2, 4, 1, 2, 3) // host 1's /b goes on
	c.waitSame(1, seen+3, 2, 3)
	if got := c.sms[1][1].values(); len(got) != seen {
		t.Fatalf("host 1 group 1 applied %v after its log dir failed (had %d)", got[seen:], seen)
	}
	if got := len(c.sms[2][1].values()); got <= seen {
		t.Fatalf("group 1 on hosts 2, 3: %d values, no progress past %d", got, seen)
	}
	g3, err := c.h1.AddGroup(GroupConfig{ID: 3, Peers: []uint64{1}, StateMachine: &kvSM{}})
	if err != nil {
		t.Fatal(err)
	}
	if d := g3.Status().LogDir; d != "/b" {
		t.Fatalf("new group placed on %s, want /b (/a failed)", d)
	}
	c.tap.mu.Lock()
	defer c.tap.mu.Unlock()
	if len(c.tap.bad) > 0 {
		t.Fatalf("host 1 acknowledged for group 1 after its log dir failed: %v", c.tap.bad)
	}
}

// TestLogDirFatalWALSync: the WAL sync of host 1's /a fails with EIO. The
// process survives (before: quietLogger's Fatalf panicked, or the loop's
// panic on the commit error), the groups on /a stop without acknowledging
// anything, those on /b and on the other hosts keep committing.
func TestLogDirFatalWALSync(t *testing.T) {
	c := newFatalCluster(t)
	c.proposeSome(1, "before")
	c.proposeSome(2, "b-before")
	var hits atomic.Int64
	c.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/a/") && strings.HasSuffix(path, ".log") {
			hits.Add(1)
			return syscall.EIO
		}
		return nil
	})
	defer c.ffs.SetInject(nil)
	// Group 1 keeps being written (a proposal, or appends from the leader
	// elsewhere): its next synced batch on /a fails.
	go func() {
		for i := 0; i < 50 && !c.group(1, 1).Stopped(); i++ {
			lead := c.group(2, 1).Leader()
			if lead == 0 {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			g, err := c.hosts[lead].Group(1)
			if err != nil {
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			g.Propose(ctx, []byte(fmt.Sprintf("during-%d", i)), nil)
			cancel()
		}
	}()
	c.checkFailedDir("sync failed")
	if hits.Load() == 0 {
		t.Fatal("no WAL sync was failed")
	}
}

// TestLogDirFatalFlush: a flush of host 1's /a (Pebble's own
// goroutine) fails to sync the MANIFEST and Pebble calls Fatalf there.
// Before: quietLogger panicked on Pebble's goroutine, killing the process.
// The same with the flush's SST write failing: Pebble reports it as a
// background error and retries at once, forever (no Fatalf): the
// directory fails, the flush goroutine ends. Before: the failed flush
// went unnoticed and spun.
func TestLogDirFatalFlush(t *testing.T) {
	for _, tc := range []struct{ name, op, file, want string }{
		{"manifest-sync", "sync", "/a/MANIFEST", "MANIFEST sync failed"},
		{"sst-write", "write", ".sst", "background error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newFatalCluster(t)
			c.proposeSome(1, "before")
			c.proposeSome(2, "b-before")
			var hits atomic.Int64
			c.ffs.SetInject(func(op, path string) error {
				if op == tc.op && strings.HasPrefix(path, "/a/") && strings.Contains(path, tc.file) {
					hits.Add(1)
					return syscall.EIO
				}
				return nil
			})
			defer c.ffs.SetInject(nil)
			if _, err := c.h1.loops[0].store.db.AsyncFlush(); err != nil {
				t.Fatal(err)
			}
			c.checkFailedDir(tc.want)
			// The failed flush's goroutine ended: no more attempts (before
			// the Goexit, Pebble retried the SST write at once, forever).
			checkNoRetries(t, &hits)
		})
	}
}

// TestLogDirFatalRestart: after /a failed, host 1 restarts (a crash: only
// what was synced survives). With the disk still failing, NewHost fails
// and says which directory; once it works, /a reopens, group 1 catches up
// with the others and group 2 has everything.
func TestLogDirFatalRestart(t *testing.T) {
	c := newFatalCluster(t)
	c.proposeSome(1, "before")
	c.proposeSome(2, "b-before")
	c.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/a/") {
			return syscall.EIO
		}
		return nil
	})
	c.proposeSome(1, "trigger", 2, 3)
	c.checkFailedDir("sync failed")
	t.Log("closing host 1")
	c.h1.Close()
	t.Log("closed")
	delete(c.hosts, 1)
	crashed := c.ffs.FS.(*bvfs.MemFS).Crash()

	cfg := HostConfig{ID: 1, LogDirs: []string{"/a", "/b"}, Transport: c.net.Transport(1),
		TickInterval: 2 * time.Millisecond, ElectionTicks: 10, HeartbeatTicks: 1, Logger: testLogger()}
	still := bvfs.NewFaultFS(crashed.Crash())
	still.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/a") {
			return syscall.EIO
		}
		return nil
	})
	cfg.FS = still
	t.Log("restart on a failing disk")
	if h, err := NewHost(cfg); err == nil {
		h.Close()
		t.Fatal("NewHost on a log dir whose disk still fails: no error")
	} else if !strings.Contains(err.Error(), "/a") || !errors.Is(err, ErrLogDirFailed) {
		t.Fatalf("NewHost on a still failing /a: %v (does not name the directory)", err)
	} else {
		t.Logf("NewHost on a still failing /a: %v", err)
	}

	t.Log("restart on a working disk")
	cfg.FS, cfg.Transport = crashed, c.net.Transport(1)
	c.sms[1] = map[uint64]*kvSM{1: {}, 2: {}}
	h, err := NewHost(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.hosts[1] = h
	for _, g := range []uint64{1, 2} {
		if _, err := h.AddGroup(GroupConfig{ID: g, StateMachine: c.sms[1][g]}); err != nil {
			t.Fatal(err)
		}
	}
	c.proposeSome(1, "after-restart")
	c.proposeSome(2, "b-after-restart")
	c.waitSame(1, 2, 1, 2, 3)
	c.waitSame(2, 2, 1, 2, 3)
	for _, st := range h.LogDirs() {
		if st.Failed {
			t.Fatalf("after the restart: %+v", st)
		}
	}
}

// BenchmarkLogStoreCommitGuard: the guard's own cost per commit (usable,
// Catch's defer, the error check), raw Batch.Commit against
// logStore.commit, alternating in one binary, on an in-memory FS with a
// one-key NoSync batch (the cheapest commit there is).
func BenchmarkLogStoreCommitGuard(b *testing.B) {
	s, err := openLogStore("/log", newMemFS())
	if err != nil {
		b.Fatal(err)
	}
	defer s.close()
	k, v := groupKey(keyHardState, 1), make([]byte, 24)
	for _, guarded := range []bool{false, true, false, true} {
		b.Run(fmt.Sprintf("guarded=%v", guarded), func(b *testing.B) {
			for range b.N {
				batch := s.db.NewBatch()
				batch.Set(k, v, nil)
				var err error
				if guarded {
					err = s.commit(batch, pebble.NoSync)
				} else {
					err = batch.Commit(pebble.NoSync)
				}
				batch.Close()
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestLogDirFatalRawPanics: an etcd raft panic in a call into the RawNode
// other than Step (a tick, a proposal, Campaign, ...: its Storage failing
// a read once the log directory failed) stops that group, not the
// process; the group is marked stopped before its lock is released; the
// entry points refuse a stopped group (Campaign returned nil on a stopped
// group before); the panic counts in raw_node_panics_total, not
// step_panics_total.
func TestLogDirFatalRawPanics(t *testing.T) {
	c := newFatalCluster(t)
	c.proposeSome(1, "before")
	c.proposeSome(2, "b-before")
	c.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/a/") && strings.HasSuffix(path, ".log") {
			return syscall.EIO
		}
		return nil
	})
	defer c.ffs.SetInject(nil)
	g1 := c.group(1, 1)
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; !g1.Stopped() && time.Now().Before(deadline); i++ {
		if lead := c.group(2, 1).Leader(); lead != 0 {
			if g, err := c.hosts[lead].Group(1); err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
				g.Propose(ctx, []byte(fmt.Sprintf("during-%d", i)), nil)
				cancel()
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !g1.Stopped() {
		t.Fatal("group 1 on host 1 did not stop")
	}
	if err := g1.Campaign(); !errors.Is(err, ErrStopped) {
		t.Fatalf("Campaign on a stopped group = %v, want ErrStopped", err)
	}
	g1.TransferLeader(2) // must not reach the RawNode

	// A panic inside a RawNode call: the group is stopped before mu is
	// released, and the error wraps the directory's failure if any.
	steps0 := testCounter(c.h1.metrics.stepPanics)
	g2 := c.group(1, 2)
	g2.mu.Lock()
	err := g2.rawLocked("tick", func() { panic("raft: storage read failed (test)") })
	stoppedUnderMu := g2.isStopped()
	g2.mu.Unlock()
	if err == nil || !stoppedUnderMu {
		t.Fatalf("rawLocked: err %v, stopped under mu %v; want an error and stopped", err, stoppedUnderMu)
	}
	if errors.Is(err, ErrLogDirFailed) {
		t.Fatalf("group 2's error %v matches ErrLogDirFailed: /b did not fail", err)
	}
	g2.fail(err)
	if !g2.Stopped() || g2.Failure() == nil {
		t.Fatalf("group 2: stopped %v, failure %v", g2.Stopped(), g2.Failure())
	}
	if err := g2.Campaign(); !errors.Is(err, ErrStopped) {
		t.Fatalf("Campaign on a broken group = %v, want ErrStopped", err)
	}
	if e := rawPanicError(c.h1.loops[0], 1, "tick", "x"); !errors.Is(e, ErrLogDirFailed) {
		t.Fatalf("a panic on failed /a: %v, want ErrLogDirFailed", e)
	}
	if n := testCounter(c.h1.metrics.rawPanics); n < 1 {
		t.Fatalf("raw_node_panics_total = %v, want >= 1", n)
	}
	if n := testCounter(c.h1.metrics.stepPanics); n != steps0 {
		t.Fatalf("step_panics_total went from %v to %v on a non-step panic", steps0, n)
	}
	// A tick of the broken group does not reach the RawNode (it would
	// panic again, or run on a broken log).
	g2.tick()
	// The other hosts go on with group 2.
	c.proposeSome(2, "b-after", 2, 3)
}

// checkNoRetries: the failing I/O counted by hits is not retried any more
// (the goroutine that did it ended) over a while.
func checkNoRetries(t *testing.T, hits *atomic.Int64) {
	t.Helper()
	before := hits.Load()
	time.Sleep(300 * time.Millisecond)
	if after := hits.Load(); after > before+1 {
		t.Fatalf("the failing background work goes on after the directory failed: %d attempts, %d in the last 300 ms", after, after-before)
	}
}

// TestLogDirFatalCompaction (review finding 3): a compaction of host 1's
// /a fails (its SST writes, only under Pebble's compaction). The
// directory fails and the compaction goroutine ends. Before, Pebble
// retried the compaction at once, forever (no back-off; thousands of
// attempts a second, most of a core) until the process restarted.
func TestLogDirFatalCompaction(t *testing.T) {
	c := newFatalCluster(t)
	c.proposeSome(2, "b-before")
	var hits atomic.Int64
	inCompaction := func() bool {
		buf := make([]byte, 64<<10)
		return strings.Contains(string(buf[:runtime.Stack(buf, false)]), "(*DB).compact1")
	}
	c.ffs.SetInject(func(op, path string) error {
		if op == "write" && strings.HasPrefix(path, "/a/") && strings.HasSuffix(path, ".sst") && inCompaction() {
			hits.Add(1)
			return syscall.EIO
		}
		return nil
	})
	defer c.ffs.SetInject(nil)
	// L0 files on /a (each flush one): past L0CompactionThreshold (4),
	// Pebble compacts them on its own goroutine.
	db := c.h1.loops[0].store.db
	for i := 0; i < 8 && hits.Load() == 0; i++ {
		// Asked of hosts 2 and 3 only: host 1's group 1 may stop
		// meanwhile (the compaction fails on Pebble's goroutine) and then
		// names no leader.
		c.proposeSome(1, fmt.Sprintf("l0-%d", i), 2, 3)
		if err := db.Flush(); err != nil {
			t.Fatalf("flush %d: %v", i, err)
		}
	}
	c.checkFailedDir("background error")
	if hits.Load() == 0 {
		t.Fatal("no compaction write was failed")
	}
	checkNoRetries(t, &hits)
	t.Logf("%d failed compaction writes", hits.Load())
}
