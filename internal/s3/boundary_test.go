package s3

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestFuzzSeedsReachSuccess: the fuzz targets' valid seeds pass, so the
// fuzzer starts from inputs that get past every check.
func TestFuzzSeedsReachSuccess(t *testing.T) {
	g := authGateway()
	for _, presign := range []bool{false, true} {
		q := ""
		if presign {
			q = "X-Amz-Expires=300"
		}
		if _, e := g.authenticate(sigRequest(signedSeed(t, presign, q))); e != nil {
			t.Fatalf("SDK-signed request (presigned %v) refused: %v", presign, e)
		}
	}
	data := []byte("The quick brown fox jumps over the lazy dog")
	for i, m := range chunkModes {
		var trailers []string
		if m.trailer {
			trailers = []string{"x-amz-checksum-crc32:AAAAAA=="}
		}
		out, err := io.ReadAll(newChunkedReader(bytes.NewReader(encodeChunked(data, 7, m.signed, trailers)), fuzzAuth, m.signed, m.trailer))
		if err != nil || !bytes.Equal(out, data) {
			t.Fatalf("mode %d: %q, %v", i, out, err)
		}
		if !m.signed {
			continue
		}
		// FuzzChunkedBody's re-signing makes a damaged signed body
		// verify again (here: changed data, a trailer that is not in
		// canonical form).
		if m.trailer {
			trailers = append(trailers, "X-Other : v ")
		}
		b := encodeChunked(data, 7, true, trailers)
		b[bytes.Index(b, []byte("\r\n"))+2] = 't' // "The" → "the"
		if _, err := io.ReadAll(newChunkedReader(bytes.NewReader(b), fuzzAuth, true, m.trailer)); err == nil {
			t.Fatalf("mode %d: damaged body verified", i)
		}
		out, err = io.ReadAll(newChunkedReader(bytes.NewReader(resignChunked(b, m.trailer)), fuzzAuth, true, m.trailer))
		if err != nil || !bytes.Equal(out, bytes.Replace(data, []byte("The"), []byte("the"), 1)) {
			t.Fatalf("mode %d: re-signed body: %q, %v", i, out, err)
		}
	}
}

// TestPresignExpiresOverflow: X-Amz-Expires is bounded in seconds. It was
// multiplied into a Duration first, which wraps for large values: 2^64/1e9
// rounded up became 0.29 s and passed the 7-day check.
func TestPresignExpiresOverflow(t *testing.T) {
	g := authGateway()
	for _, exp := range []string{"18446744074", "9223372037", "604801", "0", "-5", "x"} {
		_, e := g.authenticate(sigRequest(signedSeed(t, true, "X-Amz-Expires="+exp)))
		if e == nil || e.Code != "AuthorizationQueryParametersError" {
			t.Fatalf("X-Amz-Expires=%s: got %v, want AuthorizationQueryParametersError", exp, e)
		}
	}
	if _, e := g.authenticate(sigRequest(signedSeed(t, true, "X-Amz-Expires=604800"))); e != nil {
		t.Fatalf("X-Amz-Expires=604800 (7 days): %v", e)
	}
}

// TestChunkedTrailerLimit: at most maxTrailers trailer lines (one more
// got through before).
func TestChunkedTrailerLimit(t *testing.T) {
	for _, n := range []int{maxTrailers, maxTrailers + 1} {
		var trailers []string
		for i := range n {
			trailers = append(trailers, fmt.Sprintf("x-t%d:v", i))
		}
		_, err := io.ReadAll(newChunkedReader(bytes.NewReader(encodeChunked([]byte("abc"), 2, false, trailers)), fuzzAuth, false, true))
		if (err == nil) != (n <= maxTrailers) {
			t.Fatalf("%d trailers: %v", n, err)
		}
	}
}

// endless is a body that never ends; it counts what was read from it.
type endless struct{ n int64 }

func (e *endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = ' '
	}
	e.n += int64(len(p))
	return len(p), nil
}

