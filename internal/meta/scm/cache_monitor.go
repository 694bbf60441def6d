package scm

import (
	"context"
	"slices"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The cache monitor (docs/CACHE.md) runs on the SCM leader. Every
// CacheRescanInterval it resolves each live directive to the blocks of
// the keys it covers (keys written later under a cached prefix are found
// by the next scan), picks which replicas cache each block (spread over
// the datanodes by free cache capacity, within the pool's byte limit),
// and keeps the plan as soft state. Heartbeats carry the datanodes' cache
// reports; commandsFor sends cache commands for planned blocks a datanode
// does not report and uncache commands for reported blocks outside the
// plan (expired or removed directives, deleted keys).

// CacheFile is one key a directive covers, with its blocks.
type CacheFile struct {
	Key    string
	Blocks []*metapb.KeyBlock
}

// CacheResolver turns a directive into the keys it covers (at most limit;
// truncated when there were more). The meta server resolves against its
// namespace replica.
type CacheResolver interface {
	ResolveCache(d *metapb.CacheDirective, limit int) (files []CacheFile, truncated bool, err error)
}

// Limits of the monitor.
const (
	maxCacheFilesPerDirective = 100000
	maxCachedBlocksReported   = 1000000
	maxCacheBlocksPerCommand  = 256
	// DefaultCacheRescanInterval is Config.CacheRescanInterval's default.
	DefaultCacheRescanInterval = 10 * time.Second
)

type blockKey struct{ c, l uint64 }

type dnCache struct {
	cached map[blockKey]bool
	stats  *metapb.CacheStats
}

type dirStat struct {
	bytesNeeded, bytesCached, filesNeeded, filesCached uint64
	note                                               string
}

type cacheMonitor struct {
	mu       sync.Mutex
	resolver CacheResolver
	reports  map[uint64]*dnCache // by datanode, from heartbeats
	plan     map[blockKey][]uint64
	blockLen map[blockKey]uint64
	dirStats map[uint64]*dirStat
	// planSince: the leadership (Manager.since) the plan was made in; the
	// commands use a plan of this leadership only, so a new leader never
	// uncaches everything before its first scan.
	planSince time.Time
	lastScan  time.Time
	sent      map[uint64]map[blockKey]time.Time // cache/uncache commands sent
	rounds    uint64
}

// SetCacheResolver installs the resolver (before Run).
func (m *Manager) SetCacheResolver(r CacheResolver) {
	m.cacheMon.mu.Lock()
	m.cacheMon.resolver = r
	m.cacheMon.mu.Unlock()
}

func (m *Manager) cacheRescan() time.Duration {
	if m.cfg.CacheRescanInterval > 0 {
		return m.cfg.CacheRescanInterval
	}
	return DefaultCacheRescanInterval
}

// cacheReportLocked records a heartbeat's cache report. Callers hold m.mu.
func (m *Manager) cacheReportLocked(req *metapb.HeartbeatRequest) {
	if !req.CacheReport && req.Cache == nil {
		return
	}
	cm := &m.cacheMon
	cm.mu.Lock()
	defer cm.mu.Unlock()
	if cm.reports == nil {
		cm.reports = map[uint64]*dnCache{}
	}
	r := cm.reports[req.DatanodeId]
	if r == nil {
		r = &dnCache{cached: map[blockKey]bool{}}
		cm.reports[req.DatanodeId] = r
	}
	if req.Cache != nil {
		r.stats = req.Cache
	}
	if req.CacheReport {
		blocks := req.CachedBlocks
		if len(blocks) > maxCachedBlocksReported {
			blocks = blocks[:maxCachedBlocksReported]
		}
		r.cached = make(map[blockKey]bool, len(blocks))
		for _, b := range blocks {
			r.cached[blockKey{b.ContainerId, b.LocalId}] = true
		}
		// Reported blocks need no command any more.
		for k := range cm.sent[req.DatanodeId] {
			if r.cached[k] == cm.wantOn(k, req.DatanodeId) {
				delete(cm.sent[req.DatanodeId], k)
			}
		}
	}
}

func (cm *cacheMonitor) wantOn(k blockKey, dn uint64) bool {
	return slices.Contains(cm.plan[k], dn)
}

// cacheCommandsLocked appends the cache and uncache commands for dn.
// Callers hold m.mu.
func (m *Manager) cacheCommandsLocked(dn uint64, now time.Time, cmds []*metapb.DatanodeCommand) []*metapb.DatanodeCommand {
	cm := &m.cacheMon
	cm.mu.Lock()
	defer cm.mu.Unlock()
	if cm.plan == nil || !cm.planSince.Equal(m.since) {
		return cmds
	}
	rep := cm.reports[dn]
	if rep == nil || rep.stats == nil || rep.stats.CapacityBytes == 0 {
		return cmds
	}
	if cm.sent == nil {
		cm.sent = map[uint64]map[blockKey]time.Time{}
	}
	sent := cm.sent[dn]
	if sent == nil {
		sent = map[blockKey]time.Time{}
		cm.sent[dn] = sent
	}
	due := func(k blockKey) bool {
		if t, ok := sent[k]; ok && now.Sub(t) < m.cfg.CommandRetryInterval {
			return false
		}
		sent[k] = now
		return true
	}
	var add, drop []*metapb.BlockID
	for k, dns := range cm.plan {
		if len(add) >= maxCacheBlocksPerCommand {
			break
		}
		if slices.Contains(dns, dn) && !rep.cached[k] && due(k) {
			add = append(add, &metapb.BlockID{ContainerId: k.c, LocalId: k.l})
		}
	}
	for k := range rep.cached {
		if len(drop) >= maxCacheBlocksPerCommand {
			break
		}
		if !cm.wantOn(k, dn) && due(k) {
			drop = append(drop, &metapb.BlockID{ContainerId: k.c, LocalId: k.l})
		}
	}
	if len(add) > 0 {
		cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CacheBlocks{CacheBlocks: &metapb.CacheBlocksCommand{Blocks: add}}})
	}
	if len(drop) > 0 {
		cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_UncacheBlocks{UncacheBlocks: &metapb.UncacheBlocksCommand{Blocks: drop}}})
	}
	return cmds
}

