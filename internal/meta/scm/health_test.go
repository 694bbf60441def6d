package scm

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// newEnvAt is newEnv on a given directory, so a test can reopen the state.
func newEnvAt(t *testing.T, cfg Config, dir string) *env {
	t.Helper()
	st := openState(t, dir)
	clk := newClock()
	cfg.Now = clk.Now
	fr := &fakeRaft{st: st, leader: true, idx: st.Store().AppliedIndex()}
	return &env{st: st, fr: fr, m: NewManager(cfg, st, fr), clk: clk, ctx: context.Background()}
}

func (e *env) alloc(t *testing.T, repl metapb.Replication) *metapb.BlockLocation {
	t.Helper()
	r, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: repl})
	if err != nil {
		t.Fatal(err)
	}
	return r.Blocks[0]
}

func (e *env) report(t testing.TB, dn uint64, reps ...*metapb.ContainerReport) *metapb.HeartbeatResponse {
	t.Helper()
	r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: dn, FullReport: true, Containers: reps})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (e *env) tick(t *testing.T) {
	t.Helper()
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
}

// Issue 11 scenario 1 (SCM side): a replica reported UNHEALTHY stops
// allocation into its container at once, is recorded through Raft (and
// survives a restart), the container closes on the other replicas, and
// the replica is never offered as a location.
func TestUnhealthyReplica(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3}
	e := newEnvAt(t, cfg, dir)
	var ids []uint64
	for i := range 3 {
		ids = append(ids, e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2)))
	}
	e.tick(t)
	b := e.alloc(t, metapb.Replication_THREE)
	cid := b.Id.ContainerId
	bad := b.Datanodes[0].Id

	e.report(t, bad, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY})
	// At once, before any Raft round: no block goes to the container.
	for range 20 {
		if got := e.alloc(t, metapb.Replication_THREE); got.Id.ContainerId == cid {
			t.Fatalf("block allocated in container %d after replica %d reported UNHEALTHY", cid, bad)
		}
	}
	e.tick(t)
	c := e.st.Container(cid)
	if c.State != metapb.ContainerState_CONTAINER_CLOSING || !slices.Equal(c.UnhealthyReplicas, []uint64{bad}) {
		t.Fatalf("container after tick: state %v, unhealthy %v; want CLOSING, [%d]", c.State, c.UnhealthyReplicas, bad)
	}
	_, dns := e.st.ContainerReplicas(cid)
	if len(dns) != 2 || slices.ContainsFunc(dns, func(d *metapb.DatanodeDetails) bool { return d.Id == bad }) {
		t.Fatalf("locations of container %d: %v; the unhealthy replica %d must not be one", cid, dns, bad)
	}
	// The healthy replicas are told to close it; once they report it
	// closed, it is CLOSED (the unhealthy one is not waited for).
	for _, id := range ids {
		if id == bad {
			continue
		}
		r := e.report(t, id, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_OPEN})
		if !slices.ContainsFunc(r.Commands, func(c *metapb.DatanodeCommand) bool { return c.GetCloseContainer().GetContainerId() == cid }) {
			t.Fatalf("datanode %d not told to close container %d: %v", id, cid, r.Commands)
		}
		e.report(t, id, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_CLOSED, UsedBytes: 10})
	}
	e.tick(t)
	if st := e.st.Container(cid).State; st != metapb.ContainerState_CONTAINER_CLOSED {
		t.Fatalf("container %d is %v after the healthy replicas closed it", cid, st)
	}

	// A restart (a new leader reads the same state) keeps it all.
	e.st.Close()
	e = newEnvAt(t, cfg, dir)
	defer e.st.Close()
	c = e.st.Container(cid)
	if c.State != metapb.ContainerState_CONTAINER_CLOSED || !slices.Equal(c.UnhealthyReplicas, []uint64{bad}) {
		t.Fatalf("after restart: state %v, unhealthy %v", c.State, c.UnhealthyReplicas)
	}
	for _, id := range ids {
		e.report(t, id)
	}
	for range 20 {
		if got := e.alloc(t, metapb.Replication_THREE); got.Id.ContainerId == cid {
			t.Fatalf("block allocated in container %d after restart", cid)
		}
	}
}

