package raft

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"testing/cryptotest"

	"github.com/cockroachdb/pebble/v2/vfs"
	pb "go.etcd.io/raft/v3/raftpb"
)

// fifoNet is a deterministic network for manual hosts: Send only queues,
// and the test delivers the queue in order.
type fifoNet struct {
	hosts map[uint64]*Host
	q     []fifoItem
	// down: traffic to and from this host is dropped.
	down uint64
	// mute: traffic from this host is dropped, traffic to it is held in
	// held until unmuted.
	mute uint64
	held []fifoItem
}

type fifoItem struct {
	from, to uint64
	msgs     []Outgoing
	// a snapshot
	group uint64
	snap  *pb.Message
	data  []byte
	done  func(error)
}

type fifoTransport struct {
	net *fifoNet
	id  uint64
}

func (t *fifoTransport) Start(h Handler) error { t.net.hosts[t.id] = h.(*Host); return nil }
func (t *fifoTransport) Addr() string          { return fmt.Sprintf("fifo:%d", t.id) }
func (t *fifoTransport) Close() error          { return nil }

func (t *fifoTransport) Send(to uint64, msgs []Outgoing) {
	c := make([]Outgoing, len(msgs))
	for i, o := range msgs {
		c[i] = o.Materialize()
	}
	t.net.q = append(t.net.q, fifoItem{from: t.id, to: to, msgs: c})
}

func (t *fifoTransport) SendSnapshot(ctx context.Context, to, group uint64, m *pb.Message, body io.Reader) error {
	return fmt.Errorf("fifo: streaming snapshots are not used in manual mode")
}

func (t *fifoTransport) QueueSnapshot(to, group uint64, m *pb.Message, data []byte, done func(error)) {
	t.net.q = append(t.net.q, fifoItem{from: t.id, to: to, group: group, snap: cloneMessage(m), data: data, done: done})
}

// deliver hands every queued item to its host, in order.
func (n *fifoNet) deliver() bool {
	q := n.q
	n.q = nil
	for _, it := range q {
		h, ok := n.hosts[it.to]
		if n.down != 0 && (it.from == n.down || it.to == n.down) {
			ok = false
		}
		if n.mute != 0 && it.from == n.mute {
			ok = false
		}
		if n.mute != 0 && it.to == n.mute {
			n.held = append(n.held, it)
			continue
		}
		if it.snap != nil {
			err := fmt.Errorf("fifo: host %d gone", it.to)
			if ok {
				err = h.HandleSnapshot(it.from, it.group, it.snap, bytes.NewReader(it.data))
			}
			it.done(err)
			continue
		}
		if ok {
			h.HandleMessages(it.from, it.msgs)
		}
	}
	return len(q) > 0
}

// memDataSM keeps data in memory and records every apply in a log shared
// by the hosts of one run.
type memDataSM struct {
	kvSM
	host  uint64
	group uint64
	rec   *[]string
	mu2   sync.Mutex
	data  map[[2]uint64][]byte
}

func (s *memDataSM) Apply(ents []Entry) []any {
	for _, e := range ents {
		*s.rec = append(*s.rec, fmt.Sprintf("host %d group %d index %d term %d", s.host, s.group, e.Index, e.Term))
	}
	return s.kvSM.Apply(ents)
}

func (s *memDataSM) Restore(index uint64, r io.Reader) error {
	*s.rec = append(*s.rec, fmt.Sprintf("host %d group %d restore %d", s.host, s.group, index))
	return s.kvSM.Restore(index, r)
}

func (s *memDataSM) WriteData(index, term uint64, meta, data []byte) error {
	s.mu2.Lock()
	defer s.mu2.Unlock()
	s.data[[2]uint64{index, term}] = append([]byte(nil), data...)
	return nil
}

func (s *memDataSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	s.mu2.Lock()
	defer s.mu2.Unlock()
	d, ok := s.data[[2]uint64{index, term}]
	if !ok {
		return nil, fmt.Errorf("no data at %d/%d: %w", index, term, ErrDataLost)
	}
	return d, nil
}

