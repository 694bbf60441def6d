package scm

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Centralized cache management, replicated part (docs/CACHE.md): cache
// pools ("cp/<name>") and cache directives ("cd/<id>"), both mirrored in
// memory. The leader's monitor (cache_monitor.go) turns them into cache
// and uncache commands.
var (
	pfxCachePool = []byte("cp/")
	pfxCacheDir  = []byte("cd/")
	keyNextCache = []byte("m/next_cache_directive")
)

// Bounds on cache definitions.
const (
	MaxCachePools      = 1000
	MaxCacheDirectives = 10000
	maxCacheName       = 128
	maxCachePath       = 1024
)

type cacheDefs struct {
	pools map[string]*metapb.CachePool
	dirs  map[uint64]*metapb.CacheDirective
	next  uint64
}

func poolKey(name string) []byte { return append(append([]byte(nil), pfxCachePool...), name...) }

// loadCache loads pools and directives (caller holds mu).
func (s *State) loadCache(r pebble.Reader) error {
	s.cache = cacheDefs{pools: map[string]*metapb.CachePool{}, dirs: map[uint64]*metapb.CacheDirective{}, next: 1}
	v, closer, err := r.Get(keyNextCache)
	switch {
	case err == nil:
		s.cache.next = decodeU64(v)
		closer.Close()
	case !errors.Is(err, pebble.ErrNotFound):
		return err
	}
	if err := store.Scan(r, pfxCachePool, func(_, v []byte) error {
		p := &metapb.CachePool{}
		if err := proto.Unmarshal(v, p); err != nil {
			return err
		}
		s.cache.pools[p.Name] = p
		return nil
	}); err != nil {
		return err
	}
	return store.Scan(r, pfxCacheDir, func(_, v []byte) error {
		d := &metapb.CacheDirective{}
		if err := proto.Unmarshal(v, d); err != nil {
			return err
		}
		s.cache.dirs[d.Id] = d
		return nil
	})
}

// ValidateCachePool checks a pool definition (before proposing, and again
// in Apply).
func ValidateCachePool(p *metapb.CachePool) error {
	if p == nil {
		return status.Error(codes.InvalidArgument, "cache pool: missing")
	}
	if p.Name == "" || len(p.Name) > maxCacheName || strings.ContainsAny(p.Name, "/ \t\n") {
		return status.Errorf(codes.InvalidArgument, "cache pool name %q: want 1..%d characters without '/' or spaces", clipName(p.Name), maxCacheName)
	}
	if len(p.Owner) > maxCacheName {
		return status.Errorf(codes.InvalidArgument, "cache pool %s: owner longer than %d bytes", p.Name, maxCacheName)
	}
	if p.MaxTtlMs < 0 {
		return status.Errorf(codes.InvalidArgument, "cache pool %s: negative max TTL", p.Name)
	}
	if len(p.Group) > maxCacheName {
		return status.Errorf(codes.InvalidArgument, "cache pool %s: group longer than %d bytes", p.Name, maxCacheName)
	}
	if p.Mode > 0o777 {
		return status.Errorf(codes.InvalidArgument, "cache pool %s: mode %#o, want at most 0777", p.Name, p.Mode)
	}
	return nil
}

// DefaultCachePoolMode is the mode of a pool created without one (HDFS's
// default): only the owner (and admins) may change its directives.
const DefaultCachePoolMode = 0o755

// PoolMode is p's mode, the default if none was recorded.
func PoolMode(p *metapb.CachePool) uint32 {
	if p.Mode == 0 {
		return DefaultCachePoolMode
	}
	return p.Mode
}

// CanWritePool reports whether user may add, modify or remove directives
// in p (admins are not asked): the owner by the owner bits, anyone else by
// the "other" bits. Group bits grant nothing: there is no group
// membership service (as in the namespace's Authorizer).
func CanWritePool(p *metapb.CachePool, user string) bool {
	m := PoolMode(p)
	if user != "" && user == p.Owner {
		return m&0o200 != 0
	}
	return m&0o002 != 0
}

