package zoned

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// Config configures a zoned volume.
type Config struct {
	// Mount is the zonefs mount point (or an EmuFS root).
	Mount string
	// FS is the file system of Mount: vfs.Default for a real zonefs, an
	// *EmuFS in tests. Default vfs.Default.
	FS vfs.FS
	// MetaDir holds the volume's Pebble DB (extent map, zone tails), on a
	// regular file system; MetaFS is its file system (default vfs.Default).
	MetaDir string
	MetaFS  vfs.FS
	// Geometry overrides what ReadGeometry finds (nil: read it).
	Geometry *Geometry
	// Streams is the number of zones written at once (streams beyond it
	// share zones); default the device's open/active limit less one for
	// the cleaner, or 8 without limits.
	Streams int
	// StageBytes is the size of each of a written zone's two staging
	// buffers; default 4 MiB (the default chunk: a whole chunk is copied
	// while the previous one is written).
	StageBytes int
	// ReserveZones are empty zones only the cleaner may take, so it can
	// always move live data; default 2 (1 below 16 zones).
	ReserveZones int
	// CleanerRate bounds the bytes per second the cleaner moves; default
	// 64 MiB/s; negative: unlimited.
	CleanerRate int64
	// CleanLive: a full zone is worth cleaning when at most this share of
	// it is live; default 0.75.
	CleanLive float64
	// LowZones: the cleaner works while fewer zones than this are empty;
	// default ReserveZones + max(2, zones/16).
	LowZones int
	// SpaceWait is how long a writer that finds no zone waits for the
	// cleaner when there is reclaimable space; default 10 s.
	SpaceWait time.Duration
	Logf      func(format string, args ...any)
}

// Backend is the zoned storage backend (storage.BlockFiles) of one volume:
// block data appended into the zones of a zonefs mount, extents in a
// Pebble DB. See docs/ZONED.md.
type Backend struct {
	cfg Config
	g   Geometry
	fs  vfs.FS
	db  *pebble.DB
	gdb storage.GuardedDB // every call into db (fatal.go)
	log *storage.FatalLogger
	// fatal: the DB met a fatal error (or the cleaner panicked) and is
	// not called again (fatal.go).
	fatal atomic.Pointer[storage.FatalError]
	// wedged is closed when fatal is set: a write inside the DB returns
	// (storage.GuardedDB).
	wedged chan struct{}
	direct bool // zone reads use O_DIRECT
	seed   maphash.Seed

	mu       sync.Mutex
	cond     sync.Cond // on mu: a zone became free
	zones    []*zone
	active   int // zones in state zActive (cleaner's included)
	cleanZ   *zone
	pending  []int // zones whose live count reached 0: reset after a WAL sync
	open     map[bkey]*blockState
	stripes  [512]sync.Mutex
	closed   bool
	kick     chan struct{}
	stop     chan struct{}
	done     chan struct{}
	cleanErr error

	userBytes  atomic.Int64 // bytes appended by writers
	movedBytes atomic.Int64 // bytes rewritten by the cleaner
	resets     atomic.Int64
	cleaned    atomic.Int64 // zones emptied by the cleaner
}

// blockState is a block with open writers (or being changed): its current
// extents, including those not yet synced.
type blockState struct {
	key     bkey
	rec     record
	writers int
	dirty   bool
	touched map[*zone]int64 // zone → end of this block's bytes in it since the last sync
}

