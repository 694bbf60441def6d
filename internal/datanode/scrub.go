package datanode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// The scrubber verifies, in the background, every committed block of every
// container on every volume against its stored checksums, at a bounded
// byte rate (a token bucket), so silent corruption (bit rot, a lost or
// truncated file) is found before a read needs the replica, as Ozone's
// container data scanner and HDFS's block scanner do. One pass walks the
// containers in ID order and each container's blocks in local-ID order;
// its position is saved in DATA_DIR/scrub.json (atomically, about once a
// second and at shutdown), so a restart resumes the pass where it stopped.
// A new pass starts ScrubInterval after the previous one started.
//
// A damaged replica (checksum mismatch, short, missing or unreadable file)
// is marked UNHEALTHY durably by storage.VerifyBlock, logged, reported to
// SCM at once (ReportCorruptReplica, as a reader reports one) and in the
// next heartbeat's full container report; the replication manager copies
// the container from a healthy replica and drops this one. The rest of
// that container is skipped for the pass. A block that fails its checksum
// on a client read is re-verified at once (a "suspect"), outside the rate,
// so a read finding is confirmed and acted on like a scrub finding.

// Defaults of the scrubber and the volume health check.
const (
	DefaultScrubRate           = 32 << 20 // bytes per second
	DefaultScrubInterval       = 7 * 24 * time.Hour
	DefaultVolumeCheckInterval = time.Minute
	DefaultVolumeCheckTimeout  = 2 * time.Minute
)

const (
	scrubCursorFile = "scrub.json"
	// scrubSaveEvery: the cursor is saved at most this often during a pass.
	scrubSaveEvery = time.Second
	scrubListBatch = 256
	maxSuspects    = 256
)

var errScrubStopped = errors.New("datanode: scrubber stopped")

// ScrubCursor is scrub.json: where the scrubber is.
type ScrubCursor struct {
	// PassStartedMs is when the pass in progress started (0: none).
	PassStartedMs int64 `json:"pass_started_unix_ms,omitempty"`
	// Container, Block: the pass resumes at block Block of container
	// Container (blocks before it, and containers below it, are done).
	Container uint64 `json:"container"`
	Block     uint64 `json:"block"`
	// LastPassStartedMs, LastPassDoneMs: the last finished pass.
	LastPassStartedMs int64  `json:"last_pass_started_unix_ms,omitempty"`
	LastPassDoneMs    int64  `json:"last_pass_done_unix_ms,omitempty"`
	Passes            uint64 `json:"passes"`
}

// ScrubFinding is one damaged replica the scrubber found.
type ScrubFinding struct {
	Container storage.ContainerID
	Block     storage.LocalID
	Kind      string // "checksum", "missing" or "unreadable"
	Err       error
}

// ScrubStats are the scrubber's counters since the process started.
type ScrubStats struct {
	Bytes, Blocks uint64 // verified
	Passes        uint64 // finished in this process
	Checksum      uint64 // findings by kind
	Missing       uint64
	Unreadable    uint64
	// LastPassBytes is the bytes verified by the last pass finished in this
	// process (0 if none); a resumed pass counts only what it verified.
	LastPassBytes uint64
	Cursor        ScrubCursor
}

type scrubConfig struct {
	store    *storage.Store
	fs       vfs.FS
	path     string        // cursor file
	rate     int64         // bytes/s; 0 unlimited
	interval time.Duration // between pass starts; 0: DefaultScrubInterval
	// background: run passes when due; otherwise only when asked (Scrub).
	background bool
	log        *slog.Logger
	found      func(ScrubFinding)
}

type scrubber struct {
	cfg    scrubConfig
	bucket tokenBucket
	kick   chan chan struct{}
	susp   chan suspectBlock
	stopc  chan struct{}
	wg     sync.WaitGroup
	once   sync.Once

	mu        sync.Mutex
	cur       ScrubCursor
	lastSave  time.Time
	suspected map[suspectBlock]bool

	bytes, blocks, passes, lastPass atomic.Uint64
	checksum, missing, unreadable   atomic.Uint64
}

type suspectBlock struct {
	cid storage.ContainerID
	lid storage.LocalID
}

