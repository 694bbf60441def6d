package vfs

import (
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	sa "sync/atomic"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
)

// LatencyFS wraps an FS and makes the directories under some roots behave
// like slow disks, for benchmarks (seed 001: Raft logs on HDDs, one of them
// much slower). Each root is one Disk with a Profile. A disk flushes its
// write cache one flush at a time, like a spindle: each flush takes the
// profile's sync latency plus jitter, plus the bytes written to the disk
// since the previous flush at the profile's write bandwidth, plus the rest
// of a stall if one is under way. A sync of a file (or directory) under the
// root waits for a flush that starts after it was issued; syncs issued
// while a flush runs share the next one, as the kernel's block layer merges
// the flushes queued behind a running one (with DiskProfile.NoFlushMerge
// every sync is a flush of its own). Disks flush in parallel. Reads,
// writes and syncs outside every root pass through untouched.
//
// With NoRealSync the model replaces the underlying sync (the data stays in
// the page cache: the wrapped disk's own fsync time would otherwise be
// added to the model's); never use it where durability matters.
type LatencyFS struct {
	FS FS
	// NoRealSync: the modelled delay only, no sync of the wrapped FS.
	NoRealSync bool

	disks []*Disk // longest root first
}

// DiskProfile is the behaviour of one modelled disk. Zero values: no delay.
type DiskProfile struct {
	// SyncLatency is the fixed cost of one sync (an HDD: seek, rotation
	// and the cache flush, a few ms); SyncJitter adds a uniform [0, jitter).
	SyncLatency time.Duration
	SyncJitter  time.Duration
	// WriteBytesPerSec is the disk's write bandwidth: a sync also pays for
	// the bytes written under the root since the previous sync (0: free).
	WriteBytesPerSec int64
	// Periodic stalls: for StallFor out of every StallEvery (measured from
	// NewLatencyFS), syncs of this disk wait for the stall to end (a disk
	// retrying a sector, a RAID controller flushing its cache).
	StallEvery, StallFor time.Duration
	// NoFlushMerge: every sync is a flush of its own, in turn (no merging
	// of the syncs queued behind a running flush).
	NoFlushMerge bool
	// Capacity, if nonzero, is the disk's size as GetDiskUsage reports it
	// for paths under the root: Capacity minus the bytes written through
	// this FS, so that stores choosing the emptiest volume spread over
	// the disks as they would over real ones.
	Capacity int64
}

// Disk is one modelled disk of a LatencyFS.
type Disk struct {
	Root    string
	Profile DiskProfile

	start time.Time
	// The flush state: started and done count flushes; a sync issued when
	// started == k needs flush k+1 (the next to start) to be done.
	mu       sync.Mutex
	cond     *sync.Cond
	flushing bool
	started  uint64
	done     uint64
	rngMu    sync.Mutex
	rng      *rand.Rand
	dirty    sa.Int64 // bytes written since the last sync
	written  sa.Int64 // bytes written in all

	syncs     sa.Int64
	flushes   sa.Int64
	waitNs    sa.Int64 // time syncs waited for a flush to start
	busyNs    sa.Int64 // time the disk was flushing
	maxNs     sa.Int64 // longest sync, queueing included
	lastFlush sa.Int64 // the latest flush's duration
	stalled   sa.Int64 // syncs that hit a stall
	slowdown  sa.Int64 // SetSlowdown's factor (0, 1: none)
}

// SetSlowdown multiplies the disk's flush time by factor from now on (a
// disk that degrades while in use; factor ≤ 1: back to its profile).
func (d *Disk) SetSlowdown(factor int) { d.slowdown.Store(int64(factor)) }

// DiskStats is what a Disk did.
type DiskStats struct {
	Root string
	// Syncs issued and Flushes done (fewer when syncs merged); Wait is the
	// syncs' total time queued before their flush started, Busy the total
	// time the disk was flushing, Max the longest sync including its wait;
	// Stalled counts flushes that met a stall.
	Syncs   int64
	Flushes int64
	Wait    time.Duration
	Busy    time.Duration
	Max     time.Duration
	Stalled int64
	Written int64
}

// NewLatencyFS wraps fs with one disk per root (roots are cleaned; a path
// belongs to the longest root it is under). seed seeds the jitter.
func NewLatencyFS(fs FS, disks map[string]DiskProfile, seed uint64) *LatencyFS {
	l := &LatencyFS{FS: fs}
	now := time.Now()
	roots := make([]string, 0, len(disks))
	for r := range disks {
		roots = append(roots, r)
	}
	sort.Strings(roots)
	for i, r := range roots {
		d := &Disk{Root: filepath.Clean(r), Profile: disks[r], start: now, rng: rand.New(rand.NewPCG(seed, uint64(i)))}
		d.cond = sync.NewCond(&d.mu)
		l.disks = append(l.disks, d)
	}
	sort.SliceStable(l.disks, func(i, j int) bool { return len(l.disks[i].Root) > len(l.disks[j].Root) })
	return l
}

