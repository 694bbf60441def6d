package datanode_test

import (
	"bytes"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// TestPutSmallFilesAsksEachFollowerOnce: a PutSmallFiles batch costs the
// leader one ApplyStatus call per follower, asked beside raft's wait for
// the applied reports (wait_ms: the follower answers after its own apply),
// not one round after the reports (where the batcher sent the first file's
// ask alone and the rest in a second call: two calls per follower). Every
// file is acknowledged and readable on every replica. Fails on the old
// code (4 calls for 2 followers).
func TestPutSmallFilesAsksEachFollowerOnce(t *testing.T) {
	e := startEnv(t)
	bs := e.samePipelineBlocks(12)
	pipeline := bs[0].GetPipelineId()
	datas := make([][]byte, len(bs))
	files := make([]*datanodepb.SmallFile, len(bs))
	for i, b := range bs {
		datas[i] = randBytes(4096, uint64(900+i))
		files[i] = &datanodepb.SmallFile{Block: smallBlock(b, datas[i]), Data: datas[i], Token: tokenOf(bid(b))}
	}
	// A first batch elects and settles the pipeline.
	e.putSmallFiles(pipeline, files[:1])
	var calls0 uint64
	for i := range e.c.Datanodes {
		calls0 += e.c.Datanode(i).ApplyStatusCalls()
	}
	_, r := e.putSmallFiles(pipeline, files[1:])
	for i, res := range r.GetResults() {
		if res.GetCode() != 0 {
			t.Fatalf("file %d: %v", i+1, res)
		}
	}
	var calls uint64
	for i := range e.c.Datanodes {
		calls += e.c.Datanode(i).ApplyStatusCalls()
	}
	if calls -= calls0; calls != 2 {
		t.Errorf("a batch of %d files cost %d ApplyStatus calls to 2 followers; want 2 (one each, beside the wait for the applied reports)", len(files)-1, calls)
	}
	for i, b := range bs {
		for _, d := range b.GetDatanodes() {
			_, dn := e.byID(d.GetId())
			if got := readAll(t, dn.Addr(), bid(b)); !bytes.Equal(got, datas[i]) {
				t.Fatalf("datanode %d: file %d reads back differently", d.GetId(), i)
			}
		}
	}
}
