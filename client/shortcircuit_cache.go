package client

import (
	"container/list"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The client-wide cache of local block files (HDFS's ShortCircuitCache).
// Without it every reader (every S3 GET) asked the datanode's socket for
// each block's descriptor, mapped it, filled its page tables and unmapped
// it at Close. The cache keeps the descriptor and the mapping of a block
// file of a datanode on this host for the next readers of the same client:
//
//   - Keyed by datanode and block ID; an entry is used only for a location
//     whose committed length is at most the entry's (reads never go past
//     the location's length; a replica longer than a location, e.g. one
//     that took more writes of an open key, serves it, and a longer
//     location fetches the file again), and only while its file is still
//     linked (fstat:
//     a block deleted or replaced by the datanode, e.g. its container
//     deleted and imported again, has st_nlink 0 and is fetched again).
//     Committed bytes are never rewritten in place, and every read still
//     verifies the checksums on the mapping under the SIGBUS guard: a
//     stale or damaged mapping can fail a read (which then re-fetches or
//     reads over gRPC), never return wrong bytes.
//   - Reference-counted: the cache holds one reference, each reader that
//     uses the entry another (scBlockFile.refs); an entry evicted or
//     invalidated while a read uses it is unmapped and closed by the last
//     release.
//   - Bounded: at most scCacheFiles entries and scCacheBytes mapped bytes
//     (least recently used evicted first), and entries unused for
//     scCacheIdle are dropped. A timer every scCacheTick also drops the
//     entries whose file is no longer linked (fstat st_nlink 0): the open
//     descriptor keeps a deleted block's disk space, and a nearly full
//     datanode deleting and writing blocks would otherwise wait up to the
//     idle time for it. The same tick forgets which parts of each mapping
//     had their page tables filled (scBlockFile.populated), so a hot entry
//     whose pages the kernel reclaimed fills them again in one call
//     instead of a page fault per page.
//   - A verification failure on an entry another reader fetched drops the
//     entry and reads over gRPC (which checks the replica itself), instead
//     of reporting the replica corrupt on the word of an old mapping.
//
// Tokens: the datanode checks the block token when it passes the file. A
// later reader gets the entry only if its own token passes what the client
// can check without the secret (tokenAllows: it decodes, names this block,
// grants read and has not expired by this host's clock; Decode, no MAC);
// otherwise the datanode is asked over the socket as on a miss, and its
// check decides: it refuses (an expired token: TOKEN_EXPIRED, which sends
// the reader to look the key up again, refreshTokens in reader.go, and
// that lookup checks the user's access again, so a revoked ACL takes
// effect within a token's lifetime, as over gRPC) or passes the file (the
// clocks disagree: the datanode's is the authority). Not checked on a hit:
// the MAC (the tokens readers present are the namespace's, and the entry
// came from a genuine one), and an expiry the client's clock has not
// reached yet (a clock behind the datanode's lets a hit serve a token
// expired by up to the skew). A reader keeps the files it got (scBlocks)
// only until the token it got each with expires (scHeld, by a coarse
// clock: up to about 50 ms late, scClock); then its current token is
// checked again here, as gRPC checks every ReadBlock.

const (
	scCacheFiles = 512
	scCacheBytes = 64 << 30 // mapped (address space; the pages are the page cache's)
	scCacheIdle  = 60 * time.Second
	scCacheTick  = 5 * time.Second // at most; idle/2 when shorter
)

type scEntry struct {
	k    scKey
	bf   *scBlockFile
	size int64
	used time.Time
	el   *list.Element
}

type scCache struct {
	mu       sync.Mutex
	entries  map[scKey]*scEntry
	lru      list.List // front: most recently used
	bytes    int64
	closed   bool
	timer    *time.Timer
	maxFiles int
	maxBytes int64
	idle     time.Duration
	// now: a test's clock (nil: time.Now). Read without mu (clock,
	// shortCircuits.nowMs): a test sets it before the reads that use it,
	// in the same goroutine.
	now func() time.Time

	hits, misses, evicted, invalidated uint64
	// rechecks: readers whose token failed tokenAllows while the block
	// was cached, sent to the datanode instead (atomic: counted outside
	// mu).
	rechecks atomic.Uint64
}

// limitsLocked returns the bounds (s.mu held).
func (s *scCache) limitsLocked() (int, int64, time.Duration) {
	files, bytes, idle := s.maxFiles, s.maxBytes, s.idle
	if files <= 0 {
		files = scCacheFiles
	}
	if bytes <= 0 {
		bytes = scCacheBytes
	}
	if idle <= 0 {
		idle = scCacheIdle
	}
	return files, bytes, idle
}

// tickLocked is the expiry timer's period (s.mu held).
func (s *scCache) tickLocked() time.Duration {
	_, _, idle := s.limitsLocked()
	return min(idle/2, scCacheTick)
}

func (s *scCache) clock() time.Time {
	if s.now != nil {
		return s.now()
	}
	return time.Now()
}

// lookup returns k's entry with a reference taken for the caller, if it is
// valid for a block of committed length want; an invalid one is dropped.
// now (s.clock()) marks the entry used.
func (s *scCache) lookup(k scKey, want uint64, now time.Time) *scBlockFile {
	s.mu.Lock()
	e := s.entries[k]
	if e == nil || !e.bf.acquire() {
		s.mu.Unlock()
		return nil
	}
	s.mu.Unlock()
	if !e.bf.valid(want) {
		e.bf.release()
		s.invalidate(k, e.bf)
		return nil
	}
	s.mu.Lock()
	if s.entries[k] == e {
		e.used = now
		s.lru.MoveToFront(e.el)
	}
	s.hits++
	s.mu.Unlock()
	return e.bf
}

// valid: bf describes a block of committed length at least want (the
// location's; reads stay below it) and its file is still linked.
func (bf *scBlockFile) valid(want uint64) bool {
	return bf.bd.GetLength() >= want && bf.linked()
}

// linked: bf's file is still linked (not deleted or replaced).
func (bf *scBlockFile) linked() bool {
	var st unix.Stat_t
	return unix.Fstat(int(bf.f.Fd()), &st) == nil && st.Nlink > 0
}

// insert adds bf (one reference: the caller's) and takes the cache's
// reference; an entry already there for k wins (bf is returned to the
// caller as is, uncached, and dropped at its release).
func (s *scCache) insert(k scKey, bf *scBlockFile) {
	size := int64(len(bf.m))
	s.mu.Lock()
	defer s.mu.Unlock()
	files, maxBytes, _ := s.limitsLocked()
	s.misses++
	if s.closed || s.entries[k] != nil || size > maxBytes {
		return
	}
	if s.entries == nil {
		s.entries = map[scKey]*scEntry{}
	}
	bf.refs.Add(1)
	e := &scEntry{k: k, bf: bf, size: size, used: s.clock()}
	e.el = s.lru.PushFront(e)
	s.entries[k] = e
	s.bytes += size
	for len(s.entries) > files || s.bytes > maxBytes {
		s.removeLocked(s.lru.Back().Value.(*scEntry))
		s.evicted++
	}
	if s.timer == nil {
		s.timer = time.AfterFunc(s.tickLocked(), s.expire)
	}
}

// removeLocked takes e out and drops the cache's reference (the file is
// closed and unmapped now or by the last reader's release).
func (s *scCache) removeLocked(e *scEntry) {
	s.lru.Remove(e.el)
	delete(s.entries, e.k)
	s.bytes -= e.size
	e.bf.release()
}

// has reports whether k is cached.
func (s *scCache) has(k scKey) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.entries[k] != nil
}

// cachedFirst moves the replicas of l whose block file this client has
// cached to the front of ds (in place, otherwise stable): they run on this
// host, so they are among the nearest anyway, and where several datanodes
// share the host (basalt dev) readers then keep using one file per block.
func (sc *shortCircuits) cachedFirst(l *metapb.BlockLocation, ds []*metapb.DatanodeDetails) {
	if len(ds) < 2 {
		return
	}
	j := 0
	for i, d := range ds {
		if d.ShortCircuitSocket != "" && sc.cache.has(scKey{d.Id, l.Id.GetContainerId(), l.Id.GetLocalId()}) {
			copy(ds[j+1:i+1], ds[j:i])
			ds[j] = d
			j++
		}
	}
}

// invalidate drops k's entry if it is bf.
func (s *scCache) invalidate(k scKey, bf *scBlockFile) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.entries[k]; e != nil && e.bf == bf {
		s.removeLocked(e)
		s.invalidated++
	}
}