func newScrubber(cfg scrubConfig) (*scrubber, error) {
	if cfg.interval <= 0 {
		cfg.interval = DefaultScrubInterval
	}
	if cfg.found == nil {
		cfg.found = func(ScrubFinding) {}
	}
	s := &scrubber{cfg: cfg, kick: make(chan chan struct{}, 16), susp: make(chan suspectBlock, maxSuspects),
		stopc: make(chan struct{}), suspected: map[suspectBlock]bool{}}
	s.bucket.setRate(cfg.rate)
	b, err := vfs.ReadFile(cfg.fs, cfg.path)
	switch {
	case err == nil:
		if err := json.Unmarshal(b, &s.cur); err != nil {
			// A cursor is a hint: start a new pass rather than refuse to run.
			cfg.log.Warn("scrubber: unreadable cursor; starting a new pass", "file", cfg.path, "err", err)
			s.cur = ScrubCursor{}
		}
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("datanode: scrub cursor %s: %w", cfg.path, err)
	}
	return s, nil
}

func (s *scrubber) start() {
	s.wg.Add(2)
	go s.run()
	go s.suspectLoop()
}

// stop ends the pass in progress (its cursor saved) and waits.
func (s *scrubber) stop() {
	s.once.Do(func() { close(s.stopc) })
	s.wg.Wait()
}

func (s *scrubber) stopped() bool {
	select {
	case <-s.stopc:
		return true
	default:
		return false
	}
}

