package s3

import (
	"bytes"
	"crypto/md5"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"testing"
	"time"
)

// TestLateDigests: a large body written through putData (late) ends at
// its EOF without waiting for its digests; settle, called before the
// commit, checks them: a wrong Content-MD5 or payload SHA-256 fails the
// body (bodyOr reports it) and the commit, a right one gives the ETag.
// A short body still fails at EOF.
func TestLateDigests(t *testing.T) {
	data := make([]byte, 3<<20+17)
	for i := range data {
		data[i] = byte(i * 7)
	}
	good := md5.Sum(data)
	cases := []struct {
		name string
		set  func(r *requestT)
		code string
	}{
		{"good", func(r *requestT) { r.md5(good[:]) }, ""},
		{"bad-md5", func(r *requestT) { r.md5(make([]byte, 16)) }, "BadDigest"},
		{"bad-sha256", func(r *requestT) { r.a.payload = fmt.Sprintf("%x", sha256.Sum256(data[1:])) }, "XAmzContentSHA256Mismatch"},
		{"good-sha256", func(r *requestT) { r.a.payload = fmt.Sprintf("%x", sha256.Sum256(data)) }, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, a := plainRequest(data)
			rq := &requestT{r: r.Header, a: a}
			c.set(rq)
			b, e := newBody(r, a, MaxObjectSize, true)
			if e != nil {
				t.Fatal(e)
			}
			defer b.close()
			b.late = true
			if b.async == nil {
				t.Fatal("a 3 MiB body is not hashed on its own goroutines")
			}
			if _, err := io.Copy(io.Discard, b); err != nil {
				t.Fatalf("a late body failed at EOF: %v (its digests are settled before the commit)", err)
			}
			err := b.settle()
			if c.code == "" {
				if err != nil {
					t.Fatal(err)
				}
				if b.etag() != hex.EncodeToString(good[:]) {
					t.Fatalf("ETag %s, want %x", b.etag(), good)
				}
				return
			}
			var se *Error
			if !errors.As(err, &se) || se.Code != c.code {
				t.Fatalf("settle: %v, want %s", err, c.code)
			}
			if e := bodyOr(b, errors.New("commit refused"), &request{}); e.Code != c.code {
				t.Fatalf("bodyOr: %s, want %s", e.Code, c.code)
			}
			if err := b.settle(); err == nil {
				t.Fatal("a failed body settles the second time")
			}
		})
	}
	// Shorter than its Content-Length: refused at EOF, late or not.
	r, a := plainRequest(data[:len(data)-1])
	r.ContentLength = int64(len(data))
	b, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	defer b.close()
	b.late = true
	_, err := io.Copy(io.Discard, b)
	var se *Error
	if !errors.As(err, &se) || se.Code != "IncompleteBody" {
		t.Fatalf("a short late body: %v, want IncompleteBody at EOF", err)
	}
	// A late body that did not reach its EOF is not committed.
	r, a = plainRequest(data)
	b2, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	defer b2.close()
	b2.late = true
	if _, err := io.ReadFull(b2, make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	if err := b2.settle(); err == nil {
		t.Fatal("a body settled before its end")
	}
}

type requestT struct {
	r interface{ Set(k, v string) }
	a *auth
}

func (r *requestT) md5(d []byte) { r.r.Set("Content-Md5", base64.StdEncoding.EncodeToString(d)) }

// gatedHash is a digest whose Write waits until gate is closed.
type gatedHash struct {
	hash.Hash
	gate chan struct{}
}

func (g gatedHash) Write(p []byte) (int, error) { <-g.gate; return g.Hash.Write(p) }

