package namespace

import (
	"hash/maphash"
	"sync"
	"sync/atomic"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// lookupCache keeps decoded key records of object buckets for the read
// path (LookupKey, LookupKeys, a key's own ACL in authorization): a hit
// costs a map lookup instead of a Pebble Get and a KeyInfo unmarshal.
//
// Consistency. The cache holds only what readers read from committed
// Pebble state, and Apply keeps it exact with a generation per shard:
//
//   - a reader loads its shard's generation before it reads Pebble, and
//     inserts what it read only if the generation is still the same and
//     even;
//   - an Apply that writes or deletes key records (every such write goes
//     through tx.put or tx.del, which note the key) makes the shards of
//     those keys' generation odd and drops their entries *before* it
//     commits the batch, and makes it even again after the commit.
//
// So while a key's change is being committed its entry is absent and no
// reader can insert one (odd generation: nothing read then is kept), and
// an insert after the commit needs a generation loaded after it, hence a
// Pebble read that saw the change. A lookup never returns a record older
// than the committed state it could have read from Pebble at that moment:
// a read after an acknowledged write (whose Apply has returned) sees it.
// A snapshot restore, and the benchmark's bulk load, drop the whole cache
// the same way (all shards odd during the change). Leader changes need
// nothing: every replica fills its cache only from its own committed
// state, which Apply maintains on followers exactly as on the leader.
//
// Cached records are shared between readers and never modified; a lookup
// hands out a shallow copy (copyKeyInfo) whose own fields the service may
// set (Locations).
//
// Bounded in bytes: each of lookupShards shards holds at most its share
// of maxBytes (an estimate of the decoded record's heap, entryCost), and
// evicts with CLOCK (a hand goes round the shard's slots; an entry hit
// since the hand last passed gets a second chance). A shard's lock is
// taken shared on a hit. Admission: once a shard is full, a record is
// kept only on its key's second miss since the shard's doorkeeper (a
// bitset of key hashes) was last cleared, so a working set larger than the cache (uniform lookups
// over many keys) does not churn the cache (an insert and an eviction, and
// garbage for the collector, per miss) for entries that are rarely hit.
//
// Adaptive bypass. A full cache that is rarely hit costs more than it
// saves (each miss probes a map in cold memory, and the collector marks
// the whole cache), so the cache watches its hit ratio over windows of
// lookups (winLookups, counted per shard and added up every shardFlush
// lookups). When a cache at least 1/bypassFill full hits less than
// bypassLowPct of a window (but some: under 1% the keys are being read
// for the first time, as in a first pass over a working set, and that
// shows only that a cache nearly full holds the wrong keys), it bypasses
// itself: only keys of one sampled
// hash class (1 in bypassDiv) are probed and inserted, every other
// lookup skips the cache (no probe; its generation is odd, so put keeps
// nothing). For a window the other entries stay: a working set read
// once and then again and again looks like uniform lookups at first, and
// if the sampled keys hit in that window the cache serves every key again
// with its entries intact. While the sampled keys are hardly ever read
// again (under 1% hits: each read for the first time, which no cache
// would hit, e.g. the first pass over a working set) or their hit ratio
// more than doubles from one window to the next, it holds for up to
// maxHeld windows. Otherwise it shrinks: each shard keeps only
// the sampled keys, within 1/bypassDiv of its bound (the rest is freed,
// so the collector no longer marks it). The sampled keys' hit ratio in
// that small cache estimates the one the whole cache would have (spatial
// sampling, as SHARDS); when it reaches bypassHighPct the cache serves
// every key again. If the sampled class gets far less than its share of
// lookups (a few hot keys of other classes), the class moves on each
// window, so every key is sampled in turn. The bypass only skips probes,
// refuses inserts and drops entries; it never changes what an entry holds
// or when one may be inserted (the generations above), so it cannot make
// a lookup stale.
type lookupCache struct {
	off      bool
	maxShard int64 // bytes per shard
	seed     maphash.Seed

	bypass               atomic.Bool
	shrunk               atomic.Bool   // bypassing, and the unsampled entries are gone
	class                atomic.Uint64 // the sampled hash class while bypassing
	win                  atomic.Uint64 // window: lookups | probes<<winBits | hits<<2*winBits
	evalMu               sync.Mutex
	held                 int           // windows bypassed before shrinking (evalMu)
	prevHits, prevProbes uint64        // the last window's (evalMu)
	changes              atomic.Uint64 // switches between serving and bypassing

	shards [lookupShards]lcShard
}

// The adaptive bypass's constants (see lookupCache).
const (
	bypassDiv     = 16 // 1 in bypassDiv hash classes sampled; the bound shrinks as much
	bypassFill    = 8  // bypass only a cache at least 1/bypassFill full
	maxHeld       = 8  // windows a bypassed cache keeps its entries while its sampled keys are not read again
	winLookups    = 1 << 13
	shardFlush    = 64
	bypassLowPct  = 35 // a full cache hitting less bypasses itself
	bypassHighPct = 50 // the sampled estimate serves again at this
	minProbes     = 256
	winBits       = 21
	winMask       = 1<<winBits - 1
)

// lookupShards is a power of two and at most 64 (a change set is a
// uint64 mask of shards).
const lookupShards = 64

// DefaultLookupCacheBytes is the default bound of the decoded-record
// cache of one meta node.
const DefaultLookupCacheBytes = 128 << 20

type lcShard struct {
	mu    sync.RWMutex
	gen   atomic.Uint64 // odd while a change of this shard's keys commits
	m     map[string]*lcEntry
	bytes int64
	// CLOCK: slots holds the entries (nil: free, listed in free); hand is
	// the next slot the eviction looks at.
	slots []*lcEntry
	free  []int
	hand  int
	// door: hashes of keys missed since it was last cleared (admission);
	// doorN counts the bits set.
	door    [doorWords]atomic.Uint64
	doorN   atomic.Int64
	full    atomic.Bool // the shard is (nearly) at its bound: admission applies
	hits    atomic.Uint64
	misses  atomic.Uint64
	evicted atomic.Uint64
	skipped atomic.Uint64 // lookups that bypassed the cache
	win     atomic.Uint64 // this shard's part of the window, as lookupCache.win
	_       [64]byte      // keep shards' hot words on their own cache lines
}

// doorWords sizes a shard's doorkeeper (64 Ki bits, 8 KiB); it is cleared
// once doorClear keys were noted (65,536 over the 64 shards), when about
// 1 in 64 of its bits are set (its false positives admit that share of
// first misses). A key is admitted when it misses again within that
// window of misses (with lookups spread evenly over 1M keys, about 1 in
// 12 misses; a window 8x as long admitted about 4 in 10 and measured the
// same CPU per lookup, docs/BENCHMARKS.md session 9: what such lookups
// cost beyond the uncached path is the probe and the collector's work on
// a full cache, not the inserts).
const (
	doorWords = 1 << 10
	doorClear = doorWords * 64 / 64
)

type lcEntry struct {
	key  string
	ki   *metapb.KeyInfo // shared, never modified
	size int             // the stored record's length
	cost int64
	slot int
	ref  atomic.Bool // hit since the hand last passed
}

func newLookupCache(maxBytes int64) *lookupCache {
	c := &lookupCache{seed: maphash.MakeSeed()}
	c.setMax(maxBytes)
	return c
}

// setMax sets the bound (0: the default; negative: no cache). Call it
// before the cache serves.
func (c *lookupCache) setMax(maxBytes int64) {
	if maxBytes == 0 {
		maxBytes = DefaultLookupCacheBytes
	}
	c.off = maxBytes < 0
	c.maxShard = maxBytes / lookupShards
}

func (c *lookupCache) shardOf(k []byte) int {
	return int(maphash.Bytes(c.seed, k) & (lookupShards - 1))
}

// admit notes a miss of k in its shard's doorkeeper and reports whether
// k had missed before since the doorkeeper was cleared.
func (c *lookupCache) admit(sh *lcShard, k []byte) bool {
	h := maphash.Bytes(c.seed, k) >> 6 // the low bits chose the shard
	w, bit := &sh.door[(h>>6)%doorWords], uint64(1)<<(h&63)
	if w.Load()&bit != 0 {
		return true
	}
	w.Or(bit)
	if sh.doorN.Add(1) == doorClear {
		for i := range sh.door {
			sh.door[i].Store(0)
		}
		sh.doorN.Store(0)
	}
	return false
}

func (c *lookupCache) shardOfString(k string) int {
	return int(maphash.String(c.seed, k) & (lookupShards - 1))
}

// entryCost estimates the heap an entry holds: the map key, the decoded
// message (its strings take about twice the encoded bytes, plus the
// structs) and the entry itself, plus what decoding adds per repeated
// part beyond its encoded bytes: a block (KeyBlock and BlockID structs
// and the slice's pointer, ~15 bytes encoded), a location, an ACL entry
// and a map entry of the S3 attributes (map buckets) each take far more
// heap than their bytes on the wire (measured: a record with 64 blocks
// held 3.5 times what 2x its size counted).
func entryCost(key []byte, size int, ki *metapb.KeyInfo) int64 {
	n := int64(2*len(key) + 2*size + 520)
	n += 120*int64(len(ki.GetBlocks())) + 80*int64(len(ki.GetAcls()))
	n += 200 * int64(len(ki.GetLocations()))
	if m := ki.GetMeta(); m != nil {
		n += 200 + 64*int64(len(m.GetUser())+len(m.GetTags())+len(m.GetChecksums())) + 80*int64(len(m.GetUploadAcls()))
	}
	return n
}

// get returns the cached record of k and the shard generation to pass to
// put after reading Pebble on a miss. The generation is loaded before the
// caller's Pebble read, as put requires. A lookup that bypasses the cache
// gets an odd generation: put keeps nothing for it.
func (c *lookupCache) get(k []byte) (e *lcEntry, gen uint64) {
	if c.off {
		return nil, 1
	}
	h := maphash.Bytes(c.seed, k)
	sh := &c.shards[h&(lookupShards-1)]
	if c.bypass.Load() && !c.sampled(h) {
		sh.skipped.Add(1)
		c.count(sh, 1)
		return nil, 1
	}
	gen = sh.gen.Load()
	sh.mu.RLock()
	e = sh.m[string(k)]
	sh.mu.RUnlock()
	if e == nil {
		sh.misses.Add(1)
		c.count(sh, 1|1<<winBits)
		return nil, gen
	}
	sh.hits.Add(1)
	c.count(sh, 1|1<<winBits|1<<(2*winBits))
	if !e.ref.Load() {
		e.ref.Store(true)
	}
	return e, gen
}

// sampled reports whether a key of hash h is kept while bypassing.
func (c *lookupCache) sampled(h uint64) bool {
	return h>>60 == c.class.Load() // the low bits choose the shard and the doorkeeper bit
}

// limit is a shard's bound now.
func (c *lookupCache) limit() int64 {
	if c.shrunk.Load() {
		return c.maxShard / bypassDiv
	}
	return c.maxShard
}

// count adds a lookup (d: 1, plus a probe, plus a hit) to sh's part of
// the window, and sh's part to the window every shardFlush lookups.
func (c *lookupCache) count(sh *lcShard, d uint64) {
	if sh.win.Add(d)&winMask != shardFlush {
		return
	}
	v := sh.win.Swap(0)
	n := c.win.Add(v)
	if n&winMask >= winLookups && (n-v)&winMask < winLookups { // this flush closed the window
		c.evaluate(c.win.Swap(0))
	}
}

// evaluate decides from a window's counts whether the cache serves every
// key or bypasses itself. On the way to bypassing it first keeps its
// entries for one window (only the sampled class is probed and filled):
// if the sampled keys hit then, it serves again with every entry still
// there (a working set read once, then again and again, looks like
// uniform lookups at first); otherwise it shrinks.
func (c *lookupCache) evaluate(v uint64) {
	c.evalMu.Lock()
	defer c.evalMu.Unlock()
	lookups, probes, hits := v&winMask, v>>winBits&winMask, v>>(2*winBits)&winMask
	if !c.bypass.Load() {
		// Keys read for the first time (under 1% hits) hit in no cache:
		// no sign yet that the working set does not fit, unless it is full.
		if b := c.bytes(); probes >= minProbes && hits*100 < probes*bypassLowPct &&
			(b >= c.maxShard*lookupShards/bypassFill && hits*100 >= probes || b >= c.maxShard*lookupShards*7/8) {
			c.held, c.prevHits, c.prevProbes = 0, hits, probes
			c.bypass.Store(true)
			c.changes.Add(1)
		}
		return
	}
	switch {
	case probes >= minProbes && hits*100 >= probes*bypassHighPct:
		c.bypass.Store(false)
		c.changes.Add(1)
		if c.shrunk.Load() {
			c.shrunk.Store(false)
			c.resize()
		}
	case !c.shrunk.Load():
		// Keys read for the first time hit in no cache: while the sampled
		// keys are hardly ever read again (under 1%), or their hit ratio
		// more than doubled since the last window (a working set is being
		// read again), hold a while longer.
		rising := hits*c.prevProbes > 2*c.prevHits*probes
		c.prevHits, c.prevProbes = hits, probes
		if c.held++; (hits*100 < probes || rising) && c.held < maxHeld {
			return
		}
		c.shrunk.Store(true)
		c.resize()
	case probes < lookups/(4*bypassDiv): // the sampled class is rarely looked up: sample another
		c.class.Store((c.class.Load() + 1) % bypassDiv)
	}
}

// bytes is the estimated heap of all entries.
func (c *lookupCache) bytes() int64 {
	var n int64
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.RLock()
		n += sh.bytes
		sh.mu.RUnlock()
	}
	return n
}

