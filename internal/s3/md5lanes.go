package s3

import (
	"crypto/md5"
	"hash"
	"sync"
	"sync/atomic"
	"time"

	md5simd "github.com/minio/md5-simd"
)

// The ETag of a large body is its MD5, which S3 clients compare, so it
// must be computed; at ~800 MB/s per core it is the gateway's largest
// cost per byte (about 1.2 CPU-s per GiB). MD5 is serial within one body,
// but the gateway usually hashes several bodies at once: warp and the AWS
// SDKs send a large object as parts uploaded in parallel (four 16 MiB
// parts at a time per client from minio-go), and several clients write at
// once. md5-simd hashes up to 16 bodies side by side in the lanes of
// AVX-512 registers (8 with AVX2) on one goroutine (crypto/md5 without
// AVX2): one body at ~800 MB/s, four at ~2.3 GB/s and twelve at ~6 GB/s
// per core here (BenchmarkETagLanes).
//
// Two things make it safe to keep in a long-running gateway:
//
//   - md5-simd v1.1.2 (the newest release) never forgets a closed hasher:
//     its server deletes the wrong map key on close (minio/md5-simd#27),
//     so every body leaves a map entry and a closed channel that each pass
//     walks. A server here therefore takes at most laneServerBodies bodies
//     and is then retired: a fresh one takes new bodies, and the old one is
//     closed (its goroutine ends, its maps go) once its last hasher is
//     closed. No server ever holds more than laneServerBodies dead
//     entries (TestLaneServersBounded).
//   - md5-simd only shares a pass between bodies whose blocks are queued
//     at the same moment, and bodies arriving from the network hand over a
//     256 KiB buffer every few ms; so the hashing goroutines meet at their
//     server's gate (laneGate) before handing a buffer over. The gate only
//     waits for bodies that are hashing now — whose next buffer is due
//     within laneWait, judged from the interval between their last
//     buffers — never for one that has ended, failed, paused (a commit, a
//     stalled client) or is slower than laneSlowest, and never longer than
//     laneWait (2 ms). Only the hashing goroutine waits; the body's reads
//     go on into its other buffers, and a body whose hashing is behind
//     (more buffers queued) does not wait at all.
//
// A body takes the lanes only when, at its laneDecideAt-th buffer, another
// large body is being read (alone, a body gains nothing from the lanes and
// would pay the hand-over to their goroutine) and the body arrives no
// faster than laneFastest (a lane is slower than crypto/md5 on its own
// core); otherwise it uses crypto/md5 on its own hashing goroutine, as
// before. The rate is measured from the first buffer on, not from the
// body's opening: a real client's first buffer always comes late (the
// Expect: 100-continue round trip, TCP slow start), and a client sending
// at 1 GB/s after it would otherwise be judged slow and held to a lane's
// speed. md5-simd's state cannot move to crypto/md5 once started, so the
// hashing goroutine holds the first buffer un-hashed until the decision;
// the body's reads go on into its other buffers meanwhile (hashBufs >
// laneDecideAt), so the wait never holds up a read.
var lanePool laneServers

// etagLanes: large bodies' MD5 may use the shared lanes (false: always
// crypto/md5; benchmarks compare the two).
var etagLanes = true

const (
	// laneMinBodies large bodies being read make a body take the lanes.
	// 2, not 3 (md5-simd runs passes of fewer than 3 bodies scalar): a
	// body that starts beside one other is usually joined by more (the
	// next parts of a wave), and bodies whose hashing is behind queue
	// blocks side by side; session 9 measured a body alone at its first
	// buffer as the right test (not alone when opened, not always).
	laneMinBodies = 2
	// laneWait bounds a buffer's wait at the gate, and only bodies due
	// within it are waited for. 0.5 ms was measured first: bodies at
	// 40–80 MB/s hand over a buffer every 3–6 ms, so few were due that
	// soon, and 4 paced bodies cost more CPU in the lanes than with
	// crypto/md5 (BenchmarkETagPaced 1.86–1.96 cpu-s/GiB vs 1.80); with
	// 2 ms 1.42–1.47. The wait costs the body nothing while its hashing
	// keeps up (its reads go on into 3 more buffers, ~13 ms at 80 MB/s),
	// and a body that reached its end or is behind does not wait.
	laneWait = 2 * time.Millisecond
	// laneSlowest: a body handing over 256 KiB buffers less often than
	// this (slower than ~13 MB/s) is not waited for.
	laneSlowest = 20 * time.Millisecond
)

