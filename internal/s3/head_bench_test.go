package s3_test

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// BenchmarkHeadServe times signed HEADs of 4 KiB objects served in
// process by 64 concurrent callers (as warp stat's 64 clients), through
// the gateway's handler, the metadata client's coalescer, gRPC and the
// metadata service of an in-process cluster: the server's CPU per HEAD
// without net/http and the sockets to the client (issue 15).
//
//	go test -run '^$' -bench HeadServe -benchtime 20000x ./internal/s3/
func BenchmarkHeadServe(b *testing.B) {
	e := setup(b)
	e.mkBucket(b, "heads")
	const objects = 256
	reqs := make([]*http.Request, objects)
	for i := range reqs {
		if _, err := e.s3.PutObject(e.ctx, &s3.PutObjectInput{Bucket: aws.String("heads"), Key: aws.String(fmt.Sprintf("dir/object-%d", i)),
			Body: bytes.NewReader(bytes.Repeat([]byte("x"), 4096))}); err != nil {
			b.Fatal(err)
		}
		r, err := http.NewRequest(http.MethodHead, fmt.Sprintf("%s/heads/dir/object-%d", e.url, i), nil)
		if err != nil {
			b.Fatal(err)
		}
		r.RemoteAddr = "127.0.0.1:40000"
		r.Header.Set("User-Agent", "head-bench")
		e.sign(b, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
		reqs[i] = r
	}
	head := func(i int) {
		r := reqs[i%objects].Clone(reqs[i%objects].Context())
		w := httptest.NewRecorder()
		e.gw.ServeHTTP(w, r)
		if w.Code != http.StatusOK || w.Header().Get("Content-Length") != "4096" {
			b.Fatalf("HEAD: %d %v %s", w.Code, w.Header(), w.Body)
		}
	}
	for i := range objects { // warm the caches
		head(i)
	}
	b.SetParallelism(32) // 64 callers on two cores
	b.ReportAllocs()
	cpu0 := processCPU()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			head(i)
			i += 7
		}
	})
	b.StopTimer()
	// The process's CPU (user and system) per HEAD: the figure that
	// counts on a shared machine, where ns/op follows the other load.
	b.ReportMetric(float64((processCPU()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
}

// processCPU is the process's user and system CPU time so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