// TestHasherSlack: a large body's reading runs up to 4 MiB (16 buffers)
// ahead of a digest that does not keep up before it waits (with 4 buffers,
// warp's parts spent a third of their time waiting for MD5; BENCHMARKS.md,
// session 13), and then waits rather than holding more memory.
func TestHasherSlack(t *testing.T) {
	g := gatedHash{Hash: md5.New(), gate: make(chan struct{})}
	h := newHasher([]hash.Hash{g}, hashBufs)
	p := make([]byte, hashBufSize)
	wrote := make(chan int, 64)
	go func() {
		for i := range 17 {
			h.write(p)
			wrote <- i + 1
		}
		// The 17th buffer's bytes are in hand (h.cur): sent at wait.
	}()
	// 16 full buffers are handed over without waiting for the digest
	// (the 16th is sent when full; the 17th write needs a 17th buffer).
	deadline := time.After(10 * time.Second)
	for n := 0; n < 16; {
		select {
		case n = <-wrote:
		case <-deadline:
			t.Fatalf("the reading waited for the digest after %d of 16 buffers", n)
		}
	}
	// The 17th write waits for a free buffer (counted in full, before it
	// blocks): polled with a deadline, not assumed after a fixed sleep.
	for end := time.Now().Add(10 * time.Second); h.full.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the 17th write did not wait for a free buffer")
		}
	}
	select {
	case n := <-wrote:
		t.Fatalf("%d buffers written with the digest stalled: more than hashBufs in memory", n)
	default:
	}
	if h.full.Load() != 1 {
		t.Fatalf("waits counted: %d, want 1", h.full.Load())
	}
	close(g.gate)
	select {
	case <-wrote:
	case <-time.After(10 * time.Second):
		t.Fatal("the reading did not resume once the digest caught up")
	}
	h.wait()
	want := md5.New()
	for range 17 {
		want.Write(p)
	}
	if !bytes.Equal(g.Sum(nil), want.Sum(nil)) {
		t.Fatal("digest differs")
	}
}

// stallReader returns its data, then blocks until stop is closed.
type stallReader struct {
	data []byte
	stop chan struct{}
}

func (s *stallReader) Read(p []byte) (int, error) {
	if len(s.data) == 0 {
		<-s.stop
		return 0, io.ErrUnexpectedEOF
	}
	n := copy(p, s.data)
	s.data = s.data[n:]
	return n, nil
}

// TestStalledXMLBodiesBounded (review of session 13): bodies not written
// through putData (XML documents: no upload slot bounds them) take no hash
// buffer before their bytes arrive, and at most shallowHashBufs as they
// do; with the 16 taken at newBody, 64 stalled 2 MiB documents held
// 256 MiB. A body written through putData (deepened) may lag by hashBufs.
func TestStalledXMLBodiesBounded(t *testing.T) {
	const n = 64
	held0 := hashBufsHeld.Load()
	stop := make(chan struct{}) // never closed: the bodies stay stalled
	var bodies []*body
	defer func() {
		for _, b := range bodies {
			b.close()
		}
	}()
	newXML := func(sent int) *body {
		r, a := plainRequest(nil)
		r.ContentLength = maxXMLBody - 1
		r.Body = io.NopCloser(&stallReader{data: make([]byte, sent), stop: stop})
		b, e := newBody(r, a, maxXMLBody, false)
		if e != nil {
			t.Fatal(e)
		}
		if b.async == nil {
			t.Fatal("a 2 MiB body is not hashed on its own goroutines")
		}
		bodies = append(bodies, b)
		return b
	}
	for range n {
		newXML(0)
	}
	if held := hashBufsHeld.Load() - held0; held != 0 {
		t.Fatalf("%d stalled XML bodies (no byte read) hold %d hash buffers (%d MiB), want 0", n, held, held*hashBufSize>>20)
	}
	// Each sends 1.5 MiB (6 buffers) and stalls: at most shallowHashBufs each.
	for range n {
		b := newXML(3 * hashBufs * hashBufSize / 32)
		if _, err := io.ReadFull(b, make([]byte, 3*hashBufs*hashBufSize/32)); err != nil {
			t.Fatal(err)
		}
	}
	if held := hashBufsHeld.Load() - held0; held > n*shallowHashBufs {
		t.Fatalf("%d XML bodies that sent 1.5 MiB hold %d hash buffers, want ≤ %d", n, held, n*shallowHashBufs)
	}
	for _, b := range bodies {
		b.close()
	}
	bodies = nil
	if held := hashBufsHeld.Load() - held0; held != 0 {
		t.Fatalf("closed bodies hold %d hash buffers", held)
	}
}
