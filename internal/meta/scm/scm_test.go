package scm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// fakeRaft applies proposals directly, in order, like a one-node group.
type fakeRaft struct {
	mu     sync.Mutex
	st     *State
	idx    uint64
	leader bool
	props  [][]byte // every proposed command, in order
}

func (f *fakeRaft) Propose(_ context.Context, cmd []byte) (any, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.idx++
	f.props = append(f.props, cmd)
	r := f.st.Apply([]store.Entry{{Index: f.idx, Cmd: cmd}})[0]
	if err, ok := r.(error); ok {
		return nil, err
	}
	return r, nil
}

func (f *fakeRaft) IsLeader() bool { f.mu.Lock(); defer f.mu.Unlock(); return f.leader }

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time          { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }
func newClock() *clock                   { return &clock{t: time.Unix(1_700_000_000, 0)} }
func code(err error) codes.Code          { return status.Code(err) }
func openState(t *testing.T, dir string) *State {
	t.Helper()
	st, err := Open(dir, store.Options{SyncInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

type env struct {
	st  *State
	fr  *fakeRaft
	m   *Manager
	clk *clock
	ctx context.Context
}

func newEnv(t *testing.T, cfg Config) *env {
	t.Helper()
	st := openState(t, t.TempDir())
	t.Cleanup(func() { st.Close() })
	clk := newClock()
	cfg.Now = clk.Now
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = time.Second
		cfg.StaleInterval = 5 * time.Second
		cfg.DeadInterval = 10 * time.Second
	}
	fr := &fakeRaft{st: st, leader: true}
	return &env{st: st, fr: fr, m: NewManager(cfg, st, fr), clk: clk, ctx: context.Background()}
}

func (e *env) register(t testing.TB, uuid, loc string) uint64 {
	t.Helper()
	r, err := e.m.Register(e.ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{Uuid: uuid, DataAddr: "h:1", RaftAddr: "h:2", Location: loc}})
	if err != nil {
		t.Fatalf("register %s: %v", uuid, err)
	}
	return r.DatanodeId
}

func (e *env) heartbeatAll(t *testing.T, ids ...uint64) map[uint64][]*metapb.DatanodeCommand {
	t.Helper()
	out := map[uint64][]*metapb.DatanodeCommand{}
	for _, id := range ids {
		r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id})
		if err != nil {
			t.Fatalf("heartbeat %d: %v", id, err)
		}
		out[id] = r.Commands
	}
	return out
}

func TestRegisterKeepsID(t *testing.T) {
	dir := t.TempDir()
	st := openState(t, dir)
	fr := &fakeRaft{st: st, leader: true}
	m := NewManager(Config{}, st, fr)
	ctx := context.Background()
	reg := func(uuid string, id uint64) (uint64, error) {
		r, err := m.Register(ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{Id: id, Uuid: uuid, DataAddr: "a:1", RaftAddr: "a:2", Location: "/dc1/r1"}})
		if err != nil {
			return 0, err
		}
		return r.DatanodeId, nil
	}
	a, _ := reg("uuid-a", 0)
	b, _ := reg("uuid-b", 0)
	if a == b || a == 0 || b == 0 {
		t.Fatalf("ids %d %d", a, b)
	}
	if again, _ := reg("uuid-a", a); again != a {
		t.Fatalf("re-register gave %d, want %d", again, a)
	}
	if _, err := reg("uuid-a", b); code(err) != codes.FailedPrecondition {
		t.Fatalf("claiming another's ID: %v", err)
	}
	if _, err := reg("", 0); code(err) != codes.InvalidArgument {
		t.Fatalf("empty uuid: %v", err)
	}
	if _, err := m.Register(ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{Uuid: "x", DataAddr: "a", RaftAddr: "b", Location: "rack"}}); code(err) != codes.InvalidArgument {
		t.Fatalf("bad location: %v", err)
	}
	st.Close()
	// Restart: same IDs, and a datanode that kept an ID SCM does not know
	// keeps it.
	st = openState(t, dir)
	defer st.Close()
	if id, ok := st.DatanodeByUUID("uuid-b"); !ok || id != b {
		t.Fatalf("after restart uuid-b → %d,%v want %d", id, ok, b)
	}
	m = NewManager(Config{}, st, &fakeRaft{st: st, leader: true, idx: fr.idx})
	if id, _ := reg("uuid-z", 77); id != 77 {
		t.Fatalf("kept id: got %d want 77", id)
	}
	if id, _ := reg("uuid-y", 0); id != 78 {
		t.Fatalf("next id after kept 77: got %d", id)
	}
}