// scrub runs a whole pass that starts after the call (at the configured
// rate) and returns when it is done.
func (s *scrubber) scrub(ctx context.Context) error {
	w := make(chan struct{})
	select {
	case s.kick <- w:
	case <-ctx.Done():
		return ctx.Err()
	case <-s.stopc:
		return errScrubStopped
	}
	select {
	case <-w:
		if s.stopped() {
			return errScrubStopped
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// suspect queues a block a read found damaged for verification now.
func (s *scrubber) suspect(cid storage.ContainerID, lid storage.LocalID) {
	if r, err := s.cfg.store.Container(cid); err != nil || r.State == storage.StateUnhealthy {
		return // gone, or known bad and reported: reads of it need not cost a verification each
	}
	k := suspectBlock{cid, lid}
	s.mu.Lock()
	if s.suspected[k] || len(s.suspected) >= maxSuspects {
		s.mu.Unlock()
		return
	}
	s.suspected[k] = true
	s.mu.Unlock()
	s.susp <- k // cannot block: at most maxSuspects queued
}

func (s *scrubber) suspectLoop() {
	defer s.wg.Done()
	buf := storage.AlignedBuffer(4 << 20)
	for {
		select {
		case <-s.stopc:
			return
		case k := <-s.susp:
			_, err := s.cfg.store.VerifyBlock(k.cid, k.lid, storage.VerifyOptions{Buf: buf})
			s.handle(k.cid, k.lid, err)
			s.mu.Lock()
			delete(s.suspected, k)
			s.mu.Unlock()
		}
	}
}

func (s *scrubber) run() {
	defer s.wg.Done()
	defer s.save(true)
	for {
		var waiters []chan struct{}
		s.mu.Lock()
		resume := s.cur.PassStartedMs != 0
		due := time.UnixMilli(s.cur.LastPassStartedMs).Add(s.cfg.interval)
		s.mu.Unlock()
		if !resume || !s.cfg.background {
			var timer <-chan time.Time
			var t *time.Timer
			if s.cfg.background {
				t = time.NewTimer(max(0, time.Until(due)))
				timer = t.C
			}
			select {
			case <-s.stopc:
				return
			case w := <-s.kick:
				waiters = append(waiters, w)
			case <-timer:
			}
			if t != nil {
				t.Stop()
			}
		}
		for more := true; more; {
			select {
			case w := <-s.kick:
				waiters = append(waiters, w)
			default:
				more = false
			}
		}
		s.mu.Lock()
		if s.cur.PassStartedMs == 0 {
			s.cur.PassStartedMs = time.Now().UnixMilli()
			s.cur.Container, s.cur.Block = 0, 0
		}
		s.mu.Unlock()
		before := s.bytes.Load()
		err := s.pass()
		if err == nil {
			s.mu.Lock()
			s.cur.LastPassStartedMs, s.cur.LastPassDoneMs = s.cur.PassStartedMs, time.Now().UnixMilli()
			s.cur.PassStartedMs, s.cur.Container, s.cur.Block = 0, 0, 0
			s.cur.Passes++
			s.mu.Unlock()
			s.passes.Add(1)
			s.lastPass.Store(s.bytes.Load() - before)
			s.save(true)
		}
		for _, w := range waiters {
			close(w)
		}
		if err != nil {
			return // stopped
		}
	}
}

// pass verifies every block from the cursor on; nil when it got to the end.
func (s *scrubber) pass() error {
	s.mu.Lock()
	from := s.cur
	s.mu.Unlock()
	buf := storage.AlignedBuffer(4 << 20)
	opts := storage.VerifyOptions{Buf: buf, Before: func(n int64) error { return s.bucket.take(n, s.stopc) }}
	for _, c := range s.cfg.store.ListContainers() {
		if uint64(c.ID) < from.Container {
			continue
		}
		start := storage.LocalID(0)
		if uint64(c.ID) == from.Container {
			start = storage.LocalID(from.Block)
		}
		s.setCursor(uint64(c.ID), uint64(start))
		if c.State == storage.StateUnhealthy {
			continue // known bad (or on a failed volume): being replaced
		}
	blocks:
		for {
			bds, err := s.cfg.store.ListBlocks(c.ID, start, scrubListBatch)
			if err != nil {
				if !errors.Is(err, storage.ErrContainerNotFound) && !errors.Is(err, storage.ErrVolumeFailed) {
					s.cfg.log.Warn("scrubber: cannot list blocks; skipping the container", "container", c.ID, "err", err)
				}
				break
			}
			for _, bd := range bds {
				if s.stopped() {
					return errScrubStopped
				}
				n, err := s.cfg.store.VerifyBlock(c.ID, bd.LocalID, opts)
				s.bytes.Add(uint64(n))
				if errors.Is(err, errScrubStopped) {
					return err
				}
				if err == nil {
					s.blocks.Add(1)
				}
				s.setCursor(uint64(c.ID), uint64(bd.LocalID)+1)
				if !s.handle(c.ID, bd.LocalID, err) {
					break blocks
				}
			}
			if len(bds) < scrubListBatch {
				break
			}
			start = bds[len(bds)-1].LocalID + 1
		}
		s.setCursor(uint64(c.ID)+1, 0)
	}
	if s.stopped() {
		return errScrubStopped
	}
	return nil
}

// handle acts on one verification result; false: skip the rest of the
// container.
func (s *scrubber) handle(cid storage.ContainerID, lid storage.LocalID, err error) bool {
	switch {
	case err == nil:
		return true
	case errors.Is(err, storage.ErrCorruption):
		f := ScrubFinding{Container: cid, Block: lid, Err: err, Kind: "checksum"}
		switch {
		case errors.Is(err, storage.ErrBlockFileMissing):
			f.Kind = "missing"
			s.missing.Add(1)
		case errors.Is(err, storage.ErrBlockUnreadable):
			f.Kind = "unreadable"
			s.unreadable.Add(1)
		default:
			s.checksum.Add(1)
		}
		s.cfg.log.Warn("scrubber: damaged replica; container marked UNHEALTHY, reporting it to SCM",
			"container", cid, "block", lid, "kind", f.Kind, "err", err)
		s.cfg.found(f)
		return false
	case errors.Is(err, storage.ErrBlockNotFound):
		return true // deleted meanwhile
	case errors.Is(err, storage.ErrTemporary):
		s.cfg.log.Warn("scrubber: block not verified (resource shortage); verified next pass", "container", cid, "block", lid, "err", err)
		return true
	case errors.Is(err, storage.ErrContainerNotFound), errors.Is(err, storage.ErrVolumeFailed), errors.Is(err, storage.ErrClosed):
		return false
	default:
		s.cfg.log.Warn("scrubber: cannot verify block; skipping the container", "container", cid, "block", lid, "err", err)
		return false
	}
}

func (s *scrubber) setCursor(cid, lid uint64) {
	s.mu.Lock()
	s.cur.Container, s.cur.Block = cid, lid
	s.mu.Unlock()
	s.save(false)
}

// save writes the cursor (force, or if the last save is old enough).
func (s *scrubber) save(force bool) {
	s.mu.Lock()
	if !force && time.Since(s.lastSave) < scrubSaveEvery {
		s.mu.Unlock()
		return
	}
	s.lastSave = time.Now()
	b := mustJSON(s.cur)
	s.mu.Unlock()
	if err := vfs.WriteFileAtomic(s.cfg.fs, s.cfg.path, b); err != nil {
		s.cfg.log.Warn("scrubber: cannot save the cursor", "file", s.cfg.path, "err", err)
	}
}

func (s *scrubber) stats() ScrubStats {
	s.mu.Lock()
	cur := s.cur
	s.mu.Unlock()
	return ScrubStats{Bytes: s.bytes.Load(), Blocks: s.blocks.Load(), Passes: s.passes.Load(),
		Checksum: s.checksum.Load(), Missing: s.missing.Load(), Unreadable: s.unreadable.Load(),
		LastPassBytes: s.lastPass.Load(), Cursor: cur}
}

func (s *scrubber) collectors() []prometheus.Collector {
	counter := func(name, help string, labels prometheus.Labels, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode_scrub", Name: name, Help: help, ConstLabels: labels},
			func() float64 { return float64(f()) })
	}
	const fh = "Damaged replicas the scrubber (or the re-verification of a failed read) found, by kind; each container is marked UNHEALTHY and reported to SCM."
	return []prometheus.Collector{
		counter("bytes_total", "Bytes of committed blocks the scrubber read and verified.", nil, s.bytes.Load),
		counter("blocks_total", "Blocks the scrubber verified intact.", nil, s.blocks.Load),
		counter("passes_total", "Scrubber passes over every container finished.", nil, s.passes.Load),
		counter("corrupt_found_total", fh, prometheus.Labels{"kind": "checksum"}, s.checksum.Load),
		counter("corrupt_found_total", fh, prometheus.Labels{"kind": "missing"}, s.missing.Load),
		counter("corrupt_found_total", fh, prometheus.Labels{"kind": "unreadable"}, s.unreadable.Load),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode_scrub", Name: "rate_bytes_per_second", Help: "The scrubber's configured rate (0: unlimited)."},
			func() float64 { return float64(s.bucket.getRate()) }),
	}
}

// tokenBucket paces reads to rate bytes per second with a burst of at most
// a quarter second's worth (and at least one 4 MiB piece).
type tokenBucket struct {
	mu     sync.Mutex
	rate   float64
	burst  float64
	tokens float64
	last   time.Time
}

func (b *tokenBucket) setRate(rate int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rate = float64(max(rate, 0))
	b.burst = max(b.rate/4, 4<<20)
	b.tokens = 0
	b.last = time.Now()
}

func (b *tokenBucket) getRate() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return int64(b.rate)
}

