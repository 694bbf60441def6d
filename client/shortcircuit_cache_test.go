package client

import (
	"bytes"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// cachedFile maps a block file of data and returns it as fetchShared
// builds one (one reference: the caller's).
func cachedFile(t testing.TB, data []byte) *scBlockFile {
	t.Helper()
	f, bd := blockOnDisk(t, data)
	bf := &scBlockFile{f: f, bd: bd, m: mapBlockFile(f, bd.Length)}
	if bf.m == nil {
		t.Fatal("not mapped")
	}
	bf.populated = make([]atomic.Uint64, (len(bf.m)/popUnit+64)/64)
	bf.refs.Store(1)
	return bf
}

// TestSCCacheTickDropsUnlinked: the expiry tick drops (closes and
// unmaps) a cached file whose block was deleted although it is not idle,
// keeps the linked one, and clears its populated bits; an unlinked file a
// reader still uses leaves the cache at once and is closed by the
// reader's release. Before, a deleted block's file stayed open until it
// was idle (60-90 s), and populated bits were never cleared.
func TestSCCacheTickDropsUnlinked(t *testing.T) {
	s := &scCache{idle: time.Hour}
	defer s.close()
	data := randBytes(20, 1<<20+77)
	a, b, c := cachedFile(t, data), cachedFile(t, data), cachedFile(t, data)
	ka, kb, kc := scKey{1, 1, 1}, scKey{1, 1, 2}, scKey{1, 1, 3}
	for _, x := range []struct {
		k  scKey
		bf *scBlockFile
	}{{ka, a}, {kb, b}, {kc, c}} {
		s.insert(x.k, x.bf)
		x.bf.release() // the cache's reference remains
	}
	n := int64(len(data))
	if err := b.verify(0, n, 0, n); err != nil || b.populated[0].Load() == 0 {
		t.Fatalf("verify: %v, populated %b", err, b.populated[0].Load())
	}
	if !c.acquire() { // a reader of c
		t.Fatal("c released")
	}
	for _, bf := range []*scBlockFile{a, c} {
		if err := os.Remove(bf.f.Name()); err != nil {
			t.Fatal(err)
		}
	}
	s.expire()
	if s.has(ka) || s.has(kc) || !s.has(kb) {
		t.Fatalf("after the tick: a cached %v, b %v, c %v; want only b (linked)", s.has(ka), s.has(kb), s.has(kc))
	}
	if a.refs.Load() != 0 || a.m != nil {
		t.Fatalf("unlinked unused file: %d refs, mapped %v; want closed and unmapped", a.refs.Load(), a.m != nil)
	}
	if c.refs.Load() != 1 || c.m == nil {
		t.Fatalf("unlinked file in use: %d refs, mapped %v; want the reader's reference and the mapping", c.refs.Load(), c.m != nil)
	}
	if err := c.verify(0, n, 0, n); err != nil {
		t.Fatalf("reader of the unlinked file: %v", err)
	}
	c.release()
	if c.m != nil {
		t.Fatal("unlinked file still mapped after the last release")
	}
	if got := b.populated[0].Load(); got != 0 {
		t.Fatalf("populated %b after the tick, want cleared", got)
	}
	if err := b.verify(0, n, 0, n); err != nil || b.populated[0].Load() == 0 {
		t.Fatalf("verify after the tick: %v, populated %b", err, b.populated[0].Load())
	}
	if s.invalidated != 2 || s.evicted != 0 {
		t.Fatalf("invalidated %d, evicted %d; want 2, 0", s.invalidated, s.evicted)
	}
}

// TestSCCacheLongerReplica: a cached file serves every location of its
// block no longer than it (reads stay below the location's length); a
// longer location drops it. Before, any other length dropped it, so
// readers of a block whose replica had grown churned the entry.
func TestSCCacheLongerReplica(t *testing.T) {
	s := &scCache{idle: time.Hour}
	defer s.close()
	data := randBytes(21, 1<<20)
	bf := cachedFile(t, data)
	k := scKey{1, 2, 3}
	s.insert(k, bf)
	bf.release()
	for _, want := range []uint64{0, 1, 1<<20 - 100, 1 << 20} {
		got := s.lookup(k, want, time.Now())
		if got != bf {
			t.Fatalf("location of %d bytes, file of %d: not served from the cache", want, len(data))
		}
		got.release()
	}
	if got := s.lookup(k, 1<<20+1, time.Now()); got != nil || s.has(k) {
		t.Fatal("a location longer than the cached file was served from it")
	}
	if s.hits != 4 || s.invalidated != 1 {
		t.Fatalf("hits %d, invalidated %d; want 4, 1", s.hits, s.invalidated)
	}
}

// TestSCCacheLimitsRace: setting the limits while the cache inserts and
// ticks is no data race (run with -race; the limits were read unlocked).
func TestSCCacheLimitsRace(t *testing.T) {
	c := &Client{}
	s := &c.sc.cache
	defer s.close()
	data := randBytes(22, 64<<10)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range 50 {
			c.SetShortCircuitCacheLimitsForTest(i%4+1, 0, time.Duration(i+1)*time.Millisecond)
		}
	}()
	go func() {
		defer wg.Done()
		for i := range 50 {
			bf := cachedFile(t, data)
			s.insert(scKey{1, 1, uint64(i)}, bf)
			bf.release()
			s.expire()
		}
	}()
	wg.Wait()
}

