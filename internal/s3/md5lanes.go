package s3

import (
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/basalt-store/basalt/internal/md5x"
)

// The ETag of a large body is its MD5, which S3 clients compare, so it
// must be computed; at ~850 MB/s per core with crypto/md5 it is the
// gateway's largest cost per byte. MD5 is serial within one body, but the
// gateway usually hashes several bodies at once: warp and the AWS SDKs
// send a large object as parts uploaded in parallel (four 16 MiB parts at
// a time per client from minio-go), and several clients write at once.
// internal/md5x advances up to 16 MD5 states side by side in the lanes of
// AVX-512 registers, and a pass costs about the same with 1 lane occupied
// as with 16 (MD5's steps are one latency chain): 0.75 GB/s with one
// lane, 3 GB/s with 4, ~10 GB/s with 16 per core here (BenchmarkMD5x).
//
// Its state is plain data ([4]uint32 and a length), so a body's MD5 can
// enter or leave the lanes at any 64-byte boundary: there is no choice to
// commit to, no rate to guess. Each large body's hashing goroutine hands
// its 256 KiB buffers, one at a time, to laneSched.hash, which hashes them
// in passes with whatever other bodies' buffers are ready at that moment:
//
//   - A goroutine leads: the first to arrive when nobody leads. It takes up to 16 queued buffers and advances them all by
//     the same number of blocks (at most laneChunk bytes, at most the
//     shortest one's rest), then takes what was queued meanwhile, and so
//     on. A buffer alone goes on the scalar path (crypto/md5, its state
//     imported and exported), on its own hashing goroutine with no
//     hand-over and no wait; a second body's buffer joins it in the lanes
//     at the next laneChunk boundary.
//   - When the leader's own buffer is done it hands the lead to a
//     goroutine whose buffer is still in hand (or queued), so that its own
//     body's next buffer is not held up by others' work; the others are
//     told when theirs is done.
//   - A buffer alone while other bodies are being read first yields its
//     goroutine once (runtime.Gosched): on a busy machine the other
//     bodies' hashing goroutines are often runnable but not yet run, and
//     then hand their buffers over to the same pass (warp put3 at load
//     7-10: bytes hashed alone ~45% -> see BENCHMARKS.md session 11).
//   - Batching comes from bodies whose hashing is behind (their buffers
//     queue while a pass runs) and from laneLinger: a new batch of fewer
//     buffers than there are bodies being read waits at most laneLinger
//     for company, unless a buffer in it is its body's last (the body
//     ended: its commit waits for the sum) or its body's reading had to
//     wait for its hashing lately (laneBehindKeep: a body read faster
//     than buffers come from the others would be held to one buffer per
//     laneLinger; session 10's BenchmarkETagFastBesideSlow).
//   - More than one goroutine leads when there are spare cores and the
//     pass would be thin: a buffer whose body is behind (its reading
//     waited for its hashing) leads its own passes, on its own goroutine,
//     when a leader already runs, fewer than GOMAXPROCS lead, and fewer
//     than laneThin other buffers are in hand (queued or in passes). One
//     leader hashes on one core: two bodies read flat out were ~22%
//     slower in one 2-lane pass than on two cores with crypto/md5
//     (BenchmarkETagLanes bodies=2, -cpu 2, review of session 11); three
//     or more share a pass as before, and paced bodies (never behind)
//     batch as before. Leaders take from the same queue; only one
//     lingers at a time.
//
// Reading never waits on hashing beyond the body's hashBufs buffers, as
// before: only the hashing goroutine waits. No goroutine or timer is
// started per body; a closed body leaves nothing (TestLaneStateBounded).
var lanes = laneSched{arrive: make(chan struct{}, 1)}

// laneSchedAlways (tests): large bodies go through the scheduler even
// without the AVX-512 kernel (md5x.Lanes then hashes each lane on the
// scalar path), so the scheduling is tested on any CPU.
var laneSchedAlways bool

// laneThin: a behind body's buffer leads its own passes (on a spare
// core) when fewer than this many other buffers are in hand: joining
// would make a pass of at most laneThin lanes on one core, which two
// cores hash as fast or faster on the scalar path (see lanes).
const laneThin = 2

