package datanode

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// secondSM opens the state machine of another pipeline over r's store, as
// on a datanode that is in two pipelines.
func (r *replica) secondSM(pipeline uint64) *containerSM {
	r.t.Helper()
	sm, err := newContainerSM(pipeline, r.store, vfs.Default, r.dir, &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		r.t.Fatal(err)
	}
	return sm
}

func writeSmall(t *testing.T, sm *containerSM, index, cid, lid uint64) {
	t.Helper()
	data := randBytes(index, 1000)
	e := smallFileEntry(index, cid, lid, data)
	if err := sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		t.Fatal(err)
	}
	if res := sm.Apply([]raft.Entry{e}); res[0] != nil {
		t.Fatalf("apply entry %d: %v", index, res[0])
	}
}

func state(t *testing.T, st *storage.Store, cid storage.ContainerID) storage.State {
	t.Helper()
	rep, err := st.Container(cid)
	if err != nil {
		t.Fatal(err)
	}
	return rep.State
}

// TestSnapshotCoversOnlyItsPipeline (scenario 7): a datanode in pipelines
// 1000 and 1001 holds container 1 of the first and 2 of the second. A
// snapshot of pipeline 1000 lists container 1 only, and restoring it on a
// replica that holds both marks container 1 UNHEALTHY (it missed entries)
// and leaves container 2, another pipeline's, OPEN.
func TestSnapshotCoversOnlyItsPipeline(t *testing.T) {
	leader := openReplica(t, t.TempDir())
	defer leader.store.Close()
	other := leader.secondSM(1001)
	writeSmall(t, leader.sm, 5, 1, 1)
	writeSmall(t, other, 5, 2, 1)

	idx, body, err := leader.sm.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(body)
	body.Close()
	var snap smSnapshot
	if err := json.Unmarshal(raw, &snap); err != nil {
		t.Fatal(err)
	}
	if snap.Pipeline != 1000 || len(snap.Containers) != 1 || snap.Containers[0] != 1 {
		t.Fatalf("snapshot of pipeline 1000 = %+v, want pipeline 1000 with container 1 only", snap)
	}

	follower := openReplica(t, t.TempDir())
	defer follower.store.Close()
	fOther := follower.secondSM(1001)
	writeSmall(t, follower.sm, 2, 1, 9)
	writeSmall(t, fOther, 3, 2, 9)
	if err := follower.sm.Restore(idx, bytes.NewReader(raw)); err != nil {
		t.Fatal(err)
	}
	if s := state(t, follower.store, 1); s != storage.StateUnhealthy {
		t.Fatalf("container 1 of the restored pipeline is %s, want UNHEALTHY", s)
	}
	if s := state(t, follower.store, 2); s != storage.StateOpen {
		t.Fatalf("container 2 of pipeline 1001 is %s after pipeline 1000's snapshot, want OPEN", s)
	}

	// A snapshot in the old format (no pipeline: every container of the
	// sender) is not trusted for other pipelines' containers either.
	old, _ := json.Marshal(smSnapshot{Index: 40, Containers: []uint64{1, 2}})
	if err := fOther.Restore(40, bytes.NewReader(old)); err != nil {
		t.Fatal(err)
	}
	if s := state(t, follower.store, 2); s != storage.StateUnhealthy {
		t.Fatalf("container 2 after its own pipeline's snapshot is %s, want UNHEALTHY", s)
	}
}

// TestAppliedIndexNeverGoesBack (scenario 3, state machine side): a
// snapshot at or below the applied index changes nothing, and the
// persisted index never decreases, also across a restart.
func TestAppliedIndexNeverGoesBack(t *testing.T) {
	r := openReplica(t, t.TempDir())
	writeSmall(t, r.sm, 20, 1, 1)
	r.sm.persist(20)
	snap := func(i uint64) *bytes.Reader {
		b, _ := json.Marshal(smSnapshot{Index: i, Pipeline: 1000, Containers: []uint64{1}})
		return bytes.NewReader(b)
	}
	if err := r.sm.Restore(30, snap(30)); err != nil {
		t.Fatal(err)
	}
	if err := r.sm.Restore(25, snap(25)); err != nil {
		t.Fatal(err)
	}
	if a := r.sm.applied.Load(); a != 30 {
		t.Fatalf("applied %d after snapshots at 30 then 25, want 30", a)
	}
	r.sm.persist(12)
	b, err := vfs.ReadFile(vfs.Default, r.sm.file)
	if err != nil || binary.BigEndian.Uint64(b) != 30 {
		t.Fatalf("persisted applied index %x (%v) after persist(12), want 30", b, err)
	}
	r = r.restart()
	defer r.store.Close()
	if a := r.sm.AppliedIndex(); a != 30 {
		t.Fatalf("applied index after restart %d, want 30", a)
	}
}