// CachedOn returns the datanodes that report block id cached (leader
// only; nil elsewhere). LookupKey lists them on the block's location.
func (m *Manager) CachedOn(id *metapb.BlockID) []uint64 {
	cm := &m.cacheMon
	cm.mu.Lock()
	defer cm.mu.Unlock()
	k := blockKey{id.GetContainerId(), id.GetLocalId()}
	var out []uint64
	for dn, r := range cm.reports {
		if r.cached[k] {
			out = append(out, dn)
		}
	}
	slices.Sort(out)
	return out
}

// cacheRound rescans the directives if due and makes a new plan. healthy:
// the datanodes this leader considers healthy; since: this leadership;
// allFull: every healthy datanode has sent this leader its cached blocks
// (a cache report, or a full report, which carries one).
//
// A leadership's first plan waits for those reports (up to the dead
// interval, past which a datanode that did not report is dead anyway):
// made from the first reporters alone, it would place blocks only on
// them and tell every later reporter — a datanode that just recovered
// its cache directory after a restart of the cluster — to uncache what
// it holds, and to copy it again at the next scan.
func (m *Manager) cacheRound(now, since time.Time, healthy map[uint64]bool, allFull, force bool) {
	cm := &m.cacheMon
	cm.mu.Lock()
	res := cm.resolver
	first := !cm.planSince.Equal(since)
	if res == nil || (!force && !first && now.Sub(cm.lastScan) < m.cacheRescan()) ||
		(first && !allFull && now.Sub(since) < m.cfg.DeadInterval) {
		cm.mu.Unlock()
		return
	}
	cm.lastScan = now
	// Free capacity and current holders, from the reports.
	capLeft := map[uint64]int64{}
	holders := map[blockKey][]uint64{}
	for dn, r := range cm.reports {
		if !healthy[dn] || r.stats == nil || r.stats.CapacityBytes == 0 {
			continue
		}
		capLeft[dn] = int64(r.stats.CapacityBytes)
		for k := range r.cached {
			holders[k] = append(holders[k], dn)
		}
	}
	oldPlan := cm.plan
	cm.mu.Unlock()

	dirs := m.st.CacheDirectives()
	pools := map[string]*metapb.CachePool{}
	for _, p := range m.st.CachePools() {
		pools[p.Name] = p
	}
	poolUsed := map[string]uint64{}
	plan := map[blockKey][]uint64{}
	want := map[blockKey]int{}
	lens := map[blockKey]uint64{}
	stats := map[uint64]*dirStat{}
	type fileRef struct {
		dir    uint64
		blocks []blockKey
		repl   int
	}
	var files []fileRef
	var order []blockKey
	for _, d := range dirs {
		ds := &dirStat{}
		stats[d.Id] = ds
		if d.ExpiryUnixMs != 0 && now.UnixMilli() >= d.ExpiryUnixMs {
			ds.note = "expired"
			continue
		}
		pool := pools[d.Pool]
		fs, trunc, err := res.ResolveCache(d, maxCacheFilesPerDirective)
		if err != nil {
			ds.note = status.Convert(err).Message()
			continue
		}
		if trunc {
			ds.note = "more than 100000 keys; the rest are not cached"
		}
		for _, f := range fs {
			ds.filesNeeded++
			fr := fileRef{dir: d.Id, repl: int(d.Replication)}
			for _, kb := range f.Blocks {
				k := blockKey{kb.GetId().GetContainerId(), kb.GetId().GetLocalId()}
				need := kb.Length * uint64(d.Replication)
				ds.bytesNeeded += need
				fr.blocks = append(fr.blocks, k)
				if want[k] >= int(d.Replication) {
					continue // another directive caches it as much already
				}
				extra := need - uint64(want[k])*kb.Length
				if pool != nil && pool.LimitBytes > 0 && poolUsed[d.Pool]+extra > pool.LimitBytes {
					ds.note = "pool limit reached"
					continue
				}
				poolUsed[d.Pool] += extra
				if want[k] == 0 {
					order = append(order, k)
				}
				want[k] = int(d.Replication)
				lens[k] = kb.Length
			}
			files = append(files, fr)
		}
	}
	// Placement: keep what is cached or planned on a healthy replica,
	// then add the replicas with the most free cache capacity.
	for _, k := range order {
		_, reps := m.st.ContainerReplicas(k.c)
		var cands []uint64
		for _, d := range reps {
			if _, ok := capLeft[d.Id]; ok {
				cands = append(cands, d.Id)
			}
		}
		var chosen []uint64
		// Replicas that hold it cached first (a new leader's first plan
		// keeps what the datanodes report), then the previous plan.
		for _, dn := range append(slices.Clone(holders[k]), oldPlan[k]...) {
			if len(chosen) < want[k] && slices.Contains(cands, dn) && !slices.Contains(chosen, dn) {
				chosen = append(chosen, dn)
				capLeft[dn] -= int64(lens[k])
			}
		}
		sort.SliceStable(cands, func(i, j int) bool { return capLeft[cands[i]] > capLeft[cands[j]] })
		for _, dn := range cands {
			if len(chosen) >= want[k] {
				break
			}
			if !slices.Contains(chosen, dn) && capLeft[dn] >= int64(lens[k]) {
				chosen = append(chosen, dn)
				capLeft[dn] -= int64(lens[k])
			}
		}
		if len(chosen) > 0 {
			plan[k] = chosen
		}
	}
	// Statistics from the reports.
	for _, f := range files {
		ds := stats[f.dir]
		all := true
		for _, k := range f.blocks {
			n := min(len(holders[k]), f.repl)
			ds.bytesCached += uint64(n) * lens[k]
			if n < f.repl {
				all = false
			}
		}
		if all {
			ds.filesCached++
		}
	}
	cm.mu.Lock()
	cm.plan = plan
	cm.blockLen = lens
	cm.dirStats = stats
	cm.planSince = since
	cm.rounds++
	cm.mu.Unlock()
}

