package namespace

import (
	"bytes"
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// sameAsUnmarshal checks decodeRecord against proto.Unmarshal on b: the
// same error or none, and the same message (unknown fields included),
// which does not change when the decoded bytes are overwritten.
func sameAsUnmarshal(t testing.TB, b []byte) {
	t.Helper()
	want := &metapb.KeyInfo{}
	werr := proto.Unmarshal(b, want)
	// Decoded from a copy that is then overwritten, as the cache's arena
	// chunks are reused and Pebble's value is released after the decode:
	// a decoded string aliasing its input would change with it.
	buf := append([]byte(nil), b...)
	got, gerr := decodeRecord(buf, recordNames{"vol", "bkt", "data/key-1"})
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("% x: decodeRecord error %v, proto.Unmarshal %v", b, gerr, werr)
	}
	if werr != nil {
		return
	}
	for i := range buf {
		buf[i] = 0xAA
	}
	if !proto.Equal(got, want) || !bytes.Equal(got.ProtoReflect().GetUnknown(), want.ProtoReflect().GetUnknown()) {
		t.Fatalf("% x: decodeRecord\n got %v\nwant %v", b, got, want)
	}
	// Each id belongs to its own block (the slabs are laid out right).
	for i, kb := range got.Blocks {
		if (kb.Id == nil) != (want.Blocks[i].Id == nil) {
			t.Fatalf("block %d: id %v, want %v", i, kb.Id, want.Blocks[i].Id)
		}
	}
}

// TestDecodeRecordMatchesUnmarshal: records of every shape decode as
// proto.Unmarshal decodes them: plain ones (decodeRecord's own path:
// zero, one and several blocks, blocks without an id or with an empty
// one, fields repeated), every field of KeyInfo set (the fallback: a field
// added to KeyInfo later cannot go missing from cached answers), unknown
// fields, invalid UTF-8, truncations.
func TestDecodeRecordMatchesUnmarshal(t *testing.T) {
	plain := func(blocks int) *metapb.KeyInfo {
		ki := &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: "data/key-1", Size: 4096, Replication: metapb.Replication_THREE,
			ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 65536, CreatedUnixMs: 1700000000000, ModifiedUnixMs: -5, ObjectId: 99}
		for j := range blocks {
			ki.Blocks = append(ki.Blocks, &metapb.KeyBlock{Id: &metapb.BlockID{ContainerId: uint64(j + 1), LocalId: uint64(1000 + j)}, Length: uint64(j * 7)})
		}
		return ki
	}
	var recs [][]byte
	for _, n := range []int{0, 1, 2, 5, 64} {
		b, _ := proto.Marshal(plain(n))
		recs = append(recs, b)
	}
	odd := plain(3)
	odd.Blocks[0].Id = nil
	odd.Blocks[1].Id = &metapb.BlockID{}
	odd.Blocks[2] = &metapb.KeyBlock{}
	b, _ := proto.Marshal(odd)
	recs = append(recs, b)
	one, _ := proto.Marshal(plain(1))
	recs = append(recs,
		append(append([]byte{}, one...), one...),              // every field twice: last wins, blocks add up
		append(append([]byte{}, one...), 0xf8, 0x7f, 1),       // an unknown field
		append(append([]byte{}, one...), 0x1a, 2, 0xff, 0xfe), // a name that is not UTF-8
		[]byte{0x52, 4, 0x0a, 0, 0x0a, 0},                     // a block whose id comes twice (merged)
		[]byte{0x52, 2, 0x10, 5, 0x52, 3, 0x0a, 1, 0x08},      // a block, then a truncated one
	)
	// S3 objects' records (ObjectMeta): decodeObjectMeta's path with every
	// field set, with empty strings and maps, and the shapes it leaves to
	// proto.Unmarshal (upload ACLs, the attributes twice, a map entry's
	// key twice, a value that is not UTF-8).
	for _, r := range s3Records() {
		recs = append(recs, r)
	}
	// Every field of KeyInfo set.
	full := &metapb.KeyInfo{}
	m := full.ProtoReflect()
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
	b, _ = proto.Marshal(full)
	recs = append(recs, b)
	for _, r := range recs {
		sameAsUnmarshal(t, r)
		for i := range r { // every truncation
			sameAsUnmarshal(t, r[:i])
		}
	}
	// A plain record whose strings are the names given decodes in one
	// allocation (the message, its block and id); other strings are
	// copied.
	if n := testing.AllocsPerRun(100, func() { decodeRecord(one, recordNames{"vol", "bkt", "data/key-1"}) }); n != 1 {
		t.Fatalf("decoding a one-block record allocates %.0f times, want 1", n)
	}
	if n := testing.AllocsPerRun(100, func() { decodeRecord(one, recordNames{}) }); n != 4 {
		t.Fatalf("decoding a one-block record with 3 strings not given allocates %.0f times, want 4", n)
	}
}

