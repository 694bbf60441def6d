package datanode

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// fzReplica is one replica of the fuzzed pipeline: a fresh state machine
// over its own store on the in-memory vfs, after two set-up entries:
// entry 1 put a small file (container 1, block 10), entry 2 wrote the
// first chunk of block 11 of container 1 (not yet committed).
type fzReplica struct {
	st *storage.Store
	sm *containerSM
}

var (
	fzSmall = randBytes(7, 4096)
	fzChunk = randBytes(8, 4096)
	fzNext  = randBytes(9, 1024)
)

func fzOpen(t *testing.T) *fzReplica {
	t.Helper()
	fs := vfs.NewMem(vfs.MemOptions{})
	st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	r := &fzReplica{st: st, sm: sm}
	e1 := smallFileEntry(1, 1, 10, fzSmall)
	e2 := rvCmd(2, fzWriteChunk(1, 11, 0, fzChunk))
	e2.HasData = true
	for _, x := range []struct {
		e    raft.Entry
		data []byte
	}{{e1, fzSmall}, {e2, fzChunk}} {
		if err := sm.WriteData(x.e.Index, x.e.Term, x.e.Meta, x.data); err != nil {
			t.Fatal(err)
		}
		if err := sm.SyncData(); err != nil {
			t.Fatal(err)
		}
		if res := sm.Apply([]raft.Entry{x.e}); res[0] != nil {
			t.Fatalf("set-up entry %d: %v", x.e.Index, res[0])
		}
	}
	return r
}

func fzWriteChunk(cid, lid, off uint64, data []byte) *datanodepb.ContainerCommand {
	return &datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
		Block: &datanodepb.BlockID{ContainerId: cid, LocalId: lid}, Chunk: chunkInfo(off, data)}}}
}

// fzState is what a replica holds: every container's report, its blocks
// and their bytes (or the read error), what it lacks and the entries it
// failed.
func (r *fzReplica) state() string {
	var b bytes.Buffer
	for _, c := range r.st.ListContainers() {
		fmt.Fprintf(&b, "container %+v\n", c)
		blocks, err := r.st.ListBlocks(c.ID, 0, 0)
		fmt.Fprintf(&b, "  blocks err=%v\n", err)
		for _, bd := range blocks {
			fmt.Fprintf(&b, "  block %+v\n", bd)
			if bd.Length < 0 || bd.Length > 1<<20 {
				continue
			}
			buf := make([]byte, bd.Length)
			n, err := r.st.ReadAt(c.ID, bd.LocalID, buf, 0)
			if errors.Is(err, io.EOF) {
				err = nil
			}
			fmt.Fprintf(&b, "  data %x err=%v\n", buf[:n], err)
		}
	}
	r.sm.mu.Lock()
	fmt.Fprintf(&b, "sick %v\nfailed %v\ncontainers %v\n", r.sm.sick, r.sm.failed, slices.Sorted(maps.Keys(r.sm.containers)))
	r.sm.mu.Unlock()
	fmt.Fprintf(&b, "applied %d\n", r.sm.applied.Load())
	return b.String()
}

// fzRun hands entry 3 (meta, with data as mode says) and then entry 4 (a
// valid small file into container 2) to r the way the raft host does,
// and returns the results of both.
func (r *fzReplica) run(meta, data []byte, mode uint8) []string {
	e := raft.Entry{Index: 3, Term: 1, Kind: raft.EntryNormal, Meta: meta}
	if mode&1 != 0 {
		// The entry carries data: WriteData before it is acknowledged,
		// then SyncData (nil data: a re-delivery without it).
		e.HasData = true
		d := data
		if mode&4 != 0 {
			d = nil
		}
		if mode&2 != 0 {
			// Data kept in the log (WriteDataLogged) and handed back
			// with the entry.
			r.sm.dataInLog = true
			if _, err := r.sm.WriteDataLogged(e.Index, e.Term, meta, d); err != nil {
				return []string{"writedata: " + err.Error()}
			}
			e.Data = data
		} else if err := r.sm.WriteData(e.Index, e.Term, meta, d); err != nil {
			return []string{"writedata: " + err.Error()}
		}
		if err := r.sm.SyncData(); err != nil {
			return []string{"syncdata: " + err.Error()}
		}
	}
	e4 := smallFileEntry(4, 2, 20, fzNext)
	_ = r.sm.WriteData(e4.Index, e4.Term, e4.Meta, fzNext)
	_ = r.sm.SyncData()
	var out []string
	for _, res := range r.sm.Apply([]raft.Entry{e, e4}) {
		out = append(out, fmt.Sprint(res))
	}
	return out
}

