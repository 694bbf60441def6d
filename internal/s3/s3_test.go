package s3_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/md5"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	bs3 "github.com/basalt-store/basalt/internal/s3"
	"github.com/basalt-store/basalt/internal/stream"
)

// The official AWS SDK for Go v2 against a gateway on an in-process
// cluster: the SDK signs (header, presigned, chunked), checks checksums
// and parses every response, so it is the oracle for the wire format.

const (
	accessKey = "AKIDBASALTTEST"
	secretKey = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
	region    = "us-east-1"
)

type env struct {
	cluster *cluster.Cluster
	gw      *bs3.Gateway
	reg     *prometheus.Registry
	cl      *client.Client
	gcl     *client.Client // the gateway's (gateway certificate)
	s3      *s3.Client
	vhost   *s3.Client
	url     string
	ctx     context.Context
	signer  *v4.Signer
}

var sharedEnv *env

func setup(t testing.TB) *env { return setupWith(t, 4<<20, 512<<20, 0) }

// setupWith starts the cluster with blockSize and containerSize, and gives
// the gateway's client a write buffer of bufBytes (0: the client's default).
func setupWith(t testing.TB, blockSize, containerSize uint64, bufBytes int64) *env {
	t.Helper()
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: 3, HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: blockSize, ContainerSize: containerSize})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
		ServiceToken: c.ServiceToken()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	if _, err := cl.Namespace().CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: accessKey, SecretAccessKey: secretKey, Owner: "tester"}); err != nil {
		t.Fatal(err)
	}
	// The gateway has a gateway certificate: the metadata service checks
	// every call for the access key's owner, as in a deployment.
	gwCreds, err := c.GatewayCredentials("s3")
	if err != nil {
		t.Fatal(err)
	}
	gcl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: gwCreds, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
		ServiceToken: c.ServiceToken(), MaxBufferBytes: bufBytes})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gcl.Close() })
	reg := prometheus.NewRegistry()
	gw, err := bs3.New(bs3.Config{Client: gcl, Listen: "127.0.0.1:0", Domains: []string{"s3.test"}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	go gw.Serve()
	t.Cleanup(func() { gw.Close() })
	e := &env{cluster: c, gw: gw, reg: reg, cl: cl, gcl: gcl, url: "http://" + gw.Addr(), ctx: context.Background(), signer: v4.NewSigner()}
	e.s3 = e.newS3(secretKey, true)
	e.vhost = e.newS3(secretKey, false)
	return e
}

// newS3 returns an SDK client; virtual-host clients address
// <bucket>.s3.test, dialled to the gateway.
func (e *env) newS3(secret string, pathStyle bool) *s3.Client {
	endpoint := e.url
	hc := &http.Client{}
	if !pathStyle {
		_, port, _ := net.SplitHostPort(e.gw.Addr())
		endpoint = "http://s3.test:" + port
		addr := e.gw.Addr()
		hc.Transport = &http.Transport{DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}}
	}
	return s3.New(s3.Options{Region: region, BaseEndpoint: aws.String(endpoint), UsePathStyle: pathStyle, HTTPClient: hc,
		Credentials: credentials.NewStaticCredentialsProvider(accessKey, secret, ""), RetryMaxAttempts: 1})
}

func wantCode(t *testing.T, err error, code string, status int) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want %s", code)
	}
	var ae smithy.APIError
	var re *awshttp.ResponseError
	if !errors.As(err, &re) || re.HTTPStatusCode() != status {
		t.Fatalf("error %v: want HTTP %d", err, status)
	}
	if code != "" && (!errors.As(err, &ae) || ae.ErrorCode() != code) {
		t.Fatalf("error %v: want code %s", err, code)
	}
}

func randBytes(seed int64, n int) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

func md5hex(b []byte) string { s := md5.Sum(b); return hex.EncodeToString(s[:]) }

func (e *env) mkBucket(t testing.TB, name string) {
	t.Helper()
	if _, err := e.s3.CreateBucket(e.ctx, &s3.CreateBucketInput{Bucket: aws.String(name)}); err != nil {
		t.Fatalf("create bucket %s: %v", name, err)
	}
}

func (e *env) put(t *testing.T, bucket, key string, data []byte) {
	t.Helper()
	if _, err := e.s3.PutObject(e.ctx, &s3.PutObjectInput{Bucket: aws.String(bucket), Key: aws.String(key), Body: bytes.NewReader(data)}); err != nil {
		t.Fatalf("put %s/%s: %v", bucket, key, err)
	}
}