// TestXMLBodies: each request document is parsed strictly (one root of
// the right name, nothing after it, values in range) and read only up to
// its bound; bad ones get the S3 client error that names the problem.
func TestXMLBodies(t *testing.T) {
	cmu := func(req *request) *Error { _, e := parseCompleteMultipartUpload(req); return e }
	del := func(req *request) *Error { _, e := parseDeleteObjects(req); return e }
	cbc := func(req *request) *Error { _, e := parseCreateBucketConfiguration(req); return e }
	tag := func(req *request) *Error { _, e := parseTagging(req); return e }
	part := func(n int) string { return fmt.Sprintf("<Part><PartNumber>%d</PartNumber><ETag>e</ETag></Part>", n) }
	for _, c := range []struct {
		name  string
		parse func(*request) *Error
		body  string
		code  string // "" for success
	}{
		{"complete", cmu, "<CompleteMultipartUpload>" + part(1) + part(3) + "</CompleteMultipartUpload>", ""},
		{"complete wrong root", cmu, "<Delete>" + part(1) + "</Delete>", "MalformedXML"},
		{"complete second root", cmu, "<CompleteMultipartUpload>" + part(1) + "</CompleteMultipartUpload><CompleteMultipartUpload>" + part(2) + "</CompleteMultipartUpload>", "MalformedXML"},
		{"complete trailing text", cmu, "<CompleteMultipartUpload>" + part(1) + "</CompleteMultipartUpload>junk", "MalformedXML"},
		{"complete trailing comment", cmu, "<CompleteMultipartUpload>" + part(1) + "</CompleteMultipartUpload>\n<!-- c -->\n", ""},
		{"complete no parts", cmu, "<CompleteMultipartUpload></CompleteMultipartUpload>", "MalformedXML"},
		{"complete part 0", cmu, "<CompleteMultipartUpload>" + part(0) + "</CompleteMultipartUpload>", "InvalidArgument"},
		{"complete part 10001", cmu, "<CompleteMultipartUpload>" + part(10001) + "</CompleteMultipartUpload>", "InvalidArgument"},
		{"complete descending", cmu, "<CompleteMultipartUpload>" + part(2) + part(1) + "</CompleteMultipartUpload>", "InvalidPartOrder"},
		{"complete duplicate", cmu, "<CompleteMultipartUpload>" + part(2) + part(2) + "</CompleteMultipartUpload>", "InvalidPartOrder"},
		{"complete negative", cmu, "<CompleteMultipartUpload><Part><PartNumber>-1</PartNumber></Part></CompleteMultipartUpload>", "MalformedXML"},
		{"complete empty", cmu, "", "MalformedXML"},
		{"complete truncated", cmu, "<CompleteMultipartUpload>" + part(1), "MalformedXML"},
		{"delete", del, "<Delete><Object><Key>a</Key></Object></Delete>", ""},
		{"delete wrong root", del, "<Tagging><Object><Key>a</Key></Object></Tagging>", "MalformedXML"},
		{"delete quiet not a bool", del, "<Delete><Quiet>maybe</Quiet><Object><Key>a</Key></Object></Delete>", "MalformedXML"},
		{"delete too many", del, "<Delete>" + strings.Repeat("<Object><Key>a</Key></Object>", maxDeleteObjects+1) + "</Delete>", "MalformedXML"},
		{"location", cbc, "<CreateBucketConfiguration><LocationConstraint>eu-west-1</LocationConstraint></CreateBucketConfiguration>", ""},
		{"location wrong root", cbc, "<LocationConstraint>eu-west-1</LocationConstraint>", "MalformedXML"},
		{"tagging", tag, "<Tagging><TagSet><Tag><Key>k</Key><Value>v</Value></Tag></TagSet></Tagging>", ""},
		{"tagging duplicate", tag, "<Tagging><TagSet><Tag><Key>k</Key></Tag><Tag><Key>k</Key></Tag></TagSet></Tagging>", "InvalidTag"},
		{"tagging empty key", tag, "<Tagging><TagSet><Tag><Key></Key></Tag></TagSet></Tagging>", "InvalidTag"},
		{"tagging too many", tag, "<Tagging><TagSet>" + func() string {
			var b strings.Builder
			for i := range maxTags + 1 {
				fmt.Fprintf(&b, "<Tag><Key>k%d</Key></Tag>", i)
			}
			return b.String()
		}() + "</TagSet></Tagging>", "BadRequest"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := c.parse(xmlRequest([]byte(c.body)))
			switch {
			case c.code == "" && e != nil:
				t.Fatalf("refused: %v", e)
			case c.code != "" && (e == nil || e.Code != c.code):
				t.Fatalf("got %v, want %s", e, c.code)
			}
		})
	}

	// A body that never ends is read only up to the document bound.
	var body endless
	req := xmlRequest(nil)
	req.r.Body = io.NopCloser(io.MultiReader(strings.NewReader("<Delete>"), &body))
	req.r.ContentLength = -1
	if _, e := parseDeleteObjects(req); e == nil || e.Code != "EntityTooLarge" {
		t.Fatalf("endless body: %v", e)
	}
	if body.n > maxXMLBody+64<<10 {
		t.Fatalf("read %d bytes of an endless body, bound %d", body.n, maxXMLBody)
	}
	// A declared length over the bound is refused before reading.
	req = xmlRequest(nil)
	body.n = 0
	req.r.Body = io.NopCloser(&body)
	req.r.ContentLength = maxXMLBody + 1
	if _, e := parseDeleteObjects(req); e == nil || e.Code != "EntityTooLarge" || body.n != 0 {
		t.Fatalf("declared oversize body: %v after reading %d bytes", e, body.n)
	}
}