// resize applies the bound limit returns now to every shard; when the
// cache shrinks, each shard keeps only the sampled keys' entries, in a new
// map (the old one's memory, which does not shrink, goes to the
// collector).
func (c *lookupCache) resize() {
	lim := c.limit()
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		if c.shrunk.Load() {
			var kept []*lcEntry
			for _, e := range sh.slots {
				if e != nil && c.sampled(maphash.String(c.seed, e.key)) {
					kept = append(kept, e)
				}
			}
			sh.m = make(map[string]*lcEntry, len(kept))
			sh.slots, sh.free, sh.hand, sh.bytes = kept, nil, 0, 0
			for j, e := range kept {
				e.slot = j
				sh.m[e.key] = e
				sh.bytes += e.cost
			}
			for sh.bytes > lim && len(sh.m) > 0 {
				sh.evictOne()
			}
		}
		sh.full.Store(sh.bytes > lim-lim/16)
		sh.mu.Unlock()
	}
}

// put caches ki, read from Pebble at k after get returned gen, unless a
// change of the shard began since (or was under way then), or k is not
// admitted yet. It reports whether ki is now cached (shared).
func (c *lookupCache) put(k []byte, gen uint64, ki *metapb.KeyInfo, size int) bool {
	if c.off || gen&1 != 0 {
		return false
	}
	cost := entryCost(k, size, ki)
	if cost > c.limit()/4 {
		return false // a huge record would empty the shard
	}
	h := maphash.Bytes(c.seed, k)
	sh := &c.shards[h&(lookupShards-1)]
	if sh.full.Load() && !c.admit(sh, k) {
		return false
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.gen.Load() != gen {
		return false
	}
	if c.bypass.Load() && !c.sampled(h) {
		return false // the cache began bypassing since get
	}
	lim := c.limit()
	if sh.m == nil {
		sh.m = map[string]*lcEntry{}
	}
	if old := sh.m[string(k)]; old != nil {
		sh.remove(old)
	}
	for sh.bytes+cost > lim && len(sh.m) > 0 {
		sh.evictOne()
	}
	e := &lcEntry{key: string(k), ki: ki, size: size, cost: cost}
	if n := len(sh.free); n > 0 {
		e.slot = sh.free[n-1]
		sh.free = sh.free[:n-1]
		sh.slots[e.slot] = e
	} else {
		e.slot = len(sh.slots)
		sh.slots = append(sh.slots, e)
	}
	sh.m[e.key] = e
	sh.bytes += cost
	if !sh.full.Load() && sh.bytes > lim-lim/16 {
		sh.full.Store(true)
	}
	return true
}

// remove drops e (the shard's lock held).
func (sh *lcShard) remove(e *lcEntry) {
	delete(sh.m, e.key)
	sh.slots[e.slot] = nil
	sh.free = append(sh.free, e.slot)
	sh.bytes -= e.cost
}

// evictOne drops the first entry at or after the hand not hit since the
// hand last passed it (the shard holds at least one entry).
func (sh *lcShard) evictOne() {
	for {
		if sh.hand >= len(sh.slots) {
			sh.hand = 0
		}
		e := sh.slots[sh.hand]
		sh.hand++
		if e == nil {
			continue
		}
		if e.ref.Load() {
			e.ref.Store(false)
			continue
		}
		sh.remove(e)
		sh.evicted.Add(1)
		return
	}
}

// begin starts a change of keys (Pebble keys of key records): their
// shards' generations turn odd and their entries go. The caller commits,
// then calls end with the mask returned.
func (c *lookupCache) begin(keys []string) uint64 {
	// Each key is hashed once (a batch of many keys cost shards x keys
	// hashes under the shard locks); the shards of up to 64 keys are
	// kept on the stack.
	var small [64]uint8
	var shardOf []uint8
	if len(keys) <= len(small) {
		shardOf = small[:len(keys)]
	} else {
		shardOf = make([]uint8, len(keys))
	}
	var mask uint64
	for j, k := range keys {
		i := c.shardOfString(k)
		shardOf[j] = uint8(i)
		mask |= 1 << i
	}
	for i := range lookupShards {
		if mask&(1<<i) == 0 {
			continue
		}
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.gen.Add(1)
		for j, k := range keys {
			if int(shardOf[j]) == i {
				if e := sh.m[k]; e != nil {
					sh.remove(e)
				}
			}
		}
		sh.mu.Unlock()
	}
	return mask
}

// beginAll starts a change of any key (restore, bulk load): every shard
// turns odd and empties.
func (c *lookupCache) beginAll() uint64 {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.gen.Add(1)
		sh.m, sh.slots, sh.free, sh.hand = nil, nil, nil, 0
		sh.bytes = 0
		sh.full.Store(false)
		sh.mu.Unlock()
	}
	return ^uint64(0)
}