func (e *env) get(t *testing.T, bucket, key string) []byte {
	t.Helper()
	out, err := e.s3.GetObject(e.ctx, &s3.GetObjectInput{Bucket: aws.String(bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatalf("get %s/%s: %v", bucket, key, err)
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sign signs a raw request with the SDK's signer at time at.
func (e *env) sign(t testing.TB, r *http.Request, payloadHash string, at time.Time, secret string) {
	t.Helper()
	r.Header.Set("X-Amz-Content-Sha256", payloadHash)
	if err := e.signer.SignHTTP(e.ctx, aws.Credentials{AccessKeyID: accessKey, SecretAccessKey: secret}, r, payloadHash, "s3", region, at); err != nil {
		t.Fatal(err)
	}
}

func TestGateway(t *testing.T) {
	e := setup(t)
	t.Run("Buckets", e.testBuckets)
	t.Run("Auth", e.testAuth)
	t.Run("Objects", e.testObjects)
	t.Run("Checksums", e.testChecksums)
	t.Run("ChunkedSigned", e.testChunkedSigned)
	t.Run("Listing", e.testListing)
	t.Run("Multipart", e.testMultipart)
	t.Run("Copy", e.testCopy)
	t.Run("Disconnect", e.testDisconnect)
	t.Run("VirtualHost", e.testVirtualHost)
	t.Run("Metrics", e.testMetrics)
}

func (e *env) testBuckets(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "bkt1")
	_, err := e.s3.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("bkt1")})
	wantCode(t, err, "BucketAlreadyOwnedByYou", 409)
	_, err = e.s3.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("Bad_Name")})
	wantCode(t, err, "InvalidBucketName", 400)
	if _, err := e.s3.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: aws.String("bkt1")}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: aws.String("nope-bucket")})
	wantCode(t, err, "", 404)
	lb, err := e.s3.ListBuckets(ctx, &s3.ListBucketsInput{})
	if err != nil || len(lb.Buckets) != 1 || *lb.Buckets[0].Name != "bkt1" || lb.Buckets[0].CreationDate == nil || *lb.Owner.ID != "tester" {
		t.Fatalf("list buckets %+v %v", lb, err)
	}
	loc, err := e.s3.GetBucketLocation(ctx, &s3.GetBucketLocationInput{Bucket: aws.String("bkt1")})
	if err != nil || loc.LocationConstraint != "" {
		t.Fatalf("location %+v %v", loc, err)
	}
	_, err = e.s3.GetBucketLocation(ctx, &s3.GetBucketLocationInput{Bucket: aws.String("nope-bucket")})
	wantCode(t, err, "NoSuchBucket", 404)
	e.put(t, "bkt1", "k", []byte("x"))
	_, err = e.s3.DeleteBucket(ctx, &s3.DeleteBucketInput{Bucket: aws.String("bkt1")})
	wantCode(t, err, "BucketNotEmpty", 409)
	if _, err := e.s3.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String("bkt1"), Key: aws.String("k")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s3.DeleteBucket(ctx, &s3.DeleteBucketInput{Bucket: aws.String("bkt1")}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.DeleteBucket(ctx, &s3.DeleteBucketInput{Bucket: aws.String("bkt1")})
	wantCode(t, err, "NoSuchBucket", 404)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("bkt1"), Key: aws.String("k"), Body: strings.NewReader("x")})
	wantCode(t, err, "NoSuchBucket", 404)
}

