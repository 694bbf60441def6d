package sim

import (
	"fmt"
	"hash"
	"hash/fnv"
	"io"
	"log/slog"
	"math/rand/v2"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/basalt-store/basalt/internal/raft"
)

// Config is one simulation run. Everything else is drawn from Seed.
type Config struct {
	Seed uint64
	// Steps is the number of workload actions (client operations and
	// faults); default 200.
	Steps int
	// Logf, when set, receives the trace (every event, fault and result).
	Logf func(format string, args ...any)
}

// Report is what a run did and what its checkers found.
type Report struct {
	Seed    uint64
	Nodes   int
	SimTime time.Duration
	Events  int
	Polls   int

	BlocksTried, BlocksAcked, BlocksFailed int
	SmallAcked                             int // of BlocksAcked, written with PutSmallFile
	SmallBatched                           int // of BlocksTried, small files proposed in a batch (smallBatch)
	KVOps, KVAcked, KVUnknown, KVFailed    int
	Crashes, Partitions, DiskFaults        int
	NetSent, NetDropped, NetDuplicated     int
	UnhealthyReplicas                      int // acked blocks whose replica's container is UNHEALTHY (reported, not lost)
	// Panics: a node's process would have died (not a safety violation;
	// the node restarts from its disk). LogDirFailures: a node's raft log
	// directory failed and the node was restarted (as a panic). PanicMsgs:
	// the first few causes of either.
	Panics         int
	LogDirFailures int
	PanicMsgs      []string

	// Trace hashes every event and outcome: two runs of one seed must
	// agree (TestSimDeterministic).
	Trace uint64
	// Violations are the checkers' findings; empty means the run passed.
	Violations []string
}

func (r *Report) String() string {
	return fmt.Sprintf("seed %d: %d nodes, %v simulated, %d events; blocks %d tried (%d in small batches) %d acked (%d small) %d failed (%d replicas reported UNHEALTHY); kv %d ops %d acked %d unknown %d failed; %d crashes %d partitions %d disk faults; net %d sent %d dropped %d duplicated; trace %016x",
		r.Seed, r.Nodes, r.SimTime, r.Events, r.BlocksTried, r.SmallBatched, r.BlocksAcked, r.SmallAcked, r.BlocksFailed, r.UnhealthyReplicas,
		r.KVOps, r.KVAcked, r.KVUnknown, r.KVFailed, r.Crashes, r.Partitions, r.DiskFaults,
		r.NetSent, r.NetDropped, r.NetDuplicated, r.Trace) + fmt.Sprintf("; %d node panics, %d failed log dirs %q", r.Panics, r.LogDirFailures, r.PanicMsgs)
}

const (
	groupMeta     = 1
	groupPipeline = 100

	tick           = 10 * time.Millisecond
	electionTicks  = 10
	heartbeatTicks = 1

	opTimeout      = 3 * time.Second  // a client gives up on an operation
	waitAllTimeout = 5 * time.Second  // PutBlock's wait for every replica
	healQuiet      = 20 * time.Second // after the faults stop, before checking
	maxPollRounds  = 10000
)

// Sim is one run: the world (nodes, network, clock) and the workload's
// history.
type Sim struct {
	cfg Config
	rep Report
	clk clock
	net *network

	work, faults, crashRng *rand.Rand

	nodes      []*node
	pipeline   []uint64
	metaPeers  []uint64
	maxApplied map[[2]uint64]uint64 // (node, group) → highest AppliedIndex seen

	blocks   []*blockOp
	nextLID  uint64
	openCids []uint64 // containers the workload writes into
	nextCid  uint64
	kvops    []*kvOp
	clients  []*kvClient

	ioDebt atomic.Int64 // simulated I/O latency not yet charged to the clock
	trace  hash.Hash64
	log    *slog.Logger
	ending bool
}

