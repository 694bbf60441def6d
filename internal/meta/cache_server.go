package meta

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// Cache pools and directives (docs/CACHE.md): changes go through the SCM
// leader (validated, then proposed); listings come from the leader, with
// its monitor's statistics.
//
// Who may change what, as in HDFS: pools are added, modified and removed
// by admins only (adminMethods); directives by admins and by users with
// write on the directive's pool (its owner, by default; see
// scm.CanWritePool) — on both pools when a directive moves. Like the
// namespace's checks, this reads the committed state before proposing.

// poolWriter checks that ctx's caller may change directives in the named
// pools. Admins and in-process callers (no caller) may; an unknown pool
// is NotFound, as it would be for an admin.
func (x *scmServer) poolWriter(ctx context.Context, what string, pools ...string) error {
	c, ok := namespace.CallerOf(ctx)
	if !ok || c.Admin {
		return nil
	}
	for _, name := range pools {
		p := x.s.scmState.CachePool(name)
		if p == nil {
			return status.Errorf(codes.NotFound, "%s: cache pool %q not found", what, clipPool(name))
		}
		if !scm.CanWritePool(p, c.User) {
			return status.Errorf(codes.PermissionDenied, "%s: %s may not change directives in cache pool %s (owner %q, mode %#o; admins: basalt meta --admins)",
				what, c, p.Name, p.Owner, scm.PoolMode(p))
		}
	}
	return nil
}

func clipPool(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// directivePools: the pools a change of directive id touches (its own,
// and the one it moves to), or NotFound.
func (x *scmServer) directivePools(id uint64, moveTo string) ([]string, error) {
	d := x.s.scmState.CacheDirective(id)
	if d == nil {
		return nil, status.Errorf(codes.NotFound, "cache directive %d not found", id)
	}
	pools := []string{d.Pool}
	if moveTo != "" && moveTo != d.Pool {
		pools = append(pools, moveTo)
	}
	return pools, nil
}

func (x *scmServer) AddCachePool(ctx context.Context, req *metapb.CachePool) (*metapb.CachePool, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	if c, ok := namespace.CallerOf(ctx); ok && req.GetOwner() == "" {
		req.Owner = c.User // as HDFS: the pool's owner defaults to whoever adds it
	}
	return x.s.scmMgr.AddCachePool(ctx, req)
}

func (x *scmServer) ModifyCachePool(ctx context.Context, req *metapb.CachePool) (*metapb.CachePool, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ModifyCachePool(ctx, req)
}

func (x *scmServer) RemoveCachePool(ctx context.Context, req *metapb.RemoveCachePoolRequest) (*metapb.RemoveCachePoolResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return &metapb.RemoveCachePoolResponse{}, x.s.scmMgr.RemoveCachePool(ctx, req.Name)
}

func (x *scmServer) ListCachePools(ctx context.Context, _ *metapb.ListCachePoolsRequest) (*metapb.ListCachePoolsResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ListCachePools(), nil
}

func (x *scmServer) AddCacheDirective(ctx context.Context, req *metapb.CacheDirective) (*metapb.CacheDirective, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	if err := x.poolWriter(ctx, "add cache directive", req.GetPool()); err != nil {
		return nil, err
	}
	return x.s.scmMgr.AddCacheDirective(ctx, req)
}

func (x *scmServer) ModifyCacheDirective(ctx context.Context, req *metapb.CacheDirective) (*metapb.CacheDirective, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	moveTo := ""
	if req.GetSetPool() {
		moveTo = req.GetPool()
	}
	pools, err := x.directivePools(req.GetId(), moveTo)
	if err != nil {
		return nil, err
	}
	if err := x.poolWriter(ctx, "modify cache directive", pools...); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ModifyCacheDirective(ctx, req)
}

func (x *scmServer) RemoveCacheDirective(ctx context.Context, req *metapb.RemoveCacheDirectiveRequest) (*metapb.RemoveCacheDirectiveResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	pools, err := x.directivePools(req.GetId(), "")
	if err != nil {
		return nil, err
	}
	if err := x.poolWriter(ctx, "remove cache directive", pools...); err != nil {
		return nil, err
	}
	return &metapb.RemoveCacheDirectiveResponse{}, x.s.scmMgr.RemoveCacheDirective(ctx, req.Id)
}

func (x *scmServer) ListCacheDirectives(ctx context.Context, req *metapb.ListCacheDirectivesRequest) (*metapb.ListCacheDirectivesResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ListCacheDirectives(req), nil
}

// CachedOn: the datanodes holding a block cached, as the SCM leader's
// monitor knows them (nil on other nodes). The namespace lists them on
// LookupKey's locations.
func (b *scmBlocks) CachedOn(id *metapb.BlockID) []uint64 {
	if !(&scmRaft{b.s}).IsLeader() {
		return nil
	}
	return b.s.scmMgr.CachedOn(id)
}
