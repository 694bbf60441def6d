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
// must be computed; at ~800 MB/s per core it was the gateway's largest
// cost per byte (about 1.2 CPU-s per GiB). MD5 is serial within one
// body, but the gateway usually hashes several bodies at once: warp and
// the AWS SDKs send a large object as parts uploaded in parallel (four
// 16 MiB parts at a time per client from minio-go), and several clients
// write at once. md5-simd hashes up to 16 independent bodies side by side
// in the lanes of AVX-512 registers (8 with AVX2) on one goroutine: on
// this machine's CPU one body hashes at ~800 MB/s, four at ~2.3 GB/s and
// twelve at ~6 GB/s per core (BenchmarkETagLanes). Without AVX2 it falls
// back to crypto/md5.
//
// md5-simd only shares a pass between bodies whose blocks are queued at
// the same moment, and a body whose bytes arrive from the network at
// 50–100 MB/s hands over a buffer every few ms: left alone, nearly every
// pass would carry one body (scalar, plus the server's overhead). So the
// bodies' hashing goroutines meet at laneGate before handing a buffer
// over: a buffer waits until every large body being read has one ready
// (at most 16), or laneWait passed, or its body has more waiting behind
// it (hashing is behind; no reason to wait). Only the hashing goroutine
// waits: the body's reads go on into its other hash buffers. A body that
// is alone at its first buffer uses crypto/md5 instead (laneMD5).
var (
	md5LanesOnce sync.Once
	md5Lanes     md5simd.Server
	lanes        laneGate
)

// etagLanes: large bodies' MD5 in the shared lanes (false: crypto/md5 on
// the body's hasher goroutine, as before; benchmarks compare the two).
var etagLanes = true

// laneWait bounds how long a body's buffer waits for others' to share a
// pass. A body at 100 MB/s fills its other three 256 KiB buffers in ~7 ms,
// so the wait does not hold up its reads.
const laneWait = 3 * time.Millisecond

// laneGate releases the waiting hashing goroutines together.
type laneGate struct {
	mu      sync.Mutex
	active  int // large bodies being hashed
	waiting int
	release chan struct{} // closed when the waiting ones go
	passes  atomic.Int64  // released batches (tests)
	alone   atomic.Int64  // buffers handed over without company (tests)
}

func (g *laneGate) join() {
	g.mu.Lock()
	g.active++
	if g.release == nil {
		g.release = make(chan struct{})
	}
	g.mu.Unlock()
}

func (g *laneGate) leave() {
	g.mu.Lock()
	g.active--
	if g.waiting > 0 && g.waiting >= min(g.active, md5simd.Lanes) {
		g.openLocked()
	}
	g.mu.Unlock()
}

func (g *laneGate) openLocked() {
	close(g.release)
	g.release = make(chan struct{})
	g.waiting = 0
	g.passes.Add(1)
}

// wait returns when the caller's buffer may go: the others are ready, or
// laneWait passed. t is the caller's own timer (stopped).
func (g *laneGate) wait(t *time.Timer) {
	g.mu.Lock()
	if g.active <= 1 {
		g.mu.Unlock()
		g.alone.Add(1)
		return
	}
	g.waiting++
	if g.waiting >= min(g.active, md5simd.Lanes) {
		g.openLocked()
		g.mu.Unlock()
		return
	}
	ch := g.release
	g.mu.Unlock()
	t.Reset(laneWait)
	select {
	case <-ch:
		t.Stop()
	case <-t.C:
		g.mu.Lock()
		if g.release == ch {
			g.openLocked()
		}
		g.mu.Unlock()
	}
}

// laneMD5 is a body's MD5, in the shared lanes or, for a body read
// alone, crypto/md5. Its Write is called by the body's hasher goroutine
// with one hash buffer at a time; Sum after the hasher is done.
//
// Which one is decided at the first buffer (256 KiB in, a few ms after
// the body started), not when the body opens: the parts of one upload
// start within a few ms of each other, and the first of them would see
// none of the others. A body alone gains nothing from the lanes and pays
// the hand-over to their goroutine.
type laneMD5 struct {
	lane  md5simd.Hasher // in the lanes
	alone hash.Hash      // crypto/md5: no other large body at the first buffer
	timer *time.Timer
	// final: the body reached its end; its last buffer goes at once.
	final atomic.Bool
	// backlog reports buffers queued behind the current one.
	backlog func() int
	counted bool // in largeBodies until Close
	closed  bool // after Close a late Sum takes no lane
}

// newLaneMD5 returns a body's MD5 (a large body: counted in largeBodies).
// Close it once done (after Sum), or its lane and place at the gate stay
// taken.
func newLaneMD5() *laneMD5 {
	largeBodies.Add(1)
	return &laneMD5{counted: true}
}

// largeBodies counts the large bodies being read, in the lanes or not.
var largeBodies atomic.Int64

func (l *laneMD5) decide() {
	if l.lane != nil || l.alone != nil {
		return
	}
	if l.closed || !etagLanes || largeBodies.Load() <= 1 {
		l.alone = md5.New()
		return
	}
	md5LanesOnce.Do(func() { md5Lanes = md5simd.NewServer() })
	l.timer = time.NewTimer(time.Hour)
	l.timer.Stop()
	lanes.join()
	l.lane = md5Lanes.NewHash()
}

func (l *laneMD5) Write(p []byte) (int, error) {
	l.decide()
	if l.alone != nil {
		return l.alone.Write(p)
	}
	if !l.final.Load() && (l.backlog == nil || l.backlog() == 0) {
		lanes.wait(l.timer)
	}
	return l.lane.Write(p)
}

func (l *laneMD5) Sum(b []byte) []byte {
	l.decide()
	if l.alone != nil {
		return l.alone.Sum(b)
	}
	return l.lane.Sum(b)
}

func (l *laneMD5) Reset()         { panic("laneMD5: Reset is not used") }
func (l *laneMD5) Size() int      { return md5.Size }
func (l *laneMD5) BlockSize() int { return md5.BlockSize }

// inLanes reports whether the body's MD5 runs in the lanes (tests).
func (l *laneMD5) inLanes() bool { return l.lane != nil }

// Close frees the lane and the place at the gate; idempotent.
func (l *laneMD5) Close() {
	l.closed = true
	if l.lane != nil {
		l.lane.Close()
		l.lane = nil
		lanes.leave()
	}
	if l.counted {
		l.counted = false
		largeBodies.Add(-1)
	}
}
