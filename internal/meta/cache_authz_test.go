package meta

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// TestCachePoolOwnership: cache pools are changed by admins only; a
// directive is added, modified or removed by admins and by users with
// write on its pool (the owner under the default mode 0755, anyone under
// 0777), on both pools when it moves. Before pool ownership was enforced
// every directive change was admin-only (alice's own directive was
// refused).
func TestCachePoolOwnership(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	admin := c.client() // "test", an admin
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	registerDatanodes(t, admin, 3)
	alice, bob := c.userClient("alice"), c.userClient("bob")
	_, err := admin.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"})
	mustOK(t, "admin creates alice's volume", err)
	_, err = alice.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	mustOK(t, "alice creates a bucket", err)

	// Pools: admins only; the owner defaults to whoever adds it.
	_, err = alice.Scm.AddCachePool(ctx, &metapb.CachePool{Name: "mine", Owner: "alice"})
	wantDenied(t, "alice adds a cache pool", err)
	for _, p := range []*metapb.CachePool{{Name: "apool", Owner: "alice"}, {Name: "bpool", Owner: "bob"}, {Name: "open", Mode: 0o777}} {
		_, err = admin.Scm.AddCachePool(ctx, p)
		mustOK(t, "admin adds pool "+p.Name, err)
	}
	pools, err := admin.Scm.ListCachePools(ctx, &metapb.ListCachePoolsRequest{})
	mustOK(t, "list pools", err)
	for _, p := range pools.Pools {
		if p.Name == "open" && (p.Owner != "test" || p.Mode != 0o777) {
			t.Fatalf("pool open: owner %q mode %#o, want the adding admin \"test\" and 0777", p.Owner, p.Mode)
		}
	}
	_, err = alice.Scm.ModifyCachePool(ctx, &metapb.CachePool{Name: "apool", LimitBytes: 1, SetLimit: true})
	wantDenied(t, "alice modifies her own pool", err)
	_, err = bob.Scm.RemoveCachePool(ctx, &metapb.RemoveCachePoolRequest{Name: "bpool"})
	wantDenied(t, "bob removes his own pool", err)

	dir := func(pool, path string) *metapb.CacheDirective {
		return &metapb.CacheDirective{Volume: "vol", Bucket: "bkt", Path: path, Prefix: true, Replication: 1, Pool: pool}
	}
	// Adding: own pool yes, another's no, an open pool yes; an unknown
	// pool is NotFound.
	ad, err := alice.Scm.AddCacheDirective(ctx, dir("apool", "a/"))
	mustOK(t, "alice adds a directive to her pool", err)
	_, err = bob.Scm.AddCacheDirective(ctx, dir("apool", "b/"))
	wantDenied(t, "bob adds a directive to alice's pool", err)
	bd, err := bob.Scm.AddCacheDirective(ctx, dir("bpool", "b/"))
	mustOK(t, "bob adds a directive to his pool", err)
	od, err := bob.Scm.AddCacheDirective(ctx, dir("open", "o/"))
	mustOK(t, "bob adds a directive to a 0777 pool", err)
	_, err = bob.Scm.AddCacheDirective(ctx, dir("nosuch", "x/"))
	if status.Code(err) != codes.NotFound {
		t.Fatalf("bob adds a directive to an unknown pool: %v, want NotFound", err)
	}

	// Modifying and removing: the directive's pool decides; a move needs
	// write on both pools.
	_, err = bob.Scm.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: ad.Id, Replication: 2, SetReplication: true})
	wantDenied(t, "bob modifies alice's directive", err)
	_, err = bob.Scm.RemoveCacheDirective(ctx, &metapb.RemoveCacheDirectiveRequest{Id: ad.Id})
	wantDenied(t, "bob removes alice's directive", err)
	_, err = alice.Scm.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: ad.Id, Pool: "bpool", SetPool: true})
	wantDenied(t, "alice moves her directive into bob's pool", err)
	_, err = bob.Scm.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: bd.Id, Pool: "apool", SetPool: true})
	wantDenied(t, "bob moves his directive into alice's pool", err)
	_, err = bob.Scm.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: bd.Id, Pool: "open", SetPool: true})
	mustOK(t, "bob moves his directive into the open pool", err)
	_, err = alice.Scm.RemoveCacheDirective(ctx, &metapb.RemoveCacheDirectiveRequest{Id: od.Id})
	mustOK(t, "alice removes a directive in the open pool", err)
	_, err = alice.Scm.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: ad.Id, Replication: 2, SetReplication: true})
	mustOK(t, "alice modifies her directive", err)
	_, err = alice.Scm.RemoveCacheDirective(ctx, &metapb.RemoveCacheDirectiveRequest{Id: 9999})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("alice removes an unknown directive: %v, want NotFound", err)
	}

	// The mode decides for the owner too: 0555 takes alice's write away.
	_, err = admin.Scm.ModifyCachePool(ctx, &metapb.CachePool{Name: "apool", Mode: 0o555, SetMode: true, Group: "etl", SetGroup: true})
	mustOK(t, "admin sets apool's mode", err)
	_, err = alice.Scm.RemoveCacheDirective(ctx, &metapb.RemoveCacheDirectiveRequest{Id: ad.Id})
	wantDenied(t, "alice removes her directive from a 0555 pool", err)
	_, err = admin.Scm.AddCachePool(ctx, &metapb.CachePool{Name: "bad", Mode: 0o1777})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a pool with mode 01777: %v, want InvalidArgument", err)
	}

	// Admins may do everything.
	_, err = admin.Scm.ModifyCacheDirective(ctx, &metapb.CacheDirective{Id: ad.Id, Pool: "bpool", SetPool: true})
	mustOK(t, "admin moves alice's directive into bob's pool", err)
	_, err = admin.Scm.RemoveCacheDirective(ctx, &metapb.RemoveCacheDirectiveRequest{Id: bd.Id})
	mustOK(t, "admin removes bob's directive", err)
	_, err = admin.Scm.RemoveCachePool(ctx, &metapb.RemoveCachePoolRequest{Name: "bpool"})
	mustOK(t, "admin removes bob's pool", err)
}
