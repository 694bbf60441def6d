package datanode

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/slowdisk"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
	"github.com/prometheus/client_golang/prometheus"
)

// SlowDiskConfig tunes slow-disk detection (internal/slowdisk): the
// datanode times every flush under each Raft log directory and each data
// volume, marks the outliers among disks of the same kind, places new Raft
// groups and new containers elsewhere, and reports the slow ones (and the
// pipelines using them) to SCM in its heartbeat. Only with more than one
// log directory or volume.
type SlowDiskConfig struct {
	Disabled bool
	// Interval between evaluations (default 5s); disks without a flush
	// within it are probed (a 4 KiB write and its flush).
	Interval time.Duration
	// ProbeAtStart: flushes per disk probed before the Raft host starts,
	// so the first groups and containers already avoid a slow disk
	// (default 5; negative: none). The probe waits at most StartBound
	// (default 3s); a disk not done by then is judged by what it took.
	ProbeAtStart int
	StartBound   time.Duration
	Detector     slowdisk.Config
}

// diskWatch is the datanode's slow-disk detection.
type diskWatch struct {
	cfg        SlowDiskConfig
	fs         *vfs.TimedFS
	logs, vols *slowdisk.Detector
	kind       map[string]*slowdisk.Detector // root → its detector
	logDirs    []string
	volumes    []string
	slowGauge  *prometheus.GaugeVec
	medGauge   *prometheus.GaugeVec
	flushHist  *prometheus.HistogramVec
	collectors []prometheus.Collector
	probeMu    sync.Mutex // one probe round at a time
	// probing: per root, the start of its probe still running (a hung
	// disk's outlives its round); guarded by busyMu. A root is probed by
	// one goroutine at a time, so a hung disk holds one goroutine and one
	// descriptor, not one more per round.
	busyMu  sync.Mutex
	probing map[string]time.Time
}

// probeFile is the file a probe writes and flushes under root.
func probeFile(root string) string { return filepath.Join(root, ".basalt-disk-probe") }

// watchDisks wraps d.cfg.FS to time flushes and probes each disk once (in
// New, before storage and Raft place anything). Nothing with one log
// directory and one volume, or when disabled.
func (d *Datanode) watchDisks() {
	c := d.cfg.SlowDisk
	if c.Disabled || len(d.cfg.LogDirs) < 2 && len(d.cfg.Volumes) < 2 {
		return
	}
	if c.Interval <= 0 {
		c.Interval = 5 * time.Second
	}
	if c.ProbeAtStart == 0 {
		c.ProbeAtStart = 5
	}
	if c.StartBound <= 0 {
		c.StartBound = 3 * time.Second
	}
	w := &diskWatch{cfg: c, kind: map[string]*slowdisk.Detector{}}
	for _, p := range d.cfg.LogDirs {
		w.logDirs = append(w.logDirs, filepath.Clean(p))
	}
	for _, p := range d.cfg.Volumes {
		w.volumes = append(w.volumes, filepath.Clean(p))
	}
	w.logs = slowdisk.New(c.Detector, w.logDirs)
	w.vols = slowdisk.New(c.Detector, w.volumes)
	for _, p := range w.logDirs {
		w.kind[p] = w.logs
	}
	for _, p := range w.volumes {
		if _, dup := w.kind[p]; !dup {
			w.kind[p] = w.vols
		}
	}
	w.fs = vfs.NewTimedFS(d.cfg.FS, append(append([]string(nil), w.logDirs...), w.volumes...), func(root string, lat time.Duration) {
		if det := w.kind[root]; det != nil {
			det.Observe(root, lat, time.Now())
			k := "volume"
			if det == w.logs {
				k = "log"
			}
			w.flushHist.WithLabelValues(k).Observe(lat.Seconds())
		}
	})
	d.cfg.FS = w.fs
	w.slowGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "basalt_datanode_disk_slow",
		Help: "1 if the log directory or volume is marked slow (its median flush latency an outlier among its peers)."}, []string{"kind", "path"})
	w.medGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "basalt_datanode_disk_flush_median_seconds",
		Help: "Median flush latency of the log directory or volume over the detection window."}, []string{"kind", "path"})
	w.flushHist = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "basalt_datanode_disk_flush_seconds",
		Help:    "Flush (fsync) latency under the log directories and the volumes, queueing included.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}, []string{"kind"})
	if r := d.cfg.Registerer; r != nil {
		for _, col := range []prometheus.Collector{w.slowGauge, w.medGauge, w.flushHist} {
			if r.Register(col) == nil {
				w.collectors = append(w.collectors, col)
			}
		}
	}
	d.disks = w
	if c.ProbeAtStart > 0 {
		w.probe(c.ProbeAtStart, c.StartBound, time.Time{}, d.stopc)
		w.evaluate(d, true)
	}
}