// take takes n tokens, waiting (until stop) for the debt to be paid.
func (b *tokenBucket) take(n int64, stop <-chan struct{}) error {
	b.mu.Lock()
	if b.rate <= 0 {
		b.mu.Unlock()
		return nil
	}
	now := time.Now()
	b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
	b.last = now
	b.tokens -= float64(n)
	var wait time.Duration
	if b.tokens < 0 {
		wait = time.Duration(-b.tokens / b.rate * float64(time.Second))
	}
	b.mu.Unlock()
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-stop:
		return errScrubStopped
	case <-t.C:
		return nil
	}
}

// ---------------------------------------------------------------- datanode

// startScrubber starts the scrubber and the volume health check.
func (d *Datanode) startScrubber() error {
	rate := d.cfg.ScrubRate
	if rate == 0 {
		rate = DefaultScrubRate
	}
	sc, err := newScrubber(scrubConfig{
		store: d.store, fs: d.cfg.FS, path: filepath.Join(d.cfg.DataDir, scrubCursorFile),
		rate: max(rate, 0), interval: d.cfg.ScrubInterval, background: rate > 0,
		log: d.log, found: d.scrubFound,
	})
	if err != nil {
		return err
	}
	d.scrub = sc
	d.scrubMetrics = sc.collectors()
	d.scrubMetrics = append(d.scrubMetrics, d.volumeCollectors()...)
	if d.cfg.Registerer != nil {
		for _, c := range d.scrubMetrics {
			d.cfg.Registerer.Register(c) // a restarted datanode on the same registry: export once
		}
	}
	sc.start()
	if d.cfg.VolumeCheckInterval >= 0 {
		d.wg.Add(1)
		go d.volumeCheckLoop()
	}
	return nil
}

func (d *Datanode) stopScrubber() {
	if d.scrub == nil {
		return
	}
	d.scrub.stop()
	if d.cfg.Registerer != nil {
		for _, c := range d.scrubMetrics {
			d.cfg.Registerer.Unregister(c)
		}
	}
}

// scrubFound reports a damaged replica: the next heartbeat carries a full
// container report (the container is UNHEALTHY now), and SCM is told at
// once, as a client that read the replica would tell it.
func (d *Datanode) scrubFound(f ScrubFinding) {
	d.reportSoon.Store(true)
	d.closeFailedReplicas([]storage.ContainerID{f.Container})
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		go func() {
			select {
			case <-d.stopc:
				cancel()
			case <-ctx.Done():
			}
		}()
		reason := fmt.Sprintf("datanode %d scrubber: %s: %v", d.ident.ID, f.Kind, f.Err)
		if len(reason) > 1000 {
			reason = reason[:1000]
		}
		_, err := d.meta.Scm.ReportCorruptReplica(ctx, &metapb.ReportCorruptReplicaRequest{
			Block:      &metapb.BlockID{ContainerId: uint64(f.Container), LocalId: uint64(f.Block)},
			DatanodeId: d.ident.ID, Reason: reason,
		})
		if err != nil {
			// The UNHEALTHY state is durable and goes out with the next
			// full container report anyway.
			d.log.Warn("scrubber: reporting a damaged replica to SCM failed; the container report will carry it", "container", f.Container, "err", err)
		}
	}()
}

