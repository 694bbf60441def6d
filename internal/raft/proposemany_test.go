package raft

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// bigBatches counts the leader's log-store batches of more than 16 entries.
func bigBatches(h *Host) uint64 {
	var m dto.Metric
	if err := h.metrics.batchEntries.Write(&m); err != nil {
		return 0
	}
	small := uint64(0)
	for _, b := range m.GetHistogram().GetBucket() {
		if b.GetUpperBound() == 16 {
			small = b.GetCumulativeCount()
		}
	}
	return m.GetHistogram().GetSampleCount() - small
}

// TestProposeManyOneBatch: ProposeMany's entries (with data kept out of
// the log) each commit at their own index on every replica, with their own
// data, and reach the leader's log store in one batch (one append, one
// fsync) rather than one per entry; an entry that cannot be proposed
// (too large) fails alone.
func TestProposeManyOneBatch(t *testing.T) {
	c := newTCPCluster(t, 3, 20*time.Millisecond)
	sms := map[uint64]*dataSM{}
	for id, h := range c.hosts {
		sms[id] = &dataSM{dir: filepath.Join(c.dir, fmt.Sprint(id), "data")}
		os.MkdirAll(sms[id].dir, 0o755)
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: sms[id]}); err != nil {
			t.Fatal(err)
		}
	}
	all := []uint64{1, 2, 3}
	var lead *Group
	deadline := time.Now().Add(30 * time.Second)
	for lead == nil {
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		lead = c.leaderOf(1, all)
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// Settle: an entry alone first.
	if _, err := lead.Propose(ctx, []byte("first"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	const n = 32
	metas, datas := make([][]byte, n), make([][]byte, n)
	for i := range n {
		metas[i] = fmt.Appendf(nil, "m%d", i)
		datas[i] = bytes.Repeat([]byte{byte(i)}, 1000+i)
	}
	datas[5] = make([]byte, lead.host.cfg.MaxProposalBytes+1)
	before := bigBatches(lead.host)
	res, errs := lead.ProposeMany(ctx, metas, datas)
	if bigBatches(lead.host) != before+1 {
		t.Errorf("the leader wrote %d batches of more than 16 entries for %d entries proposed together, want 1", bigBatches(lead.host)-before, n-1)
	}
	seen := map[uint64]bool{}
	for i := range n {
		if i == 5 {
			if errs[i] == nil {
				t.Fatalf("entry %d of %d bytes: accepted", i, len(datas[i]))
			}
			continue
		}
		if errs[i] != nil || res[i].Index == 0 || seen[res[i].Index] {
			t.Fatalf("entry %d: %+v, %v", i, res[i], errs[i])
		}
		seen[res[i].Index] = true
	}
	if err := lead.WaitAppliedAll(ctx, res[n-1].Index); err != nil {
		t.Fatal(err)
	}
	for id, sm := range sms {
		for i := range n {
			if i == 5 {
				continue
			}
			files, _ := filepath.Glob(filepath.Join(sm.dir, fmt.Sprintf("%d-*", res[i].Index)))
			if len(files) != 1 {
				t.Fatalf("host %d: entry %d: data files %v", id, i, files)
			}
			got, err := os.ReadFile(files[0])
			if err != nil || !bytes.Equal(got, datas[i]) {
				t.Fatalf("host %d: entry %d's data: %d bytes, %v", id, i, len(got), err)
			}
		}
	}
}

// TestProposeManyWaitsForBudget: with the leader's inflight budget
// smaller than a batch, ProposeMany's entries wait for budget as Propose's
// would instead of failing as dropped (which the datanode reports as
// NOT_LEADER): four 1,500-byte entries under a 4,000-byte budget, then an
// entry larger than what the batch's own earlier entries leave free, then
// one larger than the whole budget. An entry still without budget when the
// context ends fails with the context's error, not as dropped.
func TestProposeManyWaitsForBudget(t *testing.T) {
	c := newTCPCluster(t, 3, 20*time.Millisecond)
	for id, h := range c.hosts {
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &dataSM{dir: filepath.Join(c.dir, fmt.Sprint(id), "data")}}); err != nil {
			t.Fatal(err)
		}
		os.MkdirAll(filepath.Join(c.dir, fmt.Sprint(id), "data"), 0o755)
	}
	all := []uint64{1, 2, 3}
	var lead *Group
	deadline := time.Now().Add(30 * time.Second)
	for lead == nil {
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		lead = c.leaderOf(1, all)
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := lead.Propose(ctx, []byte("first"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	// Only this goroutine proposes to the leader: no concurrent reader.
	lead.host.cfg.MaxInflightBytes = 4000
	propose := func(ctx context.Context, sizes ...int) []error {
		metas, datas := make([][]byte, len(sizes)), make([][]byte, len(sizes))
		for i, sz := range sizes {
			metas[i] = fmt.Appendf(nil, "m%d", i)
			datas[i] = bytes.Repeat([]byte{byte(i + 1)}, sz-len(metas[i]))
		}
		res, errs := lead.ProposeMany(ctx, metas, datas)
		seen := map[uint64]bool{}
		for i, err := range errs {
			if err == nil && (res[i].Index == 0 || seen[res[i].Index]) {
				t.Fatalf("entry %d: index %d", i, res[i].Index)
			}
			seen[res[i].Index] = true
		}
		return errs
	}
	for _, sizes := range [][]int{
		{1500, 1500, 1500, 1500}, // the reviewer's case
		{1500, 1500, 3500},       // more than the batch's own entries leave free
		{1500, 5000, 1500},       // more than the whole budget: waits for none in flight
	} {
		for i, err := range propose(ctx, sizes...) {
			if err != nil {
				t.Fatalf("sizes %v: entry %d: %v", sizes, i, err)
			}
		}
	}
	// Budget held elsewhere (as by proposals of other callers) and never
	// freed in time: the entry that does not fit fails with the context's
	// error; the one that fits commits.
	if err := lead.acquire(ctx, 2000); err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 2*time.Second)
	defer cancelShort()
	errs := propose(short, 1500, 2500)
	if errs[0] != nil {
		t.Errorf("entry 0, within the budget: %v", errs[0])
	}
	if errs[1] == nil || errors.Is(errs[1], ErrProposalDropped) || !errors.Is(errs[1], context.DeadlineExceeded) {
		t.Errorf("entry 1, over the budget until the context ended: %v, want a context error, not dropped", errs[1])
	}
	lead.pmu.Lock()
	lead.releaseLocked(2000)
	lead.pmu.Unlock()
}

// TestProposeManyAsyncOneBatch: ProposeManyAsync (the simulator's way to
// propose a batch of small files) hands its entries to raft together as
// ProposeMany does: one log-store batch, each entry its own index, done
// called once per proposed entry; an entry that cannot be proposed gets
// its error at once and no callback.
func TestProposeManyAsyncOneBatch(t *testing.T) {
	c := newTCPCluster(t, 3, 20*time.Millisecond)
	for id, h := range c.hosts {
		dir := filepath.Join(c.dir, fmt.Sprint(id), "data")
		os.MkdirAll(dir, 0o755)
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &dataSM{dir: dir}}); err != nil {
			t.Fatal(err)
		}
	}
	var lead *Group
	deadline := time.Now().Add(30 * time.Second)
	for lead == nil {
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		lead = c.leaderOf(1, []uint64{1, 2, 3})
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := lead.Propose(ctx, []byte("first"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	const n = 24
	metas, datas := make([][]byte, n), make([][]byte, n)
	for i := range n {
		metas[i] = fmt.Appendf(nil, "m%d", i)
		datas[i] = bytes.Repeat([]byte{byte(i)}, 500+i)
	}
	datas[3] = make([]byte, lead.host.cfg.MaxProposalBytes+1)
	type outcome struct {
		i   int
		res Result
		err error
	}
	outc := make(chan outcome, 2*n)
	before := bigBatches(lead.host)
	errs := lead.ProposeManyAsync(metas, datas, func(i int, res Result, err error) { outc <- outcome{i, res, err} })
	for i, err := range errs {
		if (i == 3) != (err != nil) {
			t.Fatalf("entry %d: %v", i, err)
		}
	}
	seen, indexes := map[int]bool{}, map[uint64]bool{}
	for range n - 1 {
		select {
		case o := <-outc:
			if o.err != nil || seen[o.i] || o.i == 3 || o.res.Index == 0 || indexes[o.res.Index] {
				t.Fatalf("callback for entry %d: %+v, %v (seen %v)", o.i, o.res, o.err, seen[o.i])
			}
			seen[o.i], indexes[o.res.Index] = true, true
		case <-ctx.Done():
			t.Fatalf("%d callbacks of %d", len(seen), n-1)
		}
	}
	select {
	case o := <-outc:
		t.Fatalf("an extra callback: entry %d", o.i)
	case <-time.After(200 * time.Millisecond):
	}
	if got := bigBatches(lead.host) - before; got != 1 {
		t.Errorf("the leader wrote %d batches of more than 16 entries for %d entries proposed together, want 1", got, n-1)
	}
}
