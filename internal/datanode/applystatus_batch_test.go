package datanode_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestApplyStatusBatched: concurrent PutSmallFiles cost the pipeline
// leader fewer ApplyStatus calls than one per write per follower (the
// asks are batched, applystatus_batch.go); before, every write cost one
// call to each of the two followers. Every write is acknowledged and
// readable on every replica.
func TestApplyStatusBatched(t *testing.T) {
	e := startEnv(t)
	const n = 48
	blocks := make([]*metapb.BlockLocation, n)
	datas := make([][]byte, n)
	for i := range blocks {
		blocks[i] = e.block()
		datas[i] = randBytes(4096, uint64(100+i))
	}
	var calls0 uint64
	for i := range e.c.Datanodes {
		calls0 += e.c.Datanode(i).ApplyStatusCalls()
	}
	var wg sync.WaitGroup
	errc := make(chan error, n)
	for i := range blocks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := blocks[i]
			deadline := time.Now().Add(30 * time.Second)
			for time.Now().Before(deadline) {
				for j := range e.c.Datanodes {
					dn := e.c.Datanode(j)
					if dn == nil || !dn.IsPipelineLeader(b.GetPipelineId()) {
						continue
					}
					ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
					_, err := dnClient(t, dn.Addr()).PutSmallFile(ctx, &datanodepb.PutSmallFileRequest{
						PipelineId: b.GetPipelineId(), Block: smallBlock(b, datas[i]), Data: datas[i], WaitTimeoutMs: 20000})
					cancel()
					if dnKind(err) != datanodepb.Error_NOT_LEADER {
						errc <- err
						return
					}
				}
				time.Sleep(20 * time.Millisecond)
			}
			errc <- context.DeadlineExceeded
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		if err != nil {
			t.Fatalf("PutSmallFile: %v", err)
		}
	}
	var calls uint64
	for i := range e.c.Datanodes {
		calls += e.c.Datanode(i).ApplyStatusCalls()
	}
	calls -= calls0
	t.Logf("%d concurrent small writes: %d ApplyStatus calls", n, calls)
	if calls >= 2*n {
		t.Fatalf("%d ApplyStatus calls for %d concurrent writes on 2 followers: not batched", calls, n)
	}
	for i, b := range blocks {
		for _, d := range b.GetDatanodes() {
			_, dn := e.byID(d.GetId())
			if got := readAll(t, dn.Addr(), bid(b)); string(got) != string(datas[i]) {
				t.Fatalf("block %d on datanode %d reads back wrong", i, d.GetId())
			}
		}
	}
}
