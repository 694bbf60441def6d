package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/middleware"
	"github.com/spf13/cobra"
)

// benchS3Cmd measures any S3 server with the workloads of MinIO's warp
// (put, get, stat), through the AWS SDK for Go v2, so the figures compare
// with other servers measured the same way.
func benchS3Cmd(o *benchOpts, f *connFlags) *cobra.Command {
	s := &s3BenchOpts{bench: o, conn: f}
	root := &cobra.Command{
		Use:   "s3",
		Short: "S3 load (MinIO warp's put/get/stat) against any S3 endpoint, through the AWS SDK for Go v2",
		Long: `S3 load generator with the workloads of MinIO's warp. Runs for --duration
with -t concurrent clients (warp's --concurrent), then deletes what it wrote
(unless --keep). get and stat first upload -n objects (default: enough to
cycle through, at most 4 GiB or 2,500 objects) and then read them in random
order. Credentials come from --access-key/--secret-key or AWS_ACCESS_KEY_ID/
AWS_SECRET_ACCESS_KEY.

Payloads: --payload unsigned (UNSIGNED-PAYLOAD; integrity by --checksum, what
current SDKs do) or signed (the SHA-256 of the whole body in the signature).

Examples (the workloads of the S3 issue, against basalt dev):
  export AWS_ACCESS_KEY_ID=basalt-dev AWS_SECRET_ACCESS_KEY=<printed by basalt dev>
  basalt bench s3 put  --size 128MiB -t 1  --duration 60s
  basalt bench s3 put  --size 128MiB -t 3  --duration 60s
  basalt bench s3 get  --size 128MiB -t 1  --duration 60s
  basalt bench s3 put  --size 4KiB   -t 32 --duration 30s
  basalt bench s3 stat --size 4KiB   -t 64 --duration 30s
` + exitCodesHelp,
	}
	pf := root.PersistentFlags()
	pf.StringVar(&s.endpoint, "endpoint", "http://127.0.0.1:9878", "S3 endpoint URL")
	pf.StringVar(&s.accessKey, "access-key", "", "access key ID (default $AWS_ACCESS_KEY_ID)")
	pf.StringVar(&s.secretKey, "secret-key", "", "secret access key (default $AWS_SECRET_ACCESS_KEY)")
	pf.StringVar(&s.region, "region", "us-east-1", "region to sign for")
	pf.DurationVar(&s.duration, "duration", 30*time.Second, "how long the measured phase runs")
	pf.StringVar(&s.payload, "payload", "unsigned", "unsigned or signed (SHA-256 of the body in the signature)")
	pf.StringVar(&s.checksum, "checksum", "crc32c", "request checksum: crc32c, crc32, sha256 or none")
	pf.BoolVar(&s.keep, "keep", false, "keep the objects written instead of deleting them at the end")
	pf.BoolVar(&s.virtualHost, "virtual-host", false, "virtual-host-style addressing (default path-style)")
	pf.StringVar(&s.cpuProfile, "cpuprofile", "", "write this process's CPU profile of the measured phase to FILE")
	pf.BoolVar(&s.lean, "lean", false, "stat: send each HeadObject as a hand-signed SigV4 HEAD over net/http instead of through the AWS SDK (a much cheaper load generator; the gateway verifies the signatures in full)")
	for _, op := range []string{"put", "get", "stat"} {
		root.AddCommand(&cobra.Command{
			Use:   op,
			Short: map[string]string{"put": "PutObject new objects", "get": "GetObject prepared objects in random order", "stat": "HeadObject prepared objects in random order"}[op],
			RunE: runE(func(cmd *cobra.Command, args []string) error {
				if err := exactArgs(args, 0, "none; use flags"); err != nil {
					return err
				}
				return s.run(cmd, op)
			}),
		})
	}
	return root
}

type s3BenchOpts struct {
	bench                                  *benchOpts
	conn                                   *connFlags
	endpoint, accessKey, secretKey, region string
	payload, checksum                      string
	duration                               time.Duration
	keep, virtualHost, lean                bool
	cpuProfile                             string
}

