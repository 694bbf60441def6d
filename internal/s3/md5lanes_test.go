package s3

import (
	"bytes"
	"crypto/md5"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	md5simd "github.com/minio/md5-simd"
)

// largeCompanions opens n large bodies that are never read: they count as
// large bodies being read (so bodies opened beside them take the lanes)
// without a place at any gate.
func largeCompanions(t testing.TB, n int) func() {
	var bs []*body
	for range n {
		r, a := plainRequest(make([]byte, asyncHashMin))
		b, e := newBody(r, a, MaxObjectSize, true)
		if e != nil {
			t.Fatal(e)
		}
		bs = append(bs, b)
	}
	return func() {
		for _, b := range bs {
			b.close()
		}
	}
}

// waitLanesIdle waits until no lane hasher, no large body and no server
// beyond the current one is left, and the goroutine count is back to at
// most base (servers' goroutines end shortly after their Close).
func waitLanesIdle(t testing.TB, base int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		h, s, lb, g := lanePool.hashers.Load(), lanePool.servers.Load(), largeBodies.Load(), runtime.NumGoroutine()
		if h == 0 && s <= 1 && lb == 0 && g <= base {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("lanes not idle: %d hashers, %d servers open, %d large bodies counted, %d goroutines (was %d)", h, s, lb, g, base)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// baseGoroutines is the goroutine count with the current lane server
// started (its goroutine lives until the server is retired).
func baseGoroutines() int {
	l := &laneMD5{force: 1}
	l.Write(make([]byte, 64))
	l.Sum(nil)
	l.Close()
	runtime.GC()
	return runtime.NumGoroutine() + 1 // the retiring of the current server may start a fresh one
}

// TestLaneMD5ETags: large bodies hashed side by side in the lanes each get
// their own MD5 as ETag (lengths around block and buffer boundaries, odd
// read sizes, plain and aws-chunked), every lane is freed, a wrong
// Content-MD5 on a large body in the lanes fails at EOF with BadDigest, and
// a body read with fewer than laneMinBodies large bodies uses crypto/md5.
func TestLaneMD5ETags(t *testing.T) {
	defer func(f float64) { laneFastest = f }(laneFastest)
	laneFastest = 1e15 // bodies here come from memory
	base := baseGoroutines()
	closeCompanions := largeCompanions(t, laneMinBodies-1)
	rng := rand.New(rand.NewPCG(1, 2))
	sizes := []int{asyncHashMin, asyncHashMin + 1, asyncHashMin + 63, asyncHashMin + 64, asyncHashMin + 65,
		32<<10*40 + 17, hashBufSize*5 - 1, hashBufSize * 5, hashBufSize*5 + 1, 3<<20 + 5, 4 << 20}
	var wg sync.WaitGroup
	errs := make(chan error, 8*len(sizes))
	for round := range 4 {
		for i, n := range sizes {
			data := make([]byte, n)
			for j := range data {
				data[j] = byte(rng.Uint32())
			}
			readSize := 1 + rng.IntN(300<<10)
			wg.Add(1)
			go func() {
				defer wg.Done()
				var r, a = plainRequest(data)
				if (i+round)%2 == 1 {
					r, a = chunkedRequest(data)
				}
				b, e := newBody(r, a, MaxObjectSize, true)
				if e != nil {
					errs <- e
					return
				}
				defer b.close()
				buf := make([]byte, readSize)
				for {
					_, err := b.Read(buf)
					if err == io.EOF {
						break
					}
					if err != nil {
						errs <- err
						return
					}
				}
				sum := md5.Sum(data)
				if b.etag() != hex.EncodeToString(sum[:]) || b.etag() != hex.EncodeToString(sum[:]) {
					errs <- fmt.Errorf("%d bytes read by %d: ETag %s, want %x", n, readSize, b.etag(), sum)
				}
				if !b.laneMD5.inLanes() {
					errs <- fmt.Errorf("a %d-byte body read beside others was not hashed in the lanes", n)
				}
			}()
		}
		wg.Wait()
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	// A wrong Content-MD5 on a large body in the lanes: BadDigest at EOF.
	data := bytes.Repeat([]byte("lanes"), 300<<10)
	r, a := plainRequest(data)
	bad := md5.Sum(append([]byte{1}, data...))
	r.Header.Set("Content-Md5", base64.StdEncoding.EncodeToString(bad[:]))
	b, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	_, err := io.Copy(io.Discard, b)
	var se *Error
	if !errors.As(err, &se) || se.Code != "BadDigest" || !b.laneMD5.inLanes() {
		t.Fatalf("a large body with a wrong Content-MD5: %v (lanes %v), want BadDigest", err, b.laneMD5.inLanes())
	}
	b.close()
	// And the right one passes; its ETag after close is the same.
	good := md5.Sum(data)
	r, a = plainRequest(data)
	r.Header.Set("Content-Md5", base64.StdEncoding.EncodeToString(good[:]))
	b2, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	if _, err := io.Copy(io.Discard, b2); err != nil || b2.etag() != hex.EncodeToString(good[:]) || !b2.laneMD5.inLanes() {
		t.Fatalf("a large body with its Content-MD5: %v, ETag %s", err, b2.etag())
	}
	b2.close()
	if b2.etag() != hex.EncodeToString(good[:]) {
		t.Fatalf("ETag after close %s", b2.etag())
	}

	// With fewer than laneMinBodies large bodies being read: crypto/md5,
	// the same ETag.
	closeCompanions()
	r, a = plainRequest(data)
	b3, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	if _, err := io.Copy(io.Discard, b3); err != nil || b3.laneMD5.inLanes() || b3.etag() != hex.EncodeToString(good[:]) {
		t.Fatalf("a body read alone: %v, lanes %v, ETag %s", err, b3.laneMD5.inLanes(), b3.etag())
	}
	b3.close()
	waitLanesIdle(t, base)
}

// TestLaneServersBounded: thousands of bodies through the lanes leave no
// state behind. md5-simd v1.1.2 keeps every closed hasher in its server's
// maps and walks them all on every pass (upstream #27): without retiring
// servers, a 4 MiB body's MD5 took several times longer after a few
// thousand bodies. Here every server takes at most laneServerBodies
// bodies, retired servers are closed and their goroutines end, and a
// body's MD5 takes as long after 6,000 bodies as before.
func TestLaneServersBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("hashes 6,000 bodies")
	}
	base := baseGoroutines()
	probe := bytes.Repeat([]byte("probe-md5"), 4<<20/9)
	want := md5.Sum(probe)
	timeProbe := func() time.Duration {
		best := time.Hour
		for range 5 {
			start := time.Now()
			l := &laneMD5{force: 1}
			for p := probe; len(p) > 0; p = p[min(len(p), hashBufSize):] {
				l.Write(p[:min(len(p), hashBufSize)])
			}
			if got := l.Sum(nil); !bytes.Equal(got, want[:]) {
				t.Fatalf("probe MD5 %x, want %x", got, want)
			}
			l.Close()
			best = min(best, time.Since(start))
		}
		return best
	}
	before := timeProbe()
	retired0 := lanePool.retired.Load()

	const bodies, side = 6000, 4
	data := make([]byte, 3*32<<10+100) // a few of md5-simd's 32 KiB blocks
	for i := range data {
		data[i] = byte(i * 7)
	}
	wantSmall := md5.Sum(data)
	var maxServers, maxHashers int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan int)
	for range side {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				l := &laneMD5{force: 1}
				l.Write(data[:len(data)/2])
				l.Write(data[len(data)/2:])
				if i%10 == 9 { // abandoned without a Sum, as a failed body is
					l.Close()
					continue
				}
				sum := l.Sum(nil)
				mu.Lock()
				maxServers = max(maxServers, lanePool.servers.Load())
				maxHashers = max(maxHashers, lanePool.hashers.Load())
				mu.Unlock()
				l.Close()
				if !bytes.Equal(sum, wantSmall[:]) {
					t.Errorf("body %d: MD5 %x, want %x", i, sum, wantSmall)
				}
			}
		}()
	}
	for i := range bodies {
		work <- i
	}
	close(work)
	wg.Wait()
	after := timeProbe()
	retired := lanePool.retired.Load() - retired0
	t.Logf("4 MiB probe: %v before, %v after %d bodies; %d servers retired; at most %d servers and %d hashers open", before, after, bodies, retired, maxServers, maxHashers)
	if want := int64(bodies / laneServerBodies); retired < want-1 {
		t.Errorf("%d servers retired for %d bodies, want ≥ %d", retired, bodies, want-1)
	}
	// Open at once: the current server and retired ones still holding
	// one of the side bodies.
	if maxServers > side+1 || maxHashers > side {
		t.Errorf("at most %d servers and %d hashers open at once, want ≤ %d and ≤ %d", maxServers, maxHashers, side+1, side)
	}
	if after > 3*before+20*time.Millisecond {
		t.Errorf("a 4 MiB body's MD5 took %v after %d bodies, %v before: the servers' state grows", after, bodies, before)
	}
	waitLanesIdle(t, base)
}

