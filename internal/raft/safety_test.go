package raft

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// gatedSM is a dataSM whose WriteData blocks for entries whose metadata is
// "block" until the gate opens: it holds the store loop in step 2.
type gatedSM struct {
	dataSM
	entered chan struct{}
	gate    chan struct{}
	once    sync.Once
}

// release opens the gate (once).
func (s *gatedSM) release() { s.once.Do(func() { close(s.gate) }) }

func newGatedSM(t *testing.T) *gatedSM {
	return &gatedSM{dataSM: dataSM{dir: t.TempDir()}, entered: make(chan struct{}, 16), gate: make(chan struct{})}
}

func (s *gatedSM) WriteData(index, term uint64, meta, data []byte) error {
	if string(meta) == "block" {
		s.entered <- struct{}{}
		<-s.gate
	}
	return s.dataSM.WriteData(index, term, meta, data)
}

// singleHost starts one host (manual ticks) with a one-replica group that
// has made itself the leader.
func singleHost(t *testing.T, sm StateMachine) (*Host, *Group) {
	t.Helper()
	h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/log"}, FS: newMemFS(), Transport: NewMemNetwork(1).Transport(1),
		TickInterval: -1, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1}, StateMachine: sm})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Campaign(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "leadership", g.IsLeader)
	return h, g
}

// waitFor polls cond (a condition of another goroutine's progress).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// Scenario 4 of issue 11: a caller that gives up on a data proposal before
// the store loop reaches it must not take the data away from the loop (the
// old code stopped the group with "data of local proposal missing" while
// IsLeader stayed true).
func TestCanceledDataProposalStillWritten(t *testing.T) {
	sm := newGatedSM(t)
	_, g := singleHost(t, sm)
	t.Cleanup(sm.release) // before the host closes, even on failure

	// Hold the store loop inside WriteData of a first proposal.
	first := make(chan error, 1)
	go func() {
		_, err := g.Propose(testCtx(t), []byte("block"), []byte("first"))
		first <- err
	}()
	<-sm.entered

	// A second proposal whose caller gives up once it is in raft's log,
	// before the store loop reaches it.
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		defer cancel()
		for {
			g.pmu.Lock()
			n := len(g.pending)
			g.pmu.Unlock()
			if n == 2 {
				return
			}
			time.Sleep(time.Millisecond) // polling another goroutine's progress
		}
	}()
	_, err := g.Propose(ctx, []byte("abandoned"), []byte("payload"))
	if !errors.Is(err, ErrOutcomeUnknown) || !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned proposal: err = %v, want ErrOutcomeUnknown wrapping context.Canceled", err)
	}
	sm.release()
	if err := <-first; err != nil {
		t.Fatalf("first proposal: %v", err)
	}
	// The group keeps working, and the abandoned proposal did commit.
	res, err := g.Propose(testCtx(t), []byte("after"), []byte("more"))
	if err != nil {
		t.Fatalf("proposal after an abandoned one: %v (group stopped: %v)", err, g.Stopped())
	}
	if got := sm.values(); !equalStrings(got, []string{"block", "abandoned", "after"}) {
		t.Fatalf("applied %v", got)
	}
	if !g.IsLeader() || res.Index == 0 {
		t.Fatalf("leader %v, index %d", g.IsLeader(), res.Index)
	}
	g.localMu.Lock()
	n := len(g.local)
	g.localMu.Unlock()
	if n != 0 {
		t.Fatalf("%d local payloads kept after they were written", n)
	}
}

