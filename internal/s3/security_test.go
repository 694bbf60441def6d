package s3_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	bs3 "github.com/basalt-store/basalt/internal/s3"
)

// The attacks of issue 13 on the S3 gateway, each as a test that fails on
// the gateway before the change: conditional writes ignored, unknown
// sub-resources served as listings, unsigned x-amz-* headers accepted,
// stalled bodies holding upload slots forever, any key acting on any
// user's buckets.

func TestGatewaySecurity(t *testing.T) {
	e := setup(t)
	t.Run("ConditionalWrites", e.testConditionalWrites)
	t.Run("ConditionalConflict", e.testConditionalConflict)
	t.Run("SubResources", e.testSubResources)
	t.Run("UnsignedHeaders", e.testUnsignedHeaders)
	t.Run("SlowClients", e.testSlowClients)
	t.Run("TrailingChunkBytes", e.testTrailingChunkBytes)
	t.Run("UserIsolation", e.testUserIsolation)
}

func (e *env) testConditionalWrites(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "cond")
	put := func(key, body string, ifMatch, ifNoneMatch *string) (*s3.PutObjectOutput, error) {
		return e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("cond"), Key: aws.String(key), Body: strings.NewReader(body),
			IfMatch: ifMatch, IfNoneMatch: ifNoneMatch})
	}
	star := aws.String("*")
	first, err := put("k", "first", nil, star)
	if err != nil {
		t.Fatal(err)
	}
	_, err = put("k", "second", nil, star)
	wantCode(t, err, "PreconditionFailed", 412)
	_, err = put("k", "second", aws.String(`"0123456789abcdef0123456789abcdef"`), nil)
	wantCode(t, err, "PreconditionFailed", 412)
	if got := e.get(t, "cond", "k"); string(got) != "first" {
		t.Fatalf("refused writes overwrote the object: %q", got)
	}
	if _, err := put("k", "third", first.ETag, nil); err != nil {
		t.Fatal(err)
	}
	if got := e.get(t, "cond", "k"); string(got) != "third" {
		t.Fatalf("If-Match write: %q", got)
	}
	_, err = put("missing", "x", first.ETag, nil)
	wantCode(t, err, "NoSuchKey", 404)
	_, err = put("k", "x", nil, aws.String(`"abc"`))
	wantCode(t, err, "NotImplemented", 501)

	// Racing creators: exactly one wins.
	const n = 8
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = put("race", fmt.Sprintf("writer %d", i), nil, star)
		}()
	}
	wg.Wait()
	winner := -1
	for i, err := range errs {
		if err == nil {
			if winner >= 0 {
				t.Fatalf("writers %d and %d both created the key", winner, i)
			}
			winner = i
			continue
		}
		var ae smithy.APIError
		if !errors.As(err, &ae) || (ae.ErrorCode() != "PreconditionFailed" && ae.ErrorCode() != "ConditionalRequestConflict") {
			t.Fatalf("writer %d: %v", i, err)
		}
	}
	if winner < 0 {
		t.Fatal("no writer won")
	}
	if got := e.get(t, "cond", "race"); string(got) != fmt.Sprintf("writer %d", winner) {
		t.Fatalf("race: object %q, winner %d", got, winner)
	}

	// CompleteMultipartUpload: conditional too; a refused one keeps the
	// upload, which completes once the condition holds.
	mp, err := e.s3.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String("cond"), Key: aws.String("k")})
	if err != nil {
		t.Fatal(err)
	}
	part, err := e.s3.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String("cond"), Key: aws.String("k"), UploadId: mp.UploadId,
		PartNumber: aws.Int32(1), Body: strings.NewReader("multipart body")})
	if err != nil {
		t.Fatal(err)
	}
	complete := func(ifMatch, ifNoneMatch *string) error {
		_, err := e.s3.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: aws.String("cond"), Key: aws.String("k"), UploadId: mp.UploadId,
			MultipartUpload: &types.CompletedMultipartUpload{Parts: []types.CompletedPart{{PartNumber: aws.Int32(1), ETag: part.ETag}}},
			IfMatch:         ifMatch, IfNoneMatch: ifNoneMatch})
		return err
	}
	wantCode(t, complete(nil, star), "PreconditionFailed", 412)
	wantCode(t, complete(first.ETag, nil), "PreconditionFailed", 412)
	if got := e.get(t, "cond", "k"); string(got) != "third" {
		t.Fatalf("refused completes overwrote the object: %q", got)
	}
	h, err := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("cond"), Key: aws.String("k")})
	if err != nil {
		t.Fatal(err)
	}
	if err := complete(h.ETag, nil); err != nil {
		t.Fatal(err)
	}
	if got := e.get(t, "cond", "k"); string(got) != "multipart body" {
		t.Fatalf("completed object: %q", got)
	}

	// CopyObject: the destination's conditions.
	copyTo := func(key string, ifMatch, ifNoneMatch *string) error {
		_, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("cond"), Key: aws.String(key), CopySource: aws.String("cond/race"),
			IfMatch: ifMatch, IfNoneMatch: ifNoneMatch})
		return err
	}
	wantCode(t, copyTo("k", nil, star), "PreconditionFailed", 412)
	wantCode(t, copyTo("k", first.ETag, nil), "PreconditionFailed", 412)
	if got := e.get(t, "cond", "k"); string(got) != "multipart body" {
		t.Fatalf("refused copies overwrote the object: %q", got)
	}
	if err := copyTo("fresh", nil, star); err != nil {
		t.Fatal(err)
	}
	h, _ = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("cond"), Key: aws.String("k")})
	if err := copyTo("k", h.ETag, nil); err != nil {
		t.Fatal(err)
	}
	if got := e.get(t, "cond", "k"); string(got) != fmt.Sprintf("writer %d", winner) {
		t.Fatalf("If-Match copy: %q", got)
	}
}

