package client

import (
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// cachedFile maps a block file of data and returns it as fetchShared
// builds one (one reference: the caller's).
func cachedFile(t *testing.T, data []byte) *scBlockFile {
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
		got := s.lookup(k, want)
		if got != bf {
			t.Fatalf("location of %d bytes, file of %d: not served from the cache", want, len(data))
		}
		got.release()
	}
	if got := s.lookup(k, 1<<20+1); got != nil || s.has(k) {
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
