package s3

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The gateway's trust boundary: request bodies (XML documents,
// aws-chunked encoding) and signatures (the Authorization header,
// presigned query parameters) come from anyone who can reach the port.
// The fuzz targets below feed each decoder arbitrary input; bad input must
// give an S3 client error (4xx), never a panic, a 5xx or a success it
// should not. Their seed corpora (testdata/fuzz/<Target>) run as
// regression cases in every plain `go test`:
//
//	go test -run '^$' -fuzz '^FuzzCompleteMultipartUpload$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzDeleteObjects$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzCreateBucketConfiguration$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzTagging$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzChunkedBody$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzSigV4$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzRange$' -fuzztime 75s ./internal/s3
//	go test -run '^$' -fuzz '^FuzzRoute$' -fuzztime 75s ./internal/s3

const (
	fuzzAccessKey = "AKIDFUZZ"
	fuzzSecret    = "fuzz/secret/key"
	fuzzRegion    = "us-east-1"
)

// fuzzNow is the gateway's clock in these tests.
var fuzzNow = time.Date(2026, 11, 24, 5, 0, 0, 0, time.UTC)

// xmlRequest is a request carrying body as an unsigned payload (the
// signature itself is not what these targets test).
func xmlRequest(body []byte) *request {
	r := httptest.NewRequest(http.MethodPost, "http://gw.test/bkt/key", bytes.NewReader(body))
	return &request{w: httptest.NewRecorder(), r: r, auth: &auth{payload: unsignedPayload}}
}

// checkClientError fails unless e is nil or an S3 client error.
func checkClientError(t *testing.T, e *Error) {
	t.Helper()
	if e != nil && (e.Status < 400 || e.Status > 499 || e.Code == "" || e.Code == "InternalError") {
		t.Fatalf("bad input answered %d %s: %s", e.Status, e.Code, e.Message)
	}
}

func FuzzCompleteMultipartUpload(f *testing.F) {
	for _, s := range []string{
		`<CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Part><PartNumber>1</PartNumber><ETag>"a"</ETag></Part><Part><PartNumber>2</PartNumber><ETag>"b"</ETag></Part></CompleteMultipartUpload>`,
		`<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUpload><Part><PartNumber>10000</PartNumber><ETag>x</ETag></Part></CompleteMultipartUpload>`,
		`<CompleteMultipartUpload><Part><PartNumber>2</PartNumber></Part><Part><PartNumber>1</PartNumber></Part></CompleteMultipartUpload>`,
		`<CompleteMultipartUpload><Part><PartNumber>-1</PartNumber></Part></CompleteMultipartUpload>`,
		`<CompleteMultipartUpload></CompleteMultipartUpload>`,
		`<Other><Part><PartNumber>1</PartNumber></Part></Other>`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		parts, e := parseCompleteMultipartUpload(xmlRequest(body))
		checkClientError(t, e)
		if e != nil {
			return
		}
		if len(parts) == 0 || len(parts) > 10000 {
			t.Fatalf("accepted %d parts", len(parts))
		}
		for i, p := range parts {
			if p.PartNumber < 1 || p.PartNumber > 10000 || i > 0 && p.PartNumber <= parts[i-1].PartNumber {
				t.Fatalf("accepted part %d (number %d) after %v", i, p.PartNumber, parts[:i])
			}
		}
	})
}

func FuzzDeleteObjects(f *testing.F) {
	for _, s := range []string{
		`<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Quiet>true</Quiet><Object><Key>a</Key></Object><Object><Key>b/c</Key></Object></Delete>`,
		`<Delete><Object><Key>k</Key><VersionId>null</VersionId></Object></Delete>`,
		`<Delete><Quiet>maybe</Quiet><Object><Key>k</Key></Object></Delete>`,
		`<Delete></Delete>`,
		`<Delete><Object><Key>a</Key></Object></Delete><Delete><Object><Key>b</Key></Object></Delete>`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		in, e := parseDeleteObjects(xmlRequest(body))
		checkClientError(t, e)
		if e == nil && (len(in.Objects) == 0 || len(in.Objects) > maxDeleteObjects) {
			t.Fatalf("accepted %d objects", len(in.Objects))
		}
	})
}