// TestLaneBodiesAbandoned: bodies in the lanes that end early — the client
// disconnects mid-way, or sends fewer bytes than declared — fail as
// before, and leave no hasher, count or goroutine behind.
func TestLaneBodiesAbandoned(t *testing.T) {
	base := baseGoroutines()
	closeCompanions := largeCompanions(t, laneMinBodies-1)
	data := bytes.Repeat([]byte("abandon!"), 3<<20/8)
	var wg sync.WaitGroup
	errs := make(chan error, 80)
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, a := plainRequest(data)
			cut := 300<<10 + i*37<<10
			wantCode := "IncompleteBody"
			if i%2 == 0 { // disconnect: the read fails
				r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(data[:cut]), errReader{syscall.ECONNRESET}))
			} else { // truncated: EOF before the declared length
				r.Body = io.NopCloser(bytes.NewReader(data[:cut]))
			}
			b, e := newBody(r, a, MaxObjectSize, true)
			if e != nil {
				errs <- e
				return
			}
			defer b.close()
			b.laneMD5.force = 1 // in the lanes even if it fails before its first buffer is hashed
			_, err := io.Copy(io.Discard, b)
			var se *Error
			if !errors.As(err, &se) || se.Code != wantCode {
				errs <- fmt.Errorf("body cut at %d: %v, want %s", cut, err, wantCode)
			}
			b.close() // as the handler's deferred close; the hashing is done after it
			if !b.laneMD5.inLanes() {
				errs <- fmt.Errorf("body cut at %d not in the lanes", cut)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	closeCompanions()
	waitLanesIdle(t, base)
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// TestLaneGateWaitsOnlyForHashing: a buffer at the gate waits only for
// bodies whose next buffer is due within laneWait; never for one that
// ended, paused (overdue), or is slower than laneSlowest, and never
// longer than laneWait.
func TestLaneGateWaitsOnlyForHashing(t *testing.T) {
	var g laneGate
	self := &laneMD5{}
	other := &laneMD5{}
	g.join(self)
	g.join(other)
	now := time.Now().UnixNano()
	timeWait := func() time.Duration {
		self.last, self.interval = 0, 0
		start := time.Now()
		g.wait(self)
		return time.Since(start)
	}
	cases := []struct {
		name                 string
		last, interval, next int64
		final                bool
		waits                bool
	}{
		{"due within laneWait", now, int64(time.Millisecond), now + int64(100*time.Microsecond), false, true},
		{"ended", now, int64(time.Millisecond), now + int64(100*time.Microsecond), true, false},
		{"paused (overdue)", now, int64(time.Millisecond), now - int64(50*time.Millisecond), false, false},
		{"slower than laneSlowest", now, int64(2 * laneSlowest), now + int64(100*time.Microsecond), false, false},
		{"due later than laneWait", now, int64(5 * time.Millisecond), now + int64(4*time.Millisecond), false, false},
		{"rate not known yet", now, 0, now, false, false},
	}
	for _, c := range cases {
		other.last, other.interval, other.next = c.last, c.interval, c.next
		// Re-base the due time on the clock at the wait.
		shift := time.Now().UnixNano() - now
		other.next += shift
		other.final.Store(c.final)
		timeouts := g.timeout.Load()
		d := timeWait()
		waited := g.timeout.Load() > timeouts
		if waited != c.waits {
			t.Errorf("%s: waited %v (timed out %v), want a wait %v", c.name, d, waited, c.waits)
		}
		if d > 100*time.Millisecond {
			t.Errorf("%s: the wait took %v, bound %v", c.name, d, laneWait)
		}
	}
	// A due body that arrives releases the waiting one before laneWait.
	other.final.Store(false)
	other.last, other.interval = time.Now().UnixNano(), int64(time.Millisecond)
	other.next = other.last + int64(200*time.Microsecond)
	done := make(chan struct{})
	go func() { g.wait(self); close(done) }()
	for {
		g.mu.Lock()
		w := g.waiting
		g.mu.Unlock()
		if w == 1 {
			break
		}
		runtime.Gosched()
	}
	timeouts := g.timeout.Load()
	g.wait(other)
	<-done
	if g.timeout.Load() != timeouts {
		t.Errorf("the waiting buffer was released by the timeout, not by its companion's arrival")
	}
}

// BenchmarkETagLanes: MD5 of n 16 MiB bodies at once, in the lanes and
// with crypto/md5 (one goroutine per body). Run with -cpu 1 to see the CPU
// per byte.
//
//	go test -run '^$' -bench ETagLanes -cpu 1 ./internal/s3/
func BenchmarkETagLanes(b *testing.B) {
	buf := bytes.Repeat([]byte("0123456789abcdef"), hashBufSize/16)
	const total = 16 << 20
	for _, streams := range []int{1, 4, 12} {
		for _, lanes := range []bool{false, true} {
			b.Run(fmt.Sprintf("bodies=%d/lanes=%v", streams, lanes), func(b *testing.B) {
				b.SetBytes(int64(streams * total))
				for range b.N {
					var wg sync.WaitGroup
					for range streams {
						h := &laneMD5{force: 2}
						if lanes {
							h.force = 1
						}
						wg.Add(1)
						go func() {
							defer wg.Done()
							defer h.Close()
							for n := 0; n < total; n += len(buf) {
								h.Write(buf)
							}
							h.Sum(nil)
						}()
					}
					wg.Wait()
				}
			})
		}
	}
}

// pacedReader delivers its data as a network would: step bytes at a time,
// one step per tick.
type pacedReader struct {
	data []byte
	step int
	tick *time.Ticker
}

func (p *pacedReader) Read(b []byte) (int, error) {
	if len(p.data) == 0 {
		return 0, io.EOF
	}
	<-p.tick.C
	n := copy(b[:min(len(b), p.step)], p.data)
	p.data = p.data[n:]
	return n, nil
}

func cpuNow() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkETagPaced: the process CPU per GiB of reading n large bodies
// at once whose bytes arrive at 40–80 MB/s each (64 KiB every 0.8–1.6
// ms, as parts over the network do), with the ETag in the shared lanes or with
// crypto/md5 per body.
//
//	go test -run '^$' -bench ETagPaced ./internal/s3/
func BenchmarkETagPaced(b *testing.B) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 16<<20/16)
	for _, bodies := range []int{4, 12} {
		for _, useLanes := range []bool{false, true} {
			b.Run(fmt.Sprintf("bodies=%d/lanes=%v", bodies, useLanes), func(b *testing.B) {
				old := etagLanes
				etagLanes = useLanes
				defer func() { etagLanes = old }()
				b.SetBytes(int64(bodies * len(data)))
				cpu0 := cpuNow()
				for range b.N {
					var wg sync.WaitGroup
					for range bodies {
						wg.Add(1)
						go func() {
							defer wg.Done()
							t := time.NewTicker(time.Duration(800+rand.IntN(800)) * time.Microsecond)
							defer t.Stop()
							r, a := plainRequest(data)
							r.Body = io.NopCloser(&pacedReader{data: data, step: 64 << 10, tick: t})
							readBody(b, r, a, make([]byte, 4<<20))
						}()
					}
					wg.Wait()
				}
				cpu := cpuNow() - cpu0
				b.ReportMetric(cpu.Seconds()/(float64(b.N*bodies*len(data))/(1<<30)), "cpu-s/GiB")
			})
		}
	}
}