func TestPipelinesContainersAndBlocks(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 2, OpenContainersPerPipeline: 2, SafeModeMinDatanodes: 4, BlockSize: 1 << 20, ContainerSize: 4 << 20})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	// Safe mode until 4 datanodes reported: registration counts as a report.
	if sm, _ := e.m.SafeMode(); sm.InSafeMode {
		t.Fatalf("still in safe mode after 4 registrations: %v", sm)
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	var three, one int
	used := map[uint64]bool{}
	for _, p := range e.st.Pipelines() {
		if p.Replication == metapb.Replication_THREE {
			three++
			racks := map[string]bool{}
			for _, id := range p.Datanodes {
				used[id] = true
				racks[e.st.Datanode(id).Location] = true
			}
			if len(racks) < 2 {
				t.Errorf("pipeline %d on one rack", p.Id)
			}
		} else {
			one++
		}
		if p.Id < FirstPipelineID {
			t.Errorf("pipeline id %d below %d", p.Id, FirstPipelineID)
		}
	}
	if three != 2 || one != 4 || len(used) != 4 {
		t.Fatalf("pipelines: %d THREE over %d datanodes, %d ONE; want 2 over 4, 4", three, len(used), one)
	}
	if n := len(e.st.Containers()); n != 12 {
		t.Fatalf("%d containers, want 6 pipelines × 2", n)
	}
	// Heartbeat commands: each datanode is told to create its pipelines,
	// and not again until the retry interval passes.
	cmds := e.heartbeatAll(t, ids...)
	for _, id := range ids {
		n := 0
		for _, c := range cmds[id] {
			if cp := c.GetCreatePipeline(); cp != nil {
				n++
				if !slices.Contains(cp.Pipeline.Datanodes, id) || len(cp.Datanodes) != len(cp.Pipeline.Datanodes) {
					t.Errorf("datanode %d got create for %v", id, cp.Pipeline)
				}
			}
		}
		if n < 2 {
			t.Errorf("datanode %d got %d create-pipeline commands, want ≥ 2", id, n)
		}
	}
	if again := e.heartbeatAll(t, ids[0]); len(again[ids[0]]) != 0 {
		t.Errorf("commands resent before retry interval: %v", again)
	}

	// Allocation: replicas ordered by distance from the caller.
	resp, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 5, ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[uint64]bool{}
	for _, b := range resp.Blocks {
		if seen[b.Id.LocalId] {
			t.Fatalf("local id %d twice", b.Id.LocalId)
		}
		seen[b.Id.LocalId] = true
		if len(b.Datanodes) != 3 || b.Datanodes[0].Location != "/dc1/rack1" {
			t.Errorf("block %v: replicas %v not nearest-first for /dc1/rack1", b.Id, b.Datanodes)
		}
	}
	// Exclude list: excluding a datanode that is in one of the two THREE
	// pipelines leaves only the other.
	in := map[uint64]int{}
	for _, p := range e.st.Pipelines() {
		if p.Replication == metapb.Replication_THREE {
			for _, id := range p.Datanodes {
				in[id]++
			}
		}
	}
	ex := ids[0]
	for id, n := range in {
		if n == 1 {
			ex = id
		}
	}
	resp, err = e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 10, Exclude: &metapb.ExcludeList{Datanodes: []uint64{ex}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range resp.Blocks {
		for _, d := range b.Datanodes {
			if d.Id == ex {
				t.Fatalf("block %v on excluded datanode %d", b.Id, ex)
			}
		}
	}
	var allPipes []uint64
	for _, p := range e.st.Pipelines() {
		allPipes = append(allPipes, p.Id)
	}
	if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Exclude: &metapb.ExcludeList{Pipelines: allPipes}}); code(err) != codes.FailedPrecondition {
		t.Fatalf("all pipelines excluded: %v", err)
	}
	if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 0}); code(err) != codes.InvalidArgument {
		t.Fatalf("count 0: %v", err)
	}
	// Containers fill (4 blocks of 1 MiB in 4 MiB) and get closed by the
	// next tick; new ones replace them.
	for range 40 {
		if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_ONE}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	closing := 0
	for _, c := range e.st.Containers() {
		if c.State == metapb.ContainerState_CONTAINER_CLOSING {
			closing++
		}
	}
	if closing == 0 {
		t.Fatal("no container closed after filling")
	}
}