// etagLanes: large bodies' MD5 may use the shared lanes (false: always
// the scalar path on the body's own hashing goroutine; benchmarks compare
// the two). Without AVX-512 (or BASALT_MD5X=scalar) the lanes are off.
var etagLanes = true

// laneChunk is the most one pass advances its buffers by: a buffer
// arriving meanwhile joins the lanes within one pass (~30 µs for 16
// lanes, ~20 µs for one buffer alone).
const laneChunk = 16 << 10

// laneLinger bounds how long a new batch waits for other bodies' buffers
// (a variable for tests and benchmarks). See BENCHMARKS.md, session 11.
var laneLinger = 1 * time.Millisecond

// laneBehindKeep: a body whose reading waited for its hashing (all its
// hashBufs buffers were waiting for digests) counts as behind for this
// many buffers and does not linger: it is read faster than it is hashed,
// and a linger costs it up to laneLinger of hashing. The test is the
// reader's wait, not the hash queue: on a loaded machine paced bodies
// often find a buffer queued (their hashing goroutine was not scheduled),
// and taking that as behind left 75% of the bytes of warp's put3 hashed
// alone; a body read flat out beside a paced one was held to ~480 MB/s
// against ~610 with no lanes (load 6, BenchmarkETagFastBesideSlow) when
// its queue alone was looked at, buffer by buffer. It is twice the
// body's hash buffers (behindKeep): a body with hashBufs (16) buffers
// whose reading paused (not scheduled on a loaded machine) refills its
// free buffers without waiting for up to 16 of them, and lost "behind"
// after 8 (TestLaneBehindBodiesLeadApart failed 9/10 under -race; review
// of session 13).
const laneBehindKeep = 2 * shallowHashBufs

// laneYield: a buffer alone yields its goroutine once before it is
// hashed, while other bodies are being read (a variable for benchmarks).
var laneYield = true

// laneSched hands buffers to the lanes (see lanes).
type laneSched struct {
	mu      sync.Mutex
	pending []*laneJob // queued buffers, not yet in a pass
	leaders int        // goroutines leading (at most GOMAXPROCS)
	inHand  int        // buffers in hash: queued or in a pass
	// lingering: a leader waits for company (one at a time: it owns
	// arrive and timer).
	lingering bool
	// arrive wakes a lingering leader: a buffer was queued or a body
	// stopped reading (capacity 1; a stale signal only makes it look
	// again). Made with lanes: poke reads it without the lock.
	arrive chan struct{}
	timer  *time.Timer // the lingering leader's timer
}

// laneJob is one buffer of a body in hand: whole blocks left to hash.
type laneJob struct {
	st *md5x.State
	sc *md5x.Scalar // the body's scalar path
	// inScalar: the state is loaded in sc (hashed alone), not in st.
	inScalar bool
	p        []byte
	at       int64 // ns, queued
	fresh    bool  // no block hashed yet
	// behind: the body's reading waited for its hashing within its last
	// laneBehindKeep buffers: it does not wait for company.
	behind  bool
	final   *atomic.Bool
	wake    chan bool // capacity 1: false done, true lead
	inLanes int64     // bytes of this body hashed beside others (tests)
}

// laneStats, since start (metrics, tests).
var laneStats struct {
	bodies atomic.Int64 // large bodies (laneMD5s made), lanes on or off
	// bytes[n]: bytes hashed in passes of n occupied lanes (1: scalar).
	bytes [md5x.MaxLanes + 1]atomic.Int64
	// behindBytes[n]: those of them of behind bodies' buffers.
	behindBytes [md5x.MaxLanes + 1]atomic.Int64
	// lingers that ended with company (a buffer arrived) or at laneLinger.
	lingerCompany, lingerTimeout atomic.Int64
	handovers                    atomic.Int64 // leads handed to another goroutine
	// extraLeads: buffers of behind bodies that led their own passes
	// beside another leader (spare cores).
	extraLeads atomic.Int64
}

// readingBodies counts the large bodies being read: from newLaneMD5 to
// EOF, failure or Close (not while the upload commits).
var readingBodies atomic.Int64

func (s *laneSched) poke() {
	select {
	case s.arrive <- struct{}{}:
	default:
	}
}

