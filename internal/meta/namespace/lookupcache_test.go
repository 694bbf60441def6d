package namespace

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// lookupCode looks key up as ctx's caller (filling the cache).
func (e *nsEnv) lookupCode(t *testing.T, ctx context.Context, bkt, key string) (*metapb.KeyInfo, codes.Code) {
	t.Helper()
	ki, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: bkt, Key: key, NoLocations: true})
	return ki, statusCode(err)
}

func (e *nsEnv) wantSize(t *testing.T, bkt, key string, size uint64, what string) {
	t.Helper()
	for range 3 { // the second miss caches the record, the third answer hits
		ki, c := e.lookupCode(t, e.ctx, bkt, key)
		if c != codes.OK || ki.Size != size {
			t.Fatalf("%s: lookup %s/%s: size %d code %v, want size %d", what, bkt, key, ki.GetSize(), c, size)
		}
	}
}

func (e *nsEnv) wantMissing(t *testing.T, bkt, key, what string) {
	t.Helper()
	for range 2 {
		if _, c := e.lookupCode(t, e.ctx, bkt, key); c != codes.NotFound {
			t.Fatalf("%s: lookup %s/%s: code %v, want NotFound", what, bkt, key, c)
		}
	}
}

// TestLookupCacheNeverStale warms the cache with every key, then changes
// the keys with every kind of write of key records (overwrite, delete,
// rename, rename over a key, metadata, ACL, copy, multipart completion,
// bucket re-created under the same name) and checks each lookup after
// the write's acknowledgement sees it.
func TestLookupCacheNeverStale(t *testing.T) {
	e := newNS(t)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	for i, k := range []string{"a", "b", "c", "d", "e", "f"} {
		e.put(t, "vol", "bkt", k, uint64(10+i))
		e.wantSize(t, "bkt", k, uint64(10+i), "first write")
	}
	st := e.st.LookupCacheStats()
	if st.Hits < 6 || st.Entries < 6 {
		t.Fatalf("the cache served nothing: %+v", st)
	}

	e.put(t, "vol", "bkt", "a", 100)
	e.wantSize(t, "bkt", "a", 100, "overwrite")

	if _, err := e.s.DeleteKey(e.ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "b"}); err != nil {

		t.Fatal(err)

	}
	e.wantMissing(t, "bkt", "b", "delete")

	if _, err := e.s.RenameKey(e.ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "bkt", Key: "c", NewKey: "c2"}); err != nil {

		t.Fatal(err)

	}
	e.wantMissing(t, "bkt", "c", "rename source")
	e.wantSize(t, "bkt", "c2", 12, "rename destination")
	if _, err := e.s.RenameKey(e.ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "bkt", Key: "c2", NewKey: "d", Overwrite: true}); err != nil {
		t.Fatal(err)
	}
	e.wantSize(t, "bkt", "d", 12, "rename over a cached key")
	if ki, _ := e.lookupCode(t, e.ctx, "bkt", "d"); ki.GetName() != "d" {
		t.Fatalf("renamed key's name %q, want d", ki.GetName())
	}

	e.now = e.now.Add(time.Second)
	ki, _ := e.lookupCode(t, e.ctx, "bkt", "e")
	if _, err := e.s.SetKeyMeta(e.ctx, &metapb.SetKeyMetaRequest{Volume: "vol", Bucket: "bkt", Key: "e", Meta: &metapb.ObjectMeta{Etag: "x1"}, ExpectObjectId: ki.ObjectId}); err != nil {
		t.Fatal(err)
	}
	if ki, _ := e.lookupCode(t, e.ctx, "bkt", "e"); ki.GetMeta().GetEtag() != "x1" {
		t.Fatalf("metadata change not seen: %v", ki)
	}

	// ACL of a key: bob may not read f (bucket 0700 of alice), then may
	// (his own ACL entry on the key), then may not again.
	bob := e.as("bob")
	if _, c := e.lookupCode(t, bob, "bkt", "f"); c != codes.PermissionDenied {
		t.Fatalf("bob before the grant: %v", c)
	}
	must(t, e.setAcl(t, e.ctx, ref("bkt", "f"), metapb.AclOp_ACL_ADD, user("bob", rR)))
	if ki, c := e.lookupCode(t, bob, "bkt", "f"); c != codes.OK || len(ki.Acls) == 0 {
		t.Fatalf("bob after the grant: %v %v", c, ki)
	}
	must(t, e.setAcl(t, e.ctx, ref("bkt", "f"), metapb.AclOp_ACL_REMOVE, user("bob", rR)))
	if _, c := e.lookupCode(t, bob, "bkt", "f"); c != codes.PermissionDenied {
		t.Fatalf("bob after the removal: %v", c)
	}

	if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "a", Bucket: "bkt", Key: "f"}); err != nil {
		t.Fatal(err)
	}
	e.wantSize(t, "bkt", "f", 100, "copy over a cached key")

	u, err := e.s.CreateMultipartUpload(e.ctx, &metapb.CreateMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "d"})
	if err != nil {
		t.Fatal(err)
	}
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "d"})
	if err != nil {
		t.Fatal(err)
	}
	part, err := e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 77}},
		Part: &metapb.PartRef{UploadId: u.UploadId, PartNumber: 1, Etag: "0123456789abcdef0123456789abcdef"}})
	if err != nil {
		t.Fatal(err)
	}
	e.wantSize(t, "bkt", "d", 12, "part uploaded (the key is unchanged)")
	if _, err := e.s.CompleteMultipartUpload(e.ctx, &metapb.CompleteMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "d", UploadId: u.UploadId,
		Parts: []*metapb.CompletedPart{{PartNumber: 1, Etag: part.Meta.GetEtag()}}}); err != nil {
		t.Fatal(err)
	}
	e.wantSize(t, "bkt", "d", 77, "multipart completion over a cached key")

	// Bucket deleted and re-created under the same name: its keys are gone.
	for _, k := range []string{"a", "d", "e", "f"} {
		if _, err := e.s.DeleteKey(e.ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: k}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.s.DeleteBucket(e.ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	e.wantMissing(t, "bkt", "a", "bucket re-created")
}

// TestLookupCacheRestore: a replica that cached a key, then installs a
// snapshot of a state where the key was overwritten or deleted, serves
// the snapshot's records.
func TestLookupCacheRestore(t *testing.T) {
	a, b := newNS(t), newNS(t)
	for _, e := range []*nsEnv{a, b} {
		if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
			t.Fatal(err)
		}
		e.put(t, "vol", "bkt", "k", 1)
		e.put(t, "vol", "bkt", "gone", 2)
		e.wantSize(t, "bkt", "k", 1, "before")
		e.wantSize(t, "bkt", "gone", 2, "before")
	}
	a.put(t, "vol", "bkt", "k", 5)
	if _, err := a.s.DeleteKey(a.ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "gone"}); err != nil {
		t.Fatal(err)
	}
	for range 10 { // a's log runs ahead of b's
		a.put(t, "vol", "bkt", "other", 3)
	}
	idx, rc, err := a.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(rc); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if err := b.st.Restore(idx, &buf); err != nil {
		t.Fatal(err)
	}
	b.s.raft.(*fakeRaft).idx = idx
	b.wantSize(t, "bkt", "k", 5, "after restore")
	b.wantMissing(t, "bkt", "gone", "after restore")
}

