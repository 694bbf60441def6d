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
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestLaneMD5ETags: large bodies hashed side by side in md5-simd's lanes
// each get their own MD5 as ETag (lengths around block and buffer
// boundaries, odd read sizes, plain and aws-chunked), a lane is freed by
// close, and a wrong Content-MD5 on a large body still fails at EOF with
// BadDigest.
func TestLaneMD5ETags(t *testing.T) {
	// A body read beside another takes the lanes (at its first buffer);
	// the companion stays open through the concurrent part, so every body
	// there has company.
	companion := largeCompanion(t)
	rng := rand.New(rand.NewPCG(1, 2))
	sizes := []int{asyncHashMin, asyncHashMin + 1, asyncHashMin + 63, asyncHashMin + 64, 32<<10*40 + 17, 3<<20 + 5, 4 << 20}
	var wg sync.WaitGroup
	errs := make(chan error, 4*len(sizes))
	for round := range 4 { // more bodies than lanes over the rounds: lanes are reused
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
				if sum := md5.Sum(data); b.etag() != hex.EncodeToString(sum[:]) {
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
	defer b.close()
	_, err := io.Copy(io.Discard, b)
	var se *Error
	if !errors.As(err, &se) || se.Code != "BadDigest" || !b.laneMD5.inLanes() {
		t.Fatalf("a large body with a wrong Content-MD5: %v (lanes %v), want BadDigest", err, b.laneMD5.inLanes())
	}
	// And the right one passes.
	good := md5.Sum(data)
	r, a = plainRequest(data)
	r.Header.Set("Content-Md5", base64.StdEncoding.EncodeToString(good[:]))
	b2, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	defer b2.close()
	if _, err := io.Copy(io.Discard, b2); err != nil || b2.etag() != hex.EncodeToString(good[:]) {
		t.Fatalf("a large body with its Content-MD5: %v, ETag %s", err, b2.etag())
	}
	b.close()
	b2.close()
	// A Sum after close (no caller does it; a late ETag must not take a
	// lane nobody frees) is harmless.
	active := func() int { lanes.mu.Lock(); defer lanes.mu.Unlock(); return lanes.active }
	before := active()
	fresh := newLaneMD5()
	fresh.Close()
	fresh.Sum(nil)
	if after := active(); after != before {
		t.Fatalf("a Sum after Close took a place at the gate: %d -> %d", before, after)
	}

	// A body read alone hashes with crypto/md5, with the same ETag.
	companion.close()
	if n := largeBodies.Load(); n != 0 {
		t.Fatalf("%d large bodies still counted after every one was closed", n)
	}
	r, a = plainRequest(data)
	b3, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	defer b3.close()
	if _, err := io.Copy(io.Discard, b3); err != nil || b3.laneMD5.inLanes() || b3.etag() != hex.EncodeToString(good[:]) {
		t.Fatalf("a body read alone: %v, lanes %v, ETag %s", err, b3.laneMD5.inLanes(), b3.etag())
	}
}

// largeCompanion opens a large body that is never read: it counts as a
// large body being read (so the ones opened beside it take the lanes)
// without a place at the gate.
func largeCompanion(t testing.TB) *body {
	r, a := plainRequest(make([]byte, asyncHashMin))
	b, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	return b
}

// BenchmarkETagLanes: MD5 of n 16 MiB bodies at once, in the lanes and
// with crypto/md5 (one goroutine per body, as before). Run with -cpu 1 to
// see the CPU per byte.
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
						var h *laneMD5
						if lanes { // all open before any writes, as bodies read side by side are
							h = newLaneMD5()
						}
						wg.Add(1)
						go func() {
							defer wg.Done()
							if lanes {
								defer h.Close()
								for n := 0; n < total; n += len(buf) {
									h.Write(buf)
								}
								h.Sum(nil)
								return
							}
							h := md5.New()
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

// BenchmarkETagPaced: the process CPU per GiB of reading n large bodies
// at once whose bytes arrive at 40–80 MB/s each (64 KiB every 0.8–1.6
// ms, as parts over the network do), with the ETag in the shared lanes or with
// crypto/md5 per body. The gate (laneGate) is what makes the lanes pay
// here: without it, paced bodies rarely share a pass.
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
				companion := largeCompanion(b) // as the rest of a steady stream of parts
				defer companion.close()
				b.SetBytes(int64(bodies * len(data)))
				var ru0, ru1 syscall.Rusage
				syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
				for range b.N {
					var wg sync.WaitGroup
					for range bodies {
						wg.Add(1)
						go func() {
							defer wg.Done()
							// Each body at its own pace, 40–80 MB/s: parts
							// over the network do not arrive in step.
							t := time.NewTicker(time.Duration(800+rand.IntN(800)) * time.Microsecond)
							defer t.Stop()
							r, a := plainRequest(data)
							r.Body = io.NopCloser(&pacedReader{data: data, step: 64 << 10, tick: t})
							readBody(b, r, a, make([]byte, 4<<20))
						}()
					}
					wg.Wait()
				}
				syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
				cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
				b.ReportMetric(cpu.Seconds()/(float64(b.N*bodies*len(data))/(1<<30)), "cpu-s/GiB")
			})
		}
	}
}

