package namespace

import (
	"bytes"
	"encoding/binary"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"unsafe"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/keyrec"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// lookupCache keeps the encoded key records of object buckets (the bytes
// Pebble holds) for the read path (LookupKey, LookupKeys, a key's own ACL
// in authorization): a hit costs a map probe and a decode (decodeRecord,
// keyrec.Decode: one allocation for a plain record, five for a small S3
// object's) instead of a Pebble Get and an unmarshal.
//
// Memory. Each of lookupShards shards keeps its records in an arena of
// equal []byte chunks used as a ring (a log: records are appended at the
// head; when the shard is at its bound the oldest chunk is reclaimed) and
// an index map[uint64]uint32 from the key's hash to the record's place.
// Neither holds a pointer, so a full cache costs the garbage collector
// nothing to mark. An entry costs its key and value, a 10-byte header
// and its share of the index (lcIndexCost); the bound (maxBytes) counts
// the chunks allocated plus the index at its high-water mark (a Go map
// never shrinks: an index grown by many small records keeps its size when
// fewer large ones replace them, until it is rebuilt smaller, see
// compact). When the index grows into the chunks' share (records turn
// smaller), the oldest chunk is released. Hashes collide, so
// the key is stored beside the value and compared on a hit; a colliding
// key replaces the other's entry (a cache may drop entries).
//
// Eviction: when the head moves on to a chunk that is in use, its
// entries leave the index, except those hit since they were written
// (a reference bit in the header, set on a hit), which are copied to the
// chunk's start once more with the bit cleared (a second chance, as
// CLOCK's), up to half the chunk: one insert reclaims at most one chunk
// (the shard's lock is exclusive meanwhile). Every miss is admitted.
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
// Eviction only drops entries or moves a live entry's bytes unchanged
// (under the shard's lock), so it cannot make a lookup stale.
//
// Every hit decodes a new record, which the caller owns and may modify.
type lookupCache struct {
	off      bool
	maxShard int64 // bytes per shard
	chunk    int   // bytes per arena chunk; the largest entry kept
	seed     maphash.Seed

	shards [lookupShards]lcShard
}

// lookupShards is a power of two and at most 64 (a change set is a
// uint64 mask of shards).
const lookupShards = 64

// DefaultLookupCacheBytes is the default bound of the lookup cache of
// one meta node.
const DefaultLookupCacheBytes = 128 << 20

// The arena's layout. An entry at a 4-aligned offset of a chunk: ref
// (uint32, 1 if hit since written, set atomically under the read lock),
// key length (uint16), value length (uint32, unaligned), key, value,
// padding to 4. A place in the index is chunk<<lcOffBits | offset.
const (
	lcHeader    = 10
	lcOffBits   = 20
	lcMaxChunk  = 1 << lcOffBits // a chunk's offsets fit lcOffBits
	lcMinChunk  = 4 << 10
	lcMaxChunks = 1 << (32 - lcOffBits)
	// lcIndexCost is an entry's share of the index at its high-water
	// mark: a map[uint64]uint32 slot is 16 bytes in groups of 8 with a
	// control word (17 bytes), at a load between 7/16 and 7/8 after
	// growth (19-39 bytes per entry). Measured (Go 1.26, maps of 500 to
	// 40,000 entries, the sizes of a shard's index): 24.6-37.0 B.
	lcIndexCost = 36
)

type lcShard struct {
	mu  sync.RWMutex
	gen atomic.Uint64 // odd while a change of this shard's keys commits
	idx map[uint64]uint32
	// chunks is the ring (a released chunk is nil); head is the chunk
	// being filled, fill[i] the end of chunk i's entries; nalloc counts
	// the chunks allocated.
	chunks [][]byte
	fill   []int
	head   int
	nalloc int
	// peak is len(idx)'s high-water mark since idx was made: the map
	// holds the memory of that many entries.
	peak    int
	work    int64 // bytes of chunks reclaim and release scanned (for tests)
	hits    atomic.Uint64
	misses  atomic.Uint64
	evicted atomic.Uint64
	_       [64]byte // keep shards' hot words on their own cache lines
}

func newLookupCache(maxBytes int64) *lookupCache {
	c := &lookupCache{seed: maphash.MakeSeed()}
	c.setMax(maxBytes)
	return c
}

// setMax sets the bound (0: the default; negative: no cache). Call it
// before the cache serves (and holds anything).
func (c *lookupCache) setMax(maxBytes int64) {
	if maxBytes == 0 {
		maxBytes = DefaultLookupCacheBytes
	}
	c.off = maxBytes < 0
	c.maxShard = min(maxBytes/lookupShards, lcMaxChunk*(lcMaxChunks-1))
	// 16 chunks per shard (up to 1 MiB each), so a reclaim drops at most
	// a sixteenth, and the bound is used to within a chunk.
	ch := min(max(int(c.maxShard/16), lcMinChunk), lcMaxChunk) &^ 7
	if int64(ch) > c.maxShard/2 {
		ch = int(c.maxShard/2) &^ 7 // a tiny bound: two chunks
	}
	c.chunk = ch
}

func lcSize(klen, vlen int) int { return (lcHeader + klen + vlen + 3) &^ 3 }

func lcRef(ch []byte, off int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&ch[off]))
}