// Disks returns the modelled disks, sorted by root.
func (l *LatencyFS) Disks() []*Disk {
	out := append([]*Disk(nil), l.disks...)
	sort.Slice(out, func(i, j int) bool { return out[i].Root < out[j].Root })
	return out
}

// DiskOf returns the disk path is on (nil: none).
func (l *LatencyFS) DiskOf(path string) *Disk {
	p := filepath.Clean(path)
	for _, d := range l.disks {
		if p == d.Root || strings.HasPrefix(p, d.Root+string(filepath.Separator)) {
			return d
		}
	}
	return nil
}

// Stats returns what the disk did so far.
func (d *Disk) Stats() DiskStats {
	return DiskStats{Root: d.Root, Syncs: d.syncs.Load(), Flushes: d.flushes.Load(), Wait: time.Duration(d.waitNs.Load()),
		Busy: time.Duration(d.busyNs.Load()), Max: time.Duration(d.maxNs.Load()),
		Stalled: d.stalled.Load(), Written: d.written.Load()}
}

// serviceTime is how long the flush starting at now takes.
func (d *Disk) serviceTime(now time.Time) (time.Duration, bool) {
	p := d.Profile
	t := p.SyncLatency
	if p.SyncJitter > 0 {
		d.rngMu.Lock()
		t += time.Duration(d.rng.Int64N(int64(p.SyncJitter)))
		d.rngMu.Unlock()
	}
	if p.WriteBytesPerSec > 0 {
		n := d.dirty.Swap(0)
		t += time.Duration(float64(n) / float64(p.WriteBytesPerSec) * float64(time.Second))
	} else {
		d.dirty.Store(0)
	}
	if f := d.slowdown.Load(); f > 1 {
		t *= time.Duration(f)
	}
	stalled := false
	if p.StallEvery > 0 && p.StallFor > 0 {
		if in := now.Sub(d.start) % p.StallEvery; in < p.StallFor {
			t += p.StallFor - in
			stalled = true
		}
	}
	return t, stalled
}

// sync runs real (the wrapped sync, unless NoRealSync) and waits for a
// flush of the disk that starts after the call.
func (l *LatencyFS) sync(d *Disk, real func() error) error {
	if d == nil {
		return real()
	}
	var err error
	if !l.NoRealSync {
		err = real()
	}
	t0 := time.Now()
	var waited time.Duration
	d.mu.Lock()
	need := d.started + 1
	if d.Profile.NoFlushMerge {
		// Every sync its own flush: take the next number in turn.
		d.started++
		need = d.started
		for d.done < need-1 || d.flushing {
			d.cond.Wait()
		}
		waited = time.Since(t0)
		d.flushing = true
		d.mu.Unlock()
		d.flush()
		d.mu.Lock()
		d.flushing = false
		d.done = need
		d.cond.Broadcast()
	} else {
		for d.done < need {
			if d.flushing {
				d.cond.Wait()
				continue
			}
			// Start the next flush; it covers every sync waiting now.
			waited = time.Since(t0)
			d.flushing = true
			d.started++
			n := d.started
			d.mu.Unlock()
			d.flush()
			d.mu.Lock()
			d.flushing = false
			d.done = n
			d.cond.Broadcast()
		}
	}
	d.mu.Unlock()
	total := time.Since(t0)
	if waited == 0 {
		// Merged into a flush another sync started: it waited until that
		// flush began.
		waited = max(0, total-time.Duration(d.lastFlush.Load()))
	}
	d.syncs.Add(1)
	d.waitNs.Add(int64(waited))
	for {
		m := d.maxNs.Load()
		if int64(total) <= m || d.maxNs.CompareAndSwap(m, int64(total)) {
			break
		}
	}
	return err
}

// flush sleeps for one flush's service time.
func (d *Disk) flush() {
	t1 := time.Now()
	st, stalled := d.serviceTime(t1)
	time.Sleep(st)
	d.flushes.Add(1)
	if stalled {
		d.stalled.Add(1)
	}
	el := time.Since(t1)
	d.lastFlush.Store(int64(el))
	d.busyNs.Add(int64(el))
}