// BenchmarkETagFastBesideSlow: the review's case — one 64 MiB body read
// flat out beside `slow` bodies paced at ~40 MB/s (64 KiB every 1.6 ms);
// the time is the fast body's (read to EOF with its ETag), lanes on and
// off. With the lanes it must be no slower than with crypto/md5.
//
//	go test -run '^$' -bench ETagFastBesideSlow ./internal/s3/
func BenchmarkETagFastBesideSlow(b *testing.B) {
	fast := bytes.Repeat([]byte("fast-body-bytes!"), 64<<20/16)
	slowData := bytes.Repeat([]byte("slow-body-bytes!"), 256<<20/16)
	for _, slow := range []int{1, 3} {
		for _, useLanes := range []bool{false, true} {
			b.Run(fmt.Sprintf("slow=%d/lanes=%v", slow, useLanes), func(b *testing.B) {
				old := etagLanes
				etagLanes = useLanes
				defer func() { etagLanes = old }()
				stop := make(chan struct{})
				var wg sync.WaitGroup
				for range slow { // paced bodies, running through the whole benchmark
					wg.Add(1)
					go func() {
						defer wg.Done()
						for {
							select {
							case <-stop:
								return
							default:
							}
							t := time.NewTicker(1600 * time.Microsecond)
							r, a := plainRequest(slowData)
							r.Body = io.NopCloser(&pacedReader{data: slowData, step: 64 << 10, tick: t})
							bd, e := newBody(r, a, MaxObjectSize, true)
							if e != nil {
								panic(e)
							}
							buf := make([]byte, 256<<10)
							for {
								select {
								case <-stop:
									bd.close()
									t.Stop()
									return
								default:
								}
								if _, err := bd.Read(buf); err != nil {
									break
								}
							}
							bd.close()
							t.Stop()
						}
					}()
				}
				time.Sleep(20 * time.Millisecond) // the slow ones are reading
				buf := make([]byte, 4<<20)
				b.SetBytes(int64(len(fast)))
				b.ResetTimer()
				for range b.N {
					r, a := plainRequest(fast)
					bd := readBody(b, r, a, buf)
					if bd.etag() == "" {
						b.Fatal("no ETag")
					}
				}
				b.StopTimer()
				close(stop)
				wg.Wait()
			})
		}
	}
}