// A replica that reports a container closed (today's datanodes report an
// UNHEALTHY replica that way) while SCM has it OPEN takes no more writes:
// SCM stops allocating in it and closes it.
func TestReplicaClosedUnderOpenContainer(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3})
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2))
	}
	e.tick(t)
	b := e.alloc(t, metapb.Replication_THREE)
	cid := b.Id.ContainerId
	e.report(t, b.Datanodes[1].Id, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_CLOSED})
	for range 20 {
		if got := e.alloc(t, metapb.Replication_THREE); got.Id.ContainerId == cid {
			t.Fatalf("block allocated in container %d after a replica reported it CLOSED", cid)
		}
	}
	e.tick(t)
	if st := e.st.Container(cid).State; st != metapb.ContainerState_CONTAINER_CLOSING {
		t.Fatalf("container %d is %v, want CLOSING", cid, st)
	}
}

// deleteCmds returns the delete-block commands of a heartbeat response.
func deleteCmds(r *metapb.HeartbeatResponse) []*metapb.DeleteBlocksCommand {
	var out []*metapb.DeleteBlocksCommand
	for _, c := range r.Commands {
		if d := c.GetDeleteBlocks(); d != nil {
			out = append(out, d)
		}
	}
	return out
}

// twoSingles registers two datanodes and returns them with the container
// of each one's ONE pipeline.
func twoSingles(t *testing.T, e *env) (a, b, ca, cb uint64) {
	t.Helper()
	a = e.register(t, "a", "/r1")
	b = e.register(t, "b", "/r2")
	e.tick(t)
	for _, c := range e.st.OpenContainers() {
		switch {
		case slices.Equal(c.Replicas, []uint64{a}):
			ca = c.Id
		case slices.Equal(c.Replicas, []uint64{b}):
			cb = c.Id
		}
	}
	if ca == 0 || cb == 0 {
		t.Fatalf("no ONE containers: %v", e.st.OpenContainers())
	}
	return a, b, ca, cb
}

func (e *env) addDeletes(t *testing.T, cid uint64, n int) {
	t.Helper()
	for n > 0 {
		k := min(n, MaxDeleteGroups)
		req := &metapb.DeleteBlocksRequest{}
		for i := range k {
			req.Groups = append(req.Groups, &metapb.DeleteBlocksGroup{ContainerId: cid, LocalIds: []uint64{uint64(n*10 + i)}})
		}
		if err := e.m.DeleteBlocks(e.ctx, req); err != nil {
			t.Fatal(err)
		}
		n -= k
	}
}

func pendingFor(t *testing.T, st *State, cid uint64) int {
	t.Helper()
	k := 0
	var after uint64
	for {
		txs, err := st.DeleteTxs(after, 1000)
		if err != nil {
			t.Fatal(err)
		}
		for _, tx := range txs {
			if tx.ContainerId == cid {
				k++
			}
			after = tx.TxId
		}
		if len(txs) < 1000 {
			return k
		}
	}
}

// Issue 11 scenario 8: more than a scan's worth of transactions stuck on
// one datanode (it never answers) must not stop deletion on the others.
func TestDeleteTxsBehindStuckOnesAreSentAndPurged(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 2, MaxCommandsPerHeartbeat: 64})
	a, b, ca, cb := twoSingles(t, e)
	e.addDeletes(t, ca, 1500) // a never acknowledges these
	e.addDeletes(t, cb, 100)
	// b acknowledges in each heartbeat what the previous one told it.
	var done []uint64
	for round := 0; round < 50 && pendingFor(t, e.st, cb) > 0; round++ {
		e.heartbeatAll(t, a)
		r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: b, DeletedBlockTxs: done})
		if err != nil {
			t.Fatal(err)
		}
		done = done[:0]
		for _, d := range deleteCmds(r) {
			if d.ContainerId != cb {
				t.Fatalf("datanode %d told to delete in container %d", b, d.ContainerId)
			}
			done = append(done, d.TxId)
		}
		e.tick(t)
	}
	if n := pendingFor(t, e.st, cb); n > 0 {
		t.Fatalf("%d of 100 delete txs of container %d still pending behind 1500 stuck ones", n, cb)
	}
	if n := pendingFor(t, e.st, ca); n != 1500 {
		t.Fatalf("%d txs of the stuck container left, want 1500", n)
	}
}