// TestRefusedEntryDoesNotWedge (scenario 6, state machine side): an entry
// that storage refuses on every replica (here a chunk over the chunk size
// limit, as a log written before requests were validated may hold) never
// stops the group: WriteData succeeds, ReadData reports the data lost so
// the entry can be resent without it, its apply fails visibly, the
// container stays healthy and later entries apply.
func TestRefusedEntryDoesNotWedge(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	big := randBytes(1, storage.DefaultMaxChunkSize+1)
	wc := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
		Block: &datanodepb.BlockID{ContainerId: 3, LocalId: 1}, Chunk: chunkInfo(0, big)}}})
	if err := r.sm.WriteData(1, 1, wc, big); err != nil {
		t.Fatalf("WriteData of a refused chunk stops the group: %v", err)
	}
	if _, err := r.sm.ReadData(1, 1, wc); !errors.Is(err, raft.ErrDataLost) {
		t.Fatalf("ReadData of a refused chunk: %v, want ErrDataLost (else the leader retries the resend forever)", err)
	}
	if err := r.apply(raft.Entry{Index: 1, Term: 1, Meta: wc, HasData: true}); err == nil {
		t.Fatal("apply of a refused chunk succeeded")
	}
	if why, ok := r.sm.failure(1); !ok {
		t.Fatal("failed entry not recorded for the leader's wait")
	} else if !strings.Contains(why, "chunk size limit") {
		t.Fatalf("failure recorded as %q", why)
	}
	writeSmall(t, r.sm, 2, 3, 2)
	if s := state(t, r.store, 3); s != storage.StateOpen {
		t.Fatalf("container %s after a request every replica refuses, want OPEN", s)
	}
}

// TestWriteChunkApplyNeedsTheChunk: applying a WriteChunk succeeds only
// on a replica that holds the chunk. The in-memory record of a lost
// chunk is gone after a restart; storage's durable chunk records are not,
// so the entry still fails there (and the failure is recorded for the
// leader's wait for all replicas).
func TestWriteChunkApplyNeedsTheChunk(t *testing.T) {
	r := openReplica(t, t.TempDir())
	data := randBytes(7, 5000)
	wc := func(lid uint64) []byte {
		return mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
			Block: &datanodepb.BlockID{ContainerId: 4, LocalId: lid}, Chunk: chunkInfo(0, data)}}})
	}
	if err := r.sm.WriteData(1, 1, wc(1), data); err != nil {
		t.Fatal(err)
	}
	r = r.restart()
	defer r.store.Close()
	if err := r.apply(raft.Entry{Index: 1, Term: 1, Meta: wc(1), HasData: true}); err != nil {
		t.Fatalf("apply of a chunk stored (and synced) before the restart: %v", err)
	}
	if err := r.apply(raft.Entry{Index: 2, Term: 1, Meta: wc(2), HasData: true}); !errors.Is(err, storage.ErrChunkMissing) {
		t.Fatalf("apply of a chunk this replica never stored: %v, want ErrChunkMissing", err)
	}
	if _, ok := r.sm.failure(2); !ok {
		t.Fatal("failed WriteChunk entry not recorded")
	}
}

// TestRedeliveryWithoutDataOfAHeldChunk: an entry re-sent without its data
// (the leader no longer had it) to a replica that stored the chunk the
// first time is not a loss: its apply and the block's commit succeed.
func TestRedeliveryWithoutDataOfAHeldChunk(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	data := randBytes(8, 3000)
	ci := chunkInfo(0, data)
	wc := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
		Block: &datanodepb.BlockID{ContainerId: 6, LocalId: 1}, Chunk: ci}}})
	if err := r.sm.WriteData(1, 1, wc, data); err != nil {
		t.Fatal(err)
	}
	if err := r.sm.WriteData(1, 2, wc, nil); err != nil {
		t.Fatal(err)
	}
	if err := r.apply(raft.Entry{Index: 1, Term: 2, Meta: wc, HasData: true}); err != nil {
		t.Fatalf("apply of a held chunk re-sent without data: %v", err)
	}
	pb := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{
		Block: &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: 6, LocalId: 1}, Length: uint64(len(data)), Chunks: []*datanodepb.ChunkInfo{ci}}}}})
	if err := r.apply(raft.Entry{Index: 2, Term: 2, Meta: pb}); err != nil {
		t.Fatalf("commit of a held block: %v", err)
	}
	if s := state(t, r.store, 6); s != storage.StateOpen {
		t.Fatalf("container %s, want OPEN", s)
	}
}

// TestSimulatorStateMachineReadsNoClock: the state machine the simulator
// builds persists its applied index by entry count, never by wall time, so
// what survives a simulated crash depends only on the seed.
func TestSimulatorStateMachineReadsNoClock(t *testing.T) {
	dir := t.TempDir()
	st, err := storage.Open(storage.Options{Volumes: []string{dir + "/vol"}, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	dsm, err := NewContainerStateMachine(7, st, vfs.Default, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := uint64(1); i <= persistEveryEntries+1; i++ {
		dsm.Apply([]raft.Entry{{Index: i, Term: 1, Kind: raft.EntryEmpty}})
		want := uint64(0)
		if i >= persistEveryEntries {
			want = persistEveryEntries
		}
		if got := dsm.AppliedIndex(); got != want {
			t.Fatalf("after entry %d the durable applied index is %d, want %d", i, got, want)
		}
	}
}