// s3BenchResult is one phase of an S3 benchmark.
type s3BenchResult struct {
	Op          string  `json:"op"`
	Endpoint    string  `json:"endpoint"`
	Concurrent  int     `json:"concurrent"`
	ObjectSize  int64   `json:"object_size"`
	Ops         int     `json:"ops"`
	Errors      int     `json:"errors"`
	Bytes       int64   `json:"bytes"`
	Seconds     float64 `json:"seconds"`
	MiBPerSec   float64 `json:"mib_per_sec"`
	OpsPerSec   float64 `json:"ops_per_sec"`
	P50Ms       float64 `json:"p50_ms"`
	P90Ms       float64 `json:"p90_ms"`
	P99Ms       float64 `json:"p99_ms"`
	MaxMs       float64 `json:"max_ms"`
	TTFBP50Ms   float64 `json:"ttfb_p50_ms,omitempty"`
	ServerCPUs  float64 `json:"server_cpu_seconds,omitempty"`
	CPUsPerGiB  float64 `json:"server_cpu_seconds_per_gib,omitempty"`
	CPUmsPerOp  float64 `json:"server_cpu_ms_per_op,omitempty"`
	ClientCPUs  float64 `json:"client_cpu_seconds"` // this process: the SDK's share of a shared machine
	FirstError  string  `json:"first_error,omitempty"`
	Payload     string  `json:"payload,omitempty"`
	Checksum    string  `json:"checksum,omitempty"`
	PreparedObj int     `json:"prepared_objects,omitempty"`
}

// Limits on what one run may create: a benchmark is a tool, not a way to
// fill a cluster by accident.
const (
	maxS3BenchLatencies = 20_000_000
	maxS3PrepareBytes   = 4 << 30
	maxS3PrepareObjects = 2500
	s3DeleteBatch       = 1000
)

