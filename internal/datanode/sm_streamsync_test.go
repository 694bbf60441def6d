package datanode

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// A V2 stream's close is acknowledged before this replica synced the
// block (streamSink.Close only starts the sync): these tests check that a
// replica still never counts for a commit whose data it does not durably
// hold, on the crashable in-memory disk.

// streamBlockOn writes data as a stream does (packets into the block
// file, no checksums, nothing synced) to container cid, block lid.
func streamBlockOn(t *testing.T, r *memReplica, cid storage.ContainerID, lid storage.LocalID, data []byte) *storage.BlockStream {
	t.Helper()
	if err := r.sm.ensureContainer(cid); err != nil {
		t.Fatal(err)
	}
	bs := r.store.OpenStream(cid, lid, 0)
	for off := 0; off < len(data); off += 64 << 10 {
		if _, err := bs.Write(data[off:min(off+64<<10, len(data))]); err != nil {
			t.Fatal(err)
		}
	}
	return bs
}

// streamPutBlock is the PutBlock entry of a streamed block: its chunk list
// (4 chunks) with the sums the client computed.
func streamPutBlock(index uint64, cid, lid uint64, data []byte) raft.Entry {
	q := len(data) / 4
	return putBlockEntry(index, cid, lid, data[:q], data[q:2*q], data[2*q:3*q], data[3*q:])
}

func readBlock(t *testing.T, st *storage.Store, cid storage.ContainerID, lid storage.LocalID, n int) ([]byte, error) {
	t.Helper()
	bd, err := st.GetBlock(cid, lid)
	if err != nil {
		return nil, err
	}
	if bd.Length != int64(n) {
		return nil, errors.New("wrong length")
	}
	got := make([]byte, n)
	_, err = st.ReadAt(cid, lid, got, 0)
	return got, err
}

// TestStreamCommitSyncsUnsyncedData: the close started no sync here yet
// (the worst case of streamSink.Close's background sync), then the
// PutBlock applies. The apply must make the block's data durable before it
// commits: a power loss right after Apply returns leaves the block intact,
// byte for byte, without any replay. Fails if the commit does not sync the
// stream's data first (the crash image then has the block's record
// without its bytes).
func TestStreamCommitSyncsUnsyncedData(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	r := openMemReplica(t, fs)
	defer r.store.Close()
	data := randBytes(7, 1<<20)
	streamBlockOn(t, r, 3, 11, data) // no Close: nothing synced
	e := streamPutBlock(1, 3, 11, data)
	for _, res := range r.sm.Apply([]raft.Entry{e}) {
		if err, ok := res.(error); ok {
			t.Fatalf("apply: %v", err)
		}
	}
	if i, missing := checkCrashImage(t, fs.Crash(), []logBlock{{e: e, cid: 3, lid: 11, data: data}}); i != 0 || missing != 0 {
		t.Fatalf("crash right after the apply: persisted index %d, %d blocks missing before the replay; want 0 and 0", i, missing)
	}
}

// TestStreamCrashBeforeCommitFailsReplica: a power loss after the close
// was acknowledged (data written, not synced) and before the PutBlock
// applied: after the restart this replica does not hold the data, so the
// replayed PutBlock fails here, visibly (the entry's failure is recorded
// for ApplyStatus and the container is UNHEALTHY), instead of committing
// a block whose bytes are gone.
func TestStreamCrashBeforeCommitFailsReplica(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	r := openMemReplica(t, fs)
	data := randBytes(8, 1<<20)
	streamBlockOn(t, r, 3, 12, data)
	img := fs.Crash()
	r.store.Close()

	r2 := openMemReplica(t, img)
	defer r2.store.Close()
	e := streamPutBlock(1, 3, 12, data)
	res := r2.sm.Apply([]raft.Entry{e})
	err, _ := res[0].(error)
	if err == nil {
		got, rerr := readBlock(t, r2.store, 3, 12, len(data))
		t.Fatalf("the replayed PutBlock committed a block whose data was never synced here (read: %v, intact: %v)", rerr, bytes.Equal(got, data))
	}
	if !errors.Is(err, storage.ErrChunkMissing) {
		t.Fatalf("apply failed with %v; want ErrChunkMissing", err)
	}
	if _, failed := r2.sm.failure(1); !failed {
		t.Fatal("the failed entry is not recorded: ApplyStatus would count this replica")
	}
	if rep, err := r2.store.Container(3); err != nil || rep.State != storage.StateUnhealthy {
		t.Fatalf("container after the failed commit: %+v, %v; want UNHEALTHY", rep, err)
	}
}

// TestStreamSinkCloseSyncsInBackground: streamSink.Close returns at once
// and syncs the block in the background; once that sync is done, a power
// loss before the PutBlock applied loses nothing (the replay commits the
// block here). Fails if Close starts no sync at all (the replayed
// PutBlock then finds the data gone).
func TestStreamSinkCloseSyncsInBackground(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	r := openMemReplica(t, fs)
	data := randBytes(9, 1<<20)
	bs := streamBlockOn(t, r, 3, 13, data)
	d := &Datanode{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := (streamSink{id: 1, d: d, BlockStream: bs}).Close(); err != nil {
		t.Fatal(err)
	}
	d.wg.Wait() // the background sync
	img := fs.Crash()
	r.store.Close()

	r2 := openMemReplica(t, img)
	defer r2.store.Close()
	e := streamPutBlock(1, 3, 13, data)
	if err, ok := r2.sm.Apply([]raft.Entry{e})[0].(error); ok {
		t.Fatalf("PutBlock after a crash that followed the close's sync: %v", err)
	}
	if got, err := readBlock(t, r2.store, 3, 13, len(data)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("block after the commit: %v, intact %v", err, bytes.Equal(got, data))
	}
}

// TestStreamCloseSyncFailureFailsCommit: the close's background sync
// fails (the block file's fsync errs): the PutBlock that follows must not
// commit the block here; it fails on this replica and marks the container
// UNHEALTHY, so wait_all names this replica and the client writes the
// block elsewhere.
func TestStreamCloseSyncFailureFailsCommit(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	var failSync atomic.Bool
	var failed atomic.Int64
	fs.SetInject(func(op, path string) error {
		if op == "sync" && failSync.Load() && strings.HasSuffix(path, ".block") {
			failed.Add(1)
			return errors.New("injected: block file fsync fails")
		}
		return nil
	})
	r := openMemReplica(t, fs)
	defer r.store.Close()
	data := randBytes(10, 1<<20)
	bs := streamBlockOn(t, r, 3, 14, data)
	failSync.Store(true)
	d := &Datanode{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := (streamSink{id: 1, d: d, BlockStream: bs}).Close(); err != nil {
		t.Fatal(err)
	}
	d.wg.Wait()
	if failed.Load() == 0 {
		t.Fatal("the close started no sync of the block file")
	}
	e := streamPutBlock(1, 3, 14, data)
	err, _ := r.sm.Apply([]raft.Entry{e})[0].(error)
	if err == nil {
		t.Fatal("PutBlock committed a block whose sync failed on this replica")
	}
	if _, ok := r.sm.failure(1); !ok {
		t.Fatal("the failed entry is not recorded: ApplyStatus would count this replica")
	}
	if rep, cerr := r.store.Container(3); cerr == nil && rep.State != storage.StateUnhealthy {
		t.Fatalf("container after the failed commit: %+v; want UNHEALTHY (err %v)", rep, err)
	}
}
