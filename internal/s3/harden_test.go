package s3_test

import (
	"bytes"
	"errors"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/prometheus/client_golang/prometheus"

	bs3 "github.com/basalt-store/basalt/internal/s3"
)

// Region checks, typed not-found errors and the upload slots, on one
// cluster of their own.
func TestGatewayHardening(t *testing.T) {
	e := setup(t)
	t.Run("Region", e.testRegion)
	t.Run("ErrorKinds", e.testErrorKinds)
	t.Run("UploadSlots", e.testUploadSlots)
	t.Run("SlowDown", e.testSlowDown)
}

func (e *env) sdk(endpoint, region string) *s3.Client {
	return s3.New(s3.Options{Region: region, BaseEndpoint: aws.String(endpoint), UsePathStyle: true, RetryMaxAttempts: 1,
		Credentials: credentials.NewStaticCredentialsProvider(accessKey, secretKey, "")})
}

func wantMessage(t *testing.T, err error, sub string) {
	t.Helper()
	var ae smithy.APIError
	if !errors.As(err, &ae) || !strings.Contains(ae.ErrorMessage(), sub) {
		t.Fatalf("error %v: want a message with %q", err, sub)
	}
}

func (e *env) testRegion(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "region")
	// A client configured for another region: refused with the region to
	// use, before any signature or secret check.
	eu := e.sdk(e.url, "eu-west-1")
	_, err := eu.ListBuckets(ctx, &s3.ListBucketsInput{})
	wantCode(t, err, "AuthorizationHeaderMalformed", 400)
	wantMessage(t, err, "the region 'eu-west-1' is wrong; expecting 'us-east-1'")
	_, err = eu.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("region"), Key: aws.String("k")})
	wantCode(t, err, "AuthorizationHeaderMalformed", 400)
	// Presigned URLs too.
	ps, err := s3.NewPresignClient(eu).PresignGetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("region"), Key: aws.String("k")})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(ps.URL)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	body := html.UnescapeString(string(raw))
	if resp.StatusCode != 400 || !strings.Contains(body, "AuthorizationQueryParametersError") ||
		!strings.Contains(body, "the region 'eu-west-1' is wrong; expecting 'us-east-1'") || !strings.Contains(body, "<Region>us-east-1</Region>") {
		t.Fatalf("presigned for eu-west-1: %d %s", resp.StatusCode, body)
	}

	// A gateway in another region: GetBucketLocation, HeadBucket and
	// CreateBucket's constraint agree with it.
	gw, err := bs3.New(bs3.Config{Client: e.cl, Listen: "127.0.0.1:0", Region: "eu-central-1"})
	if err != nil {
		t.Fatal(err)
	}
	go gw.Serve()
	defer gw.Close()
	url := "http://" + gw.Addr()
	fra := e.sdk(url, "eu-central-1")
	if _, err := fra.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("region-fra"),
		CreateBucketConfiguration: &types.CreateBucketConfiguration{LocationConstraint: types.BucketLocationConstraintEuCentral1}}); err != nil {
		t.Fatal(err)
	}
	loc, err := fra.GetBucketLocation(ctx, &s3.GetBucketLocationInput{Bucket: aws.String("region-fra")})
	if err != nil || loc.LocationConstraint != types.BucketLocationConstraintEuCentral1 {
		t.Fatalf("location %+v %v", loc, err)
	}
	hb, err := fra.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: aws.String("region-fra")})
	if err != nil || aws.ToString(hb.BucketRegion) != "eu-central-1" {
		t.Fatalf("head bucket %+v %v", hb, err)
	}
	_, err = fra.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("region-dub"),
		CreateBucketConfiguration: &types.CreateBucketConfiguration{LocationConstraint: types.BucketLocationConstraintEuWest1}})
	wantCode(t, err, "IllegalLocationConstraintException", 400)
	if _, err := fra.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: aws.String("region-dub")}); err == nil {
		t.Fatal("a refused CreateBucket made the bucket")
	}
	_, err = e.sdk(url, "us-east-1").ListBuckets(ctx, &s3.ListBucketsInput{})
	wantCode(t, err, "AuthorizationHeaderMalformed", 400)
	wantMessage(t, err, "the region 'us-east-1' is wrong; expecting 'eu-central-1'")
	// The default gateway still reports us-east-1 as S3 does: empty.
	loc, err = e.s3.GetBucketLocation(ctx, &s3.GetBucketLocationInput{Bucket: aws.String("region")})
	if err != nil || loc.LocationConstraint != "" {
		t.Fatalf("us-east-1 location %+v %v", loc, err)
	}
}