// The per-datanode "sent" map holds only commands still in flight: acked
// and purged transactions leave it, entries expire after the retry
// interval, a dead datanode's are dropped, and it never exceeds its bound.
func TestSentMapIsBounded(t *testing.T) {
	cfg := Config{SafeModeMinDatanodes: 2, MaxCommandsPerHeartbeat: 8}
	e := newEnv(t, cfg)
	a, b, ca, cb := twoSingles(t, e)
	e.addDeletes(t, ca, 300)
	e.addDeletes(t, cb, 300)
	sent := func(id uint64) int {
		e.m.mu.Lock()
		defer e.m.mu.Unlock()
		return len(e.m.nodes[id].sent)
	}
	limit := e.m.maxSent()
	// b does everything it is told; a does nothing.
	var done []uint64
	for range 200 {
		e.heartbeatAll(t, a)
		r, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: b, DeletedBlockTxs: done})
		if err != nil {
			t.Fatal(err)
		}
		done = done[:0]
		for _, d := range deleteCmds(r) {
			done = append(done, d.TxId)
		}
		e.tick(t)
		if sent(a) > limit || sent(b) > limit {
			t.Fatalf("sent maps %d and %d, bound %d", sent(a), sent(b), limit)
		}
		e.clk.Advance(e.m.cfg.HeartbeatInterval / 4)
	}
	if n := pendingFor(t, e.st, cb); n != 0 {
		t.Fatalf("%d txs of container %d pending", n, cb)
	}
	if n := sent(b); n > 1 { // its ONE pipeline's create at most
		t.Fatalf("datanode %d's sent map holds %d entries after every tx was acked and purged", b, n)
	}
	// a goes dead: its entries go.
	e.clk.Advance(e.m.cfg.DeadInterval)
	e.heartbeatAll(t, b)
	e.tick(t)
	if n := sent(a); n != 0 {
		t.Fatalf("dead datanode %d's sent map holds %d entries", a, n)
	}
}

