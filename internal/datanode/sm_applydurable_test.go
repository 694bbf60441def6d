package datanode

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// memReplica is one replica's state machine and storage on a crashable
// in-memory disk: both the volume (/vol) and the state machine's small
// files (/sm) are on fs, so fs.Crash() is what a power loss leaves of both.
type memReplica struct {
	t     *testing.T
	fs    *vfs.MemFS
	store *storage.Store
	sm    *containerSM
}

func openMemReplica(t *testing.T, fs *vfs.MemFS) *memReplica {
	t.Helper()
	st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		st.Close()
		t.Fatal(err)
	}
	return &memReplica{t: t, fs: fs, store: st, sm: sm}
}

// logBlock is a block an entry of the test's log commits.
type logBlock struct {
	e    raft.Entry
	cid  storage.ContainerID
	lid  storage.LocalID
	data []byte // the whole block
}

// check opens the replica on img (a crash image) and checks what the
// durable applied index promises: every block committed by an entry at or
// below it is there byte for byte without any replay; one above it is
// either there or not found at all (never a wrong one), and once the
// entries above the index are applied again from the log (as the host
// does after a restart), every block is there. It returns the persisted
// index and how many blocks were missing before the replay.
func checkCrashImage(t *testing.T, img *vfs.MemFS, blocks []logBlock) (uint64, int) {
	t.Helper()
	r := openMemReplica(t, img)
	defer r.store.Close()
	idx := r.sm.AppliedIndex()
	missing := 0
	var replay []raft.Entry
	for _, b := range blocks {
		if b.e.Index > idx {
			replay = append(replay, b.e)
		}
		bd, err := r.store.GetBlock(b.cid, b.lid)
		switch {
		case err == nil && bd.Length == int64(len(b.data)):
			got := make([]byte, bd.Length)
			if _, err := r.store.ReadAt(b.cid, b.lid, got, 0); err != nil || !bytes.Equal(got, b.data) {
				t.Fatalf("block %d (entry %d) after the crash: %v, or not its data", b.lid, b.e.Index, err)
			}
		case b.e.Index <= idx:
			t.Fatalf("block %d committed by entry %d is not durable after the crash (length %d, %v), but the persisted applied index is %d: the host may have truncated the entry from the log", b.lid, b.e.Index, bd.Length, err, idx)
		case err != nil && !errors.Is(err, storage.ErrBlockNotFound):
			t.Fatalf("block %d (entry %d, above the persisted index %d) after the crash: %v, want found or ErrBlockNotFound", b.lid, b.e.Index, idx, err)
		case err != nil:
			missing++
		default:
			// A shorter commit of the block (its extension was lost):
			// reading past it fails, and the client goes to another
			// replica.
			missing++
			if _, err := r.store.ReadAt(b.cid, b.lid, make([]byte, len(b.data)), 0); err == nil {
				t.Fatalf("block %d: reading %d bytes of a block committed at %d after the crash succeeded", b.lid, len(b.data), bd.Length)
			}
		}
	}
	slices.SortFunc(replay, func(a, b raft.Entry) int { return cmp.Compare(a.Index, b.Index) })
	if len(replay) > 0 {
		for i, res := range r.sm.Apply(replay) {
			if err, ok := res.(error); ok {
				t.Fatalf("replaying entry %d after the crash: %v", replay[i].Index, err)
			}
		}
	}
	for _, b := range blocks {
		bd, err := r.store.GetBlock(b.cid, b.lid)
		got := make([]byte, len(b.data))
		if err == nil && bd.Length == int64(len(b.data)) {
			_, err = r.store.ReadAt(b.cid, b.lid, got, 0)
		}
		if err != nil || !bytes.Equal(got, b.data) || bd.BCSID != b.e.Index {
			t.Fatalf("block %d (entry %d) after the replay: %+v, %v", b.lid, b.e.Index, bd, err)
		}
	}
	return idx, missing
}

func putBlockEntry(index uint64, cid, lid uint64, chunks ...[]byte) raft.Entry {
	bd := &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: cid, LocalId: lid}}
	for _, c := range chunks {
		bd.Chunks = append(bd.Chunks, chunkInfo(bd.Length, c))
		bd.Length += uint64(len(c))
	}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{Block: bd}}})
	return raft.Entry{Index: index, Term: 1, Kind: raft.EntryNormal, Meta: meta}
}

func writeChunkEntry(index uint64, cid, lid, off uint64, data []byte) raft.Entry {
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{
		Block: &datanodepb.BlockID{ContainerId: cid, LocalId: lid}, Chunk: chunkInfo(off, data)}}})
	return raft.Entry{Index: index, Term: 1, Kind: raft.EntryNormal, Meta: meta, HasData: true}
}

