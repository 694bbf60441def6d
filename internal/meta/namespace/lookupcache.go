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
// evicts with a CLOCK-like rule (an entry hit since the last pass gets a
// second chance). A shard's lock is taken shared on a hit.
type lookupCache struct {
	off      bool
	maxShard int64 // bytes per shard
	seed     maphash.Seed
	shards   [lookupShards]lcShard
}

// lookupShards is a power of two and at most 64 (a change set is a
// uint64 mask of shards).
const lookupShards = 64

// DefaultLookupCacheBytes is the default bound of the decoded-record
// cache of one meta node.
const DefaultLookupCacheBytes = 128 << 20

type lcShard struct {
	mu      sync.RWMutex
	gen     atomic.Uint64 // odd while a change of this shard's keys commits
	m       map[string]*lcEntry
	bytes   int64
	hits    atomic.Uint64
	misses  atomic.Uint64
	evicted atomic.Uint64
	_       [64]byte // keep shards' hot words on their own cache lines
}

type lcEntry struct {
	ki   *metapb.KeyInfo // shared, never modified
	size int             // the stored record's length
	cost int64
	ref  atomic.Bool // hit since the last eviction pass
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

func (c *lookupCache) shardOfString(k string) int {
	return int(maphash.String(c.seed, k) & (lookupShards - 1))
}

// entryCost estimates the heap an entry holds: the map key, the decoded
// message (its strings and sub-messages take about twice the encoded
// bytes, plus the structs) and the entry itself.
func entryCost(key []byte, size int) int64 {
	return int64(2*len(key) + 2*size + 520)
}

// get returns the cached record of k and the shard generation to pass to
// put after reading Pebble on a miss. The generation is loaded before the
// caller's Pebble read, as put requires.
func (c *lookupCache) get(k []byte) (e *lcEntry, gen uint64) {
	if c.off {
		return nil, 1
	}
	sh := &c.shards[c.shardOf(k)]
	gen = sh.gen.Load()
	sh.mu.RLock()
	e = sh.m[string(k)]
	sh.mu.RUnlock()
	if e == nil {
		sh.misses.Add(1)
		return nil, gen
	}
	sh.hits.Add(1)
	if !e.ref.Load() {
		e.ref.Store(true)
	}
	return e, gen
}

// put caches ki, read from Pebble at k after get returned gen, unless a
// change of the shard began since (or was under way then).
func (c *lookupCache) put(k []byte, gen uint64, ki *metapb.KeyInfo, size int) {
	if c.off || gen&1 != 0 {
		return
	}
	cost := entryCost(k, size)
	if cost > c.maxShard/4 {
		return // a huge record would empty the shard
	}
	sh := &c.shards[c.shardOf(k)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.gen.Load() != gen {
		return
	}
	if sh.m == nil {
		sh.m = map[string]*lcEntry{}
	}
	if old := sh.m[string(k)]; old != nil {
		sh.bytes -= old.cost
		delete(sh.m, string(k))
	}
	for sh.bytes+cost > c.maxShard && len(sh.m) > 0 {
		sh.evictOne()
	}
	sh.m[string(k)] = &lcEntry{ki: ki, size: size, cost: cost}
	sh.bytes += cost
}

// evictOne drops one entry, preferring one not hit since the last pass
// (map iteration starts at a random entry).
func (sh *lcShard) evictOne() {
	spared := 0
	for k, e := range sh.m {
		if e.ref.Load() && spared < 8 {
			e.ref.Store(false)
			spared++
			continue
		}
		delete(sh.m, k)
		sh.bytes -= e.cost
		sh.evicted.Add(1)
		return
	}
}

// begin starts a change of keys (Pebble keys of key records): their
// shards' generations turn odd and their entries go. The caller commits,
// then calls end with the mask returned.
func (c *lookupCache) begin(keys []string) uint64 {
	var mask uint64
	for _, k := range keys {
		mask |= 1 << c.shardOfString(k)
	}
	for i := range lookupShards {
		if mask&(1<<i) == 0 {
			continue
		}
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.gen.Add(1)
		for _, k := range keys {
			if c.shardOfString(k) == i {
				if e := sh.m[k]; e != nil {
					sh.bytes -= e.cost
					delete(sh.m, k)
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
		sh.m = nil
		sh.bytes = 0
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
	Entries                 int
	Bytes                   int64 // estimated heap of the entries
	MaxBytes                int64
}

func (c *lookupCache) stats() LookupCacheStats {
	st := LookupCacheStats{}
	if !c.off {
		st.MaxBytes = c.maxShard * lookupShards
	}
	for i := range c.shards {
		sh := &c.shards[i]
		st.Hits += sh.hits.Load()
		st.Misses += sh.misses.Load()
		st.Evictions += sh.evicted.Load()
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
