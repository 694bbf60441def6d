package faulttest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"
)

// FaultKind is one kind of fault.
type FaultKind string

const (
	KillDN   FaultKind = "kill-dn"   // kill -9 a datanode, restart it on the same data dir
	KillMeta FaultKind = "kill-meta" // kill -9 the namespace leader, restart it
	StopDN   FaultKind = "stop-dn"   // SIGSTOP a datanode, SIGCONT after StopFor
	FillDisk FaultKind = "fill-disk" // fill a datanode's data volume (until the workload ends)
	// Impatient: for Down, a client writes large V1 keys with deadlines of
	// 0.1–1.6 s (requests cancelled while their proposals are in flight).
	ImpatientClient FaultKind = "impatient"
)

// Fault is one planned fault.
type Fault struct {
	Kind   FaultKind
	Target int           // datanode index (KillDN, StopDN); ignored otherwise
	Gap    time.Duration // wait before it, after the previous fault ended
	Down   time.Duration // how long the process stays dead or stopped
}

// Event is a fault as it happened.
type Event struct {
	Kind       FaultKind
	Target     string
	Start, End time.Duration // since the workload began
	Note       string
}

func (e Event) String() string {
	return fmt.Sprintf("%7.1fs–%7.1fs  %-9s %-6s %s", e.Start.Seconds(), e.End.Seconds(), e.Kind, e.Target, e.Note)
}

// PlanConfig says how many faults of each kind to plan.
type PlanConfig struct {
	KillDN, KillMeta, StopDN int
	FillDisk                 bool
	StopFor                  time.Duration
	ImpatientFor             time.Duration // 0: no impatient-client fault
	FirstAfter               time.Duration // gap before the first fault
}

// Plan builds the seeded fault schedule: the faults in a random order,
// random targets, random gaps (3–8 s) and down times (2–8 s).
func Plan(seed uint64, cfg PlanConfig) []Fault {
	rng := rand.New(rand.NewPCG(seed, 0xfa17))
	var fs []Fault
	for range cfg.KillDN {
		fs = append(fs, Fault{Kind: KillDN, Target: rng.IntN(numDN), Down: time.Duration(2000+rng.IntN(6000)) * time.Millisecond})
	}
	for range cfg.KillMeta {
		fs = append(fs, Fault{Kind: KillMeta, Down: time.Duration(2000+rng.IntN(6000)) * time.Millisecond})
	}
	for range cfg.StopDN {
		fs = append(fs, Fault{Kind: StopDN, Target: rng.IntN(numDN), Down: cfg.StopFor})
	}
	if cfg.FillDisk {
		fs = append(fs, Fault{Kind: FillDisk})
	}
	if cfg.ImpatientFor > 0 {
		fs = append(fs, Fault{Kind: ImpatientClient, Down: cfg.ImpatientFor})
	}
	rng.Shuffle(len(fs), func(i, j int) { fs[i], fs[j] = fs[j], fs[i] })
	for i := range fs {
		fs[i].Gap = time.Duration(3000+rng.IntN(5000)) * time.Millisecond
	}
	if len(fs) > 0 {
		fs[0].Gap = cfg.FirstAfter
	}
	return fs
}

// Duration estimates how long a plan takes to carry out (gaps, down
// times, a few seconds per restart).
func Duration(plan []Fault) time.Duration {
	var d time.Duration
	for _, f := range plan {
		d += f.Gap + f.Down
		if f.Kind == KillDN || f.Kind == KillMeta {
			d += 3 * time.Second
		}
	}
	return d
}

// Injector carries out a plan against a cluster, one fault at a time, and
// records what happened.
type Injector struct {
	C *Cluster
	// Disks are the datanodes' data volumes (nil: FillDisk is skipped).
	Disks []*SmallDisk
	Seed  uint64
	// Impatient turns the impatient client on and off.
	Impatient func(on bool)
	Since     func() time.Duration
	Logf      func(format string, args ...any)

	mu     sync.Mutex
	events []Event
	filled int // index+1 of the datanode whose disk is full, 0 if none
}

// Run carries out the faults in order; it returns when the last one has
// ended (processes restarted or resumed) or ctx is done.
func (in *Injector) Run(ctx context.Context, plan []Fault) {
	for _, f := range plan {
		select {
		case <-ctx.Done():
			return
		case <-time.After(f.Gap):
		}
		ev := in.do(ctx, f)
		in.Logf("fault: %s", ev)
		in.mu.Lock()
		in.events = append(in.events, ev)
		in.mu.Unlock()
	}
}