// expire (the timer, every tickLocked) drops the entries unused for the
// idle time and those whose file is no longer linked, clears the others'
// populated bits, and runs again while any entries remain.
func (s *scCache) expire() {
	s.mu.Lock()
	_, _, idle := s.limitsLocked()
	now := s.clock()
	for el := s.lru.Back(); el != nil; {
		e := el.Value.(*scEntry)
		el = el.Prev()
		if now.Sub(e.used) < idle {
			break
		}
		s.removeLocked(e)
		s.evicted++
	}
	// fstat outside the lock, each file held by a reference (so its
	// descriptor cannot be closed and reused meanwhile).
	type held struct {
		k  scKey
		bf *scBlockFile
	}
	live := make([]held, 0, len(s.entries))
	for k, e := range s.entries {
		if e.bf.acquire() {
			live = append(live, held{k, e.bf})
		}
	}
	s.mu.Unlock()
	for _, h := range live {
		if !h.bf.linked() {
			s.invalidate(h.k, h.bf)
		} else {
			for i := range h.bf.populated {
				h.bf.populated[i].Store(0)
			}
		}
		h.bf.release()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || len(s.entries) == 0 {
		if s.timer != nil {
			s.timer.Stop()
		}
		s.timer = nil
		return
	}
	if s.timer != nil {
		s.timer.Reset(s.tickLocked())
	} else {
		s.timer = time.AfterFunc(s.tickLocked(), s.expire)
	}
}

func (s *scCache) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	for s.lru.Len() > 0 {
		s.removeLocked(s.lru.Back().Value.(*scEntry))
	}
}