// FuzzContainerApply: any bytes as a committed pipeline entry's command
// (and any data beside it, written as the raft host writes an entry's
// data, or kept in the log), applied by two fresh replicas: neither
// panics, nor does the apply guard catch anything (a runtime error there
// is a bug to fix by validation), both answer the same results and hold
// the same state, and the valid entry after it still applies alike.
func FuzzContainerApply(f *testing.F) {
	bd := func(cid, lid uint64, chunks ...*datanodepb.ChunkInfo) *datanodepb.BlockData {
		var n uint64
		for _, c := range chunks {
			n += c.GetLength()
		}
		return &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: cid, LocalId: lid}, Length: n, Chunks: chunks}
	}
	more := randBytes(10, 2048)
	seeds := []struct {
		cmd  *datanodepb.ContainerCommand
		data []byte
		mode uint8
	}{
		{fzWriteChunk(1, 11, 4096, more), more, 1},
		{fzWriteChunk(1, 11, 4096, more), more, 5},
		{fzWriteChunk(1, 11, 4096, more), nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{Block: bd(1, 11, chunkInfo(0, fzChunk))}}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{Block: bd(1, 11, chunkInfo(0, fzChunk)), CloseContainer: true}}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{PutSmallFile: &datanodepb.PutSmallFileCmd{Block: bd(3, 30, chunkInfo(0, more))}}}, more, 1},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{PutSmallFile: &datanodepb.PutSmallFileCmd{Block: bd(3, 30, chunkInfo(0, more))}}}, more, 3},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{PutSmallFile: &datanodepb.PutSmallFileCmd{Block: bd(3, 30, chunkInfo(0, more))}}}, more, 7},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: 1}}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_DeleteBlocks{DeleteBlocks: &datanodepb.DeleteBlocksCmd{ContainerId: 1, LocalIds: []uint64{10, 11, 99}, TxId: 4}}}, nil, 0},
		// Empty commands of every type (nil members), and no command.
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{}}, more, 1},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{}}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{}}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{}}, more, 1},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{PutSmallFile: &datanodepb.PutSmallFileCmd{}}}, more, 3},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{}}, nil, 0},
		{&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_DeleteBlocks{}}, nil, 0},
		{&datanodepb.ContainerCommand{}, nil, 0},
	}
	for _, s := range seeds {
		f.Add(mustMarshal(s.cmd), s.data, s.mode)
	}
	f.Add([]byte{0xff, 0x01}, []byte("x"), uint8(1))
	f.Fuzz(func(t *testing.T, meta, data []byte, mode uint8) {
		if len(data) > 1<<20 {
			return
		}
		a, b := fzOpen(t), fzOpen(t)
		defer a.st.Close()
		defer b.st.Close()
		ra := a.run(meta, data, mode)
		rb := b.run(meta, data, mode)
		if !reflect.DeepEqual(ra, rb) {
			t.Fatalf("results differ:\n%q\n%q", ra, rb)
		}
		if sa, sb := a.state(), b.state(); sa != sb {
			t.Fatalf("states differ:\n%s\n---\n%s", sa, sb)
		}
		if n := a.sm.stats.applyPanics.Load() + b.sm.stats.applyPanics.Load(); n != 0 {
			t.Fatalf("the apply guard caught %d runtime errors (a bug to fix by validation): results %q\nstate:\n%s", n, ra, a.state())
		}
	})
}
