package datanode_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

func smallBlock(b *metapb.BlockLocation, data []byte) *datanodepb.BlockData {
	sum := storage.DefaultChecksum.Compute(data)
	return &datanodepb.BlockData{
		Id:     &datanodepb.BlockID{ContainerId: b.GetId().GetContainerId(), LocalId: b.GetId().GetLocalId()},
		Length: uint64(len(data)),
		Chunks: []*datanodepb.ChunkInfo{{Offset: 0, Length: uint64(len(data)), Checksum: &datanodepb.ChecksumData{
			Type: datanodepb.ChecksumType(sum.Type), BytesPerChecksum: sum.BytesPerChecksum, Sums: sum.Sums}}},
	}
}

// putSmall sends a PutSmallFile to the pipeline's leader (waiting out an
// election) and returns the answer of the leader.
func (e *env) putSmall(b *metapb.BlockLocation, bd *datanodepb.BlockData, data []byte) (*datanodepb.PutSmallFileResponse, error) {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		for i := range e.c.Datanodes {
			dn := e.c.Datanode(i)
			if dn == nil || !dn.IsPipelineLeader(b.GetPipelineId()) {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			r, err := dnClient(e.t, dn.Addr()).PutSmallFile(ctx, &datanodepb.PutSmallFileRequest{
				PipelineId: b.GetPipelineId(), Block: bd, Data: data, WaitTimeoutMs: 10000})
			cancel()
			if dnKind(err) != datanodepb.Error_NOT_LEADER {
				return r, err
			}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("PutSmallFile %v: no leader", bd.GetId())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func dnKind(err error) datanodepb.Error_Kind {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if e, ok := d.(*datanodepb.Error); ok {
			return e.GetKind()
		}
	}
	return datanodepb.Error_UNKNOWN
}

// TestPutSmallFileThroughCluster: one PutSmallFile call writes and commits
// a block on every replica of a real pipeline, with one log entry; each
// replica returns the same block description (BCSID = that entry) and
// the same bytes, also after the datanodes restart. Bad requests and data
// that fails its checksum store nothing.
func TestPutSmallFileThroughCluster(t *testing.T) {
	e := startEnv(t)
	ctx := testCtx(t)
	type written struct {
		b     *metapb.BlockLocation
		data  []byte
		index uint64
	}
	var all []written
	for i, n := range []int{1, 4096, 100_000} {
		b := e.block()
		data := randBytes(n, uint64(i+1))
		r, err := e.putSmall(b, smallBlock(b, data), data)
		if err != nil {
			t.Fatalf("PutSmallFile of %d bytes: %v", n, err)
		}
		all = append(all, written{b, data, r.GetIndex()})
	}
	check := func(when string) {
		t.Helper()
		for _, w := range all {
			var first *datanodepb.BlockData
			for _, d := range w.b.GetDatanodes() {
				_, dn := e.byID(d.GetId())
				bd, err := dnClient(t, dn.Addr()).GetBlock(ctx, &datanodepb.GetBlockRequest{Block: smallBlock(w.b, w.data).GetId()})
				if err != nil {
					t.Fatalf("%s: GetBlock from datanode %d: %v", when, d.GetId(), err)
				}
				if bd.GetBcsid() != w.index || bd.GetLength() != uint64(len(w.data)) {
					t.Fatalf("%s: datanode %d has %v, want length %d at BCSID %d", when, d.GetId(), bd, len(w.data), w.index)
				}
				if first == nil {
					first = bd
				} else if !proto.Equal(first, bd) {
					t.Fatalf("%s: replicas differ: %v vs %v", when, first, bd)
				}
				if got := readAll(t, dn.Addr(), bid(w.b)); !bytes.Equal(got, w.data) {
					t.Fatalf("%s: datanode %d returned %d bytes, differing from the %d written", when, d.GetId(), len(got), len(w.data))
				}
				// A small file's block is kept inline (no block file) on
				// every replica when it is a deferred write (storage/inline.go).
				sbd, err := dn.Store().GetBlock(storage.ContainerID(w.b.GetId().GetContainerId()), storage.LocalID(w.b.GetId().GetLocalId()))
				if wantInline := len(w.data) <= storage.DefaultDeferredMax; err != nil || sbd.Inline != wantInline {
					t.Fatalf("%s: datanode %d: block of %d bytes inline = %v (%v), want %v", when, d.GetId(), len(w.data), sbd.Inline, err, wantInline)
				}
			}
		}
	}
	check("after write")

	// The same call again (a client retry after a lost answer) is
	// harmless and changes nothing.
	w := all[1]
	if _, err := e.putSmall(w.b, smallBlock(w.b, w.data), w.data); err != nil {
		t.Fatalf("repeated PutSmallFile: %v", err)
	}
	check("after a repeated call")

	// Refused before anything is proposed.
	b := e.block()
	data := randBytes(5000, 9)
	two := smallBlock(b, data)
	two.Chunks = []*datanodepb.ChunkInfo{smallBlock(b, data[:4096]).Chunks[0], smallBlock(b, data[4096:]).Chunks[0]}
	two.Chunks[1].Offset = 4096
	short := smallBlock(b, data)
	short.Length--
	for name, c := range map[string]struct {
		bd   *datanodepb.BlockData
		data []byte
	}{"two chunks": {two, data}, "length differs": {short, data}, "no data": {smallBlock(b, nil), nil}} {
		if _, err := e.putSmall(b, c.bd, c.data); status.Code(err) != codes.InvalidArgument || dnKind(err) != datanodepb.Error_BAD_REQUEST {
			t.Errorf("%s: %v, want InvalidArgument / BAD_REQUEST", name, err)
		}
	}
	bad := append([]byte(nil), data...)
	bad[100] ^= 0xff
	if _, err := e.putSmall(b, smallBlock(b, data), bad); dnKind(err) != datanodepb.Error_CHECKSUM_MISMATCH {
		t.Fatalf("corrupt data: %v, want CHECKSUM_MISMATCH", err)
	}
	for _, d := range b.GetDatanodes() {
		_, dn := e.byID(d.GetId())
		if hasBlockData(dn, bid(b)) {
			t.Fatalf("datanode %d stored data of a refused small file", d.GetId())
		}
	}

	// Restart every datanode: the blocks are still there, identical.
	for i := range e.c.Datanodes {
		if err := e.c.StopDatanode(i); err != nil {
			t.Fatal(err)
		}
	}
	for i := range e.c.Datanodes {
		rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		err := e.c.RestartDatanode(rctx, i)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
	check("after restarting the datanodes")
}

func dnErrorOf(err error) *datanodepb.Error {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if e, ok := d.(*datanodepb.Error); ok {
			return e
		}
	}
	return nil
}
