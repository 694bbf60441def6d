package raft

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	etcdraft "go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// Group is one Raft group hosted on a Host.
type Group struct {
	host *Host
	id   uint64
	sm   StateMachine
	dsm  DataStateMachine // nil when the state machine keeps no data
	log  *groupLog
	loop *storeLoop

	// mu guards rn: etcd raft is not safe for concurrent use.
	mu sync.Mutex
	rn *etcdraft.RawNode

	stopc   chan struct{}
	stopped atomic.Bool
	// broken: etcd raft panicked in a call under mu (rawLocked); set
	// before mu is released, so that nothing calls into the RawNode again
	// (isStopped) before fail finishes the stop.
	broken atomic.Bool
	// failure is why the group stopped, when a fatal error stopped it.
	failure atomic.Pointer[error]
	applyWG sync.WaitGroup

	// Soft state as of the last Ready, readable without mu.
	leader atomic.Uint64
	term   atomic.Uint64
	role   atomic.Value // string

	// applied is the index of the last entry handed to the state machine.
	applied atomic.Uint64

	// Apply queue: committed entries and snapshot work, run in order on
	// the group's apply goroutine. At most maxApplyBacklog entries wait in
	// memory; past that, committed entries are held back in the log (a
	// task with only a range) and read from it when the state machine
	// catches up, so a slow state machine never stops the group's Ready
	// (heartbeats, votes, appends) from being processed.
	aq struct {
		sync.Mutex
		tasks   []applyTask
		entries int
		signal  chan struct{}
	}

	// inbox holds inbound messages until the store loop steps them (under
	// mu, in ready): the transport never waits for a group's lock.
	inbox struct {
		sync.Mutex
		msgs []*pb.Message
	}

	// readies counts the Readies taken (under mu). A proposal made while
	// readies == e is in Ready e's entries unless raft discarded it before
	// that Ready (see sweepDiscarded).
	readies uint64

	// sendq holds MsgApps waiting for their entries' data (hydrateMessage,
	// which may read the disk) before they go to the transport, drained by
	// one worker per group so a slow ReadData delays only this group.
	sendq struct {
		sync.Mutex
		msgs    []*pb.Message
		running bool
	}

	// Proposals waiting for their entry to be applied, and inflight bytes.
	pmu           sync.Mutex
	pending       map[uint64]*proposal // by seq
	byIndex       map[uint64]uint64    // log index → seq, once known
	appliedTerm   uint64               // the term of the last entry applied (pmu)
	inflight      int
	inflightWait  chan struct{} // closed and replaced when inflight drops
	reads         map[uint64]*readReq
	rb            readBatcher // ReadIndex calls sharing barriers
	appliedWaiter []appliedWait
	// Leader only: applied index each replica reported.
	followerApplied map[uint64]uint64
	appliedChanged  chan struct{} // closed and replaced on any change
	voters          []uint64
	confState       *pb.ConfState
	lastSentApplied atomic.Uint64
	ticks           atomic.Uint64

	cache dataCache

	// local holds the data of this host's proposals (fmtLocal entries)
	// until WriteData has stored it, by proposal sequence number. Its
	// lifetime is the entry's, not the proposer's: a caller that stops
	// waiting does not take the data away from the store loop.
	localMu sync.Mutex
	local   map[uint64]localData

	// doneq holds finished asynchronous proposals whose callbacks have not
	// run yet (under pmu); deliver runs them outside the locks.
	doneq []*proposal
	// unseen lists, in submission order (so by epoch), the proposals no
	// Ready has carried yet (under pmu). See sweepDiscarded.
	unseen []*proposal
}

type localData struct {
	data  []byte
	epoch uint64 // g.readies when proposed
}

type proposal struct {
	seq   uint64
	size  int
	index uint64
	term  uint64              // the term of its entry, with index
	done  chan struct{}       // closed when finished (Propose)
	cb    func(Result, error) // or called through deliver (ProposeAsync)
	res   Result
	err   error
	epoch uint64 // g.readies when handed to raft
}

type readReq struct {
	done  chan struct{}
	index uint64
}

type appliedWait struct {
	index uint64
	done  chan struct{}
}

type applyTask struct {
	ents []*pb.Entry
	// lo..hi, when hi != 0: committed entries held back in the log, to be
	// read from it when this task runs.
	lo, hi  uint64
	snap    chan snapshotResult
	restore *restoreTask
}

type restoreTask struct {
	m    *pb.Message
	body io.Reader
	done chan error
}

type snapshotResult struct {
	index uint64
	term  uint64
	conf  *pb.ConfState
	body  io.ReadCloser
	err   error
}

// maxApplyBacklog bounds the committed-but-unapplied entries a group keeps
// in memory. Beyond it, newly committed entries stay in the log only and
// the apply goroutine reads them back (applyTask.lo/hi). The log is never
// truncated past the applied index, so they are there; proposers are held
// back by MaxInflightBytes, which counts a proposal until it is applied.
// A variable so tests can make it small.
var maxApplyBacklog = 4096

// maxInbox bounds the inbound messages waiting for a group's store loop;
// beyond it messages are dropped (raft resends).
const maxInbox = 4096

// maxSendQueue bounds the MsgApps waiting for hydration per group; beyond
// it they are dropped (raft resends). Each may carry up to
// maxHydratedBytes of data once hydrated.
const maxSendQueue = 1024

func newGroup(h *Host, loop *storeLoop, gl *groupLog, cfg GroupConfig) (*Group, error) {
	g := &Group{
		host: h, id: cfg.ID, sm: cfg.StateMachine, log: gl, loop: loop,
		stopc:           make(chan struct{}),
		pending:         make(map[uint64]*proposal),
		byIndex:         make(map[uint64]uint64),
		reads:           make(map[uint64]*readReq),
		followerApplied: make(map[uint64]uint64),
		appliedChanged:  make(chan struct{}),
		inflightWait:    make(chan struct{}),
		local:           make(map[uint64]localData),
	}
	g.cache.max = 8 << 20
	g.dsm, _ = cfg.StateMachine.(DataStateMachine)
	g.aq.signal = make(chan struct{}, 1)
	g.role.Store("follower")

	hs, cs, _ := gl.InitialState()
	applied := cfg.StateMachine.AppliedIndex()
	if applied < gl.truncIndex {
		applied = gl.truncIndex
	}
	if applied > hs.GetCommit() {
		// The state machine may be ahead of the last synced commit index
		// after a restored snapshot; raft may not start past its commit.
		g.applied.Store(applied)
		applied = hs.GetCommit()
	} else {
		g.applied.Store(applied)
	}
	g.confState = cs
	g.voters = append([]uint64(nil), cs.GetVoters()...)
	rn, err := newRawNode(h, loop, cfg.ID, &etcdraft.Config{
		ID:                        h.id,
		ElectionTick:              h.cfg.ElectionTicks,
		HeartbeatTick:             h.cfg.HeartbeatTicks,
		Storage:                   gl,
		Applied:                   applied,
		MaxSizePerMsg:             1 << 20,
		MaxCommittedSizePerReady:  64 << 20,
		MaxInflightMsgs:           256,
		CheckQuorum:               true,
		PreVote:                   true,
		DisableProposalForwarding: true,
		Logger:                    raftLogger{h.log.With("group", cfg.ID)},
	})
	if err != nil {
		return nil, fmt.Errorf("raft: group %d: %w", cfg.ID, err)
	}
	g.rn = rn
	if !h.cfg.Manual {
		g.applyWG.Add(1)
		go g.applyLoop()
	}
	return g, nil
}

// ID is the group's ID.
func (g *Group) ID() uint64 { return g.id }

// Leader is the leader's host ID as last seen, 0 if unknown.
func (g *Group) Leader() uint64 { return g.leader.Load() }

// IsLeader reports whether this host leads the group. A stopped group is
// never the leader.
func (g *Group) IsLeader() bool { return !g.isStopped() && g.leader.Load() == g.host.id }

// Stopped reports whether the group was stopped (closed, or after a fatal
// error); it then accepts nothing (ErrStopped) until re-added.
func (g *Group) Stopped() bool { return g.isStopped() }

func (g *Group) isStopped() bool { return g.stopped.Load() || g.broken.Load() }

// stop stops the group for good. Proposals already handed to raft fail
// with ErrOutcomeUnknown: they may have committed (or may yet, on the other
// replicas).
func (g *Group) stop() {
	if !g.stopped.CompareAndSwap(false, true) {
		return
	}
	close(g.stopc)
	// Under mu so that no Ready taken concurrently publishes a leader after
	// this: a stopped group must look stopped, never like a leader.
	g.mu.Lock()
	g.leader.Store(0)
	g.role.Store("stopped")
	g.mu.Unlock()
	g.localMu.Lock()
	clear(g.local)
	g.localMu.Unlock()
	g.pmu.Lock()
	g.appliedWaiter = nil                       // each returns ErrStopped (stopc)
	for _, seq := range sortedKeys(g.pending) { // deterministic callback order
		g.finish(seq, Result{}, fmt.Errorf("raft: group %d stopped with the proposal in its log: %w", g.id, ErrOutcomeUnknown))
	}
	g.pmu.Unlock()
	g.deliver()
}