// Run runs one simulation and its checkers.
func Run(cfg Config) *Report {
	if cfg.Steps <= 0 {
		cfg.Steps = 200
	}
	s := &Sim{cfg: cfg, maxApplied: map[[2]uint64]uint64{}, trace: fnv.New64a(),
		work: stream(cfg.Seed, "work"), faults: stream(cfg.Seed, "faults"), crashRng: stream(cfg.Seed, "crash"),
		log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s.rep.Seed = cfg.Seed
	s.openCids, s.nextCid = []uint64{1, 2, 3}, 4
	s.run()
	s.rep.SimTime = s.clk.now
	s.rep.NetSent, s.rep.NetDropped, s.rep.NetDuplicated = s.net.sent, s.net.dropped, s.net.duplicated
	s.rep.Trace = s.trace.Sum64()
	for _, n := range s.nodes {
		n.stop()
	}
	return &s.rep
}

func (s *Sim) logf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	fmt.Fprintf(s.trace, "%d %s\n", s.clk.now, msg)
	if s.cfg.Logf != nil {
		s.cfg.Logf("%10v %s", s.clk.now, msg)
	}
}

func (s *Sim) violate(format string, args ...any) {
	v := fmt.Sprintf("at %v: ", s.clk.now) + fmt.Sprintf(format, args...)
	s.logf("VIOLATION %s", v)
	if len(s.rep.Violations) < 50 {
		s.rep.Violations = append(s.rep.Violations, v)
	}
}

func (s *Sim) run() {
	setup := stream(s.cfg.Seed, "setup")
	nn := 3 + setup.IntN(3)
	s.rep.Nodes = nn
	ids := make([]uint64, nn)
	for i := range ids {
		ids[i] = uint64(i + 1)
	}
	// The pipeline is 3 of the nodes, the metadata group all of them when
	// their number is odd (else the first 3).
	perm := setup.Perm(nn)
	for _, p := range perm[:3] {
		s.pipeline = append(s.pipeline, ids[p])
	}
	sort.Slice(s.pipeline, func(i, j int) bool { return s.pipeline[i] < s.pipeline[j] })
	s.metaPeers = ids
	if nn%2 == 0 {
		s.metaPeers = ids[:3]
	}
	netCfg := NetConfig{MinDelay: time.Millisecond, MaxDelay: time.Duration(1+setup.IntN(20)) * time.Millisecond}
	s.net = newNetwork(&s.clk, stream(s.cfg.Seed, "net"), netCfg)
	s.net.trace = func(m string) { s.logf("%s", m) }
	direct := setup.IntN(2) == 0
	for _, id := range ids {
		n := newNode(s, id, direct)
		s.nodes = append(s.nodes, n)
		if err := n.start(); err != nil {
			s.violate("node %d does not start: %v", id, err)
			return
		}
	}
	s.logf("world: %d nodes, pipeline %v, meta %v, O_DIRECT %v, net delay %v-%v", nn, s.pipeline, s.metaPeers, direct, netCfg.MinDelay, netCfg.MaxDelay)
	for c := 0; c < 3; c++ {
		s.clients = append(s.clients, &kvClient{id: c})
	}
	// The workload: Steps actions at random intervals.
	at := time.Duration(0)
	for i := 0; i < s.cfg.Steps; i++ {
		at += time.Duration(s.work.IntN(int(100 * time.Millisecond)))
		s.clk.after(at, "step", s.step)
	}
	s.clk.after(at+time.Millisecond, "heal", s.heal)
	s.loop(func() bool { return s.ending })
	if s.unknownViolation() {
		return
	}
	end := s.clk.now + healQuiet
	s.loop(func() bool { return s.clk.now >= end })
	s.finalReads()
	// Let every replica catch up with the final reads before comparing.
	end = s.clk.now + 2*time.Second
	s.loop(func() bool { return s.clk.now >= end })
	s.check()
}

// loop runs events until done or no event is left.
func (s *Sim) loop(done func() bool) {
	for !done() {
		e, ok := s.clk.next()
		if !ok {
			return
		}
		s.rep.Events++
		if e.what != "tick" {
			s.logf("%s", e.what)
		}
		e.fn()
		s.pollAll()
		if d := s.ioDebt.Swap(0); d > 0 {
			s.clk.advance(time.Duration(d))
		}
		if s.unknownViolation() && !s.ending {
			return
		}
	}
}

// pollAll lets every node do all the work it has, in node order, until
// none has any (bounded).
func (s *Sim) pollAll() {
	for round := 0; round < maxPollRounds; round++ {
		did := false
		for _, n := range s.nodes {
			if n.up && s.poll(n) {
				did = true
				s.rep.Polls++
			}
		}
		if !did {
			return
		}
	}
	s.logf("poll: nodes still busy after %d rounds", maxPollRounds)
}