func TestNoSafeModeExitWithoutReports(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 3})
	e.register(t, "a", "")
	if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1}); code(err) != codes.FailedPrecondition {
		t.Fatalf("allocation in safe mode: %v", err)
	}
	sm, _ := e.m.SafeMode()
	if !sm.InSafeMode || sm.ReportedDatanodes != 1 || sm.RequiredDatanodes != 3 {
		t.Fatalf("safe mode %v", sm)
	}
	_ = e.m.Tick(e.ctx)
	if len(e.st.Pipelines()) != 0 {
		t.Fatal("pipelines created in safe mode")
	}
}

func TestStaleDeadClosesPipelines(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, SafeModeMinDatanodes: 3})
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), ""))
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	var p3 *metapb.Pipeline
	for _, p := range e.st.Pipelines() {
		if p.Replication == metapb.Replication_THREE {
			p3 = p
		}
	}
	if p3 == nil {
		t.Fatal("no THREE pipeline")
	}
	step := func(d time.Duration) {
		e.clk.Advance(d)
		e.heartbeatAll(t, ids[1], ids[2]) // ids[0] went silent
		if err := e.m.Tick(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	step(3 * time.Second)
	if s := e.m.NodeState(ids[0]); s != metapb.NodeState_HEALTHY {
		t.Fatalf("after 3s: %v", s)
	}
	step(3 * time.Second)
	if s := e.m.NodeState(ids[0]); s != metapb.NodeState_STALE {
		t.Fatalf("after 6s: %v", s)
	}
	// A stale member already costs the pipeline (Ozone's stale node
	// handling): its open containers close, and new pipelines on the
	// other datanodes take the writes.
	if p := e.st.Pipeline(p3.Id); p.State != metapb.PipelineState_PIPELINE_CLOSED || !strings.Contains(p.CloseReason, "stale") {
		t.Fatalf("pipeline with a stale member: %v", p)
	}
	step(5 * time.Second)
	if s := e.m.NodeState(ids[0]); s != metapb.NodeState_DEAD {
		t.Fatalf("after 11s: %v", s)
	}
	p := e.st.Pipeline(p3.Id)
	if p.State != metapb.PipelineState_PIPELINE_CLOSED || p.CloseReason == "" {
		t.Fatalf("pipeline of dead datanode: %v", p)
	}
	for _, c := range e.st.Containers() {
		if c.PipelineId == p3.Id && c.State == metapb.ContainerState_CONTAINER_OPEN {
			t.Fatalf("container %d still open on closed pipeline", c.Id)
		}
	}
	// The survivors that report the closed pipeline are told to close it,
	// and containers they report open are told to close.
	var cont uint64
	for _, c := range e.st.Containers() {
		if c.PipelineId == p3.Id {
			cont = c.Id
		}
	}
	r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: ids[1], FullReport: true,
		Pipelines:  []*metapb.PipelineReport{{PipelineId: p3.Id}},
		Containers: []*metapb.ContainerReport{{ContainerId: cont, State: metapb.ContainerState_CONTAINER_OPEN}}})
	if err != nil {
		t.Fatal(err)
	}
	var closeP, closeC bool
	for _, c := range r.Commands {
		closeP = closeP || c.GetClosePipeline().GetPipelineId() == p3.Id
		closeC = closeC || c.GetCloseContainer().GetContainerId() == cont
	}
	// The container closes through the pipeline's log first: the
	// pipeline is not left while a replica still reports it open.
	if closeP || !closeC {
		t.Fatalf("commands %v: want close container %d and not yet close pipeline %d", r.Commands, cont, p3.Id)
	}
	// Both live replicas report the container closed → CLOSED.
	for _, id := range ids[1:] {
		if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, FullReport: true,
			Containers: []*metapb.ContainerReport{{ContainerId: cont, State: metapb.ContainerState_CONTAINER_CLOSED, UsedBytes: 123}}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if c := e.st.Container(cont); c.State != metapb.ContainerState_CONTAINER_CLOSED || c.UsedBytes != 123 {
		t.Fatalf("container after reports: %v", c)
	}
	// Now the pipeline goes.
	r, err = e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: ids[1], FullReport: true,
		Pipelines:  []*metapb.PipelineReport{{PipelineId: p3.Id}},
		Containers: []*metapb.ContainerReport{{ContainerId: cont, State: metapb.ContainerState_CONTAINER_CLOSED, UsedBytes: 123}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := findCmd(r.Commands, (*metapb.DatanodeCommand).GetClosePipeline); !ok {
		t.Fatalf("commands %v: want close pipeline %d", r.Commands, p3.Id)
	}
}

func TestIDRangesNeverRepeatAcrossFailover(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 1, IDRangeSize: 7})
	e.register(t, "a", "")
	_ = e.m.Tick(e.ctx)
	seen := map[uint64]bool{}
	alloc := func(m *Manager) {
		r, err := m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 3, Replication: metapb.Replication_ONE})
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range r.Blocks {
			if seen[b.Id.LocalId] {
				t.Fatalf("local id %d handed out twice", b.Id.LocalId)
			}
			seen[b.Id.LocalId] = true
		}
	}
	alloc(e.m)
	// A second manager (a new leader on another replica) takes its own
	// range; the old one continues from its own.
	m2 := NewManager(Config{Now: e.clk.Now, IDRangeSize: 7}, e.st, e.fr)
	if _, err := m2.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: 1}); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		alloc(m2)
		alloc(e.m)
	}
}

