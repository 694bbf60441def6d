package s3

import (
	"bytes"
	"fmt"
	"io"
	"testing"
	"time"
)

// BenchmarkETagLateFastBesideSlow (the review's case after session 10's
// first rule): one 64 MiB body that pauses 3 ms before its first byte and
// then reads flat out from memory, beside one body paced at ~40 MB/s; the
// time is the fast body's, lanes on and off. With the lanes it must be no
// slower than with crypto/md5.
//
//	go test -run '^$' -bench ETagLateFastBesideSlow ./internal/s3/
func BenchmarkETagLateFastBesideSlow(b *testing.B) {
	fast := bytes.Repeat([]byte("fast-body-bytes!"), 64<<20/16)
	slowData := bytes.Repeat([]byte("slow-body-bytes!"), 256<<20/16)
	for _, useLanes := range []bool{false, true} {
		b.Run(fmt.Sprintf("lanes=%v", useLanes), func(b *testing.B) {
			old := etagLanes
			etagLanes = useLanes
			defer func() { etagLanes = old }()
			stopSlow := startPacedBodies(1, slowData)
			time.Sleep(20 * time.Millisecond) // the slow one is reading
			buf := make([]byte, 4<<20)
			b.SetBytes(int64(len(fast)))
			inLanes := 0
			b.ResetTimer()
			for range b.N {
				r, a := plainRequest(fast)
				r.Body = io.NopCloser(&slowStartReader{data: fast, pause: 3 * time.Millisecond})
				bd := readBody(b, r, a, buf)
				if bd.etag() == "" {
					b.Fatal("no ETag")
				}
				if bd.laneMD5.inLanes() {
					inLanes++
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(inLanes)/float64(b.N), "in-lanes")
			stopSlow()
		})
	}
}