func (in *Injector) do(ctx context.Context, f Fault) (ev Event) {
	ev = Event{Kind: f.Kind, Start: in.Since()}
	defer func() { ev.End = in.Since() }()
	sleep := func(d time.Duration) {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	var notes []string
	note := func(format string, args ...any) { notes = append(notes, fmt.Sprintf(format, args...)) }
	defer func() { ev.Note = strings.Join(notes, "; ") }()
	switch f.Kind {
	case KillDN:
		p := in.C.DNs[f.Target]
		ev.Target = p.Name
		note("pid %d SIGKILL, down %v", p.Pid(), f.Down.Round(time.Millisecond))
		if err := p.Kill(); err != nil {
			note("kill: %v", err)
		}
		sleep(f.Down)
		if err := p.Start(); err != nil {
			note("restart: %v", err)
		} else {
			note("restarted as pid %d", p.Pid())
		}
		wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		if err := waitPort(wctx, in.C.DNData[f.Target]); err != nil {
			note("not serving: %v", err)
		}
		cancel()
	case KillMeta:
		i := in.C.Leader(ctx)
		if i < 0 {
			note("no leader found; killing meta1")
			i = 0
		}
		p := in.C.Metas[i]
		ev.Target = p.Name
		note("leader pid %d SIGKILL, down %v", p.Pid(), f.Down.Round(time.Millisecond))
		if err := p.Kill(); err != nil {
			note("kill: %v", err)
		}
		sleep(f.Down)
		if err := p.Start(); err != nil {
			note("restart: %v", err)
		} else {
			note("restarted as pid %d", p.Pid())
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		if j, err := in.C.WaitLeader(wctx); err != nil {
			note("%v", err)
		} else {
			note("leader now %s", in.C.Metas[j].Name)
		}
		cancel()
	case StopDN:
		p := in.C.DNs[f.Target]
		ev.Target = p.Name
		if err := p.Stop(); err != nil {
			note("SIGSTOP: %v", err)
			break
		}
		note("pid %d SIGSTOP for %v", p.Pid(), f.Down)
		sleep(f.Down)
		if err := p.Cont(); err != nil {
			note("SIGCONT: %v", err)
		}
	case ImpatientClient:
		ev.Target = "client"
		note("deadlines of 0.1–1.6 s on large V1 keys for %v", f.Down)
		if in.Impatient == nil {
			note("skipped: no impatient client")
			break
		}
		in.Impatient(true)
		sleep(f.Down)
		in.Impatient(false)
	case FillDisk:
		if in.Disks == nil {
			note("skipped: no loop-mounted volumes (not root?)")
			break
		}
		i, why := in.fillTarget(ctx)
		ev.Target = in.C.DNs[i].Name
		note("%s", why)
		n, err := in.Disks[i].Fill()
		avail, _ := in.Disks[i].Avail()
		note("ballast %d MiB, %d bytes left", n>>20, avail)
		if err != nil {
			note("fill: %v", err)
		}
		in.mu.Lock()
		in.filled = i + 1
		in.mu.Unlock()
	}
	return ev
}

// fillTarget picks the datanode whose disk to fill: one that follows in
// a THREE pipeline and leads none, since a follower that cannot store
// what it acknowledges is the case that matters (a leader that cannot
// store fails the client's request itself). Seeded among the candidates;
// the most-following datanode if there is none.
func (in *Injector) fillTarget(ctx context.Context) (int, string) {
	rng := rand.New(rand.NewPCG(in.Seed, 0xd15c))
	var cands []int
	best, bestFollow := rng.IntN(numDN), -1
	var roles []string
	for i := range numDN {
		lead, follow, err := in.C.Roles(ctx, i)
		if err != nil {
			roles = append(roles, fmt.Sprintf("%s: %v", in.C.DNs[i].Name, err))
			continue
		}
		roles = append(roles, fmt.Sprintf("%s leads %d follows %d", in.C.DNs[i].Name, lead, follow))
		if follow > 0 && lead == 0 {
			cands = append(cands, i)
		}
		if follow > bestFollow {
			best, bestFollow = i, follow
		}
	}
	if len(cands) > 0 {
		best = cands[rng.IntN(len(cands))]
	}
	return best, "THREE pipelines: " + strings.Join(roles, ", ")
}

// ReleaseDisk removes the ballast if the disk was filled and records it.
func (in *Injector) ReleaseDisk() {
	in.mu.Lock()
	filled := in.filled
	in.filled = 0
	in.mu.Unlock()
	if filled == 0 {
		return
	}
	ev := Event{Kind: FillDisk, Target: in.C.DNs[filled-1].Name, Start: in.Since(), Note: "ballast removed"}
	if err := in.Disks[filled-1].Release(); err != nil {
		ev.Note += ": " + err.Error()
	}
	ev.End = in.Since()
	in.mu.Lock()
	in.events = append(in.events, ev)
	in.mu.Unlock()
}

// Filled returns the index of the datanode whose disk is full (-1: none).
func (in *Injector) Filled() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.filled - 1
}

// Events returns the faults carried out so far.
func (in *Injector) Events() []Event {
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]Event(nil), in.events...)
}
