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
	"google.golang.org/protobuf/reflect/protoreflect"

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
			ki := &metapb.KeyInfo{}
			must(t, proto.Unmarshal(v, ki))
			k := objKey(7, ki.Name)
			for range 2 { // a key is admitted on its second miss
				if e, gen := c.get(k); e == nil {
					c.put(k, gen, ki, len(v))
				}
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
		t.Fatalf("the cache holds %d bytes of heap for a bound of %d: entryCost underestimates", held, limit)
	}
	runtime.KeepAlive(c)
}

// TestCopyKeyInfoCopiesEveryField sets every field of a KeyInfo and
// checks copyKeyInfo's copy equals it, so a field added to KeyInfo
// cannot go missing from cached answers.
func TestCopyKeyInfoCopiesEveryField(t *testing.T) {
	src := &metapb.KeyInfo{}
	m := src.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.IsList():
			l := m.Mutable(fd).List()
			l.Append(l.NewElement())
		case fd.Message() != nil:
			m.Mutable(fd)
		case fd.Kind() == protoreflect.StringKind:
			m.Set(fd, protoreflect.ValueOfString("s"))
		case fd.Kind() == protoreflect.EnumKind:
			m.Set(fd, protoreflect.ValueOfEnum(1))
		case fd.Kind() == protoreflect.Uint64Kind:
			m.Set(fd, protoreflect.ValueOfUint64(3))
		case fd.Kind() == protoreflect.Uint32Kind:
			m.Set(fd, protoreflect.ValueOfUint32(4))
		case fd.Kind() == protoreflect.Int64Kind:
			m.Set(fd, protoreflect.ValueOfInt64(5))
		default:
			t.Fatalf("field %s of kind %v: extend this test", fd.Name(), fd.Kind())
		}
		if !m.Has(fd) {
			t.Fatalf("field %s not set", fd.Name())
		}
	}
	m.SetUnknown(protoreflect.RawFields{0xf8, 0x7f, 0x01}) // field 2047, varint 1
	got := copyKeyInfo(src)
	if !proto.Equal(got, src) || !bytes.Equal(got.ProtoReflect().GetUnknown(), src.ProtoReflect().GetUnknown()) {
		t.Fatalf("copy differs:\n got %v\nwant %v", got, src)
	}
	got.Locations = append(got.Locations, &metapb.BlockLocation{})
	if len(src.Locations) != 1 {
		t.Fatal("appending to the copy's Locations changed the cached record")
	}
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

// TestLookupCacheAdmission: a shard with room keeps a record on its
// first miss; a full one only on the key's second miss, so keys read once
// do not push out the ones read again.
func TestLookupCacheAdmission(t *testing.T) {
	c := newLookupCache(lookupShards * 64 << 10) // 64 KiB per shard
	ki := &metapb.KeyInfo{Name: "k"}
	miss := func(k []byte) bool {
		e, gen := c.get(k)
		return e == nil && c.put(k, gen, ki, 100)
	}
	if !miss([]byte("first")) {
		t.Fatal("a cache with room did not keep a record on its first miss")
	}
	sh := &c.shards[c.shardOf([]byte("once"))]
	for i := 0; !sh.full.Load(); i++ { // fill once's shard (and others)
		if i > 1_000_000 {
			t.Fatal("a shard never got full")
		}
		k := fmt.Appendf(nil, "fill-%d", i)
		miss(k)
		miss(k)
	}
	if miss([]byte("once")) {
		t.Fatal("a full shard kept a record on its key's first miss")
	}
	if !miss([]byte("once")) {
		t.Fatal("a full shard did not keep a record on its key's second miss")
	}
	if e, _ := c.get([]byte("once")); e == nil {
		t.Fatal("the admitted record is not cached")
	}
}

// TestLookupCacheAdaptiveBypass looks up keys spread evenly over 45x
// what the cache holds: once full and rarely hit, the cache bypasses
// itself (a small sample of keys, most lookups skip the probe). A hot set
// that fits then turns it back on and is served from it; so does a hot
// set of three keys (the sampled class moves until it holds one of them).
func TestLookupCacheAdaptiveBypass(t *testing.T) {
	const limit = lookupShards * 256 << 10 // 16 MiB: ~22,000 entries of cost ~740; bypassed, ~22 per shard
	c := newLookupCache(limit)
	ki := &metapb.KeyInfo{Name: "k"}
	lookup := func(k []byte) {
		if e, gen := c.get(k); e == nil {
			c.put(k, gen, ki, 100)
		}
	}
	key := func(i uint64) []byte { return fmt.Appendf(nil, "key-%08d", i) }
	rnd := uint64(1)
	next := func(n uint64) uint64 { // xorshift: the same sequence every run
		rnd ^= rnd << 13
		rnd ^= rnd >> 7
		rnd ^= rnd << 17
		return rnd % n
	}
	deadline := time.Now().Add(20 * time.Second)
	run := func(what string, keys uint64, until func(LookupCacheStats) bool) LookupCacheStats {
		t.Helper()
		for n := 0; ; n++ {
			lookup(key(next(keys)))
			if n%1024 == 0 {
				if st := c.stats(); until(st) {
					t.Logf("%s: after %d lookups %+v", what, n, st)
					return st
				}
				if n > 4_000_000 || time.Now().After(deadline) {
					t.Fatalf("%s: not reached after %d lookups: %+v", what, n, c.stats())
				}
			}
		}
	}
	uniform := func(st LookupCacheStats) bool { return st.Bypassing }
	st := run("uniform over 1M keys", 1_000_000, uniform)
	// Stay uniform for a while: it remains bypassed, small, and most
	// lookups skip the probe.
	before := st
	for range 200_000 {
		lookup(key(next(1_000_000)))
	}
	st = c.stats()
	t.Logf("uniform, bypassed: %+v", st)
	if !st.Bypassing || st.ModeChanges != before.ModeChanges {
		t.Fatalf("the uniform workload left the bypass: %+v", st)
	}
	if st.Bytes > limit/bypassDiv {
		t.Fatalf("bypassed cache holds %d bytes, more than 1/%d of %d", st.Bytes, bypassDiv, limit)
	}
	if skipped := st.Skipped - before.Skipped; skipped < 200_000*3/4 {
		t.Fatalf("only %d of 200,000 uniform lookups skipped the cache", skipped)
	}

	hot := func(st LookupCacheStats) bool { return !st.Bypassing }
	run("hot set of 500 keys", 500, hot)
	// Served: a hot key hits.
	for range 3 {
		for i := range uint64(500) {
			lookup(key(i))
		}
	}
	st = c.stats()
	for i := range uint64(500) {
		if e, _ := c.get(key(i)); e == nil {
			t.Fatalf("hot key %d not cached after the cache turned back on: %+v", i, st)
		}
	}

	run("uniform again", 1_000_000, uniform)
	run("hot set of 3 keys", 3, hot)
	for i := range uint64(3) {
		lookup(key(i))
		lookup(key(i))
		if e, _ := c.get(key(i)); e == nil {
			t.Fatalf("hot key %d not cached: %+v", i, c.stats())
		}
	}
}

