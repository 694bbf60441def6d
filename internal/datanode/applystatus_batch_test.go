package datanode_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"google.golang.org/grpc"
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

// TestApplyStatusBatchFailedLaterEntry: in a batched ApplyStatus call, a
// failed entry after the first (in more) is reported failed, with its
// reason, while the first is not.
func TestApplyStatusBatchFailedLaterEntry(t *testing.T) {
	e := startEnv(t)
	b := e.block()
	data := randBytes(4096, 7)
	deadline := time.Now().Add(30 * time.Second)
	for put := false; !put; {
		if time.Now().After(deadline) {
			t.Fatal("no pipeline leader took the write")
		}
		for j := range e.c.Datanodes {
			dn := e.c.Datanode(j)
			if dn == nil || !dn.IsPipelineLeader(b.GetPipelineId()) {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			_, err := dnClient(t, dn.Addr()).PutSmallFile(ctx, &datanodepb.PutSmallFileRequest{
				PipelineId: b.GetPipelineId(), Block: smallBlock(b, data), Data: data, WaitTimeoutMs: 20000})
			cancel()
			if err == nil {
				put = true
				break
			}
			if dnKind(err) != datanodepb.Error_NOT_LEADER {
				t.Fatalf("PutSmallFile: %v", err)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	cid := b.GetId().GetContainerId()
	// ApplyStatus is for datanodes only: ask as one.
	creds, err := e.c.CA().Issue(pki.Identity{Role: pki.RoleDatanode, ID: "dn-asker"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range b.GetDatanodes() {
		_, dn := e.byID(d.GetId())
		cc, err := grpc.NewClient(dn.Addr(), creds.GRPCDialOption(pki.RoleDatanode))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		r, err := datanodepb.NewDatanodeClient(cc).ApplyStatus(ctx, &datanodepb.ApplyStatusRequest{PipelineId: b.GetPipelineId(), Index: 1, ContainerId: cid,
			More: []*datanodepb.ApplyStatusEntry{{Index: 1, ContainerId: cid}, {Index: 1, ContainerId: cid + 1000}}})
		cancel()
		if err != nil {
			t.Fatalf("datanode %d: ApplyStatus: %v", d.GetId(), err)
		}
		if r.GetFailed() || len(r.GetMore()) != 2 || r.GetMore()[0].GetFailed() {
			t.Fatalf("datanode %d: %v: want the first two entries not failed", d.GetId(), r)
		}
		if m := r.GetMore()[1]; !m.GetFailed() || m.GetReason() == "" {
			t.Fatalf("datanode %d: entry for a container it lacks: %v, want failed with a reason", d.GetId(), m)
		}
	}
}
