package scm

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestCacheDefinitionsPersist: pools and directives go through Apply,
// are validated there too, survive a reopen of the state, and removing a
// pool removes its directives.
func TestCacheDefinitionsPersist(t *testing.T) {
	dir := t.TempDir()
	st := openState(t, dir)
	fr := &fakeRaft{st: st, leader: true}
	clk := newClock()
	m := NewManager(Config{Now: clk.Now}, st, fr)
	ctx := t.Context()
	if _, err := m.AddCachePool(ctx, &metapb.CachePool{Name: "hot", Owner: "etl", LimitBytes: 1 << 30, MaxTtlMs: 3600_000}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.AddCachePool(ctx, &metapb.CachePool{Name: "bad/name"}); code(err) != codes.InvalidArgument {
		t.Fatalf("pool named with a slash: %v", err)
	}
	d, err := m.AddCacheDirective(ctx, &metapb.CacheDirective{Volume: "v", Bucket: "b", Path: "p/", Prefix: true, Replication: 2, Pool: "hot"})
	if err != nil {
		t.Fatal(err)
	}
	if d.Id != 1 || d.ExpiryUnixMs != clk.Now().UnixMilli()+3600_000 {
		t.Fatalf("directive %v: want ID 1 and the pool's max TTL", d)
	}
	if _, err := m.AddCacheDirective(ctx, &metapb.CacheDirective{Volume: "v", Bucket: "b", Path: "q", Replication: 1, Pool: "hot", TtlMs: 7200_000}); code(err) != codes.InvalidArgument {
		t.Fatalf("TTL above the pool's maximum: %v", err)
	}
	if _, err := m.ModifyCachePool(ctx, &metapb.CachePool{Name: "hot", LimitBytes: 2 << 30, SetLimit: true}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	if md, err := m.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: d.Id, Replication: 3, SetReplication: true}); err != nil || md.ExpiryUnixMs != d.ExpiryUnixMs {
		t.Fatalf("modify replication: %v %v; want the expiry kept at %d", md, err, d.ExpiryUnixMs)
	}
	if _, err := m.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: d.Id, Replication: 4, SetReplication: true}); code(err) != codes.InvalidArgument {
		t.Fatalf("modify to replication 4: %v", err)
	}
	st.Close()
	st = openState(t, dir)
	defer st.Close()
	p := st.CachePool("hot")
	if p == nil || p.Owner != "etl" || p.LimitBytes != 2<<30 || p.MaxTtlMs != 3600_000 {
		t.Fatalf("pool after reopen: %v", p)
	}
	ds := st.CacheDirectives()
	if len(ds) != 1 || ds[0].Replication != 3 || ds[0].Pool != "hot" || DirectivePath(ds[0]) != "/v/b/p/" {
		t.Fatalf("directives after reopen: %v", ds)
	}
	fr = &fakeRaft{st: st, leader: true, idx: 100}
	m = NewManager(Config{Now: clk.Now}, st, fr)
	d2, err := m.AddCacheDirective(ctx, &metapb.CacheDirective{Volume: "v", Bucket: "b", Path: "k", Replication: 1, Pool: "hot"})
	if err != nil || d2.Id != 2 {
		t.Fatalf("second directive after reopen: %v %v (want ID 2)", d2, err)
	}
	if err := m.RemoveCachePool(ctx, "hot"); err != nil {
		t.Fatal(err)
	}
	if n := len(st.CacheDirectives()); n != 0 {
		t.Fatalf("%d directives left after removing their pool", n)
	}
}

// fakeResolver returns fixed files per directive path.
type fakeResolver struct {
	mu    sync.Mutex
	files map[string][]CacheFile
}

func (f *fakeResolver) ResolveCache(d *metapb.CacheDirective, limit int) ([]CacheFile, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.files[DirectivePath(d)], false, nil
}

func (f *fakeResolver) set(path string, files []CacheFile) {
	f.mu.Lock()
	f.files[path] = files
	f.mu.Unlock()
}