// TestSignedSmallBodyAllocs: the gateway's own work on the body of a
// small PUT as warp sends it (4 KiB, STREAMING-AWS4-HMAC-SHA256-PAYLOAD:
// a signed data chunk and the signed final chunk, X-Amz-Decoded-Content-
// Length; header lookups of the checksum and ACL names, the user metadata
// scan) allocates a fixed, small number of times: none per chunk
// signature (session 8's code: 55 in all, 15 now). A corrupted chunk
// still fails with SignatureDoesNotMatch.
func TestSignedSmallBodyAllocs(t *testing.T) {
	data := bytes.Repeat([]byte("s"), 4096)
	enc := encodeChunked(data, 64<<10, true, nil)
	mk := func(body []byte) *http.Request {
		r, _ := http.NewRequest("PUT", "http://s3.test/b/k", bytes.NewReader(body))
		r.Header.Set("X-Amz-Decoded-Content-Length", "4096")
		r.Header.Set("Content-Type", "application/octet-stream")
		r.Header.Set("X-Amz-Meta-Owner", "bench")
		return r
	}
	a := *fuzzAuth
	a.payload = streamingSigned
	a.key = newDerivedKey(a.signingKey) // as authenticate leaves it
	put := func(r *http.Request) error {
		b, e := newBody(r, &a, MaxObjectSize, true)
		if e != nil {
			return e
		}
		defer b.close()
		if _, e := metaFromHeaders(r.Header); e != nil {
			return e
		}
		if hasACLHeaders(r.Header) {
			return errors.New("no ACL headers were sent")
		}
		var buf [8192]byte
		for {
			_, err := b.Read(buf[:])
			if err == io.EOF {
				break
			}
			if err != nil {
				return err
			}
		}
		if sum := md5.Sum(data); b.etag() != hex.EncodeToString(sum[:]) {
			return fmt.Errorf("ETag %s", b.etag())
		}
		return nil
	}
	if err := put(mk(enc)); err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(enc)
	bad[bytes.Index(bad, []byte("\r\n"))+10] ^= 1 // a data byte
	var se *Error
	if err := put(mk(bad)); !errors.As(err, &se) || se.Code != "SignatureDoesNotMatch" {
		t.Fatalf("a corrupted signed chunk: %v, want SignatureDoesNotMatch", err)
	}
	allocs := testing.AllocsPerRun(200, func() {
		if err := put(mk(enc)); err != nil {
			t.Fatal(err)
		}
	})
	harness := testing.AllocsPerRun(200, func() { _ = mk(enc) })
	per := allocs - harness
	t.Logf("allocations for a signed 4 KiB body: %.0f (request %.0f excluded)", per, harness)
	if per > 24 {
		t.Fatalf("a signed 4 KiB body costs %.0f allocations, want ≤ 24 (none per chunk signature)", per)
	}
}