// A group that stops with a proposal in its log reports the outcome as
// unknown, not as a retryable ErrStopped (scenario 10), and from then on
// is visibly stopped: not the leader, proposals fail with ErrStopped.
func TestStoppedGroupOutcomeUnknownAndNotLeader(t *testing.T) {
	sm := newGatedSM(t)
	_, g := singleHost(t, sm)
	t.Cleanup(sm.release) // before the host closes, even on failure
	errc := make(chan error, 1)
	go func() {
		_, err := g.Propose(testCtx(t), []byte("block"), []byte("x"))
		errc <- err
	}()
	<-sm.entered
	g.fail(errors.New("test: injected fatal error"))
	err := <-errc
	if !errors.Is(err, ErrOutcomeUnknown) || errors.Is(err, ErrStopped) {
		t.Fatalf("proposal in the log of a stopped group: err = %v, want ErrOutcomeUnknown (and not ErrStopped)", err)
	}
	sm.release()
	if g.IsLeader() || g.Leader() != 0 || !g.Stopped() || g.Status().Role != "stopped" {
		t.Fatalf("stopped group: IsLeader %v, Leader %d, Stopped %v, Role %q", g.IsLeader(), g.Leader(), g.Stopped(), g.Status().Role)
	}
	if _, err := g.Propose(testCtx(t), []byte("later"), nil); !errors.Is(err, ErrStopped) || !strings.Contains(err.Error(), "injected fatal error") {
		t.Fatalf("proposal to a stopped group: %v, want ErrStopped naming the cause", err)
	}
}

// A context that ended before the proposal reached raft is a plain,
// retryable context error: the proposal never entered the log.
func TestExpiredContextNeverSubmits(t *testing.T) {
	sm := &kvSM{}
	_, g := singleHost(t, sm)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := g.Propose(ctx, []byte("never"), nil)
	if !errors.Is(err, context.Canceled) || errors.Is(err, ErrOutcomeUnknown) {
		t.Fatalf("err = %v, want context.Canceled and not ErrOutcomeUnknown", err)
	}
	if _, err := g.Propose(testCtx(t), []byte("after"), nil); err != nil {
		t.Fatal(err)
	}
	if got := sm.values(); !equalStrings(got, []string{"after"}) {
		t.Fatalf("applied %v", got)
	}
}

// blockingRestoreSM blocks its first Restore until released, so a second
// snapshot can arrive while the first is being restored.
type blockingRestoreSM struct {
	kvSM
	entered chan uint64
	gate    chan struct{}
	once    sync.Once
}

func (s *blockingRestoreSM) Restore(index uint64, r io.Reader) error {
	s.once.Do(func() {
		s.entered <- index
		<-s.gate
	})
	return s.kvSM.Restore(index, r)
}

func snapMsg(index, term uint64, vals []string) (*pb.Message, io.Reader) {
	at := make([]uint64, len(vals))
	for i := range at {
		at[i] = uint64(i + 2)
	}
	b, _ := json.Marshal(kvSnap{Applied: index, Vals: vals, At: at})
	typ := pb.MsgSnap
	m := &pb.Message{Type: &typ, From: proto.Uint64(2), To: proto.Uint64(1), Term: proto.Uint64(term),
		Snapshot: &pb.Snapshot{Metadata: &pb.SnapshotMetadata{Index: proto.Uint64(index), Term: proto.Uint64(term),
			ConfState: &pb.ConfState{Voters: []uint64{1, 2, 3}}}}}
	return m, bytes.NewReader(b)
}

// Scenario 3 / applied-index invariant: two snapshots that arrive
// newer-then-older must leave the state machine at the newer one. The old
// code compared each with raft's commit index before either was stepped,
// so both were restored and the state went back.
func TestOlderSnapshotNeverRestoredOverNewer(t *testing.T) {
	sm := &blockingRestoreSM{entered: make(chan uint64, 1), gate: make(chan struct{})}
	h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/log"}, FS: newMemFS(), Transport: NewMemNetwork(1).Transport(1),
		TickInterval: -1, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	g, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sm})
	if err != nil {
		t.Fatal(err)
	}
	newer := []string{"a", "b", "c", "d", "e"}
	errs := make(chan error, 2)
	go func() {
		m, body := snapMsg(6, 2, newer)
		errs <- g.receiveSnapshot(m, body)
	}()
	if idx := <-sm.entered; idx != 6 {
		t.Fatalf("restoring %d first", idx)
	}
	go func() {
		m, body := snapMsg(3, 2, newer[:2])
		errs <- g.receiveSnapshot(m, body)
	}()
	// The older snapshot is queued behind the newer one's restore.
	waitFor(t, "second snapshot queued", func() bool {
		g.aq.Lock()
		defer g.aq.Unlock()
		return len(g.aq.tasks) == 1
	})
	close(sm.gate)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if got := sm.values(); !equalStrings(got, newer) || sm.AppliedIndex() != 6 || g.applied.Load() != 6 {
		t.Fatalf("after snapshots at 6 then 3: values %v, state machine at %d, group applied %d", got, sm.AppliedIndex(), g.applied.Load())
	}
	if g.Stopped() {
		t.Fatal("group stopped")
	}
}

