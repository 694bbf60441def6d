package datanode

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// lockedBuf is a log sink the test reads.
type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// guardReplica is a fresh replica on the in-memory vfs whose hook makes
// entry 2 (a PutSmallFile into container 2) hit a runtime error (an index out of
// range), as a bug the leader's checks let through would on every
// replica.
func guardReplica(t *testing.T, logs io.Writer) (*vfs.MemFS, *storage.Store, *containerSM) {
	t.Helper()
	fs := vfs.NewMem(vfs.MemOptions{})
	st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	sm.applyHook = func(e raft.Entry, cmd *datanodepb.ContainerCommand) {
		if e.Index == 2 {
			var none []int
			_ = none[e.Index] // runtime error: index out of range
		}
	}
	return fs, st, sm
}

// TestApplyRuntimeErrorFailsEntry: a committed entry whose apply hits a
// runtime error does not take the replica's process down (on every
// replica alike, in a crash loop). On each of three replicas: the entry
// fails (its waiter gets the error, the failure is recorded for
// ApplyStatus), its container goes UNHEALTHY here, durably (sickFile: a
// restart marks it again), one ERROR line names the entry, the command
// and the panic, the counter counts it, and the entries after it, into
// other containers, apply. Without the guard the test panics.
func TestApplyRuntimeErrorFailsEntry(t *testing.T) {
	d1, d2, d3, d4 := randBytes(21, 3000), randBytes(22, 3000), randBytes(23, 3000), randBytes(24, 3000)
	ents := []raft.Entry{
		smallFileEntry(1, 1, 10, d1),
		smallFileEntry(2, 2, 20, d2), // hits the runtime error
		smallFileEntry(3, 3, 30, d3),
		smallFileEntry(4, 2, 21, d4), // container 2 is UNHEALTHY here now
	}
	datas := [][]byte{d1, d2, d3, d4}
	var states []string
	for rep := range 3 {
		var logs lockedBuf
		fs, st, sm := guardReplica(t, &logs)
		for i, e := range ents {
			if err := sm.WriteData(e.Index, e.Term, e.Meta, datas[i]); err != nil {
				t.Fatal(err)
			}
		}
		if err := sm.SyncData(); err != nil {
			t.Fatal(err)
		}
		res := sm.Apply(ents)
		for _, i := range []int{0, 2} {
			if res[i] != nil {
				t.Errorf("replica %d: entry %d into another container: %v", rep, ents[i].Index, res[i])
			}
		}
		err2, _ := res[1].(error)
		if err2 == nil || !strings.Contains(err2.Error(), "failed in apply") || !errors.Is(err2, storage.ErrContainerNotOpen) {
			t.Errorf("replica %d: entry 2's result: %v, want the apply failure", rep, res[1])
		}
		if res[3] == nil {
			t.Errorf("replica %d: entry 4 into the UNHEALTHY container succeeded", rep)
		}
		if why, ok := sm.failure(2); !ok || !strings.Contains(why, "index out of range") {
			t.Errorf("replica %d: failure of entry 2 recorded: %v %q", rep, ok, why)
		}
		if c, err := st.Container(2); err != nil || c.State != storage.StateUnhealthy {
			t.Errorf("replica %d: container 2: %+v %v, want UNHEALTHY", rep, c, err)
		}
		if why, ok := sm.lacks(2); !ok || !strings.Contains(why, "PutSmallFile") {
			t.Errorf("replica %d: container 2 not recorded as lacking: %v %q", rep, ok, why)
		}
		for _, b := range []struct {
			cid storage.ContainerID
			lid storage.LocalID
			d   []byte
		}{{1, 10, d1}, {3, 30, d3}} {
			got := make([]byte, len(b.d))
			if _, err := st.ReadAt(b.cid, b.lid, got, 0); err != nil || !bytes.Equal(got, b.d) {
				t.Errorf("replica %d: block %d/%d after the failed entry: %v", rep, b.cid, b.lid, err)
			}
		}
		if c, err := st.Container(3); err != nil || c.State != storage.StateOpen {
			t.Errorf("replica %d: container 3: %+v %v, want OPEN", rep, c, err)
		}
		if n := sm.stats.applyPanics.Load(); n != 1 {
			t.Errorf("replica %d: apply panics counted: %d, want 1", rep, n)
		}
		if got := sm.applied.Load(); got != 4 {
			t.Errorf("replica %d: applied index %d, want 4", rep, got)
		}
		var errLines []string
		for l := range strings.SplitSeq(logs.String(), "\n") {
			if strings.Contains(l, "level=ERROR") {
				errLines = append(errLines, l)
			}
		}
		if len(errLines) != 1 || !strings.Contains(errLines[0], "index=2") || !strings.Contains(errLines[0], "command=PutSmallFile") ||
			!strings.Contains(errLines[0], "index out of range") {
			t.Errorf("replica %d: ERROR lines: %q, want one naming entry 2, PutSmallFile and the panic", rep, errLines)
		}
		var state strings.Builder
		for _, c := range st.ListContainers() {
			fmt.Fprintf(&state, "%d %v;", c.ID, c.State)
		}
		states = append(states, state.String())

		// The mark is durable: a crash and restart (the hook gone, as with
		// a fixed binary) keeps container 2 UNHEALTHY.
		img := fs.Crash()
		st.Close()
		st2, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: img, KeepUncommitted: true})
		if err != nil {
			t.Fatal(err)
		}
		sm2, err := newContainerSM(1000, st2, img, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := sm2.lacks(2); !ok {
			t.Errorf("replica %d: container 2 no longer recorded as lacking after a restart", rep)
		}
		if c, err := st2.Container(2); err != nil || c.State != storage.StateUnhealthy {
			t.Errorf("replica %d: container 2 after a restart: %+v %v, want UNHEALTHY", rep, c, err)
		}
		st2.Close()
	}
	if states[0] != states[1] || states[1] != states[2] {
		t.Errorf("replicas out of step: %q", states)
	}
	t.Logf("every replica: %s", states[0])
}

