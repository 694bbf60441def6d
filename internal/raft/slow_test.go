package raft

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// slowReadSM is a dataSM whose ReadData blocks until released: a slow
// disk under one group's resends.
type slowReadSM struct {
	dataSM
	entered chan struct{}
	gate    chan struct{}
	once    sync.Once
}

func (s *slowReadSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	select {
	case s.entered <- struct{}{}:
	default:
	}
	<-s.gate
	return s.dataSM.ReadData(index, term, meta)
}

func (s *slowReadSM) release() { s.once.Do(func() { close(s.gate) }) }

// twoGroupCluster runs group 1 (state machines from sm1) and group 2
// (kvSM) on three hosts of a MemNetwork, with both groups led by host 1.
type twoGroupCluster struct {
	t     *testing.T
	net   *MemNetwork
	fs    map[uint64]vfs.FS
	hosts map[uint64]*Host
	sm1   map[uint64]StateMachine
	sm2   map[uint64]*kvSM
}

func newTwoGroupCluster(t *testing.T, sm1 func(id uint64) StateMachine) *twoGroupCluster {
	c := &twoGroupCluster{t: t, net: NewMemNetwork(1), fs: map[uint64]vfs.FS{}, hosts: map[uint64]*Host{}, sm1: map[uint64]StateMachine{}, sm2: map[uint64]*kvSM{}}
	for id := uint64(1); id <= 3; id++ {
		c.fs[id] = newMemFS()
		c.sm1[id] = sm1(id)
		c.sm2[id] = &kvSM{}
		c.start(id)
	}
	t.Cleanup(func() {
		for _, h := range c.hosts {
			h.Close()
		}
	})
	for _, gid := range []uint64{1, 2} {
		g := c.group(1, gid)
		waitFor(t, fmt.Sprintf("host 1 to lead group %d", gid), func() bool {
			if !g.IsLeader() {
				g.Campaign()
				time.Sleep(5 * time.Millisecond) // let the election run before campaigning again
			}
			return g.IsLeader()
		})
	}
	return c
}

func (c *twoGroupCluster) start(id uint64) {
	h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log"}, FS: c.fs[id], Transport: c.net.Transport(id),
		TickInterval: 2 * time.Millisecond, ElectionTicks: 20, HeartbeatTicks: 1, Logger: testLogger()})
	if err != nil {
		c.t.Fatal(err)
	}
	for gid, sm := range map[uint64]StateMachine{1: c.sm1[id], 2: c.sm2[id]} {
		if _, err := h.AddGroup(GroupConfig{ID: gid, Peers: []uint64{1, 2, 3}, StateMachine: sm}); err != nil {
			c.t.Fatal(err)
		}
	}
	c.hosts[id] = h
}

func (c *twoGroupCluster) group(host, gid uint64) *Group {
	g, err := c.hosts[host].Group(gid)
	if err != nil {
		c.t.Fatal(err)
	}
	return g
}

func hasValue(sm *kvSM, v string) bool {
	for _, x := range sm.values() {
		if x == v {
			return true
		}
	}
	return false
}