// probe writes and flushes a small file n times on every disk whose last
// sample is older than idle (zero time: every disk), all disks in
// parallel. A disk not done within bound is observed with the time so far.
func (w *diskWatch) probe(n int, bound time.Duration, idle time.Time, stop <-chan struct{}) {
	w.probeMu.Lock()
	defer w.probeMu.Unlock()
	type job struct {
		root string
		det  *slowdisk.Detector
	}
	var jobs []job
	for _, p := range w.logDirs {
		if w.logs.LastSample(p).Before(idle) || idle.IsZero() {
			jobs = append(jobs, job{p, w.logs})
		}
	}
	for _, p := range w.volumes {
		if w.kind[p] == w.vols && (w.vols.LastSample(p).Before(idle) || idle.IsZero()) {
			jobs = append(jobs, job{p, w.vols})
		}
	}
	start := time.Now()
	// A root whose earlier probe still runs is not probed again: it is
	// observed with the time that probe has taken so far.
	w.busyMu.Lock()
	if w.probing == nil {
		w.probing = map[string]time.Time{}
	}
	free := jobs[:0]
	for _, j := range jobs {
		if since, busy := w.probing[j.root]; busy {
			for range n {
				j.det.Observe(j.root, start.Sub(since), start)
			}
			continue
		}
		w.probing[j.root] = start
		free = append(free, j)
	}
	jobs = free
	w.busyMu.Unlock()
	buf := make([]byte, 4096)
	done := make(chan struct{}, len(jobs))
	for _, j := range jobs {
		go func() {
			defer func() {
				w.busyMu.Lock()
				delete(w.probing, j.root)
				w.busyMu.Unlock()
				done <- struct{}{}
			}()
			if err := w.fs.MkdirAll(j.root, 0o755); err != nil {
				return
			}
			name := probeFile(j.root)
			f, err := w.fs.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
			if err != nil {
				return
			}
			defer f.Close()
			for range n {
				if _, err := f.WriteAt(buf, 0); err != nil {
					return
				}
				if f.SyncData() != nil { // observed through the timed FS
					return
				}
			}
		}()
	}
	timeout := time.After(bound)
	for left := len(jobs); left > 0; left-- {
		select {
		case <-done:
		case <-stop:
			return // closing: the probes finish on their own
		case <-timeout:
			// The stragglers count with what they took so far (and still
			// finish, observed, in the background).
			now := time.Now()
			for _, j := range jobs {
				if j.det.LastSample(j.root).Before(start) {
					for range n {
						j.det.Observe(j.root, now.Sub(start), now)
					}
				}
			}
			return
		}
	}
}

// evaluate judges both kinds, logs changes and updates the gauges.
func (w *diskWatch) evaluate(d *Datanode, seed bool) {
	now := time.Now()
	for _, k := range []struct {
		name string
		det  *slowdisk.Detector
	}{{"log", w.logs}, {"volume", w.vols}} {
		var changed []slowdisk.Status
		if seed {
			changed = k.det.Seed(now)
		} else {
			changed = k.det.Evaluate(now)
		}
		for _, st := range changed {
			if st.Slow {
				d.log.Warn("datanode: slow disk: new Raft groups and containers avoid it", "kind", k.name, "path", st.Disk,
					"median_flush", st.Median, "peers_median", st.Peers, "limit", st.Limit)
			} else {
				d.log.Info("datanode: disk no longer slow", "kind", k.name, "path", st.Disk, "median_flush", st.Median, "peers_median", st.Peers)
			}
		}
		for _, st := range k.det.Statuses() {
			v := 0.0
			if st.Slow {
				v = 1
			}
			w.slowGauge.WithLabelValues(k.name, st.Disk).Set(v)
			w.medGauge.WithLabelValues(k.name, st.Disk).Set(st.Median.Seconds())
		}
	}
}