func (e *env) testAuth(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "auth")
	e.put(t, "auth", "secret.txt", []byte("top secret"))

	bad := e.newS3("wrong-secret-wrong-secret", true)
	_, err := bad.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("auth"), Key: aws.String("secret.txt")})
	wantCode(t, err, "SignatureDoesNotMatch", 403)
	_, err = bad.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("auth"), Key: aws.String("new"), Body: strings.NewReader("x")})
	wantCode(t, err, "SignatureDoesNotMatch", 403)

	unknown := s3.New(s3.Options{Region: region, BaseEndpoint: aws.String(e.url), UsePathStyle: true, RetryMaxAttempts: 1,
		Credentials: credentials.NewStaticCredentialsProvider("AKIDUNKNOWN", secretKey, "")})
	_, err = unknown.ListBuckets(ctx, &s3.ListBucketsInput{})
	wantCode(t, err, "InvalidAccessKeyId", 403)

	// Anonymous: AccessDenied and no data.
	resp, err := http.Get(e.url + "/auth/secret.txt")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !bytes.Contains(body, []byte("<Code>AccessDenied</Code>")) || bytes.Contains(body, []byte("top secret")) {
		t.Fatalf("anonymous GET: %d %s", resp.StatusCode, body)
	}

	// Signed 20 minutes ago: RequestTimeTooSkewed.
	r, _ := http.NewRequest("GET", e.url+"/auth/secret.txt", nil)
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now().Add(-20*time.Minute), secretKey)
	resp, err = http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !bytes.Contains(body, []byte("<Code>RequestTimeTooSkewed</Code>")) {
		t.Fatalf("skewed GET: %d %s", resp.StatusCode, body)
	}

	// A payload that does not match its signed SHA-256 is refused and not stored.
	r, _ = http.NewRequest("PUT", e.url+"/auth/tampered", strings.NewReader("hello"))
	e.sign(t, r, fmt.Sprintf("%x", sha256.Sum256([]byte("HELLO"))), time.Now(), secretKey)
	resp, err = http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !bytes.Contains(body, []byte("XAmzContentSHA256Mismatch")) {
		t.Fatalf("tampered PUT: %d %s", resp.StatusCode, body)
	}
	_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("auth"), Key: aws.String("tampered")})
	wantCode(t, err, "", 404)

	// Presigned URLs: GET and PUT work without headers.
	pc := s3.NewPresignClient(e.s3)
	pg, err := pc.PresignGetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("auth"), Key: aws.String("secret.txt")}, s3.WithPresignExpires(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	resp, err = http.Get(pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "top secret" {
		t.Fatalf("presigned GET: %d %s", resp.StatusCode, body)
	}
	pp, err := pc.PresignPutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("auth"), Key: aws.String("presigned-put")}, s3.WithPresignExpires(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	pr, _ := http.NewRequest("PUT", pp.URL, strings.NewReader("via presigned put"))
	for k, vs := range pp.SignedHeader {
		if k != "Host" {
			pr.Header[k] = vs
		}
	}
	resp, err = http.DefaultClient.Do(pr)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || string(e.get(t, "auth", "presigned-put")) != "via presigned put" {
		t.Fatalf("presigned PUT: %d", resp.StatusCode)
	}
	// Tampering with a presigned URL breaks it.
	resp, err = http.Get(strings.Replace(pg.URL, "secret.txt", "presigned-put", 1))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !bytes.Contains(body, []byte("SignatureDoesNotMatch")) {
		t.Fatalf("tampered presigned GET: %d %s", resp.StatusCode, body)
	}
	// Expired: signed two hours ago for one hour.
	r, _ = http.NewRequest("GET", e.url+"/auth/secret.txt?X-Amz-Expires=3600", nil)
	u, _, err := e.signer.PresignHTTP(ctx, aws.Credentials{AccessKeyID: accessKey, SecretAccessKey: secretKey}, r, "UNSIGNED-PAYLOAD", "s3", region, time.Now().Add(-2*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	resp, err = http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !bytes.Contains(body, []byte("<Code>AccessDenied</Code>")) || !bytes.Contains(body, []byte("expired")) {
		t.Fatalf("expired presigned GET: %d %s", resp.StatusCode, body)
	}
}

func (e *env) testObjects(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "objs")
	data := randBytes(1, 300_000)
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	put, err := e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin"), Body: bytes.NewReader(data),
		ContentType: aws.String("application/x-test"), ContentEncoding: aws.String("identity"), ContentDisposition: aws.String(`attachment; filename="a.bin"`),
		ContentLanguage: aws.String("en"), CacheControl: aws.String("max-age=60"), Expires: &exp,
		Metadata: map[string]string{"color": "blue", "Shape": "round"}, Tagging: aws.String("t1=v1&t2=v2")})
	if err != nil {
		t.Fatal(err)
	}
	if *put.ETag != `"`+md5hex(data)+`"` {
		t.Fatalf("ETag %s, want MD5 %s", *put.ETag, md5hex(data))
	}
	get, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")})
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(get.Body)
	get.Body.Close()
	if !bytes.Equal(got, data) || *get.ContentType != "application/x-test" || *get.ContentEncoding != "identity" || *get.ContentDisposition != `attachment; filename="a.bin"` ||
		*get.ContentLanguage != "en" || *get.CacheControl != "max-age=60" || *get.ExpiresString != exp.Format(http.TimeFormat) || get.Metadata["color"] != "blue" ||
		get.Metadata["shape"] != "round" || *get.TagCount != 2 || *get.ETag != *put.ETag || *get.ContentLength != int64(len(data)) {
		t.Fatalf("GET headers %+v (body equal %v)", get, bytes.Equal(got, data))
	}
	head, err := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")})
	if err != nil || *head.ContentLength != int64(len(data)) || *head.ETag != *put.ETag || head.Metadata["color"] != "blue" || head.LastModified == nil {
		t.Fatalf("HEAD %+v %v", head, err)
	}
	lastMod := *head.LastModified

	for _, c := range []struct {
		rng        string
		start, end int
	}{{"bytes=2-5", 2, 6}, {"bytes=-3", len(data) - 3, len(data)}, {"bytes=299990-", 299990, len(data)}, {"bytes=299990-999999", 299990, len(data)}, {"bytes=0-0", 0, 1}} {
		out, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin"), Range: aws.String(c.rng)})
		if err != nil {
			t.Fatalf("range %s: %v", c.rng, err)
		}
		b, _ := io.ReadAll(out.Body)
		out.Body.Close()
		want := fmt.Sprintf("bytes %d-%d/%d", c.start, c.end-1, len(data))
		if !bytes.Equal(b, data[c.start:c.end]) || *out.ContentRange != want {
			t.Fatalf("range %s: %d bytes, Content-Range %s want %s", c.rng, len(b), *out.ContentRange, want)
		}
	}
	_, err = e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin"), Range: aws.String("bytes=300000-")})
	wantCode(t, err, "InvalidRange", 416)

	// Conditionals.
	cond := func(in *s3.GetObjectInput) error {
		in.Bucket, in.Key = aws.String("objs"), aws.String("dir/obj.bin")
		out, err := e.s3.GetObject(ctx, in)
		if err == nil {
			out.Body.Close()
		}
		return err
	}
	if err := cond(&s3.GetObjectInput{IfMatch: put.ETag}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, cond(&s3.GetObjectInput{IfMatch: aws.String(`"0123"`)}), "PreconditionFailed", 412)
	wantCode(t, cond(&s3.GetObjectInput{IfNoneMatch: put.ETag}), "", 304)
	if err := cond(&s3.GetObjectInput{IfNoneMatch: aws.String(`"0123"`)}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, cond(&s3.GetObjectInput{IfModifiedSince: aws.Time(lastMod)}), "", 304)
	if err := cond(&s3.GetObjectInput{IfModifiedSince: aws.Time(lastMod.Add(-time.Hour))}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, cond(&s3.GetObjectInput{IfUnmodifiedSince: aws.Time(lastMod.Add(-time.Hour))}), "PreconditionFailed", 412)
	if err := cond(&s3.GetObjectInput{IfUnmodifiedSince: aws.Time(lastMod)}); err != nil {
		t.Fatal(err)
	}
	// A true If-Match wins over a false If-Unmodified-Since.
	if err := cond(&s3.GetObjectInput{IfMatch: put.ETag, IfUnmodifiedSince: aws.Time(lastMod.Add(-time.Hour))}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin"), IfMatch: aws.String(`"x"`)})
	wantCode(t, err, "", 412)

	_, err = e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("objs"), Key: aws.String("missing")})
	wantCode(t, err, "NoSuchKey", 404)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("objs"), Key: aws.String("md5"), Body: strings.NewReader("abc"),
		ContentMD5: aws.String("1B2M2Y8AsgTpgAmY7PhCfg==")})
	wantCode(t, err, "BadDigest", 400)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("objs"), Key: aws.String(strings.Repeat("k", 1025)), Body: strings.NewReader("abc")})
	wantCode(t, err, "KeyTooLongError", 400)

	// Tagging.
	tg, err := e.s3.GetObjectTagging(ctx, &s3.GetObjectTaggingInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")})
	if err != nil || len(tg.TagSet) != 2 || *tg.TagSet[0].Key != "t1" || *tg.TagSet[1].Value != "v2" {
		t.Fatalf("tags %+v %v", tg, err)
	}
	if _, err := e.s3.PutObjectTagging(ctx, &s3.PutObjectTaggingInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin"),
		Tagging: &types.Tagging{TagSet: []types.Tag{{Key: aws.String("only"), Value: aws.String("one")}}}}); err != nil {
		t.Fatal(err)
	}
	tg, _ = e.s3.GetObjectTagging(ctx, &s3.GetObjectTaggingInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")})
	if len(tg.TagSet) != 1 || *tg.TagSet[0].Key != "only" {
		t.Fatalf("tags after put %+v", tg)
	}
	tooMany := make([]types.Tag, 11)
	for i := range tooMany {
		tooMany[i] = types.Tag{Key: aws.String(strconv.Itoa(i)), Value: aws.String("v")}
	}
	_, err = e.s3.PutObjectTagging(ctx, &s3.PutObjectTaggingInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin"), Tagging: &types.Tagging{TagSet: tooMany}})
	wantCode(t, err, "BadRequest", 400)
	if _, err := e.s3.DeleteObjectTagging(ctx, &s3.DeleteObjectTaggingInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")}); err != nil {
		t.Fatal(err)
	}
	tg, _ = e.s3.GetObjectTagging(ctx, &s3.GetObjectTaggingInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")})
	if len(tg.TagSet) != 0 {
		t.Fatalf("tags after delete %+v", tg)
	}
	// Data and ETag survive attribute changes.
	if !bytes.Equal(e.get(t, "objs", "dir/obj.bin"), data) {
		t.Fatal("data changed by tagging")
	}

	// Copy: COPY keeps attributes, REPLACE takes the request's.
	cp, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy1"), CopySource: aws.String("objs/dir/obj.bin")})
	if err != nil || *cp.CopyObjectResult.ETag != *put.ETag {
		t.Fatalf("copy %+v %v", cp, err)
	}
	h1, _ := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy1")})
	if h1.Metadata["color"] != "blue" || *h1.ContentType != "application/x-test" || !bytes.Equal(e.get(t, "objs", "copy1"), data) {
		t.Fatalf("copied attributes %+v", h1)
	}
	_, err = e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy2"), CopySource: aws.String("objs/dir/obj.bin"),
		MetadataDirective: types.MetadataDirectiveReplace, ContentType: aws.String("text/plain"), Metadata: map[string]string{"new": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	h2, _ := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy2")})
	if h2.Metadata["color"] != "" || h2.Metadata["new"] != "1" || *h2.ContentType != "text/plain" {
		t.Fatalf("replaced attributes %+v", h2)
	}
	_, err = e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy2"), CopySource: aws.String("objs/copy2")})
	wantCode(t, err, "InvalidRequest", 400)
	_, err = e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy3"), CopySource: aws.String("objs/dir/obj.bin"), CopySourceIfMatch: aws.String(`"nope"`)})
	wantCode(t, err, "PreconditionFailed", 412)
	_, err = e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy3"), CopySource: aws.String("objs/missing")})
	wantCode(t, err, "NoSuchKey", 404)
	// Onto itself with REPLACE: attributes only, same blocks.
	before, _ := e.cl.StatKey(ctx, "s3v", "objs", "copy2")
	if _, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("objs"), Key: aws.String("copy2"), CopySource: aws.String("/objs/copy2"),
		MetadataDirective: types.MetadataDirectiveReplace, Metadata: map[string]string{"v": "2"}}); err != nil {
		t.Fatal(err)
	}
	after, _ := e.cl.StatKey(ctx, "s3v", "objs", "copy2")
	if after.ObjectID != before.ObjectID || after.Blocks[0].LocalID != before.Blocks[0].LocalID || after.Meta.User["v"] != "2" || after.Meta.Etag != md5hex(data) {
		t.Fatalf("self copy moved data or lost the ETag: before %+v after %+v", before, after)
	}

	// Deletes: missing keys are fine; DeleteObjects reports each.
	if _, err := e.s3.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String("objs"), Key: aws.String("never-existed")}); err != nil {
		t.Fatal(err)
	}
	del, err := e.s3.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: aws.String("objs"), Delete: &types.Delete{Objects: []types.ObjectIdentifier{
		{Key: aws.String("copy1")}, {Key: aws.String("copy2")}, {Key: aws.String("nope")}}}})
	if err != nil || len(del.Deleted) != 3 || len(del.Errors) != 0 {
		t.Fatalf("delete objects %+v %v", del, err)
	}
	del, err = e.s3.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: aws.String("objs"), Delete: &types.Delete{Quiet: aws.Bool(true), Objects: []types.ObjectIdentifier{
		{Key: aws.String("dir/obj.bin")}, {Key: aws.String(strings.Repeat("x", 1025))}}}})
	if err != nil || len(del.Deleted) != 0 || len(del.Errors) != 1 || *del.Errors[0].Code != "KeyTooLongError" {
		t.Fatalf("quiet delete objects %+v %v", del, err)
	}
	_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("objs"), Key: aws.String("dir/obj.bin")})
	wantCode(t, err, "", 404)
	// Empty object.
	e.put(t, "objs", "empty", nil)
	if b := e.get(t, "objs", "empty"); len(b) != 0 {
		t.Fatalf("empty object has %d bytes", len(b))
	}
}

