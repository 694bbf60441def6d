package s3

import (
	"crypto/md5"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"testing"
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
