package datanode

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/crc32c"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// The cache tier (docs/CACHE.md). SCM's cache monitor sends CacheBlocks
// and UncacheBlocks commands on heartbeats; every heartbeat reports the
// blocks held. Caching copies a committed block into a cache directory
// (a DAX-mounted pmem file system in production, tmpfs or any directory
// elsewhere) as DIR/<container>/<block>.blk, maps it, verifies every
// checksum once from the mapping, and writes DIR/<container>/<block>.rec
// (the block's length, chunk checksums and a CRC of the record itself) as
// the commit point. ReadBlock serves a cached block from the mapping and
// never touches the data disk. At start-up the datanode recovers its cache
// directories before it first reports: files without a record, or whose
// length or record does not match, are removed; the rest are mapped and
// reported at once, and their checksums are verified in the background
// (a read before that verifies the chunks it touches), so a restart needs
// no warm-up. A block that fails verification is dropped: SCM sees it
// unreported and sends the cache command again, and reads go to the disk.
//
// Without a cache directory, CacheBytes > 0 gives a DRAM cache: anonymous
// mappings, locked in memory (mlock) when the limit allows, not persistent.

// cacheRecord is the stored description of a cached block.
type cacheRecord struct {
	Container uint64            `json:"container"`
	Block     storage.BlockData `json:"block"`
	CRC       uint32            `json:"crc"` // CRC32C of the record with CRC 0
}

func (r cacheRecord) sum() uint32 {
	r.CRC = 0
	b, _ := json.Marshal(r)
	return crc32c.Checksum(b)
}

type cacheKey struct{ c, l uint64 }

type cacheEntry struct {
	key      cacheKey
	dir      int // index in blockCache.dirs; -1: DRAM
	bd       storage.BlockData
	mu       sync.RWMutex // held for reading while serving; for writing to unmap
	data     []byte       // the mapping (nil for an empty block or once unmapped)
	verified atomic.Bool
}

type cacheDir struct {
	path           string
	capacity, used int64
}

type blockCache struct {
	log        *slog.Logger
	store      *storage.Store
	dirs       []*cacheDir
	dram       bool
	dramCap    int64
	dramUsed   int64
	mu         sync.Mutex
	entries    map[cacheKey]*cacheEntry
	pending    map[cacheKey]bool
	work       chan cacheKey
	stopc      chan struct{}
	wg         sync.WaitGroup
	hits       atomic.Uint64
	misses     atomic.Uint64
	copied     atomic.Uint64 // blocks copied in (disk reads)
	recovered  atomic.Uint64 // blocks found at start-up
	dropped    atomic.Uint64 // blocks that failed verification
	hitBytes   atomic.Uint64
	collectors []prometheus.Collector
	// version counts changes of the cached set; a heartbeat carries the
	// list only when it changed since the last one sent, or with a full
	// report (a new SCM leader learns it then).
	version, reported atomic.Uint64
}

const maxCacheQueue = 4096

// openCache recovers the cache directories (each with capacity bytes) or
// sets up a DRAM cache of capacity bytes (no dirs). Nil when neither.
func openCache(dirs []string, capacity int64, st *storage.Store, log *slog.Logger) (*blockCache, error) {
	if len(dirs) == 0 && capacity <= 0 {
		return nil, nil
	}
	if capacity <= 0 {
		return nil, errors.New("datanode: a cache directory needs a capacity (--cache-bytes)")
	}
	bc := &blockCache{log: log, store: st, entries: map[cacheKey]*cacheEntry{}, pending: map[cacheKey]bool{},
		work: make(chan cacheKey, maxCacheQueue), stopc: make(chan struct{})}
	if len(dirs) == 0 {
		bc.dram, bc.dramCap = true, capacity
	}
	start := time.Now()
	for i, p := range dirs {
		if err := os.MkdirAll(p, 0o755); err != nil {
			return nil, fmt.Errorf("datanode: cache dir: %w", err)
		}
		cd := &cacheDir{path: p, capacity: capacity}
		bc.dirs = append(bc.dirs, cd)
		if err := bc.recoverDir(i); err != nil {
			bc.close()
			return nil, err
		}
	}
	if n := bc.recovered.Load(); n > 0 {
		log.Info("cache: recovered cached blocks", "blocks", n, "took", time.Since(start))
	}
	bc.wg.Add(2)
	go bc.worker()
	go bc.verifyRecovered()
	return bc, nil
}