// runManual runs three manual hosts with two groups under seed: elect via
// Tick and Poll, then propose with data through ProposeAsync until every
// replica applied everything. It returns every apply, in order.
func runManual(t *testing.T, seed int64) []string {
	// etcd raft draws its randomized election timeouts from crypto/rand.
	cryptotest.SetGlobalRandom(t, uint64(seed))
	rnd := rand.New(rand.NewSource(seed))
	net := &fifoNet{hosts: map[uint64]*Host{}}
	var rec []string
	sms := map[[2]uint64]*memDataSM{}
	for id := uint64(1); id <= 3; id++ {
		h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log"}, FS: newMemFS(), Transport: &fifoTransport{net: net, id: id},
			Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 16, CompactKeep: 4, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		for gid := uint64(1); gid <= 2; gid++ {
			sm := &memDataSM{host: id, group: gid, rec: &rec, data: map[[2]uint64][]byte{}}
			sms[[2]uint64{id, gid}] = sm
			if _, err := h.AddGroup(GroupConfig{ID: gid, Peers: []uint64{1, 2, 3}, StateMachine: sm}); err != nil {
				t.Fatal(err)
			}
		}
	}
	quiesce := func() {
		for range 10000 {
			did := false
			for id := uint64(1); id <= 3; id++ {
				for net.hosts[id].Poll() {
					did = true
				}
			}
			if !net.deliver() && !did {
				return
			}
		}
		t.Fatal("no quiescence")
	}
	// Host 3 is cut off until everything committed on 1 and 2, so the
	// leaders truncate their logs and must send it snapshots.
	net.down = 3
	const perGroup = 20
	proposed := map[uint64]int{}
	done := map[uint64]int{}
	var lastIndex = map[uint64]uint64{}
	for round := 0; round < 5000; round++ {
		for id := uint64(1); id <= 3; id++ {
			net.hosts[id].Tick()
		}
		quiesce()
		finished := true
		for gid := uint64(1); gid <= 2; gid++ {
			var lead *Group
			for id := uint64(1); id <= 3; id++ {
				if g, _ := net.hosts[id].Group(gid); g.IsLeader() {
					lead = g
				}
			}
			if done[gid] < perGroup {
				finished = false
			}
			if lead == nil {
				continue
			}
			// A few proposals per round, sizes from the seed.
			for k := rnd.Intn(3); k > 0 && proposed[gid] < perGroup; k-- {
				data := make([]byte, 1+rnd.Intn(300))
				rnd.Read(data)
				i := proposed[gid]
				err := lead.ProposeAsync([]byte(fmt.Sprintf("g%d-%d", gid, i)), data, func(r Result, err error) {
					if err != nil {
						t.Errorf("group %d proposal %d: %v", gid, i, err)
					}
					done[gid]++
					lastIndex[gid] = max(lastIndex[gid], r.Index)
				})
				if err != nil {
					t.Fatalf("ProposeAsync: %v", err)
				}
				proposed[gid]++
			}
			if done[gid] == perGroup {
				if ok, _ := lead.AppliedAll(lastIndex[gid]); !ok {
					finished = false
				}
			}
		}
		if done[1] == perGroup && done[2] == perGroup {
			net.down = 0
		}
		if finished {
			sent := 0.0
			for id := uint64(1); id <= 3; id++ {
				sent += testCounter(net.hosts[id].metrics.snapshotsSent)
			}
			if sent == 0 {
				t.Fatal("no snapshot was sent to host 3")
			}
			for k, sm := range sms {
				if n := len(sm.values()); n != perGroup {
					t.Fatalf("host %d group %d applied %d values, want %d", k[0], k[1], n, perGroup)
				}
			}
			return rec
		}
	}
	t.Fatalf("seed %d: not finished: proposed %v, done %v", seed, proposed, done)
	return nil
}

// Manual mode is deterministic: two runs with the same seed apply the same
// entries, at the same indexes and terms, on the same hosts, in the same
// order.
func TestManualHostsDeterministic(t *testing.T) {
	for _, seed := range []int64{1, 2} {
		a := runManual(t, seed)
		b := runManual(t, seed)
		if len(a) == 0 {
			t.Fatal("nothing applied")
		}
		for i := range min(len(a), len(b)) {
			if a[i] != b[i] {
				t.Fatalf("seed %d: runs diverge at apply %d: %q vs %q", seed, i, a[i], b[i])
			}
		}
		if len(a) != len(b) {
			t.Fatalf("seed %d: %d applies, then %d", seed, len(a), len(b))
		}
		t.Logf("seed %d: %d applies, identical in both runs", seed, len(a))
	}
}

