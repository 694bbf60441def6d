package raft

import (
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"
	etcdraft "go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// storeLoop processes the Ready work of every group on one log store.
// Each iteration takes all groups that have work, writes their entries and
// HardStates into one Pebble batch and commits it with one sync: one fsync
// for all of them. While it syncs, new work accumulates for the next
// iteration, so the batch grows with the load (group commit).
type storeLoop struct {
	host  *Host
	store *logStore

	mu      sync.Mutex
	pending map[uint64]*Group
	since   time.Time // when pending became non-empty
	signal  chan struct{}
	drops   chan dropReq
	// failOnce: the directory's failure is reported once (failGroups).
	failOnce sync.Once
}

type dropReq struct {
	id   uint64
	done chan error
}

// maxGroupsPerBatch bounds one iteration so that one huge batch cannot
// delay the groups waiting behind it for too long.
const maxGroupsPerBatch = 512

func (l *storeLoop) notify(g *Group) {
	l.mu.Lock()
	if len(l.pending) == 0 {
		l.since = time.Now()
	}
	l.pending[g.id] = g
	l.mu.Unlock()
	select {
	case l.signal <- struct{}{}:
	default:
	}
}

// take returns pending groups, in ID order (deterministic: manual mode).
func (l *storeLoop) take() []*Group {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.pending) > 0 && !l.since.IsZero() {
		l.host.metrics.loopQueueSeconds.Observe(time.Since(l.since).Seconds())
	}
	out := make([]*Group, 0, min(len(l.pending), maxGroupsPerBatch))
	for _, id := range sortedKeys(l.pending) {
		out = append(out, l.pending[id])
		delete(l.pending, id)
		if len(out) == maxGroupsPerBatch {
			select {
			case l.signal <- struct{}{}:
			default:
			}
			break
		}
	}
	return out
}

type readyWork struct {
	g      *Group
	rd     etcdraft.Ready
	leader bool
	epoch  uint64 // which Ready of the group this is (Group.readies)
	sent   bool
	ents   []*pb.Entry   // what goes to the log (data elided)
	rest   []*pb.Message // messages to send after the batch is durable
}

// splitHeartbeats sends heartbeat traffic through send and returns the
// other messages.
func splitHeartbeats(msgs []*pb.Message, send func([]*pb.Message)) []*pb.Message {
	var hb, rest []*pb.Message
	for _, m := range msgs {
		if t := m.GetType(); t == pb.MsgHeartbeat || t == pb.MsgHeartbeatResp {
			hb = append(hb, m)
		} else {
			rest = append(rest, m)
		}
	}
	if len(hb) > 0 {
		send(hb)
	}
	return rest
}

// forget drops a removed group from the pending set.
func (l *storeLoop) forget(id uint64) {
	l.mu.Lock()
	delete(l.pending, id)
	l.mu.Unlock()
}

// iterate is one loop iteration, on the caller's goroutine (manual mode).
// It reports whether any group was pending.
func (l *storeLoop) iterate() bool {
	if err := l.store.usable(); err != nil {
		l.failGroups(err)
	}
	groups := l.take()
	var work []*readyWork
	for _, g := range groups {
		if w := g.ready(); w != nil {
			work = append(work, w)
		}
	}
	if len(work) > 0 {
		l.process(work)
	}
	return len(groups) > 0
}

func (l *storeLoop) run() {
	defer l.host.wg.Done()
	var work []*readyWork
	failc := l.store.failc
	for {
		select {
		case <-l.host.stopc:
			return
		case <-failc:
			failc = nil
			l.failGroups(l.store.usable())
			continue
		case d := <-l.drops:
			l.mu.Lock()
			delete(l.pending, d.id)
			l.mu.Unlock()
			d.done <- l.store.drop(d.id)
			continue
		case <-l.signal:
		}
		work = work[:0]
		for _, g := range l.take() {
			if w := g.ready(); w != nil {
				work = append(work, w)
			}
		}
		if len(work) > 0 {
			l.process(work)
		}
	}
}