// s3Record is the record of an S3 object as the gateway writes it for a
// small PUT (etag, content type, a flexible checksum).
func s3Record() *metapb.KeyInfo {
	return &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: "data/key-1", Size: 4096, Replication: metapb.Replication_THREE,
		ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 65536, CreatedUnixMs: 1700000000000, ModifiedUnixMs: 1700000000000, ObjectId: 7,
		Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: 2}, Length: 4096}},
		Meta: &metapb.ObjectMeta{Etag: "0123456789abcdef0123456789abcdef", ContentType: "application/octet-stream",
			Checksums: map[string]string{"CRC32C": "yZRlqg=="}}}
}

// s3Records are encoded records with S3 attributes of every shape
// decodeRecord must decode as proto.Unmarshal does.
func s3Records() [][]byte {
	var recs [][]byte
	add := func(ki *metapb.KeyInfo) {
		b, _ := proto.Marshal(ki)
		recs = append(recs, b)
	}
	add(s3Record())
	all := s3Record()
	all.Meta = &metapb.ObjectMeta{Etag: "e", ContentType: "t", ContentEncoding: "gzip", ContentDisposition: "d", ContentLanguage: "fr",
		CacheControl: "no-cache", Expires: "Wed, 21 Oct 2015 07:28:00 GMT", User: map[string]string{"a": "1", "b": "", "": "x", "é": "ü"},
		Tags: map[string]string{"t1": "v1", "t2": "v2"}, Checksums: map[string]string{"SHA256": "abc=", "CRC32": "x"}, PartsCount: 3}
	add(all)
	empty := s3Record()
	empty.Meta = &metapb.ObjectMeta{}
	add(empty)
	acl := s3Record()
	acl.Meta.UploadAcls = []*metapb.Acl{{}}
	add(acl)
	one, _ := proto.Marshal(s3Record())
	meta, _ := proto.Marshal(s3Record().Meta)
	tagged := func(num byte, v []byte) []byte { return append([]byte{num<<3 | 2, byte(len(v))}, v...) }
	recs = append(recs,
		append(append([]byte{}, one...), tagged(13, meta)...),                                                                 // the attributes twice (merged)
		append(append([]byte{}, one...), tagged(13, tagged(8, []byte{0x0a, 1, 'k', 0x0a, 1, 'j'}))...),                        // an entry's key twice
		append(append([]byte{}, one...), tagged(13, tagged(8, []byte{0x0a, 1, 'k', 0x12, 1, 0xff}))...),                       // a value not UTF-8
		tagged(13, tagged(8, []byte{0x12, 1, 'v'})),                                                                           // an entry without a key
		tagged(13, tagged(9, []byte{0x0a, 1, 'k'})),                                                                           // a tag without a value
		tagged(13, append(tagged(10, []byte{0x0a, 1, 'k', 0x12, 1, '1'}), tagged(10, []byte{0x0a, 1, 'k', 0x12, 1, '2'})...)), // a key again: the last wins
		tagged(13, []byte{0x58, 0x80, 0x80, 0x80, 0x80, 0x10}),                                                                // parts_count past 32 bits
		tagged(13, []byte{0x0d, 1, 2, 3, 4}),                                                                                  // a fixed32 field 1
		tagged(13, []byte{0xf8, 0x7f, 1}),                                                                                     // an unknown field
	)
	return recs
}

