package raft

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	dto "github.com/prometheus/client_model/go"
)

// kvSM is a test state machine: it records the metadata of every applied
// normal entry, in order. It stands for a durable state machine: the test
// keeps it across a host restart, and AppliedIndex is all it applied.
type kvSM struct {
	mu      sync.Mutex
	applied uint64
	vals    []string
	// index of each value, to check that replicas agree entry by entry
	at []uint64
}

func (s *kvSM) Apply(ents []Entry) []any {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]any, len(ents))
	for i, e := range ents {
		if e.Index <= s.applied {
			panic(fmt.Sprintf("entry %d applied twice (applied %d)", e.Index, s.applied))
		}
		s.applied = e.Index
		if e.Kind == EntryNormal {
			s.vals = append(s.vals, string(e.Meta))
			s.at = append(s.at, e.Index)
			out[i] = len(s.vals)
			if bytes.HasPrefix(e.Meta, []byte("fail:")) {
				out[i] = errors.New(string(e.Meta))
			}
		}
	}
	return out
}

func (s *kvSM) AppliedIndex() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.applied
}

type kvSnap struct {
	Applied uint64
	Vals    []string
	At      []uint64
}

func (s *kvSM) Snapshot() (uint64, io.ReadCloser, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, err := json.Marshal(kvSnap{s.applied, s.vals, s.at})
	if err != nil {
		return 0, nil, err
	}
	return s.applied, io.NopCloser(bytes.NewReader(b)), nil
}

func (s *kvSM) Restore(index uint64, r io.Reader) error {
	var snap kvSnap
	if err := json.NewDecoder(r).Decode(&snap); err != nil {
		return err
	}
	if snap.Applied != index {
		return fmt.Errorf("snapshot index %d, want %d", snap.Applied, index)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.applied, s.vals, s.at = snap.Applied, snap.Vals, snap.At
	return nil
}

func (s *kvSM) values() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.vals...)
}

// dataSM also keeps proposal data, in one file per entry under dir (the
// state machine's own storage, outside the log directories).
type dataSM struct {
	kvSM
	dir       string
	mu2       sync.Mutex
	writes    int
	reads     int
	dataBytes int64
}

func (s *dataSM) path(index, term uint64) string {
	return filepath.Join(s.dir, fmt.Sprintf("%d-%d", index, term))
}

func (s *dataSM) WriteData(index, term uint64, meta, data []byte) error {
	f, err := os.Create(s.path(index, term))
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	s.mu2.Lock()
	s.writes++
	s.dataBytes += int64(len(data))
	s.mu2.Unlock()
	return f.Close()
}

func (s *dataSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	s.mu2.Lock()
	s.reads++
	s.mu2.Unlock()
	return os.ReadFile(s.path(index, term))
}

// memCluster is a set of hosts on a MemNetwork, each with an in-memory
// file system that survives a restart of the host.
type memCluster struct {
	t      *testing.T
	net    *MemNetwork
	ids    []uint64
	fs     map[uint64]vfs.FS
	hosts  map[uint64]*Host
	sms    map[uint64]map[uint64]*kvSM // host → group → sm
	groups []uint64
}

func newMemCluster(t *testing.T, n int, seed int64, groups ...uint64) *memCluster {
	t.Helper()
	c := &memCluster{t: t, net: NewMemNetwork(seed), fs: map[uint64]vfs.FS{}, hosts: map[uint64]*Host{}, sms: map[uint64]map[uint64]*kvSM{}, groups: groups}
	for i := 1; i <= n; i++ {
		c.ids = append(c.ids, uint64(i))
	}
	for _, id := range c.ids {
		c.fs[id] = vfs.NewMem()
		c.sms[id] = map[uint64]*kvSM{}
		for _, g := range groups {
			c.sms[id][g] = &kvSM{}
		}
		c.start(id, c.ids)
	}
	t.Cleanup(func() {
		for _, h := range c.hosts {
			h.Close()
		}
	})
	return c
}

func (c *memCluster) start(id uint64, peers []uint64) {
	c.t.Helper()
	h, err := NewHost(HostConfig{
		ID: id, LogDirs: []string{"/log"}, FS: c.fs[id], Transport: c.net.Transport(id),
		TickInterval: 2 * time.Millisecond, ElectionTicks: 10, HeartbeatTicks: 1,
		CompactEvery: 64, CompactKeep: 8,
	})
	if err != nil {
		c.t.Fatal(err)
	}
	for _, g := range c.groups {
		if _, err := h.AddGroup(GroupConfig{ID: g, Peers: peers, StateMachine: c.sms[id][g]}); err != nil {
			c.t.Fatal(err)
		}
	}
	c.hosts[id] = h
}

func (c *memCluster) stop(id uint64) {
	c.hosts[id].Close()
	delete(c.hosts, id)
}

// waitLeader waits until the hosts in among agree on a leader of group.
func (c *memCluster) waitLeader(group uint64, among ...uint64) uint64 {
	c.t.Helper()
	if len(among) == 0 {
		among = c.ids
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var lead uint64
		agree := true
		for _, id := range among {
			h, ok := c.hosts[id]
			if !ok {
				continue
			}
			g, err := h.Group(group)
			if err != nil {
				c.t.Fatal(err)
			}
			l := g.Leader()
			if l == 0 || (lead != 0 && l != lead) {
				agree = false
				break
			}
			lead = l
		}
		if agree && lead != 0 {
			if g, err := c.hosts[lead].Group(group); err == nil && g.IsLeader() {
				return lead
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.t.Fatalf("no leader for group %d among %v", group, among)
	return 0
}

func (c *memCluster) group(host, group uint64) *Group {
	c.t.Helper()
	g, err := c.hosts[host].Group(group)
	if err != nil {
		c.t.Fatal(err)
	}
	return g
}

// propose proposes val on whichever host leads, retrying through
// elections, and returns the index it committed at.
func (c *memCluster) propose(group uint64, val string, among ...uint64) uint64 {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		lead := c.waitLeader(group, among...)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		res, err := c.group(lead, group).Propose(ctx, []byte(val), nil)
		cancel()
		if err == nil {
			return res.Index
		}
		if errors.Is(err, ErrNotLeader) || errors.Is(err, ErrProposalDropped) || errors.Is(err, context.DeadlineExceeded) {
			continue
		}
		c.t.Fatalf("propose %q: %v", val, err)
	}
	c.t.Fatalf("propose %q: no progress", val)
	return 0
}

// waitValues waits until host's state machine for group holds want.
func (c *memCluster) waitValues(host, group uint64, want []string) {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	var got []string
	for time.Now().Before(deadline) {
		got = c.sms[host][group].values()
		if equalStrings(got, want) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.t.Fatalf("host %d group %d: values\n got %v\nwant %v", host, group, got, want)
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func newMemFS() vfs.FS { return vfs.NewMem() }

func testCounter(c interface{ Write(*dto.Metric) error }) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return 0
	}
	return m.GetCounter().GetValue()
}

// testLogger logs at debug level when BASALT_TEST_DEBUG is set.
func testLogger() *slog.Logger {
	lvl := slog.LevelWarn
	if os.Getenv("BASALT_TEST_DEBUG") != "" {
		lvl = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}

// testCtx bounds a test's blocking calls (Propose, WaitApplied): a
// proposal that is never finished fails its test with a message instead
// of using up go test's -timeout for the whole package. Canceled when the
// test ends.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}