// testConditionalConflict: a conditional PUT whose condition held when it
// started but not when it commits (another writer got in while its body
// was arriving) is refused with 409 ConditionalRequestConflict, and the
// other writer's object stays.
func (e *env) testConditionalConflict(t *testing.T) {
	e.mkBucket(t, "conflict")
	// Served in-process, so that the test knows when the gateway starts
	// reading the body: its early check has passed by then.
	pr, pw := io.Pipe()
	u := &slowUpload{key: "key", data: []byte("body"), pw: pw, read: make(chan struct{}), done: make(chan *httptest.ResponseRecorder, 1)}
	r := httptest.NewRequest("PUT", "http://gateway.test/conflict/key", &firstRead{r: pr, u: u})
	r.ContentLength = 4
	r.Header.Set("If-None-Match", "*")
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
	go func() {
		w := httptest.NewRecorder()
		e.gw.ServeHTTP(w, r)
		u.done <- w
	}()
	select {
	case <-u.read:
	case <-time.After(20 * time.Second):
		t.Fatal("the gateway never read the body")
	}
	e.put(t, "conflict", "key", []byte("the other writer"))
	w := u.finish()
	if w.Code != 409 || !strings.Contains(w.Body.String(), "<Code>ConditionalRequestConflict</Code>") {
		t.Fatalf("conflicting conditional PUT: %d %s", w.Code, w.Body)
	}
	if got := e.get(t, "conflict", "key"); string(got) != "the other writer" {
		t.Fatalf("object %q", got)
	}
}

