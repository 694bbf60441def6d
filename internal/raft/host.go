package raft

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	etcdraft "go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// Host runs many Raft groups in one process (multi-raft). It owns:
//   - one log store per log directory, each with its own processing loop
//     that batches the Ready work of all its groups into one synced write
//     (group commit) — a slow disk stalls only the groups placed on it;
//   - one transport shared by all groups (one connection per host pair);
//   - one ticker for all groups.
//
// A group is processed only when something happened to it (a proposal, a
// message, a tick that produced work): the loops keep a set of ready
// groups, as CockroachDB's scheduler does.
type Host struct {
	cfg       HostConfig
	id        uint64
	log       *slog.Logger
	transport Transport
	loops     []*storeLoop
	metrics   *metrics

	mu     sync.RWMutex
	groups map[uint64]*Group
	// home remembers on which store a group's state was found at start.
	home map[uint64]*storeLoop
	// adding holds the IDs of groups AddGroup is opening (outside mu);
	// addWG counts those opens, so Close closes the log stores only after
	// them (an open racing Close used Pebble after it closed: a panic).
	adding map[uint64]bool
	addWG  sync.WaitGroup

	// seq numbers this incarnation's proposals (and read requests). It
	// starts at a random point (seqStart), not at 0: entries proposed by
	// an earlier incarnation of this host carry its numbers and may apply
	// after a restart, and each must not finish a new proposal that
	// happens to have the same number.
	seq     atomic.Uint64
	snapSem chan struct{}
	// snapq holds the snapshots to send in manual mode (Poll sends them).
	snapMu sync.Mutex
	snapq  []snapshotSend
	stopc  chan struct{}
	wg     sync.WaitGroup
	closed atomic.Bool
}