// hash advances j's state over j.p and returns when it is done.
func (s *laneSched) hash(j *laneJob) {
	j.at = time.Now().UnixNano()
	j.fresh = true
	s.mu.Lock()
	others := s.inHand
	s.inHand++
	extra := s.leaders > 0 && j.behind && others < laneThin && s.leaders < runtime.GOMAXPROCS(0)
	if s.leaders > 0 && !extra {
		s.pending = append(s.pending, j)
		s.mu.Unlock()
		s.poke()
		if !<-j.wake {
			return
		}
	} else {
		s.leaders++
		s.mu.Unlock()
		if extra {
			laneStats.extraLeads.Add(1)
		}
	}
	s.lead(j)
}

// lead runs passes until own is done, then hands the lead over or ends it.
func (s *laneSched) lead(own *laneJob) {
	act := make([]*laneJob, 1, md5x.MaxLanes)
	act[0] = own
	yielded := false
	for {
		s.mu.Lock()
		for len(act) < md5x.MaxLanes && len(s.pending) > 0 {
			act = append(act, s.pending[0])
			s.pending[0] = nil
			s.pending = s.pending[1:]
		}
		if len(s.pending) == 0 {
			s.pending = nil // let the backing array go
		}
		s.mu.Unlock()
		if s.linger(act) {
			continue
		}
		if laneYield && !yielded && len(act) == 1 && act[0].fresh && readingBodies.Load() > 1 {
			// Alone with others being read: let runnable hashing
			// goroutines (on a busy machine, not yet run) hand theirs
			// over first.
			yielded = true
			runtime.Gosched()
			continue
		}
		s.step(act)
		ownDone := false
		k, finished := len(act), 0
		for _, j := range act {
			if len(j.p) == 0 {
				finished++
			}
		}
		if finished > 0 {
			s.mu.Lock()
			s.inHand -= finished
			s.mu.Unlock()
			k = 0
			for _, j := range act {
				switch {
				case len(j.p) > 0:
					act[k] = j
					k++
				case j == own:
					ownDone = true
				default:
					j.wake <- false
				}
			}
		}
		clear(act[k:])
		act = act[:k]
		if !ownDone {
			continue
		}
		s.mu.Lock()
		if len(act) == 0 && len(s.pending) == 0 {
			s.leaders--
			s.mu.Unlock()
			return
		}
		var next *laneJob
		if len(act) > 0 {
			next = act[0]
			s.pending = slices.Concat(act[1:], s.pending)
		} else {
			next = s.pending[0]
			s.pending = slices.Clone(s.pending[1:])
		}
		s.mu.Unlock()
		laneStats.handovers.Add(1)
		next.wake <- true
		return
	}
}

// linger waits for company when act is a new batch (nothing hashed yet)
// of fewer buffers than bodies being read, none its body's last, and
// laneLinger since the oldest was queued has not passed. It reports
// whether it waited (the caller takes the queued buffers and looks again).
func (s *laneSched) linger(act []*laneJob) bool {
	d := laneLinger
	if d <= 0 || len(act) >= md5x.MaxLanes || int64(len(act)) >= readingBodies.Load() {
		return false
	}
	oldest := act[0].at
	for _, j := range act {
		if !j.fresh || j.behind || j.final.Load() {
			return false
		}
		oldest = min(oldest, j.at)
	}
	left := time.Duration(oldest + int64(d) - time.Now().UnixNano())
	if left <= 0 {
		return false
	}
	s.mu.Lock()
	if s.lingering {
		s.mu.Unlock()
		return false
	}
	s.lingering = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.lingering = false
		s.mu.Unlock()
	}()
	if s.timer == nil {
		s.timer = time.NewTimer(left)
	} else {
		s.timer.Reset(left)
	}
	select {
	case <-s.arrive:
		s.timer.Stop()
		laneStats.lingerCompany.Add(1)
	case <-s.timer.C:
		laneStats.lingerTimeout.Add(1)
	}
	return true
}