// TestDecodeS3RecordAllocs: an S3 object's record (etag, content type, a
// checksum) decodes without proto.Unmarshal, in 5 allocations (the
// message with its block, the attributes, one copy of their strings, the
// checksums map); proto.Unmarshal took 16 (issue 15: allocations per S3
// HEAD).
func TestDecodeS3RecordAllocs(t *testing.T) {
	b, _ := proto.Marshal(s3Record())
	if _, ok := decodeOwn(b, recordNames{}); !ok {
		t.Fatal("an S3 record is not decoded by decodeRecord's own path")
	}
	names := recordNames{"vol", "bkt", "data/key-1"}
	n := testing.AllocsPerRun(100, func() { decodeRecord(b, names) })
	u := testing.AllocsPerRun(100, func() { proto.Unmarshal(b, &metapb.KeyInfo{}) })
	t.Logf("decodeRecord %.0f allocations, proto.Unmarshal %.0f", n, u)
	if n > 5 {
		t.Fatalf("decoding an S3 record allocates %.0f times, want at most 5", n)
	}
}

// FuzzDecodeRecord: decodeRecord never panics and agrees with
// proto.Unmarshal on any input.
func FuzzDecodeRecord(f *testing.F) {
	for _, n := range []int{0, 1, 3} {
		ki := &metapb.KeyInfo{Volume: "v", Name: "n", Size: 1}
		for j := range n {
			ki.Blocks = append(ki.Blocks, &metapb.KeyBlock{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(j)}, Length: 3})
		}
		b, _ := proto.Marshal(ki)
		f.Add(b)
	}
	for _, r := range s3Records() {
		f.Add(r)
	}
	f.Fuzz(func(t *testing.T, b []byte) { sameAsUnmarshal(t, b) })
}

// TestLookupCacheComparesKeys: an index slot found by a key's hash holds
// another key's entry (hashes collide): the lookup misses.
func TestLookupCacheComparesKeys(t *testing.T) {
	c := newLookupCache(1 << 20)
	rec, _ := proto.Marshal(&metapb.KeyInfo{Name: "a", Size: 1})
	a, b := []byte("k/a"), []byte("k/b")
	_, _, gen := c.get(a, recordNames{})
	c.put(a, gen, rec)
	if ki, _, _ := c.get(a, recordNames{}); ki.GetSize() != 1 {
		t.Fatal("a is not cached")
	}
	ha, hb := maphash.Bytes(c.seed, a), maphash.Bytes(c.seed, b)
	sha, shb := &c.shards[ha&(lookupShards-1)], &c.shards[hb&(lookupShards-1)]
	shb.mu.Lock()
	if shb.idx == nil {
		shb.idx = map[uint64]uint32{}
	}
	if sha != shb { // make b's slot point at a's entry, in b's shard
		shb.chunks, shb.fill = sha.chunks, sha.fill
	}
	shb.idx[hb] = sha.idx[ha]
	shb.mu.Unlock()
	if ki, _, _ := c.get(b, recordNames{}); ki != nil {
		t.Fatalf("b's lookup returned a's record %v", ki)
	}
}

// TestLookupCacheSecondChance: keys hit again and again stay while a
// stream of keys read once passes through a cache many times too small
// for it; without the reference bits (every reclaim dropping its whole
// chunk) the hot keys are evicted with the rest.
func TestLookupCacheSecondChance(t *testing.T) {
	c := newLookupCache(lookupShards * 64 << 10) // 64 KiB per shard: ~40,000 entries
	rec, _ := proto.Marshal(&metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: "x", Size: 1,
		Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: 2}, Length: 1}}})
	lookup := func(k []byte) bool {
		ki, _, gen := c.get(k, recordNames{})
		if ki == nil {
			c.put(k, gen, rec)
		}
		return ki != nil
	}
	hot := func(i int) []byte { return fmt.Appendf(nil, "hot-%04d", i) }
	const nhot = 200 // each hit every 2,000 keys of the stream; the cache turns over every ~40,000
	for i := range nhot {
		lookup(hot(i))
	}
	misses := 0
	for i := range 2_000_000 {
		lookup(fmt.Appendf(nil, "once-%08d", i))
		if i%10 == 0 && !lookup(hot(i/10%nhot)) {
			misses++
		}
	}
	st := c.stats()
	t.Logf("hot misses %d of %d; %+v", misses, 2_000_000/10, st)
	if st.Evictions < 1_000_000 {
		t.Fatalf("the stream did not churn the cache: %+v", st)
	}
	if misses > nhot {
		t.Fatalf("hot keys missed %d times after their first read (at most %d expected)", misses, nhot)
	}
}