func sortedKeys[V any](m map[uint64]V) []uint64 {
	ks := make([]uint64, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Slice(ks, func(i, j int) bool { return ks[i] < ks[j] })
	return ks
}

// failIfBroken finishes the stop of a group that rawLocked marked broken
// (call it after releasing mu).
func (g *Group) failIfBroken() {
	if g.broken.Load() && !g.stopped.Load() {
		err := error(fmt.Errorf("raft: group %d: etcd raft panicked", g.id))
		if f := g.failure.Load(); f != nil {
			err = *f
		}
		g.fail(err)
	}
}

// proposeConfChangeLocked proposes cc; mu must be held.
func (g *Group) proposeConfChangeLocked(cc *pb.ConfChange) error {
	var perr error
	if err := g.rawLocked("propose conf change", func() { perr = g.rn.ProposeConfChange(cc) }); err != nil {
		return err
	}
	if perr != nil {
		return fmt.Errorf("raft: group %d: membership change: %v: %w", g.id, perr, ErrProposalDropped)
	}
	return nil
}

// fail stops the group after an error it cannot continue from (a state
// machine that cannot store data, a violated invariant), loudly.
func (g *Group) fail(err error) {
	if g.stopped.Load() {
		return
	}
	g.host.log.Error("group stopped after a fatal error", "group", g.id, "err", err)
	g.host.metrics.groupFailures.Inc()
	g.failure.CompareAndSwap(nil, &err)
	g.stop()
}

// stoppedError says that the group is stopped, and why if it failed.
func (g *Group) stoppedError() error {
	if f := g.failure.Load(); f != nil {
		return fmt.Errorf("raft: group %d stopped after a fatal error (%v); it accepts nothing until the host restarts it: %w", g.id, *f, ErrStopped)
	}
	return fmt.Errorf("raft: group %d: %w", g.id, ErrStopped)
}

// assertf stops the group when an invariant does not hold: continuing
// could corrupt the state machine or acknowledge what is not stored.
func (g *Group) assertf(ok bool, format string, args ...any) bool {
	if !ok {
		g.fail(fmt.Errorf("raft: group %d: invariant violated: "+format, append([]any{g.id}, args...)...))
	}
	return ok
}

// Propose replicates (meta, data) and returns once the entry is applied on
// this host, with the state machine's result. data may be nil; for a
// DataStateMachine non-nil data is kept out of the log. data is handed
// over: raft and the state machine keep references to it, so the caller
// must never modify it afterwards. Only the leader accepts proposals
// (*NotLeaderError otherwise).
//
// Errors that say the proposal never entered the log (ErrNotLeader,
// ErrStopped, ErrProposalDropped, ErrTooLarge) are safe to retry. Once it
// was handed to raft, giving up (ctx ends, the group stops, leadership is
// lost) returns ErrOutcomeUnknown: the entry may still commit. ctx only
// bounds the caller's wait; the entry and its data stay until the store
// loop has written them.
func (g *Group) Propose(ctx context.Context, meta, data []byte) (Result, error) {
	size, err := g.checkProposal(meta, data)
	if err != nil {
		return Result{}, err
	}
	if err := g.acquire(ctx, size); err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		// Not handed to raft yet: a plain (retryable) context error, not
		// an unknown outcome.
		g.pmu.Lock()
		g.releaseLocked(size)
		g.pmu.Unlock()
		return Result{}, fmt.Errorf("raft: group %d: proposal not submitted: %w", g.id, err)
	}
	p := &proposal{size: size, done: make(chan struct{})}
	start := time.Now()
	if err := g.submit(p, meta, data); err != nil {
		return Result{}, err
	}
	select {
	case <-p.done:
		if p.err == nil {
			g.host.metrics.commitLatency.Observe(time.Since(start).Seconds())
		}
		return p.res, p.err
	case <-ctx.Done():
		// The proposal stays pending (its inflight bytes too) until its
		// outcome is known; only this caller stops waiting for it.
		return Result{}, fmt.Errorf("raft: group %d: stopped waiting for a proposal already in the log: %w (%w)", g.id, ErrOutcomeUnknown, ctx.Err())
	}
}

// ProposeMany proposes several entries at once, each as Propose would
// (metas[i] with datas[i]), and waits for all of them: errs[i] is entry
// i's outcome, with Propose's meaning. The entries are handed to raft
// together under one lock with one wake-up of the store loop, so they
// land in the same Ready (one log append and fsync, one data Sync round,
// the same appends to the followers) instead of racing the loop one by
// one. Each entry keeps its own index, term and apply.
//
// Like Propose, an entry waits (bounded by ctx) for the inflight budget it
// needs. When an entry does not fit, the batch's earlier entries, which
// hold budget, are handed to raft first: their commits free budget, so the
// wait cannot be for entries of this call that nobody would submit (an
// entry larger than what is free waits for them to apply, as one Propose
// after another would). Nothing is locked while it waits. An entry still
// without budget when ctx ends fails with ctx's error, never as dropped.
func (g *Group) ProposeMany(ctx context.Context, metas, datas [][]byte) ([]Result, []error) {
	n := len(metas)
	res, errs := make([]Result, n), make([]error, n)
	ps := make([]*proposal, n)
	start := time.Now()
	// chunk: entries holding budget, not yet handed to raft.
	chunk := make([]int, 0, n)
	for i := range metas {
		size, err := g.checkProposal(metas[i], datas[i])
		if err != nil {
			errs[i] = err
			continue
		}
		if !g.tryAcquire(size) {
			g.submitMany(chunk, ps, metas, datas, errs)
			chunk = chunk[:0]
			if err := g.acquire(ctx, size); err != nil {
				errs[i] = err
				continue
			}
		}
		if err := ctx.Err(); err != nil {
			g.pmu.Lock()
			g.releaseLocked(size)
			g.pmu.Unlock()
			errs[i] = fmt.Errorf("raft: group %d: proposal not submitted: %w", g.id, err)
			continue
		}
		ps[i] = &proposal{size: size, done: make(chan struct{}), seq: g.host.seq.Add(1)}
		chunk = append(chunk, i)
	}
	g.submitMany(chunk, ps, metas, datas, errs)
	for i, p := range ps {
		if p == nil {
			continue
		}
		select {
		case <-p.done:
			if p.err == nil {
				g.host.metrics.commitLatency.Observe(time.Since(start).Seconds())
			}
			res[i], errs[i] = p.res, p.err
		case <-ctx.Done():
			select {
			case <-p.done: // done before ctx ended (as while a later entry waited for budget)
				res[i], errs[i] = p.res, p.err
				continue
			default:
			}
			errs[i] = fmt.Errorf("raft: group %d: stopped waiting for a proposal already in the log: %w (%w)", g.id, ErrOutcomeUnknown, ctx.Err())
		}
	}
	return res, errs
}

// ProposeManyAsync is ProposeMany without blocking, as ProposeAsync is
// Propose's: the entries that can be proposed are handed to raft together
// (one lock, one wake-up of the store loop, so one Ready), and done(i, ...)
// is called once with entry i's outcome, as ProposeAsync's done. errs[i]
// non-nil says entry i was not proposed (done is never called for it);
// over the inflight budget an entry fails at once (ErrProposalDropped).
// The deterministic simulator proposes batches of small files with it.
func (g *Group) ProposeManyAsync(metas, datas [][]byte, done func(i int, res Result, err error)) []error {
	n := len(metas)
	errs := make([]error, n)
	ps := make([]*proposal, n)
	idx := make([]int, 0, n)
	for i := range metas {
		size, err := g.checkProposal(metas[i], datas[i])
		if err == nil && !g.tryAcquire(size) {
			err = fmt.Errorf("raft: group %d: %d proposal bytes in flight, limit %d: %w", g.id, g.inflightBytes(), g.host.cfg.MaxInflightBytes, ErrProposalDropped)
		}
		if err != nil {
			errs[i] = err
			continue
		}
		ps[i] = &proposal{size: size, seq: g.host.seq.Add(1), cb: func(res Result, err error) { done(i, res, err) }}
		idx = append(idx, i)
	}
	g.submitMany(idx, ps, metas, datas, errs)
	return errs
}

// submitMany hands ProposeMany's entries idx (each ps[i] holding its
// inflight bytes) to raft under one lock and wakes the store loop once. An
// entry that does not enter the log gets its error in errs, its ps[i]
// cleared and its bytes released.
func (g *Group) submitMany(idx []int, ps []*proposal, metas, datas [][]byte, errs []error) {
	if len(idx) == 0 {
		return
	}
	payloads := make([][]byte, len(idx))
	for j, i := range idx {
		payloads[j] = g.payload(ps[i], metas[i], datas[i])
	}
	submitted := 0
	var release []int
	g.mu.Lock()
	gerr := g.admitLocked()
	for j, i := range idx {
		p := ps[i]
		err := gerr
		if err == nil {
			err = g.enterLocked(p, payloads[j], datas[i])
		}
		if err != nil {
			errs[i], ps[i] = err, nil
			release = append(release, p.size)
			continue
		}
		submitted++
	}
	g.mu.Unlock()
	g.failIfBroken()
	if len(release) > 0 {
		g.pmu.Lock()
		for _, size := range release {
			g.releaseLocked(size)
		}
		g.pmu.Unlock()
	}
	if submitted > 0 {
		g.host.metrics.proposals.WithLabelValues(g.label()).Add(float64(submitted))
		g.loop.notify(g)
	}
}