func FuzzCreateBucketConfiguration(f *testing.F) {
	for _, s := range []string{
		`<CreateBucketConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><LocationConstraint>eu-west-1</LocationConstraint></CreateBucketConfiguration>`,
		`<CreateBucketConfiguration/>`,
		`<CreateBucketConfiguration><LocationConstraint>us-east-1</LocationConstraint>`,
		`<LocationConstraint>us-east-1</LocationConstraint>`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		_, e := parseCreateBucketConfiguration(xmlRequest(body))
		checkClientError(t, e)
	})
}

func FuzzTagging(f *testing.F) {
	for _, s := range []string{
		`<Tagging xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><TagSet><Tag><Key>k</Key><Value>v</Value></Tag><Tag><Key>k2</Key><Value></Value></Tag></TagSet></Tagging>`,
		`<Tagging><TagSet><Tag><Key>k</Key><Value>1</Value></Tag><Tag><Key>k</Key><Value>2</Value></Tag></TagSet></Tagging>`,
		`<Tagging><TagSet><Tag><Key></Key><Value>v</Value></Tag></TagSet></Tagging>`,
		`<Tagging><TagSet></TagSet></Tagging>`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		tags, e := parseTagging(xmlRequest(body))
		checkClientError(t, e)
		if e == nil {
			if err := validTags(tags); err != nil {
				t.Fatalf("accepted invalid tags %v: %v", tags, err)
			}
		}
	})
}

// Chunk signing, written from the spec (independently of the gateway's).
func fuzzSigningKey(date string) []byte {
	m := func(k []byte, s string) []byte { h := hmac.New(sha256.New, k); h.Write([]byte(s)); return h.Sum(nil) }
	return m(m(m(m([]byte("AWS4"+fuzzSecret), date), fuzzRegion), "s3"), "aws4_request")
}

var fuzzAuth = &auth{accessKey: fuzzAccessKey, signingKey: fuzzSigningKey("20261124"), amzDate: "20261124T050000Z",
	scope: "20261124/" + fuzzRegion + "/s3/aws4_request", seedSig: strings.Repeat("ab", 32)}

// encodeChunked builds an aws-chunked body of data in chunks of n bytes;
// signed: with chunk signatures chained from fuzzAuth's seed; trailers:
// "name:value" lines after the last chunk (signed when signed).
func encodeChunked(data []byte, n int, signed bool, trailers []string) []byte {
	a := fuzzAuth
	mac := func(s string) string {
		h := hmac.New(sha256.New, a.signingKey)
		h.Write([]byte(s))
		return hex.EncodeToString(h.Sum(nil))
	}
	hash := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	var out bytes.Buffer
	prev := a.seedSig
	for off := 0; ; {
		c := data[off:min(off+n, len(data))]
		off += len(c)
		if signed {
			sig := mac("AWS4-HMAC-SHA256-PAYLOAD\n" + a.amzDate + "\n" + a.scope + "\n" + prev + "\n" + hash(nil) + "\n" + hash(c))
			fmt.Fprintf(&out, "%x;chunk-signature=%s\r\n", len(c), sig)
			prev = sig
		} else {
			fmt.Fprintf(&out, "%x\r\n", len(c))
		}
		if len(c) == 0 {
			break
		}
		out.Write(c)
		out.WriteString("\r\n")
	}
	if trailers == nil {
		out.WriteString("\r\n")
		return out.Bytes()
	}
	var canon strings.Builder
	for _, t := range trailers {
		out.WriteString(t + "\r\n")
		k, v, _ := strings.Cut(t, ":")
		canon.WriteString(strings.ToLower(k) + ":" + v + "\n")
	}
	if signed {
		sig := mac("AWS4-HMAC-SHA256-TRAILER\n" + a.amzDate + "\n" + a.scope + "\n" + prev + "\n" + hash([]byte(canon.String())))
		out.WriteString("x-amz-trailer-signature:" + sig + "\r\n")
	}
	out.WriteString("\r\n")
	return out.Bytes()
}

// resign is FuzzChunkedBody's mode bit for re-signing the input.
const resign = 0x80

