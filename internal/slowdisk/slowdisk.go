// Package slowdisk finds a datanode's slow disks: the log directories or
// data volumes whose recent flush latency is an outlier among the
// datanode's disks of the same kind (HDFS's slow-disk detection).
//
// Each disk keeps its recent flush latencies (a bounded ring, only those
// within Window count). Evaluate takes the median of each disk with at
// least MinSamples, the median M of those medians and their median
// absolute deviation D, and sets the limit
//
//	max(LowThreshold, MedianFactor·M, M + MADFactor·1.4826·D).
//
// A disk whose median is above the limit for MarkAfter evaluations in a
// row is marked slow; a slow disk is cleared only after its median stays
// below ClearFactor·limit for ClearAfter evaluations in a row (the
// hysteresis band between the two keeps a disk near the limit from
// flapping). A disk without enough recent samples keeps its state.
package slowdisk

import (
	"slices"
	"sync"
	"time"
)

// Config tunes a Detector. Zero values take the defaults noted.
type Config struct {
	Window       time.Duration // samples older than this do not count (default 30s)
	MaxSamples   int           // per disk, the most recent kept (default 128)
	MinSamples   int           // a disk with fewer recent samples is not judged (default 5)
	MinDisks     int           // disks with enough samples needed to judge any (default 3)
	LowThreshold time.Duration // a median below this is never slow (default 20ms)
	MedianFactor float64       // default 3
	MADFactor    float64       // default 3
	MarkAfter    int           // evaluations above the limit before marking (default 2)
	ClearAfter   int           // evaluations below ClearFactor·limit before clearing (default 3)
	ClearFactor  float64       // default 0.5
}

func (c *Config) setDefaults() {
	if c.Window <= 0 {
		c.Window = 30 * time.Second
	}
	if c.MaxSamples <= 0 {
		c.MaxSamples = 128
	}
	if c.MinSamples <= 0 {
		c.MinSamples = 5
	}
	if c.MinDisks <= 0 {
		c.MinDisks = 3
	}
	if c.LowThreshold <= 0 {
		c.LowThreshold = 20 * time.Millisecond
	}
	if c.MedianFactor <= 0 {
		c.MedianFactor = 3
	}
	if c.MADFactor <= 0 {
		c.MADFactor = 3
	}
	if c.MarkAfter <= 0 {
		c.MarkAfter = 2
	}
	if c.ClearAfter <= 0 {
		c.ClearAfter = 3
	}
	if c.ClearFactor <= 0 || c.ClearFactor > 1 {
		c.ClearFactor = 0.5
	}
}

// Status is one disk's state after the last evaluation.
type Status struct {
	Disk    string
	Samples int           // recent samples at the last evaluation
	Median  time.Duration // of those at the last evaluation with enough (0: none yet)
	Peers   time.Duration // the median of all judged disks' medians
	Limit   time.Duration // above it a disk counts as slow (0: not judged)
	Slow    bool
	Since   time.Time // when it was last marked or cleared
}

type sample struct {
	at  time.Time
	lat time.Duration
}

type disk struct {
	ring         []sample
	next         int
	st           Status
	above, below int
	last         time.Time // newest sample
}

// Detector judges a fixed set of disks. Safe for concurrent use.
type Detector struct {
	cfg   Config
	mu    sync.Mutex
	disks map[string]*disk
	order []string
}

// New returns a detector over disks (their names are the caller's: paths).
func New(cfg Config, disks []string) *Detector {
	cfg.setDefaults()
	d := &Detector{cfg: cfg, disks: make(map[string]*disk, len(disks))}
	for _, n := range disks {
		if _, ok := d.disks[n]; ok {
			continue
		}
		d.disks[n] = &disk{st: Status{Disk: n}}
		d.order = append(d.order, n)
	}
	return d
}

// Observe records one flush of disk (unknown disks are ignored).
func (d *Detector) Observe(name string, lat time.Duration, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	k := d.disks[name]
	if k == nil {
		return
	}
	s := sample{at: now, lat: lat}
	if len(k.ring) < d.cfg.MaxSamples {
		k.ring = append(k.ring, s)
	} else {
		k.ring[k.next] = s
		k.next = (k.next + 1) % len(k.ring)
	}
	if now.After(k.last) {
		k.last = now
	}
}

// LastSample is when disk's newest sample was taken (zero if none).
func (d *Detector) LastSample(name string) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	if k := d.disks[name]; k != nil {
		return k.last
	}
	return time.Time{}
}

// Slow reports whether disk is marked slow.
func (d *Detector) Slow(name string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	k := d.disks[name]
	return k != nil && k.st.Slow
}

// Statuses is every disk's state after the last evaluation, in the order
// given to New.
func (d *Detector) Statuses() []Status {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]Status, 0, len(d.order))
	for _, n := range d.order {
		out = append(out, d.disks[n].st)
	}
	return out
}

// Evaluate judges every disk from its samples within the window, applying
// the hysteresis, and returns the disks whose mark changed.
func (d *Detector) Evaluate(now time.Time) []Status { return d.evaluate(now, false) }

// Seed judges every disk without hysteresis: a disk above the limit is
// marked at once (for the probe at start, before anything is placed).
func (d *Detector) Seed(now time.Time) []Status { return d.evaluate(now, true) }

func (d *Detector) evaluate(now time.Time, immediate bool) []Status {
	d.mu.Lock()
	defer d.mu.Unlock()
	from := now.Add(-d.cfg.Window)
	medians := make(map[string]time.Duration, len(d.disks))
	var all []time.Duration
	var lats []time.Duration
	for _, n := range d.order {
		k := d.disks[n]
		lats = lats[:0]
		for _, s := range k.ring {
			if !s.at.Before(from) {
				lats = append(lats, s.lat)
			}
		}
		k.st.Samples = len(lats)
		if len(lats) >= d.cfg.MinSamples {
			m := median(lats)
			medians[n] = m
			k.st.Median = m
			all = append(all, m)
		}
	}
	var changed []Status
	if len(all) < d.cfg.MinDisks {
		return nil // too few to compare: every state and figure holds
	}
	peers := median(append([]time.Duration(nil), all...))
	dev := make([]time.Duration, len(all))
	for i, m := range all {
		dev[i] = m - peers
		if dev[i] < 0 {
			dev[i] = -dev[i]
		}
	}
	mad := median(dev)
	limit := max(d.cfg.LowThreshold, time.Duration(d.cfg.MedianFactor*float64(peers)),
		peers+time.Duration(d.cfg.MADFactor*1.4826*float64(mad)))
	clear := time.Duration(d.cfg.ClearFactor * float64(limit))
	for _, n := range d.order {
		k := d.disks[n]
		k.st.Peers, k.st.Limit = peers, limit
		m, ok := medians[n]
		if !ok {
			continue // too few samples: keep the state
		}
		switch {
		case m > limit:
			k.above++
			k.below = 0
			if !k.st.Slow && (immediate || k.above >= d.cfg.MarkAfter) {
				k.st.Slow, k.st.Since = true, now
				changed = append(changed, k.st)
			}
		case m < clear:
			k.below++
			k.above = 0
			if k.st.Slow && k.below >= d.cfg.ClearAfter {
				k.st.Slow, k.st.Since = false, now
				changed = append(changed, k.st)
			}
		default: // the hysteresis band: the mark holds
			k.above, k.below = 0, 0
		}
	}
	return changed
}

func median(v []time.Duration) time.Duration {
	slices.Sort(v)
	n := len(v)
	if n == 0 {
		return 0
	}
	if n%2 == 1 {
		return v[n/2]
	}
	return (v[n/2-1] + v[n/2]) / 2
}