// do sends a request signed (header) with the test key.
func (e *env) do(t *testing.T, method, path string, body []byte, hdr map[string]string) (int, string) {
	t.Helper()
	r, _ := http.NewRequest(method, e.url+path, bytes.NewReader(body))
	for k, v := range hdr {
		r.Header.Set(k, v)
	}
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func wantHTTP(t *testing.T, what string, code int, body string, wantCode int, wantErr string) {
	t.Helper()
	if code != wantCode || (wantErr != "" && !strings.Contains(body, "<Code>"+wantErr+"</Code>")) {
		t.Fatalf("%s: %d %s; want %d %s", what, code, body, wantCode, wantErr)
	}
}

func (e *env) testSubResources(t *testing.T) {
	e.mkBucket(t, "subres")
	e.put(t, "subres", "obj", []byte("data"))
	for _, c := range []struct{ method, path string }{
		{"GET", "/subres?lifecycle"}, {"GET", "/subres?replication"}, {"GET", "/subres?object-lock"},
		{"GET", "/subres?website"}, {"PUT", "/subres?versioning"}, {"GET", "/subres?versions"},
		{"GET", "/subres?cors"}, {"GET", "/subres?someFutureThing"}, {"GET", "/subres?metadataTable"},
		{"PUT", "/subres?policy&versioning"}, {"GET", "/subres/obj?acl&tagging"}, {"PUT", "/subres/obj?policy"},
		{"GET", "/subres/obj?retention"}, {"GET", "/subres/obj?legal-hold"}, {"PUT", "/subres/obj?retention"},
		{"GET", "/subres/obj?policyStatus"}, {"GET", "/subres/obj?attributes"}, {"POST", "/subres/obj?restore"},
		{"GET", "/subres/obj?uploads"}, {"DELETE", "/subres?delete"},
	} {
		code, body := e.do(t, c.method, c.path, nil, nil)
		wantHTTP(t, c.method+" "+c.path, code, body, 501, "NotImplemented")
	}
	// Ordinary parameters (the SDK's x-id among them) still list.
	if code, body := e.do(t, "GET", "/subres?x-id=ListObjects&prefix=o", nil, nil); code != 200 || !strings.Contains(body, "<Key>obj</Key>") {
		t.Fatalf("listing: %d %s", code, body)
	}
	// Object Lock is refused, not accepted and ignored.
	code, body := e.do(t, "PUT", "/subres/locked", []byte("x"), map[string]string{"X-Amz-Object-Lock-Mode": "COMPLIANCE",
		"X-Amz-Object-Lock-Retain-Until-Date": "2030-01-01T00:00:00Z"})
	wantHTTP(t, "PUT with Object Lock", code, body, 400, "InvalidRequest")
	_, err := e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("subres"), Key: aws.String("locked")})
	wantCode(t, err, "", 404)
	code, body = e.do(t, "PUT", "/subres-locked", nil, map[string]string{"X-Amz-Bucket-Object-Lock-Enabled": "true"})
	wantHTTP(t, "CreateBucket with Object Lock", code, body, 501, "NotImplemented")
	code, body = e.do(t, "PUT", "/subres/sse", []byte("x"), map[string]string{"X-Amz-Server-Side-Encryption-Customer-Algorithm": "AES256"})
	wantHTTP(t, "PUT with SSE-C", code, body, 501, "NotImplemented")

	// versionId: "null" is the object of an unversioned bucket; anything
	// else is refused, on GET, HEAD and DELETE.
	out, err := e.s3.GetObject(e.ctx, &s3.GetObjectInput{Bucket: aws.String("subres"), Key: aws.String("obj"), VersionId: aws.String("null")})
	if err != nil {
		t.Fatal(err)
	}
	out.Body.Close()
	for _, m := range []string{"GET", "HEAD", "DELETE"} {
		code, body = e.do(t, m, "/subres/obj?versionId=3HL4kqtJlcpXroDTDmJ.rmSpXd3dIbrHY", nil, nil)
		if m == "HEAD" {
			body = "<Code>InvalidArgument</Code>"
		}
		wantHTTP(t, m+" of another version", code, body, 400, "InvalidArgument")
	}
	if got := e.get(t, "subres", "obj"); string(got) != "data" {
		t.Fatalf("object after a refused versioned delete: %q", got)
	}
	if _, err := e.s3.DeleteObject(e.ctx, &s3.DeleteObjectInput{Bucket: aws.String("subres"), Key: aws.String("obj"), VersionId: aws.String("null")}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("subres"), Key: aws.String("obj")})
	wantCode(t, err, "", 404)
	// partNumber: part 1 of a single-part object is the object.
	e.put(t, "subres", "one", []byte("single"))
	code, body = e.do(t, "GET", "/subres/one?partNumber=1", nil, nil)
	wantHTTP(t, "GET part 1", code, body, 200, "")
	code, body = e.do(t, "GET", "/subres/one?partNumber=2", nil, nil)
	wantHTTP(t, "GET part 2", code, body, 416, "InvalidPartNumber")
}

