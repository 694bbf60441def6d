package sim

import (
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"path"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// node is one simulated machine: a disk (MemFS) that survives crashes as
// much as a real one would, and on it a raft host in manual mode with the
// pipeline group (the REAL container state machine over REAL storage)
// and the metadata group (the REAL metadata store).
type node struct {
	s      *Sim
	id     uint64
	fs     *vfs.MemFS
	direct bool
	up     bool
	epoch  int // incarnation: bumped at every crash

	host  *raft.Host
	store *storage.Store
	kvst  *store.Store
	dn    *recDSM
	kv    *recSM
	dnG   *raft.Group
	kvG   *raft.Group

	// Disk faults, read by MemFS hooks (maybe on Pebble's goroutines).
	fmu    sync.Mutex
	eio    float64
	torn   float64
	slow   time.Duration
	counts map[string]uint64 // per path: operations seen, for fault draws
	// ioFault: EIO or torn writes were injected since the node started;
	// storage then holds the volume failed until a restart (as after a
	// disk replacement), so healing restarts it.
	ioFault bool
	// checking: the checkers are reading; no faults (a checker must not
	// change what it observes).
	checking bool
}

const diskBytes = 256 << 20

func newNode(s *Sim, id uint64, direct bool) *node {
	n := &node{s: s, id: id, direct: direct, counts: map[string]uint64{}}
	n.fs = vfs.NewMem(vfs.MemOptions{Capacity: diskBytes, DirectIO: direct})
	return n
}

func (n *node) group(g uint64) *raft.Group {
	if g == groupMeta {
		return n.kvG
	}
	return n.dnG
}

func contains(ids []uint64, id uint64) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// start opens everything from the node's disk, as a process start does.
func (n *node) start() error {
	n.fs.SetInject(n.inject)
	n.fs.SetLatency(n.latency)
	// Storage commits its Pebble batches on a goroutine of its own, where
	// Pebble's fatal ENOSPC panic would end the test binary, not one
	// node: a full disk spares storage's Pebble (as reserved space would).
	// The raft log store and the metadata store commit on the simulator's
	// goroutine, so a full disk reaches them (defect D3): the metadata
	// store panics, the raft log directory fails (Sim.poll restarts the
	// node either way).
	n.fs.SetReserved(func(p string) bool { return strings.HasPrefix(p, "/vol/basalt/meta/") })
	mode := storage.DirectOff
	if n.direct {
		mode = storage.DirectAuto
	}
	st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: n.fs, DirectIO: mode,
		ContainerSize: 64 << 20, KeepUncommitted: true, OutOfOrderWrites: true,
		// No deferred writes: their flusher syncs files on a timer of its
		// own goroutine, which a seed could not replay exactly.
		DeferredMax: -1})
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	n.store = st
	if contains(n.s.pipeline, n.id) {
		sm, err := datanode.NewContainerStateMachine(groupPipeline, st, n.fs, "/dn", n.s.log)
		if err != nil {
			n.stop()
			return fmt.Errorf("container state machine: %w", err)
		}
		n.dn = &recDSM{recSM: recSM{sm: sm, n: n, group: groupPipeline, results: map[uint64]error{}}, dsm: sm}
		n.dn.opened()
	}
	if contains(n.s.metaPeers, n.id) {
		kvst, err := store.Open("/meta", store.Options{SyncInterval: -1, CacheBytes: 1 << 20, FS: n.fs, Logger: n.s.log})
		if err != nil {
			n.stop()
			return fmt.Errorf("metadata store: %w", err)
		}
		n.kvst = kvst
		n.kv = &recSM{sm: &kvSM{st: kvst}, n: n, group: groupMeta}
		n.kv.opened()
	}
	h, err := raft.NewHost(raft.HostConfig{ID: n.id, LogDirs: []string{"/raft"}, Transport: n.s.net.transport(n.id),
		Manual: true, TickInterval: -1, ElectionTicks: electionTicks, HeartbeatTicks: heartbeatTicks,
		CompactEvery: 64, CompactKeep: 16, FS: n.fs, Logger: n.s.log})
	if err != nil {
		n.stop()
		return fmt.Errorf("raft host: %w", err)
	}
	n.host = h
	if n.dn != nil {
		if n.dnG, err = h.AddGroup(raft.GroupConfig{ID: groupPipeline, Peers: n.s.pipeline, StateMachine: n.dn}); err != nil {
			n.stop()
			return fmt.Errorf("pipeline group: %w", err)
		}
	}
	if n.kv != nil {
		if n.kvG, err = h.AddGroup(raft.GroupConfig{ID: groupMeta, Peers: n.s.metaPeers, StateMachine: n.kv}); err != nil {
			n.stop()
			return fmt.Errorf("metadata group: %w", err)
		}
	}
	n.up = true
	n.ioFault = false
	n.s.logf("node %d up (incarnation %d)", n.id, n.epoch)
	n.scheduleTick()
	return nil
}

