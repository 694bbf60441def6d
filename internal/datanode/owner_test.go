package datanode

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// TestForeignContainerNotAdopted: datanode A is in pipelines P1 (1000)
// and P2 (2000); container 7 is P1's. Entries of P2's log that write
// into container 7 (a small file over P1's block, a PutBlock of it, a
// WriteChunk of a new block) fail on A and change nothing there: the
// block keeps P1's BCSID and data, no chunk is written, the container is
// neither adopted by P2 nor marked UNHEALTHY (it is healthy: the entry
// is foreign). Before, P2's apply adopted the container and committed
// the block with P2's index as its BCSID.
func TestForeignContainerNotAdopted(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	p2, err := newContainerSM(2000, r.store, r.sm.fs, r.dir, &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	d := &Datanode{store: r.store, sms: map[uint64]*containerSM{r.sm.pipeline: r.sm, 2000: p2}}
	r.sm.owner = func(cid uint64) error { return d.ownerError(cid, r.sm.pipeline) }
	p2.owner = func(cid uint64) error { return d.ownerError(cid, 2000) }

	data := randBytes(1, 5000)
	e := smallFileEntry(5, 7, 1, data)
	if err := r.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := r.sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	if err := r.apply(e); err != nil {
		t.Fatalf("P1's own write: %v", err)
	}
	if err := d.ownerError(7, 2000); !errors.Is(err, errOtherPipeline) {
		t.Fatalf("ownerError(7, P2) = %v", err)
	}
	if err := d.ownerError(7, 1000); err != nil {
		t.Fatalf("ownerError(7, P1) = %v", err)
	}
	if err := d.ownerError(8, 2000); err != nil {
		t.Fatalf("ownerError(8, P2) = %v", err)
	}

	other := randBytes(2, 5000)
	small := smallFileEntry(900, 7, 1, other)
	bd := &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: 7, LocalId: 1}, Length: uint64(len(data)),
		Chunks: []*datanodepb.ChunkInfo{chunkInfo(0, data)}}
	put := raft.Entry{Index: 901, Term: 1, Kind: raft.EntryNormal, Meta: mustMarshal(&datanodepb.ContainerCommand{
		Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{Block: bd, CloseContainer: true}}})}
	wcMeta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
		Block: &datanodepb.BlockID{ContainerId: 7, LocalId: 2}, Chunk: chunkInfo(0, other)}}})
	wc := raft.Entry{Index: 902, Term: 1, Kind: raft.EntryNormal, Meta: wcMeta, HasData: true}
	for _, x := range []raft.Entry{small, wc} {
		if err := p2.WriteData(x.Index, x.Term, x.Meta, other); err != nil {
			t.Fatal(err)
		}
	}
	if err := p2.SyncData(); err != nil {
		t.Fatal(err)
	}
	res := p2.Apply([]raft.Entry{small, put, wc})
	for i, x := range res {
		if err, _ := x.(error); err == nil {
			t.Errorf("P2 entry %d into P1's container applied", i)
		} else {
			t.Logf("P2 entry %d refused: %v", i, err)
		}
	}
	if !errors.Is(res[0].(error), errOtherPipeline) || !errors.Is(res[1].(error), errOtherPipeline) {
		t.Fatalf("refusals %v, %v: want errOtherPipeline", res[0], res[1])
	}

	got, gotData := r.read(7, 1)
	if got.BCSID != 5 || !bytes.Equal(gotData, data) {
		t.Fatalf("block 7/1: BCSID %d (want P1's 5), data changed %v", got.BCSID, !bytes.Equal(gotData, data))
	}
	if ok, _ := r.store.HasChunk(7, 2, 0, int64(len(other))); ok {
		t.Fatal("P2's chunk was written into P1's container")
	}
	if rep, err := r.store.Container(7); err != nil || rep.State != storage.StateOpen {
		t.Fatalf("container 7: %+v %v, want OPEN (not closed by P2, not UNHEALTHY)", rep, err)
	}
	if p2.hasContainer(7) {
		t.Fatal("P2 adopted container 7")
	}
	for _, sm := range []*containerSM{r.sm, p2} {
		if why, ok := sm.lacks(7); ok {
			t.Fatalf("pipeline %d records container 7 as lacking data: %s", sm.pipeline, why)
		}
	}
	// P1 still writes into it.
	e2 := smallFileEntry(6, 7, 3, other)
	if err := r.sm.WriteData(e2.Index, e2.Term, e2.Meta, other); err != nil {
		t.Fatal(err)
	}
	if err := r.sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	if err := r.apply(e2); err != nil {
		t.Fatalf("P1 after P2's refused entries: %v", err)
	}
}