func (e *env) testUnsignedHeaders(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "unsigned")
	e.put(t, "unsigned", "private", []byte("someone else's data"))
	// Headers added after signing.
	for _, hdr := range []map[string]string{{"X-Amz-Meta-Evil": "1"}, {"X-Amz-Tagging": "a=b"}, {"X-Amz-Copy-Source": "/unsigned/private"}} {
		r, _ := http.NewRequest("PUT", e.url+"/unsigned/target", strings.NewReader("mine"))
		e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
		for k, v := range hdr {
			r.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		wantHTTP(t, fmt.Sprintf("PUT with unsigned %v", hdr), resp.StatusCode, string(body), 403, "AccessDenied")
	}
	_, err := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("unsigned"), Key: aws.String("target")})
	wantCode(t, err, "", 404)

	// A presigned PUT URL plus an unsigned copy-source header.
	pc := s3.NewPresignClient(e.s3)
	pp, err := pc.PresignPutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("unsigned"), Key: aws.String("target")}, s3.WithPresignExpires(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest("PUT", pp.URL, nil)
	r.Header.Set("X-Amz-Copy-Source", "/unsigned/private")
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	wantHTTP(t, "presigned PUT with an unsigned copy source", resp.StatusCode, string(body), 403, "AccessDenied")
	_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("unsigned"), Key: aws.String("target")})
	wantCode(t, err, "", 404)
	// Moving a parameter into a presigned URL's query breaks it.
	resp, err = http.Get(pp.URL + "&x-amz-meta-evil=1")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 403 {
		t.Fatalf("presigned URL with an added x-amz parameter: %d", resp.StatusCode)
	}
	// x-amz-* parameters the presigned URL signs are its headers.
	u, _ := url.Parse(e.url + "/unsigned/presigned-meta")
	u.RawQuery = "X-Amz-Expires=60&x-amz-meta-color=blue&x-amz-tagging=" + url.QueryEscape("t=1")
	pr, _ := http.NewRequest("PUT", u.String(), nil)
	signed, _, err := v4.NewSigner().PresignHTTP(ctx, aws.Credentials{AccessKeyID: accessKey, SecretAccessKey: secretKey}, pr, "UNSIGNED-PAYLOAD", "s3", region, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	pr, _ = http.NewRequest("PUT", signed, strings.NewReader("meta via query"))
	resp, err = http.DefaultClient.Do(pr)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("presigned PUT with signed metadata: %d %s", resp.StatusCode, body)
	}
	h, err := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("unsigned"), Key: aws.String("presigned-meta")})
	if err != nil || h.Metadata["color"] != "blue" || aws.ToInt32(h.TagCount) != 1 {
		t.Fatalf("presigned metadata: %+v %v", h, err)
	}
}

// rawPut starts a signed PUT on its own connection, sends the headers and
// the first bytes of its body, and stalls.
func rawPut(t *testing.T, e *env, addr, key string, length int, sent []byte) net.Conn {
	t.Helper()
	r, _ := http.NewRequest("PUT", "http://"+addr+"/stall/"+key, nil)
	r.ContentLength = int64(length)
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "PUT /stall/%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n", key, addr, length)
	for k, vs := range r.Header {
		for _, v := range vs {
			fmt.Fprintf(&b, "%s: %s\r\n", k, v)
		}
	}
	b.WriteString("\r\n")
	b.Write(sent)
	if _, err := c.Write(b.Bytes()); err != nil {
		t.Fatal(err)
	}
	return c
}

