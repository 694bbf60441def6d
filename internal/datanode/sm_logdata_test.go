package datanode

import (
	"bytes"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestLoggedSmallFileComesBackFromLog: a small file's data that raft keeps
// in its log entry (WriteDataLogged says inLog) costs this replica no
// volume flush before the append is acknowledged (SyncData has nothing to
// sync); a power loss after the append and before the apply loses the
// memory copy, and the apply after the restart, given the data from the
// log (Entry.Data), stores and commits every file, durably (a second
// crash after that apply keeps them all). Without Entry.Data the same
// replay fails the entries: the log's copy is what makes them durable.
// Fails on the old code (no WriteDataLogged; WriteData then SyncData
// flushes the volume WAL before the append).
func TestLoggedSmallFileComesBackFromLog(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	var walSyncs atomic.Int64
	fs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/vol/") {
			walSyncs.Add(1)
		}
		return nil
	})
	r := openMemReplica(t, fs)
	r.sm.dataInLog = true // Config.SmallDataInLog

	var ents []raft.Entry
	var blocks []logBlock
	for i := range 8 {
		data := randBytes(uint64(700+i), 4096)
		e := smallFileEntry(uint64(i+1), 3, uint64(300+i), data)
		inLog, err := r.sm.WriteDataLogged(e.Index, e.Term, e.Meta, data)
		if err != nil {
			t.Fatal(err)
		}
		if !inLog {
			t.Fatalf("entry %d: a 4 KiB small file was not left in the log", e.Index)
		}
		e.Data = data // what the log holds and hands to Apply
		ents = append(ents, e)
		blocks = append(blocks, logBlock{e: e, cid: 3, lid: storage.LocalID(300 + i), data: data})
	}
	before := walSyncs.Load()
	if err := r.sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	if n := walSyncs.Load() - before; n != 0 {
		t.Fatalf("SyncData of logged small files flushed the volume %d times; want 0 (the log's fsync covers them)", n)
	}
	// The append is acknowledged now; the power goes.
	img := fs.Crash()
	r.store.Close()

	// Without the log's data the replay cannot commit them.
	{
		r2 := openMemReplica(t, img.Crash())
		var plain []raft.Entry
		for _, e := range ents {
			e.Data = nil
			plain = append(plain, e)
		}
		failed := 0
		for _, res := range r2.sm.Apply(plain) {
			if _, ok := res.(error); ok {
				failed++
			}
		}
		r2.store.Close()
		if failed != len(plain) {
			t.Fatalf("replay without the log's data: %d of %d entries failed; want all (their data was only in memory)", failed, len(plain))
		}
	}

	r3 := openMemReplica(t, img)
	if got := r3.sm.AppliedIndex(); got != 0 {
		t.Fatalf("applied index %d after the crash, want 0", got)
	}
	for i, res := range r3.sm.Apply(ents) {
		if err, ok := res.(error); ok {
			t.Fatalf("replaying entry %d with its data from the log: %v", ents[i].Index, err)
		}
	}
	for _, b := range blocks {
		got := make([]byte, len(b.data))
		if _, err := r3.store.ReadAt(b.cid, b.lid, got, 0); err != nil || !bytes.Equal(got, b.data) {
			t.Fatalf("block %d after the replay: %v, or not its data", b.lid, err)
		}
	}
	r3.store.Close()
	// The replay's apply made them durable: a crash right after it (no
	// persisted applied index) keeps every block without another replay.
	if i, missing := checkCrashImage(t, img.Crash(), blocks); i != 0 || missing != 0 {
		t.Fatalf("crash after the replayed apply: index %d, %d blocks missing; want 0 and 0", i, missing)
	}
}