func (s *s3BenchOpts) run(cmd *cobra.Command, op string) error {
	o := s.bench
	size, err := parseSize(o.sizeStr)
	if err != nil {
		return usagef("--size: %v", err)
	}
	if o.threads < 1 || o.threads > maxBenchThreads {
		return usagef("-t %d: want 1..%d", o.threads, maxBenchThreads)
	}
	if s.duration <= 0 || s.duration > 24*time.Hour {
		return usagef("--duration %v: want a positive duration up to 24h", s.duration)
	}
	var algo types.ChecksumAlgorithm
	switch s.checksum {
	case "crc32c":
		algo = types.ChecksumAlgorithmCrc32c
	case "crc32":
		algo = types.ChecksumAlgorithmCrc32
	case "sha256":
		algo = types.ChecksumAlgorithmSha256
	case "none":
	default:
		return usagef("--checksum %q: want crc32c, crc32, sha256 or none", s.checksum)
	}
	if s.payload != "unsigned" && s.payload != "signed" {
		return usagef("--payload %q: want unsigned or signed", s.payload)
	}
	if s.accessKey == "" {
		s.accessKey = os.Getenv("AWS_ACCESS_KEY_ID")
	}
	if s.secretKey == "" {
		s.secretKey = os.Getenv("AWS_SECRET_ACCESS_KEY")
	}
	if s.accessKey == "" || s.secretKey == "" {
		return usagef("no credentials: pass --access-key and --secret-key or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (basalt dev prints a pair)")
	}
	if !strings.HasPrefix(s.endpoint, "http://") && !strings.HasPrefix(s.endpoint, "https://") {
		return usagef("--endpoint %q: want an http:// or https:// URL", s.endpoint)
	}
	pids, err := parsePIDs(o.pids)
	if err != nil {
		return usagef("--server-pid: %v", err)
	}
	ctx := cmd.Context()
	if ctx == nil {
		ctx = context.Background()
	}
	cl := s.client(o.threads)
	var lean *leanS3
	if s.lean {
		if op != "stat" || s.virtualHost {
			return usagef("--lean: only with stat and path-style addressing")
		}
		if lean, err = newLeanS3(s.endpoint, s.accessKey, s.secretKey, s.region, o.threads); err != nil {
			return usagef("--endpoint: %v", err)
		}
	}
	bucket := o.bucket
	if err := s3EnsureBucket(ctx, cl, bucket); err != nil {
		return err
	}
	// A run's objects live under their own prefix so runs never collide
	// and cleanup deletes exactly what this run wrote.
	runPrefix := fmt.Sprintf("%s%x/", o.prefix, time.Now().UnixNano())
	pat := newPattern()
	showBar := o.progress || isTerminal(os.Stderr)

	put := func(ctx context.Context, key string, seed int) error {
		in := &s3.PutObjectInput{Bucket: &bucket, Key: &key, Body: newPatternSeeker(pat, seed, size), ContentLength: aws.Int64(size)}
		if algo != "" {
			in.ChecksumAlgorithm = algo
		}
		_, err := cl.PutObject(ctx, in)
		return err
	}

	var written []string // keys to delete at the end
	var writtenMu sync.Mutex
	defer func() {
		if s.keep || len(written) == 0 {
			return
		}
		if err := s3DeleteAll(context.WithoutCancel(ctx), cl, bucket, written, showBar); err != nil {
			fmt.Fprintln(os.Stderr, "basalt: cleanup:", err)
		}
	}()

	// Prepare the objects get and stat read.
	var prepared []string
	if op != "put" {
		n := o.keys
		if !cmd.Flags().Changed("keys") {
			n = max(4*o.threads, int(min(int64(maxS3PrepareObjects), maxS3PrepareBytes/max(size, 1))))
		}
		if n < 1 || int64(n)*size > 64<<30 {
			return usagef("-n %d objects of %s: want 1 or more, at most 64 GiB in all", n, fmtBytes(uint64(size)))
		}
		prepared = make([]string, n)
		for i := range prepared {
			prepared[i] = fmt.Sprintf("%sprep-%08d", runPrefix, i)
		}
		written = append(written, prepared...)
		res := runPhase("prepare", n, o.threads, newProgress(showBar, "prepare", int64(n)*size, "bytes"), false, func(i int) (int64, error) {
			return size, put(ctx, prepared[i], i)
		})
		if res.Errors > 0 {
			return fmt.Errorf("bench s3 %s: preparing %d objects: %d errors (first: %s)", op, n, res.Errors, res.FirstError)
		}
	}

	cpu0, err := cpuSeconds(pids)
	if err != nil {
		return err
	}
	if s.cpuProfile != "" {
		f, err := os.Create(s.cpuProfile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer f.Close()
		defer pprof.StopCPUProfile()
	}
	self0 := selfCPUSeconds()
	maxOps := 0
	if op == "put" && cmd.Flags().Changed("keys") {
		maxOps = o.keys
	}
	unit := "bytes"
	if op == "stat" || size < 1<<20 {
		unit = "ops"
	}
	bar := newProgress(showBar, op, -1, unit)
	var putSeq atomic.Int64
	res := runTimed(ctx, s.duration, maxOps, o.threads, bar, unit == "ops", func(ctx context.Context, worker int, rng *rand.Rand) (int64, time.Duration, error) {
		switch op {
		case "put":
			i := int(putSeq.Add(1) - 1)
			key := fmt.Sprintf("%s%03d/%08d", runPrefix, worker, i)
			err := put(ctx, key, i)
			if err == nil || !isCanceled(err) {
				writtenMu.Lock()
				written = append(written, key)
				writtenMu.Unlock()
			}
			if err != nil {
				return 0, 0, err
			}
			return size, 0, nil
		case "get":
			key := prepared[rng.IntN(len(prepared))]
			t0 := time.Now()
			out, err := cl.GetObject(ctx, &s3.GetObjectInput{Bucket: &bucket, Key: &key})
			if err != nil {
				return 0, 0, err
			}
			ttfb := time.Since(t0)
			n, err := io.Copy(io.Discard, out.Body)
			out.Body.Close()
			if err == nil && n != size {
				err = fmt.Errorf("GET %s: %d bytes, want %d", key, n, size)
			}
			return n, ttfb, err
		default: // stat
			key := prepared[rng.IntN(len(prepared))]
			if lean != nil {
				n, err := lean.head(ctx, bucket, key)
				if err == nil && n != size {
					err = fmt.Errorf("HEAD %s: Content-Length %d, want %d", key, n, size)
				}
				return 0, 0, err
			}
			out, err := cl.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &bucket, Key: &key})
			if err != nil {
				return 0, 0, err
			}
			if aws.ToInt64(out.ContentLength) != size {
				return 0, 0, fmt.Errorf("HEAD %s: Content-Length %d, want %d", key, aws.ToInt64(out.ContentLength), size)
			}
			return 0, 0, nil
		}
	})
	res.ClientCPUs = selfCPUSeconds() - self0
	res.Op, res.Endpoint, res.Concurrent, res.ObjectSize = op, s.endpoint, o.threads, size
	res.PreparedObj = len(prepared)
	if op == "put" {
		res.Payload, res.Checksum = s.payload, s.checksum
	}
	if len(pids) > 0 {
		if cpu1, err := cpuSeconds(pids); err == nil {
			res.ServerCPUs = cpu1 - cpu0
			if res.Bytes >= 1<<20 {
				res.CPUsPerGiB = res.ServerCPUs / (float64(res.Bytes) / (1 << 30))
			}
			if res.Ops > 0 {
				res.CPUmsPerOp = res.ServerCPUs * 1000 / float64(res.Ops)
			}
		} else {
			fmt.Fprintln(os.Stderr, "basalt: server CPU:", err)
		}
	}
	if err := s.print(cmd, res); err != nil {
		return err
	}
	if res.Errors > 0 {
		return fmt.Errorf("bench s3 %s: %d of %d operations failed (first error: %s)", op, res.Errors, res.Ops, res.FirstError)
	}
	return nil
}