func (bc *blockCache) blockPath(dir int, k cacheKey) string {
	return filepath.Join(bc.dirs[dir].path, strconv.FormatUint(k.c, 10), strconv.FormatUint(k.l, 10))
}

// recoverDir maps every cached block with a valid record in dir i and
// removes everything else.
func (bc *blockCache) recoverDir(i int) error {
	root := bc.dirs[i].path
	conts, err := os.ReadDir(root)
	if err != nil {
		return err
	}
	for _, ce := range conts {
		cid, err := strconv.ParseUint(ce.Name(), 10, 64)
		if err != nil || !ce.IsDir() {
			continue
		}
		files, err := os.ReadDir(filepath.Join(root, ce.Name()))
		if err != nil {
			return err
		}
		for _, f := range files {
			name := f.Name()
			full := filepath.Join(root, ce.Name(), name)
			if !strings.HasSuffix(name, ".rec") {
				if !strings.HasSuffix(name, ".blk") {
					os.Remove(full) // a copy that never finished
					continue
				}
				if _, err := os.Stat(strings.TrimSuffix(full, ".blk") + ".rec"); err != nil {
					os.Remove(full) // no record: never committed
				}
				continue
			}
			lid, err := strconv.ParseUint(strings.TrimSuffix(name, ".rec"), 10, 64)
			if err != nil {
				os.Remove(full)
				continue
			}
			k := cacheKey{cid, lid}
			if err := bc.recoverOne(i, k); err != nil {
				bc.log.Warn("cache: dropping a cached block at start-up", "container", cid, "block", lid, "err", err)
				bc.removeFiles(i, k)
			}
		}
	}
	return nil
}

func (bc *blockCache) recoverOne(i int, k cacheKey) error {
	base := bc.blockPath(i, k)
	b, err := os.ReadFile(base + ".rec")
	if err != nil {
		return err
	}
	if len(b) > 64<<20 {
		return errors.New("record too large")
	}
	var rec cacheRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return fmt.Errorf("record: %w", err)
	}
	if rec.sum() != rec.CRC || rec.Container != k.c || uint64(rec.Block.LocalID) != k.l {
		return errors.New("record checksum or identity mismatch")
	}
	var total int64
	for _, ch := range rec.Block.Chunks {
		if ch.Offset != total {
			return errors.New("record chunks not contiguous")
		}
		total += ch.Length
	}
	if total != rec.Block.Length {
		return errors.New("record chunk lengths do not sum to the block length")
	}
	d := bc.dirs[i]
	if d.used+rec.Block.Length > d.capacity {
		return fmt.Errorf("over the cache capacity %d", d.capacity)
	}
	e := &cacheEntry{key: k, dir: i, bd: rec.Block}
	if rec.Block.Length > 0 {
		f, err := os.Open(base + ".blk")
		if err != nil {
			return err
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		if fi.Size() != rec.Block.Length {
			return fmt.Errorf("cache file is %d bytes, the record says %d", fi.Size(), rec.Block.Length)
		}
		// No MAP_POPULATE: populating the page tables costs time in
		// proportion to the bytes cached (about 0.07-0.55 s per GiB on
		// tmpfs here) and would hold up the start; a read faults in what it
		// touches and the background verification the rest.
		e.data, err = unix.Mmap(int(f.Fd()), 0, int(rec.Block.Length), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("mmap: %w", err)
		}
	} else {
		e.verified.Store(true)
	}
	d.used += rec.Block.Length
	bc.entries[k] = e
	bc.version.Add(1)
	bc.recovered.Add(1)
	return nil
}

// verifyRecovered verifies the recovered blocks' checksums once, in the
// background; a block that fails is dropped (and cached again on SCM's
// next command).
func (bc *blockCache) verifyRecovered() {
	defer bc.wg.Done()
	bc.mu.Lock()
	var todo []*cacheEntry
	for _, e := range bc.entries {
		if !e.verified.Load() {
			todo = append(todo, e)
		}
	}
	bc.mu.Unlock()
	for _, e := range todo {
		select {
		case <-bc.stopc:
			return
		default:
		}
		e.mu.RLock()
		ok := e.data == nil || verifyMapped(e.bd, e.data, 0, e.bd.Length)
		e.mu.RUnlock()
		if ok {
			e.verified.Store(true)
			continue
		}
		bc.log.Warn("cache: a recovered cached block fails its checksums; dropped", "container", e.key.c, "block", e.key.l)
		bc.dropped.Add(1)
		bc.uncache(e.key)
	}
}