func (e *env) testChecksums(t *testing.T) {
	e.mkBucket(t, "sums")
	// Below and above asyncHashMin: digests inline and on their own goroutine.
	for _, n := range []int{100_000, 3<<20 + 5} {
		e.testChecksumsSize(t, n)
	}
	e.testCRC32COnce(t)
}

// testCRC32COnce (issue 15): a PUT with a CRC32C checksum sums the body
// with CRC32C once — the V2 writer's chunk sums, combined into the
// object's — not also in the gateway; a wrong CRC32C is still refused
// before the commit. The gateway used to sum every byte three times (its
// own checksum, the stream's window sums, the stream's packet CRC).
func (e *env) testCRC32COnce(t *testing.T) {
	ctx := e.ctx
	const n = 9<<20 + 321 // V2, three blocks of 4 MiB
	data := randBytes(5, n)
	g0, s0 := bs3.CRC32CSummedBytes(), stream.SummedBytes()
	out, err := e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("sums"), Key: aws.String("crc-once"), Body: bytes.NewReader(data),
		ChecksumAlgorithm: types.ChecksumAlgorithmCrc32c, ContentLength: aws.Int64(n)})
	if err != nil {
		t.Fatal(err)
	}
	want := base64.StdEncoding.EncodeToString(binary.BigEndian.AppendUint32(nil, crc32.Checksum(data, crc32.MakeTable(crc32.Castagnoli))))
	if aws.ToString(out.ChecksumCRC32C) != want {
		t.Fatalf("PUT answered CRC32C %s, want %s", aws.ToString(out.ChecksumCRC32C), want)
	}
	if g, s := bs3.CRC32CSummedBytes()-g0, stream.SummedBytes()-s0; g != 0 || s != n {
		t.Fatalf("%d bytes PUT: the gateway summed %d bytes with CRC32C and its stream writer %d (want 0 and %d)", n, g, s, n)
	}
	if got := e.get(t, "sums", "crc-once"); !bytes.Equal(got, data) {
		t.Fatal("content differs")
	}
	// A wrong CRC32C (header and, unsigned, a trailer): BadDigest, nothing stored.
	for _, trailer := range []bool{false, true} {
		key := fmt.Sprint("crc-bad-", trailer)
		var r *http.Request
		if trailer {
			var body bytes.Buffer
			fmt.Fprintf(&body, "%x\r\n", n)
			body.Write(data)
			body.WriteString("\r\n0\r\nx-amz-checksum-crc32c:AAAAAA==\r\n\r\n")
			r, _ = http.NewRequest("PUT", e.url+"/sums/"+key, &body)
			r.Header.Set("Content-Encoding", "aws-chunked")
			r.Header.Set("X-Amz-Decoded-Content-Length", fmt.Sprint(n))
			r.Header.Set("X-Amz-Trailer", "x-amz-checksum-crc32c")
			e.sign(t, r, "STREAMING-UNSIGNED-PAYLOAD-TRAILER", time.Now(), secretKey)
		} else {
			r, _ = http.NewRequest("PUT", e.url+"/sums/"+key, bytes.NewReader(data))
			r.Header.Set("X-Amz-Checksum-Crc32c", "AAAAAA==")
			e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
		}
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !bytes.Contains(body, []byte("BadDigest")) {
			t.Fatalf("wrong CRC32C (trailer %v): %d %s", trailer, resp.StatusCode, body)
		}
		_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("sums"), Key: aws.String(key)})
		wantCode(t, err, "", 404)
	}
}