// testSlowClients: stalled bodies time out and free their upload slots;
// headers are bounded in time and size.
func (e *env) testSlowClients(t *testing.T) {
	e.mkBucket(t, "stall")
	reg := prometheus.NewRegistry()
	// The default 32 upload slots, as in the attack.
	gw, err := bs3.New(bs3.Config{Client: e.cl, Listen: "127.0.0.1:0", UploadWait: 15 * time.Second,
		BodyIdleTimeout: 400 * time.Millisecond, ReadHeaderTimeout: 400 * time.Millisecond, MaxHeaderBytes: 16 << 10, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	go gw.Serve()
	defer gw.Close()
	addr := gw.Addr()
	// Every slot held by a body that stalls after 10 bytes.
	const slots = 32
	var stalled []net.Conn
	for i := range slots {
		c := rawPut(t, e, addr, fmt.Sprintf("stalled%d", i), 1000, []byte("0123456789"))
		defer c.Close()
		stalled = append(stalled, c)
	}
	waitUntil(t, "the stalled uploads to take the slots", func() bool { return gauge(t, reg, "basalt_s3_uploads_in_flight") == slots })
	// A PUT still goes through: the stalled ones time out.
	sdk := s3.New(s3.Options{Region: region, BaseEndpoint: aws.String("http://" + addr), UsePathStyle: true, RetryMaxAttempts: 1,
		Credentials: credentials.NewStaticCredentialsProvider(accessKey, secretKey, "")})
	start := time.Now()
	if _, err := sdk.PutObject(e.ctx, &s3.PutObjectInput{Bucket: aws.String("stall"), Key: aws.String("ok"), Body: strings.NewReader("through")}); err != nil {
		t.Fatalf("PUT behind stalled uploads: %v", err)
	}
	t.Logf("PUT behind %d stalled uploads took %v", slots, time.Since(start))
	for i, c := range stalled {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("stalled upload %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		wantHTTP(t, "stalled upload", resp.StatusCode, string(body), 400, "RequestTimeout")
	}
	if g := gauge(t, reg, "basalt_s3_uploads_in_flight"); g != 0 {
		t.Fatalf("%v uploads in flight after the timeouts", g)
	}
	for i := range slots {
		if _, err := e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("stall"), Key: aws.String(fmt.Sprintf("stalled%d", i))}); err == nil {
			t.Fatal("a stalled upload was committed")
		}
	}
	// Headers that never end: the connection is closed.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("GET /stall HTTP/1.1\r\nHost: x\r\n"))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	start = time.Now()
	n, err := c.Read(make([]byte, 1))
	var ne net.Error
	if n != 0 || err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("slow headers: read %d, %v after %v (the gateway should have closed the connection)", n, err, time.Since(start))
	}
	// Headers that are too large.
	req, _ := http.NewRequest("GET", "http://"+addr+"/stall", nil)
	req.Header.Set("X-Big", strings.Repeat("a", 64<<10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("64 KiB header: %d", resp.StatusCode)
	}
}

func (e *env) testTrailingChunkBytes(t *testing.T) {
	e.mkBucket(t, "trail")
	now := time.Now().UTC()
	amzDate := now.Format("20060102T150405Z")
	scope := now.Format("20060102") + "/" + region + "/s3/aws4_request"
	data := randBytes(7, 3000)
	send := func(key string, extra []byte) (int, string) {
		r, _ := http.NewRequest("PUT", e.url+"/trail/"+key, nil)
		r.Header.Set("X-Amz-Decoded-Content-Length", fmt.Sprint(len(data)))
		r.Header.Set("Content-Encoding", "aws-chunked")
		n := len(chunkedBody("x", amzDate, scope, nil, data, 1024, false)) + len(extra)
		r.ContentLength = int64(n)
		r.Header.Set("Content-Length", fmt.Sprint(n))
		e.sign(t, r, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", now, secretKey)
		seed := r.Header.Get("Authorization")
		seed = seed[strings.LastIndex(seed, "Signature=")+len("Signature="):]
		body := append(chunkedBody(seed, amzDate, scope, signingKey(secretKey, now.Format("20060102")), data, 1024, false), extra...)
		r.Body = io.NopCloser(bytes.NewReader(body))
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := send("clean", nil); code != 200 {
		t.Fatalf("chunked PUT: %d %s", code, body)
	}
	code, body := send("trailing", []byte("PUT /evil HTTP/1.1\r\n"))
	wantHTTP(t, "chunked PUT with bytes after the final chunk", code, body, 400, "IncompleteBody")
	_, err := e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("trail"), Key: aws.String("trailing")})
	wantCode(t, err, "", 404)
}

func (e *env) keyFor(t *testing.T, id, owner string, admin bool) *s3.Client {
	t.Helper()
	sec, err := e.cl.Namespace().CreateS3Secret(e.ctx, &metapb.CreateS3SecretRequest{AccessKeyId: id, Owner: owner, Admin: admin})
	if err != nil {
		t.Fatal(err)
	}
	return s3.New(s3.Options{Region: region, BaseEndpoint: aws.String(e.url), UsePathStyle: true, RetryMaxAttempts: 1,
		Credentials: credentials.NewStaticCredentialsProvider(id, sec.SecretAccessKey, "")})
}

func bucketNames(t *testing.T, e *env, c *s3.Client) []string {
	t.Helper()
	out, err := c.ListBuckets(e.ctx, &s3.ListBucketsInput{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, b := range out.Buckets {
		names = append(names, *b.Name)
	}
	return names
}

func (e *env) testUserIsolation(t *testing.T) {
	ctx := e.ctx
	alice := e.keyFor(t, "AKIDALICE", "alice", false)
	alice2 := e.keyFor(t, "AKIDALICE2", "alice", false) // a second key of the same user
	bob := e.keyFor(t, "AKIDBOB", "bob", false)
	admin := e.keyFor(t, "AKIDADMIN", "root", true)
	if _, err := alice.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("alice-data")}); err != nil {
		t.Fatal(err)
	}
	if _, err := bob.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("bob-data")}); err != nil {
		t.Fatal(err)
	}
	if _, err := alice.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("alice-data"), Key: aws.String("diary"), Body: strings.NewReader("dear diary")}); err != nil {
		t.Fatal(err)
	}
	b := aws.String("alice-data")
	k := aws.String("diary")
	denied := func(what string, err error) {
		t.Helper()
		var ae smithy.APIError
		if err == nil || (errors.As(err, &ae) && ae.ErrorCode() != "AccessDenied") {
			t.Fatalf("bob %s alice's bucket: %v, want AccessDenied", what, err)
		}
	}
	_, err := bob.GetObject(ctx, &s3.GetObjectInput{Bucket: b, Key: k})
	denied("reads", err)
	_, err = bob.HeadObject(ctx, &s3.HeadObjectInput{Bucket: b, Key: k})
	wantCode(t, err, "", 403)
	_, err = bob.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: b})
	denied("lists", err)
	_, err = bob.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: k, Body: strings.NewReader("overwritten")})
	denied("writes", err)
	_, err = bob.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: b, Key: k})
	denied("deletes from", err)
	// DeleteObjects answers per key, as S3: AccessDenied for each.
	dout, err := bob.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: b, Delete: &types.Delete{Objects: []types.ObjectIdentifier{{Key: k}}}})
	if err == nil && (len(dout.Errors) != 1 || aws.ToString(dout.Errors[0].Code) != "AccessDenied" || len(dout.Deleted) != 0) {
		t.Fatalf("bob batch-deletes from alice's bucket: deleted %d, errors %+v", len(dout.Deleted), dout.Errors)
	}
	if err != nil {
		denied("batch-deletes from", err)
	}
	_, err = bob.DeleteBucket(ctx, &s3.DeleteBucketInput{Bucket: b})
	denied("deletes", err)
	_, err = bob.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: aws.String("mp")})
	denied("starts an upload in", err)
	_, err = bob.PutObjectTagging(ctx, &s3.PutObjectTaggingInput{Bucket: b, Key: k, Tagging: &types.Tagging{TagSet: []types.Tag{{Key: aws.String("a"), Value: aws.String("b")}}}})
	denied("tags", err)
	// Copying out of alice's bucket into bob's own.
	_, err = bob.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("bob-data"), Key: aws.String("stolen"), CopySource: aws.String("alice-data/diary")})
	denied("copies from", err)
	_, err = bob.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: b})
	wantCode(t, err, "BucketAlreadyExists", 409)
	_, err = alice2.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: b})
	wantCode(t, err, "BucketAlreadyOwnedByYou", 409)
	_, err = alice.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: b, ExpectedBucketOwner: aws.String("bob")})
	wantCode(t, err, "AccessDenied", 403)

	if got := bucketNames(t, e, bob); len(got) != 1 || got[0] != "bob-data" {
		t.Fatalf("bob lists %v", got)
	}
	if got := bucketNames(t, e, alice2); len(got) != 1 || got[0] != "alice-data" {
		t.Fatalf("alice lists %v", got)
	}
	if got := e.getWith(t, alice2, "alice-data", "diary"); got != "dear diary" {
		t.Fatalf("alice's object after bob's attempts: %q", got)
	}
	// An admin acts on everyone's buckets, and on buckets made without
	// an owner, which no one else may touch.
	if _, err := e.cl.Namespace().CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "legacy-bucket"}); err != nil {
		t.Fatal(err)
	}
	_, err = alice.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("legacy-bucket")})
	wantCode(t, err, "AccessDenied", 403)
	if got := e.getWith(t, admin, "alice-data", "diary"); got != "dear diary" {
		t.Fatalf("admin read %q", got)
	}
	if _, err := admin.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("legacy-bucket")}); err != nil {
		t.Fatal(err)
	}
	names := strings.Join(bucketNames(t, e, admin), ",")
	for _, want := range []string{"alice-data", "bob-data", "legacy-bucket"} {
		if !strings.Contains(names, want) {
			t.Fatalf("admin lists %s, without %s", names, want)
		}
	}
}

func (e *env) getWith(t *testing.T, c *s3.Client, bucket, key string) string {
	t.Helper()
	out, err := c.GetObject(e.ctx, &s3.GetObjectInput{Bucket: aws.String(bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatalf("get %s/%s: %v", bucket, key, err)
	}
	defer out.Body.Close()
	b, _ := io.ReadAll(out.Body)
	return string(b)
}