// ProposeAsync is Propose without blocking: done is called once with the
// outcome (from the apply goroutine, or from Host.Poll in manual mode, or
// when the group stops). When ProposeAsync returns an error, done is never
// called. Over the inflight budget it fails at once (ErrProposalDropped)
// instead of waiting. done must not block; it may call into the Group.
func (g *Group) ProposeAsync(meta, data []byte, done func(Result, error)) error {
	size, err := g.checkProposal(meta, data)
	if err != nil {
		return err
	}
	if !g.tryAcquire(size) {
		return fmt.Errorf("raft: group %d: %d proposal bytes in flight, limit %d: %w", g.id, g.inflightBytes(), g.host.cfg.MaxInflightBytes, ErrProposalDropped)
	}
	return g.submit(&proposal{size: size, cb: done}, meta, data)
}

func (g *Group) checkProposal(meta, data []byte) (int, error) {
	size := len(meta) + len(data)
	if size > g.host.cfg.MaxProposalBytes {
		return 0, fmt.Errorf("raft: group %d: proposal of %d bytes exceeds %d: %w", g.id, size, g.host.cfg.MaxProposalBytes, ErrTooLarge)
	}
	if data != nil && g.dsm == nil {
		return 0, fmt.Errorf("raft: group %d: proposal carries data but the state machine does not implement DataStateMachine", g.id)
	}
	return size, nil
}

// submit hands p to raft. On error the proposal certainly did not enter the
// log and its inflight bytes (reserved by the caller) are released.
func (g *Group) submit(p *proposal, meta, data []byte) error {
	p.seq = g.host.seq.Add(1)
	payload := g.payload(p, meta, data)
	g.mu.Lock()
	err := g.admitLocked()
	if err == nil {
		err = g.enterLocked(p, payload, data)
	}
	g.mu.Unlock()
	g.failIfBroken()
	if err != nil {
		g.pmu.Lock()
		g.releaseLocked(p.size)
		g.pmu.Unlock()
		return err
	}
	g.host.metrics.proposals.WithLabelValues(g.label()).Inc()
	g.loop.notify(g)
	return nil
}

// payload is what the log carries for p: meta and, with data, only its
// length (the data itself stays local until the Ready writes it).
func (g *Group) payload(p *proposal, meta, data []byte) []byte {
	if data != nil {
		return encodeLocal(proposalID{g.host.id, p.seq}, meta, len(data))
	}
	return encodeProposal(proposalID{g.host.id, p.seq}, meta, nil, false)
}

// admitLocked says whether this group takes proposals now (running, and
// the leader). Caller holds mu.
func (g *Group) admitLocked() error {
	if g.isStopped() {
		return g.stoppedError()
	}
	if st := g.rn.BasicStatus(); st.RaftState != etcdraft.StateLeader {
		return &NotLeaderError{Group: g.id, Leader: st.Lead}
	}
	return nil
}

// enterLocked proposes p's payload to raft and makes p pending; on error
// p did not enter the log (its inflight bytes are the caller's to
// release). Caller holds mu (lock order mu → pmu: nothing can finish or
// fail the proposal before it is pending).
func (g *Group) enterLocked(p *proposal, payload, data []byte) error {
	if data != nil {
		// Before raft sees the entry: the next Ready may carry it.
		g.localMu.Lock()
		g.local[p.seq] = localData{data: data, epoch: g.readies}
		g.localMu.Unlock()
	}
	var perr error
	if err := g.rawLocked("propose", func() { perr = g.rn.Propose(payload) }); err != nil {
		// Broken: the entry was never saved nor sent, and never will be;
		// the caller stops the group after releasing mu (failIfBroken).
		g.dropLocal(p.seq)
		return err
	}
	if perr != nil {
		g.dropLocal(p.seq)
		return fmt.Errorf("raft: group %d: %v: %w", g.id, perr, ErrProposalDropped)
	}
	p.epoch = g.readies
	g.pmu.Lock()
	g.pending[p.seq] = p
	g.unseen = append(g.unseen, p)
	g.pmu.Unlock()
	return nil
}

// acquire reserves inflight bytes, blocking while the group is over its
// budget: a slow group slows its proposers, not the host.
func (g *Group) acquire(ctx context.Context, size int) error {
	limit := g.host.cfg.MaxInflightBytes
	for {
		g.pmu.Lock()
		if g.inflight == 0 || g.inflight+size <= limit {
			g.inflight += size
			g.pmu.Unlock()
			return nil
		}
		wait := g.inflightWait
		g.pmu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return fmt.Errorf("raft: group %d: waiting for inflight budget: %w", g.id, ctx.Err())
		case <-g.stopc:
			return ErrStopped
		}
	}
}

func (g *Group) label() string { return fmt.Sprint(g.id) }

// tryAcquire is acquire without waiting.
func (g *Group) tryAcquire(size int) bool {
	g.pmu.Lock()
	defer g.pmu.Unlock()
	if g.inflight == 0 || g.inflight+size <= g.host.cfg.MaxInflightBytes {
		g.inflight += size
		return true
	}
	return false
}

func (g *Group) inflightBytes() int {
	g.pmu.Lock()
	defer g.pmu.Unlock()
	return g.inflight
}

// releaseLocked returns inflight bytes; pmu must be held.
func (g *Group) releaseLocked(size int) {
	g.inflight -= size
	close(g.inflightWait)
	g.inflightWait = make(chan struct{})
}

func (g *Group) dropLocal(seq uint64) {
	g.localMu.Lock()
	delete(g.local, seq)
	g.localMu.Unlock()
}

func (g *Group) takeLocal(seq uint64) ([]byte, bool) {
	g.localMu.Lock()
	defer g.localMu.Unlock()
	d, ok := g.local[seq]
	return d.data, ok
}

// sweepDiscarded runs after the Ready numbered epoch was written. Every
// entry raft appended before that Ready was taken is in it or in an
// earlier one (a Ready carries all unstable entries). So a proposal made
// before it whose entry no Ready carried was discarded by raft before it
// was appended (a new leader's entries replaced it): nothing was sent or
// stored, it certainly failed. Its data, if any, is released; without
// this its caller would wait for its whole context (or forever, for an
// abandoned one).
func (g *Group) sweepDiscarded(epoch uint64) {
	g.localMu.Lock()
	for seq, d := range g.local {
		if d.epoch <= epoch {
			delete(g.local, seq)
		}
	}
	g.localMu.Unlock()
	g.pmu.Lock()
	n := 0
	for n < len(g.unseen) && g.unseen[n].epoch <= epoch {
		p := g.unseen[n]
		g.unseen[n] = nil
		n++
		if p.index == 0 {
			g.finish(p.seq, Result{}, fmt.Errorf("raft: group %d: proposal discarded by raft before it was appended: %w", g.id, ErrProposalDropped))
		}
	}
	g.unseen = g.unseen[n:]
	if len(g.unseen) == 0 {
		g.unseen = nil // let the backing array go
	}
	g.pmu.Unlock()
	g.deliver()
}

// finish reports a proposal's outcome; pmu must be held. Its data (in
// local) is not touched: that belongs to the entry, not to the caller.
// Callbacks of asynchronous proposals run later, in deliver.
func (g *Group) finish(seq uint64, res Result, err error) {
	p, ok := g.pending[seq]
	if !ok {
		return
	}
	delete(g.pending, seq)
	if p.index != 0 {
		delete(g.byIndex, p.index)
	}
	g.releaseLocked(p.size)
	p.res, p.err = res, err
	if p.cb != nil {
		g.doneq = append(g.doneq, p)
		return
	}
	close(p.done)
}

// deliver runs the callbacks of finished asynchronous proposals, with no
// lock held.
func (g *Group) deliver() {
	g.pmu.Lock()
	q := g.doneq
	g.doneq = nil
	g.pmu.Unlock()
	for _, p := range q {
		p.cb(p.res, p.err)
	}
}

// dropOutlived fails the proposals of ours that can never commit once an
// entry of term has committed at index k: those at k or above with an
// older term. Every entry of such a proposal's log up to its index had
// that older term, so no log holding the committed entry at k holds it
// (log matching), and every later leader holds the committed entry.
// Without this, a proposal whose entry a new leader's shorter log cut away
// (and no later entry ever reached its index: a quiet group) waited for
// its caller's whole deadline and then answered outcome-unknown. pmu held;
// runs once per term change.
func (g *Group) dropOutlived(k, term uint64) {
	for idx, seq := range g.byIndex {
		if idx < k {
			continue
		}
		if p := g.pending[seq]; p != nil && p.term < term {
			g.finish(seq, Result{}, fmt.Errorf("raft: group %d: entry %d (term %d) outlived by entry %d of term %d committed by a new leader: %w", g.id, idx, p.term, k, term, ErrProposalDropped))
		}
	}
}