// end ends the change begin (or beginAll) started, after the commit.
func (c *lookupCache) end(mask uint64) {
	for i := range lookupShards {
		if mask&(1<<i) == 0 {
			continue
		}
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.gen.Add(1)
		sh.mu.Unlock()
	}
}

// LookupCacheStats are the decoded-record cache's counters.
type LookupCacheStats struct {
	Hits, Misses, Evictions uint64
	Skipped                 uint64 // lookups that bypassed the cache
	Entries                 int
	Bytes                   int64 // estimated heap of the entries
	MaxBytes                int64
	Bypassing               bool   // only sampled keys are probed and kept (the hit ratio was low)
	Shrunk                  bool   // bypassing, and the cache holds only sampled keys within 1/16 of its bound
	ModeChanges             uint64 // switches between serving every key and bypassing
}

func (c *lookupCache) stats() LookupCacheStats {
	st := LookupCacheStats{Bypassing: c.bypass.Load(), Shrunk: c.shrunk.Load(), ModeChanges: c.changes.Load()}
	if !c.off {
		st.MaxBytes = c.maxShard * lookupShards
	}
	for i := range c.shards {
		sh := &c.shards[i]
		st.Hits += sh.hits.Load()
		st.Misses += sh.misses.Load()
		st.Evictions += sh.evicted.Load()
		st.Skipped += sh.skipped.Load()
		sh.mu.RLock()
		st.Entries += len(sh.m)
		st.Bytes += sh.bytes
		sh.mu.RUnlock()
	}
	return st
}

// copyKeyInfo is a shallow copy of a cached record for one answer: the
// caller may set its fields (the service appends Locations) but not
// modify what they point to. TestCopyKeyInfoCopiesEveryField keeps it
// complete when KeyInfo gains a field.
func copyKeyInfo(src *metapb.KeyInfo) *metapb.KeyInfo {
	ki := &metapb.KeyInfo{
		Volume: src.Volume, Bucket: src.Bucket, Name: src.Name, Size: src.Size,
		Replication: src.Replication, ChecksumType: src.ChecksumType, BytesPerChecksum: src.BytesPerChecksum,
		CreatedUnixMs: src.CreatedUnixMs, ModifiedUnixMs: src.ModifiedUnixMs,
		Blocks: src.Blocks[:len(src.Blocks):len(src.Blocks)], ObjectId: src.ObjectId, Meta: src.Meta, Attrs: src.Attrs,
		Acls: src.Acls[:len(src.Acls):len(src.Acls)],
	}
	if len(src.Locations) > 0 {
		ki.Locations = src.Locations[:len(src.Locations):len(src.Locations)]
	}
	if u := src.ProtoReflect().GetUnknown(); len(u) > 0 {
		ki.ProtoReflect().SetUnknown(u)
	}
	return ki
}