// New opens (formatting its metadata if new) the zoned volume on
// cfg.Mount and recovers it from the zones' write pointers.
func New(cfg Config) (*Backend, error) {
	if cfg.FS == nil {
		cfg.FS = vfs.Default
	}
	if cfg.MetaFS == nil {
		cfg.MetaFS = vfs.Default
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	var g Geometry
	if cfg.Geometry != nil {
		g = *cfg.Geometry
		if err := g.validate(); err != nil {
			return nil, errorf("geometry: %w", err)
		}
	} else {
		var err error
		if g, err = ReadGeometry(cfg.FS, cfg.Mount); err != nil {
			return nil, err
		}
	}
	if cfg.ReserveZones <= 0 {
		cfg.ReserveZones = 2
		if g.Zones < 16 {
			cfg.ReserveZones = 1
		}
	}
	if g.Zones < cfg.ReserveZones+2 {
		return nil, errorf("%d zones is too few (need %d)", g.Zones, cfg.ReserveZones+2)
	}
	if cfg.Streams <= 0 {
		cfg.Streams = max(1, g.zoneLimit(9)-1)
	}
	cfg.Streams = min(cfg.Streams, max(1, g.zoneLimit(1<<20)-1))
	if cfg.StageBytes <= 0 {
		cfg.StageBytes = 4 << 20
	}
	cfg.StageBytes = max(g.align(), cfg.StageBytes&^(g.align()-1))
	if cfg.CleanerRate == 0 {
		cfg.CleanerRate = 64 << 20
	}
	if cfg.CleanLive <= 0 {
		cfg.CleanLive = 0.75
	}
	if cfg.LowZones <= 0 {
		cfg.LowZones = cfg.ReserveZones + max(2, g.Zones/16)
	}
	if cfg.SpaceWait <= 0 {
		cfg.SpaceWait = 10 * time.Second
	}
	if err := vfs.MkdirAllSync(cfg.MetaFS, cfg.MetaDir); err != nil {
		return nil, err
	}
	b := &Backend{cfg: cfg, g: g, fs: cfg.FS, seed: maphash.MakeSeed(), open: map[bkey]*blockState{},
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}), wedged: make(chan struct{})}
	b.cond.L = &b.mu
	b.log = &storage.FatalLogger{Prefix: "zoned pebble: ", Logf: cfg.Logf, OnFatal: b.wedge}
	// Its WAL and MANIFEST errors wedge the backend before Pebble sees
	// them (storage/metafs.go).
	db, err := openDB(b.log, cfg.MetaDir, &pebble.Options{FS: b.log.WrapFS(cfg.MetaFS), Logger: b.log})
	if err != nil {
		return nil, err
	}
	b.db = db
	b.gdb = storage.GuardedDB{DB: db, Log: b.log, Usable: b.usable, Wedged: b.wedged,
		Wedge: func(err error) {
			fe, ok := err.(*storage.FatalError)
			if !ok {
				fe = &storage.FatalError{Msg: err.Error()}
			}
			b.wedge(fe)
		}}
	b.log.SetDB(db)
	if err := b.recoverGuarded(); err != nil {
		b.closeFiles()
		if b.Fatal() == nil {
			db.Close()
		}
		return nil, err
	}
	go b.cleaner()
	return b, nil
}

// openDB is pebble.Open with a Fatalf during Open (WAL replay) returned
// as an error.
func openDB(l *storage.FatalLogger, dir string, o *pebble.Options) (db *pebble.DB, err error) {
	defer l.Catch(&err)
	return pebble.Open(dir, o)
}

// recoverGuarded is recover with a Fatalf in its iterators returned as an
// error.
func (b *Backend) recoverGuarded() (err error) {
	defer b.log.Catch(&err)
	return b.recover()
}

// Geometry returns the device geometry in use.
func (b *Backend) Geometry() Geometry { return b.g }