// recordProposalIndexes learns the log index of this host's proposals as
// they are appended, so a proposal overwritten by another leader's entry
// fails promptly instead of waiting for its context.
func (g *Group) recordProposalIndexes(ents []*pb.Entry) {
	if len(ents) == 0 {
		return
	}
	g.pmu.Lock()
	defer g.pmu.Unlock()
	if len(g.pending) == 0 {
		return
	}
	for _, e := range ents {
		if !isNormalWithPayload(e) || len(e.GetData()) < headerLen {
			continue
		}
		d := e.GetData()
		if binary.BigEndian.Uint64(d[1:]) != g.host.id {
			continue
		}
		seq := binary.BigEndian.Uint64(d[9:])
		if p, ok := g.pending[seq]; ok {
			p.index, p.term = e.GetIndex(), e.GetTerm()
			g.byIndex[e.GetIndex()] = seq
		}
	}
}

// ReadIndex returns once this replica has applied everything that was
// committed when it was called, as confirmed by the leader: reads of the
// state machine after it are linearizable.
//
// Concurrent calls share barriers: a call joins the next barrier to be
// sent (never one already in flight, which may have been confirmed before
// the call arrived), and one barrier is in flight at a time, so N reads
// arriving together cost one ReadIndex (one heartbeat round on a
// multi-node group) instead of N. ReadBarriers counts the barriers sent.
func (g *Group) ReadIndex(ctx context.Context) error {
	if g.host.cfg.Manual {
		// Deterministic tests drive the host by hand: no runner goroutine.
		idx, err := g.readIndexOnce(ctx)
		if err != nil {
			return err
		}
		return g.WaitApplied(ctx, idx)
	}
	for {
		g.rb.mu.Lock()
		b := g.rb.next
		if b == nil {
			b = &readBatch{done: make(chan struct{})}
			g.rb.next = b
		}
		if !g.rb.running {
			g.rb.running = true
			go g.runReadBatches()
		}
		g.rb.mu.Unlock()
		select {
		case <-b.done:
		case <-ctx.Done():
			return fmt.Errorf("raft: group %d: read index: %w", g.id, ctx.Err())
		case <-g.stopc:
			return ErrStopped
		}
		if errors.Is(b.err, errBarrierTimeout) {
			// The barrier got no answer in its time, not this call's
			// deadline: join the next one while ctx allows (it fails at
			// once with a NotLeaderError if this replica knows no leader
			// by then).
			continue
		}
		if b.err != nil {
			return b.err
		}
		return g.WaitApplied(ctx, b.index)
	}
}

// errBarrierTimeout fails the calls of a barrier that got no answer in
// its time; ReadIndex has them join the next barrier.
var errBarrierTimeout = errors.New("read barrier got no answer")

// readBatch is one shared read barrier and the calls waiting for it.
type readBatch struct {
	done  chan struct{} // closed once index or err is set
	index uint64
	err   error
}

// readBatcher queues the calls of ReadIndex for the next barrier.
type readBatcher struct {
	mu      sync.Mutex
	next    *readBatch // calls waiting for a barrier not yet sent
	running bool       // runReadBatches is sending barriers
	sent    atomic.Uint64
}

// ReadBarriers returns the number of read barriers this replica has sent
// (ReadIndex calls share them).
func (g *Group) ReadBarriers() uint64 { return g.rb.sent.Load() }

// runReadBatches sends the queued batch's barrier, one at a time, until
// no call waits. A barrier that gets no answer (leadership lost; raft
// drops the request) gives up after two election timeouts, so the calls
// behind it go on to the next one; its own calls join that one too.
func (g *Group) runReadBatches() {
	timeout := 2 * time.Duration(g.host.cfg.ElectionTicks) * g.host.cfg.TickInterval
	switch {
	case g.host.cfg.TickInterval <= 0:
		timeout = 30 * time.Second // ticks driven by the test
	case timeout < time.Second:
		timeout = time.Second
	}
	for {
		g.rb.mu.Lock()
		b := g.rb.next
		if b == nil {
			g.rb.running = false
			g.rb.mu.Unlock()
			return
		}
		g.rb.next = nil
		g.rb.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		b.index, b.err = g.readIndexOnce(ctx)
		if b.err != nil && ctx.Err() != nil && !errors.Is(b.err, ErrStopped) {
			b.err = fmt.Errorf("raft: group %d: %w after %v", g.id, errBarrierTimeout, timeout)
		}
		cancel()
		close(b.done)
	}
}

// readIndexOnce sends one barrier and returns the index it confirmed.
func (g *Group) readIndexOnce(ctx context.Context) (uint64, error) {
	g.rb.sent.Add(1)
	var rctx [8]byte
	key := g.host.seq.Add(1)
	binary.BigEndian.PutUint64(rctx[:], key)
	r := &readReq{done: make(chan struct{})}
	g.pmu.Lock()
	g.reads[key] = r
	g.pmu.Unlock()
	defer func() {
		g.pmu.Lock()
		delete(g.reads, key)
		g.pmu.Unlock()
	}()
	g.mu.Lock()
	if g.isStopped() {
		g.mu.Unlock()
		return 0, ErrStopped
	}
	st := g.rn.BasicStatus()
	if st.Lead == 0 {
		g.mu.Unlock()
		return 0, &NotLeaderError{Group: g.id}
	}
	if err := g.rawLocked("read index", func() { g.rn.ReadIndex(rctx[:]) }); err != nil {
		g.mu.Unlock()
		g.fail(err)
		return 0, g.stoppedError()
	}
	g.mu.Unlock()
	g.loop.notify(g)
	select {
	case <-r.done:
	case <-ctx.Done():
		return 0, fmt.Errorf("raft: group %d: read index: %w", g.id, ctx.Err())
	case <-g.stopc:
		return 0, ErrStopped
	}
	return r.index, nil
}

// WaitApplied returns once this replica has applied index.
func (g *Group) WaitApplied(ctx context.Context, index uint64) error {
	if g.applied.Load() >= index {
		return nil
	}
	done := make(chan struct{})
	g.pmu.Lock()
	if g.applied.Load() >= index {
		g.pmu.Unlock()
		return nil
	}
	g.appliedWaiter = append(g.appliedWaiter, appliedWait{index: index, done: done})
	g.pmu.Unlock()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		g.dropAppliedWaiter(done)
		return fmt.Errorf("raft: group %d: waiting to apply %d (applied %d): %w", g.id, index, g.applied.Load(), ctx.Err())
	case <-g.stopc:
		g.dropAppliedWaiter(done)
		return ErrStopped
	}
}

// dropAppliedWaiter removes the waiter of a WaitApplied that gave up, so
// the list holds only the callers still waiting (an index never reached
// must not leave its waiter behind for good).
func (g *Group) dropAppliedWaiter(done chan struct{}) {
	g.pmu.Lock()
	defer g.pmu.Unlock()
	for i, w := range g.appliedWaiter {
		if w.done == done {
			g.appliedWaiter = slices.Delete(g.appliedWaiter, i, i+1)
			return
		}
	}
}

// LastIndex is the index of the last entry in this replica's log (not
// necessarily durable or committed yet).
func (g *Group) LastIndex() uint64 {
	last, _ := g.log.LastIndex()
	return last
}

// AppliedAll is the non-blocking form of WaitAppliedAll: it reports
// whether every voter has applied index and, if not, the replicas that lag
// with the applied index each reported. Meaningful on the leader only (the
// others do not hear the followers' reports).
func (g *Group) AppliedAll(index uint64) (ok bool, laggards map[uint64]uint64) {
	g.pmu.Lock()
	lag := g.laggingLocked(index)
	g.pmu.Unlock()
	return len(lag) == 0, lag
}

// WaitAppliedAll returns once every voter has applied index (Ozone's watch
// for ALL_COMMITTED), or, when ctx ends first, a *LagError naming the
// replicas that had not. Call it on the leader.
func (g *Group) WaitAppliedAll(ctx context.Context, index uint64) error {
	for {
		if !g.IsLeader() {
			return &NotLeaderError{Group: g.id, Leader: g.Leader()}
		}
		g.pmu.Lock()
		lag := g.laggingLocked(index)
		ch := g.appliedChanged
		g.pmu.Unlock()
		if len(lag) == 0 {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return &LagError{Group: g.id, Index: index, Lagging: lag}
		case <-g.stopc:
			return ErrStopped
		}
	}
}

func (g *Group) laggingLocked(index uint64) map[uint64]uint64 {
	var lag map[uint64]uint64
	for _, v := range g.voters {
		a := g.followerApplied[v]
		if v == g.host.id {
			a = g.applied.Load()
		}
		if a < index {
			if lag == nil {
				lag = make(map[uint64]uint64)
			}
			lag[v] = a
		}
	}
	return lag
}