// step advances every buffer in act by the same number of bytes: one
// kernel pass, or the scalar path for a buffer alone.
func (s *laneSched) step(act []*laneJob) {
	n := laneChunk
	for _, j := range act {
		n = min(n, len(j.p))
	}
	if len(act) == 1 {
		// Alone: the state stays in the body's crypto/md5 between steps
		// and goes back at the buffer's end or into the lanes.
		j := act[0]
		if !j.inScalar {
			j.sc.Load(j.st)
			j.inScalar = true
		}
		j.sc.Write(j.p[:n])
		if n == len(j.p) {
			j.sc.Store(j.st)
			j.inScalar = false
		}
	} else {
		for _, j := range act {
			if j.inScalar {
				j.sc.Store(j.st)
				j.inScalar = false
			}
		}
		var sts [md5x.MaxLanes]*md5x.State
		var ds [md5x.MaxLanes][]byte
		for i, j := range act {
			sts[i], ds[i] = j.st, j.p[:n]
			j.inLanes += int64(n)
		}
		md5x.Lanes(sts[:len(act)], ds[:len(act)])
	}
	behind := 0
	for _, j := range act {
		j.p = j.p[n:]
		j.fresh = false
		if j.behind {
			behind++
		}
	}
	laneStats.bytes[len(act)].Add(int64(n * len(act)))
	if behind > 0 {
		laneStats.behindBytes[len(act)].Add(int64(n * behind))
	}
}

// laneMD5 is a large body's MD5 (a hash.Hash): Write is called by the
// body's hashing goroutine, one hash buffer at a time, and hashes the
// buffer's whole blocks through lanes; Sum once that goroutine is done.
// Close (idempotent) ends the body's count; Sum after it returns the sum
// of what was hashed.
type laneMD5 struct {
	d   md5x.Digest
	job laneJob
	// final: the body reached its end (or failed); its buffers do not
	// wait for company.
	final   atomic.Bool
	reading bool // counted in readingBodies (the body's goroutine)
	// readWaits counts the times the body's reading waited for a free
	// hash buffer (nil: not known); readWaitsSeen is its value at the
	// previous buffer.
	readWaits     *atomic.Int64
	readWaitsSeen int64
	behindLeft    int // buffers it still counts as behind (behindKeep)
	// behindKeep: buffers it counts as behind after a wait (twice its
	// hash buffers; 0: laneBehindKeep). Set before its first buffer.
	behindKeep int
	sum        []byte
}

// newLaneMD5 returns a large body's MD5. Call done at EOF or failure and
// Close once finished.
func newLaneMD5() *laneMD5 {
	l := &laneMD5{reading: true}
	l.d.Reset()
	l.job = laneJob{st: &l.d.St, sc: md5x.NewScalar(), final: &l.final, wake: make(chan bool, 1)}
	readingBodies.Add(1)
	laneStats.bodies.Add(1)
	return l
}

// done marks the end of the body's reading: no longer counted nor waited
// for. Call it on the body's goroutine.
func (l *laneMD5) done() {
	l.final.Store(true)
	if l.reading {
		l.reading = false
		readingBodies.Add(-1)
		lanes.poke()
	}
}

func (l *laneMD5) Write(p []byte) (int, error) {
	n := len(p)
	p = l.d.Fill(p)
	full := len(p) &^ (md5x.BlockSize - 1)
	if full > 0 {
		if etagLanes && (md5x.HasLanes() || laneSchedAlways) {
			l.job.p = p[:full]
			if w := l.readWaits; w != nil && w.Load() != l.readWaitsSeen {
				l.readWaitsSeen = w.Load()
				l.behindLeft = max(l.behindKeep, laneBehindKeep)
			} else if l.behindLeft > 0 {
				l.behindLeft--
			}
			l.job.behind = l.behindLeft > 0
			lanes.hash(&l.job)
		} else {
			l.job.sc.Blocks(&l.d.St, p[:full])
			laneStats.bytes[1].Add(int64(full))
		}
	}
	l.d.Keep(p[full:])
	return n, nil
}

func (l *laneMD5) Sum(b []byte) []byte {
	if l.sum == nil {
		l.sum = l.d.Sum(nil)
	}
	return append(b, l.sum...)
}

func (l *laneMD5) Reset()         { panic("laneMD5: Reset is not used") }
func (l *laneMD5) Size() int      { return md5x.Size }
func (l *laneMD5) BlockSize() int { return md5x.BlockSize }

// inLanes reports whether some of the body was hashed beside another
// body in a kernel pass (tests).
func (l *laneMD5) inLanes() bool { return l.job.inLanes > 0 }

// Close ends the body's count; idempotent.
func (l *laneMD5) Close() { l.done() }