// TestCacheMonitorPlan: the monitor spreads cached replicas over the
// datanodes holding each block, stays within the pool's limit when keys
// appear later, sends cache commands to the chosen datanodes only, and
// uncaches what a datanode reports but no directive wants.
func TestCacheMonitorPlan(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 3, BlockSize: 1 << 20, ContainerSize: 64 << 20, CacheRescanInterval: time.Millisecond})
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	res := &fakeResolver{files: map[string][]CacheFile{}}
	e.m.SetCacheResolver(res)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	alloc, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 8, Replication: metapb.Replication_THREE})
	if err != nil {
		t.Fatal(err)
	}
	var files []CacheFile
	for i, b := range alloc.Blocks {
		files = append(files, CacheFile{Key: fmt.Sprintf("p/%d", i), Blocks: []*metapb.KeyBlock{{Id: b.Id, Length: 1 << 20}}})
	}
	if _, err := e.m.AddCachePool(e.ctx, &metapb.CachePool{Name: "hot", LimitBytes: 10 << 20}); err != nil {
		t.Fatal(err)
	}
	// At add time the prefix holds nothing yet; 8 keys appear later: 16 MiB
	// at replication 2, over the 10 MiB limit.
	if _, err := e.m.AddCacheDirective(e.ctx, &metapb.CacheDirective{Volume: "v", Bucket: "b", Path: "p/", Prefix: true, Replication: 2, Pool: "hot"}); err != nil {
		t.Fatal(err)
	}
	res.set("/v/b/p/", files)
	report := func(id uint64, cached map[uint64][]*metapb.BlockID) []*metapb.DatanodeCommand {
		r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, CacheReport: true, CachedBlocks: cached[id],
			Cache: &metapb.CacheStats{CapacityBytes: 100 << 20}})
		if err != nil {
			t.Fatal(err)
		}
		return r.Commands
	}
	cached := map[uint64][]*metapb.BlockID{}
	for _, id := range ids {
		report(id, cached)
	}
	e.clk.Advance(time.Second)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	perDN := map[uint64]int{}
	total := 0
	for _, id := range ids {
		for _, c := range report(id, cached) {
			for _, b := range c.GetCacheBlocks().GetBlocks() {
				perDN[id]++
				total++
				cached[id] = append(cached[id], b)
			}
		}
	}
	// 10 MiB of limit: 5 blocks at replication 2, 10 cache commands.
	if total != 10 {
		t.Fatalf("%d blocks to cache (%v), want 10 (5 blocks × 2 within the 10 MiB limit)", total, perDN)
	}
	for _, id := range ids {
		if perDN[id] < 2 || perDN[id] > 5 {
			t.Fatalf("cache spread %v: want every datanode used, none with all", perDN)
		}
	}
	for _, id := range ids {
		report(id, cached)
	}
	e.clk.Advance(time.Second)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	ls := e.m.ListCacheDirectives(&metapb.ListCacheDirectivesRequest{})
	x := ls.Directives[0]
	if !ls.Stats || x.BytesNeeded != 16<<20 || x.BytesCached != 10<<20 || x.FilesNeeded != 8 || x.FilesCached != 5 || x.Note != "pool limit reached" {
		t.Fatalf("directive stats: %v", x)
	}
	if on := e.m.CachedOn(cached[ids[0]][0]); !slices.Contains(on, ids[0]) {
		t.Fatalf("CachedOn(%v) = %v, want it to include %d", cached[ids[0]][0], on, ids[0])
	}
	// Removing the directive uncaches everything reported.
	if err := e.m.RemoveCacheDirective(e.ctx, x.Id); err != nil {
		t.Fatal(err)
	}
	e.clk.Advance(time.Minute)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		n := 0
		for _, c := range report(id, cached) {
			n += len(c.GetUncacheBlocks().GetBlocks())
		}
		if n != len(cached[id]) {
			t.Fatalf("datanode %d: %d uncached, want its %d", id, n, len(cached[id]))
		}
	}
}

