package s3

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/textproto"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The gateway's own per-request work on the HEAD path, without a cluster
// (issue 15: server CPU per S3 HEAD): SigV4 verification of a signed
// HEAD, the routing checks, the requester's metadata context and the
// response headers.

// signedHead is a HEAD signed with the AWS SDK's signer, as warp and the
// SDKs send it (host, x-amz-content-sha256 and x-amz-date signed; the
// payload hash of the empty body).
func signedHead(tb testing.TB) *http.Request {
	authz, amzDate, payload, _ := signedSeedMethod(tb, http.MethodHead, false, "")
	r := httptest.NewRequest(http.MethodHead, "http://gw.test/bkt/key", nil)
	r.RemoteAddr = "127.0.0.1:40000"
	r.Header.Set("User-Agent", "MinIO (linux; amd64) minio-go/v7.0.95 warp/1.4.0")
	r.Header.Set("Authorization", authz)
	r.Header.Set("X-Amz-Date", amzDate)
	r.Header.Set("X-Amz-Content-Sha256", payload)
	return r
}

// headWork is what serve does for a HEAD besides the metadata call and
// net/http's own work: the request ID and common headers, the address,
// SigV4, the requester context, the routing checks, the object's
// headers and the metrics.
func headWork(tb testing.TB, g *Gateway, r *http.Request, w http.ResponseWriter, ki *testKeyInfo) {
	req := &request{w: w, r: r, id: requestID()}
	hv := &[2]string{"Basalt", req.id}
	h := w.Header()
	h["Server"] = hv[0:1:1]
	h["X-Amz-Request-Id"] = hv[1:2:2]
	var e *Error
	req.bucket, req.key, e = g.address(r)
	if e == nil {
		req.auth, e = g.authenticate(r)
	}
	if e != nil {
		tb.Fatalf("HEAD refused: %v", e)
	}
	ctx := g.requesterContext(r.Context(), r, req.auth)
	if ctx == nil || g.route(req) == nil || req.op != "HeadObject" {
		tb.Fatalf("HEAD routed as %q", req.op)
	}
	setObjectHeaders(h, &ki.KeyInfo)
	h.Set("Content-Length", "4096")
	g.metrics.observe(req.op, "OK", &req.stages)
}

// BenchmarkHeadGatewayWork times headWork (no cluster, no sockets):
//
//	go test -run '^$' -bench HeadGatewayWork ./internal/s3/
func BenchmarkHeadGatewayWork(b *testing.B) {
	g := authGateway()
	g.metrics = newMetrics(nil)
	r := signedHead(b)
	ki := newTestKeyInfo()
	w := httptest.NewRecorder()
	headWork(b, g, r, w, ki) // the secret and the signing key cached
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		clear(w.HeaderMap)
		headWork(b, g, r, w, ki)
	}
}

// headWorkAllocsBound bounds headWork's allocations: 31 at the start of
// session 14, 11 after (the request ID, the headers' values, the auth,
// the signed headers, the requester's context; see docs/BENCHMARKS.md "S3 HEAD: the
// gateway's own work per request (session 14)").
const headWorkAllocsBound = 13

// TestHeadGatewayWorkAllocs keeps the gateway's own allocations per HEAD
// (headWork) below headWorkAllocsBound.
func TestHeadGatewayWorkAllocs(t *testing.T) {
	g := authGateway()
	g.metrics = newMetrics(nil)
	r := signedHead(t)
	ki := newTestKeyInfo()
	w := httptest.NewRecorder()
	headWork(t, g, r, w, ki)
	n := testing.AllocsPerRun(200, func() {
		clear(w.HeaderMap)
		headWork(t, g, r, w, ki)
	})
	t.Logf("allocations of the gateway's own work per HEAD: %.0f", n)
	if n > headWorkAllocsBound {
		t.Fatalf("the gateway's own work per HEAD allocates %.0f times, more than %d (issue 15; docs/BENCHMARKS.md)", n, headWorkAllocsBound)
	}
}

// The allocation-free helpers against the definitions they replace.