// laneFastest: a body whose first buffer arrived faster than this takes
// crypto/md5 (a variable for tests). In a pass of 3 or more bodies each
// lane hashes at ~400 MB/s here, half of crypto/md5's speed, so a body
// read faster than that (hashing behind its reads) would be held back by
// the lanes: one read flat out beside three paced at 40 MB/s took 17%
// longer in them (BenchmarkETagFastBesideSlow). Parts over the network
// (40–80 MB/s each under warp) stay well below.
var laneFastest = 256e6 // bytes per second

// laneDecideAt: a body's MD5 is placed when this many of its buffers were
// handed over (or the body ended), from the rate of those after the first.
// Must be below hashBufs, so that holding the first never blocks a read.
const laneDecideAt = 3

// laneServerBodies is how many bodies one md5-simd server takes before it
// is retired (a variable for tests). Each leaves a dead entry in its
// server's maps that every pass walks: a lone body's 32 KiB pass took
// 47–75 µs with 0–256 dead entries and 175 µs with 2,048
// (BenchmarkLaneServerBodies, loaded machine), so 64 cost a few µs per
// pass, while a retirement — after which bodies on the old and the new
// server cannot share a pass — comes every 8 of warp's 128 MiB objects.
var laneServerBodies = 64

// laneServers hands out lane hashers from the current server and retires
// servers.
type laneServers struct {
	mu  sync.Mutex
	cur *laneServer
	// Live state, for tests and metrics.
	servers atomic.Int64 // servers not yet closed
	hashers atomic.Int64 // lane hashers not yet closed
	retired atomic.Int64 // servers closed since start
}

// laneServer is one md5-simd server and its gate.
type laneServer struct {
	srv     md5simd.Server
	uses    int  // bodies it took (under laneServers.mu)
	live    int  // of them not yet closed
	retired bool // takes no more bodies
	gate    laneGate
}

// take returns a hasher from the current server, starting a fresh server
// when the current one has taken laneServerBodies bodies.
func (p *laneServers) take() (*laneServer, md5simd.Hasher) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur != nil && p.cur.uses >= laneServerBodies {
		p.retireLocked(p.cur)
		p.cur = nil
	}
	if p.cur == nil {
		p.cur = &laneServer{srv: md5simd.NewServer()}
		p.servers.Add(1)
	}
	s := p.cur
	s.uses++
	s.live++
	p.hashers.Add(1)
	return s, s.srv.NewHash()
}

func (p *laneServers) retireLocked(s *laneServer) {
	s.retired = true
	if s.live == 0 {
		s.srv.Close()
		p.servers.Add(-1)
		p.retired.Add(1)
	}
}

// release closes a hasher taken from s; a retired server is closed with
// its last hasher.
func (p *laneServers) release(s *laneServer, h md5simd.Hasher) {
	h.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	s.live--
	p.hashers.Add(-1)
	if s.retired {
		p.retireLocked(s)
	}
}

// laneGate releases the waiting hashing goroutines of one server together.
type laneGate struct {
	mu      sync.Mutex
	members []*laneMD5 // bodies of this server with a lane, until Sum/Close
	waiting int
	release *laneRelease // the waiting ones' release
	passes  atomic.Int64 // released batches (tests)
	alone   atomic.Int64 // buffers handed over without waiting (tests)
	timeout atomic.Int64 // batches released by laneWait (tests)
}

// laneRelease is closed when the buffers waiting at a gate go; timedOut
// (set before ch is closed) says laneWait released them.
type laneRelease struct {
	ch       chan struct{}
	timedOut bool
}

// laneBuffers counts buffers handed to the lanes since start (metrics):
// without waiting (its body's hashing behind its reads, or nobody else
// due), released with company, or by laneWait.
var laneBuffers struct{ behind, alone, together, timeout atomic.Int64 }

func (g *laneGate) join(l *laneMD5) {
	g.mu.Lock()
	g.members = append(g.members, l)
	if g.release == nil {
		g.release = &laneRelease{ch: make(chan struct{})}
	}
	g.mu.Unlock()
}

func (g *laneGate) leave(l *laneMD5) {
	g.mu.Lock()
	for i, m := range g.members {
		if m == l {
			last := len(g.members) - 1
			g.members[i] = g.members[last]
			g.members[last] = nil
			g.members = g.members[:last]
			break
		}
	}
	g.kickLocked(time.Now().UnixNano())
	g.mu.Unlock()
}

// kickLocked lets the waiting ones go when nobody else is due.
func (g *laneGate) kickLocked(now int64) {
	if g.waiting > 0 && (g.waiting >= md5simd.Lanes || g.dueLocked(now) == 0) {
		g.openLocked(false)
	}
}

func (g *laneGate) openLocked(timedOut bool) {
	g.release.timedOut = timedOut
	close(g.release.ch)
	g.release = &laneRelease{ch: make(chan struct{})}
	g.waiting = 0
	for _, m := range g.members {
		m.waiting = false
	}
	g.passes.Add(1)
}

