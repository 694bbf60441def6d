package datanode_test

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/pki"
	"google.golang.org/grpc"
)

// ApplyStatus with wait_ms does not wait for an index far past the
// replica's log (a bogus or far-ahead index): it answers at once, "not
// yet", and holds nothing.
func TestApplyStatusDoesNotWaitFarPastLog(t *testing.T) {
	e := startEnv(t)
	bs := e.samePipelineBlocks(1)
	pipeline := bs[0].GetPipelineId()
	creds, err := e.c.CA().Issue(pki.Identity{Role: pki.RoleDatanode, ID: "dn-asker"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	_, dn := e.byID(bs[0].GetDatanodes()[0].GetId())
	cc, err := grpc.NewClient(dn.Addr(), creds.GRPCDialOption(pki.RoleDatanode))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	cl := datanodepb.NewDatanodeClient(cc)
	for i := 0; i < 4; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		start := time.Now()
		r, err := cl.ApplyStatus(ctx, &datanodepb.ApplyStatusRequest{PipelineId: pipeline, Index: 1 << 62, ContainerId: 1, WaitMs: 20_000})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > 8*time.Second {
			t.Fatalf("ApplyStatus(index 2^62, wait_ms 20000) took %v: it waited for an index far past the log", took)
		}
		if r.GetApplied() >= 1<<62 {
			t.Fatalf("applied %d", r.GetApplied())
		}
	}
}