// ---------------------------------------------------------------- RPCs

// AddCachePool creates a pool.
func (m *Manager) AddCachePool(ctx context.Context, p *metapb.CachePool) (*metapb.CachePool, error) {
	if err := ValidateCachePool(p); err != nil {
		return nil, err
	}
	return m.cacheOp(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CachePool{CachePool: &metapb.CachePoolOp{Pool: p, Create: true}}})
}

// ModifyCachePool changes a pool's owner, limit or max TTL.
func (m *Manager) ModifyCachePool(ctx context.Context, p *metapb.CachePool) (*metapb.CachePool, error) {
	if err := ValidateCachePool(p); err != nil {
		return nil, err
	}
	if m.st.CachePool(p.Name) == nil {
		return nil, status.Errorf(codes.NotFound, "cache pool %s not found", p.Name)
	}
	return m.cacheOp(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CachePool{CachePool: &metapb.CachePoolOp{Pool: p}}})
}

// RemoveCachePool removes a pool and its directives.
func (m *Manager) RemoveCachePool(ctx context.Context, name string) error {
	p := &metapb.CachePool{Name: name}
	if err := ValidateCachePool(p); err != nil {
		return err
	}
	_, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CachePool{CachePool: &metapb.CachePoolOp{Pool: p, Remove: true}}})
	m.kickCache()
	return err
}