// dueLocked counts the members not waiting whose next buffer is due
// within laneWait: still reading (not at EOF), at least laneSlowest's
// rate, and not overdue by more than laneWait (paused or stalled).
func (g *laneGate) dueLocked(now int64) int {
	n := 0
	for _, m := range g.members {
		if m.waiting || m.final.Load() || m.interval <= 0 || m.interval > int64(laneSlowest) {
			continue
		}
		if m.next <= now+int64(laneWait) && m.next >= now-int64(laneWait) {
			n++
		}
	}
	return n
}

// wait returns when l's buffer may go: no other member is due within
// laneWait, all due ones arrived, or laneWait passed.
func (g *laneGate) wait(l *laneMD5) {
	now := time.Now().UnixNano()
	g.mu.Lock()
	l.observe(now)
	l.waiting = true // not due itself: it is here
	if g.dueLocked(now) == 0 {
		l.waiting = false
		g.alone.Add(1)
		laneBuffers.alone.Add(1)
		if g.waiting > 0 {
			g.openLocked(false)
		}
		g.mu.Unlock()
		return
	}
	g.waiting++
	if g.waiting >= md5simd.Lanes {
		g.openLocked(false)
		g.mu.Unlock()
		laneBuffers.together.Add(1)
		return
	}
	rel := g.release
	g.mu.Unlock()
	if l.timer == nil {
		l.timer = time.NewTimer(laneWait)
	} else {
		l.timer.Reset(laneWait)
	}
	select {
	case <-rel.ch:
		l.timer.Stop()
	case <-l.timer.C:
		g.mu.Lock()
		if g.release == rel { // not released by another meanwhile
			g.timeout.Add(1)
			g.openLocked(true)
		}
		g.mu.Unlock()
	}
	// Counted by what released the batch, whichever goroutine did it.
	if rel.timedOut {
		laneBuffers.timeout.Add(1)
	} else {
		laneBuffers.together.Add(1)
	}
}

// laneMD5 is a large body's MD5: in the shared lanes or crypto/md5 (see
// lanePool). Write is called by the body's hashing goroutine, one hash
// buffer at a time; Sum once that goroutine is done. Close (idempotent)
// frees the lane; Sum frees it too, and a later Sum returns the same sum.
type laneMD5 struct {
	srv   *laneServer
	srvA  atomic.Pointer[laneServer] // srv, for done on the request goroutine
	lane  md5simd.Hasher
	alone hash.Hash // crypto/md5
	sum   []byte
	timer *time.Timer
	// force: 1 the lanes, 2 crypto/md5, 0 decide at laneDecideAt buffers.
	force   int
	decided bool // counted in laneChoice
	// The buffers handed to the hashing goroutine, recorded by sent on the
	// body's goroutine until ready is closed (at laneDecideAt buffers or
	// done); read by the hashing goroutine only after that.
	watched   bool          // sent is called for every buffer (a body's hasher)
	ready     chan struct{} // closed when the body's rate is known or it ended
	readyShut bool
	sentN     int
	sentBytes int64 // bytes in the buffers after the first
	sent1     int64 // ns, the first buffer handed over
	sentLast  int64 // ns, the latest
	// final: the body reached its end (or failed); it is not waited for
	// and its buffers go at once.
	final atomic.Bool
	// backlog reports buffers queued behind the current one.
	backlog func() int
	counted bool // in largeBodies
	closed  bool
	// Under srv.gate.mu: the buffer rhythm and whether it is waiting.
	last, interval, next int64 // ns
	waiting              bool
}

// How large bodies' MD5s were run, since start (metrics, tests): in the
// lanes; crypto/md5 because fewer than laneMinBodies were being read,
// because the body arrived faster than laneFastest, because the lanes are
// off (etagLanes false or forced), or because the body ended or failed
// before its rate was known (ended; also a body that failed before any
// buffer was hashed).
var laneChoice struct{ lanes, few, fast, off, ended atomic.Int64 }

// largeBodies counts the large bodies being read: from newLaneMD5 to EOF,
// failure or Close (not while the upload commits).
var largeBodies atomic.Int64

// newLaneMD5 returns a large body's MD5. Call done at EOF or failure and
// Close once finished.
func newLaneMD5() *laneMD5 {
	largeBodies.Add(1)
	return &laneMD5{counted: true, ready: make(chan struct{})}
}

// sent records a buffer of n bytes handed to the hashing goroutine at now
// (ns), on the body's goroutine.
func (l *laneMD5) sent(now int64, n int) {
	if l.readyShut {
		return
	}
	l.sentN++
	if l.sentN == 1 {
		l.sent1 = now
	} else {
		l.sentBytes += int64(n)
	}
	l.sentLast = now
	if l.sentN >= laneDecideAt {
		l.shutReady()
	}
}