// recover rebuilds the zones from their write pointers: each zone's end is
// its write pointer plus the saved tail that starts exactly there; a block
// extent past its zone's end was never durable and is cut off (with
// everything after it in the block); every other byte past the last live
// extent of a zone is garbage that the cleaner and resets reclaim.
func (b *Backend) recover() error {
	al := b.g.align()
	b.direct = true
	for i := range b.g.Zones {
		p := filepath.Join(b.cfg.Mount, "seq", strconv.Itoa(i))
		fi, err := b.fs.Stat(p)
		if err != nil {
			return errorf("zone %d: %w", i, err)
		}
		z := &zone{id: i, path: p, cap: b.g.ZoneCap, al: al, wp: fi.Size()}
		z.cond.L = &z.mu
		z.curStart = z.wp
		z.syncedWP.Store(z.wp)
		if z.wp%int64(al) != 0 || z.wp > z.cap {
			return errorf("zone %d: write pointer %d not aligned or past capacity %d", i, z.wp, z.cap)
		}
		if b.direct {
			z.r, err = b.fs.OpenFile(p, os.O_RDONLY|unix.O_DIRECT, 0)
			if errors.Is(err, unix.EINVAL) {
				b.direct = false
			}
		}
		if !b.direct {
			z.r, err = b.fs.OpenFile(p, os.O_RDONLY, 0)
		}
		if err != nil {
			return errorf("zone %d: %w", i, err)
		}
		b.zones = append(b.zones, z)
	}
	fix := b.db.NewBatch()
	defer b.gdb.CloseBatch(fix)
	suspect := map[int][][2]int64{}
	// Durable marks: bytes of each zone known flushed; extents past them
	// were recorded while their bytes were being flushed, and are checked.
	dur := map[int]int64{}
	it, err := b.newIter(&pebble.IterOptions{LowerBound: []byte{kDurable}, UpperBound: []byte{kDurable + 1}})
	if err != nil {
		return err
	}
	for ok := it.First(); ok; ok = it.Next() {
		k := it.Key()
		val, verr := it.ValueAndErr()
		if verr != nil {
			it.Close()
			return verr
		}
		if len(k) != 5 || len(val) != 8 {
			fix.Delete(slices.Clone(k), nil)
			continue
		}
		if zi := int(binary.BigEndian.Uint32(k[1:])); zi < len(b.zones) {
			dur[zi] = int64(binary.BigEndian.Uint64(val))
			b.zones[zi].mark = dur[zi]
		}
	}
	if err := it.Close(); err != nil {
		return err
	}
	// Tails: keep the longest one that starts at the write pointer.
	it, err = b.newIter(&pebble.IterOptions{LowerBound: []byte{kTail}, UpperBound: []byte{kTail + 1}})
	if err != nil {
		return err
	}
	for ok := it.First(); ok; ok = it.Next() {
		zi, start, end, okk := parseTailKey(it.Key())
		val, verr := it.ValueAndErr()
		if verr != nil {
			it.Close()
			return verr
		}
		if !okk || zi >= len(b.zones) || end-start != int64(len(val)) || len(val) >= al || start%int64(al) != 0 {
			fix.Delete(slices.Clone(it.Key()), nil)
			continue
		}
		z := b.zones[zi]
		if start != z.wp || end <= z.end() {
			if start < z.wp {
				// The pointer moved past this tail: what is on the device
				// there must still be what the tail held, which the CRCs
				// of the extents over it tell.
				suspect[zi] = append(suspect[zi], [2]int64{start, end})
			}
			fix.Delete(slices.Clone(it.Key()), nil)
			continue
		}
		if z.cur == nil {
			z.cur, z.spare = alignedBuf(b.cfg.StageBytes, al), alignedBuf(b.cfg.StageBytes, al)
		}
		z.curLen = copy(z.cur, val)
		z.tails = append(z.tails, slices.Clone(it.Key()))
	}
	if err := it.Close(); err != nil {
		return err
	}
	// Blocks.
	it, err = b.newIter(&pebble.IterOptions{LowerBound: []byte{kBlock}, UpperBound: []byte{kBlock + 1}})
	if err != nil {
		return err
	}
	for ok := it.First(); ok; ok = it.Next() {
		k, okk := parseBlockKey(it.Key())
		val, verr := it.ValueAndErr()
		if verr != nil {
			it.Close()
			return verr
		}
		r, derr := decodeRecord(val)
		if !okk || derr != nil {
			b.cfg.Logf("zoned: dropping malformed block record %x: %v", it.Key(), derr)
			fix.Delete(slices.Clone(it.Key()), nil)
			continue
		}
		// An extent past its zone's end never became durable (its
		// record did, through a crash between the two): drop it, leaving
		// a hole the store's chunk checksums will find.
		kept := r.exts[:0]
		var size int64
		for _, e := range r.exts {
			if e.zone >= len(b.zones) || e.zoff+e.n > b.zones[e.zone].end() {
				b.cfg.Logf("zoned: container %d block %d: data [%d,+%d) was not durable; dropped", k.cid, k.lid, e.loff, e.n)
				continue
			}
			if (e.zoff+e.n > dur[e.zone] || b.overSuspect(suspect[e.zone], e)) && !b.extentIntact(e) {
				b.cfg.Logf("zoned: container %d block %d: data [%d,+%d) in zone %d fails its CRC (not durable when recorded); dropped", k.cid, k.lid, e.loff, e.n, e.zone)
				continue
			}
			kept = append(kept, e)
			size = e.end()
		}
		if len(kept) < len(r.exts) {
			r.exts, r.size = kept, size
			fix.Set(slices.Clone(it.Key()), r.encode(), nil)
		}
		for _, e := range r.exts {
			b.zones[e.zone].live += e.n
		}
	}
	if err := it.Close(); err != nil {
		return err
	}
	if err := b.commit(fix, pebble.Sync); err != nil {
		return err
	}
	for _, z := range b.zones {
		switch e := z.end(); {
		case e == 0:
			z.state = zEmpty
		case e >= z.cap:
			z.state = zFull
		default:
			z.state = zActive
			b.active++
		}
		if z.state != zEmpty && z.live == 0 {
			b.pending = append(b.pending, z.id)
		}
	}
	if b.active > b.cfg.Streams+1 {
		b.cfg.Logf("zoned: %d zones partly written, more than the %d written at once", b.active, b.cfg.Streams+1)
	}
	b.resetPending()
	return nil
}