func (g *Group) recordApplied(from, applied uint64) {
	g.pmu.Lock()
	if applied > g.followerApplied[from] {
		g.followerApplied[from] = applied
		close(g.appliedChanged)
		g.appliedChanged = make(chan struct{})
	}
	g.pmu.Unlock()
}

// Campaign makes this replica start an election.
func (g *Group) Campaign() error {
	g.mu.Lock()
	if g.isStopped() {
		g.mu.Unlock()
		return g.stoppedError()
	}
	var err error
	if perr := g.rawLocked("campaign", func() { err = g.rn.Campaign() }); perr != nil {
		g.mu.Unlock()
		g.fail(perr)
		return g.stoppedError()
	}
	g.mu.Unlock()
	g.loop.notify(g)
	return err
}

// TransferLeader asks the leader to hand leadership to replica to.
func (g *Group) TransferLeader(to uint64) {
	g.mu.Lock()
	if g.isStopped() {
		g.mu.Unlock()
		return
	}
	if perr := g.rawLocked("transfer leader", func() { g.rn.TransferLeader(to) }); perr != nil {
		g.mu.Unlock()
		g.fail(perr)
		return
	}
	g.mu.Unlock()
	g.loop.notify(g)
}

// AddMember adds host id as a voter and returns once the change is applied
// here. The new replica must run AddGroup with no Peers.
func (g *Group) AddMember(ctx context.Context, id uint64) error {
	return g.changeMembership(ctx, pb.ConfChangeAddNode, id)
}

// RemoveMember removes host id from the group.
func (g *Group) RemoveMember(ctx context.Context, id uint64) error {
	return g.changeMembership(ctx, pb.ConfChangeRemoveNode, id)
}

func (g *Group) changeMembership(ctx context.Context, typ pb.ConfChangeType, id uint64) error {
	seq := g.host.seq.Add(1)
	p := &proposal{seq: seq, done: make(chan struct{})}
	cc := &pb.ConfChange{Type: &typ, NodeId: proto.Uint64(id), Context: encodeProposal(proposalID{g.host.id, seq}, nil, nil, false)}
	g.mu.Lock()
	var err error
	if g.isStopped() {
		err = g.stoppedError()
	} else if st := g.rn.BasicStatus(); st.RaftState != etcdraft.StateLeader {
		err = &NotLeaderError{Group: g.id, Leader: st.Lead}
	} else if perr := g.proposeConfChangeLocked(cc); perr != nil {
		err = perr
	} else {
		g.pmu.Lock()
		g.pending[seq] = p
		g.pmu.Unlock()
	}
	g.mu.Unlock()
	g.failIfBroken()
	if err != nil {
		return err
	}
	g.loop.notify(g)
	select {
	case <-p.done:
		return p.err
	case <-ctx.Done():
		return fmt.Errorf("raft: group %d: stopped waiting for a membership change already in the log: %w (%w)", g.id, ErrOutcomeUnknown, ctx.Err())
	}
}

// Status reports the group's state on this host.
func (g *Group) Status() Status {
	g.mu.Lock()
	st := g.rn.Status()
	g.mu.Unlock()
	s := Status{
		Group: g.id, Host: g.host.id, Leader: st.Lead, Term: st.GetTerm(), Role: roleName(st.RaftState),
		Commit: st.GetCommit(), Applied: g.applied.Load(), LogDir: g.log.store.dir,
	}
	if g.isStopped() {
		s.Role, s.Leader = "stopped", 0
	}
	for id := range st.Config.Voters.IDs() {
		s.Voters = append(s.Voters, id)
	}
	sort.Slice(s.Voters, func(i, j int) bool { return s.Voters[i] < s.Voters[j] })
	for id := range st.Config.Learners {
		s.Learners = append(s.Learners, id)
	}
	sort.Slice(s.Learners, func(i, j int) bool { return s.Learners[i] < s.Learners[j] })
	if st.RaftState == etcdraft.StateLeader {
		s.Followers = make(map[uint64]FollowerStatus, len(st.Progress))
		g.pmu.Lock()
		for id, pr := range st.Progress {
			a := g.followerApplied[id]
			if id == g.host.id {
				a = g.applied.Load()
			}
			s.Followers[id] = FollowerStatus{Match: pr.Match, Applied: a, Active: pr.RecentActive}
		}
		g.pmu.Unlock()
	}
	return s
}

// Voters returns the group's voters, sorted, as of its last applied
// configuration (what Status().Voters says, without Status's copy of
// every follower's progress: the write path asks on every request).
func (g *Group) Voters() []uint64 {
	g.pmu.Lock()
	v := slices.Clone(g.voters)
	g.pmu.Unlock()
	slices.Sort(v)
	return v
}

func roleName(s etcdraft.StateType) string {
	switch s {
	case etcdraft.StateLeader:
		return "leader"
	case etcdraft.StateCandidate:
		return "candidate"
	case etcdraft.StatePreCandidate:
		return "pre-candidate"
	default:
		return "follower"
	}
}

// step queues an inbound message and steps the queue at once if the
// group's lock is free; otherwise whoever holds it next in the store loop
// (ready) or the ticker (tick) steps it, in arrival order. The caller (a
// transport goroutine) never waits for the group's lock, which a busy
// group may hold.
func (g *Group) step(m *pb.Message) {
	if g.isStopped() {
		return
	}
	g.inbox.Lock()
	if len(g.inbox.msgs) >= maxInbox {
		g.inbox.Unlock()
		g.host.metrics.droppedInbox.Inc()
		return
	}
	g.inbox.msgs = append(g.inbox.msgs, m)
	g.inbox.Unlock()
	if !g.host.cfg.Manual && g.mu.TryLock() {
		var err error
		if !g.isStopped() {
			err = g.stepInboxLocked()
		}
		g.mu.Unlock()
		if err != nil {
			g.fail(err)
			return
		}
	}
	g.loop.notify(g)
}

// stepInboxLocked steps the queued inbound messages; mu must be held. etcd
// raft panics on a message its log cannot take (a commit index past its
// last entry: "was the raft log corrupted, truncated, or lost?"). That
// panic is turned into an error, for the caller to stop the group with
// (after releasing mu): this replica's log cannot be trusted, but the
// process and its other groups can.
func (g *Group) stepInboxLocked() (err error) {
	g.inbox.Lock()
	msgs := g.inbox.msgs
	g.inbox.msgs = nil
	g.inbox.Unlock()
	var m *pb.Message
	defer func() {
		if r := recover(); r != nil {
			g.host.metrics.stepPanics.Inc()
			g.broken.Store(true) // before mu is released (see broken)
			g.host.log.Error("panic stepping a message; stopping the group", "group", g.id,
				"type", m.GetType().String(), "from", m.GetFrom(), "term", m.GetTerm(), "panic", r, "stack", string(debug.Stack()))
			err = fmt.Errorf("raft: group %d: stepping %v from %d: panic: %v", g.id, m.GetType(), m.GetFrom(), r)
		}
	}()
	for _, m = range msgs {
		_ = g.rn.Step(m) // errors are for local messages or unknown peers: raft ignores them
	}
	return nil
}

func (g *Group) reportUnreachable(id uint64) {
	g.mu.Lock()
	var perr error
	if !g.isStopped() {
		perr = g.rawLocked("report unreachable", func() { g.rn.ReportUnreachable(id) })
	}
	g.mu.Unlock()
	if perr != nil {
		g.fail(perr)
	}
}

func (g *Group) tick() {
	g.mu.Lock()
	if g.isStopped() {
		g.mu.Unlock()
		return
	}
	// Messages still queued count before time passes: a leader busy on
	// its disk must not miss its followers' responses (CheckQuorum).
	if err := g.stepInboxLocked(); err != nil {
		g.mu.Unlock()
		g.fail(err)
		return
	}
	if err := g.rawLocked("tick", g.rn.Tick); err != nil {
		g.mu.Unlock()
		g.fail(err)
		return
	}
	g.mu.Unlock()
	// Followers re-report their applied index now and then, in case the
	// report after an apply was lost or the leader changed.
	if g.ticks.Add(1)%10 == 0 {
		g.reportApplied(true)
	}
	g.loop.notify(g)
}

// ready steps the queued inbound messages and takes the group's Ready if
// it has one. A slow state machine does not hold it back: committed
// entries past the apply backlog wait in the log (see enqueueCommitted).
func (g *Group) ready() *readyWork {
	g.mu.Lock()
	if g.isStopped() {
		g.mu.Unlock()
		return nil
	}
	if err := g.stepInboxLocked(); err != nil {
		g.mu.Unlock()
		g.fail(err)
		return nil
	}
	rd, ok, err := g.takeReadyLocked()
	if err != nil {
		g.mu.Unlock()
		g.fail(err)
		return nil
	}
	if !ok {
		g.mu.Unlock()
		return nil
	}
	st := g.rn.BasicStatus()
	g.leader.Store(st.Lead)
	g.term.Store(st.GetTerm())
	g.role.Store(roleName(st.RaftState))
	epoch := g.readies
	g.readies++
	g.mu.Unlock()
	// Proposals of a leader that lost leadership stay pending: this host
	// still applies the entry if it commits (and reports the result), or
	// sees another entry replace it (ErrProposalDropped); a caller that
	// stops waiting first gets ErrOutcomeUnknown.
	return &readyWork{g: g, rd: rd, leader: st.RaftState == etcdraft.StateLeader, epoch: epoch}
}