// TestLookupCacheChurnConcurrent: readers look up keys spread over far
// more than the cache holds (every shard reclaims chunks, moving the
// entries hit since written) and a hot key, while a writer changes the
// hot key the way Apply does (begin, commit, end): no reader sees a
// version older than one committed before its lookup began. Run with
// -race.
func TestLookupCacheChurnConcurrent(t *testing.T) {
	c := newLookupCache(lookupShards * 16 << 10)
	var store sync.Map // Pebble key -> encoded record (committed state)
	hotKey := []byte("key-hot")
	enc := func(v uint64) []byte {
		b, _ := proto.Marshal(&metapb.KeyInfo{Name: "n", Size: v, Blocks: []*metapb.KeyBlock{{Length: v}}})
		return b
	}
	var committed atomic.Uint64
	store.Store(string(hotKey), enc(1))
	committed.Store(1)
	read := func(k []byte) *metapb.KeyInfo {
		ki, _, gen := c.get(k, recordNames{})
		if ki != nil {
			return ki
		}
		v, ok := store.Load(string(k))
		if !ok {
			v, _ = store.LoadOrStore(string(k), enc(1<<40))
		}
		c.put(k, gen, v.([]byte))
		ki = &metapb.KeyInfo{}
		if err := proto.Unmarshal(v.([]byte), ki); err != nil {
			panic(err)
		}
		return ki
	}
	stop := make(chan struct{})
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(g), 1))
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				read(fmt.Appendf(nil, "key-%d", rnd.IntN(200_000)))
				if n%4 == 0 {
					want := committed.Load()
					if got := read(hotKey).Size; got < want {
						errs <- fmt.Errorf("stale: version %d after %d committed", got, want)
						return
					}
				}
			}
		}()
	}
	deadline := time.Now().Add(3 * time.Second)
	for v := uint64(2); time.Now().Before(deadline) && len(errs) == 0; v++ {
		mask := c.begin([]string{string(hotKey)})
		store.Store(string(hotKey), enc(v))
		c.end(mask)
		committed.Store(v)
		time.Sleep(20 * time.Microsecond)
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
	if st.Evictions == 0 || st.Hits == 0 {
		t.Fatalf("the cache never evicted or never hit: %+v", st)
	}
}

// TestLookupCacheNoGCWork: a full cache holds no pointers for the
// collector to mark: a GC cycle with it full takes about as long as
// without it (the decoded-record cache of session 9 made the collector
// mark ~100 MB of records).
func TestLookupCacheNoGCWork(t *testing.T) {
	c := newLookupCache(64 << 20)
	rec, _ := proto.Marshal(&metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: "data/part-001/key-00000001", Size: 4096,
		Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: 2}, Length: 4096}}})
	for i := 0; c.stats().Evictions == 0; i++ {
		k := fmt.Appendf(nil, "k/%08d", i)
		_, _, gen := c.get(k, recordNames{})
		c.put(k, gen, rec)
		if i > 5_000_000 {
			t.Fatal("never full")
		}
	}
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	scan := ms.HeapAlloc
	st := c.stats()
	// The heap the collector scans: GOGC's scannable heap is not
	// exported; HeapObjects counts the objects, each of which a pointer
	// graph would make one to mark.
	t.Logf("%d entries, %.1f MiB counted, heap %.1f MiB in %d objects", st.Entries, float64(st.Bytes)/(1<<20), float64(scan)/(1<<20), ms.HeapObjects)
	if ms.HeapObjects > uint64(st.Entries)/10 {
		t.Fatalf("%d heap objects for %d entries: entries are not in pointer-free chunks", ms.HeapObjects, st.Entries)
	}
	runtime.KeepAlive(c)
}