func (m *Manager) cacheOp(ctx context.Context, cmd *metapb.ScmCommand) (*metapb.CachePool, error) {
	res, err := m.propose(ctx, cmd)
	if err != nil {
		return nil, err
	}
	m.kickCache()
	return res.(*metapb.CachePool), nil
}

// kickCache makes the next Tick rescan.
func (m *Manager) kickCache() {
	m.cacheMon.mu.Lock()
	m.cacheMon.lastScan = time.Time{}
	m.cacheMon.mu.Unlock()
}

// checkDirective validates a directive against the state before it is
// proposed: the pool, the path (a bucket that exists), the TTL against
// the pool's maximum, and the pool's byte limit (what the directive
// needs, added to what the pool's other directives need, must fit).
func (m *Manager) checkDirective(d *metapb.CacheDirective) error {
	if err := ValidateCacheDirective(d); err != nil {
		return err
	}
	pool := m.st.CachePool(d.Pool)
	if pool == nil {
		return status.Errorf(codes.NotFound, "cache directive: pool %s not found", d.Pool)
	}
	if pool.MaxTtlMs > 0 && d.TtlMs > pool.MaxTtlMs {
		return status.Errorf(codes.InvalidArgument, "cache directive: TTL %v exceeds pool %s's maximum %v",
			time.Duration(d.TtlMs)*time.Millisecond, pool.Name, time.Duration(pool.MaxTtlMs)*time.Millisecond)
	}
	m.cacheMon.mu.Lock()
	res := m.cacheMon.resolver
	m.cacheMon.mu.Unlock()
	if res == nil {
		return nil
	}
	files, _, err := res.ResolveCache(d, maxCacheFilesPerDirective)
	if err != nil {
		if status.Code(err) == codes.NotFound {
			return status.Errorf(codes.NotFound, "cache directive %s: %s", DirectivePath(d), status.Convert(err).Message())
		}
		return err
	}
	if pool.LimitBytes == 0 {
		return nil
	}
	var need uint64
	for _, f := range files {
		for _, b := range f.Blocks {
			need += b.Length * uint64(d.Replication)
		}
	}
	var others uint64
	for _, o := range m.st.CacheDirectives() {
		if o.Pool == d.Pool && o.Id != d.Id && (o.ExpiryUnixMs == 0 || m.cfg.Now().UnixMilli() < o.ExpiryUnixMs) {
			fs, _, err := res.ResolveCache(o, maxCacheFilesPerDirective)
			if err != nil {
				continue
			}
			for _, f := range fs {
				for _, b := range f.Blocks {
					others += b.Length * uint64(o.Replication)
				}
			}
		}
	}
	if need+others > pool.LimitBytes {
		return status.Errorf(codes.ResourceExhausted, "cache directive %s needs %d bytes; pool %s has a limit of %d bytes and its other directives need %d",
			DirectivePath(d), need, pool.Name, pool.LimitBytes, others)
	}
	return nil
}

// AddCacheDirective validates and records a directive.
func (m *Manager) AddCacheDirective(ctx context.Context, d *metapb.CacheDirective) (*metapb.CacheDirective, error) {
	d = proto.Clone(d).(*metapb.CacheDirective)
	d.Id = 0
	if err := m.checkDirective(d); err != nil {
		return nil, err
	}
	return m.directiveOp(ctx, &metapb.CacheDirectiveOp{Directive: d})
}

