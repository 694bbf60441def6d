package datanode

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

func rvOpen(t *testing.T, fs *vfs.MemFS) (*storage.Store, *containerSM) {
	t.Helper()
	st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return st, sm
}

func rvCmd(index uint64, c *datanodepb.ContainerCommand) raft.Entry {
	return raft.Entry{Index: index, Term: 1, Kind: raft.EntryNormal, Meta: mustMarshal(c)}
}

// rvApply applies ents; every one must succeed (they all committed).
func rvApply(t *testing.T, sm *containerSM, ents ...raft.Entry) {
	t.Helper()
	for i, res := range sm.Apply(ents) {
		if err, ok := res.(error); ok {
			t.Errorf("apply entry %d: %v", ents[i].Index, err)
		}
	}
}

// rvReplay: entry 1 puts a small file into container 1; entry 2 deletes
// the block ("delblocks") or closes the container ("close",
// "delcontainer", which SCM then deletes through the datanode). Both are
// durable once applied, so after a power loss storage holds them, while
// the persisted applied index (written at most once a second) is still 0:
// the restart applies both entries again. Replaying
// them must succeed and change nothing: no UNHEALTHY mark, no container
// created afresh, no failure recorded for an entry that committed.
func rvReplay(t *testing.T, mode string) {
	fs := vfs.NewMem(vfs.MemOptions{})
	st, sm := rvOpen(t, fs)
	data := randBytes(1, 4096)
	e1 := smallFileEntry(1, 1, 10, data)
	if err := sm.WriteData(e1.Index, e1.Term, e1.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	ents := []raft.Entry{e1}
	switch mode {
	case "delblocks":
		ents = append(ents, rvCmd(2, &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_DeleteBlocks{DeleteBlocks: &datanodepb.DeleteBlocksCmd{ContainerId: 1, LocalIds: []uint64{10}, TxId: 5}}}))
	case "close", "delcontainer":
		ents = append(ents, rvCmd(2, &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: 1}}}))
	}
	rvApply(t, sm, ents...)
	if mode == "delcontainer" {
		d := &Datanode{store: st, sms: map[uint64]*containerSM{sm.pipeline: sm}, log: sm.log}
		if err := d.deleteContainer(&metapb.DeleteContainerCommand{ContainerId: 1}); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("before crash: AppliedIndex=%d applied=%d", sm.AppliedIndex(), sm.applied.Load())
	img := fs.Crash()
	st.Close()
	st2, sm2 := rvOpen(t, img)
	defer st2.Close()
	from := sm2.AppliedIndex()
	var replay []raft.Entry
	for _, e := range ents {
		if e.Index > from {
			replay = append(replay, e)
		}
	}
	t.Logf("restart: persisted index %d, replaying %d entries", from, len(replay))
	rvApply(t, sm2, replay...)
	rep, err := st2.Container(1)
	why, lacks := sm2.lacks(1)
	t.Logf("%s: container 1 after replay: state=%v err=%v; sick=%v %q", mode, rep.State, err, lacks, why)
	if lacks || (err == nil && rep.State == storage.StateUnhealthy) {
		t.Errorf("%s: container 1 UNHEALTHY/sick after replaying entries it had applied and synced before the crash", mode)
	}
	for _, e := range ents {
		if why, failed := sm2.failure(e.Index); failed {
			t.Errorf("%s: failure recorded for entry %d on replay: %s", mode, e.Index, why)
		}
	}
	switch mode {
	case "delcontainer":
		if err == nil {
			t.Errorf("container 1 deleted before the crash is back after the replay: %+v", rep)
		}
	case "close":
		if err != nil || rep.State != storage.StateClosed {
			t.Errorf("closed container after the replay: %+v, %v", rep, err)
		}
		got := make([]byte, len(data))
		if _, err := st2.ReadAt(1, 10, got, 0); err != nil || !bytes.Equal(got, data) {
			t.Errorf("block of the closed container after the replay: %v", err)
		}
	case "delblocks":
		if _, err := st2.GetBlock(1, 10); !errors.Is(err, storage.ErrBlockNotFound) {
			t.Errorf("deleted block after the replay: %v, want ErrBlockNotFound", err)
		}
	}
}

// TestReplayPutAfterDeleteBlocks: a replayed PutSmallFile whose block a
// later, synced DeleteBlocks removed is a no-op (it used to mark the
// container UNHEALTHY: its data is gone).
func TestReplayPutAfterDeleteBlocks(t *testing.T) { rvReplay(t, "delblocks") }

// TestReplayPutAfterClose: a replayed PutSmallFile into the container a
// later entry closed succeeds without change (it used to record a failure
// for the entry: the container is not open).
func TestReplayPutAfterClose(t *testing.T) { rvReplay(t, "close") }

// TestReplayPutAfterDeleteContainer: a container SCM deleted is not
// created afresh (and marked UNHEALTHY) by replaying the entries that
// wrote it: the datanode persists its pipeline's applied index, past
// them, before it deletes the container.
func TestReplayPutAfterDeleteContainer(t *testing.T) { rvReplay(t, "delcontainer") }