func (b *Backend) overSuspect(rs [][2]int64, e extent) bool {
	for _, r := range rs {
		if e.zoff < r[1] && e.zoff+e.n > r[0] {
			return true
		}
	}
	return false
}

// extentIntact reads an extent and checks its CRC.
func (b *Backend) extentIntact(e extent) bool {
	p := make([]byte, e.n)
	return b.zones[e.zone].read(p, e.zoff, b.direct) == nil && crc(p) == e.crc
}

func (b *Backend) stripe(k bkey) *sync.Mutex { return &b.stripes[b.stripeIndex(k)] }

func (b *Backend) stripeIndex(k bkey) int {
	var h maphash.Hash
	h.SetSeed(b.seed)
	var buf [16]byte
	for i := range 8 {
		buf[i] = byte(uint64(k.cid) >> (8 * i))
		buf[8+i] = byte(uint64(k.lid) >> (8 * i))
	}
	h.Write(buf[:])
	return int(h.Sum64() % uint64(len(b.stripes)))
}

// subLive drops n live bytes from a zone; a zone left with none is queued
// for reset.
func (b *Backend) subLive(zi int, n int64) {
	b.mu.Lock()
	z := b.zones[zi]
	z.live -= n
	if z.live == 0 && z.state != zEmpty {
		b.pending = append(b.pending, zi)
		b.kickCleaner()
	}
	b.mu.Unlock()
}

func (b *Backend) kickCleaner() {
	select {
	case b.kick <- struct{}{}:
	default:
	}
}

// ErrNoZone is wrapped (with ENOSPC, so the store reports it as a full
// disk) when no zone can take more data.
var ErrNoZone = errors.New("zoned: no free zone")