// diskLoop evaluates every Interval and probes idle disks.
func (d *Datanode) diskLoop() {
	defer d.wg.Done()
	w := d.disks
	t := time.NewTicker(w.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-d.stopc:
			return
		case <-t.C:
		}
		w.probe(1, w.cfg.Interval, time.Now().Add(-w.cfg.Interval), d.stopc)
		w.evaluate(d, false)
	}
}

func (d *Datanode) avoidLogDir(dir string) bool {
	return d.disks != nil && d.disks.logs.Slow(filepath.Clean(dir))
}

func (d *Datanode) avoidVolume(path string) bool {
	return d.disks != nil && d.disks.vols.Slow(filepath.Clean(path))
}

// SlowDisks lists the disks marked slow now.
func (d *Datanode) SlowDisks() []*metapb.SlowDisk {
	w := d.disks
	if w == nil {
		return nil
	}
	var out []*metapb.SlowDisk
	for _, k := range []struct {
		name string
		det  *slowdisk.Detector
	}{{"log", w.logs}, {"volume", w.vols}} {
		for _, st := range k.det.Statuses() {
			if st.Slow {
				out = append(out, &metapb.SlowDisk{Path: st.Disk, Kind: k.name, MedianFlushUs: uint64(st.Median.Microseconds()),
					PeersMedianUs: uint64(st.Peers.Microseconds()), LimitUs: uint64(st.Limit.Microseconds()), SinceUnixMs: st.Since.UnixMilli()})
			}
		}
	}
	return out
}

// reportSlowDisks adds the slow disks to a heartbeat and names, per
// pipeline, a slow disk its log or one of its open containers is on.
func (d *Datanode) reportSlowDisks(req *metapb.HeartbeatRequest) {
	req.SlowDisks = d.SlowDisks()
	if len(req.SlowDisks) == 0 {
		return
	}
	for _, p := range req.Pipelines {
		p.SlowDisk = d.pipelineSlowDisk(p.PipelineId)
	}
}

func (d *Datanode) pipelineSlowDisk(pipeline uint64) string {
	if ld := d.PipelineLogDir(pipeline); ld != "" && d.avoidLogDir(ld) {
		return ld
	}
	d.mu.Lock()
	sm := d.sms[pipeline]
	d.mu.Unlock()
	if sm == nil {
		return ""
	}
	sm.mu.Lock()
	cids := sm.containerListLocked()
	sm.mu.Unlock()
	for _, cid := range cids {
		r, err := d.store.Container(storage.ContainerID(cid))
		if err == nil && r.State == storage.StateOpen && d.avoidVolume(r.Volume) {
			return r.Volume
		}
	}
	return ""
}

func (w *diskWatch) String() string {
	return fmt.Sprintf("slow-disk watch over %d log dirs, %d volumes", len(w.logDirs), len(w.volumes))
}

// removeProbeFiles removes the probe files (Close). A probe still running
// on a hung disk keeps its descriptor to the unlinked file.
func (w *diskWatch) removeProbeFiles() {
	for root := range w.kind {
		_ = w.fs.Remove(probeFile(root))
	}
}

func (d *Datanode) unwatchDisks() {
	if d.disks != nil {
		d.disks.removeProbeFiles()
	}
	if d.disks != nil && d.cfg.Registerer != nil {
		for _, c := range d.disks.collectors {
			d.cfg.Registerer.Unregister(c)
		}
	}
}

// ContainerVolume is the volume holding this datanode's replica of cid
// ("" if none).
func (d *Datanode) ContainerVolume(cid uint64) string {
	r, err := d.store.Container(storage.ContainerID(cid))
	if err != nil {
		return ""
	}
	return r.Volume
}