// TestHandlerPanicIsInternalError: a bug that panics in one request's
// handler gives that request a 500 InternalError in S3's XML, frees its
// upload slot, is counted, and the gateway serves the next request.
// Before the guard, net/http recovered it by dropping the connection (no
// answer, no log line with the stack, no metric).
func TestHandlerPanicIsInternalError(t *testing.T) {
	reg := prometheus.NewRegistry()
	g, err := New(Config{MetaAddrs: []string{"127.0.0.1:1"}, Registerer: reg, Now: func() time.Time { return fuzzNow },
		MaxUploads: 1, UploadWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cl := g.cl
	defer func() { g.cl = cl; g.Close() }()
	g.secrets.ns = fakeNamespace{}
	g.owners.ns = fakeNamespace{}
	g.cl = nil // every handler that uses the client now panics: our stand-in bug
	srv := httptest.NewServer(g)
	defer srv.Close()

	do := func(method string) (int, string) {
		authz, amzDate, payload, _ := signedSeedMethod(t, method, false, "")
		r := sigRequest(authz, amzDate, payload, "")
		r.Method = method
		r.RequestURI = ""
		u := *r.URL
		u.Scheme, u.Host = "http", strings.TrimPrefix(srv.URL, "http://")
		r.URL = &u
		r.Host = "gw.test"
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// GET /bkt/key is GetObject; PUT /bkt/key is PutObject, which takes
	// the only upload slot: a slot leaked by the panic would turn the
	// second PUT into SlowDown.
	for i, m := range []string{http.MethodGet, http.MethodPut, http.MethodPut} {
		code, body := do(m)
		if code != 500 || !strings.Contains(body, "<Code>InternalError</Code>") || strings.Contains(body, "goroutine") {
			t.Fatalf("request %d (%s): %d %s", i, m, code, body)
		}
	}
	if n := g.guard.Recovered("s3"); n != 3 {
		t.Fatalf("recovered %d panics, want 3", n)
	}
	if n, err := testutil.GatherAndCount(reg, "basalt_panics_recovered_total"); err != nil || n != 1 {
		t.Fatalf("exported %d series (%v)", n, err)
	}
	// Requests that do not reach the bug are served as before (an
	// anonymous ListBuckets is refused before any handler).
	resp, err := http.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !strings.Contains(string(b), "AccessDenied") {
		t.Fatalf("unsigned request after the panics: %d %s", resp.StatusCode, b)
	}
}