func (s *s3BenchOpts) print(cmd *cobra.Command, r s3BenchResult) error {
	if s.conn.json {
		return printJSON(cmd.OutOrStdout(), []s3BenchResult{r})
	}
	t := newTable(cmd.OutOrStdout(), "OP", "SIZE", "CONC", "OPS", "ERRORS", "SECONDS", "MiB/s", "OPS/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "TTFB p50", "SERVER CPU-s", "CPU-ms/op", "CLIENT CPU-s")
	f := func(v float64, format string) string {
		if v <= 0 {
			return "-"
		}
		return fmt.Sprintf(format, v)
	}
	t.row(r.Op, fmtBytes(uint64(r.ObjectSize)), r.Concurrent, r.Ops, r.Errors, fmt.Sprintf("%.2f", r.Seconds), fmt.Sprintf("%.1f", r.MiBPerSec), fmt.Sprintf("%.1f", r.OpsPerSec),
		fmt.Sprintf("%.2f", r.P50Ms), fmt.Sprintf("%.2f", r.P90Ms), fmt.Sprintf("%.2f", r.P99Ms), fmt.Sprintf("%.2f", r.MaxMs), f(r.TTFBP50Ms, "%.2f"), f(r.ServerCPUs, "%.2f"), f(r.CPUmsPerOp, "%.3f"), f(r.ClientCPUs, "%.2f"))
	return t.flush()
}

// client builds an SDK client with a connection pool sized for the
// concurrency (the SDK's default keeps too few idle connections per host,
// which would measure connection setup, not the server).
func (s *s3BenchOpts) client(conc int) *s3.Client {
	tr := &http.Transport{
		Proxy:               nil, // loopback benchmarks must not detour through a proxy
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        conc * 2,
		MaxIdleConnsPerHost: conc * 2,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		WriteBufferSize:     256 << 10,
		ReadBufferSize:      256 << 10,
	}
	opts := s3.Options{
		Region:                     s.region,
		BaseEndpoint:               aws.String(s.endpoint),
		UsePathStyle:               !s.virtualHost,
		HTTPClient:                 &http.Client{Transport: tr},
		Credentials:                credentials.NewStaticCredentialsProvider(s.accessKey, s.secretKey, ""),
		RetryMaxAttempts:           1, // a benchmark reports failures, it does not hide them
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
	}
	if s.payload == "unsigned" {
		// The SDK's checksum step would hash the body with SHA-256 as
		// well unless the payload hash is already decided when it runs.
		opts.APIOptions = append(opts.APIOptions, v4.SwapComputePayloadSHA256ForUnsignedPayloadMiddleware, func(st *middleware.Stack) error {
			return st.Finalize.Add(middleware.FinalizeMiddlewareFunc("BasaltBenchUnsignedPayload",
				func(ctx context.Context, in middleware.FinalizeInput, next middleware.FinalizeHandler) (middleware.FinalizeOutput, middleware.Metadata, error) {
					return next.HandleFinalize(v4.SetPayloadHash(ctx, "UNSIGNED-PAYLOAD"), in)
				}), middleware.Before)
		})
	}
	return s3.New(opts)
}

func s3EnsureBucket(ctx context.Context, cl *s3.Client, bucket string) error {
	_, err := cl.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: &bucket})
	var ae smithy.APIError
	if err == nil || errors.As(err, &ae) && (ae.ErrorCode() == "BucketAlreadyOwnedByYou" || ae.ErrorCode() == "BucketAlreadyExists") {
		return nil
	}
	return fmt.Errorf("creating bucket %q: %w", bucket, err)
}

// s3DeleteAll deletes keys with DeleteObjects, 1,000 at a time.
func s3DeleteAll(ctx context.Context, cl *s3.Client, bucket string, keys []string, showBar bool) error {
	batches := (len(keys) + s3DeleteBatch - 1) / s3DeleteBatch
	res := runPhase("cleanup", batches, 4, newProgress(showBar, "cleanup", int64(len(keys)), "ops"), false, func(b int) (int64, error) {
		part := keys[b*s3DeleteBatch : min(len(keys), (b+1)*s3DeleteBatch)]
		ids := make([]types.ObjectIdentifier, len(part))
		for i := range part {
			ids[i] = types.ObjectIdentifier{Key: &part[i]}
		}
		out, err := cl.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: &bucket, Delete: &types.Delete{Objects: ids, Quiet: aws.Bool(true)}})
		if err != nil {
			return 0, err
		}
		if len(out.Errors) > 0 {
			e := out.Errors[0]
			return 0, fmt.Errorf("%d keys not deleted, first %s: %s", len(out.Errors), aws.ToString(e.Key), aws.ToString(e.Message))
		}
		return int64(len(part)), nil
	})
	if res.Errors > 0 {
		return fmt.Errorf("%d of %d delete batches failed (first: %s)", res.Errors, batches, res.FirstError)
	}
	return nil
}