// A proposal raft discards before any Ready carries it (a new leader's
// append replaced it in the unstable log) fails promptly with
// ErrProposalDropped. The old code had its caller wait for its whole
// context, and an abandoned one stayed pending (with its data) forever.
func TestProposalDiscardedBeforeReadyFails(t *testing.T) {
	m := newManualTrio(t, 7, nil, 0, 0)
	net, quiesce, g := m.net, m.quiesce, m.g
	m.lead()
	// Host 1 goes silent (and hears nothing) while 2 and 3 elect a leader.
	net.mute = 1
	var lead uint64
	for round := 0; round < 200 && lead == 0; round++ {
		for _, id := range []uint64{2, 3} {
			net.hosts[id].Tick()
		}
		quiesce(2, 3)
		for _, id := range []uint64{2, 3} {
			if g(id).IsLeader() {
				lead = id
			}
		}
	}
	if lead == 0 {
		t.Fatal("no new leader among hosts 2 and 3")
	}
	// Host 1 still thinks it leads: it accepts a proposal into its
	// unstable log. Before it runs again, the new leader's append arrives.
	var got []error
	if err := g(1).ProposeAsync([]byte("doomed"), nil, func(_ Result, err error) { got = append(got, err) }); err != nil {
		t.Fatalf("ProposeAsync on the stale leader: %v", err)
	}
	net.mute = 0
	net.q = append(net.held, net.q...)
	net.held = nil
	net.deliver() // into host 1's inbox, ahead of its next Ready
	quiesce(1, 2, 3)
	if len(got) != 1 || !errors.Is(got[0], ErrProposalDropped) {
		t.Fatalf("callback results %v, want one ErrProposalDropped", got)
	}
	g(1).pmu.Lock()
	n := len(g(1).pending)
	g(1).pmu.Unlock()
	if n != 0 {
		t.Fatalf("%d proposals still pending", n)
	}
}

// TestProposalResultsAcrossRestart: proposals are matched to their entries
// by (host, sequence number). A restarted host must not reuse the sequence
// numbers of its previous incarnation: an entry that incarnation wrote but
// did not see committed is applied after the restart, and it must not
// finish a new proposal that happens to carry the same number with its own
// index and result (TestCrashRecovery saw it as an index "acknowledged
// twice" with different values).
func TestProposalResultsAcrossRestart(t *testing.T) {
	cryptotest.SetGlobalRandom(t, 11)
	fs := newMemFS()
	net := &fifoNet{hosts: map[uint64]*Host{}}
	start := func() (*Host, *Group, *kvSM) {
		h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/log"}, FS: fs, Transport: &fifoTransport{net: net, id: 1},
			Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: 1 << 30, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		sm := &kvSM{}
		g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: sm})
		if err != nil {
			t.Fatal(err)
		}
		return h, g, sm
	}
	quiesce := func(h *Host) {
		for range 1000 {
			if !h.Poll() {
				return
			}
		}
		t.Fatal("no quiescence")
	}
	// leader polls (and ticks) until the group knows it leads. It
	// proposes nothing meanwhile: a refused proposal uses a sequence
	// number too, and the test wants both incarnations to number alike.
	leader := func(h *Host, g *Group) {
		g.Campaign()
		for range 1000 {
			if g.IsLeader() {
				return
			}
			if !h.Poll() {
				h.Tick()
			}
		}
		t.Fatal("never the leader")
	}

	// First incarnation: one entry written to the log, not yet known to be
	// committed when the host stops.
	h, g, _ := start()
	leader(h, g)
	quiesce(h)
	var oldErr error
	if err := g.ProposeAsync([]byte("old"), nil, func(_ Result, err error) { oldErr = err }); err != nil {
		t.Fatal(err)
	}
	h.Poll() // the entry is written; its commit is not
	oldIndex := g.Status().Commit
	h.Close()
	if !errors.Is(oldErr, ErrOutcomeUnknown) {
		t.Fatalf("old proposal at close: %v, want ErrOutcomeUnknown", oldErr)
	}

	// Second incarnation: a proposal made before the old entry commits.
	h, g, sm := start()
	defer h.Close()
	leader(h, g)
	if sm.AppliedIndex() >= oldIndex {
		t.Fatalf("old entry %d already applied: the test needs it to commit after the new proposal", oldIndex)
	}
	var res []Result
	var errs []error
	if err := g.ProposeAsync([]byte("new"), nil, func(r Result, err error) { res, errs = append(res, r), append(errs, err) }); err != nil {
		t.Fatal(err)
	}
	quiesce(h)
	if vals := sm.values(); !equalStrings(vals, []string{"old", "new"}) {
		t.Fatalf("applied %q, want [old new]", vals)
	}
	if len(errs) != 1 || errs[0] != nil {
		t.Fatalf("new proposal: results %v errors %v, want one success", res, errs)
	}
	sm.mu.Lock()
	newIndex := sm.at[1]
	sm.mu.Unlock()
	if res[0].Index != newIndex || res[0].Value != 2 {
		t.Fatalf("new proposal finished with index %d value %v, want its own entry %d (value 2); the old entry was %d",
			res[0].Index, res[0].Value, newIndex, oldIndex)
	}
}

