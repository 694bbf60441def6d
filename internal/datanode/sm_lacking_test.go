package datanode

import (
	"bytes"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// onDatanode wraps r's state machine in the smallest Datanode that answers
// ApplyStatus (replicas.go), as the leader's wait_all asks it.
func (r *replica) onDatanode() *Datanode {
	return &Datanode{store: r.store, sms: map[uint64]*containerSM{r.sm.pipeline: r.sm}}
}

// statusOf is this replica's ApplyStatus answer for entry index into cid:
// "" means applied and fine.
func statusOf(t *testing.T, r *replica, index, cid uint64) string {
	t.Helper()
	applied, why, err := r.onDatanode().applyStatus(r.sm.pipeline, index, storage.ContainerID(cid))
	if err != nil {
		t.Fatal(err)
	}
	if applied < index {
		t.Fatalf("applied %d < entry %d", applied, index)
	}
	return why
}

// withSMFS reopens r's state machine with its small files on fs.
func (r *replica) withSMFS(fs vfs.FS) {
	r.t.Helper()
	sm, err := newContainerSM(r.sm.pipeline, r.store, fs, r.dir, &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		r.t.Fatal(err)
	}
	r.sm = sm
}

// TestSnapshotMarksAbsentContainers (defect D1, docs/SIMULATION.md): a
// replica caught up by a snapshot that lists a container it does not hold
// at all used to only track it; the next write created it fresh, OPEN and
// healthy, and ApplyStatus answered "fine" for the PutBlocks the snapshot
// covered, so wait_all acknowledged blocks this replica lacks and SCM was
// told the container was healthy. Now the restore records the container
// durably; the next write into it fails here and creates it UNHEALTHY
// (reported to SCM), and ApplyStatus fails the covered entries, also after
// a restart.
func TestSnapshotMarksAbsentContainers(t *testing.T) {
	leader := openReplica(t, t.TempDir())
	defer leader.store.Close()
	writeSmall(t, leader.sm, 5, 1, 1) // block 1/1 at PutBlock 5
	writeSmall(t, leader.sm, 6, 2, 1)
	idx, body, err := leader.sm.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(body)
	body.Close()

	f := openReplica(t, t.TempDir())
	if err := f.sm.Restore(idx, bytes.NewReader(raw)); err != nil {
		t.Fatal(err)
	}
	if why := statusOf(t, f, 5, 1); why == "" {
		t.Fatal("ApplyStatus says PutBlock 5 (covered by the snapshot, block not here) is fine")
	}

	// A new block into container 1 fails here and leaves it UNHEALTHY.
	data := randBytes(7, 1000)
	e := smallFileEntry(idx+1, 1, 2, data)
	if err := f.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := f.apply(e); err == nil {
		t.Fatal("a block into a container the snapshot left incomplete here was committed")
	}
	if why := statusOf(t, f, idx+1, 1); why == "" {
		t.Fatal("ApplyStatus says the new block is fine")
	}
	if s := state(t, f.store, 1); s != storage.StateUnhealthy {
		t.Fatalf("container 1, absent here before the snapshot, is %s after a write into it, want UNHEALTHY", s)
	}
	// Container 2 gets no write: it stays absent (it could be one deleted
	// since), and its covered entries still fail.
	if _, err := f.store.Container(2); err == nil {
		t.Fatal("container 2 created by the restore")
	}
	if why := statusOf(t, f, 6, 2); why == "" {
		t.Fatal("ApplyStatus says PutBlock 6 into absent container 2 is fine")
	}

	// The record survives a restart, even if the storage mark did not:
	// the restart sets it again.
	f.sm.persist(f.sm.applied.Load())
	f = f.restart()
	defer f.store.Close()
	if s := state(t, f.store, 1); s != storage.StateUnhealthy {
		t.Fatalf("container 1 after restart is %s, want UNHEALTHY", s)
	}
	if why := statusOf(t, f, 5, 1); why == "" {
		t.Fatal("after restart ApplyStatus says PutBlock 5 is fine")
	}
}

// TestSnapshotKeepsClosedContainers: a container CLOSED here before the
// snapshot was closed by an entry this replica applied, after all its
// writes: the restore leaves it CLOSED, and its blocks stay fine.
func TestSnapshotKeepsClosedContainers(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	writeSmall(t, r.sm, 5, 1, 1)
	if err := r.sm.closeContainer(1); err != nil {
		t.Fatal(err)
	}
	writeSmall(t, r.sm, 6, 2, 1)
	snap := smSnapshot{Index: 50, Pipeline: 1000, Containers: []uint64{1, 2, 3}}
	if err := r.sm.Restore(50, bytes.NewReader(mustJSON(snap))); err != nil {
		t.Fatal(err)
	}
	if s := state(t, r.store, 1); s != storage.StateClosed {
		t.Fatalf("closed container 1 is %s after the snapshot, want CLOSED", s)
	}
	if why := statusOf(t, r, 5, 1); why != "" {
		t.Fatalf("block in closed container 1: %s", why)
	}
	if s := state(t, r.store, 2); s != storage.StateUnhealthy {
		t.Fatalf("open container 2 is %s after the snapshot, want UNHEALTHY", s)
	}
	if why := statusOf(t, r, 40, 3); why == "" {
		t.Fatal("ApplyStatus says entry 40 into container 3, absent here, is fine")
	}
}

// TestRestoreRefusedIfNotRecorded: a restore that cannot record what this
// replica lacks fails (the snapshot is not acknowledged) and changes
// nothing.
func TestRestoreRefusedIfNotRecorded(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	ff := vfs.NewFaultFS(vfs.Default)
	r.withSMFS(ff)
	ff.SetInject(func(op, path string) error {
		if op == "rename" && strings.HasSuffix(path, ".unhealthy") {
			return syscall.EIO
		}
		return nil
	})
	snap := smSnapshot{Index: 50, Pipeline: 1000, Containers: []uint64{1}}
	if err := r.sm.Restore(50, bytes.NewReader(mustJSON(snap))); err == nil {
		t.Fatal("restore succeeded without recording the containers it lacks")
	}
	if a := r.sm.applied.Load(); a != 0 {
		t.Fatalf("applied %d after a failed restore, want 0", a)
	}
	if _, err := r.store.Container(1); err == nil {
		t.Fatal("a failed restore created container 1")
	}
}

// TestFailedEntryStaysFailedAfterRestart (defect D5): a replica that could
// not record a new container (EIO on its container list) failed the entry
// in memory only; markUnhealthy did nothing for a container that did not
// exist, a later write created it healthy, the applied index was
// persisted past the entry, and after a restart ApplyStatus reported the
// entry applied and fine. Now the loss is recorded durably, or, if that
// cannot be written either, the persisted applied index stays below the
// entry so a restart applies it again and finds the loss again.
func TestFailedEntryStaysFailedAfterRestart(t *testing.T) {
	for _, c := range []struct {
		name       string
		recordFail bool // the loss record cannot be written either
	}{{"recorded", false}, {"record fails too", true}} {
		t.Run(c.name, func(t *testing.T) {
			r := openReplica(t, t.TempDir())
			ff := vfs.NewFaultFS(vfs.Default)
			r.withSMFS(ff)
			writeSmall(t, r.sm, 3, 1, 1)
			var broken atomic.Bool
			broken.Store(true)
			ff.SetInject(func(op, path string) error {
				if !broken.Load() || op != "rename" {
					return nil
				}
				if strings.HasSuffix(path, ".containers") || (c.recordFail && strings.HasSuffix(path, ".unhealthy")) {
					return syscall.EIO
				}
				return nil
			})
			// Entry 10: a block into new container 7; this replica cannot
			// record the container, so the chunk is not stored.
			data := randBytes(10, 1000)
			e := smallFileEntry(10, 7, 1, data)
			if err := r.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
				t.Fatal(err)
			}
			if err := r.apply(e); err == nil {
				t.Fatal("entry 10 applied without its chunk")
			}
			broken.Store(false)
			if c.recordFail {
				// Still unwritable when the applied index is persisted.
				broken.Store(true)
			}
			// Entry 11: another block into container 7 (the disk is back
			// for the container list).
			ff.SetInject(func(op, path string) error {
				if broken.Load() && op == "rename" && strings.HasSuffix(path, ".unhealthy") {
					return syscall.EIO
				}
				return nil
			})
			data2 := randBytes(11, 1000)
			e2 := smallFileEntry(11, 7, 2, data2)
			if err := r.sm.WriteData(e2.Index, e2.Term, e2.Meta, data2); err != nil {
				t.Fatal(err)
			}
			r.apply(e2)
			if why := statusOf(t, r, 10, 7); why == "" {
				t.Fatal("ApplyStatus says entry 10 is fine")
			}
			r.sm.persist(r.sm.applied.Load()) // as Close does
			if c.recordFail {
				if d := r.sm.AppliedIndex(); d >= 10 {
					t.Fatalf("applied index persisted at %d, past entry 10 whose loss is not recorded", d)
				}
			}

			r = r.restart()
			defer r.store.Close()
			if c.recordFail {
				// The restart replays from the persisted index: entries 10
				// and 11 again, as the raft host would.
				if d := r.sm.AppliedIndex(); d >= 10 {
					t.Fatalf("after restart the applied index is %d", d)
				}
				r.apply(e)
				r.apply(e2)
			}
			if why := statusOf(t, r, 10, 7); why == "" {
				t.Fatal("after restart ApplyStatus says entry 10 is fine: its block is not here")
			}
			if _, err := r.store.GetBlock(7, 1); err == nil {
				t.Fatal("block 7/1 committed here although its chunk was never stored")
			}
		})
	}
}