// resignChunked recomputes the chunk signatures (and the trailer
// signature) of an aws-chunked body as the spec defines them, keeping
// everything else as it is; where the body stops parsing, the rest is
// copied unchanged.
func resignChunked(b []byte, trailer bool) []byte {
	a := fuzzAuth
	mac := func(s string) string {
		h := hmac.New(sha256.New, a.signingKey)
		h.Write([]byte(s))
		return hex.EncodeToString(h.Sum(nil))
	}
	hash := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	var out bytes.Buffer
	rest := func() []byte { out.Write(b); return out.Bytes() }
	nextLine := func() (line, text string, ok bool) {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			return "", "", false
		}
		line, b = string(b[:i+1]), b[i+1:]
		return line, strings.TrimRight(line, "\r\n"), true
	}
	prev := a.seedSig
	for {
		line, l, ok := nextLine()
		if !ok {
			return rest()
		}
		sizeStr, ext, _ := strings.Cut(l, ";")
		size, err := strconv.ParseInt(strings.TrimSpace(sizeStr), 16, 64)
		if err != nil || size < 0 || size > int64(len(b)) || !strings.HasPrefix(ext, "chunk-signature=") {
			out.WriteString(line)
			return rest()
		}
		data := b[:size]
		sig := mac("AWS4-HMAC-SHA256-PAYLOAD\n" + a.amzDate + "\n" + a.scope + "\n" + prev + "\n" + emptySHA256 + "\n" + hash(data))
		out.WriteString(sizeStr + ";chunk-signature=" + sig + line[len(l):])
		prev = sig
		if size == 0 {
			break
		}
		out.Write(data)
		b = b[size:]
		line, _, ok = nextLine() // the CRLF after the data
		out.WriteString(line)
		if !ok {
			return rest()
		}
	}
	if !trailer {
		return rest()
	}
	var lines []string
	var canon strings.Builder
	for {
		line, l, ok := nextLine()
		if !ok {
			for _, x := range lines {
				out.WriteString(x)
			}
			return rest()
		}
		lines = append(lines, line)
		if l == "" {
			break
		}
		k, v, _ := strings.Cut(l, ":")
		if k = strings.ToLower(strings.TrimSpace(k)); k != "x-amz-trailer-signature" {
			canon.WriteString(k + ":" + strings.TrimSpace(v) + "\n")
		}
	}
	sig := mac("AWS4-HMAC-SHA256-TRAILER\n" + a.amzDate + "\n" + a.scope + "\n" + prev + "\n" + hash([]byte(canon.String())))
	for _, x := range lines {
		if k, _, ok := strings.Cut(x, ":"); ok && strings.ToLower(strings.TrimSpace(k)) == "x-amz-trailer-signature" {
			x = k + ":" + sig + x[len(strings.TrimRight(x, "\r\n")):]
		}
		out.WriteString(x)
	}
	return rest()
}

// chunkModes are the aws-chunked payload modes: signed, trailer.
var chunkModes = []struct{ signed, trailer bool }{{true, false}, {true, true}, {false, true}}

func FuzzChunkedBody(f *testing.F) {
	data := []byte("The quick brown fox jumps over the lazy dog")
	f.Add(uint8(0), encodeChunked(data, 16, true, nil))
	f.Add(uint8(0), encodeChunked(nil, 16, true, nil))
	f.Add(uint8(1), encodeChunked(data, 7, true, []string{"x-amz-checksum-crc32:AAAAAA=="}))
	f.Add(uint8(2), encodeChunked(data, 40, false, []string{"x-amz-checksum-crc32c:AAAAAA==", "a:b"}))
	f.Add(uint8(2), []byte("ffffffffffffffff\r\nx"))
	f.Add(uint8(2), []byte("-1\r\n\r\n"))
	f.Add(uint8(resign|0), encodeChunked(data, 16, true, nil))
	f.Add(uint8(resign|1), encodeChunked(data, 7, true, []string{"x-amz-checksum-crc32:AAAAAA==", "X-Other : v "}))
	f.Fuzz(func(t *testing.T, mode uint8, body []byte) {
		// mode: the payload mode (low bits), and whether to re-sign the
		// mutated body's chunks and trailers first (high bit), so that
		// the fuzzer also explores signed bodies past their signatures.
		m := chunkModes[int(mode&^resign)%len(chunkModes)]
		if mode&resign != 0 && m.signed {
			body = resignChunked(body, m.trailer)
		}
		c := newChunkedReader(bytes.NewReader(body), fuzzAuth, m.signed, m.trailer)
		out, err := io.ReadAll(c)
		if err != nil {
			var se *Error
			if !errors.As(err, &se) {
				t.Fatalf("decoder error is not an S3 error: %v", err)
			}
			checkClientError(t, se)
			return
		}
		if !c.done || len(out) > len(body) || len(c.trailers) > maxTrailers {
			t.Fatalf("decoded %d bytes from %d (done %v), %d trailers", len(out), len(body), c.done, len(c.trailers))
		}
	})
}