// entryAt returns the key and value of the entry at off in ch.
func entryAt(ch []byte, off int) (key, val []byte, size int) {
	kl := int(binary.LittleEndian.Uint16(ch[off+4:]))
	vl := int(binary.LittleEndian.Uint32(ch[off+6:]))
	k := off + lcHeader
	return ch[k : k+kl], ch[k+kl : k+kl+vl], lcSize(kl, vl)
}

// recordNames are strings a record read at a key likely holds (its
// volume, bucket and name): a decoded record's equal strings are these,
// not copies.
type recordNames struct{ volume, bucket, name string }

// get returns the record cached for k, decoded (the caller owns it), with
// its encoded length, or nil and the shard generation to pass to put
// after reading Pebble. The generation is loaded before the caller's
// Pebble read, as put requires.
func (c *lookupCache) get(k []byte, names recordNames) (ki *metapb.KeyInfo, size int, gen uint64) {
	if c.off {
		return nil, 0, 1
	}
	h := maphash.Bytes(c.seed, k)
	sh := &c.shards[h&(lookupShards-1)]
	gen = sh.gen.Load()
	var rich []byte
	sh.mu.RLock()
	if loc, ok := sh.idx[h]; ok {
		ch, off := sh.chunks[loc>>lcOffBits], int(loc&(lcMaxChunk-1))
		if key, val, _ := entryAt(ch, off); string(key) == string(k) {
			size = len(val)
			// A record keyrec decodes itself (a plain key's, or an S3
			// object's with its attributes: a UTF-8 scan, one copy of
			// the attributes' strings and up to three maps) is decoded
			// here, under the shard's read lock (its strings copied out of
			// the arena, which put may reuse); any other is unmarshalled
			// after the lock (from a copy of its bytes). Readers share the
			// lock; only put waits for the decode.
			var own bool
			if ki, own = decodeOwn(val, names); !own {
				rich = bytes.Clone(val)
			}
			if r := lcRef(ch, off); r.Load() == 0 {
				r.Store(1)
			}
		}
	}
	sh.mu.RUnlock()
	if rich != nil {
		ki = &metapb.KeyInfo{}
		if proto.Unmarshal(rich, ki) != nil { // it did when it was read: not reached
			ki = nil
		}
	}
	if ki == nil {
		sh.misses.Add(1)
		return nil, 0, gen
	}
	sh.hits.Add(1)
	return ki, size, gen
}

