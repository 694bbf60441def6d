package scm

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// BenchmarkReplicationRound is one replication-manager round (planLocked)
// over 10,000 CLOSED containers of three replicas each, every replica
// reported CLOSED at the close's BCSID (with the floor: at the floor). It
// measures what the per-replica BCSID checks cost a round.
func BenchmarkReplicationRound(b *testing.B) {
	st, err := Open(b.TempDir(), store.Options{SyncInterval: -1})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { st.Close() })
	clk := newClock()
	cfg := Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, Now: clk.Now, HeartbeatInterval: time.Second, StaleInterval: 5 * time.Second, DeadInterval: 10 * time.Second}
	fr := &fakeRaft{st: st, leader: true}
	e := &env{st: st, fr: fr, m: NewManager(cfg, st, fr), clk: clk, ctx: context.Background()}
	var res any
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(b, "dn"+string(rune('a'+i)), "/dc1/r1"))
	}
	res, err = e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids}}})
	if err != nil {
		b.Fatal(err)
	}
	pid := res.(*metapb.Pipeline).Id
	const n = 10000
	var reps []*metapb.ContainerReport
	for range n {
		res, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: pid}}})
		if err != nil {
			b.Fatal(err)
		}
		reps = append(reps, closedRep(res.(*metapb.Container).Id, 50))
	}
	if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: []uint64{pid}, Reason: "bench"}}}); err != nil {
		b.Fatal(err)
	}
	for _, r := range reps {
		if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: r.ContainerId, UsedBytes: 100,
			Bcsid: 50, // BENCH-FLOOR
		}}}); err != nil {
			b.Fatal(err)
		}
	}
	for _, id := range ids {
		e.report(b, id, reps...)
	}
	if err := e.m.Tick(e.ctx); err != nil {
		b.Fatal(err)
	}
	if h, _ := e.m.ContainerHealth(10); h.Counts[HealthHealthy] < n {
		b.Fatalf("health %v", h.Counts)
	}
	b.ResetTimer()
	for b.Loop() {
		e.m.mu.Lock()
		e.m.planLocked(e.clk.Now())
		e.m.mu.Unlock()
	}
}
