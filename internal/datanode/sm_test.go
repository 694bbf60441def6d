package datanode

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// replica is one container state machine over its own store, as on one
// datanode of a pipeline. Tests call WriteData and Apply the way the raft
// host does: WriteData for an entry with data before it is acknowledged,
// Apply once committed.
type replica struct {
	t     *testing.T
	dir   string
	fs    *vfs.FaultFS
	store *storage.Store
	sm    *containerSM

	mu       sync.Mutex
	syncs    []string // block files fsynced, in order
	walSyncs int      // storage WAL syncs (a deferred write's durability)
}

func openReplica(t *testing.T, dir string) *replica {
	t.Helper()
	r := &replica{t: t, dir: dir, fs: vfs.NewFaultFS(vfs.Default)}
	r.fs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasSuffix(path, ".block") {
			r.mu.Lock()
			r.syncs = append(r.syncs, filepath.Base(path))
			r.mu.Unlock()
		}
		if op == "sync" && strings.HasSuffix(path, ".log") {
			r.mu.Lock()
			r.walSyncs++
			r.mu.Unlock()
		}
		return nil
	})
	st, err := storage.Open(storage.Options{Volumes: []string{filepath.Join(dir, "vol")}, FS: r.fs, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	r.store = st
	sm, err := newContainerSM(1000, st, vfs.Default, dir, &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	r.sm = sm
	return r
}

// restart closes the store (a crash as far as the state machine is
// concerned: nothing but what storage made durable survives in it) and
// opens a new state machine over the same directories.
func (r *replica) restart() *replica {
	r.t.Helper()
	if err := r.store.Close(); err != nil {
		r.t.Fatal(err)
	}
	return openReplica(r.t, r.dir)
}

func (r *replica) apply(e raft.Entry) error {
	r.t.Helper()
	res := r.sm.Apply([]raft.Entry{e})
	if err, ok := res[0].(error); ok {
		return err
	}
	return nil
}

// read returns the committed block and its data, verified by storage.
func (r *replica) read(cid storage.ContainerID, lid storage.LocalID) (storage.BlockData, []byte) {
	r.t.Helper()
	bd, err := r.store.GetBlock(cid, lid)
	if err != nil {
		r.t.Fatalf("get block %d/%d: %v", cid, lid, err)
	}
	buf := storage.AlignedBuffer(int(max(bd.Length, 1)))
	n, err := r.store.ReadAt(cid, lid, buf[:bd.Length], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		r.t.Fatalf("read block %d/%d: %v", cid, lid, err)
	}
	return bd, buf[:n]
}

func smallFileEntry(index uint64, cid, lid uint64, data []byte) raft.Entry {
	bd := &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: cid, LocalId: lid}, Length: uint64(len(data)),
		Chunks: []*datanodepb.ChunkInfo{chunkInfo(0, data)}}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{PutSmallFile: &datanodepb.PutSmallFileCmd{Block: bd}}})
	return raft.Entry{Index: index, Term: 1, Kind: raft.EntryNormal, Meta: meta, HasData: true}
}

func chunkInfo(off uint64, data []byte) *datanodepb.ChunkInfo {
	return &datanodepb.ChunkInfo{Offset: off, Length: uint64(len(data)), Checksum: fromChecksum(storage.DefaultChecksum.Compute(data))}
}

func randBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestSmallFileLikeWriteChunkPutBlock: a PutSmallFile entry leaves a
// replica with exactly what a WriteChunk entry followed by a PutBlock entry
// leaves (same block, chunks, checksums and bytes; BCSID = the committing
// entry), and the block file was fsynced before the entry could be
// acknowledged (WriteData returns only once the chunk is durable).
func TestSmallFileLikeWriteChunkPutBlock(t *testing.T) {
	for _, n := range []int{1, 4096, 5000, 64 << 10, 64<<10 + 1, 1 << 20} {
		data := randBytes(uint64(n), n)
		small := openReplica(t, t.TempDir())
		two := openReplica(t, t.TempDir())

		e := smallFileEntry(7, 1, 42, data)
		if err := small.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
			t.Fatal(err)
		}
		if len(small.syncs) != 0 {
			t.Fatalf("%d bytes: WriteData synced %v itself; the batch's SyncData does", n, small.syncs)
		}
		wal := small.walSyncs
		if err := small.sm.SyncData(); err != nil {
			t.Fatal(err)
		}
		// The entry is acknowledged after the batch's SyncData: the chunk
		// is durable by then (storage's Sync), not only at the commit. A
		// small chunk is a deferred write: durable in the storage WAL, its
		// block file synced later in the background.
		if n <= storage.DefaultDeferredMax {
			if len(small.syncs) != 0 || small.walSyncs == wal {
				t.Fatalf("%d bytes: block file syncs %v and %d WAL syncs when the data was written, want none and a WAL sync (deferred write)", n, small.syncs, small.walSyncs-wal)
			}
		} else if len(small.syncs) != 1 || small.syncs[0] != "42.block" {
			t.Fatalf("%d bytes: block file syncs when the data was written: %v, want one of 42.block", n, small.syncs)
		}
		if err := small.apply(e); err != nil {
			t.Fatalf("%d bytes: apply small file: %v", n, err)
		}

		ci := chunkInfo(0, data)
		wc := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
			Block: &datanodepb.BlockID{ContainerId: 1, LocalId: 42}, Chunk: ci}}})
		if err := two.sm.WriteData(6, 1, wc, data); err != nil {
			t.Fatal(err)
		}
		if err := two.apply(raft.Entry{Index: 6, Term: 1, Meta: wc, HasData: true}); err != nil {
			t.Fatal(err)
		}
		pb := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{
			Block: &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: 1, LocalId: 42}, Length: uint64(n), Chunks: []*datanodepb.ChunkInfo{ci}}}}})
		if err := two.apply(raft.Entry{Index: 7, Term: 1, Meta: pb}); err != nil {
			t.Fatal(err)
		}

		bdS, gotS := small.read(1, 42)
		bdT, gotT := two.read(1, 42)
		if !bytes.Equal(gotS, data) || !bytes.Equal(gotT, data) {
			t.Fatalf("%d bytes: read back %d (small file) and %d (two entries) bytes, want the data", n, len(gotS), len(gotT))
		}
		if bdS.BCSID != 7 || bdS.Length != int64(n) || len(bdS.Chunks) != 1 || bdS.Chunks[0].Length != int64(n) {
			t.Fatalf("%d bytes: small file block %+v", n, bdS)
		}
		if bdS.BCSID != bdT.BCSID || bdS.Length != bdT.Length || !bytes.Equal(bdS.Chunks[0].Checksum.Sums, bdT.Chunks[0].Checksum.Sums) {
			t.Fatalf("%d bytes: small file block %+v differs from WriteChunk+PutBlock's %+v", n, bdS, bdT)
		}
		rS, _ := small.store.Container(1)
		rT, _ := two.store.Container(1)
		if rS.UsedBytes != rT.UsedBytes || rS.BlockCount != rT.BlockCount || rS.BCSID != rT.BCSID {
			t.Fatalf("%d bytes: container after small file %+v, after two entries %+v", n, rS, rT)
		}
		small.store.Close()
		two.store.Close()
	}
}