func TestDeleteBlocksFlow(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 3, PipelineLimit: 1})
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), ""))
	}
	_ = e.m.Tick(e.ctx)
	r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	b := r.Blocks[0].Id
	if err := e.m.DeleteBlocks(e.ctx, &metapb.DeleteBlocksRequest{Groups: []*metapb.DeleteBlocksGroup{{ContainerId: b.ContainerId, LocalIds: []uint64{b.LocalId}}}}); err != nil {
		t.Fatal(err)
	}
	var tx uint64
	for _, id := range ids {
		hb, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id})
		if err != nil {
			t.Fatal(err)
		}
		var got *metapb.DeleteBlocksCommand
		for _, c := range hb.Commands {
			if d := c.GetDeleteBlocks(); d != nil {
				got = d
			}
		}
		if got == nil || got.ContainerId != b.ContainerId || !slices.Equal(got.LocalIds, []uint64{b.LocalId}) {
			t.Fatalf("datanode %d: delete command %v", id, got)
		}
		tx = got.TxId
	}
	for i, id := range ids {
		if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, DeletedBlockTxs: []uint64{tx}}); err != nil {
			t.Fatal(err)
		}
		_ = e.m.Tick(e.ctx)
		txs, _ := e.st.DeleteTxs(0, 10)
		if i < 2 && len(txs) != 1 {
			t.Fatalf("tx purged after %d of 3 acks", i+1)
		}
		if i == 2 && len(txs) != 0 {
			t.Fatalf("tx not purged after all acks: %v", txs)
		}
	}
}

func TestSnapshotRestore(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 1})
	e.register(t, "a", "/r1")
	_ = e.m.Tick(e.ctx)
	idx, rc, err := e.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	data, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	other := openState(t, t.TempDir())
	defer other.Close()
	if err := other.Restore(idx+1, bytes.NewReader(data)); err == nil {
		t.Fatal("restore with the wrong index accepted")
	}
	if err := other.Restore(idx, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if len(other.Pipelines()) != len(e.st.Pipelines()) || len(other.Containers()) != len(e.st.Containers()) || other.Datanode(1) == nil {
		t.Fatalf("restored state differs")
	}
	if other.AppliedIndex() != idx {
		t.Fatalf("applied %d after restore at %d", other.AppliedIndex(), idx)
	}
}