// scheduleTick ticks the host every tick, with a per-node phase so hosts
// do not tick in lockstep.
func (n *node) scheduleTick() {
	ep := n.epoch
	var next func()
	next = func() {
		if !n.up || n.epoch != ep {
			return
		}
		n.host.Tick()
		n.s.clk.after(tick, "tick", next)
	}
	phase := time.Duration(n.s.work.IntN(int(tick)))
	n.s.clk.after(phase, "tick", next)
}

// stop closes what is open (errors do not matter: the node is going away
// or its disk was already cloned).
func (n *node) stop() {
	if n.host != nil {
		n.host.Close()
		n.host = nil
	}
	n.s.net.down(n.id)
	if n.kvst != nil {
		n.kvst.Close()
		n.kvst = nil
	}
	if n.store != nil {
		n.store.Close()
		n.store = nil
	}
	n.dnG, n.kvG, n.dn, n.kv = nil, nil, nil, nil
	n.up = false
}

// crash takes the disk as a crash now could leave it, then stops the
// node (what stopping writes goes to the old disk, which is discarded).
func (n *node) crash(r *rand.Rand) {
	clone := n.fs.CrashClone(rand.New(rand.NewPCG(r.Uint64(), r.Uint64())))
	n.epoch++
	n.stop()
	n.fs = clone
	n.clearFaults()
}

// abandon is a crash after a panic: nothing is closed (locks may be held
// by the code that panicked); the node's goroutines (Pebble's) leak.
func (n *node) abandon(r *rand.Rand) {
	clone := n.fs.CrashClone(rand.New(rand.NewPCG(r.Uint64(), r.Uint64())))
	n.epoch++
	n.s.net.down(n.id)
	n.host, n.store, n.kvst = nil, nil, nil
	n.dnG, n.kvG, n.dn, n.kv = nil, nil, nil, nil
	n.up = false
	n.fs = clone
	n.clearFaults()
}

// faulty reports whether a disk fault is active.
func (n *node) faulty() bool {
	n.fmu.Lock()
	defer n.fmu.Unlock()
	return n.eio > 0 || n.torn > 0 || n.slow > 0 || n.fs.Options().Capacity < diskBytes
}

// isPebble reports whether a path is a Pebble file. Faults other than a
// full disk are not injected there: Pebble treats a failed write of its
// WAL or manifest as fatal and panics on its own goroutine, which would
// end the whole test binary rather than one simulated node.
func isPebble(p string) bool {
	b := path.Base(p)
	for _, suf := range []string{".sst", ".log", ".blob"} {
		if strings.HasSuffix(b, suf) {
			return true
		}
	}
	for _, pre := range []string{"MANIFEST", "OPTIONS", "CURRENT", "LOCK", "marker", "/"} {
		if strings.HasPrefix(b, pre) {
			return true
		}
	}
	return strings.Contains(p, "/meta/") || strings.HasPrefix(p, "/raft")
}

// inject decides a fault for one operation from the seed, the path and
// how many operations that path saw, so the decision does not depend on
// which goroutine asked first.
func (n *node) inject(op, p string) error {
	n.fmu.Lock()
	defer n.fmu.Unlock()
	if (n.eio == 0 && n.torn == 0) || n.checking || isPebble(p) {
		return nil
	}
	n.counts[p]++
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%d/%s/%s/%d", n.s.cfg.Seed, n.epoch, op, p, n.counts[p])
	x := float64(h.Sum64()%1_000_000) / 1_000_000
	switch {
	case op == "write" && x < n.torn:
		return vfs.ErrTornWrite
	case x < n.eio:
		return unix.EIO
	}
	return nil
}

// latency charges simulated time for I/O while the disk is slow.
func (n *node) latency(op, p string, bytes int) {
	n.fmu.Lock()
	slow := n.slow
	n.fmu.Unlock()
	if slow > 0 && (op == "sync" || op == "syncdir" || op == "write") {
		n.s.ioDebt.Add(int64(slow))
	}
}