// Scenario 9 of issue 11: the data of a resend is read on the group's own
// worker. With ReadData stuck for group 1, group 2 on the same hosts keeps
// committing, on the leader and on the follower group 1 is resending to.
// (The old code read it on the shared store loop with the in-memory
// network, and on the peer's shared writer goroutine with TCP.)
func TestSlowReadDataDoesNotStallOtherGroups(t *testing.T) {
	sms := map[uint64]*slowReadSM{}
	c := newTwoGroupCluster(t, func(id uint64) StateMachine {
		sms[id] = &slowReadSM{dataSM: dataSM{dir: t.TempDir()}, entered: make(chan struct{}, 1), gate: make(chan struct{})}
		return sms[id]
	})
	t.Cleanup(func() {
		for _, s := range sms {
			s.release()
		}
	})
	lead := c.group(1, 1)
	lead.cache.mu.Lock()
	lead.cache.max = 0 // every resend reads the disk
	lead.cache.mu.Unlock()

	// Host 3 misses an entry with data, then comes back: the leader must
	// resend it, calling ReadData, which blocks.
	c.hosts[3].Close()
	delete(c.hosts, 3)
	// Generous: under a loaded machine the restarted host's authenticated
	// reconnect and the leader's probe take seconds; the bound is not the
	// point of the test.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := lead.Propose(ctx, []byte("d1"), []byte("payload")); err != nil {
		t.Fatal(err)
	}
	c.start(3)
	select {
	case <-sms[1].entered:
	case <-ctx.Done():
		t.Fatal("the leader never read the entry's data for host 3")
	}

	// Meanwhile group 2 commits, and host 3 applies it.
	pctx, pcancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer pcancel()
	if _, err := c.group(1, 2).Propose(pctx, []byte("g2"), nil); err != nil {
		t.Fatalf("group 2 while group 1's ReadData is stuck: %v", err)
	}
	waitFor(t, "host 3 to apply group 2's entry", func() bool { return hasValue(c.sm2[3], "g2") })

	sms[1].release()
	waitFor(t, "host 3 to catch up on group 1", func() bool { return hasValue(&sms[3].kvSM, "d1") })
}

// slowApplySM blocks Apply while blocked is set.
type slowApplySM struct {
	kvSM
	blocked atomic.Bool
	gate    chan struct{}
	once    sync.Once
}

func (s *slowApplySM) Apply(ents []Entry) []any {
	if s.blocked.Load() {
		<-s.gate
	}
	return s.kvSM.Apply(ents)
}

func (s *slowApplySM) release() { s.once.Do(func() { close(s.gate) }) }

// Scenario 9: past the apply backlog, the group still processes its Ready
// (heartbeats, appends): a slow state machine on the leader neither costs
// it its leadership nor stops the group from committing, and the other
// group on the host is unaffected. The old code skipped the whole Ready,
// so the leader stopped heartbeating and was voted out.
func TestSlowStateMachineKeepsLeadership(t *testing.T) {
	old := maxApplyBacklog
	maxApplyBacklog = 8
	t.Cleanup(func() { maxApplyBacklog = old })
	sms := map[uint64]*slowApplySM{}
	c := newTwoGroupCluster(t, func(id uint64) StateMachine {
		sms[id] = &slowApplySM{gate: make(chan struct{})}
		return sms[id]
	})
	t.Cleanup(func() {
		for _, s := range sms {
			s.release()
		}
	})
	lead := c.group(1, 1)
	term := lead.Status().Term
	sms[1].blocked.Store(true)

	// Far more entries than the backlog: the callers give up (the leader
	// cannot apply), the entries still commit.
	const n = 64
	for i := range n {
		if err := lead.ProposeAsync([]byte(fmt.Sprintf("v%d", i)), nil, func(Result, error) {}); err != nil {
			t.Fatalf("proposal %d: %v", i, err)
		}
	}
	applied := lead.Status().Applied
	waitFor(t, "the entries to commit while the leader's state machine is stuck", func() bool {
		return lead.Status().Commit >= applied+n
	})
	// Many election timeouts later the leader is still the leader, in the
	// same term, and the followers applied everything.
	ticks := lead.ticks.Load()
	waitFor(t, "five election timeouts", func() bool { return lead.ticks.Load() >= ticks+5*20 })
	if st := lead.Status(); st.Role != "leader" || st.Term != term {
		t.Fatalf("leader with a stuck state machine: role %s term %d (was leader in term %d)", st.Role, st.Term, term)
	}
	waitFor(t, "followers to apply", func() bool { return len(sms[2].values()) == n && len(sms[3].values()) == n })
	// The other group commits meanwhile.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.group(1, 2).Propose(ctx, []byte("other"), nil); err != nil {
		t.Fatal(err)
	}
	// Released, the leader applies all of it, in order, from the log.
	sms[1].release()
	waitFor(t, "the leader to apply", func() bool { return len(sms[1].values()) == n })
	for i, v := range sms[1].values() {
		if v != fmt.Sprintf("v%d", i) {
			t.Fatalf("value %d = %q", i, v)
		}
	}
}