func isCanceled(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// runTimed runs op on conc workers until d has passed (or maxOps ops have
// started, if maxOps > 0). Operations cut off by the deadline are neither
// counted nor errors; latencies are kept up to a bound.
func runTimed(ctx context.Context, d time.Duration, maxOps, conc int, bar *progress, countOps bool,
	op func(ctx context.Context, worker int, rng *rand.Rand) (bytes int64, ttfb time.Duration, err error)) s3BenchResult {
	type workerStats struct {
		lat, ttfb []time.Duration
		ops, errs int
		bytes     int64
		firstErr  string
	}
	stats := make([]workerStats, conc)
	// Operations in flight at the deadline finish (a benchmark must not
	// report aborted uploads as errors); they count when they started
	// before it. The hard context bounds a stuck server.
	hard, cancel := context.WithTimeout(ctx, d+2*time.Minute)
	defer cancel()
	var started atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for w := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := &stats[w]
			rng := rand.New(rand.NewPCG(uint64(w), uint64(start.UnixNano())))
			for time.Now().Before(deadline) && hard.Err() == nil {
				if maxOps > 0 && started.Add(1) > int64(maxOps) {
					return
				}
				t0 := time.Now()
				n, ttfb, err := op(hard, w, rng)
				el := time.Since(t0)
				if err != nil && hard.Err() != nil && isCanceled(err) {
					return
				}
				st.ops++
				st.bytes += n
				if len(st.lat) < maxS3BenchLatencies/conc {
					st.lat = append(st.lat, el)
					if ttfb > 0 {
						st.ttfb = append(st.ttfb, ttfb)
					}
				}
				if err != nil {
					st.errs++
					if st.firstErr == "" {
						st.firstErr = err.Error()
					}
				}
				if countOps {
					bar.add(1)
				} else {
					bar.add(n)
				}
			}
		}()
	}
	wg.Wait()
	bar.finish()
	el := time.Since(start).Seconds()
	var r s3BenchResult
	var lat, ttfb []time.Duration
	for _, st := range stats {
		r.Ops += st.ops
		r.Errors += st.errs
		r.Bytes += st.bytes
		lat = append(lat, st.lat...)
		ttfb = append(ttfb, st.ttfb...)
		if r.FirstError == "" {
			r.FirstError = st.firstErr
		}
	}
	r.Seconds = el
	if el > 0 {
		r.MiBPerSec = float64(r.Bytes) / (1 << 20) / el
		r.OpsPerSec = float64(r.Ops) / el
	}
	pct := percentileMs
	slices.Sort(lat)
	slices.Sort(ttfb)
	r.P50Ms, r.P90Ms, r.P99Ms = pct(lat, 0.5), pct(lat, 0.9), pct(lat, 0.99)
	if len(lat) > 0 {
		r.MaxMs = float64(lat[len(lat)-1]) / 1e6
	}
	r.TTFBP50Ms = pct(ttfb, 0.5)
	return r
}

// patternSeeker is the bench data pattern as an io.ReadSeeker, so the SDK
// can compute a checksum or payload hash and rewind instead of buffering.
type patternSeeker struct {
	p         []byte
	base, pos int64
	size      int64
}

func newPatternSeeker(p *pattern, key int, size int64) *patternSeeker {
	return &patternSeeker{p: p.buf, base: (int64(key) * 1_000_003) % int64(len(p.buf)), size: size}
}

func (r *patternSeeker) Read(b []byte) (int, error) {
	if r.pos >= r.size {
		return 0, io.EOF
	}
	n := 0
	for n < len(b) && r.pos < r.size {
		off := (r.base + r.pos) % int64(len(r.p))
		c := copy(b[n:min(int64(len(b)), int64(n)+r.size-r.pos)], r.p[off:])
		n += c
		r.pos += int64(c)
	}
	return n, nil
}

func (r *patternSeeker) Seek(off int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
	case io.SeekCurrent:
		off += r.pos
	case io.SeekEnd:
		off += r.size
	default:
		return 0, fmt.Errorf("seek: bad whence %d", whence)
	}
	if off < 0 {
		return 0, fmt.Errorf("seek: negative offset %d", off)
	}
	r.pos = off
	return off, nil
}

// selfCPUSeconds is this process's user+system CPU time.
func selfCPUSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}