// ModifyCacheDirective changes a directive's replication, pool or TTL.
func (m *Manager) ModifyCacheDirective(ctx context.Context, d *metapb.CacheDirective) (*metapb.CacheDirective, error) {
	old := m.st.CacheDirective(d.Id)
	if old == nil {
		return nil, status.Errorf(codes.NotFound, "cache directive %d not found", d.Id)
	}
	n := proto.Clone(old).(*metapb.CacheDirective)
	if d.SetReplication {
		n.Replication = d.Replication
	}
	if d.SetPool {
		n.Pool = d.Pool
	}
	if d.SetTtl {
		n.TtlMs = d.TtlMs
	}
	if err := m.checkDirective(n); err != nil {
		return nil, err
	}
	return m.directiveOp(ctx, &metapb.CacheDirectiveOp{Directive: &metapb.CacheDirective{Id: d.Id, Replication: d.Replication, Pool: d.Pool, TtlMs: d.TtlMs,
		SetReplication: d.SetReplication, SetPool: d.SetPool, SetTtl: d.SetTtl}})
}

// RemoveCacheDirective removes a directive; its blocks are uncached.
func (m *Manager) RemoveCacheDirective(ctx context.Context, id uint64) error {
	_, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CacheDirective{CacheDirective: &metapb.CacheDirectiveOp{Directive: &metapb.CacheDirective{Id: id}, Remove: true}}})
	m.kickCache()
	return err
}

func (m *Manager) directiveOp(ctx context.Context, op *metapb.CacheDirectiveOp) (*metapb.CacheDirective, error) {
	res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CacheDirective{CacheDirective: op}})
	if err != nil {
		return nil, err
	}
	m.kickCache()
	return res.(*metapb.CacheDirective), nil
}

// ListCacheDirectives lists directives with the monitor's statistics
// (stats false when this replica has made no plan as leader).
func (m *Manager) ListCacheDirectives(req *metapb.ListCacheDirectivesRequest) *metapb.ListCacheDirectivesResponse {
	resp := &metapb.ListCacheDirectivesResponse{}
	m.cacheMon.mu.Lock()
	defer m.cacheMon.mu.Unlock()
	resp.Stats = m.cacheMon.dirStats != nil && m.prop.IsLeader()
	now := m.cfg.Now().UnixMilli()
	for _, d := range m.st.CacheDirectives() {
		if (req.Pool != "" && d.Pool != req.Pool) || (req.Id != 0 && d.Id != req.Id) {
			continue
		}
		d = proto.Clone(d).(*metapb.CacheDirective)
		d.Expired = d.ExpiryUnixMs != 0 && now >= d.ExpiryUnixMs
		if ds := m.cacheMon.dirStats[d.Id]; ds != nil && resp.Stats {
			d.BytesNeeded, d.BytesCached, d.FilesNeeded, d.FilesCached, d.Note = ds.bytesNeeded, ds.bytesCached, ds.filesNeeded, ds.filesCached, ds.note
		}
		resp.Directives = append(resp.Directives, d)
	}
	return resp
}

// ListCachePools lists pools with the totals of their directives.
func (m *Manager) ListCachePools() *metapb.ListCachePoolsResponse {
	dirs := m.ListCacheDirectives(&metapb.ListCacheDirectivesRequest{})
	resp := &metapb.ListCachePoolsResponse{}
	for _, p := range m.st.CachePools() {
		p = proto.Clone(p).(*metapb.CachePool)
		for _, d := range dirs.Directives {
			if d.Pool == p.Name {
				p.BytesNeeded += d.BytesNeeded
				p.BytesCached += d.BytesCached
				p.Files += d.FilesNeeded
			}
		}
		resp.Pools = append(resp.Pools, p)
	}
	return resp
}

// cacheStatsOf returns a datanode's last reported cache tier (nil if
// none).
func (m *Manager) cacheStatsOf(dn uint64) *metapb.CacheStats {
	m.cacheMon.mu.Lock()
	defer m.cacheMon.mu.Unlock()
	if r := m.cacheMon.reports[dn]; r != nil {
		return r.stats
	}
	return nil
}