// TestLaneFastBodyTakesCryptoMD5: beside enough other large bodies, a body
// arriving at network pace takes the lanes, but one read flat out (faster
// than laneFastest) hashes with crypto/md5, which a lane would hold back.
func TestLaneFastBodyTakesCryptoMD5(t *testing.T) {
	base := baseGoroutines()
	closeCompanions := largeCompanions(t, laneMinBodies-1)
	defer closeCompanions()
	data := bytes.Repeat([]byte("pace"), 2<<20/4)
	tick := time.NewTicker(time.Millisecond) // 64 KiB per ms: ≤ 64 MB/s
	defer tick.Stop()
	r, a := plainRequest(data)
	r.Body = io.NopCloser(&pacedReader{data: data, step: 64 << 10, tick: tick})
	paced := readBody(t, r, a, make([]byte, 1<<20))
	if !paced.laneMD5.inLanes() {
		t.Errorf("a body at ≤ 64 MB/s beside %d others did not take the lanes", laneMinBodies-1)
	}
	sum := md5.Sum(data)
	if paced.etag() != hex.EncodeToString(sum[:]) {
		t.Errorf("paced body ETag %s", paced.etag())
	}
	// Buffers handed over back to back after the first (flat out from
	// memory: the times are given, so this holds under the race detector
	// too): crypto/md5; the same buffers 10 ms apart (~26 MB/s): the lanes.
	buf := data[:hashBufSize]
	want := md5.Sum(append(append(append([]byte(nil), buf...), buf...), buf...))
	for _, c := range []struct {
		gap   time.Duration
		lanes bool
	}{{time.Microsecond, false}, {10 * time.Millisecond, true}} {
		l := newLaneMD5()
		now := time.Now().UnixNano()
		for i := range 3 {
			l.sent(now+int64(i)*int64(c.gap), len(buf))
		}
		for range 3 {
			l.Write(buf)
		}
		if l.inLanes() != c.lanes {
			t.Errorf("buffers %v apart: in the lanes %v, want %v", c.gap, l.inLanes(), c.lanes)
		}
		if got := l.Sum(nil); !bytes.Equal(got, want[:]) {
			t.Errorf("buffers %v apart: MD5 %x, want %x", c.gap, got, want)
		}
		l.Close()
	}
	closeCompanions()
	waitLanesIdle(t, base)
}