// verifyMapped verifies the chunks of bd overlapping [off, off+n) in data.
func verifyMapped(bd storage.BlockData, data []byte, off, n int64) bool {
	for _, ch := range bd.Chunks {
		if ch.Offset+ch.Length <= off || ch.Offset >= off+n {
			continue
		}
		if ch.Offset+ch.Length > int64(len(data)) {
			return false
		}
		if ch.Checksum.Verify(data[ch.Offset:ch.Offset+ch.Length]) >= 0 {
			return false
		}
	}
	return true
}

// request queues blocks to cache (repeats and full queues are dropped:
// SCM sends the command again).
func (bc *blockCache) request(ids []*metapb.BlockID) {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	for _, id := range ids {
		k := cacheKey{id.GetContainerId(), id.GetLocalId()}
		if bc.entries[k] != nil || bc.pending[k] {
			continue
		}
		select {
		case bc.work <- k:
			bc.pending[k] = true
		default:
			return
		}
	}
}

func (bc *blockCache) worker() {
	defer bc.wg.Done()
	for {
		select {
		case <-bc.stopc:
			return
		case k := <-bc.work:
			if err := bc.cacheOneSafe(k); err != nil {
				bc.log.Warn("cache: caching a block failed", "container", k.c, "block", k.l, "err", err)
			}
			bc.mu.Lock()
			delete(bc.pending, k)
			bc.mu.Unlock()
		}
	}
}

// cacheOneSafe is cacheOne with a panic turned into an error.
func (bc *blockCache) cacheOneSafe(k cacheKey) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return bc.cacheOne(k)
}

// reserve picks a directory (or the DRAM budget) with room for n bytes.
func (bc *blockCache) reserve(n int64) (int, error) {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	if bc.dram {
		if bc.dramUsed+n > bc.dramCap {
			return 0, fmt.Errorf("DRAM cache full (%d of %d bytes used)", bc.dramUsed, bc.dramCap)
		}
		bc.dramUsed += n
		return -1, nil
	}
	best := -1
	for i, d := range bc.dirs {
		if d.capacity-d.used >= n && (best < 0 || d.capacity-d.used > bc.dirs[best].capacity-bc.dirs[best].used) {
			best = i
		}
	}
	if best < 0 {
		return 0, errors.New("cache directories full")
	}
	bc.dirs[best].used += n
	return best, nil
}

func (bc *blockCache) release(dir int, n int64) {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	if dir < 0 {
		bc.dramUsed -= n
	} else {
		bc.dirs[dir].used -= n
	}
}