// TestProposalCoveredBySnapshotFinishes: a deposed leader's proposal that
// was appended (its index known) and is then covered by a snapshot from
// the new leader is never applied entry by entry here, so neither its
// result nor a replacing entry is ever seen. It must still finish
// (ErrOutcomeUnknown: the snapshot may or may not hold it), or its caller
// waits for its whole context and its inflight bytes are never returned,
// until the group's budget is gone and every proposal waits.
func TestProposalCoveredBySnapshotFinishes(t *testing.T) {
	m := newManualTrio(t, 5, nil, 4, 1)
	net, quiesce, g := m.net, m.quiesce, m.g
	m.lead()
	// Host 1 is cut off; its proposal enters its log and no one else's.
	net.down = 1
	var got []error
	if err := g(1).ProposeAsync([]byte("doomed"), nil, func(_ Result, err error) { got = append(got, err) }); err != nil {
		t.Fatalf("ProposeAsync: %v", err)
	}
	quiesce(1)
	var idx uint64
	g(1).pmu.Lock()
	for _, p := range g(1).pending {
		idx = p.index
	}
	g(1).pmu.Unlock()
	if idx == 0 {
		t.Fatal("the proposal's index is not known: the test needs it appended")
	}
	// Hosts 2 and 3 elect a leader, commit past that index and truncate
	// their logs, so host 1 can only catch up by a snapshot.
	var lead uint64
	for round := 0; round < 200 && lead == 0; round++ {
		net.hosts[2].Tick()
		net.hosts[3].Tick()
		quiesce(2, 3)
		for _, id := range []uint64{2, 3} {
			if g(id).IsLeader() {
				lead = id
			}
		}
	}
	if lead == 0 {
		t.Fatal("no new leader among hosts 2 and 3")
	}
	for i := range 20 {
		if err := g(lead).ProposeAsync([]byte(fmt.Sprintf("v%d", i)), nil, func(_ Result, err error) {
			if err != nil {
				t.Errorf("proposal %d: %v", i, err)
			}
		}); err != nil {
			t.Fatal(err)
		}
		quiesce(2, 3)
	}
	net.down = 0
	for round := 0; round < 200 && len(got) == 0; round++ {
		for id := uint64(1); id <= 3; id++ {
			net.hosts[id].Tick()
		}
		quiesce(1, 2, 3)
	}
	if testCounter(net.hosts[1].metrics.snapshotsReceived) == 0 {
		t.Fatal("host 1 received no snapshot: the test does not test what it says")
	}
	if len(got) != 1 || !errors.Is(got[0], ErrOutcomeUnknown) {
		t.Fatalf("callback results %v, want one ErrOutcomeUnknown", got)
	}
	g(1).pmu.Lock()
	n, inflight := len(g(1).pending), g(1).inflight
	g(1).pmu.Unlock()
	if n != 0 || inflight != 0 {
		t.Fatalf("%d proposals still pending, %d bytes in flight", n, inflight)
	}
}

// manualTrio is three manual hosts with one group (ID 1, a kvSM each) over
// a FIFO network: the common setup of the manual-mode tests.
type manualTrio struct {
	t   *testing.T
	net *fifoNet
}