// Delete results other than DONE: the replica no longer owes the tx (it
// is purged without it). CONTAINER_UNHEALTHY records the replica
// unhealthy, so it is never listed as a location again; CONTAINER_MISSING
// does so only for a CLOSED container (an open one is created on a
// replica by its first write, so missing is no loss).
func TestDeleteAckStatuses(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3})
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2))
	}
	e.tick(t)
	bl := e.alloc(t, metapb.Replication_THREE)
	cid := bl.Id.ContainerId
	reps := e.st.Container(cid).Replicas
	answer := func(statuses map[uint64]metapb.DeleteTxStatus) {
		t.Helper()
		e.addDeletes(t, cid, 1)
		for dn, st := range statuses {
			cmds := deleteCmds(e.report(t, dn))
			if len(cmds) != 1 {
				t.Fatalf("datanode %d: %d delete commands, want 1", dn, len(cmds))
			}
			if _, err := e.m.Heartbeat(e.ctx, &metapb.HeartbeatRequest{DatanodeId: dn, DeleteAcks: []*metapb.DeleteTxAck{{TxId: cmds[0].TxId, Status: st, Message: "why"}}}); err != nil {
				t.Fatal(err)
			}
		}
		e.tick(t)
		if n := pendingFor(t, e.st, cid); n != 0 {
			t.Fatalf("tx still pending after every replica answered %v", statuses)
		}
	}
	answer(map[uint64]metapb.DeleteTxStatus{
		reps[0]: metapb.DeleteTxStatus_DELETE_TX_DONE,
		reps[1]: metapb.DeleteTxStatus_DELETE_TX_CONTAINER_UNHEALTHY,
		reps[2]: metapb.DeleteTxStatus_DELETE_TX_CONTAINER_MISSING,
	})
	c := e.st.Container(cid)
	if !slices.Equal(c.UnhealthyReplicas, []uint64{reps[1]}) || c.State != metapb.ContainerState_CONTAINER_CLOSING {
		t.Fatalf("container: state %v, unhealthy %v; want CLOSING, [%d]", c.State, c.UnhealthyReplicas, reps[1])
	}
	if _, dns := e.st.ContainerReplicas(cid); len(dns) != 2 || slices.ContainsFunc(dns, func(d *metapb.DatanodeDetails) bool { return d.Id == reps[1] }) {
		t.Fatalf("locations %v include the unhealthy replica %d", dns, reps[1])
	}
	// Closed on the healthy replicas; then a replica that lost it.
	for _, dn := range []uint64{reps[0], reps[2]} {
		e.report(t, dn, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_CLOSED})
	}
	e.tick(t)
	if st := e.st.Container(cid).State; st != metapb.ContainerState_CONTAINER_CLOSED {
		t.Fatalf("container %v, want CLOSED", st)
	}
	answer(map[uint64]metapb.DeleteTxStatus{
		reps[0]: metapb.DeleteTxStatus_DELETE_TX_DONE,
		reps[2]: metapb.DeleteTxStatus_DELETE_TX_CONTAINER_MISSING,
	})
	want := slices.Sorted(slices.Values([]uint64{reps[1], reps[2]}))
	if c := e.st.Container(cid); !slices.Equal(c.UnhealthyReplicas, want) {
		t.Fatalf("unhealthy %v after a CLOSED replica went missing, want %v", c.UnhealthyReplicas, want)
	}
}

// countingProposer counts proposals.
type countingProposer struct {
	*fakeRaft
	n int
}

func (c *countingProposer) Propose(ctx context.Context, cmd []byte) (any, error) {
	c.n++
	return c.fakeRaft.Propose(ctx, cmd)
}

// Requests that can only fail are refused before they reach the log.
func TestInvalidSCMRequestsAreNotProposed(t *testing.T) {
	e := newEnv(t, Config{SafeModeMinDatanodes: 1})
	e.register(t, "a", "/r1")
	e.tick(t)
	cp := &countingProposer{fakeRaft: e.fr}
	e.m.prop = cp
	many := make([]*metapb.DeleteBlocksGroup, MaxDeleteGroups+1)
	for i := range many {
		many[i] = &metapb.DeleteBlocksGroup{ContainerId: 1, LocalIds: []uint64{uint64(i)}}
	}
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"delete/too-many-groups", func() error {
			return e.m.DeleteBlocks(e.ctx, &metapb.DeleteBlocksRequest{Groups: many})
		}},
		{"delete/too-many-ids", func() error {
			return e.m.DeleteBlocks(e.ctx, &metapb.DeleteBlocksRequest{Groups: []*metapb.DeleteBlocksGroup{{ContainerId: 1, LocalIds: make([]uint64, MaxLocalIDsPerGroup+1)}}})
		}},
		{"allocate/count", func() error {
			_, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: MaxBlocksPerRequest + 1})
			return err
		}},
		{"allocate/replication", func() error {
			_, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: 2})
			return err
		}},
		{"allocate/exclude", func() error {
			_, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_ONE, Exclude: &metapb.ExcludeList{Containers: make([]uint64, 5000)}})
			return err
		}},
		{"register/no-uuid", func() error {
			_, err := e.m.Register(e.ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{DataAddr: "a", RaftAddr: "b"}})
			return err
		}},
	} {
		before := cp.n
		if err := tc.call(); code(err) != codes.InvalidArgument {
			t.Errorf("%s: got %v, want InvalidArgument", tc.name, err)
		}
		if cp.n != before {
			t.Errorf("%s: %d proposals for a request that can only fail", tc.name, cp.n-before)
		}
	}
}