func (e *env) testChecksumsSize(t *testing.T, n int) {
	ctx := e.ctx
	data := randBytes(2, n)
	// Unseekable bodies get a trailing checksum, which the SDK sends only
	// over TLS: serve the gateway's handler over TLS too.
	ts := httptest.NewTLSServer(e.gw)
	defer ts.Close()
	tlsS3 := s3.New(s3.Options{Region: region, BaseEndpoint: aws.String(ts.URL), UsePathStyle: true, HTTPClient: ts.Client(),
		Credentials: credentials.NewStaticCredentialsProvider(accessKey, secretKey, ""), RetryMaxAttempts: 1})
	for _, alg := range []types.ChecksumAlgorithm{types.ChecksumAlgorithmCrc32, types.ChecksumAlgorithmCrc32c, types.ChecksumAlgorithmCrc64nvme, types.ChecksumAlgorithmSha1, types.ChecksumAlgorithmSha256} {
		key := "obj-" + string(alg)
		// Seekable and unseekable bodies: the SDK sends the checksum in a
		// header or as an aws-chunked trailer.
		for i, body := range []io.Reader{bytes.NewReader(data), io.MultiReader(bytes.NewReader(data))} {
			c := e.s3
			if i == 1 {
				c = tlsS3
			}
			_, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("sums"), Key: aws.String(key), Body: body, ChecksumAlgorithm: alg,
				ContentLength: aws.Int64(int64(len(data)))})
			if err != nil {
				t.Fatalf("put %s (body %d): %v", alg, i, err)
			}
			out, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("sums"), Key: aws.String(key), ChecksumMode: types.ChecksumModeEnabled})
			if err != nil {
				t.Fatal(err)
			}
			// The SDK verifies the returned checksum while reading.
			b, err := io.ReadAll(out.Body)
			out.Body.Close()
			if err != nil || !bytes.Equal(b, data) {
				t.Fatalf("get %s: %v", alg, err)
			}
		}
	}
	// A wrong checksum header: BadDigest, nothing stored.
	r, _ := http.NewRequest("PUT", e.url+"/sums/bad", bytes.NewReader(data))
	r.Header.Set("X-Amz-Checksum-Crc32", "AAAAAA==")
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !bytes.Contains(body, []byte("BadDigest")) {
		t.Fatalf("bad checksum: %d %s", resp.StatusCode, body)
	}
	_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("sums"), Key: aws.String("bad")})
	wantCode(t, err, "", 404)
	// A wrong Content-MD5 and a payload that does not match its signed
	// SHA-256: refused, nothing stored.
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("sums"), Key: aws.String("badmd5"), Body: bytes.NewReader(data),
		ContentMD5: aws.String("1B2M2Y8AsgTpgAmY7PhCfg==")})
	wantCode(t, err, "BadDigest", 400)
	r, _ = http.NewRequest("PUT", e.url+"/sums/badsha", bytes.NewReader(data))
	e.sign(t, r, fmt.Sprintf("%x", sha256.Sum256(data[1:])), time.Now(), secretKey)
	resp, err = http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !bytes.Contains(body, []byte("XAmzContentSHA256Mismatch")) {
		t.Fatalf("tampered PUT of %d bytes: %d %s", n, resp.StatusCode, body)
	}
	for _, k := range []string{"badmd5", "badsha"} {
		_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("sums"), Key: aws.String(k)})
		wantCode(t, err, "", 404)
	}
	// A good signed payload: stored, ETag is the MD5.
	r, _ = http.NewRequest("PUT", e.url+"/sums/goodsha", bytes.NewReader(data))
	e.sign(t, r, fmt.Sprintf("%x", sha256.Sum256(data)), time.Now(), secretKey)
	resp, err = http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("ETag") != `"`+md5hex(data)+`"` {
		t.Fatalf("signed PUT of %d bytes: %d, ETag %s want %s", n, resp.StatusCode, resp.Header.Get("ETag"), md5hex(data))
	}
}

// chunkedBody builds a STREAMING-AWS4-HMAC-SHA256-PAYLOAD body from the
// SDK's seed signature (the spec's chunk signing, written independently
// of the gateway's).
func chunkedBody(seed, amzDate, scope string, key []byte, data []byte, chunk int, corrupt bool) []byte {
	mac := func(s string) string {
		h := hmac.New(sha256.New, key)
		h.Write([]byte(s))
		return hex.EncodeToString(h.Sum(nil))
	}
	hash := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	var out bytes.Buffer
	prev := seed
	for off := 0; ; off = min(off+chunk, len(data)) {
		end := min(off+chunk, len(data))
		c := data[off:end]
		sig := mac("AWS4-HMAC-SHA256-PAYLOAD\n" + amzDate + "\n" + scope + "\n" + prev + "\n" + hash(nil) + "\n" + hash(c))
		fmt.Fprintf(&out, "%x;chunk-signature=%s\r\n", len(c), sig)
		if corrupt && off > 0 && len(c) > 0 {
			c = append([]byte{c[0] ^ 1}, c[1:]...)
		}
		out.Write(c)
		out.WriteString("\r\n")
		prev = sig
		if len(c) == 0 {
			return out.Bytes()
		}
	}
}

