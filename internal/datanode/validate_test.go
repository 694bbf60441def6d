package datanode_test

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/storage"
)

// leaderClient returns a client of the pipeline's leader, waiting out an
// election.
func (e *env) leaderClient(pipeline uint64) datanodepb.DatanodeClient {
	e.t.Helper()
	var c datanodepb.DatanodeClient
	waitFor(e.t, 20*time.Second, "a pipeline leader", func() bool {
		for i := range e.c.Datanodes {
			if dn := e.c.Datanode(i); dn != nil && dn.IsPipelineLeader(pipeline) {
				c = dnClient(e.t, dn.Addr())
				return true
			}
		}
		return false
	})
	return c
}

func chunkOf(off uint64, data []byte) *datanodepb.ChunkInfo {
	sum := storage.DefaultChecksum.Compute(data)
	return &datanodepb.ChunkInfo{Offset: off, Length: uint64(len(data)), Checksum: &datanodepb.ChecksumData{
		Type: datanodepb.ChecksumType(sum.Type), BytesPerChecksum: sum.BytesPerChecksum, Sums: sum.Sums}}
}

// TestBadRequestsRefusedBeforeTheLog (scenarios 6 and 12): requests whose
// chunk or checksum metadata storage would refuse, or that would index
// past the sums (bytes_per_checksum 0 used to divide by zero, a short
// checksum list to index out of range: both panicked the datanode), are
// refused as BAD_REQUEST by the real gRPC server before anything is
// proposed; the datanode keeps serving and the pipeline keeps taking
// writes. A 32 MiB chunk (over storage's 16 MiB limit, under gRPC's 64)
// used to enter the log, fail in storage and wedge the pipeline: no
// follower could ever be sent its data.
func TestBadRequestsRefusedBeforeTheLog(t *testing.T) {
	e := startEnv(t)
	ctx := testCtx(t)
	b := e.block()
	dn := e.leaderClient(b.GetPipelineId())
	id := &datanodepb.BlockID{ContainerId: b.GetId().GetContainerId(), LocalId: b.GetId().GetLocalId()}
	data := randBytes(200_000, 3) // four 64 KiB windows
	with := func(f func(c *datanodepb.ChunkInfo)) *datanodepb.ChunkInfo {
		c := chunkOf(0, data)
		f(c)
		return c
	}
	bad := []struct {
		name string
		c    *datanodepb.ChunkInfo
	}{
		{"bytes_per_checksum 0", with(func(c *datanodepb.ChunkInfo) { c.Checksum.BytesPerChecksum = 0 })},
		{"short checksum list", with(func(c *datanodepb.ChunkInfo) { c.Checksum.Sums = c.Checksum.Sums[:4] })},
		{"no sums", with(func(c *datanodepb.ChunkInfo) { c.Checksum.Sums = nil })},
		{"long checksum list", with(func(c *datanodepb.ChunkInfo) { c.Checksum.Sums = append(c.Checksum.Sums, 1, 2, 3, 4) })},
		{"tiny bytes_per_checksum", with(func(c *datanodepb.ChunkInfo) { c.Checksum.BytesPerChecksum = 1 })},
		{"unknown checksum type", with(func(c *datanodepb.ChunkInfo) { c.Checksum.Type = 9 })},
		{"NONE with sums", with(func(c *datanodepb.ChunkInfo) { c.Checksum.Type = datanodepb.ChecksumType_CHECKSUM_NONE })},
		{"length differs from data", with(func(c *datanodepb.ChunkInfo) { c.Length-- })},
		{"offset past the block max", with(func(c *datanodepb.ChunkInfo) { c.Offset = 1 << 62 })},
		{"offset overflows", with(func(c *datanodepb.ChunkInfo) { c.Offset = ^uint64(0) - 10 })},
	}
	wantBad := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.InvalidArgument || dnKind(err) != datanodepb.Error_BAD_REQUEST {
			t.Errorf("%s: %v, want InvalidArgument / BAD_REQUEST", what, err)
		}
	}
	for _, tc := range bad {
		name, c := tc.name, tc.c
		_, err := dn.WriteChunk(ctx, &datanodepb.WriteChunkRequest{PipelineId: b.GetPipelineId(), Block: id, Chunk: c, Data: data})
		wantBad("WriteChunk with "+name, err)
		if c.GetOffset() == 0 && c.GetLength() == uint64(len(data)) {
			bd := &datanodepb.BlockData{Id: id, Length: uint64(len(data)), Chunks: []*datanodepb.ChunkInfo{c}}
			_, err = dn.PutSmallFile(ctx, &datanodepb.PutSmallFileRequest{PipelineId: b.GetPipelineId(), Block: bd, Data: data})
			wantBad("PutSmallFile with "+name, err)
			_, err = dn.PutBlock(ctx, &datanodepb.PutBlockRequest{PipelineId: b.GetPipelineId(), Block: bd})
			wantBad("PutBlock with "+name, err)
		}
	}
	gap := &datanodepb.BlockData{Id: id, Length: 2 * uint64(len(data)), Chunks: []*datanodepb.ChunkInfo{chunkOf(0, data), chunkOf(uint64(len(data))+1, data)}}
	_, err := dn.PutBlock(ctx, &datanodepb.PutBlockRequest{PipelineId: b.GetPipelineId(), Block: gap})
	wantBad("PutBlock with a gap between chunks", err)

	big := randBytes(32<<20, 4)
	_, err = dn.WriteChunk(ctx, &datanodepb.WriteChunkRequest{PipelineId: b.GetPipelineId(), Block: id, Chunk: chunkOf(0, big), Data: big})
	wantBad("32 MiB WriteChunk", err)

	// Nothing of it reached a log or a disk, and the pipeline still
	// replicates: a small file goes to every replica.
	for _, d := range b.GetDatanodes() {
		_, n := e.byID(d.GetId())
		if hasBlockData(n, bid(b)) {
			t.Fatalf("datanode %d stored data of a refused request", d.GetId())
		}
	}
	ok := e.block()
	small := randBytes(5000, 5)
	if _, err := e.putSmall(ok, smallBlock(ok, small), small); err != nil {
		t.Fatalf("PutSmallFile after the refused requests: %v", err)
	}
}