// The applied index never goes back: an attempt stops the group visibly
// instead of letting the state machine silently miss entries.
func TestAppliedIndexGoingBackStopsGroup(t *testing.T) {
	_, g := singleHost(t, &kvSM{})
	if _, err := g.Propose(testCtx(t), []byte("x"), nil); err != nil {
		t.Fatal(err)
	}
	cur := g.applied.Load()
	if g.setApplied(cur - 1) {
		t.Fatal("setApplied accepted a smaller index")
	}
	if !g.Stopped() || g.IsLeader() || g.applied.Load() != cur {
		t.Fatalf("stopped %v, leader %v, applied %d (was %d)", g.Stopped(), g.IsLeader(), g.applied.Load(), cur)
	}
}

// ProposeAsync works in the default (goroutine) mode: the callback gets
// the state machine's result, and a proposal still pending when the host
// closes gets ErrOutcomeUnknown from Close.
func TestProposeAsyncGoroutineMode(t *testing.T) {
	sm := newGatedSM(t)
	h, g := singleHost(t, sm)
	t.Cleanup(sm.release)
	type outcome struct {
		res Result
		err error
	}
	first := make(chan outcome, 1)
	if err := g.ProposeAsync([]byte("a"), nil, func(r Result, err error) { first <- outcome{r, err} }); err != nil {
		t.Fatal(err)
	}
	o := <-first
	if o.err != nil || o.res.Index == 0 || o.res.Value.(int) != 1 {
		t.Fatalf("first: %+v", o)
	}
	// Hold the loop in WriteData, then close the host under the proposal.
	second := make(chan outcome, 1)
	if err := g.ProposeAsync([]byte("block"), []byte("data"), func(r Result, err error) { second <- outcome{r, err} }); err != nil {
		t.Fatal(err)
	}
	<-sm.entered
	closed := make(chan error, 1)
	go func() { closed <- h.Close() }()
	o = <-second // delivered by Close, before the loop is released
	if !errors.Is(o.err, ErrOutcomeUnknown) {
		t.Fatalf("pending at Close: %v, want ErrOutcomeUnknown", o.err)
	}
	sm.release()
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
}

// A message etcd raft panics on (a heartbeat committing past this
// replica's log, as after a lost log) stops that group, visibly, and
// nothing else: the process and the host's other groups go on.
func TestStepPanicStopsOnlyThatGroup(t *testing.T) {
	h, err := NewHost(HostConfig{ID: 1, LogDirs: []string{"/log"}, FS: newMemFS(), Transport: NewMemNetwork(1).Transport(1),
		TickInterval: -1, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	victim, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &kvSM{}})
	if err != nil {
		t.Fatal(err)
	}
	other, err := h.AddGroup(GroupConfig{ID: 2, Peers: []uint64{1}, StateMachine: &kvSM{}})
	if err != nil {
		t.Fatal(err)
	}
	other.Campaign()
	waitFor(t, "leadership of group 2", other.IsLeader)
	typ := pb.MsgHeartbeat
	h.HandleMessages(2, []Outgoing{{Group: 1, Msg: &pb.Message{Type: &typ, From: proto.Uint64(2), To: proto.Uint64(1),
		Term: proto.Uint64(5), Commit: proto.Uint64(1000)}}})
	h.Tick() // steps whatever is still queued
	waitFor(t, "group 1 to stop", victim.Stopped)
	if testCounter(h.metrics.stepPanics) != 1 || victim.IsLeader() {
		t.Fatalf("step panics %v, leader %v", testCounter(h.metrics.stepPanics), victim.IsLeader())
	}
	if _, err := other.Propose(testCtx(t), []byte("still here"), nil); err != nil {
		t.Fatal(err)
	}
}