func signingKey(secret, date string) []byte {
	m := func(k []byte, s string) []byte { h := hmac.New(sha256.New, k); h.Write([]byte(s)); return h.Sum(nil) }
	return m(m(m(m([]byte("AWS4"+secret), date), region), "s3"), "aws4_request")
}

func (e *env) testChunkedSigned(t *testing.T) {
	e.mkBucket(t, "chunked")
	data := randBytes(3, 200_000)
	send := func(key string, corrupt bool) (int, string) {
		now := time.Now().UTC()
		amzDate := now.Format("20060102T150405Z")
		scope := now.Format("20060102") + "/" + region + "/s3/aws4_request"
		// The body depends on the seed signature, which covers the
		// headers: sign first, then build the body.
		r, _ := http.NewRequest("PUT", e.url+"/chunked/"+key, nil)
		r.Header.Set("Content-Encoding", "aws-chunked")
		r.Header.Set("X-Amz-Decoded-Content-Length", strconv.Itoa(len(data)))
		body0 := chunkedBody("x", amzDate, scope, nil, data, 64<<10, false)
		r.ContentLength = int64(len(body0)) // same length whatever the signatures
		r.Header.Set("Content-Length", strconv.Itoa(len(body0)))
		e.sign(t, r, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", now, secretKey)
		auth := r.Header.Get("Authorization")
		seed := auth[strings.LastIndex(auth, "Signature=")+len("Signature="):]
		b := chunkedBody(seed, amzDate, scope, signingKey(secretKey, now.Format("20060102")), data, 64<<10, corrupt)
		r.Body = io.NopCloser(bytes.NewReader(b))
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(body)
	}
	if code, body := send("good", false); code != 200 {
		t.Fatalf("chunk-signed PUT: %d %s", code, body)
	}
	if !bytes.Equal(e.get(t, "chunked", "good"), data) {
		t.Fatal("chunk-signed upload stored different data")
	}
	if code, body := send("corrupt", true); code != 403 || !strings.Contains(body, "SignatureDoesNotMatch") {
		t.Fatalf("corrupted chunk: %d %s", code, body)
	}
	_, err := e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("chunked"), Key: aws.String("corrupt")})
	wantCode(t, err, "", 404)
}

func (e *env) testListing(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "list")
	keys := []string{"a/1", "a/2", "a/b/3", "b/1", "c", "d e+f", "z/\u00e9"}
	for _, k := range keys {
		e.put(t, "list", k, []byte(k))
	}
	out, err := e.s3.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("list"), Delimiter: aws.String("/")})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range out.Contents {
		got = append(got, *c.Key)
		if *c.ETag != `"`+md5hex([]byte(*c.Key))+`"` || *c.Size != int64(len(*c.Key)) {
			t.Fatalf("entry %+v", c)
		}
	}
	for _, p := range out.CommonPrefixes {
		got = append(got, *p.Prefix)
	}
	if want := []string{"c", "d e+f", "a/", "b/", "z/"}; !slices.Equal(got, want) || *out.IsTruncated || *out.KeyCount != 5 {
		t.Fatalf("delimiter listing %v (truncated %v), want %v", got, *out.IsTruncated, want)
	}
	// Page by page, one entry each, with the SDK's paginator.
	var all []string
	p := s3.NewListObjectsV2Paginator(e.s3, &s3.ListObjectsV2Input{Bucket: aws.String("list"), MaxKeys: aws.Int32(2)})
	pages := 0
	for p.HasMorePages() {
		pg, err := p.NextPage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, c := range pg.Contents {
			all = append(all, *c.Key)
		}
	}
	if !slices.Equal(all, keys) || pages != 4 {
		t.Fatalf("paged listing %v in %d pages", all, pages)
	}
	out, _ = e.s3.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("list"), Prefix: aws.String("a/"), Delimiter: aws.String("/"), StartAfter: aws.String("a/1")})
	if len(out.Contents) != 1 || *out.Contents[0].Key != "a/2" || len(out.CommonPrefixes) != 1 || *out.CommonPrefixes[0].Prefix != "a/b/" {
		t.Fatalf("start-after listing %+v", out)
	}
	// V1 with marker; the SDK decodes encoding-type=url.
	v1, err := e.s3.ListObjects(ctx, &s3.ListObjectsInput{Bucket: aws.String("list"), Marker: aws.String("b/1"), EncodingType: types.EncodingTypeUrl, MaxKeys: aws.Int32(2)})
	if err != nil {
		t.Fatal(err)
	}
	// This SDK leaves V1's url-encoded names to the caller; S3 encodes
	// them as form values.
	dec := func(s *string) string { d, _ := url.QueryUnescape(*s); return d }
	// Without a delimiter S3 sends no NextMarker: clients use the last key.
	if len(v1.Contents) != 2 || *v1.Contents[0].Key != "c" || *v1.Contents[1].Key != "d+e%2Bf" || dec(v1.Contents[1].Key) != "d e+f" || !*v1.IsTruncated || v1.NextMarker != nil {
		t.Fatalf("V1 listing %q %q truncated %v next %q", *v1.Contents[0].Key, *v1.Contents[1].Key, *v1.IsTruncated, aws.ToString(v1.NextMarker))
	}
	// With a delimiter, NextMarker is the last key or common prefix of the
	// page, and following it visits every entry once.
	var v1all, v1next []string
	marker := ""
	for range 10 {
		pg, err := e.s3.ListObjects(ctx, &s3.ListObjectsInput{Bucket: aws.String("list"), Delimiter: aws.String("/"), Marker: aws.String(marker), MaxKeys: aws.Int32(2)})
		if err != nil {
			t.Fatal(err)
		}
		var page []string
		for _, c := range pg.Contents {
			page = append(page, *c.Key)
		}
		for _, p := range pg.CommonPrefixes {
			page = append(page, *p.Prefix)
		}
		slices.Sort(page)
		v1all = append(v1all, page...)
		if !*pg.IsTruncated {
			if pg.NextMarker != nil {
				t.Fatalf("last V1 page has NextMarker %q", *pg.NextMarker)
			}
			break
		}
		if pg.NextMarker == nil || *pg.NextMarker != page[len(page)-1] {
			t.Fatalf("V1 page %v: NextMarker %q, want the last entry", page, aws.ToString(pg.NextMarker))
		}
		marker = *pg.NextMarker
		v1next = append(v1next, marker)
	}
	if want := []string{"a/", "b/", "c", "d e+f", "z/"}; !slices.Equal(v1all, want) || !slices.Equal(v1next, []string{"b/", "d e+f"}) {
		t.Fatalf("V1 delimiter pages %v (markers %v), want %v", v1all, v1next, want)
	}
	v1, _ = e.s3.ListObjects(ctx, &s3.ListObjectsInput{Bucket: aws.String("list"), Marker: aws.String("d e+f"), EncodingType: types.EncodingTypeUrl})
	if len(v1.Contents) != 1 || dec(v1.Contents[0].Key) != "z/\u00e9" || *v1.IsTruncated {
		t.Fatalf("V1 last page %+v", v1)
	}
	_, err = e.s3.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("nope-list")})
	wantCode(t, err, "NoSuchBucket", 404)
	_, err = e.s3.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("list"), ContinuationToken: aws.String("!!!")})
	wantCode(t, err, "InvalidArgument", 400)
}