// TestLookupCacheReclaimBounded: one insert does a bounded amount of
// work under its shard's lock even when every cached entry was hit since
// written (a working set of about the cache's size): it reclaims at most
// a chunk or two, not the whole shard in a row before it can evict
// anything (4-22 ms at 128 MiB on a loaded machine). The work counted is
// the bytes of chunks scanned; the time bound is loose (a loaded 2-core
// machine preempts).
func TestLookupCacheReclaimBounded(t *testing.T) {
	c := newLookupCache(32 << 20)
	rec, _ := proto.Marshal(&metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: "p/00000000", Size: 4096, Replication: metapb.Replication_THREE,
		Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: 7}, Length: 4096}}})
	key := func(i int) []byte { return fmt.Appendf(nil, "k/%09d", i) }
	n := 0
	for ; c.stats().Evictions < 100_000; n++ {
		_, _, gen := c.get(key(n), recordNames{})
		c.put(key(n), gen, rec)
	}
	work := func() (w int64) {
		for i := range c.shards {
			w += c.shards[i].work
		}
		return w
	}
	for round := range 2 {
		// Hit every key still cached, then insert new ones.
		for i := range n {
			c.get(key(i), recordNames{})
		}
		ev := c.stats().Evictions
		var worst time.Duration
		var maxWork int64
		// 5000 new keys, and more until one eviction (the key hash's seed
		// is random, so a round's room before the first eviction varies).
		i := n
		for ; i < n+5000 || (c.stats().Evictions == ev && i < n+200_000); i++ {
			_, _, gen := c.get(key(i), recordNames{})
			w0, t0 := work(), time.Now()
			c.put(key(i), gen, rec)
			worst = max(worst, time.Since(t0))
			maxWork = max(maxWork, work()-w0)
		}
		n = i
		st := c.stats()
		t.Logf("round %d: %d entries, slowest put of the new keys %v, most bytes scanned by one put %d (chunk %d), evicted %d",
			round, st.Entries, worst, maxWork, c.chunk, st.Evictions-ev)
		if maxWork > int64(2*c.chunk) {
			t.Errorf("one put scanned %d bytes of chunks (a chunk is %d)", maxWork, c.chunk)
		}
		if worst > 100*time.Millisecond {
			t.Errorf("slowest put %v", worst)
		}
		if st.Evictions == ev || st.Bytes > st.MaxBytes {
			t.Errorf("no eviction or over the bound: %+v", st)
		}
	}
}

// TestLookupCacheTinyChurn: a tiny cache (8 KiB a shard: two chunks,
// each reclaim takes the chunk the head just left, releases and
// partial second chances at every turn), many keys changed the way Apply
// changes them (begin, commit, end) while three readers look them up:
// every answer is the key's own record, at a version no older than the
// one committed before the lookup began. Run with -race.
func TestLookupCacheTinyChurn(t *testing.T) {
	c := newLookupCache(lookupShards * 8 << 10)
	var mu sync.RWMutex
	store := map[string][]byte{}
	ver := map[string]uint64{}
	enc := func(name string, v uint64) []byte {
		b, _ := proto.Marshal(&metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: name, Size: v, Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: v, LocalId: v}, Length: v}}})
		return b
	}
	const nkeys = 3000
	for i := range nkeys {
		n := fmt.Sprintf("k%05d", i)
		store[n], ver[n] = enc(n, 1), 1
	}
	stop := make(chan struct{})
	errs := make(chan error, 8)
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(g), 2))
			for {
				select {
				case <-stop:
					return
				default:
				}
				n := fmt.Sprintf("k%05d", rnd.IntN(nkeys))
				k := []byte(n)
				mu.RLock()
				want := ver[n]
				mu.RUnlock()
				ki, _, gen := c.get(k, recordNames{"vol", "bkt", n})
				if ki == nil {
					mu.RLock()
					v := store[n]
					mu.RUnlock()
					c.put(k, gen, v)
					continue
				}
				if ki.Name != n || ki.Size < want || ki.Blocks[0].Id.LocalId != ki.Size {
					errs <- fmt.Errorf("key %s: got %v, want version >= %d", n, ki, want)
					return
				}
			}
		}()
	}
	deadline := time.Now().Add(2 * time.Second)
	rnd := rand.New(rand.NewPCG(9, 9))
	for time.Now().Before(deadline) && len(errs) == 0 {
		n := fmt.Sprintf("k%05d", rnd.IntN(nkeys))
		mask := c.begin([]string{n})
		mu.Lock()
		ver[n]++
		store[n] = enc(n, ver[n])
		mu.Unlock()
		c.end(mask)
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
	if st.Hits == 0 || st.Evictions == 0 || st.Bytes > st.MaxBytes {
		t.Fatalf("the cache never hit, never evicted or went over its bound: %+v", st)
	}
}