// takeReadyLocked takes the group's Ready, if it has one. etcd raft
// panics when its Storage fails a read (its committed entries come from
// the log): a failed log directory (ErrLogDirFailed) then stops this
// group, as a panic stepping a message does, never the process.
func (g *Group) takeReadyLocked() (rd etcdraft.Ready, ok bool, err error) {
	err = g.rawLocked("taking a Ready", func() {
		if ok = g.rn.HasReady(); ok {
			rd = g.rn.Ready()
		}
	})
	return rd, ok && err == nil, err
}

// rawLocked runs fn, a call into the RawNode; mu must be held. etcd raft
// panics when its Storage fails a read (once the log directory failed,
// every read past the tail cache fails: hasUnappliedConfChanges in a tick,
// a leader's send of entries to a lagging follower, ...). rawLocked turns
// that panic into an error and marks the group broken before mu is
// released, so nothing calls into the RawNode again; the caller stops the
// group with the error (g.fail) after releasing mu. The process and the
// other groups go on.
func (g *Group) rawLocked(what string, fn func()) (err error) {
	defer func() {
		if r := recover(); r != nil {
			g.broken.Store(true)
			g.host.metrics.rawPanics.Inc()
			g.host.log.Error("panic in etcd raft; stopping the group", "group", g.id, "call", what, "panic", r, "stack", string(debug.Stack()))
			e := rawPanicError(g.loop, g.id, what, r)
			g.failure.CompareAndSwap(nil, &e)
			err = e
		}
	}()
	fn()
	return nil
}

// rawPanicError is the error of an etcd raft panic in call what: it wraps
// the log directory's failure when there is one (ErrLogDirFailed).
func rawPanicError(l *storeLoop, id uint64, what string, r any) error {
	if f := l.store.failed(); f != nil {
		return fmt.Errorf("raft: group %d: %s: %w (panic: %v)", id, what, f, r)
	}
	return fmt.Errorf("raft: group %d: %s: panic: %v", id, what, r)
}

// newRawNode is etcdraft.NewRawNode, whose panic (its Storage failing a
// read, as when the log directory fails while the group is added) is an
// error, not the process's end.
func newRawNode(h *Host, l *storeLoop, id uint64, c *etcdraft.Config) (rn *etcdraft.RawNode, err error) {
	defer func() {
		if r := recover(); r != nil {
			h.metrics.rawPanics.Inc()
			h.log.Error("panic in etcd raft creating a group", "group", id, "panic", r, "stack", string(debug.Stack()))
			rn, err = nil, rawPanicError(l, id, "creating its raft node", r)
		}
	}()
	return etcdraft.NewRawNode(c)
}

// advance tells raft the Ready is persisted and queues its committed
// entries for the apply goroutine.
func (g *Group) advance(rd etcdraft.Ready) {
	g.mu.Lock()
	if g.isStopped() {
		g.mu.Unlock()
		return
	}
	var more bool
	if err := g.rawLocked("advance", func() { g.rn.Advance(rd); more = g.rn.HasReady() }); err != nil {
		g.mu.Unlock()
		g.fail(err)
		return
	}
	g.mu.Unlock()
	if len(rd.ReadStates) > 0 {
		g.pmu.Lock()
		for _, rs := range rd.ReadStates {
			if len(rs.RequestCtx) != 8 {
				continue
			}
			if r, ok := g.reads[binary.BigEndian.Uint64(rs.RequestCtx)]; ok {
				r.index = rs.Index
				close(r.done)
				delete(g.reads, binary.BigEndian.Uint64(rs.RequestCtx))
			}
		}
		g.pmu.Unlock()
	}
	if len(rd.CommittedEntries) > 0 {
		g.enqueueCommitted(rd.CommittedEntries)
	}
	if more {
		g.loop.notify(g)
	}
}

// enqueueCommitted queues committed entries for the apply goroutine. Up to
// maxApplyBacklog of them wait in memory; beyond that only their range is
// queued and the apply goroutine reads them back from the log. They are
// durable there: the store loop queues committed entries only after the
// batch holding them was committed, and the log is not truncated past the
// applied index.
func (g *Group) enqueueCommitted(ents []*pb.Entry) {
	lo, hi := ents[0].GetIndex(), ents[len(ents)-1].GetIndex()
	g.aq.Lock()
	n := len(g.aq.tasks)
	switch {
	case n > 0 && g.aq.tasks[n-1].hi != 0 && g.aq.tasks[n-1].hi+1 == lo:
		g.aq.tasks[n-1].hi = hi // extend the range held back
	case g.aq.entries+len(ents) > maxApplyBacklog:
		g.aq.tasks = append(g.aq.tasks, applyTask{lo: lo, hi: hi})
		g.host.metrics.applyHeldBack.Inc()
	default:
		g.aq.tasks = append(g.aq.tasks, applyTask{ents: ents})
		g.aq.entries += len(ents)
	}
	g.aq.Unlock()
	g.signalApply()
}

func (g *Group) enqueue(t applyTask) {
	g.aq.Lock()
	g.aq.tasks = append(g.aq.tasks, t)
	g.aq.entries += len(t.ents)
	g.aq.Unlock()
	g.signalApply()
}

func (g *Group) signalApply() {
	select {
	case g.aq.signal <- struct{}{}:
	default:
	}
}

func (g *Group) applyLoop() {
	defer g.applyWG.Done()
	for {
		select {
		case <-g.stopc:
			g.drainTasks()
			return
		case <-g.aq.signal:
		}
		for g.runNextTask() {
			if g.isStopped() {
				g.drainTasks()
				return
			}
		}
	}
}

// runNextTask runs the first queued apply task, if any.
func (g *Group) runNextTask() bool {
	g.aq.Lock()
	if len(g.aq.tasks) == 0 {
		g.aq.Unlock()
		return false
	}
	t := g.aq.tasks[0]
	g.aq.tasks[0] = applyTask{}
	g.aq.tasks = g.aq.tasks[1:]
	g.aq.Unlock()
	g.runTask(t)
	g.aq.Lock()
	g.aq.entries -= len(t.ents)
	g.aq.Unlock()
	g.deliver()
	return true
}

// drainTasks fails the snapshot work still queued when the group stops.
func (g *Group) drainTasks() {
	g.aq.Lock()
	tasks := g.aq.tasks
	g.aq.tasks = nil
	g.aq.Unlock()
	for _, t := range tasks {
		if t.snap != nil {
			t.snap <- snapshotResult{err: ErrStopped}
		}
		if t.restore != nil {
			t.restore.done <- ErrStopped
		}
	}
}

func (g *Group) runTask(t applyTask) {
	switch {
	case t.snap != nil:
		t.snap <- g.snapshot()
	case t.restore != nil:
		t.restore.done <- g.restore(t.restore)
	case t.hi != 0:
		g.applyHeldBack(t.lo, t.hi)
	default:
		g.applyEntries(t.ents)
	}
}

// snapshot takes the state machine's snapshot; on the apply goroutine (or
// in Poll, in manual mode), so that no Apply runs concurrently.
func (g *Group) snapshot() snapshotResult {
	idx, body, err := g.sm.Snapshot()
	if err != nil {
		return snapshotResult{err: err}
	}
	term, terr := g.log.Term(idx)
	if terr != nil || idx == 0 {
		body.Close()
		return snapshotResult{err: fmt.Errorf("raft: group %d: snapshot at index %d: term unknown: %v", g.id, idx, terr)}
	}
	return snapshotResult{index: idx, term: term, conf: proto.Clone(g.confState).(*pb.ConfState), body: body}
}

// restore installs a snapshot unless the state machine already has
// everything it holds. The comparison is with what this replica applied
// (never raft's commit index) and happens here, on the apply goroutine, in
// order with every apply and every other restore: of two snapshots that
// arrive newer-then-older, the older is ignored, so the state never goes
// back.
func (g *Group) restore(rt *restoreTask) error {
	md := rt.m.GetSnapshot().GetMetadata()
	idx := md.GetIndex()
	if have := max(g.applied.Load(), g.sm.AppliedIndex()); idx <= have {
		g.host.log.Info("ignoring a snapshot the state machine is already past", "group", g.id, "snapshot", idx, "applied", have)
		_, err := io.Copy(io.Discard, rt.body)
		return err
	}
	if err := g.sm.Restore(idx, rt.body); err != nil {
		return err
	}
	// (The state machine's durable AppliedIndex may lag idx for a while:
	// it is not asserted here.)
	if !g.setApplied(idx) {
		return ErrStopped
	}
	g.pmu.Lock()
	g.confState = proto.Clone(md.GetConfState()).(*pb.ConfState)
	g.voters = append([]uint64(nil), md.GetConfState().GetVoters()...)
	// This host's proposals at indexes the snapshot covers will never be
	// applied here entry by entry, so neither their result nor an entry
	// replacing them (applyEntries) will be seen: finish them now, or
	// their callers wait for their whole context and their inflight bytes
	// are never returned. The snapshot may or may not hold them.
	for _, seq := range sortedKeys(g.pending) {
		if p := g.pending[seq]; p.index != 0 && p.index <= idx {
			g.finish(seq, Result{}, fmt.Errorf("raft: group %d: entry %d of the proposal covered by a snapshot at %d: %w", g.id, p.index, idx, ErrOutcomeUnknown))
		}
	}
	g.pmu.Unlock()
	g.deliver()
	g.host.metrics.snapshotsReceived.Inc()
	return nil
}