// BenchmarkLaneServerBodies: what dead hashers cost an md5-simd v1.1.2
// server (upstream #27): a 4 MiB body hashed alone through a server that
// has already taken `dead` closed hashers, per 32 KiB pass. laneServerBodies
// bounds dead at 64.
//
//	go test -run '^$' -bench LaneServerBodies ./internal/s3/
func BenchmarkLaneServerBodies(b *testing.B) {
	buf := bytes.Repeat([]byte("0123456789abcdef"), hashBufSize/16)
	const total = 4 << 20
	for _, dead := range []int{0, 64, 256, 2048} {
		b.Run(fmt.Sprintf("dead=%d", dead), func(b *testing.B) {
			srv := md5simd.NewServer()
			defer srv.Close()
			for range dead {
				h := srv.NewHash()
				h.Write(buf[:64])
				h.Sum(nil)
				h.Close()
			}
			b.SetBytes(total)
			b.ResetTimer()
			for range b.N {
				h := srv.NewHash()
				for n := 0; n < total; n += len(buf) {
					h.Write(buf)
				}
				h.Sum(nil)
				h.Close()
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*total/(32<<10)), "ns/pass")
		})
	}
}

// slowStartReader serves data from memory after a pause before its first
// byte, as a real client does (the Expect: 100-continue round trip, TCP
// slow start) before sending flat out.
type slowStartReader struct {
	data  []byte
	pause time.Duration
}