// allocZone finds a zone for a new stream: a partly written zone nobody is
// appending to, else a fresh zone while fewer than Streams are written at
// once, else the partly written zone with the fewest streams. The cleaner
// may take the reserved empty zones; writers wait for it (while there is
// reclaimable space) or fail with ENOSPC.
func (b *Backend) allocZone(cleaner bool) (*zone, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var deadline time.Time
	for {
		if b.closed {
			return nil, errorf("closed")
		}
		z, busy := b.pickZone(cleaner)
		if z == nil && busy {
			// A fresh zone must wait until a zone that is full for the
			// backend but still being written to the device closes: the
			// device counts it open until its write pointer reaches the end.
			if deadline.IsZero() {
				deadline = time.Now().Add(b.cfg.SpaceWait)
			} else if time.Now().After(deadline) {
				return nil, fmt.Errorf("zoned: every zone the device may keep open is still being written after %v: %w", b.cfg.SpaceWait, unix.EBUSY)
			}
			t := time.AfterFunc(5*time.Millisecond, func() { b.mu.Lock(); b.cond.Broadcast(); b.mu.Unlock() })
			b.cond.Wait()
			t.Stop()
			continue
		}
		if z != nil {
			if z.state == zEmpty {
				z.state = zActive
				b.active++
			}
			z.users++
			z.amu.Lock()
			z.mu.Lock()
			err := z.activate(b.fs, b.cfg.StageBytes)
			z.mu.Unlock()
			z.amu.Unlock()
			if err != nil {
				z.users--
				return nil, errorf("zone %d: %w", z.id, err)
			}
			return z, nil
		}
		if cleaner || b.reclaimableLocked() < b.g.ZoneCap {
			return nil, fmt.Errorf("%w (%d zones of %d bytes, %d live bytes): %w", ErrNoZone, b.g.Zones, b.g.ZoneCap, b.liveLocked(), unix.ENOSPC)
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(b.cfg.SpaceWait)
		} else if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: the cleaner freed none in %v: %w", ErrNoZone, b.cfg.SpaceWait, unix.ENOSPC)
		}
		b.kickCleaner()
		t := time.AfterFunc(100*time.Millisecond, func() { b.mu.Lock(); b.cond.Broadcast(); b.mu.Unlock() })
		b.cond.Wait()
		t.Stop()
	}
}

// busy: no zone is returned because a fresh one would exceed the device's
// open-zone limit while zones the backend counts full are still being
// written to the device (their staged tail not yet at the write pointer):
// the caller waits for those writes rather than failing.
func (b *Backend) pickZone(cleaner bool) (z *zone, busy bool) {
	var idle, shared *zone
	for _, z := range b.zones {
		if z.state != zActive || z == b.cleanZ || z.resetOK || b.roomLocked(z) == 0 {
			continue
		}
		if z.users == 0 && (idle == nil || z.live > idle.live) {
			idle = z
		}
		if shared == nil || z.users < shared.users {
			shared = z
		}
	}
	if idle != nil {
		return idle, false
	}
	// Writers' streams and the cleaner's zone are counted apart, so the
	// cleaner never takes a writer's slot nor a writer the cleaner's.
	active, limit := b.active, b.cfg.Streams
	if b.cleanZ != nil && b.cleanZ.state == zActive {
		active--
	}
	reserve := b.cfg.ReserveZones
	if cleaner {
		active, limit, reserve = 0, 1, 0
	}
	if active < limit && b.emptyLocked() > reserve {
		// What the device counts open: zones with a write handle whose
		// write pointer is short of the end. A zone that just became full
		// for the backend stays open on the device until its last staged
		// bytes are written, so it still takes one of the writers' slots
		// (or, for the cleaner, one of the device's).
		open, openLimit := b.writingLocked(b.cleanZ), b.cfg.Streams
		if cleaner {
			open, openLimit = b.writingLocked(nil), b.g.zoneLimit(1<<20)
		}
		if open >= openLimit {
			if shared != nil && !cleaner {
				return shared, false
			}
			return nil, true
		}
		for _, z := range b.zones {
			if z.state == zEmpty && !z.resetOK {
				return z, false
			}
		}
	}
	if cleaner {
		return nil, false
	}
	return shared, false
}

// writingLocked counts zones other than except that the device counts
// open: a write handle, and the write pointer short of the capacity.
func (b *Backend) writingLocked(except *zone) int {
	n := 0
	for _, z := range b.zones {
		if z == except {
			continue
		}
		z.mu.Lock()
		if z.w != nil && z.wp < z.cap {
			n++
		}
		z.mu.Unlock()
	}
	return n
}

func (b *Backend) roomLocked(z *zone) int64 {
	z.mu.Lock()
	defer z.mu.Unlock()
	if z.err != nil {
		return 0
	}
	return z.cap - z.end()
}

func (b *Backend) emptyLocked() int {
	n := 0
	for _, z := range b.zones {
		if z.state == zEmpty && !z.resetOK {
			n++
		}
	}
	return n
}

func (b *Backend) liveLocked() int64 {
	var n int64
	for _, z := range b.zones {
		n += z.live
	}
	return n
}