// applyHeldBack applies committed entries lo..hi read back from the log.
func (g *Group) applyHeldBack(lo, hi uint64) {
	for lo <= hi && !g.isStopped() {
		if a := g.applied.Load(); a >= lo {
			lo = a + 1 // a restored snapshot covered some of them
			continue
		}
		ents, err := g.log.Entries(lo, hi+1, 4<<20)
		if err != nil {
			g.fail(fmt.Errorf("raft: group %d: reading committed entries [%d,%d] from the log: %w", g.id, lo, hi, err))
			return
		}
		g.applyEntries(ents)
		lo = ents[len(ents)-1].GetIndex() + 1
	}
}

func (g *Group) applyEntries(ents []*pb.Entry) {
	applied := g.applied.Load()
	batch := make([]Entry, 0, len(ents))
	ids := make([]proposalID, 0, len(ents))
	for _, e := range ents {
		if e.GetIndex() <= applied {
			continue // already in the state machine (restored snapshot)
		}
		ent := Entry{Index: e.GetIndex(), Term: e.GetTerm()}
		var id proposalID
		switch e.GetType() {
		case pb.EntryNormal:
			if len(e.GetData()) == 0 {
				ent.Kind = EntryEmpty
				break
			}
			d, err := decodeEntryData(e.GetData())
			if err != nil {
				g.fail(fmt.Errorf("entry %d: %w", e.GetIndex(), err))
				return
			}
			id = d.id
			ent.Meta = d.meta
			ent.HasData = d.format != fmtPlain
			if d.format == fmtData {
				ent.Data = d.data
			}
		case pb.EntryConfChange, pb.EntryConfChangeV2:
			ent.Kind = EntryConfChange
			var cc pb.ConfChangeI
			var ctxb []byte
			if e.GetType() == pb.EntryConfChange {
				c := &pb.ConfChange{}
				if err := proto.Unmarshal(e.GetData(), c); err != nil {
					g.fail(err)
					return
				}
				cc, ctxb = c, c.GetContext()
			} else {
				c := &pb.ConfChangeV2{}
				if err := proto.Unmarshal(e.GetData(), c); err != nil {
					g.fail(err)
					return
				}
				cc, ctxb = c, c.GetContext()
			}
			g.mu.Lock()
			if g.isStopped() {
				g.mu.Unlock()
				return
			}
			var cs *pb.ConfState
			if err := g.rawLocked("apply conf change", func() { cs = g.rn.ApplyConfChange(cc) }); err != nil {
				g.mu.Unlock()
				g.fail(err)
				return
			}
			g.mu.Unlock()
			if err := g.log.setConfState(cs); err != nil {
				g.fail(err)
				return
			}
			g.pmu.Lock()
			g.confState = cs
			g.voters = append([]uint64(nil), cs.GetVoters()...)
			g.pmu.Unlock()
			if d, err := decodeEntryData(ctxb); err == nil {
				id = d.id
			}
			g.loop.notify(g)
		}
		batch = append(batch, ent)
		ids = append(ids, id)
	}
	if len(batch) == 0 {
		return
	}
	as := time.Now()
	results := g.sm.Apply(batch)
	g.host.metrics.applySeconds.Observe(time.Since(as).Seconds())
	last := batch[len(batch)-1].Index
	g.host.metrics.applied.WithLabelValues(g.label()).Add(float64(len(batch)))

	g.pmu.Lock()
	for i, ent := range batch {
		if ent.Term > g.appliedTerm {
			// The first committed entry of a newer term.
			g.appliedTerm = ent.Term
			g.dropOutlived(ent.Index, ent.Term)
		}
		// A proposal of ours that was at this index but lost it to another
		// leader's entry will never apply.
		if seq, ok := g.byIndex[ent.Index]; ok && (ids[i].host != g.host.id || ids[i].seq != seq) {
			g.finish(seq, Result{}, fmt.Errorf("raft: group %d: entry %d replaced by a new leader: %w", g.id, ent.Index, ErrProposalDropped))
		}
		if ids[i].host != g.host.id {
			continue
		}
		var v any
		if i < len(results) {
			v = results[i]
		}
		if err, ok := v.(error); ok {
			g.finish(ids[i].seq, Result{Index: ent.Index}, err)
		} else {
			g.finish(ids[i].seq, Result{Index: ent.Index, Value: v}, nil)
		}
	}
	g.pmu.Unlock()
	if !g.setApplied(last) {
		return
	}
	g.reportApplied(false)
	g.maybeCompact()
}

// setApplied records that the state machine holds everything up to index.
// The applied index never goes back: an attempt stops the group (a bug that
// must not turn into a state machine silently missing entries).
func (g *Group) setApplied(index uint64) bool {
	if cur := g.applied.Load(); !g.assertf(index >= cur, "applied index would go back from %d to %d", cur, index) {
		return false
	}
	g.pmu.Lock()
	g.applied.Store(index)
	kept := g.appliedWaiter[:0]
	for _, w := range g.appliedWaiter {
		if w.index <= index {
			close(w.done)
		} else {
			kept = append(kept, w)
		}
	}
	g.appliedWaiter = kept
	close(g.appliedChanged)
	g.appliedChanged = make(chan struct{})
	g.pmu.Unlock()
	return true
}

// reportApplied tells the leader how far this replica has applied.
func (g *Group) reportApplied(periodic bool) {
	leader := g.leader.Load()
	if leader == 0 || leader == g.host.id {
		return
	}
	a := g.applied.Load()
	if !periodic && g.lastSentApplied.Swap(a) == a {
		return
	}
	g.host.transport.Send(leader, []Outgoing{{Group: g.id, Applied: a}})
}

// Log truncation keeps CompactKeep entries behind the durable applied
// index, and on the leader what an active follower that is close behind
// still needs; a follower that is down, or more than compactMaxLag behind,
// gets a snapshot instead.
const compactMaxLag = 16384

func (g *Group) maybeCompact() {
	first, _ := g.log.bounds()
	applied := g.applied.Load()
	if applied < first+uint64(g.host.cfg.CompactEvery) {
		return
	}
	target := g.sm.AppliedIndex()
	if target > applied {
		target = applied
	}
	keep := uint64(g.host.cfg.CompactKeep)
	if target < keep {
		return
	}
	target -= keep
	if g.IsLeader() {
		g.mu.Lock()
		st := g.rn.Status()
		g.mu.Unlock()
		for id, pr := range st.Progress {
			if id != g.host.id && pr.RecentActive && pr.Match < target && target-pr.Match < compactMaxLag {
				target = pr.Match
			}
		}
	}
	if target < first {
		return
	}
	if err := g.log.compact(target); err != nil {
		g.host.log.Warn("log truncation failed", "group", g.id, "index", target, "err", err)
	}
	g.cache.dropThrough(target)
}

// takeSnapshot asks the apply goroutine for a consistent snapshot.
func (g *Group) takeSnapshot() (snapshotResult, error) {
	ch := make(chan snapshotResult, 1)
	g.enqueue(applyTask{snap: ch})
	select {
	case r := <-ch:
		return r, r.err
	case <-g.stopc:
		return snapshotResult{}, ErrStopped
	}
}

// receiveSnapshot restores a snapshot sent by the leader (unless the state
// machine is already past it, see restore), then steps the MsgSnap so raft
// moves its log to the snapshot's position.
func (g *Group) receiveSnapshot(m *pb.Message, body io.Reader) error {
	idx := m.GetSnapshot().GetMetadata().GetIndex()
	if g.host.cfg.Manual {
		// No apply goroutine: run what is queued before it, then restore,
		// here, in order.
		if g.isStopped() {
			return ErrStopped
		}
		for g.runNextTask() {
		}
		if err := g.restore(&restoreTask{m: m, body: body}); err != nil {
			return fmt.Errorf("raft: group %d: restore snapshot at %d: %w", g.id, idx, err)
		}
		g.step(m)
		return nil
	}
	done := make(chan error, 1)
	g.enqueue(applyTask{restore: &restoreTask{m: m, body: body, done: done}})
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("raft: group %d: restore snapshot at %d: %w", g.id, idx, err)
		}
	case <-g.stopc:
		return ErrStopped
	}
	g.step(m)
	return nil
}