func (s *slowStartReader) Read(b []byte) (int, error) {
	if s.pause > 0 {
		time.Sleep(s.pause)
		s.pause = 0
	}
	if len(s.data) == 0 {
		return 0, io.EOF
	}
	n := copy(b, s.data)
	s.data = s.data[n:]
	return n, nil
}

// TestLaneFastAfterSlowStart (the review's case): a body whose first
// buffer comes late and the rest flat out is judged by the rhythm after
// its first buffer and takes crypto/md5; a body paced throughout still
// takes the lanes. laneFastest is lowered so that a read from memory is
// far above it under the race detector and on a loaded machine too, and
// the pause is long enough that a rate from the body's opening would be
// below it (the rule before the review: it took the lanes).
func TestLaneFastAfterSlowStart(t *testing.T) {
	defer func(f float64) { laneFastest = f }(laneFastest)
	laneFastest = 50e6
	base := baseGoroutines()
	closeCompanions := largeCompanions(t, laneMinBodies-1)
	defer closeCompanions()
	data := bytes.Repeat([]byte("late"), 4<<20/4)
	sum := md5.Sum(data)
	crypto := 0
	for range 3 { // a loaded machine can stall a read now and then
		r, a := plainRequest(data)
		r.Body = io.NopCloser(&slowStartReader{data: data, pause: 30 * time.Millisecond})
		b := readBody(t, r, a, make([]byte, 64<<10))
		if b.etag() != hex.EncodeToString(sum[:]) {
			t.Errorf("late-start body ETag %s", b.etag())
		}
		if !b.laneMD5.inLanes() {
			crypto++
		}
	}
	if crypto == 0 {
		t.Errorf("3 bodies read flat out after a 30 ms start all took the lanes")
	}
	tick := time.NewTicker(5 * time.Millisecond) // 64 KiB per 5 ms: ≤ 13 MB/s
	defer tick.Stop()
	r, a := plainRequest(data[:1<<20])
	r.Body = io.NopCloser(&pacedReader{data: data[:1<<20], step: 64 << 10, tick: tick})
	if b := readBody(t, r, a, make([]byte, 64<<10)); !b.laneMD5.inLanes() {
		t.Errorf("a body paced at ≤ 13 MB/s throughout did not take the lanes")
	}
	closeCompanions()
	waitLanesIdle(t, base)
}

// TestLaneGateCountsByRelease: buffers released by another body's
// timeout count as timeout, not together (metrics), and buffers released
// by a companion's arrival count as together.
func TestLaneGateCountsByRelease(t *testing.T) {
	var g laneGate
	a, b, due := &laneMD5{}, &laneMD5{}, &laneMD5{}
	for _, l := range []*laneMD5{a, b, due} {
		g.join(l)
	}
	waitFor := func(n int) {
		for {
			g.mu.Lock()
			w := g.waiting
			g.mu.Unlock()
			if w == n {
				return
			}
			runtime.Gosched()
		}
	}
	setDue := func() { // due keeps being due within laneWait, never arrives
		g.mu.Lock()
		due.last, due.interval = time.Now().UnixNano(), int64(time.Millisecond)
		due.next = due.last + int64(100*time.Microsecond)
		g.mu.Unlock()
	}
	// a and b wait for due, which never comes: the first timer releases
	// both, and both count as timeout.
	setDue()
	t0, to0 := laneBuffers.together.Load(), laneBuffers.timeout.Load()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); g.wait(a) }()
	waitFor(1)
	// b comes 1 ms later, so a's timer fires first and releases b too
	// (if the machine stalls past a's timeout, b waits on its own and
	// times out: also 2).
	time.Sleep(time.Millisecond)
	setDue()
	g.wait(b)
	wg.Wait()
	if got, want := laneBuffers.timeout.Load()-to0, int64(2); got != want {
		t.Errorf("a batch released by a timeout: %d buffers counted timeout, want %d (together %d)", got, want, laneBuffers.together.Load()-t0)
	}
	if got := laneBuffers.together.Load() - t0; got != 0 {
		t.Errorf("a batch released by a timeout: %d buffers counted together", got)
	}
}