// syncGateFS blocks Sync of files under prefix while armed.
type syncGateFS struct {
	vfs.FS
	prefix  string
	armed   atomic.Bool
	entered chan struct{}
	gate    chan struct{}
}

func (fs *syncGateFS) wrap(name string, f vfs.File, err error) (vfs.File, error) {
	if err != nil || !strings.HasPrefix(name, fs.prefix) {
		return f, err
	}
	return &gatedFile{File: f, fs: fs}, nil
}

func (fs *syncGateFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.Create(name, c)
	return fs.wrap(name, f, err)
}

func (fs *syncGateFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.OpenReadWrite(name, c, opts...)
	return fs.wrap(name, f, err)
}

func (fs *syncGateFS) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.ReuseForWrite(oldname, newname, c)
	return fs.wrap(newname, f, err)
}

type gatedFile struct {
	vfs.File
	fs *syncGateFS
}

func (f *gatedFile) wait() {
	if f.fs.armed.Load() {
		select {
		case f.fs.entered <- struct{}{}:
		default:
		}
		<-f.fs.gate
	}
}

func (f *gatedFile) Sync() error                  { f.wait(); return f.File.Sync() }
func (f *gatedFile) SyncData() error              { f.wait(); return f.File.SyncData() }
func (f *gatedFile) SyncTo(n int64) (bool, error) { f.wait(); return f.File.SyncTo(n) }

// Scenario 9: AddGroup syncs the log store of the new group's directory
// without holding the host lock, so a slow disk under a new group does
// not stop inbound traffic (and ticks) for the groups already hosted.
func TestAddGroupSyncsOutsideHostLock(t *testing.T) {
	net := NewMemNetwork(1)
	gfs := &syncGateFS{FS: newMemFS(), prefix: "/log2", entered: make(chan struct{}, 1), gate: make(chan struct{})}
	var once sync.Once
	release := func() { once.Do(func() { close(gfs.gate) }) }
	hosts := map[uint64]*Host{}
	sms := map[uint64]*kvSM{}
	for id := uint64(1); id <= 3; id++ {
		var fs vfs.FS = newMemFS()
		if id == 1 {
			fs = gfs
		}
		h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log1", "/log2"}, FS: fs, Transport: net.Transport(id),
			TickInterval: 2 * time.Millisecond, ElectionTicks: 20, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		hosts[id] = h
		defer h.Close()
		sms[id] = &kvSM{}
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[id]}); err != nil {
			t.Fatal(err)
		}
	}
	defer release()
	// Group 1 lives in /log1 everywhere; host 1's next group goes to /log2.
	if d := hosts[1].LogDirs(); d[0].Groups != 1 || d[1].Groups != 0 {
		t.Fatalf("log dirs %+v", d)
	}
	gfs.armed.Store(true)
	added := make(chan error, 1)
	go func() {
		_, err := hosts[1].AddGroup(GroupConfig{ID: 2, Peers: []uint64{1}, StateMachine: &kvSM{}})
		added <- err
	}()
	<-gfs.entered // AddGroup is in a sync on /log2
	// Group 1 commits and host 1 applies it, while that sync hangs.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var g1 *Group
	waitFor(t, "a leader of group 1 on hosts 2 or 3", func() bool {
		for _, id := range []uint64{2, 3} {
			if g, _ := hosts[id].Group(1); g != nil && g.IsLeader() {
				g1 = g
				return true
			}
			if g, _ := hosts[id].Group(1); g != nil {
				g.Campaign()
			}
		}
		time.Sleep(5 * time.Millisecond) // an election takes a few ticks
		return false
	})
	if _, err := g1.Propose(ctx, []byte("during add"), nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "host 1 to apply group 1's entry during AddGroup's sync", func() bool { return hasValue(sms[1], "during add") })
	release()
	if err := <-added; err != nil {
		t.Fatal(err)
	}
}
