package datanode_test

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// TestPutSmallFilesOneTimeoutWhenFollowersStopAnswering: raft reports
// every replica applied the batch, but the followers never answer
// ApplyStatus. The call answers within about one WaitTimeoutMs (the files
// left to wait on their own get only what remains of it), not two, and
// acknowledges no file. Fails on the old code (~2x the timeout).
func TestPutSmallFilesOneTimeoutWhenFollowersStopAnswering(t *testing.T) {
	e := startEnv(t)
	bs := e.samePipelineBlocks(5)
	pipeline := bs[0].GetPipelineId()
	files := make([]*datanodepb.SmallFile, len(bs))
	for i, b := range bs {
		d := randBytes(4096, uint64(700+i))
		files[i] = &datanodepb.SmallFile{Block: smallBlock(b, d), Data: d, Token: tokenOf(bid(b))}
	}
	e.putSmallFiles(pipeline, files[:1]) // elects and settles the pipeline
	leader := e.leaderOf(pipeline)
	for i := range e.c.Datanodes {
		dn := e.c.Datanode(i)
		if dn != leader {
			dn.SetApplyStatusHook(func(ctx context.Context) { <-ctx.Done() })
			t.Cleanup(func() { dn.SetApplyStatusHook(nil) })
		}
	}
	const waitMs = 2000
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	r, err := dnClient(t, leader.Addr()).PutSmallFiles(ctx, &datanodepb.PutSmallFilesRequest{
		PipelineId: pipeline, Files: files[1:], WaitTimeoutMs: waitMs})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("PutSmallFiles with silent followers answered after %v (WaitTimeoutMs %d)", took, waitMs)
	for i, res := range r.GetResults() {
		if res.GetCode() == 0 {
			t.Errorf("file %d acknowledged though no follower confirmed it: %v", i+1, res)
		}
	}
	if took > 3400*time.Millisecond {
		t.Fatalf("PutSmallFiles took %v with WaitTimeoutMs %d: the per-file fallback waited a fresh timeout", took, waitMs)
	}
}
