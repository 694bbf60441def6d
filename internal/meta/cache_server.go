package meta

import (
	"context"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Cache pools and directives (docs/CACHE.md): changes go through the SCM
// leader (validated, then proposed); listings come from the leader, with
// its monitor's statistics.

func (x *scmServer) AddCachePool(ctx context.Context, req *metapb.CachePool) (*metapb.CachePool, error) {
	if err := x.leader(); err != nil {
		return nil, err
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
	return x.s.scmMgr.AddCacheDirective(ctx, req)
}

func (x *scmServer) ModifyCacheDirective(ctx context.Context, req *metapb.CacheDirective) (*metapb.CacheDirective, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ModifyCacheDirective(ctx, req)
}

func (x *scmServer) RemoveCacheDirective(ctx context.Context, req *metapb.RemoveCacheDirectiveRequest) (*metapb.RemoveCacheDirectiveResponse, error) {
	if err := x.leader(); err != nil {
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
	if !b.s.scmGroup.IsLeader() {
		return nil
	}
	return b.s.scmMgr.CachedOn(id)
}