// TestLookupCacheConcurrentWriter overwrites one key again and again
// while 8 readers look it up: a reader that starts after a version was
// acknowledged must see it or a newer one. Without the invalidation
// around the commit (tx.noteKey) it fails within a few versions.
func TestLookupCacheConcurrentWriter(t *testing.T) {
	e := newNS(t)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	e.put(t, "vol", "bkt", "hot", 1)
	var acked atomic.Uint64
	acked.Store(1)
	stop := make(chan struct{})
	errs := make(chan error, 16)
	var wg sync.WaitGroup
	var reads atomic.Int64
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				want := acked.Load()
				ki, err := e.s.LookupKey(e.ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "hot", NoLocations: true})
				if err != nil {
					errs <- err
					return
				}
				if ki.Size < want {
					errs <- fmt.Errorf("stale lookup: size %d after %d was acknowledged", ki.Size, want)
					return
				}
				reads.Add(1)
			}
		}()
	}
	deadline := time.Now().Add(3 * time.Second)
	v := uint64(1)
	for ; v < 400 && time.Now().Before(deadline) && len(errs) == 0; v++ {
		e.put(t, "vol", "bkt", "hot", v+1)
		acked.Store(v + 1)
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatalf("after %d versions: %v", v, err)
	default:
	}
	st := e.st.LookupCacheStats()
	t.Logf("%d versions, %d lookups, cache %+v", v, reads.Load(), st)
	if st.Hits == 0 {
		t.Fatal("no lookup was served from the cache: the test checks nothing")
	}
}