// closeFailedReplicas closes, through their pipelines, the containers
// whose replica failed here, for the pipelines this datanode leads. SCM
// closes a container whose replica is UNHEALTHY by sending CloseContainer
// to the replicas that report it OPEN, and only a pipeline's leader
// proposes the close; when the failed replica is the leader's, nobody
// else would, and the container would stay CLOSING (unrepairable) for
// ever. The other replicas close it after the same last write; this one
// stays UNHEALTHY.
func (d *Datanode) closeFailedReplicas(cids []storage.ContainerID) {
	type job struct{ cid, pipeline uint64 }
	var jobs []job
	d.mu.Lock()
	for _, cid := range cids {
		for pid, sm := range d.sms {
			if sm.hasContainer(uint64(cid)) {
				jobs = append(jobs, job{uint64(cid), pid})
			}
		}
	}
	d.mu.Unlock()
	if len(jobs) == 0 || d.host == nil {
		return
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		for _, j := range jobs {
			g, err := d.host.Group(j.pipeline)
			if err != nil || !g.IsLeader() {
				continue // a healthy leader gets SCM's CloseContainer
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, err = g.Propose(ctx, mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{
				CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: j.cid}}}), nil)
			cancel()
			switch {
			case err == nil, errors.Is(err, storage.ErrVolumeFailed), errors.Is(err, storage.ErrContainerNotOpen):
				// Committed; applying it here fails, as this replica is
				// failed, and the others close the container.
			default:
				d.log.Warn("cannot close a container whose replica failed here; SCM retries through the next leader", "container", j.cid, "pipeline", j.pipeline, "err", err)
			}
		}
	}()
}

// Scrub runs a whole scrubber pass that starts after the call, at the
// configured rate (unlimited if the background scrubber is disabled), and
// returns when it is done (tests, admin).
func (d *Datanode) Scrub(ctx context.Context) error {
	if d.scrub == nil {
		return errors.New("datanode: not started")
	}
	return d.scrub.scrub(ctx)
}

// ScrubStats reports the scrubber's counters.
func (d *Datanode) ScrubStats() ScrubStats {
	if d.scrub == nil {
		return ScrubStats{}
	}
	return d.scrub.stats()
}

func (d *Datanode) volumeCheckLoop() {
	defer d.wg.Done()
	every := d.cfg.VolumeCheckInterval
	if every == 0 {
		every = DefaultVolumeCheckInterval
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-d.stopc:
			return
		case <-t.C:
			d.CheckVolumes()
		}
	}
}

// CheckVolumes runs the volume health check now (it also runs every
// VolumeCheckInterval): a volume whose probe file cannot be created,
// written, synced, read back and removed within VolumeCheckTimeout is
// failed, and its containers go to SCM as UNHEALTHY in the next heartbeat.
func (d *Datanode) CheckVolumes() []storage.VolumeCheck {
	timeout := d.cfg.VolumeCheckTimeout
	if timeout <= 0 {
		timeout = DefaultVolumeCheckTimeout
	}
	res := d.store.CheckVolumes(timeout)
	for _, r := range res {
		switch {
		case r.NewlyFailed:
			d.volChecksFailed.Add(1)
			d.log.Error("volume FAILED its health check; its containers are reported UNHEALTHY for re-replication", "volume", r.Path, "err", r.Err)
			d.reportSoon.Store(true)
			var cids []storage.ContainerID
			for _, c := range d.store.ListContainers() {
				if c.Volume == r.Path {
					cids = append(cids, c.ID)
				}
			}
			d.closeFailedReplicas(cids)
		case !r.Failed && r.Took > 0:
			d.volChecksOK.Add(1)
		}
	}
	return res
}

func (d *Datanode) volumeCollectors() []prometheus.Collector {
	c := func(result string, v *atomic.Uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "volume_checks_total",
			Help: "Volume health checks (probe file) by result; a failed one fails its volume.", ConstLabels: prometheus.Labels{"result": result}},
			func() float64 { return float64(v.Load()) })
	}
	return []prometheus.Collector{
		c("ok", &d.volChecksOK), c("failed", &d.volChecksFailed),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode", Name: "volumes_failed", Help: "Data volumes failed (health check, Pebble or write errors)."},
			func() float64 {
				n := 0
				for _, v := range d.store.Volumes() {
					if v.Failed {
						n++
					}
				}
				return float64(n)
			}),
	}
}