func (l *storeLoop) process(work []*readyWork) {
	h := l.host
	start := time.Now()
	if err := l.store.usable(); err != nil {
		// A failed directory: nothing of these Readies leaves (no append
		// sent by a leader either), nothing is persisted or advanced.
		l.failGroups(err)
		return
	}

	// A leader may send its appends before writing them itself: its own
	// acknowledgement only counts after Advance (raft thesis 10.2.1).
	// Heartbeats and their responses assert nothing about the disk, so
	// every replica sends them at once: a slow fsync must not look like a
	// dead host (that is what makes leaders step down under disk load).
	for _, w := range work {
		if w.leader {
			h.send(w.g, w.rd.Messages)
			w.sent = true
			continue
		}
		w.rest = splitHeartbeats(w.rd.Messages, func(hb []*pb.Message) { h.send(w.g, hb) })
	}

	// Data kept out of the log goes to the state machines first, groups in
	// parallel (they usually write to different files). The last group
	// with data runs on this goroutine, the others each on their own: with
	// one such group (the usual case) no goroutine starts per Ready, and
	// none grows a fresh stack through the state machine's write (a new
	// goroutine's stack copied up several times per batch was ~0.7% of a
	// small-PUT server's CPU).
	var wg sync.WaitGroup
	errs := make([]error, len(work))
	last := -1
	for i, w := range work {
		if w.g.dsm == nil || len(w.rd.Entries) == 0 {
			w.ents = w.rd.Entries
			continue
		}
		last = i
	}
	for i, w := range work {
		if w.g.dsm == nil || len(w.rd.Entries) == 0 {
			continue
		}
		if h.cfg.Manual {
			w.ents, errs[i] = w.g.writeData(w.rd.Entries)
			continue
		}
		write := func() {
			ws := time.Now()
			w.ents, errs[i] = w.g.writeData(w.rd.Entries)
			h.metrics.dataWriteSeconds.Observe(time.Since(ws).Seconds())
		}
		if i == last {
			write()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			write()
		}()
	}
	wg.Wait()

	b := l.store.db.NewBatch()
	mustSync := false
	nents := 0
	for i, w := range work {
		if errs[i] != nil {
			// The data could not be stored: this replica cannot accept the
			// entries. Stop the group rather than acknowledge them.
			h.log.Error("WriteData failed; stopping group", "group", w.g.id, "err", errs[i])
			w.g.fail(errs[i])
			continue
		}
		if !etcdraft.IsEmptySnap(w.rd.Snapshot) {
			if err := w.g.log.applySnapshot(b, w.rd.Snapshot); err != nil {
				panic(err)
			}
			// etcd raft's MustSync looks at entries, term and vote only,
			// but the append response that follows acknowledges the
			// snapshot: the leader then counts this replica at the
			// snapshot's index. Losing it in a crash leaves the log behind
			// a commit index this replica acknowledged (found by the
			// simulator, defect D2).
			mustSync = true
		}
		if err := w.g.log.append(b, w.ents); err != nil {
			panic(err)
		}
		if !etcdraft.IsEmptyHardState(w.rd.HardState) {
			if err := w.g.log.setHardState(b, w.rd.HardState); err != nil {
				panic(err)
			}
		}
		w.g.recordProposalIndexes(w.rd.Entries)
		mustSync = mustSync || w.rd.MustSync
		nents += len(w.rd.Entries)
	}
	if !b.Empty() {
		opt := pebble.NoSync
		if mustSync {
			opt = pebble.Sync
		}
		syncStart := time.Now()
		if err := l.store.commit(b, opt); err != nil {
			// The log store is the replica's promise and it cannot keep
			// it: its directory is failed (commit), and no group of this
			// batch reports its Ready persisted (no message, no Advance:
			// no acknowledgement, no vote). The store's groups stop.
			b.Close()
			l.failGroups(err)
			return
		}
		h.metrics.observeBatch(len(work), nents, mustSync, time.Since(syncStart))
	}
	b.Close()
	if err := l.store.usable(); err != nil {
		// Failed meanwhile (a flush or compaction of Pebble's own): even
		// if this batch is durable, nothing more leaves the directory.
		l.failGroups(err)
		return
	}

	for _, w := range work {
		if !w.sent && !w.g.isStopped() {
			h.send(w.g, w.rest)
		}
	}
	for _, w := range work {
		// Proposals (and their data) that no Ready carried were discarded
		// by raft: fail them now.
		w.g.sweepDiscarded(w.epoch)
		w.g.advance(w.rd)
	}
	d := time.Since(start)
	h.metrics.loopSeconds.Observe(d.Seconds())
	if d > 200*time.Millisecond {
		h.log.Warn("slow store-loop iteration", "dir", l.store.dir, "took", d, "groups", len(work), "entries", nents)
	}
}