func clipName(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// ValidateCacheDirective checks the parts of a directive that need no
// state: path, replication, TTL.
func ValidateCacheDirective(d *metapb.CacheDirective) error {
	if d == nil {
		return status.Error(codes.InvalidArgument, "cache directive: missing")
	}
	if d.Volume == "" || d.Bucket == "" {
		return status.Errorf(codes.InvalidArgument, "cache directive: path must name a volume and a bucket (/volume/bucket[/key-or-prefix]), got volume %q bucket %q", clipName(d.Volume), clipName(d.Bucket))
	}
	if len(d.Volume) > maxCacheName || len(d.Bucket) > maxCacheName || len(d.Path) > maxCachePath {
		return status.Errorf(codes.InvalidArgument, "cache directive: path too long")
	}
	if d.Replication < 1 || d.Replication > 3 {
		return status.Errorf(codes.InvalidArgument, "cache directive: replication %d, want 1..3", d.Replication)
	}
	if d.TtlMs < 0 {
		return status.Error(codes.InvalidArgument, "cache directive: negative TTL")
	}
	if d.Pool == "" {
		return status.Error(codes.InvalidArgument, "cache directive: pool is required")
	}
	return nil
}

// applyCachePool adds, modifies or removes a pool.
func (s *State) applyCachePool(b *pebble.Batch, op *metapb.CachePoolOp) any {
	p := op.GetPool()
	if err := ValidateCachePool(p); err != nil {
		return err
	}
	old := s.cache.pools[p.Name]
	switch {
	case op.Remove:
		if old == nil {
			return status.Errorf(codes.NotFound, "cache pool %s not found", p.Name)
		}
		for id, d := range s.cache.dirs {
			if d.Pool == p.Name {
				delete(s.cache.dirs, id)
				if err := b.Delete(key(pfxCacheDir, id), nil); err != nil {
					panic(err)
				}
			}
		}
		delete(s.cache.pools, p.Name)
		if err := b.Delete(poolKey(p.Name), nil); err != nil {
			panic(err)
		}
		return nil
	case op.Create:
		if old != nil {
			return status.Errorf(codes.AlreadyExists, "cache pool %s already exists", p.Name)
		}
		if len(s.cache.pools) >= MaxCachePools {
			return status.Errorf(codes.ResourceExhausted, "cache pools: at most %d", MaxCachePools)
		}
		n := &metapb.CachePool{Name: p.Name, Owner: p.Owner, LimitBytes: p.LimitBytes, MaxTtlMs: p.MaxTtlMs, Group: p.Group, Mode: p.Mode}
		s.cache.pools[n.Name] = n
		s.put(b, poolKey(n.Name), n)
		return proto.Clone(n)
	default:
		if old == nil {
			return status.Errorf(codes.NotFound, "cache pool %s not found", p.Name)
		}
		n := proto.Clone(old).(*metapb.CachePool)
		if p.SetOwner {
			n.Owner = p.Owner
		}
		if p.SetLimit {
			n.LimitBytes = p.LimitBytes
		}
		if p.SetMaxTtl {
			n.MaxTtlMs = p.MaxTtlMs
		}
		if p.SetGroup {
			n.Group = p.Group
		}
		if p.SetMode {
			n.Mode = p.Mode
		}
		s.cache.pools[n.Name] = n
		s.put(b, poolKey(n.Name), n)
		return proto.Clone(n)
	}
}

// applyCacheDirective adds (id 0), modifies or removes a directive. The
// expiry is computed here from the proposer's clock (now).
func (s *State) applyCacheDirective(b *pebble.Batch, op *metapb.CacheDirectiveOp, now int64) any {
	d := op.GetDirective()
	if d == nil {
		return status.Error(codes.InvalidArgument, "cache directive: missing")
	}
	if op.Remove {
		if s.cache.dirs[d.Id] == nil {
			return status.Errorf(codes.NotFound, "cache directive %d not found", d.Id)
		}
		delete(s.cache.dirs, d.Id)
		if err := b.Delete(key(pfxCacheDir, d.Id), nil); err != nil {
			panic(err)
		}
		return nil
	}
	var n *metapb.CacheDirective
	if d.Id == 0 {
		if err := ValidateCacheDirective(d); err != nil {
			return err
		}
		if len(s.cache.dirs) >= MaxCacheDirectives {
			return status.Errorf(codes.ResourceExhausted, "cache directives: at most %d", MaxCacheDirectives)
		}
		n = &metapb.CacheDirective{Id: s.cache.next, Volume: d.Volume, Bucket: d.Bucket, Path: d.Path, Prefix: d.Prefix,
			Replication: d.Replication, Pool: d.Pool, TtlMs: d.TtlMs, CreatedUnixMs: now}
		s.cache.next++
		s.putU64(b, keyNextCache, s.cache.next)
	} else {
		old := s.cache.dirs[d.Id]
		if old == nil {
			return status.Errorf(codes.NotFound, "cache directive %d not found", d.Id)
		}
		n = proto.Clone(old).(*metapb.CacheDirective)
		if d.SetReplication {
			n.Replication = d.Replication
		}
		if d.SetPool {
			n.Pool = d.Pool
		}
		if d.SetTtl {
			n.TtlMs = d.TtlMs
		}
		if err := ValidateCacheDirective(n); err != nil {
			return err
		}
	}
	pool := s.cache.pools[n.Pool]
	if pool == nil {
		return status.Errorf(codes.NotFound, "cache directive: pool %s not found", n.Pool)
	}
	ttl := n.TtlMs
	if pool.MaxTtlMs > 0 {
		if ttl > pool.MaxTtlMs {
			return status.Errorf(codes.InvalidArgument, "cache directive: TTL %dms exceeds pool %s's maximum %dms", ttl, pool.Name, pool.MaxTtlMs)
		}
		if ttl == 0 {
			ttl = pool.MaxTtlMs
		}
	}
	// The expiry counts from the add, or from a change of TTL or pool; a
	// change of replication alone keeps it.
	if d.Id == 0 || d.SetTtl || d.SetPool {
		n.ExpiryUnixMs = 0
		if ttl > 0 {
			n.ExpiryUnixMs = now + ttl
		}
	}
	s.cache.dirs[n.Id] = n
	s.put(b, key(pfxCacheDir, n.Id), n)
	return proto.Clone(n)
}

// CachePool returns a pool (shared, do not modify) or nil.
func (s *State) CachePool(name string) *metapb.CachePool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.cache.pools[name]
}

// CachePools returns the pools sorted by name (shared, do not modify).
func (s *State) CachePools() []*metapb.CachePool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.CachePool, 0, len(s.cache.pools))
	for _, p := range s.cache.pools {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// CacheDirective returns a directive (shared, do not modify) or nil.
func (s *State) CacheDirective(id uint64) *metapb.CacheDirective {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.cache.dirs[id]
}

// CacheDirectives returns the directives sorted by ID (shared, do not
// modify).
func (s *State) CacheDirectives() []*metapb.CacheDirective {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.CacheDirective, 0, len(s.cache.dirs))
	for _, d := range s.cache.dirs {
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b *metapb.CacheDirective) int { return cmpU(a.Id, b.Id) })
	return out
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// DirectivePath renders a directive's path as /volume/bucket/path.
func DirectivePath(d *metapb.CacheDirective) string {
	p := fmt.Sprintf("/%s/%s", d.Volume, d.Bucket)
	if d.Path != "" {
		p += "/" + d.Path
	}
	if d.Prefix && !strings.HasSuffix(p, "/") {
		p += "*"
	}
	return p
}