// ShortCircuitCacheStats describe the client's cache of local block files.
type ShortCircuitCacheStats struct {
	Files       int    // entries now
	MappedBytes int64  // their mapped bytes
	Hits        uint64 // readers that got a cached file
	Misses      uint64 // files fetched from a datanode's socket
	Evicted     uint64 // entries dropped for the bounds or idle
	Invalidated uint64 // entries dropped as stale (length changed, file deleted, a failed read)
	// Rechecks: readers whose token failed the client's check (expired,
	// another block, no read) while the block was cached: the datanode
	// was asked over its socket instead, as on a miss (and the file it
	// passed, if any, counts in Misses too).
	Rechecks uint64
}

// ShortCircuitCacheStats returns the client's cache counters.
func (c *Client) ShortCircuitCacheStats() ShortCircuitCacheStats {
	s := &c.sc.cache
	s.mu.Lock()
	defer s.mu.Unlock()
	return ShortCircuitCacheStats{Files: len(s.entries), MappedBytes: s.bytes, Hits: s.hits, Misses: s.misses,
		Evicted: s.evicted, Invalidated: s.invalidated, Rechecks: s.rechecks.Load()}
}

// SetShortCircuitCacheLimitsForTest sets the cache's bounds (0: default).
func (c *Client) SetShortCircuitCacheLimitsForTest(files int, bytes int64, idle time.Duration) {
	s := &c.sc.cache
	s.mu.Lock()
	defer s.mu.Unlock()
	s.maxFiles, s.maxBytes, s.idle = files, bytes, idle
}

// fetchShared returns block l's file from datanode d: the cached one, or
// one fetched from d's socket and cached. fresh: fetched now for this
// caller. The caller holds one reference on the file returned.
func (sc *shortCircuits) fetchShared(k scKey, d *metapb.DatanodeDetails, l *metapb.BlockLocation, tok []byte) (bf *scBlockFile, fresh, notAvail bool, err error) {
	// One clock read for the token check and the entry's use (time.Now
	// is most of the check's cost).
	if now := sc.cache.clock(); tokenAllows(tok, k, now) {
		if bf := sc.cache.lookup(k, l.GetLength(), now); bf != nil {
			return bf, false, false, nil
		}
	} else if sc.cache.has(k) {
		sc.cache.rechecks.Add(1)
	}
	f, bd, notAvail, err := fetchBlockFile(d.ShortCircuitSocket, d.Id, l.Id, tok)
	if err != nil {
		return nil, false, notAvail, err
	}
	sc.blk.opened.Add(1)
	bf = &scBlockFile{f: f, bd: bd, m: mapBlockFile(f, bd.Length)}
	if len(bf.m) > 0 {
		bf.populated = make([]atomic.Uint64, (len(bf.m)/popUnit+64)/64)
	}
	bf.refs.Store(1)
	sc.cache.insert(k, bf)
	return bf, true, false, nil
}

// tokenAllows reports whether tok, decoded without checking its MAC (the
// client does not hold the secret), grants reading block k's container
// and local ID and has not expired at now: what a cache hit checks before
// it serves a reader (see "Tokens:" above). false: ask the datanode.
func tokenAllows(tok []byte, k scKey, now time.Time) bool {
	c, err := blocktoken.Decode(tok)
	return err == nil && c.Block == blocktoken.Block{Container: k.c, Local: k.l} &&
		c.Modes&blocktoken.Read != 0 && now.UnixMilli() < c.ExpiryUnixMs
}