// TestLookupCacheBypassConcurrent switches the cache between serving and
// bypassing (readers alternate uniform and hot phases) while a writer
// changes one hot key the way Apply does (begin, commit, end): no reader
// sees a version older than one committed before its lookup began. Run
// with -race.
func TestLookupCacheBypassConcurrent(t *testing.T) {
	c := newLookupCache(lookupShards * 64 << 10)
	var store sync.Map // Pebble key -> *metapb.KeyInfo (committed state)
	hotKey := []byte("key-hot")
	var committed atomic.Uint64
	store.Store(string(hotKey), &metapb.KeyInfo{Size: 0})
	read := func(k []byte) *metapb.KeyInfo {
		e, gen := c.get(k)
		if e != nil {
			return e.ki
		}
		v, ok := store.Load(string(k))
		if !ok {
			ki := &metapb.KeyInfo{Size: 1 << 40}
			store.LoadOrStore(string(k), ki)
			v, _ = store.Load(string(k))
		}
		c.put(k, gen, v.(*metapb.KeyInfo), 100)
		return v.(*metapb.KeyInfo)
	}
	stop := make(chan struct{})
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := uint64(g + 1)
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				rnd ^= rnd << 13
				rnd ^= rnd >> 7
				rnd ^= rnd << 17
				if !c.bypass.Load() { // drive it to the other mode
					read(fmt.Appendf(nil, "key-%d", rnd%1_000_000))
				} else {
					read(fmt.Appendf(nil, "key-%d", rnd%200))
				}
				if n%16 == 0 {
					want := committed.Load()
					if got := read(hotKey).Size; got < want {
						errs <- fmt.Errorf("stale: version %d after %d committed", got, want)
						return
					}
				}
			}
		}()
	}
	deadline := time.Now().Add(20 * time.Second)
	for v := uint64(1); c.changes.Load() < 4 && time.Now().Before(deadline) && len(errs) == 0; v++ {
		mask := c.begin([]string{string(hotKey)})
		store.Store(string(hotKey), &metapb.KeyInfo{Size: v})
		c.end(mask)
		committed.Store(v)
		time.Sleep(50 * time.Microsecond)
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	st := c.stats()
	t.Logf("%+v", st)
	if st.ModeChanges < 4 || st.Hits == 0 {
		t.Fatalf("the cache did not switch both ways, or never hit: %+v", st)
	}
}

// TestLookupCacheBypassKeepsWorkingSet reads a working set once: while
// the cache has room, keys read for the first time do not make it bypass
// itself; once it is nearly full it does (they look like uniform lookups).
// Then the set is read over and over: the sampled keys hit, and the cache
// serves again with the entries read before the bypass still there (it
// had not shrunk).
func TestLookupCacheBypassKeepsWorkingSet(t *testing.T) {
	const limit = lookupShards * 1 << 20 // 64 MiB: ~90,000 entries of cost ~744
	c := newLookupCache(limit)
	ki := &metapb.KeyInfo{Name: "k"}
	lookup := func(k []byte) {
		if e, gen := c.get(k); e == nil {
			c.put(k, gen, ki, 100)
		}
	}
	key := func(i int) []byte { return fmt.Appendf(nil, "key-%08d", i) }
	set := 0
	for ; set < 60_000; set++ {
		lookup(key(set))
	}
	if st := c.stats(); st.Bypassing {
		t.Fatalf("reading %d keys once into a cache with room for more made it bypass itself: %+v", set, st)
	}
	for ; !c.bypass.Load(); set++ {
		if set > 200_000 {
			t.Fatalf("a cache nearly full of keys read once never bypassed itself: %+v", c.stats())
		}
		lookup(key(set))
	}
	st := c.stats()
	t.Logf("after reading %d keys once: %+v", set, st)
	if st.Shrunk || st.Evictions > 0 {
		t.Fatalf("want bypassing, not shrunk, nothing evicted: %+v", st)
	}
	held := st.Entries
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; c.bypass.Load(); i++ {
		lookup(key(i % set))
		if time.Now().After(deadline) || i > 2_000_000 {
			t.Fatalf("the working set never turned the cache back on: %+v", c.stats())
		}
	}
	st = c.stats()
	t.Logf("serving again: %+v", st)
	if st.ModeChanges != 2 || st.Entries < held {
		t.Fatalf("the cache shrank before serving again (%d entries held when it began bypassing): %+v", held, st)
	}
}