// writeData hands the data of new entries to the state machine and returns
// the entries as the log stores them (data elided).
func (g *Group) writeData(ents []*pb.Entry) ([]*pb.Entry, error) {
	var out []*pb.Entry
	needSync := false
	for i, e := range ents {
		if !isNormalWithPayload(e) || (e.GetData()[0] != fmtData && e.GetData()[0] != fmtLost && e.GetData()[0] != fmtLocal) {
			if out != nil {
				out = append(out, e)
			}
			continue
		}
		d, err := decodeEntryData(e.GetData())
		if err != nil {
			return nil, err
		}
		data := d.data
		switch d.format {
		case fmtLost:
			data = nil
		case fmtLocal:
			// Only this host's proposals are fmtLocal, and their data stays
			// in local until written here, whatever their callers do.
			var ok bool
			if data, ok = g.takeLocal(d.id.seq); !ok || d.id.host != g.host.id {
				return nil, fmt.Errorf("raft: group %d: invariant violated: entry %d: data of local proposal %d (host %d) missing", g.id, e.GetIndex(), d.id.seq, d.id.host)
			}
		}
		inLog := false
		if dl, ok := g.dsm.(DataLogger); ok && data != nil && g.logHasRoom(len(data)) {
			inLog, err = dl.WriteDataLogged(e.GetIndex(), e.GetTerm(), d.meta, data)
		} else {
			err = g.dsm.WriteData(e.GetIndex(), e.GetTerm(), d.meta, data)
		}
		if err != nil {
			return nil, fmt.Errorf("raft: group %d: WriteData(index %d): %w", g.id, e.GetIndex(), err)
		}
		if !inLog {
			needSync = true
		}
		if data != nil {
			g.cache.put(e.GetIndex(), e.GetTerm(), data)
		}
		if d.format == fmtLocal {
			g.dropLocal(d.id.seq)
		}
		if out == nil {
			out = make([]*pb.Entry, i, len(ents))
			copy(out, ents[:i])
		}
		// Never mutate raft's entry: the same object may sit in an
		// outbound MsgApp.
		typ := e.GetType()
		switch {
		case inLog && d.format == fmtData:
			out = append(out, e) // the log keeps it as it came
		case inLog:
			out = append(out, &pb.Entry{Index: proto.Uint64(e.GetIndex()), Term: proto.Uint64(e.GetTerm()), Type: &typ, Data: encodeProposal(d.id, d.meta, data, true)})
		default:
			out = append(out, &pb.Entry{Index: proto.Uint64(e.GetIndex()), Term: proto.Uint64(e.GetTerm()), Type: &typ, Data: elide(e.GetData(), d)})
		}
	}
	if needSync {
		if ds, ok := g.dsm.(DataSyncer); ok {
			if err := ds.SyncData(); err != nil {
				return nil, fmt.Errorf("raft: group %d: SyncData: %w", g.id, err)
			}
		}
	}
	if out == nil {
		return ents, nil
	}
	return out, nil
}

// queueSend queues a MsgApp for hydration and sending on the group's
// worker (started when the queue becomes non-empty). Bounded: beyond
// maxSendQueue the message is dropped; raft resends.
func (g *Group) queueSend(m *pb.Message) {
	g.sendq.Lock()
	if len(g.sendq.msgs) >= maxSendQueue || g.isStopped() {
		g.sendq.Unlock()
		g.host.metrics.droppedSends.Inc()
		return
	}
	g.sendq.msgs = append(g.sendq.msgs, m)
	start := !g.sendq.running
	g.sendq.running = true
	g.sendq.Unlock()
	if start {
		g.host.startSender(g)
	}
}

// sendQueued reports whether MsgApps wait in the send queue: later ones
// must queue behind them to keep their order.
func (g *Group) sendQueued() bool {
	g.sendq.Lock()
	defer g.sendq.Unlock()
	return g.sendq.running
}

// runSendQueue hydrates and sends queued MsgApps until the queue is empty.
// Reports whether it sent anything.
func (g *Group) runSendQueue() bool {
	did := false
	for {
		g.sendq.Lock()
		if len(g.sendq.msgs) == 0 || g.isStopped() {
			g.sendq.msgs = nil
			g.sendq.running = false
			g.sendq.Unlock()
			return did
		}
		m := g.sendq.msgs[0]
		g.sendq.msgs[0] = nil
		g.sendq.msgs = g.sendq.msgs[1:]
		g.sendq.Unlock()
		did = true
		out, tails, err := g.hydrateMessage(m)
		if err != nil {
			g.host.log.Warn("cannot read entry data for a send; dropping it (raft resends)", "group", g.id, "to", m.GetTo(), "err", err)
			continue
		}
		g.host.transport.Send(m.GetTo(), []Outgoing{{Group: g.id, Msg: out, tails: tails}})
	}
}

// maxHydratedBytes bounds the data put back into one MsgApp. raft sizes
// messages by the entries it sees, which hold only metadata, so a message
// of elided entries may stand for far more data than MaxSizePerMsg. The
// message is cut after this much data; the follower acknowledges the
// prefix and the leader continues from there (probe, then replicate).
const maxHydratedBytes = 8 << 20

// hydrateMessage puts the data back into entries read from the log (or
// kept beside them) before they go to a follower. The data is not copied
// into the entries: the entry gets the fmtData prefix and tails[i] the data
// that follows it on the wire.
func (g *Group) hydrateMessage(m *pb.Message) (*pb.Message, [][]byte, error) {
	var ents []*pb.Entry
	var tails [][]byte
	hydrated := 0
	for i, e := range m.GetEntries() {
		if hydrated >= maxHydratedBytes {
			if ents == nil {
				ents = append([]*pb.Entry(nil), m.GetEntries()[:i]...)
			}
			break
		}
		if !isNormalWithPayload(e) || (e.GetData()[0] != fmtElided && e.GetData()[0] != fmtLocal) {
			if ents != nil {
				ents = append(ents, e)
			}
			continue
		}
		d, err := decodeEntryData(e.GetData())
		if err != nil {
			return nil, nil, err
		}
		var data []byte
		ok := false
		if d.format == fmtLocal {
			data, ok = g.takeLocal(d.id.seq)
		}
		if !ok {
			data, ok = g.cache.get(e.GetIndex(), e.GetTerm())
		}
		lost := false
		if !ok {
			g.host.metrics.dataReads.Inc()
			data, err = g.dsm.ReadData(e.GetIndex(), e.GetTerm(), d.meta)
			if errors.Is(err, ErrDataLost) {
				g.host.log.Warn("entry data lost; sending the entry without it", "group", g.id, "index", e.GetIndex(), "err", err)
				lost, err, data = true, nil, nil
			}
			if err != nil {
				return nil, nil, fmt.Errorf("raft: group %d: ReadData(index %d): %w", g.id, e.GetIndex(), err)
			}
			if !lost && uint64(len(data)) != d.dataLen {
				return nil, nil, fmt.Errorf("raft: group %d: ReadData(index %d) returned %d bytes, want %d", g.id, e.GetIndex(), len(data), d.dataLen)
			}
		}
		if ents == nil {
			ents = make([]*pb.Entry, i, len(m.GetEntries()))
			copy(ents, m.GetEntries()[:i])
			tails = make([][]byte, len(m.GetEntries()))
		}
		hydrated += len(data)
		typ := e.GetType()
		payload := hydratePrefix(e.GetData(), d)
		if lost {
			payload = markLost(e.GetData())
		} else {
			tails[len(ents)] = data
		}
		ents = append(ents, &pb.Entry{Index: proto.Uint64(e.GetIndex()), Term: proto.Uint64(e.GetTerm()), Type: &typ, Data: payload})
	}
	if ents == nil {
		return m, nil, nil
	}
	// Shallow copy: the entries are new, everything else is shared and
	// read-only.
	out := &pb.Message{
		Type: m.Type, To: m.To, From: m.From, Term: m.Term, LogTerm: m.LogTerm,
		Index: m.Index, Commit: m.Commit, Entries: ents,
	}
	return out, tails[:len(ents)], nil
}

// dataCache keeps the data of recent entries so that resends to a follower
// that is a little behind need no disk read (Ozone's stateMachineDataCache).
type dataCache struct {
	mu    sync.Mutex
	max   int
	size  int
	items []cachedData
}

type cachedData struct {
	index, term uint64
	data        []byte
}

func (c *dataCache) put(index, term uint64, data []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(data) > c.max {
		return
	}
	// A new entry at an index drops everything from that index on.
	for len(c.items) > 0 && c.items[len(c.items)-1].index >= index {
		c.size -= len(c.items[len(c.items)-1].data)
		c.items = c.items[:len(c.items)-1]
	}
	c.items = append(c.items, cachedData{index, term, data})
	c.size += len(data)
	for c.size > c.max {
		c.size -= len(c.items[0].data)
		c.items[0] = cachedData{}
		c.items = c.items[1:]
	}
}

func (c *dataCache) get(index, term uint64) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := sort.Search(len(c.items), func(i int) bool { return c.items[i].index >= index })
	if i < len(c.items) && c.items[i].index == index && c.items[i].term == term {
		return c.items[i].data, true
	}
	return nil, false
}

func (c *dataCache) dropThrough(index uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.items) > 0 && c.items[0].index <= index {
		c.size -= len(c.items[0].data)
		c.items[0] = cachedData{}
		c.items = c.items[1:]
	}
}
