package client

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestSmallKeysUsePutSmallFile: keys of at most one chunk go as one
// PutSmallFile; 0-byte keys write no block; longer keys take WriteChunk +
// PutBlock. All read back.
func TestSmallKeysUsePutSmallFile(t *testing.T) {
	fc := newFakeCluster(t, 3, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	var chunks atomic.Int32
	fc.onWriteChunk = func(*fakeDN, *datanodepb.WriteChunkRequest) error { chunks.Add(1); return nil }
	for i, n := range []int{0, 1, tBPC, tChunk - 1, tChunk, tChunk + 1} {
		data := randBytes(uint64(100+i), n)
		fc.mu.Lock()
		before := fc.smallFiles
		fc.mu.Unlock()
		chunks.Store(0)
		key := fmt.Sprintf("s/%d", n)
		ki, err := c.PutKey(context.Background(), "vol", "bkt", key, onlyReader{bytes.NewReader(data)}, PutOptions{})
		if err != nil {
			t.Fatalf("put %d bytes: %v", n, err)
		}
		fc.mu.Lock()
		small := fc.smallFiles - before
		fc.mu.Unlock()
		switch {
		case n == 0 && (small != 0 || chunks.Load() != 0 || len(ki.Blocks) != 0):
			t.Fatalf("empty key: %d small files, %d chunks, blocks %v", small, chunks.Load(), ki.Blocks)
		case n > 0 && n <= tChunk && (small != 1 || chunks.Load() != 1):
			// The fake's PutSmallFile is one WriteChunk + one PutBlock.
			t.Fatalf("%d bytes: %d small files and %d chunks, want one PutSmallFile", n, small, chunks.Load())
		case n > tChunk && (small != 0 || chunks.Load() != 2):
			t.Fatalf("%d bytes: %d small files and %d chunks, want 0 and 2", n, small, chunks.Load())
		}
		if got := getAll(t, c, key); !bytes.Equal(got, data) {
			t.Fatalf("get %d bytes: content differs", n)
		}
	}
}

// TestSmallFileRetries: a PutSmallFile failure is handled like a failed
// WriteChunk/PutBlock: the container, or the lagging replica and its
// pipeline, are excluded and the key goes to a new block; fatal errors
// and spent retries fail the put without a key. The files go through the
// coalescer (PutSmallFiles, an answer per file).
func TestSmallFileRetries(t *testing.T) {
	fc := newFakeCluster(t, 6, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	// The retry after REPLICAS_LAG needs an open THREE pipeline without the
	// laggard: wait for a second pipeline (SCM makes them as datanodes
	// register) and name as laggard a member another pipeline lacks.
	threes := func() [][]uint64 {
		r, err := fc.mc.Scm.ListPipelines(context.Background(), &metapb.ListPipelinesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		var out [][]uint64
		for _, p := range r.Pipelines {
			if p.Replication == metapb.Replication_THREE && p.State == metapb.PipelineState_PIPELINE_OPEN {
				out = append(out, p.Datanodes)
			}
		}
		return out
	}
	for deadline := time.Now().Add(10 * time.Second); len(threes()) < 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("fewer than 2 open THREE pipelines: %v", threes())
		}
	}
	laggard := func(members []uint64) uint64 {
		for _, m := range members {
			for _, other := range threes() {
				if !slices.Contains(other, m) {
					return m
				}
			}
		}
		return members[len(members)-1]
	}
	var closed atomic.Uint64
	var calls atomic.Int32
	var lagged atomic.Uint64
	fc.onPutSmallFile = func(dn *fakeDN, req *datanodepb.PutSmallFileRequest) error {
		switch calls.Add(1) {
		case 1:
			closed.Store(req.Block.Id.ContainerId)
			return dnErr(codes.FailedPrecondition, &datanodepb.Error{Kind: datanodepb.Error_CONTAINER_NOT_OPEN}, "container closing")
		case 2:
			if req.Block.Id.ContainerId == closed.Load() {
				t.Errorf("retry went to the closed container %d", closed.Load())
			}
			lagged.Store(req.PipelineId)
			return dnErr(codes.DeadlineExceeded, &datanodepb.Error{Kind: datanodepb.Error_REPLICAS_LAG, Lagging: []uint64{laggard(fc.members(req.PipelineId))}}, "lagging")
		default:
			if req.PipelineId == lagged.Load() {
				t.Errorf("retry went to the lagging pipeline %d", lagged.Load())
			}
		}
		return nil
	}
	data := randBytes(7, 4096)
	ki, err := c.PutKey(context.Background(), "vol", "bkt", "k", bytes.NewReader(data), PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 3 || len(ki.Blocks) != 1 || ki.Blocks[0].ContainerID == closed.Load() {
		t.Fatalf("%d calls, blocks %+v (closed container %d)", calls.Load(), ki.Blocks, closed.Load())
	}
	if !bytes.Equal(getAll(t, c, "k"), data) {
		t.Fatal("content differs")
	}

	// A bad request is not retried.
	calls.Store(0)
	fc.onPutSmallFile = func(*fakeDN, *datanodepb.PutSmallFileRequest) error {
		calls.Add(1)
		return dnErr(codes.InvalidArgument, &datanodepb.Error{Kind: datanodepb.Error_BAD_REQUEST}, "no")
	}
	if _, err := c.PutKey(context.Background(), "vol", "bkt", "bad", bytes.NewReader(data), PutOptions{}); err == nil || calls.Load() != 1 {
		t.Fatalf("bad request: %v after %d calls, want a failure after 1", err, calls.Load())
	}
	if _, err := c.StatKey(context.Background(), "vol", "bkt", "bad"); err == nil {
		t.Fatal("failed small put left a key")
	}
	// All of it went through the coalescer's PutSmallFiles (one file
	// each): its per-file errors are classified as PutSmallFile's.
	fc.mu.Lock()
	batches := fc.smallBatches
	fc.mu.Unlock()
	if batches < 4 {
		t.Fatalf("%d PutSmallFiles calls, want one per attempt (4) and any NOT_LEADER redirects", batches)
	}
}

// TestSmallFileFallback: datanodes without PutSmallFile get the usual
// WriteChunk + PutBlock, on the same block.
func TestSmallFileFallback(t *testing.T) {
	fc := newFakeCluster(t, 3, tBlock)
	fc.noSmallFile = true
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	data := randBytes(8, 1000)
	ki, err := c.PutKey(context.Background(), "vol", "bkt", "k", bytes.NewReader(data), PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ki.Blocks) != 1 || fc.committedBytes() != 1000 {
		t.Fatalf("blocks %+v, %d bytes committed", ki.Blocks, fc.committedBytes())
	}
	if !bytes.Equal(getAll(t, c, "k"), data) {
		t.Fatal("content differs")
	}
}