// poll runs one Poll of n. A node dies in two ways here, and either way
// it crashes, abandoned as it is (its locks may be held), and restarts
// from its disk later, as its supervisor (or operator) restarts it:
//   - a panic inside Poll ends the process on a real node (Pebble's
//     fatal errors outside the raft log store, e.g. the metadata store's);
//   - a raft log directory fails (internal/raft/logfatal.go: a fatal I/O
//     error of its Pebble stops its groups, the process stays up): the
//     node's only log directory is /raft, so every group of the node is
//     stopped until a restart re-opens the directory.
//
// Only a full disk is an expected cause (defect D3); any other is a
// violation.
func (s *Sim) poll(n *node) (did bool) {
	defer func() {
		if r := recover(); r != nil {
			msg := fmt.Sprint(r)
			if i := strings.IndexByte(msg, '\n'); i > 0 {
				msg = msg[:i]
			}
			s.rep.Panics++
			s.die(n, "PANICKED (process would exit)", msg)
			did = true
		}
	}()
	did = n.host.Poll()
	for _, d := range n.host.LogDirs() {
		if d.Failed {
			s.rep.LogDirFailures++
			s.die(n, fmt.Sprintf("log directory %s FAILED (restarted by its supervisor)", d.Dir), d.Error)
			return true
		}
	}
	return did
}

// die crashes n (abandoned) after a panic or a failed log directory, and
// restarts it later.
func (s *Sim) die(n *node, how, msg string) {
	if !strings.Contains(msg, "no space left on device") {
		// Only a full disk is an expected way for a node to die
		// (defect D3); anything else is a finding.
		s.violate("node %d %s: %s", n.id, how, msg)
	}
	if len(s.rep.PanicMsgs) < 10 {
		s.rep.PanicMsgs = append(s.rep.PanicMsgs, fmt.Sprintf("node %d: %s", n.id, msg))
	}
	s.logf("node %d %s: %s", n.id, how, msg)
	n.abandon(s.crashRng)
	s.clk.after(time.Duration(500+s.faults.IntN(2000))*time.Millisecond, fmt.Sprintf("restart %d", n.id), func() { s.restart(n) })
}

// step is one workload action.
func (s *Sim) step() {
	r := s.work.IntN(100)
	switch {
	case r < 46:
		s.startBlock()
	case r < 92:
		s.startKV(s.clients[s.work.IntN(len(s.clients))])
	default:
		s.fault()
	}
}

// fault injects one fault, drawn from its own stream.
func (s *Sim) fault() {
	f := s.faults
	n := s.nodes[f.IntN(len(s.nodes))]
	switch r := f.IntN(100); {
	case r < 25:
		if n.up {
			s.rep.Crashes++
			s.crash(n)
			s.clk.after(time.Duration(200+f.IntN(1500))*time.Millisecond, fmt.Sprintf("restart %d", n.id), func() { s.restart(n) })
		}
	case r < 45:
		ids := make([]uint64, len(s.nodes))
		for i, m := range s.nodes {
			ids[i] = m.id
		}
		a, b := partitionSides(f, ids)
		s.rep.Partitions++
		s.logf("partition %v | %v", a, b)
		s.net.partition(a, b)
		s.clk.after(time.Duration(500+f.IntN(4000))*time.Millisecond, "heal partition", s.net.heal)
	case r < 60:
		cfg := s.net.cfg
		cfg.Drop = []float64{0, 0.01, 0.05, 0.2}[f.IntN(4)]
		cfg.Duplicate = []float64{0, 0.01, 0.05}[f.IntN(3)]
		cfg.MaxDelay = time.Duration(1+f.IntN(50)) * time.Millisecond
		s.logf("network: drop %.2f duplicate %.2f delay %v-%v", cfg.Drop, cfg.Duplicate, cfg.MinDelay, cfg.MaxDelay)
		s.net.cfg = cfg
	default:
		if !n.up {
			return
		}
		s.rep.DiskFaults++
		kind := []string{"full", "eio", "torn", "slow"}[f.IntN(4)]
		d := time.Duration(300+f.IntN(3000)) * time.Millisecond
		n.diskFault(kind, f)
		s.logf("disk fault on %d: %s for %v", n.id, kind, d)
		ep := n.epoch
		s.clk.after(d, fmt.Sprintf("disk fault on %d ends", n.id), func() {
			if n.epoch != ep {
				return
			}
			n.clearFaults()
			if n.ioFault {
				// Storage holds a volume that returned EIO failed until the
				// process restarts (the disk is replaced): restart it.
				s.crash(n)
				s.clk.after(time.Duration(100+f.IntN(1000))*time.Millisecond, fmt.Sprintf("restart %d", n.id), func() { s.restart(n) })
			}
		})
	}
}