// testToken issues a token for blk with modes m expiring at exp, signed
// by a key of its own (the client never checks the MAC).
func testToken(t testing.TB, blk blocktoken.Block, m blocktoken.Mode, exp time.Time) []byte {
	t.Helper()
	ks, err := blocktoken.NewKeySet([]blocktoken.Key{{ID: 1, Secret: bytes.Repeat([]byte{7}, blocktoken.SecretSize)}})
	if err != nil {
		t.Fatal(err)
	}
	tok, err := ks.Issue(time.Now(), blocktoken.Claims{Block: blk, Modes: m, ExpiryUnixMs: exp.UnixMilli(), Owner: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// cachedBlock is a shortCircuits whose cache holds one block file (block
// 7/9 of datanode 1, 1 MiB) and that block's location; the datanode's
// socket does not exist (a fetch from it fails: not available).
func cachedBlock(t testing.TB) (*shortCircuits, scKey, *scBlockFile, *metapb.DatanodeDetails, *metapb.BlockLocation) {
	t.Helper()
	sc := &shortCircuits{}
	t.Cleanup(sc.close)
	bf := cachedFile(t, randBytes(23, 1<<20))
	k := scKey{1, 7, 9}
	sc.cache.insert(k, bf)
	bf.release()
	d := &metapb.DatanodeDetails{Id: 1, ShortCircuitSocket: "/nonexistent/basalt-test.sock"}
	l := &metapb.BlockLocation{Id: &metapb.BlockID{ContainerId: 7, LocalId: 9}, Length: 1 << 20}
	return sc, k, bf, d, l
}

// BenchmarkShortCircuitCacheHit: a reader getting a block file from the
// client's cache (fetchShared's hit: the token check, the lookup with its
// fstat, the release): what every short-circuit read of a cached block
// costs before its bytes.
func BenchmarkShortCircuitCacheHit(b *testing.B) {
	sc, k, bf, d, l := cachedBlock(b)
	tok := testToken(b, blocktoken.Block{Container: 7, Local: 9}, blocktoken.Read, time.Now().Add(time.Hour))
	b.ReportAllocs()
	for b.Loop() {
		got, fresh, _, err := sc.fetchShared(k, d, l, tok)
		if err != nil || fresh || got != bf {
			b.Fatalf("not a hit: %v, fresh %v", err, fresh)
		}
		got.release()
	}
}

// TestTokenAllows: the client's check of a reader's token on a cache hit
// (no MAC): the block named, read granted, not expired.
func TestTokenAllows(t *testing.T) {
	now := time.Now()
	k := scKey{1, 7, 9}
	blk := blocktoken.Block{Container: 7, Local: 9}
	for _, c := range []struct {
		name string
		tok  []byte
		want bool
	}{
		{"read, valid", testToken(t, blk, blocktoken.Read, now.Add(time.Minute)), true},
		{"read+write, valid", testToken(t, blk, blocktoken.Read|blocktoken.Write, now.Add(time.Minute)), true},
		{"expired", testToken(t, blk, blocktoken.Read, now.Add(-time.Millisecond)), false},
		{"expiring now", testToken(t, blk, blocktoken.Read, now), false},
		{"another block", testToken(t, blocktoken.Block{Container: 7, Local: 10}, blocktoken.Read, now.Add(time.Minute)), false},
		{"another container", testToken(t, blocktoken.Block{Container: 8, Local: 9}, blocktoken.Read, now.Add(time.Minute)), false},
		{"the container (export)", testToken(t, blocktoken.Block{Container: 7}, blocktoken.Read, now.Add(time.Minute)), false},
		{"write only", testToken(t, blk, blocktoken.Write, now.Add(time.Minute)), false},
		{"none", nil, false},
		{"garbage", bytes.Repeat([]byte{2}, 100), false},
	} {
		if got := tokenAllows(c.tok, k, now); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// TestSCCacheHitChecksToken: a cached block file serves a reader only if
// its token names the block, grants read and has not expired (the
// client's clock); any other reader is sent to the datanode (here its
// socket does not exist: not available, read over gRPC), as on a miss.
// Before, every reader got the cached file whatever its token.
func TestSCCacheHitChecksToken(t *testing.T) {
	sc, k, bf, d, l := cachedBlock(t)
	blk := blocktoken.Block{Container: 7, Local: 9}
	now := time.Now()
	valid := testToken(t, blk, blocktoken.Read, now.Add(time.Minute))
	got, fresh, _, err := sc.fetchShared(k, d, l, valid)
	if err != nil || fresh || got != bf {
		t.Fatalf("valid token: %v, fresh %v, cached file %v; want the cached file", err, fresh, got == bf)
	}
	got.release()
	for _, c := range []struct {
		name string
		tok  []byte
	}{
		{"expired", testToken(t, blk, blocktoken.Read, now.Add(-time.Second))},
		{"another block", testToken(t, blocktoken.Block{Container: 7, Local: 10}, blocktoken.Read, now.Add(time.Minute))},
		{"write only", testToken(t, blk, blocktoken.Write, now.Add(time.Minute))},
		{"none", nil},
	} {
		got, _, notAvail, err := sc.fetchShared(k, d, l, c.tok)
		if got != nil || err == nil || !notAvail {
			t.Errorf("%s token: file %v (cached %v), %v, not available %v; want the datanode asked (its socket is missing: not available)",
				c.name, got != nil, got == bf, err, notAvail)
			if got != nil {
				got.release()
			}
		}
	}
	// The client's clock ahead of the token's expiry: asked too (the
	// datanode's clock decides).
	sc.cache.mu.Lock()
	sc.cache.now = func() time.Time { return now.Add(time.Hour) }
	sc.cache.mu.Unlock()
	if got, _, _, err := sc.fetchShared(k, d, l, valid); got != nil || err == nil {
		t.Errorf("token expired by the client's clock: served from the cache")
	}
	if sc.cache.hits != 1 || sc.cache.rechecks.Load() != 5 || !sc.cache.has(k) {
		t.Fatalf("hits %d, rechecks %d, cached %v; want 1, 5, still cached", sc.cache.hits, sc.cache.rechecks.Load(), sc.cache.has(k))
	}
	// A failing token for a block not cached is no recheck (a miss).
	l2 := &metapb.BlockLocation{Id: &metapb.BlockID{ContainerId: 7, LocalId: 10}, Length: 1 << 20}
	if got, _, _, _ := sc.fetchShared(scKey{1, 7, 10}, d, l2, testToken(t, blocktoken.Block{Container: 7, Local: 10}, blocktoken.Read, now.Add(-time.Second))); got != nil ||
		sc.cache.rechecks.Load() != 5 {
		t.Fatalf("expired token, block not cached: file %v, rechecks %d; want none, 5", got != nil, sc.cache.rechecks.Load())
	}
}

// TestSCMappingChecksToken: a mapping of a cache-tier file (shortcircuit.go)
// another reader got serves a reader only if its token passes the same
// check; otherwise the datanode is asked (here its socket is missing: an
// error, read elsewhere). Before, every reader got the mapping.
func TestSCMappingChecksToken(t *testing.T) {
	c := &Client{}
	k := scKey{1, 7, 9}
	m := &scMap{data: []byte{1}}
	c.sc.maps = map[scKey]*scMap{k: m}
	id := &metapb.BlockID{ContainerId: 7, LocalId: 9}
	blk := blocktoken.Block{Container: 7, Local: 9}
	now := time.Now()
	sock := "/nonexistent/basalt-test.sock"
	if got, err := c.scMapping(k, sock, id, testToken(t, blk, blocktoken.Read, now.Add(time.Minute))); got != m || err != nil {
		t.Fatalf("valid token: %v, mapping %v; want the mapping", err, got == m)
	}
	for name, tok := range map[string][]byte{
		"expired":       testToken(t, blk, blocktoken.Read, now.Add(-time.Second)),
		"another block": testToken(t, blocktoken.Block{Container: 7, Local: 8}, blocktoken.Read, now.Add(time.Minute)),
	} {
		if got, err := c.scMapping(k, sock, id, tok); got != nil || err == nil {
			t.Errorf("%s token: %v, mapping %v; want the datanode asked (its socket is missing: an error)", name, err, got != nil)
		}
	}
}

// heldBlock is cachedBlock with a reader (scBlocks) holding the cached
// file, got with a read token expiring at exp; the datanode's "socket" is
// a plain file (this host's, but a fetch from it fails: not available).
func heldBlock(t testing.TB, exp time.Time) (*shortCircuits, *scBlocks, scKey, *scBlockFile, *metapb.DatanodeDetails, *metapb.BlockLocation, []byte) {
	t.Helper()
	sc, k, bf, d, l := cachedBlock(t)
	d.ShortCircuitSocket = filepath.Join(t.TempDir(), "dn.sock")
	if err := os.WriteFile(d.ShortCircuitSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	s := &scBlocks{}
	t.Cleanup(s.close)
	tok := testToken(t, blocktoken.Block{Container: 7, Local: 9}, blocktoken.Read, exp)
	if got, err := s.file(k, d, l, tok, sc); err != nil || got != bf {
		t.Fatalf("first access: %v, cached file %v", err, got == bf)
	}
	return sc, s, k, bf, d, l, tok
}

// TestSCHeldFileChecksExpiry: a block file a reader holds serves it only
// until the token it got the file with expires (the client's clock); then
// the entry is dropped and the reader's token goes through fetchShared
// again (here expired: the datanode asked, its socket fails: not
// available, read over gRPC, which checks the token). Before, the reader
// kept the file until Close.
func TestSCHeldFileChecksExpiry(t *testing.T) {
	now := time.Now()
	sc, s, k, bf, d, l, tok := heldBlock(t, now.Add(time.Minute))
	setNow := func(at time.Time) {
		sc.cache.mu.Lock()
		sc.cache.now = func() time.Time { return at }
		sc.cache.mu.Unlock()
	}
	setNow(now.Add(30 * time.Second))
	if got, err := s.file(k, d, l, tok, sc); err != nil || got != bf {
		t.Fatalf("before the expiry: %v, held file %v; want the held file", err, got == bf)
	}
	hits := sc.cache.hits
	setNow(now.Add(2 * time.Minute))
	got, err := s.file(k, d, l, tok, sc)
	if err != nil || got == nil || got == bf || got.f != nil {
		t.Fatalf("after the expiry: %v, held file %v; want the datanode asked (not available: gRPC)", err, got == bf)
	}
	if r := bf.refs.Load(); r != 1 || sc.cache.hits != hits || sc.cache.rechecks.Load() != 1 {
		t.Fatalf("after the expiry: %d references (want the cache's only), hits +%d, rechecks %d (want 0, 1)",
			r, sc.cache.hits-hits, sc.cache.rechecks.Load())
	}
}

// BenchmarkSCHeldFile: a read of a block file the reader already holds
// (scBlocks.file's hit, before the bytes): what every short-circuit read
// after a reader's first of a block costs; with the expiry check, a load
// of the coarse clock and a compare.
func BenchmarkSCHeldFile(b *testing.B) {
	sc, s, k, bf, d, l, tok := heldBlock(b, time.Now().Add(time.Hour))
	b.ReportAllocs()
	for b.Loop() {
		if got, err := s.file(k, d, l, tok, sc); err != nil || got != bf {
			b.Fatal("not held")
		}
	}
}