// put caches v, the record read from Pebble at k after get returned gen,
// unless a change of the shard began since (or was under way then). It
// copies v (the caller may release it).
func (c *lookupCache) put(k []byte, gen uint64, v []byte) {
	if c.off || gen&1 != 0 || len(v) == 0 || len(k) > 0xffff {
		return
	}
	n := lcSize(len(k), len(v))
	if n > c.chunk {
		return // a huge record would crowd out many
	}
	h := maphash.Bytes(c.seed, k)
	sh := &c.shards[h&(lookupShards-1)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.gen.Load() != gen {
		return
	}
	if sh.idx == nil {
		sh.idx = map[uint64]uint32{}
	}
	if !sh.room(c, n) {
		return
	}
	ch, off := sh.chunks[sh.head], sh.fill[sh.head]
	clear(ch[off : off+4])
	binary.LittleEndian.PutUint16(ch[off+4:], uint16(len(k)))
	binary.LittleEndian.PutUint32(ch[off+6:], uint32(len(v)))
	copy(ch[off+lcHeader:], k)
	copy(ch[off+lcHeader+len(k):], v)
	sh.fill[sh.head] = off + n
	sh.idx[h] = uint32(sh.head)<<lcOffBits | uint32(off)
	sh.peak = max(sh.peak, len(sh.idx))
}

// bytes is what the shard counts against its bound with extra more
// entries in its index: the chunks allocated and the index at its
// high-water mark.
func (sh *lcShard) bytes(c *lookupCache, extra int) int64 {
	return int64(sh.nalloc*c.chunk) + int64(max(sh.peak, len(sh.idx)+extra))*lcIndexCost
}

// next is the chunk after i in the ring (skipping released ones), i if
// it is the only one.
func (sh *lcShard) next(i int) int {
	for range len(sh.chunks) {
		i = (i + 1) % len(sh.chunks)
		if sh.chunks[i] != nil {
			break
		}
	}
	return i
}

// room makes room for an entry of n bytes at the head chunk's end within
// the bound (the lock held): it moves the head on (a new chunk while the
// bound allows, else the next one reclaimed) until the entry fits. The
// work is bounded (the lock is exclusive): at most one reclaim, which
// frees at least half the chunk, and a release or two.
func (sh *lcShard) room(c *lookupCache, n int) bool {
	reclaimed := false
	for range 4 {
		over := sh.bytes(c, 1) - c.maxShard
		if over > 0 && sh.nalloc > 1 {
			// The index grew into the chunks' share (smaller records
			// than before): release the oldest chunk.
			sh.release(c, sh.next(sh.head))
			continue
		}
		if sh.nalloc > 0 && sh.fill[sh.head]+n <= c.chunk && over <= 0 {
			return true
		}
		if over+int64(c.chunk) <= 0 {
			// A new chunk, in a released one's place if any.
			i := len(sh.chunks)
			for j, ch := range sh.chunks {
				if ch == nil {
					i = j
					break
				}
			}
			if i == len(sh.chunks) {
				if i == lcMaxChunks {
					return false
				}
				sh.chunks = append(sh.chunks, nil)
				sh.fill = append(sh.fill, 0)
			}
			sh.chunks[i], sh.fill[i] = make([]byte, c.chunk), 0
			sh.nalloc++
			sh.head = i
			continue
		}
		if sh.nalloc == 0 || reclaimed {
			return false
		}
		sh.head = sh.next(sh.head)
		sh.reclaim(c, sh.head, min(c.chunk/2, c.chunk-n))
		reclaimed = true
	}
	return false
}

// release drops chunk i and its entries (the lock held).
func (sh *lcShard) release(c *lookupCache, i int) {
	ch := sh.chunks[i]
	sh.work += int64(sh.fill[i])
	for off := 0; off < sh.fill[i]; {
		key, _, size := entryAt(ch, off)
		h := maphash.Bytes(c.seed, key)
		if loc, ok := sh.idx[h]; ok && loc == uint32(i)<<lcOffBits|uint32(off) {
			delete(sh.idx, h)
			sh.evicted.Add(1)
		}
		off += size
	}
	sh.chunks[i], sh.fill[i] = nil, 0
	sh.nalloc--
	if sh.head == i {
		sh.head = sh.next(i)
	}
	sh.compact()
}

// compact rebuilds the index into a map of its size when it holds less
// than half its high-water mark (a Go map keeps the memory of its peak),
// so that the chunks can use the memory it gives back.
func (sh *lcShard) compact() {
	if sh.peak < 256 || len(sh.idx) >= sh.peak/2 {
		return
	}
	m := make(map[uint64]uint32, len(sh.idx))
	for h, loc := range sh.idx {
		m[h] = loc
	}
	sh.idx, sh.peak = m, len(m)
}

// reclaim empties chunk i for reuse (the lock held): its live entries
// leave the index, but those hit since written move to its start (in
// place, in order: an entry moves to where entries before it were), their
// reference bits cleared, up to keep bytes (so a reclaim always frees
// room: when every entry was hit, the later ones go). An entry kept
// moves once per round of the ring and is dropped the next unless hit
// again.
func (sh *lcShard) reclaim(c *lookupCache, i, keep int) {
	ch, w := sh.chunks[i], 0
	sh.work += int64(sh.fill[i])
	for off := 0; off < sh.fill[i]; {
		key, _, size := entryAt(ch, off)
		h := maphash.Bytes(c.seed, key)
		if loc, ok := sh.idx[h]; ok && loc == uint32(i)<<lcOffBits|uint32(off) {
			if lcRef(ch, off).Load() != 0 && w+size <= keep {
				copy(ch[w:], ch[off:off+size])
				clear(ch[w : w+4])
				sh.idx[h] = uint32(i)<<lcOffBits | uint32(w)
				w += size
			} else {
				delete(sh.idx, h)
				sh.evicted.Add(1)
			}
		}
		off += size
	}
	sh.fill[i] = w
	sh.compact()
}

// begin starts a change of keys (Pebble keys of key records): their
// shards' generations turn odd and their entries go. The caller commits,
// then calls end with the mask returned.
func (c *lookupCache) begin(keys []string) uint64 {
	// Each key is hashed once (a batch of many keys cost shards x keys
	// hashes under the shard locks); the hashes of up to 64 keys are
	// kept on the stack.
	var small [64]uint64
	var hs []uint64
	if len(keys) <= len(small) {
		hs = small[:len(keys)]
	} else {
		hs = make([]uint64, len(keys))
	}
	var mask uint64
	for j, k := range keys {
		h := maphash.String(c.seed, k)
		hs[j] = h
		mask |= 1 << (h & (lookupShards - 1))
	}
	for i := range uint64(lookupShards) {
		if mask&(1<<i) == 0 {
			continue
		}
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.gen.Add(1)
		for _, h := range hs {
			if h&(lookupShards-1) == i {
				// A colliding key's entry goes too: harmless.
				delete(sh.idx, h)
			}
		}
		sh.mu.Unlock()
	}
	return mask
}

// beginAll starts a change of any key (restore, bulk load): every shard
// turns odd and empties (its memory is freed).
func (c *lookupCache) beginAll() uint64 {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.gen.Add(1)
		sh.idx, sh.chunks, sh.fill, sh.head, sh.nalloc, sh.peak = nil, nil, nil, 0, 0, 0
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

// LookupCacheStats are the lookup cache's counters.
type LookupCacheStats struct {
	Hits, Misses, Evictions uint64
	Entries                 int
	Bytes                   int64 // the arena's chunks plus the index's estimate at its high-water mark
	MaxBytes                int64
}

func (c *lookupCache) stats() LookupCacheStats {
	var st LookupCacheStats
	if !c.off {
		st.MaxBytes = c.maxShard * lookupShards
	}
	for i := range c.shards {
		sh := &c.shards[i]
		st.Hits += sh.hits.Load()
		st.Misses += sh.misses.Load()
		st.Evictions += sh.evicted.Load()
		sh.mu.RLock()
		st.Entries += len(sh.idx)
		st.Bytes += sh.bytes(c, 0)
		sh.mu.RUnlock()
	}
	return st
}

// decodeRecord is keyrec.Decode (kept here for the cache's tests).
func decodeRecord(b []byte, names recordNames) (*metapb.KeyInfo, error) {
	return keyrec.Decode(b, names.keyrec())
}

// decodeOwn is keyrec.DecodeOwn: the record decoded if keyrec decodes
// its shape itself, false otherwise.
func decodeOwn(b []byte, names recordNames) (*metapb.KeyInfo, bool) {
	return keyrec.DecodeOwn(b, names.keyrec())
}

func (n recordNames) keyrec() keyrec.Names {
	return keyrec.Names{Volume: n.volume, Bucket: n.bucket, Name: n.name}
}
