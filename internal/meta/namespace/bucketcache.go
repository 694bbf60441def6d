package namespace

import (
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// bucketCache keeps bucket rows for the read path: every LookupKey needs
// its bucket (ID, layout), and a Pebble point read costs as much as the
// key's own. Bucket rows change only when a bucket is created or deleted
// (or a snapshot is installed); Apply then invalidates the whole cache
// before and after committing. A reader takes the generation before it
// opens its view and caches what it read only if no invalidation happened
// since, so a row read from a state older than the cache's is never kept.
// Cached rows are shared: callers must not modify them.
type bucketCache struct {
	gen atomic.Uint64
	mu  sync.RWMutex
	m   map[bucketRef]*metapb.Bucket
}

// maxCachedBuckets bounds the cache; past it the cache starts over.
const maxCachedBuckets = 100_000

// bucketRef keys the cache (a struct: no string built per lookup).
type bucketRef struct{ volume, name string }

// generation is read before opening the view the row will be read from.
func (c *bucketCache) generation() uint64 { return c.gen.Load() }

func (c *bucketCache) invalidate() {
	c.mu.Lock()
	c.gen.Add(1)
	c.m = nil
	c.mu.Unlock()
}

// get returns the bucket from the cache or from r, caching it if gen is
// still current.
func (c *bucketCache) get(r pebble.Reader, gen uint64, volume, name string) (*metapb.Bucket, error) {
	k := bucketRef{volume, name}
	c.mu.RLock()
	b := c.m[k]
	c.mu.RUnlock()
	if b != nil {
		return b, nil
	}
	b, err := readBucket(r, volume, name)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.gen.Load() == gen {
		if c.m == nil || len(c.m) >= maxCachedBuckets {
			c.m = map[bucketRef]*metapb.Bucket{}
		}
		c.m[k] = b
	}
	c.mu.Unlock()
	return b, nil
}