func (e *env) testMultipart(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "mpu")
	src := randBytes(4, 1<<20)
	e.put(t, "mpu", "source", src)
	cr, err := e.s3.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String("mpu"), Key: aws.String("big"),
		ContentType: aws.String("video/test"), Metadata: map[string]string{"m": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	id := cr.UploadId
	p1 := randBytes(5, 5<<20)
	p3 := randBytes(6, 1000)
	up := func(n int32, b []byte) string {
		out, err := e.s3.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String("mpu"), Key: aws.String("big"), UploadId: id, PartNumber: aws.Int32(n), Body: bytes.NewReader(b)})
		if err != nil {
			t.Fatalf("upload part %d: %v", n, err)
		}
		if *out.ETag != `"`+md5hex(b)+`"` {
			t.Fatalf("part %d ETag %s", n, *out.ETag)
		}
		return *out.ETag
	}
	e1 := up(1, p1)
	up(3, randBytes(7, 10)) // replaced below
	e3 := up(3, p3)
	// Part 2: bytes 1000..5 MiB+999 of a 5 MiB+ source? The source is 1 MiB; copy a range of it.
	big := append(slices.Clone(p1), src...)
	e.put(t, "mpu", "source2", big)
	cp, err := e.s3.UploadPartCopy(ctx, &s3.UploadPartCopyInput{Bucket: aws.String("mpu"), Key: aws.String("big"), UploadId: id, PartNumber: aws.Int32(2),
		CopySource: aws.String("mpu/source2"), CopySourceRange: aws.String("bytes=1000-5243879")})
	if err != nil {
		t.Fatal(err)
	}
	p2 := big[1000:5243880]
	if *cp.CopyPartResult.ETag != `"`+md5hex(p2)+`"` {
		t.Fatalf("part copy ETag %s", *cp.CopyPartResult.ETag)
	}
	e2 := *cp.CopyPartResult.ETag
	lp, err := e.s3.ListParts(ctx, &s3.ListPartsInput{Bucket: aws.String("mpu"), Key: aws.String("big"), UploadId: id, MaxParts: aws.Int32(2)})
	if err != nil || len(lp.Parts) != 2 || !*lp.IsTruncated || *lp.NextPartNumberMarker != "2" || *lp.Parts[0].Size != 5<<20 {
		t.Fatalf("list parts %+v %v", lp, err)
	}
	lu, err := e.s3.ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: aws.String("mpu")})
	if err != nil || len(lu.Uploads) != 1 || *lu.Uploads[0].UploadId != *id || *lu.Uploads[0].Key != "big" {
		t.Fatalf("list uploads %+v %v", lu, err)
	}
	complete := func(parts ...types.CompletedPart) (*s3.CompleteMultipartUploadOutput, error) {
		return e.s3.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: aws.String("mpu"), Key: aws.String("big"), UploadId: id,
			MultipartUpload: &types.CompletedMultipartUpload{Parts: parts}})
	}
	part := func(n int32, etag string) types.CompletedPart {
		return types.CompletedPart{PartNumber: aws.Int32(n), ETag: aws.String(etag)}
	}
	_, err = complete(part(2, e2), part(1, e1))
	wantCode(t, err, "InvalidPartOrder", 400)
	_, err = complete(part(1, e1), part(2, e3))
	wantCode(t, err, "InvalidPart", 400)
	_, err = complete(part(1, e1), part(3, e3), part(4, e3))
	wantCode(t, err, "InvalidPart", 400)
	_, err = complete(part(3, e3), part(4, e3))
	wantCode(t, err, "InvalidPart", 400)
	// 1000-byte part 3 in the middle is too small.
	cr2, _ := e.s3.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String("mpu"), Key: aws.String("small")})
	for n := int32(1); n <= 2; n++ {
		if _, err := e.s3.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String("mpu"), Key: aws.String("small"), UploadId: cr2.UploadId, PartNumber: aws.Int32(n), Body: bytes.NewReader(p3)}); err != nil {
			t.Fatal(err)
		}
	}
	_, err = e.s3.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: aws.String("mpu"), Key: aws.String("small"), UploadId: cr2.UploadId,
		MultipartUpload: &types.CompletedMultipartUpload{Parts: []types.CompletedPart{part(1, `"`+md5hex(p3)+`"`), part(2, `"`+md5hex(p3)+`"`)}}})
	wantCode(t, err, "EntityTooSmall", 400)
	if _, err := e.s3.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: aws.String("mpu"), Key: aws.String("small"), UploadId: cr2.UploadId}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.ListParts(ctx, &s3.ListPartsInput{Bucket: aws.String("mpu"), Key: aws.String("small"), UploadId: cr2.UploadId})
	wantCode(t, err, "NoSuchUpload", 404)
	_, err = e.s3.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String("mpu"), Key: aws.String("small"), UploadId: cr2.UploadId, PartNumber: aws.Int32(1), Body: bytes.NewReader(p3)})
	wantCode(t, err, "NoSuchUpload", 404)

	out, err := complete(part(1, e1), part(2, e2), part(3, e3))
	if err != nil {
		t.Fatal(err)
	}
	h := md5.New()
	for _, p := range [][]byte{p1, p2, p3} {
		s := md5.Sum(p)
		h.Write(s[:])
	}
	wantETag := fmt.Sprintf(`"%x-3"`, h.Sum(nil))
	if *out.ETag != wantETag {
		t.Fatalf("multipart ETag %s, want %s", *out.ETag, wantETag)
	}
	whole := slices.Concat(p1, p2, p3)
	get, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("mpu"), Key: aws.String("big")})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(get.Body)
	get.Body.Close()
	if !bytes.Equal(b, whole) || *get.ETag != wantETag || *get.ContentType != "video/test" || get.Metadata["m"] != "1" {
		t.Fatalf("completed object: %d bytes (want %d), %+v", len(b), len(whole), get)
	}
	// A range across the part boundary.
	rg, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("mpu"), Key: aws.String("big"), Range: aws.String(fmt.Sprintf("bytes=%d-%d", 5<<20-10, 5<<20+9))})
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(rg.Body)
	rg.Body.Close()
	if !bytes.Equal(b, whole[5<<20-10:5<<20+10]) {
		t.Fatal("range across parts differs")
	}
	lu, _ = e.s3.ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: aws.String("mpu")})
	if len(lu.Uploads) != 0 {
		t.Fatalf("uploads left: %+v", lu.Uploads)
	}
	_, err = complete(part(1, e1))
	wantCode(t, err, "NoSuchUpload", 404)
}