// TestCommitsDurableAtApply: Apply makes its batch's block commits
// durable before it returns (one storage WAL flush for the batch). A
// power loss right after Apply returns, before any persist of the applied
// index, leaves every block the batch committed intact with no replay,
// and applying the entries above the persisted index again (as the host
// does after a restart) changes nothing. Fails if Apply leaves its
// commits unsynced (the crash image lacks them).
func TestCommitsDurableAtApply(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	var walSyncs atomic.Int64
	fs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/vol/") && strings.HasSuffix(path, ".log") {
			walSyncs.Add(1)
		}
		return nil
	})
	r := openMemReplica(t, fs)
	defer r.store.Close()

	// Small files (inline and deferred writes), a file block past the
	// deferred-write size, and a block committed in two steps (the second
	// commit extends it).
	var blocks []logBlock
	var ents []raft.Entry
	idx := uint64(0)
	for i := range 12 {
		n := 4096
		if i%4 == 3 {
			n = 40 << 10
		}
		idx++
		data := randBytes(uint64(i), n)
		e := smallFileEntry(idx, 1, uint64(100+i), data)
		blocks = append(blocks, logBlock{e: e, cid: 1, lid: storage.LocalID(100 + i), data: data})
		ents = append(ents, e)
	}
	c1, c2 := randBytes(50, 8192), randBytes(51, 8192)
	ents = append(ents, writeChunkEntry(idx+1, 2, 7, 0, c1), putBlockEntry(idx+2, 2, 7, c1))
	idx += 2
	firstHalf := idx // persisted below
	blocks = append(blocks, logBlock{e: ents[len(ents)-1], cid: 2, lid: 7, data: c1})
	// What the first half commits (block 7 with its first chunk).
	firstBlocks := slices.Clone(blocks)
	for i := 12; i < 18; i++ {
		idx++
		data := randBytes(uint64(i), 4096)
		e := smallFileEntry(idx, 1, uint64(100+i), data)
		blocks = append(blocks, logBlock{e: e, cid: 1, lid: storage.LocalID(100 + i), data: data})
		ents = append(ents, e)
	}
	ents = append(ents, writeChunkEntry(idx+1, 2, 7, 8192, c2), putBlockEntry(idx+2, 2, 7, c1, c2))
	idx += 2
	blocks[12] = logBlock{e: ents[len(ents)-1], cid: 2, lid: 7, data: append(append([]byte(nil), c1...), c2...)}

	// Every entry's data is written and synced (acknowledged) first.
	for _, e := range ents {
		if !e.HasData {
			continue
		}
		cmd, err := decodeCommand(e.Meta)
		if err != nil {
			t.Fatal(err)
		}
		var data []byte
		switch c := cmd.GetCmd().(type) {
		case *datanodepb.ContainerCommand_PutSmallFile:
			for _, b := range blocks {
				if b.e.Index == e.Index {
					data = b.data
				}
			}
		case *datanodepb.ContainerCommand_WriteChunk:
			data = c1
			if c.WriteChunk.GetChunk().GetOffset() != 0 {
				data = c2
			}
		}
		if err := r.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.sm.SyncData(); err != nil {
		t.Fatal(err)
	}

	// The first half applies: one WAL flush makes its commits durable.
	var first, second []raft.Entry
	for _, e := range ents {
		if e.Index <= firstHalf {
			first = append(first, e)
		} else {
			second = append(second, e)
		}
	}
	before := walSyncs.Load()
	for i, res := range r.sm.Apply(first) {
		if err, ok := res.(error); ok {
			t.Fatalf("apply entry %d: %v", first[i].Index, err)
		}
	}
	if n := walSyncs.Load() - before; n < 1 {
		t.Fatalf("Apply of %d entries synced the storage WAL %d times; want its commits synced", len(first), n)
	}
	if got := r.sm.AppliedIndex(); got != 0 {
		t.Fatalf("AppliedIndex %d before any persist", got)
	}
	// A crash now: the index is 0, yet every commit is there without a
	// replay, and the replay changes nothing.
	if i, missing := checkCrashImage(t, fs.Crash(), firstBlocks); i != 0 || missing != 0 {
		t.Fatalf("crash right after Apply, before persist: index %d, %d blocks missing before the replay; want 0 and 0 (Apply synced its commits)", i, missing)
	}

	if err := r.sm.persist(firstHalf); err != nil {
		t.Fatal(err)
	}
	if got := r.sm.AppliedIndex(); got != firstHalf {
		t.Fatalf("AppliedIndex %d after persist(%d)", got, firstHalf)
	}

	// The second half applies (block 7 extended); a crash before its
	// persist keeps every block with no replay.
	before = walSyncs.Load()
	for i, res := range r.sm.Apply(second) {
		if err, ok := res.(error); ok {
			t.Fatalf("apply entry %d: %v", second[i].Index, err)
		}
	}
	if n := walSyncs.Load() - before; n < 1 {
		t.Fatalf("Apply of %d entries synced the storage WAL %d times; want its commits synced", len(second), n)
	}
	if got := r.sm.AppliedIndex(); got != firstHalf {
		t.Fatalf("AppliedIndex %d before the second persist, want %d", got, firstHalf)
	}
	if i, missing := checkCrashImage(t, fs.Crash(), blocks); i != firstHalf || missing != 0 {
		t.Fatalf("crash right after the second Apply: index %d, %d blocks missing or short; want %d and 0", i, missing, firstHalf)
	}
	if err := r.sm.persist(idx); err != nil {
		t.Fatal(err)
	}
	if i, missing := checkCrashImage(t, fs.Crash(), blocks); i != idx || missing != 0 {
		t.Fatalf("crash after the second persist: index %d, %d blocks missing; want %d and 0", i, missing, idx)
	}
}

