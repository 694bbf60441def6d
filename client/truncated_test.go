package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
)

// TestPutKeyReaderUnexpectedEOF: a reader that fails with
// io.ErrUnexpectedEOF (what net/http's request body returns when an
// upload ends before its Content-Length) fails the put, on every path,
// and no key is created. Before, io.ReadFull's own short-read error and
// the reader's could not be told apart: the bytes read so far were
// committed as the whole key.
func TestPutKeyReaderUnexpectedEOF(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	cl := startBucket(t, ctx, cluster.Config{Datanodes: 3, BlockSize: 16 << 20, ContainerSize: 512 << 20},
		Config{ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	for _, tc := range []struct {
		at       int
		hint     int64
		pipeline Pipeline
	}{
		{1000, 0, PipelineAuto},            // within the peek: was a small file
		{3<<20 + 5, 8 << 20, PipelineAuto}, // after the early open's first chunk
		{6<<20 + 7, 0, PipelineAuto},       // V2 through auto
		{6<<20 + 7, 0, PipelineV1},
		{6<<20 + 7, 0, PipelineV2},
		{0, 0, PipelineV1},
	} {
		name := fmt.Sprintf("trunc-%v-%d", tc.pipeline, tc.at)
		body := io.MultiReader(bytes.NewReader(bytes.Repeat([]byte{'x'}, tc.at)),
			readerFunc(func([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }))
		ki, err := cl.PutKey(ctx, "vol", "bkt", name, body, PutOptions{SizeHint: tc.hint, Pipeline: tc.pipeline})
		if !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("%s: put: %v (key %d bytes via %s), want the reader's io.ErrUnexpectedEOF", name, err, ki.Size, ki.Pipeline)
		}
		if ki, err := cl.StatKey(ctx, "vol", "bkt", name); !errors.Is(err, ErrNotFound) {
			t.Errorf("%s: stat: %v (%d bytes), want not found", name, err, ki.Size)
		}
	}
}
