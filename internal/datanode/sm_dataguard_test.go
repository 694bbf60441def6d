package datanode

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// The guards of WriteData, ReadData and Restore (a runtime error there is
// a bug every replica would meet alike: without a guard it takes the
// datanode down, and again at every restart). Without the guards these
// tests panic.

// injectRuntimeError hits a runtime error (an index out of range).
func injectRuntimeError(i uint64) {
	var none []int
	_ = none[i]
}

// errorLines returns the ERROR lines of logs.
func errorLines(logs string) []string {
	var out []string
	for l := range strings.SplitSeq(logs, "\n") {
		if strings.Contains(l, "level=ERROR") {
			out = append(out, l)
		}
	}
	return out
}

// TestWriteDataRuntimeErrorLosesChunk: WriteData of a follower (it
// verifies) meets a runtime error for entry 2 (a WriteChunk into
// container 2). The datanode goes on: WriteData returns nil (an error
// would stop the group for good), the chunk counts as lost here, container
// 2 goes UNHEALTHY here, durably, the PutBlock that needs the chunk fails
// with the cause, one ERROR line names the entry and the panic, the
// counter counts it, and the entries into container 3 write and apply.
func TestWriteDataRuntimeErrorLosesChunk(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	defer st.Close()
	sm.applyHook = nil
	sm.writeHook = func(index uint64, _ *datanodepb.ContainerCommand) {
		if index == 2 {
			injectRuntimeError(index)
		}
	}
	d2, d3 := randBytes(41, 4096), randBytes(42, 3000)
	ents := []raft.Entry{
		rvCmd(1, &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: 9}}}),
		writeChunkEntry(2, 2, 20, 0, d2), // hits the runtime error
		putBlockEntry(3, 2, 20, d2),      // needs its chunk
		smallFileEntry(4, 3, 30, d3),
	}
	for _, w := range []struct {
		i int
		d []byte
	}{{1, d2}, {3, d3}} {
		if err := sm.WriteData(ents[w.i].Index, ents[w.i].Term, ents[w.i].Meta, w.d); err != nil {
			t.Fatalf("WriteData(%d): %v, want nil (the group goes on)", ents[w.i].Index, err)
		}
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	if n := sm.stats.writePanics.Load(); n != 1 {
		t.Errorf("write panics counted: %d, want 1", n)
	}
	if c, err := st.Container(2); err != nil || c.State != storage.StateUnhealthy {
		t.Errorf("container 2 after WriteData's panic: %+v %v, want UNHEALTHY", c, err)
	}
	if why, ok := sm.lacks(2); !ok || !strings.Contains(why, "WriteData failed") {
		t.Errorf("container 2 not recorded as lacking: %v %q", ok, why)
	}
	res := sm.Apply(ents)
	if err, _ := res[2].(error); err == nil || !errors.Is(err, storage.ErrContainerNotOpen) {
		t.Errorf("PutBlock needing the lost chunk: %v, want it failed", res[2])
	}
	if res[3] != nil {
		t.Errorf("small file into container 3: %v", res[3])
	}
	got := make([]byte, len(d3))
	if _, err := st.ReadAt(3, 30, got, 0); err != nil || !bytes.Equal(got, d3) {
		t.Errorf("block 3/30: %v", err)
	}
	if got := sm.applied.Load(); got != 4 {
		t.Errorf("applied index %d, want 4", got)
	}
	el := errorLines(logs.String())
	if len(el) != 1 || !strings.Contains(el[0], "index=2") || !strings.Contains(el[0], "command=WriteChunk") ||
		!strings.Contains(el[0], "index out of range") || !strings.Contains(el[0], "stack=") {
		t.Errorf("ERROR lines: %q, want one naming entry 2, WriteChunk, the panic and the stack", el)
	}
}

