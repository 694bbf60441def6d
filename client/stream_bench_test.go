package client

import (
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
)

// pacedReader yields n bytes in reads of at most 256 KiB at about rate
// bytes/s (an S3 body arriving from its client).
type pacedReader struct {
	n, off int64
	rate   float64
	start  time.Time
	chunk  []byte
}

func (r *pacedReader) Read(p []byte) (int, error) {
	if r.off == r.n {
		return 0, io.EOF
	}
	if r.start.IsZero() {
		r.start = time.Now()
	}
	if due := r.start.Add(time.Duration(float64(r.off) / r.rate * float64(time.Second))); time.Until(due) > 0 {
		time.Sleep(time.Until(due))
	}
	k := copy(p[:min(int64(len(p)), r.n-r.off, int64(len(r.chunk)))], r.chunk)
	r.off += int64(k)
	return k, nil
}

// BenchmarkV2PutPaced: one 16 MiB V2 put at a time (one segment: the S3
// gateway's part of a 128 MiB warp upload) from a body arriving at
// 200 MB/s, through a real 3-datanode cluster with TLS. Per put: reading
// (~84 ms), opening the stream (every hop's connection and handshake),
// sending, Close (every datanode syncs) and PutBlock. With the sender
// goroutine the opening and sending overlap the reading.
//
//	go test -run '^$' -bench V2PutPaced -benchtime 20x ./client/
func BenchmarkV2PutPaced(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cl := startBucket(b, ctx, cluster.Config{Datanodes: 3, BlockSize: 256 << 20, ContainerSize: 4 << 30},
		Config{RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	const size = 16 << 20
	chunk := make([]byte, 256<<10)
	for i := range chunk {
		chunk[i] = byte(i * 7)
	}
	b.SetBytes(size)
	b.ResetTimer()
	for i := range b.N {
		r := &pacedReader{n: size, rate: 200e6, chunk: chunk}
		if _, err := cl.PutKey(ctx, "vol", "bkt", fmt.Sprintf("k%d", i), r, PutOptions{Pipeline: PipelineV2}); err != nil {
			b.Fatal(err)
		}
	}
}