// testErrorKinds: the gateway tells a missing bucket from a missing key or
// upload by the error's kind, whatever the names say.
func (e *env) testErrorKinds(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "key")
	e.put(t, "key", "present", []byte("x"))
	_, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("no-such-bucket-key"), Key: aws.String("key volume")})
	wantCode(t, err, "NoSuchBucket", 404)
	// The message of a missing key named like this once read as a missing
	// upload to a gateway that matched message text.
	_, err = e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("key"), Key: aws.String("upload bucket volume")})
	wantCode(t, err, "NoSuchKey", 404)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("no-such-bucket-key"), Key: aws.String("k"), Body: strings.NewReader("x")})
	wantCode(t, err, "NoSuchBucket", 404)
	_, err = e.s3.PutObjectTagging(ctx, &s3.PutObjectTaggingInput{Bucket: aws.String("key"), Key: aws.String("bucket"),
		Tagging: &types.Tagging{TagSet: []types.Tag{{Key: aws.String("a"), Value: aws.String("b")}}}})
	wantCode(t, err, "NoSuchKey", 404)
	_, err = e.s3.ListParts(ctx, &s3.ListPartsInput{Bucket: aws.String("key"), Key: aws.String("present"), UploadId: aws.String("1-nope")})
	wantCode(t, err, "NoSuchUpload", 404)
	// A part for a missing upload fails at the commit, through the client.
	_, err = e.s3.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String("key"), Key: aws.String("present"), UploadId: aws.String("1-nope"),
		PartNumber: aws.Int32(1), Body: strings.NewReader("part")})
	wantCode(t, err, "NoSuchUpload", 404)
}

// gauge reads a gauge from a registry.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.Metric[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func waitUntil(t *testing.T, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// slowUpload is a PUT served in-process whose body the test feeds through
// a pipe, so that it knows whether the gateway has read any of it.
type slowUpload struct {
	key  string
	data []byte
	pw   *io.PipeWriter
	once sync.Once
	read chan struct{} // closed at the gateway's first read of the body
	done chan *httptest.ResponseRecorder
}

type firstRead struct {
	r io.Reader
	u *slowUpload
}

func (f *firstRead) Read(p []byte) (int, error) {
	f.u.once.Do(func() { close(f.u.read) })
	return f.r.Read(p)
}

func (u *slowUpload) wasRead() bool {
	select {
	case <-u.read:
		return true
	default:
		return false
	}
}

// finish sends the body and returns the response.
func (u *slowUpload) finish() *httptest.ResponseRecorder {
	go func() {
		u.pw.Write(u.data)
		u.pw.Close()
	}()
	return <-u.done
}

func (e *env) startUpload(t *testing.T, h http.Handler, bucket, key string, data []byte) *slowUpload {
	t.Helper()
	pr, pw := io.Pipe()
	u := &slowUpload{key: key, data: data, pw: pw, read: make(chan struct{}), done: make(chan *httptest.ResponseRecorder, 1)}
	r := httptest.NewRequest("PUT", "http://gateway.test/"+bucket+"/"+key, &firstRead{r: pr, u: u})
	r.ContentLength = int64(len(data))
	e.sign(t, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
	go func() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		u.done <- w
	}()
	return u
}