// TestSmallBlocksChargeWhatTheyUse: allocations for small keys
// (ExpectedBytes) count their size against the container, so many small
// keys share a container; whole-block allocations fill it after
// ContainerSize/BlockSize of them.
func TestSmallBlocksChargeWhatTheyUse(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3, BlockSize: 1 << 20, ContainerSize: 4 << 20})
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2))
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	containers := func(expected uint64, n int) map[uint64]bool {
		seen := map[uint64]bool{}
		for range n {
			r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE, ExpectedBytes: expected})
			if err != nil {
				t.Fatal(err)
			}
			seen[r.Blocks[0].Id.ContainerId] = true
		}
		return seen
	}
	// 200 keys of 4 KiB charge 800 KiB: one container holds them all.
	if got := containers(4096, 200); len(got) != 1 {
		t.Fatalf("200 small allocations spread over %d containers, want 1", len(got))
	}
	// Whole blocks (no expectation, or one at least a block) fill 4 MiB
	// containers every 4 allocations.
	if got := containers(0, 8); len(got) < 2 {
		t.Fatalf("8 whole-block allocations in %d containers, want ≥ 2", len(got))
	}
	if got := containers(2<<20, 8); len(got) < 2 {
		t.Fatalf("8 allocations expecting 2 MiB in %d containers, want ≥ 2", len(got))
	}
	if chargeFor(1, 1<<20) != 4096 || chargeFor(4097, 1<<20) != 8192 || chargeFor(0, 1<<20) != 1<<20 || chargeFor(3<<20, 1<<20) != 1<<20 {
		t.Fatal("chargeFor rounds wrong")
	}
}

// TestNoContainersWithoutRoom: when the open containers are full and the
// pipeline's datanodes report no volume with room for another, allocation
// fails with a clear out-of-space error instead of creating containers the
// datanodes cannot hold; once space is back, allocation works again.
func TestNoContainersWithoutRoom(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3, BlockSize: 1 << 20, ContainerSize: 4 << 20})
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	report := func(avail uint64) {
		for _, id := range ids {
			if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, Volumes: []*metapb.VolumeReport{
				{Path: "/d1", CapacityBytes: 100 << 30, AvailableBytes: avail, AvailableKnown: true},
				{Path: "/d2", CapacityBytes: 100 << 30, AvailableBytes: 1 << 40, AvailableKnown: true, Failed: true}}}); err != nil {
				t.Fatal(err)
			}
		}
	}
	alloc := func() error {
		_, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE})
		return err
	}
	report(3 << 20) // less than a container on the only healthy volume
	var err error
	for range 10 { // fill the open container, then need a new one
		if err = alloc(); err != nil {
			break
		}
	}
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "out of space") || !strings.Contains(err.Error(), "bytes free") {
		t.Fatalf("allocation with no room for a container: %v", err)
	}
	n := len(e.st.Containers())
	for range 5 {
		alloc()
	}
	if len(e.st.Containers()) != n {
		t.Fatalf("containers created on datanodes without room: %d → %d", n, len(e.st.Containers()))
	}
	report(1 << 30)
	if err := alloc(); err != nil {
		t.Fatalf("allocation after space came back: %v", err)
	}
}

// TestNoPipelineOnDatanodeWithoutRoom: a datanode that reports no volume
// with room for a container gets no new pipeline (the fault test's
// pipeline 1012: built on a datanode whose disk was full, its containers
// could not be created there, and it stayed OPEN taking no block); once
// it reports room, it is placed again.
func TestNoPipelineOnDatanodeWithoutRoom(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 2, SafeModeMinDatanodes: 4, BlockSize: 1 << 20, ContainerSize: 4 << 20})
	var ids []uint64
	for i := range 4 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	full := ids[0]
	report := func(id, avail uint64) {
		if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: id, Volumes: []*metapb.VolumeReport{
			{Path: "/d1", CapacityBytes: 100 << 30, AvailableBytes: avail, AvailableKnown: true}}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		report(id, 1<<30)
	}
	report(full, 3<<20) // less than a container
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	three := 0
	for _, p := range e.st.Pipelines() {
		if p.State != metapb.PipelineState_PIPELINE_OPEN {
			continue
		}
		if slices.Contains(p.Datanodes, full) {
			t.Fatalf("pipeline %d %v placed on datanode %d, which has no room for a container", p.Id, p.Datanodes, full)
		}
		if p.Replication == metapb.Replication_THREE {
			three++
		}
	}
	if three == 0 {
		t.Fatal("no THREE pipeline on the three datanodes with room")
	}
	report(full, 1<<30)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	placed := false
	for _, p := range e.st.Pipelines() {
		placed = placed || (p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, full))
	}
	if !placed {
		t.Fatal("datanode with room again got no pipeline")
	}
}
