package namespace

import (
	"bytes"
	"slices"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// applyCache keeps, for Apply alone, the encoded values of the rows every
// small PUT reads while it applies: its bucket's row (b/, read by OpenKey
// and CommitKey) and its open-key row (o/, written by OpenKey, read and
// deleted by CommitKey). A hit costs a map lookup instead of a Pebble
// point read through the batch, the memtables and the levels.
//
// Apply runs on one goroutine and is the only writer of the namespace
// rows, so the cache can be exact: every write of a cached table goes
// through tx.put or tx.del, which update the cache as they add the write
// to the batch (and the batch's reads see the batch, so both agree within
// one Apply too); a restore or a bulk load drops it. A hit returns the
// same bytes Pebble would, and the caller decodes them into a fresh
// message, so no caller shares or changes a cached row. Readers never see
// it (they have their own caches, bucketcache.go and lookupcache.go).
//
// Only rows found are cached (a miss still reads Pebble). Bucket rows are
// cached when written or read; open-key rows only when written (one is
// read once, by its commit). Each table is bounded in bytes (and bucket
// rows in count): past its bound it starts over; a row over a sixteenth
// of its table's bound is not cached.
type applyCache struct {
	buckets map[string][]byte
	opens   map[string][]byte
	// bbytes and obytes are the bytes buckets and opens hold (keys,
	// values and a map entry's overhead), each kept within its bound.
	bbytes, obytes int
	// decoded holds bucket rows decoded, for the callers that only read
	// them (tx.bucketRO): dropped with the row's entry in buckets.
	decoded map[bucketRef]*metapb.Bucket
	// hits counts the reads served (tests); off turns the cache off
	// (tests: a replay without it must give the same results and rows).
	hits uint64
	off  bool
}

const (
	maxApplyCachedBuckets = 10_000
	// maxApplyCachedBucketBytes bounds the encoded bucket rows (a row
	// with a large policy is tens of KiB); their decoded copies are only
	// kept while the row is (dropDecoded), at most one per row.
	maxApplyCachedBucketBytes = 16 << 20
	// maxApplyCachedOpenBytes is a few seconds of small PUTs' open keys
	// (an open key is deleted from the cache when it commits or
	// expires); bytes, not rows: a row grows with its key's name and
	// blocks (AddBlock), so a count would bound nothing.
	maxApplyCachedOpenBytes = 32 << 20
	// applyCacheEntryOverhead is a map entry's own cost beyond its key
	// and value bytes (the string and slice headers, the bucket slot).
	applyCacheEntryOverhead = 64
)

func applyCacheEntryBytes(k string, v []byte) int {
	return len(k) + cap(v) + applyCacheEntryOverhead
}

// counter returns the byte count and bound of table t.
func (c *applyCache) counter(t *map[string][]byte) (*int, int) {
	if t == &c.opens {
		return &c.obytes, maxApplyCachedOpenBytes
	}
	return &c.bbytes, maxApplyCachedBucketBytes
}

// table returns the map that caches k, nil if k's table is not cached.
func (c *applyCache) table(k []byte) *map[string][]byte {
	switch {
	case c.off:
		return nil
	case bytes.HasPrefix(k, pfxOpen):
		return &c.opens
	case bytes.HasPrefix(k, pfxBucket):
		return &c.buckets
	}
	return nil
}

func (c *applyCache) get(k []byte) ([]byte, bool) {
	if t := c.table(k); t != nil {
		v, ok := (*t)[string(k)]
		if ok {
			c.hits++
		}
		return v, ok
	}
	return nil, false
}

// set records that k now holds v (v is not changed afterwards).
func (c *applyCache) set(k, v []byte) {
	t := c.table(k)
	if t == nil {
		return
	}
	n, bound := c.counter(t)
	ks := string(k)
	if old, ok := (*t)[ks]; ok {
		*n -= applyCacheEntryBytes(ks, old)
	}
	add := applyCacheEntryBytes(ks, v)
	if add > bound/16 {
		// A row this large would crowd out the rest: not cached (a
		// read finds it in Pebble).
		c.del(k)
		return
	}
	if *t == nil || *n+add > bound || (t == &c.buckets && len(*t) >= maxApplyCachedBuckets) {
		*t, *n = make(map[string][]byte), 0
		if t == &c.buckets {
			c.decoded = nil
		}
	}
	(*t)[ks] = v
	*n += add
	if t == &c.buckets {
		c.dropDecoded(k)
	}
}

// dropDecoded drops the decoded row of bucket key k.
func (c *applyCache) dropDecoded(k []byte) {
	if len(c.decoded) == 0 {
		return
	}
	vol, name, ok := bytes.Cut(k[len(pfxBucket):], []byte{0})
	if !ok {
		c.decoded = nil // (no such bucket key is written)
		return
	}
	delete(c.decoded, bucketRef{string(vol), string(name)})
}

// bucket returns the decoded row of a bucket, nil if not cached.
func (c *applyCache) bucket(volume, name string) *metapb.Bucket {
	b := c.decoded[bucketRef{volume, name}]
	if b != nil {
		c.hits++
	}
	return b
}

// keepBucket caches b, just read by tx.bucket (so its row is in buckets
// or was read from the batch).
func (c *applyCache) keepBucket(volume, name string, b *metapb.Bucket) {
	if c.off {
		return
	}
	if c.decoded == nil || len(c.decoded) >= maxApplyCachedBuckets {
		c.decoded = make(map[bucketRef]*metapb.Bucket)
	}
	c.decoded[bucketRef{volume, name}] = b
}

// fill caches a bucket row read from Pebble (v is Pebble's, so copied).
func (c *applyCache) fill(k, v []byte) {
	if bytes.HasPrefix(k, pfxBucket) {
		c.set(k, slices.Clone(v))
	}
}

func (c *applyCache) del(k []byte) {
	if t := c.table(k); t != nil {
		ks := string(k)
		if old, ok := (*t)[ks]; ok {
			n, _ := c.counter(t)
			*n -= applyCacheEntryBytes(ks, old)
			delete(*t, ks)
		}
		if t == &c.buckets {
			c.dropDecoded(k)
		}
	}
}

// reset drops everything (restore, bulk load).
func (c *applyCache) reset() {
	c.buckets, c.opens, c.decoded = nil, nil, nil
	c.bbytes, c.obytes = 0, 0
}