// TestCacheRestartKeepsReportedCache: after a restart of the meta node
// (a new SCM process, safe mode already left once, so one datanode's
// report ends safe mode), the first cache plan waits for every healthy
// datanode's full report, so blocks the datanodes recovered from their
// cache directories are kept where they are: no uncache command, no
// copy. Before, the first plan was made from the first reporter alone,
// every later reporter was told to uncache its recovered blocks and then
// to cache them again on the next scan (a full re-warm).
func TestCacheRestartKeepsReportedCache(t *testing.T) {
	cfg := Config{SafeModeMinDatanodes: 3, BlockSize: 1 << 20, ContainerSize: 64 << 20, CacheRescanInterval: time.Millisecond}
	e := newEnv(t, cfg)
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	e.heartbeatAll(t, ids...)
	e.tick(t) // leaves safe mode (recorded in the state)
	alloc, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 4, Replication: metapb.Replication_THREE})
	if err != nil {
		t.Fatal(err)
	}
	var files []CacheFile
	var blocks []*metapb.BlockID
	for i, b := range alloc.Blocks {
		files = append(files, CacheFile{Key: fmt.Sprintf("p/%d", i), Blocks: []*metapb.KeyBlock{{Id: b.Id, Length: 1 << 20}}})
		blocks = append(blocks, b.Id)
	}
	if _, err := e.m.AddCachePool(e.ctx, &metapb.CachePool{Name: "hot"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.AddCacheDirective(e.ctx, &metapb.CacheDirective{Volume: "v", Bucket: "b", Path: "p/", Prefix: true, Replication: 3, Pool: "hot"}); err != nil {
		t.Fatal(err)
	}
	e.tick(t)
	if !e.st.SafeModeExited() {
		t.Fatal("safe mode exit not recorded")
	}

	// The meta node restarts: a new manager on the same state. Every
	// datanode recovered all four blocks from its cache directory.
	e.m = NewManager(cfg, e.st, e.fr)
	e.m.SetCacheResolver(&fakeResolver{files: map[string][]CacheFile{"/v/b/p/": files}})
	heartbeat := func(id uint64) []*metapb.DatanodeCommand {
		r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, FullReport: true, CacheReport: true, CachedBlocks: blocks,
			Cache: &metapb.CacheStats{CapacityBytes: 100 << 20, UsedBytes: 4 << 20, Blocks: 4}})
		if err != nil {
			t.Fatal(err)
		}
		return r.Commands
	}
	check := func(id uint64, cmds []*metapb.DatanodeCommand) {
		t.Helper()
		for _, c := range cmds {
			if n := len(c.GetUncacheBlocks().GetBlocks()); n > 0 {
				t.Fatalf("datanode %d told to uncache %d recovered blocks", id, n)
			}
			if n := len(c.GetCacheBlocks().GetBlocks()); n > 0 {
				t.Fatalf("datanode %d told to cache %d blocks it reports cached", id, n)
			}
		}
	}
	check(ids[0], heartbeat(ids[0]))
	for range 3 {
		e.clk.Advance(100 * time.Millisecond)
		e.tick(t) // out of safe mode on one report; the plan waits
	}
	for _, id := range ids[1:] {
		check(id, heartbeat(id))
	}
	e.clk.Advance(100 * time.Millisecond)
	e.tick(t)
	for _, id := range ids {
		check(id, heartbeat(id))
	}
	for _, b := range blocks {
		if on := e.m.CachedOn(b); len(on) != 3 {
			t.Fatalf("CachedOn(%v) = %v, want all three datanodes", b, on)
		}
	}
	ls := e.m.ListCacheDirectives(&metapb.ListCacheDirectivesRequest{})
	if x := ls.Directives[0]; x.FilesCached != 4 {
		t.Fatalf("directive stats after the restart: %v, want 4 files cached", x)
	}
}
