package datanode

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Commands from heartbeat answers run on their own goroutine, one at a
// time in the order SCM sent them (Ozone's CommandDispatcher), not in the
// heartbeat loop: a command can wait on a slow disk (joining or leaving a
// pipeline syncs on the log disk) or on a Raft proposal (closeContainer,
// up to 10 s), and a datanode whose heartbeats stop for the stale
// interval is STALE to SCM, which then closes every pipeline it is in.
// With one degraded disk that turned a slow disk into a "stale" healthy
// datanode (cluster.TestSlowDisksAvoided under load, session 17).
//
// SCM sends a command again while it does not see its effect (a pipeline
// not reported, a container still open, a delete not acked), so:
//   - a command equal to one still waiting in the queue is not queued
//     twice (one that already started may run again: every command is
//     idempotent, as a resend after a slow heartbeat already required);
//   - when the queue is full (maxQueuedCommands) a command is dropped,
//     counted and logged; SCM sends it again.
//
// Execute (tests, admin) still runs a command at once, on the caller's
// goroutine.
const maxQueuedCommands = 1024

type cmdQueue struct {
	mu      sync.Mutex
	q       []queuedCmd
	pending map[string]struct{} // keys of the commands in q
	wake    chan struct{}       // cap 1

	queued, dropped, deduped, done, failed, abandoned atomic.Uint64
	collectors                                        []prometheus.Collector

	// running: when the command now running started (unix ns; 0: none),
	// and what it is (for the stuck-command warning).
	running    atomic.Int64
	runningCmd atomic.Pointer[metapb.DatanodeCommand]
}

// stuckCommandAfter: a command running this long is logged at WARN (then
// every stuckCommandAfter again) and shows in
// basalt_datanode_commands_running_seconds. Heartbeats go on while it
// runs, so SCM sees the datanode HEALTHY; the commands behind it wait
// (its resends are deduplicated): the warning and the gauge are how an
// operator sees it.
const stuckCommandAfter = 60 * time.Second

type queuedCmd struct {
	key string
	cmd *metapb.DatanodeCommand
}

func newCmdQueue() *cmdQueue {
	return &cmdQueue{pending: map[string]struct{}{}, wake: make(chan struct{}, 1)}
}

// cmdKey identifies a command's content (deterministic encoding).
func cmdKey(cmd *metapb.DatanodeCommand) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(cmd)
	if err != nil {
		return "" // never deduplicated
	}
	return string(b)
}

// enqueue queues cmd; false if it was dropped (queue full).
func (q *cmdQueue) enqueue(cmd *metapb.DatanodeCommand) bool {
	k := cmdKey(cmd)
	q.mu.Lock()
	if k != "" {
		if _, ok := q.pending[k]; ok {
			q.mu.Unlock()
			q.deduped.Add(1)
			return true
		}
	}
	if len(q.q) >= maxQueuedCommands {
		q.mu.Unlock()
		q.dropped.Add(1)
		return false
	}
	q.q = append(q.q, queuedCmd{key: k, cmd: cmd})
	if k != "" {
		q.pending[k] = struct{}{}
	}
	q.mu.Unlock()
	q.queued.Add(1)
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return true
}

// next takes the oldest queued command, or nil.
func (q *cmdQueue) next() *metapb.DatanodeCommand {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.q) == 0 {
		return nil
	}
	c := q.q[0]
	q.q[0] = queuedCmd{}
	q.q = q.q[1:]
	if len(q.q) == 0 {
		q.q = nil // let the backing array go
	}
	if c.key != "" {
		delete(q.pending, c.key)
	}
	return c.cmd
}

// waiting is the number of queued commands not started.
func (q *cmdQueue) waiting() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.q)
}

// commandLoop runs the queued commands until the datanode stops (what is
// left is dropped, counted as abandoned: SCM sends it again to the
// restarted datanode).
func (d *Datanode) commandLoop() {
	defer d.wg.Done()
	q := d.cmds
	for {
		select {
		case <-d.stopc:
			q.abandon()
			return
		case <-q.wake:
		}
		for {
			select {
			case <-d.stopc:
				q.abandon()
				return
			default:
			}
			cmd := q.next()
			if cmd == nil {
				break
			}
			q.runningCmd.Store(cmd)
			q.running.Store(time.Now().UnixNano())
			if err := d.execute(cmd); err != nil {
				q.failed.Add(1)
				d.log.Warn("command failed", "cmd", cmd.String(), "err", err)
			}
			q.running.Store(0)
			q.done.Add(1)
		}
	}
}

