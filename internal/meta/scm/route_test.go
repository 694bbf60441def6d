package scm

import (
	"fmt"
	"slices"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestWriteRouteStablePerPipeline: every allocation on a pipeline names
// its datanodes in the same order (a client's V2 stream connection is
// reused only for the same route), whatever container of the pipeline the
// block lands in; pipelines start at different datanodes.
func TestWriteRouteStablePerPipeline(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 2, SafeModeMinDatanodes: 3, BlockSize: 1 << 20, ContainerSize: 2 << 20})
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/r%d", i%2))
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	routes := map[uint64][]uint64{}
	for range 40 {
		r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE})
		if err != nil {
			t.Fatal(err)
		}
		b := r.Blocks[0]
		var ids []uint64
		for _, d := range b.Datanodes {
			ids = append(ids, d.Id)
		}
		if len(ids) != 3 {
			t.Fatalf("block on %d datanodes, want 3", len(ids))
		}
		if prev, ok := routes[b.PipelineId]; ok && !slices.Equal(prev, ids) {
			t.Fatalf("pipeline %d: route %v, earlier %v", b.PipelineId, ids, prev)
		}
		routes[b.PipelineId] = ids
	}
	// The rotation itself.
	dns := []*metapb.DatanodeDetails{{Id: 30}, {Id: 10}, {Id: 20}}
	for p, want := range map[uint64][]uint64{0: {10, 20, 30}, 1: {20, 30, 10}, 5: {30, 10, 20}} {
		var got []uint64
		for _, d := range writeRoute(p, dns) {
			got = append(got, d.Id)
		}
		if !slices.Equal(got, want) {
			t.Errorf("writeRoute(%d) = %v, want %v", p, got, want)
		}
	}
	if dns[0].Id != 30 {
		t.Error("writeRoute reordered its argument")
	}
}