// newManualTrio starts the hosts; fsFor gives each host's file system (nil:
// a fresh in-memory one) and compact sets CompactEvery/CompactKeep (0:
// defaults).
func newManualTrio(t *testing.T, seed uint64, fsFor func(id uint64) vfs.FS, compactEvery, compactKeep int) *manualTrio {
	t.Helper()
	// etcd raft draws its randomized election timeouts from crypto/rand.
	cryptotest.SetGlobalRandom(t, seed)
	m := &manualTrio{t: t, net: &fifoNet{hosts: map[uint64]*Host{}}}
	for id := uint64(1); id <= 3; id++ {
		var fs vfs.FS
		if fsFor != nil {
			fs = fsFor(id)
		}
		if fs == nil {
			fs = newMemFS()
		}
		h, err := NewHost(HostConfig{ID: id, LogDirs: []string{"/log"}, FS: fs, Transport: &fifoTransport{net: m.net, id: id},
			Manual: true, ElectionTicks: 10, HeartbeatTicks: 1, CompactEvery: compactEvery, CompactKeep: compactKeep, Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &kvSM{}}); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

// quiesce polls the given hosts and delivers messages until nothing moves.
func (m *manualTrio) quiesce(ids ...uint64) {
	m.t.Helper()
	for range 1000 {
		did := false
		for _, id := range ids {
			for m.net.hosts[id].Poll() {
				did = true
			}
		}
		if !m.net.deliver() && !did {
			return
		}
	}
	m.t.Fatal("no quiescence")
}

// g returns host id's group.
func (m *manualTrio) g(id uint64) *Group { gr, _ := m.net.hosts[id].Group(1); return gr }

// lead makes host 1 the leader.
func (m *manualTrio) lead() {
	m.t.Helper()
	m.g(1).Campaign()
	m.quiesce(1, 2, 3)
	if !m.g(1).IsLeader() {
		m.t.Fatal("host 1 did not become the leader")
	}
}

// TestProposalsOutlivedByNewLeaderFail: a stale leader appends three
// proposals nobody else has; the new leader's log is shorter (its empty
// entry replaces the first, nothing ever reaches the other two indexes:
// a quiet group). Once the new leader's entry commits, the other two can
// never commit either, and they fail promptly with ErrProposalDropped.
// The old code left them pending until their callers gave up, then
// answered outcome-unknown (CI, session 14: one of 200 groups in
// TestTCPManyGroupsSurviveHostLoss waited its whole 60 s).
func TestProposalsOutlivedByNewLeaderFail(t *testing.T) {
	m := newManualTrio(t, 11, nil, 0, 0)
	net, quiesce, g := m.net, m.quiesce, m.g
	m.lead()
	net.mute = 1
	var got []error
	for i := range 3 {
		if err := g(1).ProposeAsync([]byte(fmt.Sprintf("doomed-%d", i)), nil, func(_ Result, err error) { got = append(got, err) }); err != nil {
			t.Fatalf("ProposeAsync on the leader: %v", err)
		}
	}
	quiesce(1) // appended to host 1's log only
	g(1).pmu.Lock()
	known := len(g(1).byIndex)
	g(1).pmu.Unlock()
	if known != 3 {
		t.Fatalf("%d of 3 proposals appended on host 1", known)
	}
	var lead uint64
	for round := 0; round < 200 && lead == 0; round++ {
		for _, id := range []uint64{2, 3} {
			net.hosts[id].Tick()
		}
		quiesce(2, 3)
		for _, id := range []uint64{2, 3} {
			if g(id).IsLeader() {
				lead = id
			}
		}
	}
	if lead == 0 {
		t.Fatal("no new leader among hosts 2 and 3")
	}
	net.mute = 0
	net.q = append(net.held, net.q...)
	net.held = nil
	for round := 0; round < 20 && len(got) < 3; round++ {
		for id := uint64(1); id <= 3; id++ {
			net.hosts[id].Tick()
		}
		quiesce(1, 2, 3)
	}
	if len(got) != 3 {
		t.Fatalf("%d of 3 proposals answered (%v): the others still wait", len(got), got)
	}
	for i, err := range got {
		if !errors.Is(err, ErrProposalDropped) {
			t.Fatalf("proposal %d: %v, want ErrProposalDropped", i, err)
		}
	}
	for _, v := range g(1).sm.(*kvSM).values() {
		if strings.HasPrefix(v, "doomed") {
			t.Fatalf("host 1 applied %q", v)
		}
	}
}