func TestHeaderValuesMatchesCanonical(t *testing.T) {
	alphabet := []string{"a", "B", "-", "x-amz-", "_", "0", " ", "é", ":", "Content", "date"}
	rng := rand.New(rand.NewPCG(3, 4))
	h := http.Header{}
	names := make([]string, 5000)
	for i := range names {
		var b strings.Builder
		for range 1 + rng.IntN(6) {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		names[i] = b.String()
		h[textproto.CanonicalMIMEHeaderKey(names[i])] = []string{names[i]}
		if i%3 == 0 {
			h[names[i]] = []string{"as sent"} // a key net/http would not canonicalise
		}
	}
	names = append(names, strings.Repeat("x-long", 20))
	for _, name := range names {
		want := h[textproto.CanonicalMIMEHeaderKey(name)]
		if got := headerValues(h, name); strings.Join(got, "\x00") != strings.Join(want, "\x00") {
			t.Fatalf("headerValues(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestParseCredentialMatchesSplit(t *testing.T) {
	split := func(cred string) (sigParams, bool) { // the definition before session 14
		parts := strings.Split(cred, "/")
		if len(parts) != 5 || parts[4] != "aws4_request" || parts[0] == "" {
			return sigParams{}, false
		}
		return sigParams{accessKey: parts[0], date: parts[1], region: parts[2], service: parts[3],
			scope: parts[1] + "/" + parts[2] + "/" + parts[3] + "/aws4_request"}, true
	}
	alphabet := []string{"/", "AK", "20261127", "us-east-1", "s3", "aws4_request", "", "x"}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 20000 {
		var b strings.Builder
		for range rng.IntN(11) {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		cred := b.String()
		got, ok := parseCredential(cred)
		want, wok := split(cred)
		if ok != wok || got.accessKey != want.accessKey || got.date != want.date || got.region != want.region ||
			got.service != want.service || got.scope != want.scope {
			t.Fatalf("parseCredential(%q) = %+v %v, want %+v %v", cred, got, ok, want, wok)
		}
	}
}

func TestValidPayloadModeMatchesHex(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	const chars = "0123456789abcdefABCDEFgxG-"
	for range 20000 {
		b := make([]byte, 64)
		for i := range b {
			b[i] = "0123456789abcdefABCDEF"[rng.IntN(22)]
		}
		if rng.IntN(2) == 0 {
			b[rng.IntN(64)] = chars[rng.IntN(len(chars))]
		}
		p := string(b)
		_, err := hex.DecodeString(p)
		if validPayloadMode(p) != (err == nil) {
			t.Fatalf("validPayloadMode(%q) = %v, hex: %v", p, validPayloadMode(p), err)
		}
	}
}

type testKeyInfo struct{ client.KeyInfo }

func newTestKeyInfo() *testKeyInfo {
	return &testKeyInfo{client.KeyInfo{Size: 4096, Modified: time.Date(2026, 11, 27, 22, 0, 0, 0, time.UTC),
		Meta: &metapb.ObjectMeta{Etag: "0f343b0931126a20f133d67c2b018a3b"}}}
}

// TestRequesterContextCached: the cached metadata of a requester is what
// metaclient.WithRequester makes for it, requesters differing in any
// part get their own, and a caller's own outgoing metadata is merged.
func TestRequesterContextCached(t *testing.T) {
	g := &Gateway{}
	mk := func(addr, ua string) *http.Request {
		r := httptest.NewRequest(http.MethodGet, "http://gw.test/bkt/key", nil)
		r.RemoteAddr = addr
		r.Header.Set("User-Agent", ua)
		return r
	}
	withReferer := mk("10.1.2.3:5555", "ua-1")
	withReferer.Header.Set("Referer", "https://example.test/page")
	overTLS := mk("10.1.2.3:5555", "ua-1")
	overTLS.TLS = &tls.ConnectionState{}
	cases := []struct {
		r *http.Request
		a *auth
	}{
		{mk("10.1.2.3:5555", "ua-1"), &auth{owner: "alice"}},
		{mk("10.1.2.3:5556", "ua-1"), &auth{owner: "alice"}}, // the same requester
		{mk("10.1.2.4:5555", "ua-1"), &auth{owner: "alice"}},
		{mk("10.1.2.3:5555", "ua-2"), &auth{owner: "alice"}},
		{mk("10.1.2.3:5555", "ua-1"), &auth{owner: "alice", admin: true}},
		{mk("10.1.2.3:5555", "ua-1"), &auth{owner: "bob"}},
		{mk("[::1]:5555", "ua-1"), &auth{anonymous: true}},
		{withReferer, &auth{owner: "alice"}}, // differs only in its Referer
		{overTLS, &auth{owner: "alice"}},     // only in its transport
	}
	for round := range 2 { // the second round from the cache
		for i, c := range cases {
			got, _ := metadata.FromOutgoingContext(g.requesterContext(context.Background(), c.r, c.a))
			want, _ := metadata.FromOutgoingContext(metaclient.WithRequester(context.Background(), c.a.anonymous, c.a.owner, c.a.admin, metaclient.RequestInfo{
				SourceIP: g.clientIP(c.r), UserAgent: c.r.Header.Get("User-Agent"), Referer: c.r.Header.Get("Referer"), SecureTransport: c.r.TLS != nil}))
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("round %d case %d: metadata %v, want %v", round, i, got, want)
			}
		}
	}
	if n := len(g.requesters.m); n != len(cases)-1 {
		t.Fatalf("%d requesters cached, want %d", n, len(cases)-1)
	}
	// Metadata of the caller's own is kept, as WithRequester keeps it.
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-caller", "1")
	got, _ := metadata.FromOutgoingContext(g.requesterContext(ctx, cases[0].r, cases[0].a))
	if got.Get("x-caller") == nil || got.Get(metaclient.OnBehalfOfHeader)[0] != "alice" {
		t.Fatalf("caller's metadata lost: %v", got)
	}
}

// TestRefusedHeaderNonASCII: a header name strings.ToLower folds to a
// refused x-amz-* name (the Kelvin sign for k, from a presigned query
// parameter) is still refused, as before the ASCII-only pre-check
// (review of session 14).
func TestRefusedHeaderNonASCII(t *testing.T) {
	h := http.Header{}
	h["X-Amz-Object-Loc\u212a-Mode"] = []string{"GOVERNANCE"}
	if err := unsupportedHeaders("PutObject", h); err == nil {
		t.Fatal("x-amz-object-loc\u212a-mode accepted")
	}
}
