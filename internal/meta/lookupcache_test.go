package meta

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// TestLookupCacheAcrossLeaderChange: three meta nodes (real Raft,
// Pebble, TLS) all cache a key's record, the key is overwritten and
// another deleted, the leader is killed: lookups at the new leader (plain
// and coalesced) and every surviving replica's state see the writes,
// never the records their caches held before.
func TestLookupCacheAcrossLeaderChange(t *testing.T) {
	c := newCluster(t, 3, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	registerDatanodes(t, cl, 3)
	waitFor(t, 10*time.Second, "containers", func() bool {
		r, err := cl.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) >= 3
	})
	put := func(key string, size uint64) {
		t.Helper()
		o, err := cl.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cl.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: size}}}); err != nil {
			t.Fatal(err)
		}
	}
	caughtUp := func() {
		t.Helper()
		want := c.servers[c.nsLeader()].nsGroup.Status().Commit
		waitFor(t, 10*time.Second, "replicas to apply", func() bool {
			for _, s := range c.servers {
				if s.nsGroup.Status().Applied < want {
					return false
				}
			}
			return true
		})
	}
	put("k", 1)
	put("gone", 2)
	caughtUp()
	for id, s := range c.servers { // every replica caches both records (on the second miss)
		for range 3 {
			if ki, err := s.nsState.LookupKey("vol", "bkt", "k"); err != nil || ki.Size != 1 {
				t.Fatalf("node %d: %v %v", id, ki, err)
			}
			if _, err := s.nsState.LookupKey("vol", "bkt", "gone"); err != nil {
				t.Fatalf("node %d: %v", id, err)
			}
		}
		if st := s.nsState.LookupCacheStats(); st.Hits < 2 || st.Entries < 2 {
			t.Fatalf("node %d cached nothing: %+v", id, st)
		}
	}
	put("k", 5)
	if _, err := cl.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "gone"}); err != nil {
		t.Fatal(err)
	}
	old := c.nsLeader()
	c.servers[old].Close()
	delete(c.servers, old)
	waitFor(t, 15*time.Second, "a new leader", func() bool { return c.nsLeader() != 0 })
	for range 3 {
		ki, err := cl.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k", NoLocations: true})
		if err != nil || ki.Size != 5 {
			t.Fatalf("lookup after the leader change: %v %v (an acknowledged overwrite lost or a stale record served)", ki, err)
		}
		if ki, err := cl.Lookup(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"}); err != nil || ki.Size != 5 {
			t.Fatalf("coalesced lookup after the leader change: %v %v", ki, err)
		}
		if _, err := cl.Lookup(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "gone"}); status.Code(err) != codes.NotFound {
			t.Fatalf("deleted key after the leader change: %v, want NotFound", err)
		}
	}
	caughtUp()
	for id, s := range c.servers {
		if ki, err := s.nsState.LookupKey("vol", "bkt", "k"); err != nil || ki.Size != 5 {
			t.Fatalf("node %d after the leader change: %v %v", id, ki, err)
		}
	}
	put("k", 9) // through the new leader, over its cached record
	if ki, err := cl.Lookup(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"}); err != nil || ki.Size != 9 {
		t.Fatalf("lookup after an overwrite at the new leader: %v %v", ki, err)
	}
}

// TestLookupCacheMetrics: the cache's counters are exported.
func TestLookupCacheMetrics(t *testing.T) {
	c := newClusterWith(t, 1, scm.Config{}, func(cfg *Config) { cfg.LookupCacheBytes = 32 << 20 })
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	rec := httptest.NewRecorder()
	c.servers[1].Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body := rec.Body.String()
	for _, want := range []string{"basalt_meta_lookup_cache_hits_total 0", "basalt_meta_lookup_cache_evictions_total 0",
		"basalt_meta_lookup_cache_bytes 0", "basalt_meta_lookup_cache_max_bytes 3.3554432e+07"} {
		if !strings.Contains(body, want) {
			t.Fatalf("metrics lack %q:\n%s", want, body)
		}
	}
}