// TestSmallFileReplayAndCrash covers what a restart replays: an entry
// applied again (the applied index is persisted lazily) changes nothing;
// an entry whose data was written but that was not applied before the
// crash commits from the kept data, and the leader can still read that
// data for a follower (ReadData).
func TestSmallFileReplayAndCrash(t *testing.T) {
	data := randBytes(1, 4096)
	r := openReplica(t, t.TempDir())
	e1 := smallFileEntry(3, 5, 1, data)
	if err := r.sm.WriteData(e1.Index, e1.Term, e1.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := r.apply(e1); err != nil {
		t.Fatal(err)
	}
	// Second block: data written (entry acknowledged), then a crash before
	// the apply.
	data2 := randBytes(2, 3000)
	e2 := smallFileEntry(4, 5, 2, data2)
	if err := r.sm.WriteData(e2.Index, e2.Term, e2.Meta, data2); err != nil {
		t.Fatal(err)
	}
	r = r.restart()
	if got, err := r.sm.ReadData(e2.Index, e2.Term, e2.Meta); err != nil || !bytes.Equal(got[:len(data2)], data2) {
		t.Fatalf("ReadData of the unapplied small file after restart: %v", err)
	}
	// Replay from the log: both entries apply (again).
	for _, e := range []raft.Entry{e1, e2} {
		if err := r.apply(e); err != nil {
			t.Fatalf("replaying entry %d: %v", e.Index, err)
		}
	}
	// A resend of the first entry's data after its commit (a follower that
	// missed the acknowledgement) is harmless too.
	if err := r.sm.WriteData(e1.Index, e1.Term, e1.Meta, data); err != nil {
		t.Fatal(err)
	}
	if err := r.apply(e1); err != nil {
		t.Fatal(err)
	}
	r = r.restart()
	for _, c := range []struct {
		lid   storage.LocalID
		data  []byte
		bcsid uint64
	}{{1, data, 3}, {2, data2, 4}} {
		bd, got := r.read(5, c.lid)
		if !bytes.Equal(got, c.data) || bd.BCSID != c.bcsid {
			t.Fatalf("block %d after replay and restart: %d bytes, BCSID %d; want %d bytes, BCSID %d", c.lid, len(got), bd.BCSID, len(c.data), c.bcsid)
		}
	}
	rep, err := r.store.Container(5)
	if err != nil || rep.BlockCount != 2 || rep.UsedBytes != int64(len(data)+len(data2)) || rep.State != storage.StateOpen {
		t.Fatalf("container after replays: %+v, %v", rep, err)
	}
	r.store.Close()
}

// TestSmallFileDataMissing: a replica that did not get the data (the
// leader had lost it: data nil) or got it damaged must not commit the
// block: the apply fails and the container is marked UNHEALTHY, as for a
// PutBlock whose chunk is missing.
func TestSmallFileDataMissing(t *testing.T) {
	data := randBytes(3, 4096)
	for _, c := range []struct {
		name string
		data []byte
	}{{"lost", nil}, {"corrupt", append([]byte{data[0] ^ 1}, data[1:]...)}} {
		t.Run(c.name, func(t *testing.T) {
			r := openReplica(t, t.TempDir())
			defer r.store.Close()
			e := smallFileEntry(9, 2, 7, data)
			if c.data != nil {
				// Make the container exist, so its state can be checked.
				if err := r.sm.ensureContainer(2); err != nil {
					t.Fatal(err)
				}
			}
			if err := r.sm.WriteData(e.Index, e.Term, e.Meta, c.data); err != nil {
				t.Fatalf("WriteData must record the loss, not fail the group: %v", err)
			}
			if err := r.apply(e); err == nil {
				t.Fatal("small file committed without its data")
			}
			if _, err := r.store.GetBlock(2, 7); err == nil {
				t.Fatal("block visible after a failed small file")
			}
			if rep, err := r.store.Container(2); err == nil && rep.State != storage.StateUnhealthy {
				t.Fatalf("container %+v after a commit without data, want UNHEALTHY", rep)
			}
		})
	}
}

// TestSmallFileMalformed: an entry whose block does not have exactly one
// chunk carries data it cannot place. It fails when applied, and neither
// WriteData nor ReadData stops the group over it (scenario 6): WriteData
// records nothing and succeeds, ReadData reports the data lost so the
// entry can be resent without it.
func TestSmallFileMalformed(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	data := randBytes(4, 100)
	bd := &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: 1, LocalId: 1}, Length: 100,
		Chunks: []*datanodepb.ChunkInfo{chunkInfo(0, data[:50]), chunkInfo(50, data[50:])}}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{PutSmallFile: &datanodepb.PutSmallFileCmd{Block: bd}}})
	if err := r.sm.WriteData(1, 1, meta, data); err != nil {
		t.Fatalf("WriteData of a two-chunk small file must not stop the group: %v", err)
	}
	if _, err := r.sm.ReadData(1, 1, meta); !errors.Is(err, raft.ErrDataLost) {
		t.Fatalf("ReadData of a two-chunk small file: %v, want ErrDataLost", err)
	}
	if err := r.apply(raft.Entry{Index: 1, Term: 1, Meta: meta, HasData: true}); err == nil {
		t.Fatal("two-chunk small file committed")
	}
}

// TestApplyUsesTheEntrysOwnCommand: Apply takes the command WriteData
// decoded only for the same entry (index and term). Here index 6 was
// written in term 1 (block 1) and replaced by a leader of term 2 whose
// entry 6 commits block 2 (its data came with entry 9): block 2 is
// committed at 6, block 1 is not, and nothing stays kept afterwards.
func TestApplyUsesTheEntrysOwnCommand(t *testing.T) {
	r := openReplica(t, t.TempDir())
	defer r.store.Close()
	a, b := randBytes(1, 4096), randBytes(2, 4096)
	old := smallFileEntry(6, 5, 1, a)
	if err := r.sm.WriteData(old.Index, old.Term, old.Meta, a); err != nil {
		t.Fatal(err)
	}
	carrier := smallFileEntry(9, 5, 2, b)
	carrier.Term = 2
	if err := r.sm.WriteData(carrier.Index, carrier.Term, carrier.Meta, b); err != nil {
		t.Fatal(err)
	}
	replaced := smallFileEntry(6, 5, 2, b)
	replaced.Term = 2
	if err := r.apply(replaced); err != nil {
		t.Fatal(err)
	}
	if bd, got := r.read(5, 2); bd.BCSID != 6 || !bytes.Equal(got, b) {
		t.Fatalf("block 2: BCSID %d, data equal %v; want committed at 6", bd.BCSID, bytes.Equal(got, b))
	}
	if _, err := r.store.GetBlock(5, 1); !errors.Is(err, storage.ErrBlockNotFound) {
		t.Fatalf("block 1 of the replaced entry: %v, want not found", err)
	}
	if err := r.apply(carrier); err != nil {
		t.Fatal(err)
	}
	r.sm.decMu.Lock()
	n := len(r.sm.decoded)
	r.sm.decMu.Unlock()
	if n != 0 {
		t.Fatalf("%d decoded commands kept after their entries applied", n)
	}
}