// fakeNamespace answers GetS3Secret for fuzzAccessKey; any other method
// panics (nil embedded interface), which no auth path may reach.
type fakeNamespace struct {
	metapb.NamespaceClient
}

func (fakeNamespace) GetS3Secret(_ context.Context, r *metapb.GetS3SecretRequest, _ ...grpc.CallOption) (*metapb.S3Secret, error) {
	if r.AccessKeyId == fuzzAccessKey {
		return &metapb.S3Secret{AccessKeyId: fuzzAccessKey, SecretAccessKey: fuzzSecret, Owner: "fuzz"}, nil
	}
	return nil, status.Error(codes.NotFound, "no such access key")
}

// GetBucket answers that no bucket exists (the access check passes; the
// operation itself then finds no bucket).
func (fakeNamespace) GetBucket(_ context.Context, r *metapb.GetBucketRequest, _ ...grpc.CallOption) (*metapb.Bucket, error) {
	return nil, status.Error(codes.NotFound, "no such bucket")
}

// authGateway is a gateway with just enough to authenticate requests.
func authGateway() *Gateway {
	now := func() time.Time { return fuzzNow }
	cfg := Config{Region: fuzzRegion, MaxClockSkew: DefaultMaxClockSkew, Now: now}
	return &Gateway{cfg: cfg, secrets: &secrets{ns: fakeNamespace{}, ttl: time.Hour, now: now, m: map[string]secretEntry{}}}
}

// sigRequest rebuilds a request from the fuzzed strings: GET of
// /bkt/key?query with the given Authorization, X-Amz-Date and
// X-Amz-Content-Sha256 (each left out when empty).
func sigRequest(authz, amzDate, payload, query string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "http://gw.test/bkt/key", nil)
	r.URL.RawQuery = query
	for k, v := range map[string]string{"Authorization": authz, "X-Amz-Date": amzDate, "X-Amz-Content-Sha256": payload} {
		if v != "" {
			r.Header.Set(k, v)
		}
	}
	return r
}

// signedSeed signs (header) or presigns a GET with the AWS SDK's signer,
// and returns the strings sigRequest takes.
func signedSeed(tb testing.TB, presign bool, query string) (authz, amzDate, payload, q string) {
	return signedSeedMethod(tb, http.MethodGet, presign, query)
}

func signedSeedMethod(tb testing.TB, method string, presign bool, query string) (authz, amzDate, payload, q string) {
	r := httptest.NewRequest(method, "http://gw.test/bkt/key", nil)
	r.URL.RawQuery = query
	creds := aws.Credentials{AccessKeyID: fuzzAccessKey, SecretAccessKey: fuzzSecret}
	s := v4.NewSigner()
	if presign {
		u, _, err := s.PresignHTTP(context.Background(), creds, r, unsignedPayload, "s3", fuzzRegion, fuzzNow)
		if err != nil {
			tb.Fatal(err)
		}
		return "", "", "", u[strings.Index(u, "?")+1:]
	}
	r.Header.Set("X-Amz-Content-Sha256", emptySHA256)
	if err := s.SignHTTP(context.Background(), creds, r, emptySHA256, "s3", fuzzRegion, fuzzNow); err != nil {
		tb.Fatal(err)
	}
	return r.Header.Get("Authorization"), r.Header.Get("X-Amz-Date"), emptySHA256, r.URL.RawQuery
}