// reclaimableLocked is the dead space in full zones.
func (b *Backend) reclaimableLocked() int64 {
	var n int64
	for _, z := range b.zones {
		if z.state == zFull {
			n += z.cap - z.live
		}
	}
	return n
}

// dropZone ends a stream's use of a zone; full marks it full.
func (b *Backend) dropZone(z *zone) {
	b.mu.Lock()
	z.users--
	full := b.roomLocked(z) == 0
	if full && z.state == zActive {
		z.state = zFull
		b.active--
		b.cond.Broadcast()
	}
	last := z.users == 0
	if z.live == 0 && last && z != b.cleanZ {
		b.pending = append(b.pending, z.id)
		b.kickCleaner()
	}
	b.mu.Unlock()
	if last && full {
		z.amu.Lock()
		z.mu.Lock()
		for z.writing {
			z.cond.Wait()
		}
		z.release()
		z.mu.Unlock()
		z.amu.Unlock()
		b.mu.Lock()
		b.cond.Broadcast() // a writer may wait for this zone's handle (pickZone)
		b.mu.Unlock()
	}
}

// DiskUsage reports the zones' capacity and what is not live data, less
// the cleaner's reserve (storage.SpaceReporter).
func (b *Backend) DiskUsage() (avail, total int64, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	total = b.g.ZoneCap * int64(b.g.Zones)
	avail = total - b.liveLocked() - b.g.ZoneCap*int64(b.cfg.ReserveZones)
	return max(0, avail), total, nil
}

// Stats are counters of a zoned volume.
type Stats struct {
	UserBytes, MovedBytes int64 // appended by writers, rewritten by the cleaner
	Resets, Cleaned       int64 // zones reset, zones emptied by the cleaner
	EmptyZones, Zones     int
	LiveBytes             int64
}

// WriteAmplification is (user + moved) / user bytes.
func (s Stats) WriteAmplification() float64 {
	if s.UserBytes == 0 {
		return 1
	}
	return float64(s.UserBytes+s.MovedBytes) / float64(s.UserBytes)
}

func (b *Backend) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Stats{UserBytes: b.userBytes.Load(), MovedBytes: b.movedBytes.Load(), Resets: b.resets.Load(), Cleaned: b.cleaned.Load(),
		EmptyZones: b.emptyLocked(), Zones: b.g.Zones, LiveBytes: b.liveLocked()}
}

// Close stops the cleaner and closes the zones and the DB. Unsynced data
// is dropped, as a crash would.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.cond.Broadcast()
	b.mu.Unlock()
	close(b.stop)
	wedged := func() bool { return b.Fatal() != nil }
	if !waitDone(b.done, wedged) {
		// The cleaner is stalled inside the wedged DB: leave it all to
		// the process exit.
		return nil
	}
	merr := b.saveMarks(pebble.Sync)
	b.closeFiles()
	// Left open if wedged, even while closing: its Close would wait for a
	// flush or compaction that Fatalf ended (see storage.CloseDB).
	b.gdb.Stop() // its idle committers end
	cerr := storage.CloseDB(b.db, b.log, wedged)
	if merr != nil {
		return merr
	}
	return cerr
}

// waitDone waits for done, or until wedged (false).
func waitDone(done <-chan struct{}, wedged func() bool) bool {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-done:
			return true
		case <-t.C:
			if wedged() {
				select { // a grace for a cleaner on its way out
				case <-done:
					return true
				case <-time.After(time.Second):
					return false
				}
			}
		}
	}
}

func (b *Backend) closeFiles() {
	for _, z := range b.zones {
		z.amu.Lock()
		z.mu.Lock()
		for z.writing {
			z.cond.Wait()
		}
		if z.w != nil {
			z.w.Close()
			z.w = nil
		}
		if z.r != nil {
			z.r.Close()
			z.r = nil
		}
		z.mu.Unlock()
		z.amu.Unlock()
	}
}

func (b *Backend) String() string { return fmt.Sprintf("zoned(%s)", b.cfg.Mount) }

var _ storage.BlockFiles = (*Backend)(nil)