// TestApplySyncFailureMarksUnhealthy: when Apply cannot make its block
// commits durable (the volume failed after the data was synced and
// acknowledged), the entries fail, and the container is marked UNHEALTHY
// here, durably (sickFile) and visibly (ApplyStatus fails its entries),
// before any entry of the batch counts as applied. The applied index then
// moves past them (the loss is recorded) and a crash image holds it.
func TestApplySyncFailureMarksUnhealthy(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	var fail atomic.Bool
	fs.SetInject(func(op, path string) error {
		if fail.Load() && op == "sync" && strings.HasPrefix(path, "/vol/") && strings.HasSuffix(path, ".block") {
			return errors.New("injected: disk gone")
		}
		return nil
	})
	r := openMemReplica(t, fs)
	defer r.store.Close()
	var ents []raft.Entry
	for i := range 4 {
		data := randBytes(uint64(i), 4096)
		e := smallFileEntry(uint64(i+1), 1, uint64(10+i), data)
		if err := r.sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
			t.Fatal(err)
		}
		ents = append(ents, e)
	}
	if err := r.sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	// The volume fails under another writer (a block file's sync; Pebble
	// takes a failed WAL sync as fatal) before the entries are applied.
	if _, err := r.store.CreateContainer(2, storage.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	big := randBytes(9, 1<<20)
	if err := r.store.WriteChunk(2, 1, 0, big, storage.ChecksumData{}, false); err != nil {
		t.Fatal(err)
	}
	fail.Store(true)
	if err := r.store.SyncContainers([]storage.ContainerID{2}); !errors.Is(err, storage.ErrVolumeFailed) {
		t.Fatalf("sync on the failing disk: %v, want ErrVolumeFailed", err)
	}
	for i, res := range r.sm.Apply(ents) {
		if _, ok := res.(error); !ok {
			t.Fatalf("apply entry %d on a failed volume: %v, want an error", ents[i].Index, res)
		}
	}
	if _, ok := r.sm.lacks(1); !ok {
		t.Fatal("container 1 not recorded UNHEALTHY after its commits could not be made durable")
	}
	d := &Datanode{store: r.store, sms: map[uint64]*containerSM{r.sm.pipeline: r.sm}}
	if _, why, err := d.applyStatus(r.sm.pipeline, 3, 1); err != nil || why == "" {
		t.Fatalf("ApplyStatus of entry 3 into container 1: %q, %v; want it failed", why, err)
	}
	b, err := vfs.ReadFile(fs.Crash(), r.sm.sickFile)
	if err != nil || !strings.Contains(string(b), "entry 1") {
		t.Fatalf("durable unhealthy list after the failed apply: %q, %v", b, err)
	}
	if err := r.sm.persist(4); err != nil {
		t.Fatal(err)
	}
	if got := diskAppliedIndex(t, fs.Crash(), r.sm.file); got != 4 {
		t.Fatalf("index file on disk says %d after the loss was recorded, want 4", got)
	}
}

// diskAppliedIndex reads the persisted applied index in file on img (0
// if there is none).
func diskAppliedIndex(t *testing.T, img *vfs.MemFS, file string) uint64 {
	t.Helper()
	b, err := vfs.ReadFile(img, file)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	if err != nil || len(b) != 8 {
		t.Fatalf("applied index file %s: %d bytes, %v", file, len(b), err)
	}
	return binary.BigEndian.Uint64(b)
}