// crashSoon sometimes crashes n within a few milliseconds of a moment
// where durability is easy to get wrong (a snapshot just restored), as
// VOPR aims crashes at interesting points rather than only at random ones.
func (s *Sim) crashSoon(n *node, why string) {
	if s.ending || !chance(s.faults, 0.2) {
		return
	}
	ep := n.epoch
	d := time.Duration(s.faults.IntN(int(30 * time.Millisecond)))
	s.clk.after(d, fmt.Sprintf("crash %d soon %s", n.id, why), func() {
		if n.up && n.epoch == ep {
			s.rep.Crashes++
			s.crash(n)
			s.clk.after(time.Duration(200+s.faults.IntN(1500))*time.Millisecond, fmt.Sprintf("restart %d", n.id), func() { s.restart(n) })
		}
	})
}

func (s *Sim) crash(n *node) {
	s.logf("crash %d", n.id)
	n.crash(s.crashRng)
}

func (s *Sim) restart(n *node) {
	if n.up {
		return
	}
	err := s.safeStart(n)
	if err == nil {
		return
	}
	if !s.ending && n.faulty() {
		// A full disk may keep a node from starting; it tries again.
		s.logf("node %d cannot start yet: %v", n.id, err)
		s.clk.after(time.Second, fmt.Sprintf("restart %d", n.id), func() { s.restart(n) })
		return
	}
	s.violate("node %d does not restart after a crash: %v", n.id, err)
}

// safeStart starts n, turning a panic into an error.
func (s *Sim) safeStart(n *node) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
			n.abandon(s.crashRng)
		}
	}()
	return n.start()
}

// heal ends the faults: every node up, the network whole and clean,
// disks healthy. What follows must converge.
func (s *Sim) heal() {
	s.logf("heal: faults stop")
	s.ending = true
	s.net.heal()
	s.net.cfg.Drop, s.net.cfg.Duplicate = 0, 0
	for _, n := range s.nodes {
		if n.up && n.ioFault {
			s.logf("heal: node %d had I/O errors; crash and restart it", n.id)
			s.crash(n)
		}
		if n.up {
			n.clearFaults()
		} else {
			s.restart(n)
		}
	}
}

func (s *Sim) node(id uint64) *node { return s.nodes[id-1] }

// leaderOf returns the up node that leads group g, if any.
func (s *Sim) leaderOf(members []uint64, g uint64) *node {
	for _, id := range members {
		n := s.node(id)
		if n.up && n.group(g) != nil && n.group(g).IsLeader() {
			return n
		}
	}
	return nil
}

// Replay is the command that reruns a seed.
func Replay(seed uint64, steps int) string {
	return fmt.Sprintf("go test ./internal/sim -run 'TestSim$' -seed=%d -steps=%d -v", seed, steps)
}

func joinIDs(m map[uint64]uint64) string {
	var parts []string
	for id, v := range m {
		parts = append(parts, fmt.Sprintf("%d@%d", id, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

var _ = raft.ErrStopped

// unknownViolation reports whether a checker found something not already
// known (a known defect does not end the run: it may hide others).
func (s *Sim) unknownViolation() bool {
	for _, v := range s.rep.Violations {
		if !isKnown(v) {
			return true
		}
	}
	return false
}

func isKnown(v string) bool {
	return strings.HasPrefix(v, knownDefect)
}

// OnlyKnown reports whether every violation of the run is a known defect.
func (r *Report) OnlyKnown() bool {
	for _, v := range r.Violations {
		if !isKnown(v) {
			return false
		}
	}
	return len(r.Violations) > 0
}
