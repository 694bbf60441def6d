package s3

import (
	"bytes"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"testing"
)

// chunkedRequest is a PUT whose body is what the AWS SDKs send by default:
// aws-chunked, unsigned, 64 KiB chunks, with an x-amz-checksum-crc32c
// trailer (its value is not checked here: the write path verifies it).
func chunkedRequest(data []byte) (*http.Request, *auth) {
	return chunkedRequestOf(chunkedEncode(data), len(data))
}

func chunkedEncode(data []byte) []byte {
	var body bytes.Buffer
	for off := 0; off < len(data); off += 64 << 10 {
		c := data[off:min(off+64<<10, len(data))]
		fmt.Fprintf(&body, "%x\r\n", len(c))
		body.Write(c)
		body.WriteString("\r\n")
	}
	body.WriteString("0\r\nx-amz-checksum-crc32c:AAAAAA==\r\n\r\n")
	return body.Bytes()
}

func chunkedRequestOf(enc []byte, n int) (*http.Request, *auth) {
	r, _ := http.NewRequest("PUT", "http://s3.test/b/k", bytes.NewReader(enc))
	r.Header.Set("X-Amz-Decoded-Content-Length", fmt.Sprint(n))
	r.Header.Set("X-Amz-Trailer", "x-amz-checksum-crc32c")
	return r, &auth{payload: streamingUnsignedTrailr}
}

func plainRequest(data []byte) (*http.Request, *auth) {
	r, _ := http.NewRequest("PUT", "http://s3.test/b/k", bytes.NewReader(data))
	return r, &auth{payload: unsignedPayload}
}

// readBody reads a request body the way the client's V2 writer does: into
// 4 MiB buffers, to EOF.
func readBody(t testing.TB, r *http.Request, a *auth, buf []byte) *body {
	b, e := newBody(r, a, MaxObjectSize, true)
	if e != nil {
		t.Fatal(e)
	}
	defer b.close()
	b.deepen() // as putData's bodies
	for {
		_, err := io.ReadFull(b, buf)
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return b
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// BenchmarkBodyRead: the gateway's own work per MiB of a large PUT body
// (aws-chunked decoding, the MD5 for the ETag on its goroutine, length
// checks), without the network and the write path.
//
//	go test -run '^$' -bench BodyRead ./internal/s3/
func BenchmarkBodyRead(b *testing.B) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 16<<20/16)
	buf := make([]byte, 4<<20)
	enc := chunkedEncode(data)
	for name, mk := range map[string]func() (*http.Request, *auth){
		"plain":          func() (*http.Request, *auth) { return plainRequest(data) },
		"chunked-crc32c": func() (*http.Request, *auth) { return chunkedRequestOf(enc, len(data)) },
	} {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for range b.N {
				r, a := mk()
				readBody(b, r, a, buf)
			}
		})
	}
}

// TestBodyReadBounded (issue 15): reading a large aws-chunked body costs a
// bounded number of allocations per MiB (none per chunk or per read: the
// digest buffers are pooled), hashes it with MD5 exactly, and leaves the
// CRC32C to the write path.
func TestBodyReadBounded(t *testing.T) {
	const mib = 16
	data := bytes.Repeat([]byte("basalt s3 body. "), mib<<20/16)
	buf := make([]byte, 4<<20)
	enc := chunkedEncode(data)
	r, a := chunkedRequestOf(enc, len(data))
	b := readBody(t, r, a, buf)
	sum := md5.Sum(data)
	if b.n != int64(len(data)) || b.etag() != hex.EncodeToString(sum[:]) || !b.crcFromWrite || b.ck != nil || b.ckWant != "AAAAAA==" {
		t.Fatalf("read %d of %d bytes, ETag %s (want %x), CRC32C from the write path %v", b.n, len(data), b.etag(), sum, b.crcFromWrite)
	}
	allocs := testing.AllocsPerRun(3, func() {
		r, a := chunkedRequestOf(enc, len(data))
		readBody(t, r, a, buf)
	})
	// The request, the body and its digests cost a few dozen; nothing may
	// scale with the 256 chunks or the bytes.
	if per := allocs / mib; per > 8 {
		t.Fatalf("%.0f allocations for a %d MiB body: %.1f per MiB, want ≤ 8", allocs, mib, per)
	}
	t.Logf("%.0f allocations for %d MiB", allocs, mib)
}