// testUploadSlots: with MaxUploads uploads in progress, more wait without
// reading their bodies, and one starts as soon as a slot frees.
func (e *env) testUploadSlots(t *testing.T) {
	const slots = 2
	e.mkBucket(t, "slots")
	reg := prometheus.NewRegistry()
	// No listener: the test calls ServeHTTP, so every body read is the
	// gateway's (no socket buffer in between).
	gw, err := bs3.New(bs3.Config{Client: e.cl, MaxUploads: slots, UploadWait: time.Minute, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer gw.Close()
	inFlight := func() float64 { return gauge(t, reg, "basalt_s3_uploads_in_flight") }
	waiting := func() float64 { return gauge(t, reg, "basalt_s3_uploads_waiting") }

	const n = 5
	ups := make([]*slowUpload, n)
	for i := range ups {
		ups[i] = e.startUpload(t, gw, "slots", "k"+string(rune('0'+i)), randBytes(int64(i), 300<<10))
	}
	reading := func() []*slowUpload {
		var out []*slowUpload
		for _, u := range ups {
			if u != nil && u.wasRead() {
				out = append(out, u)
			}
		}
		return out
	}
	waitUntil(t, "the slots taken and the rest waiting", func() bool {
		return inFlight() == slots && waiting() == n-slots && len(reading()) == slots
	})
	// Bucket operations are not uploads: they do not wait.
	if _, err := e.s3.CreateBucket(e.ctx, &s3.CreateBucketInput{Bucket: aws.String("slots-other")}); err != nil {
		t.Fatal(err)
	}
	finished := 0
	for finished < n {
		r := reading()
		if len(r) != slots && n-finished >= slots {
			t.Fatalf("%d bodies being read with %d slots", len(r), slots)
		}
		if got := inFlight(); got > slots {
			t.Fatalf("%v uploads in flight, MaxUploads %d", got, slots)
		}
		u := r[0]
		if w := u.finish(); w.Code != 200 {
			t.Fatalf("upload %s: %d %s", u.key, w.Code, w.Body)
		}
		for i := range ups {
			if ups[i] == u {
				ups[i] = nil
			}
		}
		finished++
		left := n - finished
		// The freed slot goes to a waiter, which starts reading.
		waitUntil(t, "a waiter to take the freed slot", func() bool {
			return int(inFlight()) == min(slots, left) && int(waiting()) == max(left-slots, 0) && len(reading()) == min(slots, left)
		})
	}
	for i := range n {
		key := "k" + string(rune('0'+i))
		if got := e.get(t, "slots", key); !bytes.Equal(got, randBytes(int64(i), 300<<10)) {
			t.Fatalf("%s: wrong bytes", key)
		}
	}
}

// testSlowDown: an upload that finds every slot busy past UploadWait gets
// SlowDown (503) without the gateway reading its body.
func (e *env) testSlowDown(t *testing.T) {
	e.mkBucket(t, "slow")
	reg := prometheus.NewRegistry()
	gw, err := bs3.New(bs3.Config{Client: e.cl, MaxUploads: 1, UploadWait: 200 * time.Millisecond, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer gw.Close()
	holder := e.startUpload(t, gw, "slow", "holder", []byte("holding the only slot"))
	waitUntil(t, "the slot taken", func() bool { return gauge(t, reg, "basalt_s3_uploads_in_flight") == 1 })
	late := e.startUpload(t, gw, "slow", "late", []byte("too late"))
	var w *httptest.ResponseRecorder
	select {
	case w = <-late.done:
	case <-time.After(20 * time.Second):
		t.Fatal("an upload waited for a slot far past UploadWait")
	}
	if w.Code != 503 || !strings.Contains(w.Body.String(), "<Code>SlowDown</Code>") {
		t.Fatalf("upload past the wait: %d %s", w.Code, w.Body)
	}
	if late.wasRead() {
		t.Fatal("the gateway read the body of a request it refused")
	}
	if w := holder.finish(); w.Code != 200 {
		t.Fatalf("holder: %d %s", w.Code, w.Body)
	}
	// With the slot free, the retry goes through.
	if w := e.startUpload(t, gw, "slow", "late", []byte("retried")).finish(); w.Code != 200 {
		t.Fatalf("retry: %d %s", w.Code, w.Body)
	}
	if got := e.get(t, "slow", "late"); string(got) != "retried" {
		t.Fatalf("late = %q", got)
	}
	if g := gauge(t, reg, "basalt_s3_uploads_in_flight"); g != 0 {
		t.Fatalf("in flight after all finished: %v", g)
	}
}
