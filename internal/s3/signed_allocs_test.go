package s3

import (
	"bytes"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"testing"
)

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