// cacheOne copies a committed block into the cache, verifies it from the
// mapping and commits it.
func (bc *blockCache) cacheOne(k cacheKey) error {
	bd, err := bc.store.GetBlock(storage.ContainerID(k.c), storage.LocalID(k.l))
	if err != nil {
		return err
	}
	dir, err := bc.reserve(bd.Length)
	if err != nil {
		return err
	}
	e := &cacheEntry{key: k, dir: dir, bd: bd}
	ok := false
	defer func() {
		if !ok {
			if e.data != nil {
				unix.Munmap(e.data)
			}
			bc.release(dir, bd.Length)
			if dir >= 0 {
				bc.removeFiles(dir, k)
			}
		}
	}()
	var f *os.File
	if bd.Length > 0 {
		if dir < 0 {
			e.data, err = unix.Mmap(-1, 0, int(bd.Length), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			if err != nil {
				return fmt.Errorf("mmap: %w", err)
			}
			if err := unix.Mlock(e.data); err != nil {
				bc.log.Debug("cache: mlock failed; the DRAM cache is not locked", "err", err)
			}
		} else {
			base := bc.blockPath(dir, k)
			if err := os.MkdirAll(filepath.Dir(base), 0o755); err != nil {
				return err
			}
			f, err = os.OpenFile(base+".tmp", os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
			if err != nil {
				return err
			}
			defer f.Close()
			if err := f.Truncate(bd.Length); err != nil {
				return err
			}
			e.data, err = unix.Mmap(int(f.Fd()), 0, int(bd.Length), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			if err != nil {
				return fmt.Errorf("mmap: %w", err)
			}
		}
		// Copy from the data disk (ReadAt verifies as it reads), then
		// verify every checksum once more from the mapping: what is served
		// is what was verified.
		for off := int64(0); off < bd.Length; {
			n := min(bd.Length-off, readPiece)
			got, err := bc.store.ReadAt(storage.ContainerID(k.c), storage.LocalID(k.l), e.data[off:off+n], off)
			if err != nil {
				return err
			}
			if got <= 0 {
				return errors.New("short read from the data disk")
			}
			off += int64(got)
		}
		if !verifyMapped(bd, e.data, 0, bd.Length) {
			return errors.New("the copy fails its checksums")
		}
		if dir >= 0 {
			if err := unix.Msync(e.data, unix.MS_SYNC); err != nil {
				return fmt.Errorf("msync: %w", err)
			}
			base := bc.blockPath(dir, k)
			if err := os.Rename(base+".tmp", base+".blk"); err != nil {
				return err
			}
		}
	}
	if dir >= 0 {
		rec := cacheRecord{Container: k.c, Block: bd}
		rec.CRC = rec.sum()
		b, _ := json.Marshal(rec)
		base := bc.blockPath(dir, k)
		if err := writeFileSync(base+".rec.tmp", b); err != nil {
			return err
		}
		if err := os.Rename(base+".rec.tmp", base+".rec"); err != nil {
			return err
		}
		syncDir(filepath.Dir(base))
	}
	e.verified.Store(true)
	bc.mu.Lock()
	if bc.entries[k] != nil {
		bc.mu.Unlock()
		return nil // raced with itself; keep the first
	}
	bc.entries[k] = e
	bc.version.Add(1)
	bc.mu.Unlock()
	ok = true
	bc.copied.Add(1)
	bc.log.Debug("cache: block cached", "container", k.c, "block", k.l, "bytes", bd.Length)
	return nil
}

func writeFileSync(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func syncDir(dir string) {
	if f, err := os.Open(dir); err == nil {
		f.Sync()
		f.Close()
	}
}

func (bc *blockCache) removeFiles(dir int, k cacheKey) {
	base := bc.blockPath(dir, k)
	os.Remove(base + ".rec") // the record first: without it the data is garbage
	os.Remove(base + ".rec.tmp")
	os.Remove(base + ".blk")
	os.Remove(base + ".tmp")
}

// uncache drops a block: out of the map at once, unmapped once no read
// holds it.
func (bc *blockCache) uncache(k cacheKey) {
	bc.mu.Lock()
	e := bc.entries[k]
	delete(bc.entries, k)
	bc.version.Add(1)
	bc.mu.Unlock()
	if e == nil {
		return
	}
	e.mu.Lock()
	if e.data != nil {
		unix.Munmap(e.data)
		e.data = nil
	}
	e.mu.Unlock()
	if e.dir >= 0 {
		bc.removeFiles(e.dir, k)
	}
	bc.release(e.dir, e.bd.Length)
}

// get returns a cached block's entry, read-locked (the caller unlocks),
// or nil.
func (bc *blockCache) get(c, l uint64) *cacheEntry {
	bc.mu.Lock()
	e := bc.entries[cacheKey{c, l}]
	bc.mu.Unlock()
	if e == nil {
		return nil
	}
	e.mu.RLock()
	if e.data == nil && e.bd.Length > 0 {
		e.mu.RUnlock()
		return nil
	}
	return e
}

// serve answers a ReadBlock from a cached block. It returns false (having
// sent nothing) when the entry fails verification: the caller reads the
// disk.
func (bc *blockCache) serve(e *cacheEntry, cid storage.ContainerID, off, n int64, stream datanodepb.Datanode_ReadBlockServer) (bool, error) {
	if !e.verified.Load() && !verifyMapped(e.bd, e.data, off, n) {
		return false, nil
	}
	if err := stream.Send(&datanodepb.ReadBlockResponse{Block: fromBlockData(cid, e.bd), Cached: true}); err != nil {
		return true, err
	}
	for p := off; p < off+n; p += sendPiece {
		end := min(p+sendPiece, off+n)
		if err := stream.Send(&datanodepb.ReadBlockResponse{Offset: uint64(p), Data: e.data[p:end]}); err != nil {
			return true, err
		}
	}
	bc.hits.Add(1)
	bc.hitBytes.Add(uint64(n))
	return true, nil
}

// report fills a heartbeat's cache fields: the counters always, the
// cached-block list when it changed or with a full report. sent is
// called once the heartbeat went through.
func (bc *blockCache) report(req *metapb.HeartbeatRequest, full bool) (sent func()) {
	req.Cache = bc.stats()
	bc.mu.Lock()
	defer bc.mu.Unlock()
	v := bc.version.Load()
	if !full && v == bc.reported.Load() {
		return func() {}
	}
	req.CacheReport = true
	req.CachedBlocks = make([]*metapb.BlockID, 0, len(bc.entries))
	for k := range bc.entries {
		req.CachedBlocks = append(req.CachedBlocks, &metapb.BlockID{ContainerId: k.c, LocalId: k.l})
	}
	sort.Slice(req.CachedBlocks, func(i, j int) bool {
		a, b := req.CachedBlocks[i], req.CachedBlocks[j]
		return a.ContainerId < b.ContainerId || (a.ContainerId == b.ContainerId && a.LocalId < b.LocalId)
	})
	return func() { bc.reported.Store(v) }
}

func (bc *blockCache) stats() *metapb.CacheStats {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	s := &metapb.CacheStats{Blocks: uint64(len(bc.entries)), Hits: bc.hits.Load(), Misses: bc.misses.Load(), Persistent: !bc.dram}
	if bc.dram {
		s.CapacityBytes, s.UsedBytes = uint64(bc.dramCap), uint64(bc.dramUsed)
	}
	for _, d := range bc.dirs {
		s.CapacityBytes += uint64(d.capacity)
		s.UsedBytes += uint64(d.used)
	}
	return s
}

func (bc *blockCache) metrics() []prometheus.Collector {
	if bc.collectors != nil {
		return bc.collectors
	}
	counter := func(name, help string, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode_cache", Name: name, Help: help},
			func() float64 { return float64(f()) })
	}
	gauge := func(name, help string, f func() uint64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode_cache", Name: name, Help: help},
			func() float64 { return float64(f()) })
	}
	bc.collectors = []prometheus.Collector{
		counter("hits_total", "Block reads served from the cache tier (the data disk untouched).", bc.hits.Load),
		counter("hit_bytes_total", "Bytes served from the cache tier.", bc.hitBytes.Load),
		counter("misses_total", "Block reads of blocks not cached.", bc.misses.Load),
		counter("copied_total", "Blocks copied into the cache from the data disk.", bc.copied.Load),
		counter("recovered_total", "Cached blocks found and mapped at start-up.", bc.recovered.Load),
		counter("dropped_total", "Cached blocks dropped because they failed verification.", bc.dropped.Load),
		gauge("capacity_bytes", "Capacity of the cache tier.", func() uint64 { return bc.stats().CapacityBytes }),
		gauge("used_bytes", "Bytes cached.", func() uint64 { return bc.stats().UsedBytes }),
		gauge("blocks", "Blocks cached.", func() uint64 { return bc.stats().Blocks }),
	}
	return bc.collectors
}

// close stops the workers and unmaps everything (files stay: the cache
// is persistent).
func (bc *blockCache) close() {
	select {
	case <-bc.stopc:
		return
	default:
	}
	close(bc.stopc)
	bc.wg.Wait()
	bc.mu.Lock()
	defer bc.mu.Unlock()
	for _, e := range bc.entries {
		e.mu.Lock()
		if e.data != nil {
			unix.Munmap(e.data)
			e.data = nil
		}
		e.mu.Unlock()
	}
}

// ---------------------------------------------------------------- Datanode API

// CacheStats is the cache tier's counters (tests, admin).
type CacheStats struct {
	Capacity, Used             uint64
	Blocks                     uint64
	Hits, Misses               uint64
	Copied, Recovered, Dropped uint64
}

// CacheStats returns the cache tier's counters (zero without a cache).
func (d *Datanode) CacheStats() CacheStats {
	bc := d.cache
	if bc == nil {
		return CacheStats{}
	}
	s := bc.stats()
	return CacheStats{Capacity: s.CapacityBytes, Used: s.UsedBytes, Blocks: s.Blocks, Hits: s.Hits, Misses: s.Misses,
		Copied: bc.copied.Load(), Recovered: bc.recovered.Load(), Dropped: bc.dropped.Load()}
}

// IsCached reports whether a block is in the cache tier.
func (d *Datanode) IsCached(container, local uint64) bool {
	if d.cache == nil {
		return false
	}
	d.cache.mu.Lock()
	defer d.cache.mu.Unlock()
	return d.cache.entries[cacheKey{container, local}] != nil
}

func (d *Datanode) executeCache(add, drop []*metapb.BlockID) error {
	if d.cache == nil {
		if len(add) > 0 {
			return errors.New("cache command, but this datanode has no cache tier (--cache-dir/--cache-bytes)")
		}
		return nil
	}
	if len(drop) > 0 {
		go func() {
			for _, id := range drop {
				d.cache.uncache(cacheKey{id.GetContainerId(), id.GetLocalId()})
			}
		}()
	}
	d.cache.request(add)
	return nil
}