// TestWriteDataRuntimeErrorAfterStore: the runtime error is raised after
// storage stored the chunk (it holds the span, which is not listed for
// SyncData). The container still goes UNHEALTHY and lacking, the PutBlock
// that needs the chunk fails although storage holds its bytes, the next
// batch into another container of the volume syncs (storage's dirty span
// is flushed with it, nothing waits on it) and applies.
func TestWriteDataRuntimeErrorAfterStore(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	sm.applyHook = nil
	sm.storedHook = func(index uint64) {
		if index == 1 {
			injectRuntimeError(index)
		}
	}
	d1, d3 := randBytes(51, 4096), randBytes(52, 3000)
	ents := []raft.Entry{writeChunkEntry(1, 2, 20, 0, d1), putBlockEntry(2, 2, 20, d1), smallFileEntry(3, 3, 30, d3)}
	type outcome struct {
		errs []error
		res  []any
	}
	done := make(chan outcome, 1) // not t.Error in the goroutine: it may outlive the test
	go func() {
		var o outcome
		o.errs = append(o.errs, sm.WriteData(ents[0].Index, ents[0].Term, ents[0].Meta, d1))
		o.errs = append(o.errs, sm.WriteData(ents[2].Index, ents[2].Term, ents[2].Meta, d3))
		o.errs = append(o.errs, sm.SyncData())
		o.res = sm.Apply(ents)
		done <- o
	}()
	var o outcome
	select {
	case o = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("WriteData, SyncData and Apply after a panic past the storage write did not return in 5 s")
	}
	defer st.Close()
	for i, err := range o.errs {
		if err != nil {
			t.Errorf("call %d: %v, want nil (the group goes on)", i, err)
		}
	}
	if n := sm.stats.writePanics.Load(); n != 1 {
		t.Errorf("write panics counted: %d, want 1", n)
	}
	if ok, _ := st.HasChunk(2, 20, 0, int64(len(d1))); !ok {
		t.Error("storage does not hold the chunk: the panic was not after the write")
	}
	if c, err := st.Container(2); err != nil || c.State != storage.StateUnhealthy {
		t.Errorf("container 2: %+v %v, want UNHEALTHY", c, err)
	}
	if why, ok := sm.lacks(2); !ok || !strings.Contains(why, "WriteData failed") {
		t.Errorf("container 2 not recorded as lacking: %v %q", ok, why)
	}
	if err, _ := o.res[1].(error); !errors.Is(err, storage.ErrContainerNotOpen) {
		t.Errorf("PutBlock of the chunk whose WriteData panicked: %v, want it failed", o.res[1])
	}
	if o.res[2] != nil {
		t.Errorf("small file into container 3: %v", o.res[2])
	}
}

// TestWriteDataOtherPanicGoesUp: a panic in WriteData that is not a
// runtime error is not swallowed.
func TestWriteDataOtherPanicGoesUp(t *testing.T) {
	_, st, sm := guardReplica(t, io.Discard)
	defer st.Close()
	boom := errors.New("volume write failed")
	sm.writeHook = func(uint64, *datanodepb.ContainerCommand) { panic(boom) }
	e := smallFileEntry(1, 1, 10, randBytes(43, 100))
	defer func() {
		if r := recover(); r != boom {
			t.Errorf("recovered %v, want the panic to go up", r)
		}
		if n := sm.stats.writePanics.Load(); n != 0 {
			t.Errorf("write panics counted: %d", n)
		}
	}()
	sm.WriteData(e.Index, e.Term, e.Meta, randBytes(43, 100))
	t.Error("WriteData returned")
}

