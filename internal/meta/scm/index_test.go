package scm

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// checkIndexes compares State's open/closing indexes with a full scan of
// the mirror: they must list exactly the pipelines and containers in
// those states.
func checkIndexes(t *testing.T, s *State) {
	t.Helper()
	for _, repl := range []metapb.Replication{metapb.Replication_ONE, metapb.Replication_THREE} {
		var wantP, gotP []uint64
		for _, p := range s.Pipelines() {
			if p.State == metapb.PipelineState_PIPELINE_OPEN && p.Replication == repl {
				wantP = append(wantP, p.Id)
			}
		}
		for _, p := range s.OpenPipelines(repl) {
			gotP = append(gotP, p.Id)
		}
		if !slices.Equal(wantP, gotP) {
			t.Fatalf("%v: open pipelines index %v, scan %v", repl, gotP, wantP)
		}
		var wantC, gotC []uint64
		for _, c := range s.Containers() {
			if c.State == metapb.ContainerState_CONTAINER_OPEN && c.Replication == repl {
				wantC = append(wantC, c.Id)
			}
		}
		s.EachOpenContainer(repl, func(c *metapb.Container) bool {
			if c.State != metapb.ContainerState_CONTAINER_OPEN {
				t.Errorf("index lists container %d in state %v as open", c.Id, c.State)
			}
			gotC = append(gotC, c.Id)
			return true
		})
		if !slices.Equal(wantC, gotC) {
			t.Fatalf("%v: open containers index %v, scan %v", repl, gotC, wantC)
		}
	}
	var wantX, gotX []uint64
	for _, c := range s.Containers() {
		if c.State == metapb.ContainerState_CONTAINER_CLOSING {
			wantX = append(wantX, c.Id)
		}
	}
	for _, c := range s.ClosingContainers() {
		gotX = append(gotX, c.Id)
	}
	if !slices.Equal(wantX, gotX) {
		t.Fatalf("closing index %v, scan %v", gotX, wantX)
	}
}

// TestOpenIndexes drives containers through every state change (fill and
// close, reported closed, pipeline closed by a dead datanode) and checks
// the indexes after each step, after a reopen and after a restore.
func TestOpenIndexes(t *testing.T) {
	dir := t.TempDir()
	e := newEnv(t, Config{PipelineLimit: 2, OpenContainersPerPipeline: 2, SafeModeMinDatanodes: 4, BlockSize: 1 << 20, ContainerSize: 3 << 20})
	e.st.Close()
	e.st = openState(t, dir)
	t.Cleanup(func() { e.st.Close() })
	e.fr.st = e.st
	e.m = NewManager(e.m.cfg, e.st, e.fr)
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	tick := func() {
		t.Helper()
		if err := e.m.Tick(e.ctx); err != nil {
			t.Fatal(err)
		}
		checkIndexes(t, e.st)
	}
	tick()
	if n := len(e.st.OpenContainers()); n != 12 {
		t.Fatalf("%d open containers, want 12", n)
	}
	// Fill containers: 3 blocks each, so they close on the next tick and
	// are replaced.
	for range 30 {
		if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 2}); err != nil {
			t.Fatal(err)
		}
		checkIndexes(t, e.st)
	}
	tick()
	closing := e.st.ClosingContainers()
	if len(closing) == 0 {
		t.Fatal("no container closing after filling")
	}
	// Every replica reports the first closing container closed: CLOSED.
	c0 := closing[0]
	for _, id := range c0.Replicas {
		if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, FullReport: true,
			Containers: []*metapb.ContainerReport{{ContainerId: c0.Id, State: metapb.ContainerState_CONTAINER_CLOSED, UsedBytes: 7}}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		if !slices.Contains(c0.Replicas, id) {
			e.heartbeatAll(t, id)
		}
	}
	tick()
	if c := e.st.Container(c0.Id); c.State != metapb.ContainerState_CONTAINER_CLOSED {
		t.Fatalf("container %d: %v after all replicas reported it closed", c0.Id, c.State)
	}
	// A datanode dies: its pipelines close, their open containers go to
	// CLOSING.
	for range 11 {
		e.clk.Advance(time.Second)
		e.heartbeatAll(t, ids[1:]...)
		tick()
	}
	if e.m.NodeState(ids[0]) != metapb.NodeState_DEAD {
		t.Fatalf("datanode %d: %v", ids[0], e.m.NodeState(ids[0]))
	}
	e.st.EachOpenContainer(metapb.Replication_THREE, func(c *metapb.Container) bool {
		if slices.Contains(c.Replicas, ids[0]) {
			t.Errorf("container %d on dead datanode %d still open", c.Id, ids[0])
		}
		return true
	})
	// Reopen (load) and restore rebuild the same indexes.
	want := e.st.OpenContainers()
	e.st.Close()
	e.st = openState(t, dir)
	checkIndexes(t, e.st)
	if got := e.st.OpenContainers(); len(got) != len(want) {
		t.Fatalf("after reopen: %d open containers, want %d", len(got), len(want))
	}
	idx, rc, err := e.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	other := openState(t, t.TempDir())
	defer other.Close()
	err = other.Restore(idx, rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	checkIndexes(t, other)
}

// BenchmarkAllocateBlock allocates one block at a time with many closed
// containers in the state: the cost must not depend on them.
func BenchmarkAllocateBlock(b *testing.B) {
	for _, closed := range []int{0, 10000} {
		b.Run(fmt.Sprintf("closed=%d", closed), func(b *testing.B) {
			st, err := Open(b.TempDir(), store.Options{SyncInterval: -1})
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			clk := newClock()
			fr := &fakeRaft{st: st, leader: true}
			m := NewManager(Config{Now: clk.Now, SafeModeMinDatanodes: 3, BlockSize: 1, ContainerSize: 1 << 40}, st, fr)
			for i := range 3 {
				if _, err := m.Register(b.Context(), &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{Uuid: fmt.Sprint(i), DataAddr: "h:1", RaftAddr: "h:2", Location: fmt.Sprintf("/r%d", i%2)}}); err != nil {
					b.Fatal(err)
				}
			}
			if err := m.Tick(b.Context()); err != nil {
				b.Fatal(err)
			}
			var p *metapb.Pipeline
			for _, q := range st.Pipelines() {
				if q.Replication == metapb.Replication_THREE {
					p = q
				}
			}
			for i := 0; i < closed; i += 1000 {
				var ids []uint64
				for range 1000 {
					r, err := fr.Propose(b.Context(), mustMarshalCmd(&metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: p.Id}}}))
					if err != nil {
						b.Fatal(err)
					}
					ids = append(ids, r.(*metapb.Container).Id)
				}
				if _, err := fr.Propose(b.Context(), mustMarshalCmd(&metapb.ScmCommand{Op: &metapb.ScmCommand_CloseContainers{CloseContainers: &metapb.CloseContainersOp{ContainerIds: ids}}})); err != nil {
					b.Fatal(err)
				}
			}
			req := &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := m.AllocateBlocks(b.Context(), req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func mustMarshalCmd(cmd *metapb.ScmCommand) []byte {
	b, err := proto.Marshal(cmd)
	if err != nil {
		panic(err)
	}
	return b
}