// testDisconnect: a client that goes away mid-upload leaves no object.
func (e *env) testDisconnect(t *testing.T) {
	e.mkBucket(t, "disc")
	conn, err := net.Dial("tcp", e.gw.Addr())
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest("PUT", e.url+"/disc/partial", nil)
	r.ContentLength = 1 << 20
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
	var hdr bytes.Buffer
	fmt.Fprintf(&hdr, "PUT /disc/partial HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n", r.Host, 1<<20)
	for k, vs := range r.Header {
		fmt.Fprintf(&hdr, "%s: %s\r\n", k, vs[0])
	}
	hdr.WriteString("\r\n")
	conn.Write(hdr.Bytes())
	conn.Write(make([]byte, 300<<10))
	conn.Close()
	// The gateway notices the short body; wait until it answered the
	// request (its metrics count it), then check nothing is visible.
	deadline := time.Now().Add(20 * time.Second)
	for testutil.ToFloat64(e.counter("PutObject", "IncompleteBody")) < 1 {
		if time.Now().After(deadline) {
			t.Fatal("gateway did not finish the abandoned upload")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, err = e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("disc"), Key: aws.String("partial")})
	wantCode(t, err, "", 404)
}

func (e *env) counter(op, code string) prometheus.Collector {
	mfs, _ := e.reg.Gather()
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != "basalt_s3_requests_total" {
			continue
		}
		for _, m := range mf.Metric {
			var gotOp, gotCode string
			for _, l := range m.Label {
				switch l.GetName() {
				case "op":
					gotOp = l.GetValue()
				case "code":
					gotCode = l.GetValue()
				}
			}
			if gotOp == op && gotCode == code {
				v = m.GetCounter().GetValue()
			}
		}
	}
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "x"}, func() float64 { return v })
}

func (e *env) testVirtualHost(t *testing.T) {
	ctx := e.ctx
	if _, err := e.vhost.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("vhost")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.vhost.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("vhost"), Key: aws.String("a/b.txt"), Body: strings.NewReader("virtual")}); err != nil {
		t.Fatal(err)
	}
	// Path style sees the same object.
	if b := e.get(t, "vhost", "a/b.txt"); string(b) != "virtual" {
		t.Fatalf("vhost object via path style: %q", b)
	}
	out, err := e.vhost.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: aws.String("vhost")})
	if err != nil || len(out.Contents) != 1 || *out.Contents[0].Key != "a/b.txt" {
		t.Fatalf("vhost list %+v %v", out, err)
	}
}

func (e *env) testMetrics(t *testing.T) {
	if v := testutil.ToFloat64(e.counter("PutObject", "OK")); v < 10 {
		t.Fatalf("PutObject OK count %v", v)
	}
	n, err := testutil.GatherAndCount(e.reg, "basalt_s3_stage_duration_seconds")
	if err != nil || n == 0 {
		t.Fatalf("stage metrics: %d %v", n, err)
	}
	mfs, _ := e.reg.Gather()
	stages := map[string]bool{}
	// Observations of the body's sub-stages by op and stage.
	sub := map[[2]string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() == "basalt_s3_stage_duration_seconds" {
			for _, m := range mf.Metric {
				var op, stage string
				for _, l := range m.Label {
					switch l.GetName() {
					case "stage":
						stage = l.GetValue()
					case "op":
						op = l.GetValue()
					}
				}
				stages[stage] = true
				sub[[2]string{op, stage}] += m.GetHistogram().GetSampleCount()
			}
		}
	}
	if !stages["auth"] || !stages["meta"] || !stages["data"] {
		t.Fatalf("stages recorded: %v", stages)
	}
	// data_body/data_hashwait/data_tail: recorded for every successful
	// PutObject and UploadPart with a body, never for failed ones (the
	// Checksums and Disconnect cases above failed some).
	for _, op := range []string{"PutObject", "UploadPart"} {
		ok := uint64(testutil.ToFloat64(e.counter(op, "OK")))
		for _, st := range []string{"data_body", "data_hashwait", "data_tail"} {
			if n := sub[[2]string{op, st}]; n == 0 || n > ok {
				t.Errorf("%s %s: %d observations, %d successful requests: want 1..%d", op, st, n, ok, ok)
			}
		}
	}
}