// TestApplyPanicsMetric: basalt_datanode_apply_panics_total reads the
// counter the guard adds to (the datanode's stats, shared by its
// pipelines' state machines).
func TestApplyPanicsMetric(t *testing.T) {
	d := &Datanode{}
	d.stats.applyPanics.Add(3)
	c := d.applyCollectors()[0]
	if got := testutil.ToFloat64(c); got != 3 {
		t.Errorf("apply_panics_total = %v, want 3", got)
	}
	if !strings.Contains(c.(interface{ Desc() *prometheus.Desc }).Desc().String(), "basalt_datanode_apply_panics_total") {
		t.Errorf("metric name: %v", c.(interface{ Desc() *prometheus.Desc }).Desc())
	}
}

// TestApplyOtherPanicGoesUp: a panic that is not a runtime error (what
// the code panics on when the process cannot go on) is not swallowed by
// the guard.
func TestApplyOtherPanicGoesUp(t *testing.T) {
	_, st, sm := guardReplica(t, io.Discard)
	defer st.Close()
	boom := errors.New("volume write failed")
	sm.applyHook = func(raft.Entry, *datanodepb.ContainerCommand) { panic(boom) }
	e := rvCmd(1, &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: 1}}})
	defer func() {
		if r := recover(); r != boom {
			t.Errorf("recovered %v, want the panic to go up", r)
		}
		if n := sm.stats.applyPanics.Load(); n != 0 {
			t.Errorf("apply panics counted: %d", n)
		}
	}()
	sm.Apply([]raft.Entry{e})
	t.Error("Apply returned")
}

// BenchmarkApplyGuard: the guard's cost per entry. The same committed
// WriteChunk (its chunk stored: the apply checks it is) applied through
// apply alone ("bare") and through applyGuarded ("guarded").
func BenchmarkApplyGuard(b *testing.B) {
	fs := vfs.NewMem(vfs.MemOptions{})
	st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, KeepUncommitted: true})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		b.Fatal(err)
	}
	data := randBytes(31, 4096)
	e := rvCmd(1, &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
		Block: &datanodepb.BlockID{ContainerId: 1, LocalId: 10}, Chunk: chunkInfo(0, data)}}})
	e.HasData = true
	if err := sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		b.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		b.Fatal(err)
	}
	cmd, err := decodeCommand(e.Meta)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			if err := sm.apply(e, cmd); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("guarded", func(b *testing.B) {
		for b.Loop() {
			if err := sm.applyGuarded(e, cmd); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestApplyRuntimeErrorOtherPipeline: an entry that fails in apply but
// names a container another pipeline of this datanode holds leaves that
// container alone (never marked from this log); the entry still fails.
func TestApplyRuntimeErrorOtherPipeline(t *testing.T) {
	_, st, sm := guardReplica(t, io.Discard)
	defer st.Close()
	if _, err := st.CreateContainer(2, storage.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sm.owner = func(cid uint64) error {
		if cid == 2 {
			return errOtherPipeline
		}
		return nil
	}
	e := rvCmd(2, &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: 2}}})
	res := sm.Apply([]raft.Entry{e})
	if err, _ := res[0].(error); err == nil || !strings.Contains(err.Error(), "failed in apply") {
		t.Errorf("result: %v, want the apply failure", res[0])
	}
	if c, err := st.Container(2); err != nil || c.State != storage.StateOpen {
		t.Errorf("other pipeline's container 2: %+v %v, want OPEN, untouched", c, err)
	}
	if _, ok := sm.lacks(2); ok {
		t.Error("other pipeline's container 2 recorded as lacking here")
	}
}