func (l *LatencyFS) wrap(f pvfs.File, name string) File {
	d := l.DiskOf(name)
	if d == nil {
		if ff, ok := f.(File); ok {
			return ff
		}
		return noTruncate{f}
	}
	ff, ok := f.(File)
	if !ok {
		ff = noTruncate{f}
	}
	return &latencyFile{File: ff, fs: l, d: d}
}

func (l *LatencyFS) Create(name string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	f, err := l.FS.Create(name, c)
	if err != nil {
		return nil, err
	}
	return l.wrap(f, name), nil
}

func (l *LatencyFS) Open(name string, opts ...pvfs.OpenOption) (pvfs.File, error) {
	f, err := l.FS.Open(name, opts...)
	if err != nil {
		return nil, err
	}
	return l.wrap(f, name), nil
}

func (l *LatencyFS) OpenReadWrite(name string, c pvfs.DiskWriteCategory, opts ...pvfs.OpenOption) (pvfs.File, error) {
	f, err := l.FS.OpenReadWrite(name, c, opts...)
	if err != nil {
		return nil, err
	}
	return l.wrap(f, name), nil
}

func (l *LatencyFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := l.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return l.wrap(f, name), nil
}

func (l *LatencyFS) OpenDir(name string) (pvfs.File, error) {
	f, err := l.FS.OpenDir(name)
	if err != nil {
		return nil, err
	}
	return l.wrap(f, name), nil
}

func (l *LatencyFS) ReuseForWrite(o, n string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	f, err := l.FS.ReuseForWrite(o, n, c)
	if err != nil {
		return nil, err
	}
	return l.wrap(f, n), nil
}

func (l *LatencyFS) Link(o, n string) error                      { return l.FS.Link(o, n) }
func (l *LatencyFS) Remove(name string) error                    { return l.FS.Remove(name) }
func (l *LatencyFS) RemoveAll(name string) error                 { return l.FS.RemoveAll(name) }
func (l *LatencyFS) Rename(o, n string) error                    { return l.FS.Rename(o, n) }
func (l *LatencyFS) MkdirAll(dir string, perm os.FileMode) error { return l.FS.MkdirAll(dir, perm) }
func (l *LatencyFS) Lock(name string) (io.Closer, error)         { return l.FS.Lock(name) }
func (l *LatencyFS) List(dir string) ([]string, error)           { return l.FS.List(dir) }
func (l *LatencyFS) Stat(name string) (pvfs.FileInfo, error)     { return l.FS.Stat(name) }
func (l *LatencyFS) PathBase(p string) string                    { return l.FS.PathBase(p) }
func (l *LatencyFS) PathJoin(elem ...string) string              { return l.FS.PathJoin(elem...) }
func (l *LatencyFS) PathDir(p string) string                     { return l.FS.PathDir(p) }
func (l *LatencyFS) Unwrap() pvfs.FS                             { return l.FS }

// GetDiskUsage reports a disk's modelled capacity for paths on a disk with
// one (see DiskProfile.Capacity), the wrapped FS's figures otherwise.
func (l *LatencyFS) GetDiskUsage(p string) (DiskUsage, error) {
	d := l.DiskOf(p)
	if d == nil || d.Profile.Capacity == 0 {
		return l.FS.GetDiskUsage(p)
	}
	used := min(uint64(d.written.Load()), uint64(d.Profile.Capacity))
	free := uint64(d.Profile.Capacity) - used
	return DiskUsage{AvailBytes: free, TotalBytes: uint64(d.Profile.Capacity), UsedBytes: used}, nil
}

type latencyFile struct {
	File
	fs *LatencyFS
	d  *Disk
}

func (f *latencyFile) wrote(n int) {
	if n > 0 {
		f.d.dirty.Add(int64(n))
		f.d.written.Add(int64(n))
	}
}

func (f *latencyFile) Write(p []byte) (int, error) {
	n, err := f.File.Write(p)
	f.wrote(n)
	return n, err
}

func (f *latencyFile) WriteAt(p []byte, off int64) (int, error) {
	n, err := f.File.WriteAt(p, off)
	f.wrote(n)
	return n, err
}

func (f *latencyFile) Sync() error { return f.fs.sync(f.d, f.File.Sync) }

func (f *latencyFile) SyncData() error { return f.fs.sync(f.d, f.File.SyncData) }

func (f *latencyFile) SyncTo(length int64) (bool, error) {
	full := true
	err := f.fs.sync(f.d, func() error {
		var err error
		full, err = f.File.SyncTo(length)
		return err
	})
	return full, err
}