// watchStuckCommand logs the command running past stuckCommandAfter
// (heartbeatLoop calls it each beat: it never waits on the command).
func (d *Datanode) watchStuckCommand(now time.Time) {
	q := d.cmds
	start := q.running.Load()
	if start == 0 {
		return
	}
	age := now.Sub(time.Unix(0, start))
	if age < stuckCommandAfter {
		return
	}
	// Once per stuckCommandAfter of its age.
	if age%stuckCommandAfter >= d.hbInterval && d.hbInterval > 0 {
		return
	}
	cmd := q.runningCmd.Load()
	d.log.Warn("SCM command still running: the commands behind it wait", "cmd", cmd.String(), "running", age.Round(time.Second), "waiting", q.waiting())
}

// abandon drops what is still queued at shutdown.
func (q *cmdQueue) abandon() {
	q.mu.Lock()
	n := len(q.q)
	q.q, q.pending = nil, map[string]struct{}{}
	q.mu.Unlock()
	q.abandoned.Add(uint64(n))
}

// queueCommand hands a heartbeat's command to commandLoop.
func (d *Datanode) queueCommand(cmd *metapb.DatanodeCommand) {
	if !d.cmds.enqueue(cmd) {
		d.log.Warn("command queue full: command dropped (SCM sends it again)", "limit", maxQueuedCommands, "cmd", cmd.String())
	}
}

// CommandStats are the heartbeat command queue's counters: commands
// queued, dropped (queue full), not queued for an equal one waiting,
// finished (failed ones included), failed, left queued at shutdown, and
// waiting now.
type CommandStats struct {
	Queued, Dropped, Deduplicated, Done, Failed, Abandoned uint64
	Waiting                                                int
}

// CommandStats returns the command queue's counters.
func (d *Datanode) CommandStats() CommandStats {
	q := d.cmds
	return CommandStats{Queued: q.queued.Load(), Dropped: q.dropped.Load(), Deduplicated: q.deduped.Load(),
		Done: q.done.Load(), Failed: q.failed.Load(), Abandoned: q.abandoned.Load(), Waiting: q.waiting()}
}

func (d *Datanode) registerCommandMetrics() {
	if d.cfg.Registerer == nil {
		return
	}
	q := d.cmds
	counter := func(name, help string, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode_commands", Name: name, Help: help},
			func() float64 { return float64(f()) })
	}
	all := []prometheus.Collector{
		counter("queued_total", "SCM commands queued from heartbeat answers.", q.queued.Load),
		counter("dropped_total", "SCM commands dropped because the queue was full (SCM sends them again).", q.dropped.Load),
		counter("deduplicated_total", "SCM commands not queued because an equal one was waiting.", q.deduped.Load),
		counter("done_total", "SCM commands finished (failed ones included).", q.done.Load),
		counter("failed_total", "SCM commands that returned an error.", q.failed.Load),
		counter("abandoned_total", "SCM commands still queued when the datanode stopped (SCM sends them again).", q.abandoned.Load),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode_commands", Name: "waiting",
			Help: "SCM commands queued and not started."}, func() float64 { return float64(q.waiting()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode_commands", Name: "running_seconds",
			Help: "How long the SCM command now running has run (0: none). The commands behind it wait."}, func() float64 {
			if st := q.running.Load(); st != 0 {
				return time.Since(time.Unix(0, st)).Seconds()
			}
			return 0
		}),
	}
	// The block token and volume fatal-error counters register (and
	// unregister at Close) with these.
	all = append(all, d.tokenCollectors()...)
	all = append(all, d.volumeFatalCollectors()...)
	for _, c := range all {
		// A second datanode on the same registry (tests) exports nothing:
		// only what registered here is unregistered at Close.
		if d.cfg.Registerer.Register(c) == nil {
			q.collectors = append(q.collectors, c)
		}
	}
}