// TestLookupCacheBounded fills a small cache with far more records than
// fit: its estimate stays under the bound, and so does the heap it holds.
func TestLookupCacheBounded(t *testing.T) {
	const limit = 4 << 20
	c := newLookupCache(limit)
	rec := func(i int) []byte {
		ki := &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("data/part-%03d/key-%08d", i%100, i), Size: 4096,
			ObjectId: uint64(i), Meta: &metapb.ObjectMeta{Etag: fmt.Sprintf("%032x", i), ContentType: "application/octet-stream"},
			Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i + 1)}, Length: 4096}}}
		v, _ := proto.Marshal(ki)
		return v
	}
	fill := func(from, n int) {
		for i := from; i < from+n; i++ {
			v := rec(i)
			k := objKey(7, fmt.Sprintf("data/part-%03d/key-%08d", i%100, i))
			if ki, _, gen := c.get(k, recordNames{}); ki == nil {
				c.put(k, gen, v)
			}
		}
	}
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	fill(0, 200_000)
	after := heap()
	st := c.stats()
	t.Logf("stats %+v; heap held %.1f MiB for a %.1f MiB bound", st, float64(after-before)/(1<<20), float64(limit)/(1<<20))
	if st.Bytes > limit || st.Evictions == 0 || st.Entries == 0 {
		t.Fatalf("cache over its bound or never evicted: %+v", st)
	}
	if held := int64(after) - int64(before); held > limit*3/2 {
		t.Fatalf("the cache holds %d bytes of heap for a bound of %d", held, limit)
	}
	runtime.KeepAlive(c)
}

// BenchmarkLookupCacheParallel: LookupKey of cached keys from 64
// goroutines (on this machine's cores), against the cache turned off;
// contention on the shards shows as ns/op growing with parallelism.
func BenchmarkLookupCacheParallel(b *testing.B) {
	for _, on := range []bool{true, false} {
		b.Run(fmt.Sprintf("cache=%v", on), func(b *testing.B) {
			e := newNS(b)
			if !on {
				e.st.SetLookupCacheBytes(-1)
			}
			if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
				b.Fatal(err)
			}
			if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
				b.Fatal(err)
			}
			const n = 10_000
			var keys []*metapb.KeyInfo
			for i := range n {
				keys = append(keys, &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("data/part-%03d/key-%08d", i%100, i), Size: 4096,
					Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i + 1)}, Length: 4096}}})
			}
			bk, err := e.st.GetBucket("vol", "bkt")
			if err != nil {
				b.Fatal(err)
			}
			if err := e.st.BulkLoadObjectKeys(bk.Id, keys); err != nil {
				b.Fatal(err)
			}
			var next atomic.Int64
			b.SetParallelism(64 / runtime.GOMAXPROCS(0))
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(7919))
				for pb.Next() {
					i += 7919
					if _, err := e.s.LookupKey(e.ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: keys[i%n].Name, NoLocations: true}); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