func (n *node) diskFault(kind string, r *rand.Rand) {
	n.fmu.Lock()
	defer n.fmu.Unlock()
	switch kind {
	case "full":
		n.fs.SetCapacity(n.fs.Used() + int64(r.IntN(64<<10)))
	case "eio":
		n.eio = []float64{0.01, 0.1, 0.5}[r.IntN(3)]
		n.ioFault = true
	case "torn":
		n.torn = []float64{0.05, 0.3}[r.IntN(2)]
		n.ioFault = true
	case "slow":
		n.slow = time.Duration(1+r.IntN(30)) * time.Millisecond
	}
}

func (n *node) clearFaults() {
	n.fmu.Lock()
	n.eio, n.torn, n.slow = 0, 0, 0
	n.fmu.Unlock()
	n.fs.SetCapacity(diskBytes)
}

// recSM wraps a state machine to check, on every call, that its applied
// index never goes backwards (within an incarnation and across crashes)
// and that entries arrive in order, and records each entry's result (the
// leader's wait for all replicas asks, like the datanode's ApplyStatus).
type recSM struct {
	sm      raft.StateMachine
	n       *node
	group   uint64
	last    uint64           // highest index handed to Apply or Restore this incarnation
	results map[uint64]error // pipeline: entry → its error on this replica (nil: applied fine)
	// restored: the highest snapshot index restored this incarnation.
	restored uint64
}

func (r *recSM) key() [2]uint64 { return [2]uint64{r.n.id, r.group} }

// opened checks the state machine just opened from disk: it must not have
// forgotten what it reported as applied before the crash.
func (r *recSM) opened() {
	a := r.sm.AppliedIndex()
	if max := r.n.s.maxApplied[r.key()]; a < max {
		r.n.s.violate("node %d group %d: applied index went back from %d to %d across a restart", r.n.id, r.group, max, a)
	}
	r.last = a
	r.observe(a)
}

func (r *recSM) observe(a uint64) {
	k := r.key()
	if max := r.n.s.maxApplied[k]; a < max {
		r.n.s.violate("node %d group %d: applied index went back from %d to %d", r.n.id, r.group, max, a)
		return
	}
	r.n.s.maxApplied[k] = a
}

func (r *recSM) Apply(ents []raft.Entry) []any {
	for _, e := range ents {
		if e.Index <= r.last {
			r.n.s.violate("node %d group %d: entry %d applied after %d", r.n.id, r.group, e.Index, r.last)
		}
		r.last = e.Index
	}
	out := r.sm.Apply(ents)
	if r.results != nil {
		for i, e := range ents {
			err, _ := out[i].(error)
			r.results[e.Index] = err
		}
	}
	r.observe(r.sm.AppliedIndex())
	return out
}

func (r *recSM) AppliedIndex() uint64 {
	a := r.sm.AppliedIndex()
	r.observe(a)
	return a
}

func (r *recSM) Snapshot() (uint64, io.ReadCloser, error) { return r.sm.Snapshot() }

func (r *recSM) Restore(index uint64, rd io.Reader) error {
	err := r.sm.Restore(index, rd)
	if err == nil && index > r.last {
		r.last = index
	}
	if err == nil && index > r.restored {
		r.restored = index
	}
	r.observe(r.sm.AppliedIndex())
	r.n.s.logf("node %d group %d: restored snapshot at %d: %v", r.n.id, r.group, index, err)
	if err == nil {
		r.n.s.crashSoon(r.n, "after restoring a snapshot")
	}
	return err
}

// recDSM is recSM for a state machine that keeps data out of the log.
type recDSM struct {
	recSM
	dsm raft.DataStateMachine
}

func (r *recDSM) WriteData(index, term uint64, meta, data []byte) error {
	return r.dsm.WriteData(index, term, meta, data)
}

// WriteDataLogged passes raft.DataLogger through. The simulated storage
// has DeferredMax -1 (no chunk kept inline), so it always answers "not in
// the log": the simulator does not run small files' data in the log (see
// docs/ARCHITECTURE.md, "Deterministic simulation").
func (r *recDSM) WriteDataLogged(index, term uint64, meta, data []byte) (bool, error) {
	if dl, ok := r.dsm.(raft.DataLogger); ok {
		return dl.WriteDataLogged(index, term, meta, data)
	}
	return false, r.dsm.WriteData(index, term, meta, data)
}

// SyncData passes the host's batch flush through (raft.DataSyncer).
func (r *recDSM) SyncData() error {
	if ds, ok := r.dsm.(raft.DataSyncer); ok {
		return ds.SyncData()
	}
	return nil
}

func (r *recDSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	return r.dsm.ReadData(index, term, meta)
}