func FuzzSigV4(f *testing.F) {
	for _, c := range []struct {
		presign bool
		query   string
	}{{false, ""}, {false, "list-type=2&prefix=a%2Fb"}, {true, "X-Amz-Expires=300"}} {
		authz, amzDate, payload, query := signedSeed(f, c.presign, c.query)
		f.Add(authz, amzDate, payload, query)
	}
	f.Add("AWS4-HMAC-SHA256 Credential=AKIDFUZZ/20261124/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00", "20261124T050000Z", unsignedPayload, "")
	f.Add("AWS AKIDFUZZ:sig", "", "", "")
	f.Add("", "", "", "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDFUZZ%2F20261124%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20261124T050000Z&X-Amz-Expires=18446744074&X-Amz-SignedHeaders=host&X-Amz-Signature=00")
	g := authGateway()
	f.Fuzz(func(t *testing.T, authz, amzDate, payload, query string) {
		r := sigRequest(authz, amzDate, payload, query)
		a, e := g.authenticate(r)
		if e != nil {
			// Looking up the key may fail with a server error (the
			// namespace manager down): here it cannot.
			checkClientError(t, e)
			return
		}
		if a.anonymous {
			// Only a request with no signature at all is anonymous.
			if !isAnonymous(r) || a.owner != "" || a.admin {
				t.Fatalf("signed request taken as anonymous: %+v", a)
			}
			return
		}
		if a.accessKey != fuzzAccessKey || a.signingKey == nil || len(a.amzDate) < 8 {
			t.Fatalf("authenticated %+v", a)
		}
	})
}

// FuzzRange: the Range and x-amz-copy-source-range headers. A range is
// either ignored (not ok, no error: S3 serves the whole object), refused
// with 416, or lies within the object.
func FuzzRange(f *testing.F) {
	for _, v := range []string{"bytes=0-0", "bytes=5-", "bytes=-5", "bytes=-0", "bytes=9-3", "bytes=0-1,3-4", "bytes= 1-2", "bytes=-9223372036854775808", "items=0-1"} {
		f.Add(v, int64(10))
	}
	f.Add("bytes=0-", int64(0))
	f.Fuzz(func(t *testing.T, v string, size int64) {
		if size < 0 {
			return
		}
		start, length, ok, e := parseRange(v, size)
		switch {
		case e != nil:
			if ok || e.Status != 416 {
				t.Fatalf("range %q of %d: ok %v with %v", v, size, ok, e)
			}
		case ok:
			if start < 0 || length < 1 || start > size-length {
				t.Fatalf("range %q of %d bytes: start %d length %d", v, size, start, length)
			}
		}
	})
}

// FuzzRoute: any method, path, query and header routes without a panic,
// and a request naming a sub-resource is either served by an operation
// that serves it or refused: never served as something else.
func FuzzRoute(f *testing.F) {
	for _, c := range []struct{ method, path, query, hk, hv string }{
		{"GET", "/bkt", "policyStatus", "", ""},
		{"GET", "/bkt", "list-type=2&prefix=&x-id=ListObjectsV2", "", ""},
		{"PUT", "/bkt/key", "partNumber=1&uploadId=abc", "X-Amz-Copy-Source", "/a/b"},
		{"GET", "/bkt/key", "versionId=null&partNumber=1", "", ""},
		{"PUT", "/bkt/key", "", "X-Amz-Object-Lock-Mode", "GOVERNANCE"},
		{"DELETE", "/bkt", "delete", "", ""},
		{"POST", "/bkt/key", "uploads&tagging", "", ""},
		{"PUT", "/bkt", "versioning", "X-Amz-Acl", "public-read"},
	} {
		f.Add(c.method, c.path, c.query, c.hk, c.hv)
	}
	g := authGateway()
	f.Fuzz(func(t *testing.T, method, path, query, hk, hv string) {
		r, err := http.NewRequest(method, "http://gw.test/", nil)
		if err != nil {
			return
		}
		r.URL.Path, r.URL.RawQuery = path, query
		if hk != "" && !strings.ContainsAny(hk, "\r\n:") {
			r.Header.Set(hk, hv)
		}
		req := &request{r: r}
		req.bucket, req.key, _ = g.address(r)
		g.route(req)
		if req.op == "" {
			t.Fatalf("%s %s?%s: no operation", method, path, query)
		}
		if req.op == "Unsupported" {
			return
		}
		for k := range r.URL.Query() {
			if subResources[k] && !contains(opSubResources[req.op], k) {
				t.Fatalf("%s %s?%s routed to %s, which does not serve ?%s", method, path, query, req.op, k)
			}
		}
	})
}