// TestUncreatableContainerReportedUnhealthy: a write into a container this
// replica does not hold yet, on a volume without room for a new container
// (a filled disk), fails here; the container cannot be created, so storage
// has no record to mark UNHEALTHY. The heartbeat's container reports must
// still name it UNHEALTHY, or SCM keeps the pipeline open and allocating
// into it (make test-fault seed 587210: pipeline 1009, reported only two
// minutes later, after the pipeline check had failed).
func TestUncreatableContainerReportedUnhealthy(t *testing.T) {
	dir := t.TempDir()
	st, err := storage.Open(storage.Options{Volumes: []string{filepath.Join(dir, "vol")}, ContainerSize: 1 << 60})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	sm, err := newContainerSM(1000, st, vfs.Default, dir, &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	r := &replica{t: t, dir: dir, store: st, sm: sm}
	data := randBytes(3, 1000)
	e := smallFileEntry(3, 9, 1, data)
	if err := r.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := r.apply(e); err == nil {
		t.Fatal("a block into a container no volume has room for was committed")
	}
	if _, err := st.Container(9); err == nil {
		t.Fatal("container 9 exists: the test needs one that cannot be created")
	}
	var got *metapb.ContainerReport
	for _, c := range r.onDatanode().ContainerReports() {
		if c.ContainerId == 9 {
			got = c
		}
	}
	if got == nil || got.State != metapb.ContainerState_CONTAINER_UNHEALTHY {
		t.Fatalf("container 9 (lacking here, not creatable) reported as %v, want UNHEALTHY", got)
	}
}