// NewHost opens the log stores, starts the transport and the loops.
func NewHost(cfg HostConfig) (*Host, error) {
	if cfg.ID == 0 {
		return nil, fmt.Errorf("raft: host ID must be nonzero")
	}
	if len(cfg.LogDirs) == 0 {
		return nil, fmt.Errorf("raft: host %d: at least one log directory is required", cfg.ID)
	}
	if cfg.TickInterval == 0 {
		cfg.TickInterval = 100 * time.Millisecond
	}
	if cfg.ElectionTicks == 0 {
		cfg.ElectionTicks = 10
	}
	if cfg.HeartbeatTicks == 0 {
		cfg.HeartbeatTicks = 1
	}
	if cfg.MaxProposalBytes == 0 {
		cfg.MaxProposalBytes = 64 << 20
	}
	if cfg.MaxInflightBytes == 0 {
		cfg.MaxInflightBytes = 256 << 20
	}
	if cfg.CompactEvery == 0 {
		cfg.CompactEvery = 2048
	}
	if cfg.CompactKeep == 0 {
		cfg.CompactKeep = 256
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.FS == nil {
		cfg.FS = vfs.Default
	}
	if cfg.LogReserveBytes == 0 {
		cfg.LogReserveBytes = DefaultLogReserve
	}
	h := &Host{
		cfg:     cfg,
		id:      cfg.ID,
		log:     cfg.Logger.With("host", cfg.ID),
		groups:  make(map[uint64]*Group),
		home:    make(map[uint64]*storeLoop),
		adding:  make(map[uint64]bool),
		snapSem: make(chan struct{}, 2),
		stopc:   make(chan struct{}),
	}
	h.seq.Store(seqStart())
	h.metrics = newMetrics(cfg.ID, cfg.Registerer)
	for _, dir := range cfg.LogDirs {
		s, err := openLogStoreSpace(dir, cfg.FS, h.spaceOptions())
		if err != nil {
			h.closeStores()
			return nil, err
		}
		l := &storeLoop{host: h, store: s, pending: make(map[uint64]*Group), signal: make(chan struct{}, 1), drops: make(chan dropReq)}
		h.loops = append(h.loops, l)
		ids, err := s.groupIDs()
		if err != nil {
			h.closeStores()
			return nil, err
		}
		for _, id := range ids {
			h.home[id] = l
		}
	}
	h.transport = cfg.Transport
	if cfg.Manual && h.transport == nil {
		h.closeStores()
		return nil, fmt.Errorf("raft: host %d: manual mode needs a Transport (the caller's)", cfg.ID)
	}
	if h.transport == nil {
		if cfg.Resolve == nil {
			h.closeStores()
			return nil, fmt.Errorf("raft: host %d: Resolve is required with the TCP transport", cfg.ID)
		}
		// A frame holds at most one message past maxBatchBytes, and one
		// message at most one proposal past maxHydratedBytes.
		maxFrame := cfg.MaxProposalBytes + maxBatchBytes + maxHydratedBytes + 1<<20
		t, err := NewTCPTransport(TCPConfig{ID: cfg.ID, ListenAddr: cfg.ListenAddr, Listener: cfg.Listener, Resolve: cfg.Resolve, Security: cfg.Security, Logger: h.log, Metrics: h.metrics, MaxFrameBytes: maxFrame})
		if err != nil {
			h.closeStores()
			return nil, err
		}
		h.transport = t
	}
	if err := h.transport.Start(h); err != nil {
		h.closeStores()
		return nil, err
	}
	if cfg.Manual {
		return h, nil
	}
	for _, l := range h.loops {
		h.wg.Add(1)
		go l.run()
	}
	if cfg.TickInterval > 0 {
		h.wg.Add(1)
		go h.tickLoop()
	}
	return h, nil
}

func (h *Host) closeStores() {
	for _, l := range h.loops {
		l.store.close()
	}
}

// ID is this host's replica ID.
func (h *Host) ID() uint64 { return h.id }

// Addr is the transport address peers use to reach this host.
func (h *Host) Addr() string { return h.transport.Addr() }

// StoredGroups lists the groups whose state is on this host's disks, so a
// restarting process can re-add them.
func (h *Host) StoredGroups() []uint64 {
	h.mu.RLock()
	defer h.mu.RUnlock()
	ids := make([]uint64, 0, len(h.home))
	for id := range h.home {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids
}

// LogDirs reports, per log directory, how many groups it holds and how
// many fsyncs it has issued.
func (h *Host) LogDirs() []LogDirStatus {
	out := make([]LogDirStatus, len(h.loops))
	for i, l := range h.loops {
		out[i] = LogDirStatus{Dir: l.store.dir, Groups: l.store.numGroups(), Fsyncs: l.store.syncs.Load()}
		if e := l.store.failed(); e != nil {
			out[i].Failed, out[i].Error = true, e.Cause
		}
	}
	return out
}

// LogDirStatus describes one log directory.
type LogDirStatus struct {
	Dir    string
	Groups int
	Fsyncs int64
	// Failed: the directory met a fatal I/O error (logfatal.go); its
	// groups are stopped and it gets no new ones. Error is the cause.
	Failed bool
	Error  string
}

// Close stops all groups, the transport and the stores.
func (h *Host) Close() error {
	if !h.closed.CompareAndSwap(false, true) {
		return nil
	}
	close(h.stopc)
	// Barrier: an AddGroup that saw the host open under mu has counted
	// itself in addWG by now; later ones see closed and do nothing.
	h.mu.Lock()
	h.mu.Unlock()
	groups := h.groupList()
	for _, g := range groups {
		g.stop()
	}
	err := h.transport.Close()
	h.addWG.Wait() // each stops the group it opened (it sees closed)
	h.wg.Wait()
	for _, g := range groups {
		g.applyWG.Wait()
	}
	for _, l := range h.loops {
		if cerr := l.store.close(); cerr != nil && err == nil {
			err = cerr
		}
	}
	h.metrics.unregister()
	return err
}

// AddGroup starts hosting a group: it reopens the group's state if it is on
// disk, else creates it (bootstrapping with cfg.Peers, or waiting to be
// added by the leader when Peers is empty).
func (h *Host) AddGroup(cfg GroupConfig) (*Group, error) {
	if cfg.ID == 0 {
		return nil, fmt.Errorf("raft: group ID must be nonzero")
	}
	if cfg.StateMachine == nil {
		return nil, fmt.Errorf("raft: group %d: StateMachine is required", cfg.ID)
	}
	if h.closed.Load() {
		return nil, ErrStopped
	}
	// The host lock is held only to reserve the ID and to publish the
	// group: loading and bootstrapping sync the log store, and inbound
	// messages and ticks of every other group need the lock meanwhile.
	h.mu.Lock()
	if h.closed.Load() {
		h.mu.Unlock()
		return nil, ErrStopped
	}
	if _, ok := h.groups[cfg.ID]; ok || h.adding[cfg.ID] {
		h.mu.Unlock()
		return nil, fmt.Errorf("raft: group %d: %w", cfg.ID, ErrGroupExists)
	}
	loop, existed := h.home[cfg.ID]
	if !existed {
		// Least-loaded log directory (seed 001: spreading logs over disks
		// is what removes the multi-second tail).
		// Directories on a slow disk only if every one is.
		loop = nil
		for _, avoid := range []bool{true, false} {
			for _, l := range h.loops {
				if l.store.failed() != nil {
					continue // never, not even as the last resort
				}
				if avoid && h.cfg.AvoidLogDir != nil && h.cfg.AvoidLogDir(l.store.dir) {
					continue
				}
				if loop == nil || l.store.numGroups() < loop.store.numGroups() {
					loop = l
				}
			}
			if loop != nil {
				break
			}
		}
		if loop == nil {
			h.mu.Unlock()
			return nil, fmt.Errorf("raft: group %d: every log directory of host %d failed: %w", cfg.ID, h.id, ErrLogDirFailed)
		}
	}
	h.adding[cfg.ID] = true
	h.addWG.Add(1)
	h.mu.Unlock()
	defer h.addWG.Done()
	g, err := h.openGroup(loop, cfg)
	h.mu.Lock()
	delete(h.adding, cfg.ID)
	if err == nil && h.closed.Load() {
		err = ErrStopped
	}
	if err != nil {
		h.mu.Unlock()
		if g != nil {
			g.stop()
			g.applyWG.Wait()
		}
		return nil, err
	}
	h.groups[cfg.ID] = g
	h.home[cfg.ID] = loop
	h.mu.Unlock()
	h.metrics.groups.Inc()
	loop.notify(g)
	return g, nil
}

// openGroup loads (or bootstraps) a group's log and starts the group.
func (h *Host) openGroup(loop *storeLoop, cfg GroupConfig) (*Group, error) {
	gl, err := loop.store.load(cfg.ID)
	if err != nil {
		return nil, err
	}
	fresh := gl.last == 0 && gl.truncIndex == 0 && etcdraft.IsEmptyHardState(gl.hs)
	if fresh && len(cfg.Peers) > 0 {
		if err := bootstrap(gl, cfg.Peers); err != nil {
			return nil, err
		}
	}
	return newGroup(h, loop, gl, cfg)
}

// bootstrap writes the initial state of a new group: the log starts after
// a virtual entry 1 of term 1 whose "snapshot" holds the initial members.
// A replica that joins later has no entry 1, so the leader must send it a
// snapshot, which carries the membership (as in CockroachDB).
func bootstrap(gl *groupLog, peers []uint64) error {
	voters := append([]uint64(nil), peers...)
	sort.Slice(voters, func(i, j int) bool { return voters[i] < voters[j] })
	b := gl.store.db.NewBatch()
	defer b.Close()
	snap := &pb.Snapshot{Metadata: &pb.SnapshotMetadata{
		Index: proto.Uint64(1), Term: proto.Uint64(1), ConfState: &pb.ConfState{Voters: voters},
	}}
	if err := gl.applySnapshot(b, snap); err != nil {
		return err
	}
	if err := gl.setHardState(b, &pb.HardState{Term: proto.Uint64(1), Commit: proto.Uint64(1)}); err != nil {
		return err
	}
	return gl.store.commit(b, pebble.Sync)
}

// Group returns a hosted group.
func (h *Host) Group(id uint64) (*Group, error) {
	h.mu.RLock()
	defer h.mu.RUnlock()
	g, ok := h.groups[id]
	if !ok {
		return nil, fmt.Errorf("raft: group %d on host %d: %w", id, h.id, ErrGroupNotFound)
	}
	return g, nil
}

// Groups lists the hosted group IDs.
func (h *Host) Groups() []uint64 {
	h.mu.RLock()
	defer h.mu.RUnlock()
	ids := make([]uint64, 0, len(h.groups))
	for id := range h.groups {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids
}

// RemoveGroup stops a group and deletes its log from the store. The state
// machine's own data is the caller's to delete.
func (h *Host) RemoveGroup(id uint64) error {
	h.mu.Lock()
	g, ok := h.groups[id]
	if ok {
		delete(h.groups, id)
	}
	loop := h.home[id]
	delete(h.home, id)
	h.mu.Unlock()
	if !ok {
		if loop != nil {
			return loop.store.drop(id)
		}
		return fmt.Errorf("raft: group %d on host %d: %w", id, h.id, ErrGroupNotFound)
	}
	g.stop()
	g.applyWG.Wait()
	if h.cfg.Manual {
		// No loop runs concurrently: drop now.
		loop.forget(id)
		err := loop.store.drop(id)
		h.metrics.groups.Dec()
		h.metrics.forgetGroup(id)
		return err
	}
	// The drop runs on the store loop, between iterations, so that no
	// batch in flight can write the group's keys back after it.
	done := make(chan error, 1)
	select {
	case loop.drops <- dropReq{id: id, done: done}:
	case <-h.stopc:
		return ErrStopped
	}
	var err error
	select {
	case err = <-done:
	case <-h.stopc:
		return ErrStopped
	}
	h.metrics.groups.Dec()
	h.metrics.forgetGroup(id)
	return err
}

// StopGroup stops group id without removing it: once it returns, the
// group applies nothing more and takes no messages, and its log stays on
// disk (RemoveGroup drops it later, or a restart opens it again). A
// state machine that makes its applied effects durable through replay
// from this log syncs them between StopGroup and RemoveGroup.
func (h *Host) StopGroup(id uint64) error {
	h.mu.Lock()
	g, ok := h.groups[id]
	h.mu.Unlock()
	if !ok {
		return fmt.Errorf("raft: group %d on host %d: %w", id, h.id, ErrGroupNotFound)
	}
	g.stop()
	g.applyWG.Wait()
	return nil
}

// Tick advances every group's logical clock by one tick, in group ID
// order. Called by the host's ticker, or by the caller when TickInterval
// is negative or the host is Manual.
func (h *Host) Tick() {
	for _, g := range h.groupList() {
		g.tick()
	}
}

func (h *Host) tickLoop() {
	defer h.wg.Done()
	t := time.NewTicker(h.cfg.TickInterval)
	defer t.Stop()
	for {
		select {
		case <-h.stopc:
			return
		case <-t.C:
			h.Tick()
		}
	}
}

// HandleMessages implements Handler. It only queues: the host lock is
// held to look the groups up, no group lock is taken (the store loop steps
// the messages, see Group.step).
func (h *Host) HandleMessages(from uint64, msgs []Outgoing) {
	gs := make([]*Group, len(msgs))
	h.mu.RLock()
	for i, o := range msgs {
		gs[i] = h.groups[o.Group]
	}
	h.mu.RUnlock()
	for i, o := range msgs {
		g := gs[i]
		if g == nil {
			h.metrics.droppedUnknownGroup.Inc()
			continue
		}
		if o.Msg == nil {
			g.recordApplied(from, o.Applied)
			continue
		}
		g.step(o.Msg)
	}
}

// Unreachable implements Handler.
func (h *Host) Unreachable(id uint64) {
	for _, g := range h.groupList() {
		g.reportUnreachable(id)
	}
}

// groupList is the hosted groups in ID order.
func (h *Host) groupList() []*Group {
	h.mu.RLock()
	gs := make([]*Group, 0, len(h.groups))
	for _, g := range h.groups {
		gs = append(gs, g)
	}
	h.mu.RUnlock()
	sort.Slice(gs, func(i, j int) bool { return gs[i].id < gs[j].id })
	return gs
}

// HandleSnapshot implements Handler: restore the state machine, then let
// raft take the snapshot's position.
func (h *Host) HandleSnapshot(from, group uint64, m *pb.Message, body io.Reader) error {
	g, err := h.Group(group)
	if err != nil {
		return err
	}
	return g.receiveSnapshot(m, body)
}

// send hands a group's outbound messages to the transport, grouped by
// destination. MsgSnap goes through the snapshot path instead.
func (h *Host) send(g *Group, msgs []*pb.Message) {
	if len(msgs) == 0 {
		return
	}
	var byPeer map[uint64][]Outgoing
	for _, m := range msgs {
		if m.GetType() == pb.MsgSnap {
			if h.cfg.Manual {
				h.snapMu.Lock()
				h.snapq = append(h.snapq, snapshotSend{g: g, m: m})
				h.snapMu.Unlock()
				continue
			}
			h.wg.Add(1)
			go h.sendSnapshot(g, m)
			continue
		}
		if g.dsm != nil && m.GetType() == pb.MsgApp && (hasElided(m) || g.sendQueued()) {
			// Its data must be put back first, which may read the disk:
			// on the group's own worker, never on the loop or on the
			// peer's writer (shared by every group).
			g.queueSend(m)
			continue
		}
		o := Outgoing{Group: g.id, Msg: m}
		if byPeer == nil {
			byPeer = make(map[uint64][]Outgoing, 4)
		}
		byPeer[m.GetTo()] = append(byPeer[m.GetTo()], o)
	}
	for _, to := range sortedKeys(byPeer) {
		h.transport.Send(to, byPeer[to])
	}
}

func (h *Host) sendSnapshot(g *Group, m *pb.Message) {
	defer h.wg.Done()
	to := m.GetTo()
	report := func(st etcdraft.SnapshotStatus) {
		g.mu.Lock()
		var perr error
		if !g.isStopped() {
			perr = g.rawLocked("report snapshot", func() { g.rn.ReportSnapshot(to, st) })
		}
		g.mu.Unlock()
		if perr != nil {
			g.fail(perr)
		}
		g.loop.notify(g)
	}
	select {
	case h.snapSem <- struct{}{}:
	case <-h.stopc:
		return
	}
	defer func() { <-h.snapSem }()
	snap, err := g.takeSnapshot()
	if err != nil {
		h.log.Warn("snapshot failed", "group", g.id, "to", to, "err", err)
		report(etcdraft.SnapshotFailure)
		return
	}
	defer snap.body.Close()
	out := proto.Clone(m).(*pb.Message)
	out.Snapshot = &pb.Snapshot{Metadata: &pb.SnapshotMetadata{
		Index: proto.Uint64(snap.index), Term: proto.Uint64(snap.term), ConfState: snap.conf,
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	go func() {
		select {
		case <-h.stopc:
			cancel()
		case <-ctx.Done():
		}
	}()
	start := time.Now()
	if err := h.transport.SendSnapshot(ctx, to, g.id, out, snap.body); err != nil {
		h.log.Warn("sending snapshot failed", "group", g.id, "to", to, "index", snap.index, "err", err)
		report(etcdraft.SnapshotFailure)
		return
	}
	h.metrics.snapshotsSent.Inc()
	h.log.Info("snapshot sent", "group", g.id, "to", to, "index", snap.index, "took", time.Since(start))
	report(etcdraft.SnapshotFinish)
}

// startSender runs a group's send queue on a goroutine of its own (one at
// a time per group, see Group.queueSend).
func (h *Host) startSender(g *Group) {
	if h.cfg.Manual {
		return // Poll drains the queue
	}
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		g.runSendQueue()
	}()
}

// SnapshotSender is implemented by a transport that takes a snapshot as
// one complete message. Manual mode needs it (the streaming
// Transport.SendSnapshot blocks): Poll takes the state machine's snapshot,
// reads it whole, and hands it over.
type SnapshotSender interface {
	// QueueSnapshot queues the MsgSnap m of group, with the state
	// machine's data, for host to. It must not block. The transport later
	// delivers it with the receiver's Host.HandleSnapshot(from, group, m,
	// bytes.NewReader(data)) and calls done with that call's result (or an
	// error if it dropped the snapshot): done tells raft whether the
	// follower has it (ReportSnapshot). done must be called exactly once,
	// on the caller's (the simulator's) goroutine.
	QueueSnapshot(to, group uint64, m *pb.Message, data []byte, done func(error))
}

type snapshotSend struct {
	g *Group
	m *pb.Message
}

// Poll runs, on the caller's goroutine, all work of a Manual host that is
// runnable now: one iteration of each store loop that has pending groups
// (inbound messages stepped, Ready taken, WriteData, one synced batch,
// messages sent, Advance), each group's queued apply tasks (which deliver
// results to ProposeAsync callbacks), each group's queued sends (MsgApps
// whose data is put back), and queued snapshot sends. It reports whether
// it did anything; call it until it returns false to quiesce. Groups are
// visited in ID order and nothing depends on map order, goroutines or the
// wall clock, so a run is a function of the calls made (and of etcd raft's
// randomized election timeouts, see doc.go). Without Manual it does
// nothing and returns false.
func (h *Host) Poll() bool {
	if !h.cfg.Manual || h.closed.Load() {
		return false
	}
	did := false
	for _, l := range h.loops {
		if l.iterate() {
			did = true
		}
	}
	for _, g := range h.groupList() {
		if g.isStopped() {
			g.drainTasks()
			continue
		}
		for g.runNextTask() {
			did = true
		}
		if g.runSendQueue() {
			did = true
		}
	}
	h.snapMu.Lock()
	snaps := h.snapq
	h.snapq = nil
	h.snapMu.Unlock()
	for _, s := range snaps {
		h.sendSnapshotManual(s.g, s.m)
		did = true
	}
	return did
}

func (h *Host) sendSnapshotManual(g *Group, m *pb.Message) {
	to := m.GetTo()
	report := func(err error) {
		st := etcdraft.SnapshotFinish
		if err != nil {
			h.log.Warn("sending snapshot failed", "group", g.id, "to", to, "err", err)
			st = etcdraft.SnapshotFailure
		} else {
			h.metrics.snapshotsSent.Inc()
		}
		g.mu.Lock()
		var perr error
		if !g.isStopped() {
			perr = g.rawLocked("report snapshot", func() { g.rn.ReportSnapshot(to, st) })
		}
		g.mu.Unlock()
		if perr != nil {
			g.fail(perr)
		}
		g.loop.notify(g)
	}
	ss, ok := h.transport.(SnapshotSender)
	if !ok {
		report(fmt.Errorf("raft: host %d: manual mode: the transport does not implement SnapshotSender", h.id))
		return
	}
	if g.isStopped() {
		return
	}
	snap := g.snapshot()
	if snap.err != nil {
		report(snap.err)
		return
	}
	data, err := io.ReadAll(snap.body)
	snap.body.Close()
	if err != nil {
		report(fmt.Errorf("reading snapshot at %d: %w", snap.index, err))
		return
	}
	out := proto.Clone(m).(*pb.Message)
	out.Snapshot = &pb.Snapshot{Metadata: &pb.SnapshotMetadata{
		Index: proto.Uint64(snap.index), Term: proto.Uint64(snap.term), ConfState: snap.conf,
	}}
	ss.QueueSnapshot(to, g.id, out, data, report)
}

// seqStart picks where a host's sequence numbers start: a random 62-bit
// value, so the ranges of two incarnations practically never meet and the
// counter never wraps. It comes from crypto/rand, which a deterministic
// simulation fixes with testing/cryptotest.SetGlobalRandom as it does for
// etcd raft's election timeouts.
func seqStart() uint64 {
	var b [8]byte
	rand.Read(b[:]) // never fails (crypto/rand crashes the process instead)
	return binary.BigEndian.Uint64(b[:]) & (1<<62 - 1)
}