// TestSyncDataRuntimeErrorLosesBatch: SyncData meets a runtime error with
// the chunks of a batch (containers 1 and 2) written and not yet checked:
// it returns nil (the group goes on), both chunks count as lost and both
// containers go UNHEALTHY here, the PutBlocks that need them fail, the
// counter counts it, and the next batch, into container 3, syncs and
// applies.
func TestSyncDataRuntimeErrorLosesBatch(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	defer st.Close()
	sm.applyHook = nil
	d1, d2, d3 := randBytes(46, 4096), randBytes(47, 4096), randBytes(48, 3000)
	w1, w2 := writeChunkEntry(1, 1, 10, 0, d1), writeChunkEntry(2, 2, 20, 0, d2)
	for _, w := range []struct {
		e raft.Entry
		d []byte
	}{{w1, d1}, {w2, d2}} {
		if err := sm.WriteData(w.e.Index, w.e.Term, w.e.Meta, w.d); err != nil {
			t.Fatal(err)
		}
	}
	sm.syncHook = func() { injectRuntimeError(3) }
	if err := sm.SyncData(); err != nil {
		t.Fatalf("SyncData: %v, want nil (the group goes on)", err)
	}
	sm.syncHook = nil
	if n := sm.stats.syncPanics.Load(); n != 1 {
		t.Errorf("sync panics counted: %d, want 1", n)
	}
	for _, cid := range []uint64{1, 2} {
		if c, err := st.Container(storage.ContainerID(cid)); err != nil || c.State != storage.StateUnhealthy {
			t.Errorf("container %d: %+v %v, want UNHEALTHY", cid, c, err)
		}
		if why, ok := sm.lacks(cid); !ok || !strings.Contains(why, "SyncData failed") {
			t.Errorf("container %d not recorded as lacking: %v %q", cid, ok, why)
		}
	}
	w3 := smallFileEntry(5, 3, 30, d3)
	if err := sm.WriteData(w3.Index, w3.Term, w3.Meta, d3); err != nil {
		t.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	res := sm.Apply([]raft.Entry{w1, w2, putBlockEntry(3, 1, 10, d1), putBlockEntry(4, 2, 20, d2), w3})
	for i := 2; i <= 3; i++ {
		if res[i] == nil {
			t.Errorf("PutBlock %d of a lost chunk succeeded", i+1)
		}
	}
	if res[4] != nil {
		t.Errorf("small file into container 3: %v", res[4])
	}
	if el := errorLines(logs.String()); len(el) != 1 || !strings.Contains(el[0], "SyncData failed") || !strings.Contains(el[0], "chunks=2") {
		t.Errorf("ERROR lines: %q", el)
	}
}

// TestSyncDataRuntimeErrorInStorageRound: the runtime error is raised
// inside storage's sync round (blocks locked, round registered), which
// SyncData's guard recovers. The round is finished on the way out
// (storage's syncRound), so the datanode does not go on with a wedged
// round: the batch's container goes UNHEALTHY as for any SyncData panic,
// and the next batch, into another container on the same volume, syncs
// and applies (it hung for good when the round stayed registered with its
// blocks locked, and with it the host's raft loop).
func TestSyncDataRuntimeErrorInStorageRound(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	sm.applyHook = nil
	d1, d2 := randBytes(46, 4096), randBytes(47, 4096)
	w1 := writeChunkEntry(1, 1, 10, 0, d1)
	if err := sm.WriteData(w1.Index, w1.Term, w1.Meta, d1); err != nil {
		t.Fatal(err)
	}
	st.SetTestHook(func(p string) {
		if p == "sync round: blocks locked" {
			st.SetTestHook(nil)
			injectRuntimeError(3)
		}
	})
	if err := sm.SyncData(); err != nil {
		t.Fatalf("SyncData: %v, want nil (the group goes on)", err)
	}
	if n := sm.stats.syncPanics.Load(); n != 1 {
		t.Errorf("sync panics counted: %d, want 1", n)
	}
	if c, err := st.Container(1); err != nil || c.State != storage.StateUnhealthy {
		t.Errorf("container 1: %+v %v, want UNHEALTHY", c, err)
	}
	w2 := writeChunkEntry(2, 2, 20, 0, d2) // another container, same volume
	type outcome struct {
		werr, serr error
		res        []any
	}
	done := make(chan outcome, 1) // not t.Error in the goroutine: it may outlive the test
	go func() {
		var o outcome
		o.werr = sm.WriteData(w2.Index, w2.Term, w2.Meta, d2)
		o.serr = sm.SyncData()
		o.res = sm.Apply([]raft.Entry{w1, w2, putBlockEntry(3, 1, 10, d1), putBlockEntry(4, 2, 20, d2)})
		done <- o
	}()
	select {
	case o := <-done:
		if o.werr != nil || o.serr != nil {
			t.Errorf("next batch: WriteData %v, SyncData %v", o.werr, o.serr)
		}
		res := o.res
		if res[2] == nil {
			t.Error("PutBlock of the chunk whose sync round panicked succeeded")
		}
		if res[3] != nil {
			t.Errorf("PutBlock into container 2 after the panicked round: %v", res[3])
		}
	case <-time.After(5 * time.Second):
		// The store is left open: Close would wait for the locks.
		t.Fatal("the next batch (another container, same volume) did not sync and apply in 5 s: the panicked round wedged the volume")
	}
	if sm.stats.syncPanics.Load() != 1 {
		t.Errorf("sync panics counted: %d, want 1", sm.stats.syncPanics.Load())
	}
	st.Close()
}

// TestReadDataRuntimeErrorIsDataLost: a leader's ReadData (a resend)
// that meets a runtime error answers raft.ErrDataLost (the entry goes out
// without its data, the follower records the loss) instead of taking the
// leader's datanode down; nothing is marked here (a read changes
// nothing); one ERROR line and the counter.
func TestReadDataRuntimeErrorIsDataLost(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	defer st.Close()
	d := randBytes(44, 4096)
	e := writeChunkEntry(1, 1, 10, 0, d)
	if err := sm.WriteData(e.Index, e.Term, e.Meta, d); err != nil {
		t.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	if got, err := sm.ReadData(e.Index, e.Term, e.Meta); err != nil || !bytes.Equal(got, d) {
		t.Fatalf("ReadData before: %v", err)
	}
	sm.readHook = injectRuntimeError
	got, err := sm.ReadData(e.Index, e.Term, e.Meta)
	if got != nil || !errors.Is(err, raft.ErrDataLost) || !strings.Contains(err.Error(), "index out of range") {
		t.Errorf("ReadData: %d bytes, %v; want raft.ErrDataLost naming the panic", len(got), err)
	}
	if n := sm.stats.readPanics.Load(); n != 1 {
		t.Errorf("read panics counted: %d, want 1", n)
	}
	if c, err := st.Container(1); err != nil || c.State != storage.StateOpen {
		t.Errorf("container 1: %+v %v, want OPEN (a read marks nothing)", c, err)
	}
	if el := errorLines(logs.String()); len(el) != 1 || !strings.Contains(el[0], "index=1") {
		t.Errorf("ERROR lines: %q", el)
	}
}

// TestReadDataRuntimeErrorLogRateLimited: a ReadData bug met on every
// read (each resend reads each entry it carries, for each lagging
// follower) logs its ERROR line with the stack at most once a minute per
// pipeline; the counter counts every one, and the next line, a minute
// on, says how many were not logged.
func TestReadDataRuntimeErrorLogRateLimited(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	defer st.Close()
	d := randBytes(44, 4096)
	e := writeChunkEntry(1, 1, 10, 0, d)
	if err := sm.WriteData(e.Index, e.Term, e.Meta, d); err != nil {
		t.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	sm.readHook = injectRuntimeError
	for range 3 {
		if _, err := sm.ReadData(e.Index, e.Term, e.Meta); !errors.Is(err, raft.ErrDataLost) {
			t.Fatalf("ReadData: %v, want raft.ErrDataLost", err)
		}
	}
	if n := sm.stats.readPanics.Load(); n != 3 {
		t.Errorf("read panics counted: %d, want 3", n)
	}
	if el := errorLines(logs.String()); len(el) != 1 || !strings.Contains(el[0], "stack=") || !strings.Contains(el[0], "not_logged_since_last=0") {
		t.Fatalf("ERROR lines after 3 failed reads within a minute: %q, want 1 with the stack", el)
	}
	sm.readPanicLog.at.Add(-int64(rateLogEvery)) // a minute on
	if _, err := sm.ReadData(e.Index, e.Term, e.Meta); !errors.Is(err, raft.ErrDataLost) {
		t.Fatalf("ReadData: %v, want raft.ErrDataLost", err)
	}
	if n := sm.stats.readPanics.Load(); n != 4 {
		t.Errorf("read panics counted: %d, want 4", n)
	}
	if el := errorLines(logs.String()); len(el) != 2 || !strings.Contains(el[1], "not_logged_since_last=2") {
		t.Errorf("ERROR lines a minute on: %q, want a second one naming the 2 not logged", el)
	}
}

// TestRestoreRuntimeErrorRefused: a snapshot install that meets a runtime
// error while it holds the state machine's lock (recordRestore) is
// refused: Restore returns an error, the applied index and the lacking
// list stay as they were, the lock is released (the next Restore and
// Apply complete; a lock left held would hang them), and the snapshot,
// sent again, installs.
func TestRestoreRuntimeErrorRefused(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	defer st.Close()
	sm.applyHook = nil
	d := randBytes(45, 3000)
	e := smallFileEntry(1, 1, 10, d)
	if err := sm.WriteData(e.Index, e.Term, e.Meta, d); err != nil {
		t.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	rvApply(t, sm, e)
	snap, err := json.Marshal(smSnapshot{Index: 10, Pipeline: 1000, Containers: []uint64{1, 5}})
	if err != nil {
		t.Fatal(err)
	}
	sm.restoreHook = injectRuntimeError
	err = sm.Restore(10, bytes.NewReader(snap))
	if err == nil || !strings.Contains(err.Error(), "index out of range") {
		t.Errorf("Restore: %v, want the failure", err)
	}
	if n := sm.stats.restorePanics.Load(); n != 1 {
		t.Errorf("restore panics counted: %d, want 1", n)
	}
	if el := errorLines(logs.String()); len(el) != 1 || !strings.Contains(el[0], "snapshot=10") {
		t.Errorf("ERROR lines: %q", el)
	}
	sm.restoreHook = nil
	// The checks run on a goroutine (a lock left held would hang them) and
	// report on a channel: a t.Errorf there could outlive a timed-out test.
	done := make(chan []string, 1)
	go func() {
		var errs []string
		if got := sm.applied.Load(); got != 1 {
			errs = append(errs, fmt.Sprintf("applied index after the refused snapshot: %d, want 1", got))
		}
		if _, ok := sm.lacks(1); ok {
			errs = append(errs, "container 1 recorded as lacking by the refused snapshot")
		}
		if got := sm.restoredIndex(); got != 0 {
			errs = append(errs, fmt.Sprintf("restored index after the refused snapshot: %d, want 0", got))
		}
		if err := sm.Restore(10, bytes.NewReader(snap)); err != nil {
			errs = append(errs, fmt.Sprintf("Restore sent again: %v", err))
		}
		if _, ok := sm.lacks(1); !ok {
			errs = append(errs, "container 1 not recorded as lacking after the snapshot")
		}
		if got := sm.applied.Load(); got != 10 {
			errs = append(errs, fmt.Sprintf("applied index after the snapshot: %d, want 10", got))
		}
		done <- errs
	}()
	select {
	case errs := <-done:
		for _, e := range errs {
			t.Error(e)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the state machine's lock stayed held after the recovered panic")
	}
}

// TestRestoreRuntimeErrorLogRateLimited: a snapshot install that fails on
// every resend (a bug met each time) logs its stack at most once a minute
// per pipeline; every failure is still refused and counted, and the next
// line let through names how many were held back.
func TestRestoreRuntimeErrorLogRateLimited(t *testing.T) {
	var logs lockedBuf
	_, st, sm := guardReplica(t, &logs)
	defer st.Close()
	sm.applyHook = nil
	snap, err := json.Marshal(smSnapshot{Index: 10, Pipeline: 1000, Containers: []uint64{1}})
	if err != nil {
		t.Fatal(err)
	}
	sm.restoreHook = injectRuntimeError
	for i := 0; i < 3; i++ {
		if err := sm.Restore(10, bytes.NewReader(snap)); err == nil {
			t.Fatalf("Restore %d: accepted, want the failure", i)
		}
	}
	if n := sm.stats.restorePanics.Load(); n != 3 {
		t.Errorf("restore panics counted: %d, want 3", n)
	}
	if el := errorLines(logs.String()); len(el) != 1 {
		t.Errorf("ERROR lines for 3 failed installs within a minute: %d (%q), want 1", len(el), el)
	}
	sm.restorePanicLog.at.Add(-int64(rateLogEvery)) // a minute on
	if err := sm.Restore(10, bytes.NewReader(snap)); err == nil {
		t.Fatal("Restore a minute on: accepted, want the failure")
	}
	if el := errorLines(logs.String()); len(el) != 2 || !strings.Contains(el[1], "not_logged_since_last=2") {
		t.Errorf("ERROR lines a minute on: %q, want a second one naming the 2 not logged", el)
	}
	if got := sm.applied.Load(); got != 0 {
		t.Errorf("applied index after refused snapshots: %d, want 0", got)
	}
}

// TestDataGuardMetrics: basalt_datanode_apply_panics_total has one series
// per stage, each reading its counter.
func TestDataGuardMetrics(t *testing.T) {
	d := &Datanode{}
	d.stats.applyPanics.Add(1)
	d.stats.writePanics.Add(2)
	d.stats.syncPanics.Add(3)
	d.stats.readPanics.Add(4)
	d.stats.restorePanics.Add(5)
	cs := d.applyCollectors()
	if len(cs) != 5 {
		t.Fatalf("%d collectors, want 5", len(cs))
	}
	for i, stage := range []string{"apply", "write_data", "sync_data", "read_data", "restore"} {
		desc := cs[i].(interface{ Desc() *prometheus.Desc }).Desc().String()
		if !strings.Contains(desc, "basalt_datanode_apply_panics_total") || !strings.Contains(desc, `stage="`+stage+`"`) {
			t.Errorf("collector %d: %s, want stage %s", i, desc, stage)
		}
		if got := testutil.ToFloat64(cs[i]); got != float64(i+1) {
			t.Errorf("stage %s = %v, want %d", stage, got, i+1)
		}
	}
}