func (l *laneMD5) shutReady() {
	if !l.readyShut && l.ready != nil {
		l.readyShut = true
		close(l.ready)
	}
}

// done marks the end of the body's reading: no longer counted or waited
// for. Call it on the body's goroutine (before the hasher's wait).
func (l *laneMD5) done() {
	l.shutReady()
	l.final.Store(true)
	if l.counted {
		l.counted = false
		largeBodies.Add(-1)
	}
	if s := l.srvA.Load(); s != nil {
		s.gate.mu.Lock()
		if l.waiting { // its buffer waits: let it go now, the body has ended
			s.gate.openLocked(false)
		} else {
			s.gate.kickLocked(time.Now().UnixNano())
		}
		s.gate.mu.Unlock()
	}
}

// observe records a buffer's arrival at now (under the gate's lock).
func (l *laneMD5) observe(now int64) {
	if l.last > 0 {
		iv := now - l.last
		if l.interval == 0 {
			l.interval = iv
		} else {
			l.interval = (3*l.interval + iv) / 4
		}
	}
	l.last = now
	l.next = now + l.interval
}

// decide picks the lanes or crypto/md5 at the body's laneDecideAt-th
// buffer (or its end): the lanes when at least laneMinBodies large bodies
// are being read and its buffers after the first arrived no faster than
// laneFastest.
func (l *laneMD5) decide() {
	if l.decided {
		return
	}
	l.decided = true
	n := largeBodies.Load()
	if l.final.Load() { // read to its end already, but it is being hashed
		n++
	}
	var how *atomic.Int64
	switch {
	case l.force == 1:
	case l.force == 2 || !etagLanes:
		how = &laneChoice.off
	case l.closed || l.sum != nil || l.sentN < 2:
		how = &laneChoice.ended
	case n < laneMinBodies:
		how = &laneChoice.few
	case float64(l.sentBytes)*1e9 > laneFastest*float64(max(l.sentLast-l.sent1, 1)):
		how = &laneChoice.fast
	}
	if how != nil {
		how.Add(1)
		l.alone = md5.New()
		return
	}
	laneChoice.lanes.Add(1)
	if l.force == 0 && l.sentN >= 2 { // the gate's first guess of its rhythm (forced: sent may still be writing)
		l.interval = (l.sentLast - l.sent1) / int64(l.sentN-1)
	}
	l.srv, l.lane = lanePool.take()
	l.srv.gate.join(l)
	l.srvA.Store(l.srv)
}

func (l *laneMD5) Write(p []byte) (int, error) {
	if !l.decided {
		if l.watched && l.force == 0 && etagLanes {
			<-l.ready // the first buffer waits un-hashed for the body's rate
		}
		l.decide()
	}
	if l.alone != nil {
		return l.alone.Write(p)
	}
	if !l.final.Load() && (l.backlog == nil || l.backlog() == 0) {
		l.srv.gate.wait(l)
	} else {
		l.srv.gate.alone.Add(1)
		laneBuffers.behind.Add(1)
	}
	return l.lane.Write(p)
}

func (l *laneMD5) Sum(b []byte) []byte {
	if l.sum == nil {
		if !l.decided { // nothing written: no lane for it
			l.decided = true
			laneChoice.ended.Add(1)
			l.alone = md5.New()
		}
		if l.alone != nil {
			l.sum = l.alone.Sum(nil)
		} else {
			l.sum = l.lane.Sum(nil)
			l.freeLane()
		}
	}
	return append(b, l.sum...)
}

func (l *laneMD5) Reset()         { panic("laneMD5: Reset is not used") }
func (l *laneMD5) Size() int      { return md5.Size }
func (l *laneMD5) BlockSize() int { return md5.BlockSize }

// inLanes reports whether the body's MD5 ran in the lanes (tests).
func (l *laneMD5) inLanes() bool { return l.srv != nil }

func (l *laneMD5) freeLane() {
	if l.lane != nil {
		l.srv.gate.leave(l)
		lanePool.release(l.srv, l.lane)
		l.lane = nil
	}
}

// Close frees the lane and the count; idempotent.
func (l *laneMD5) Close() {
	if !l.decided { // failed before its MD5 started
		l.decided = true
		laneChoice.ended.Add(1)
	}
	l.closed = true
	if l.counted {
		l.counted = false
		largeBodies.Add(-1)
	}
	l.final.Store(true)
	if l.lane != nil && l.sum == nil { // a later Sum still returns what was hashed
		l.sum = l.lane.Sum(nil)
	}
	l.freeLane()
}
