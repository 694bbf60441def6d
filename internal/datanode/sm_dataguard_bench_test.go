package datanode

import (
	"io"
	"log/slog"
	"testing"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// BenchmarkWriteData: a follower's WriteData (it verifies the checksum)
// per chunk, on the in-memory vfs: "fresh" writes a new 512-byte chunk
// each time (offsets in order, a new block every 1,024 chunks, a SyncData
// every 64 as raft's batches do), "redeliver" the same chunk again (the
// re-delivery no-op: decode, container check, storage's overlap check).
// Written to run unchanged on main, so the guard (writeData's deferred
// recover, storage's deferred reservation release) is measured A/B
// across the two builds.
func BenchmarkWriteData(b *testing.B) {
	open := func(b *testing.B) *containerSM {
		fs := vfs.NewMem(vfs.MemOptions{})
		st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, KeepUncommitted: true})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { st.Close() })
		sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			b.Fatal(err)
		}
		return sm
	}
	data := randBytes(51, 512)
	b.Run("fresh", func(b *testing.B) {
		sm := open(b)
		const perBlock = 1024
		metas := make([][]byte, perBlock)
		for i := range metas {
			metas[i] = writeChunkEntry(1, 1, 0, uint64(i*len(data)), data).Meta
		}
		// The metas name block 0; each block's entries are rewritten
		// with the block's ID outside the timer.
		var idx uint64
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; b.Loop(); i++ {
			k := i % perBlock
			if k == 0 {
				b.StopTimer()
				lid := uint64(i/perBlock) + 1
				for j := range metas {
					metas[j] = writeChunkEntry(1, 1, lid, uint64(j*len(data)), data).Meta
				}
				b.StartTimer()
			}
			idx++
			if err := sm.WriteData(idx, 1, metas[k], data); err != nil {
				b.Fatal(err)
			}
			if idx%64 == 0 {
				if err := sm.SyncData(); err != nil {
					b.Fatal(err)
				}
			}
			if n := sm.stats.chunksWritten.Load(); n != idx {
				b.Fatalf("%d chunks written after %d calls", n, idx)
			}
		}
	})
	b.Run("redeliver", func(b *testing.B) {
		sm := open(b)
		e := writeChunkEntry(1, 1, 10, 0, data)
		if err := sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
			b.Fatal(err)
		}
		if err := sm.SyncData(); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if err := sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkWriteDataGuard: the WriteData guard's cost per call, in one
// binary: the re-delivery of a stored chunk (the cheapest real WriteData)
// through the unguarded body ("bare": decode and storeData) and through
// writeData ("guarded": the same under a deferred recover).
func BenchmarkWriteDataGuard(b *testing.B) {
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
	data := randBytes(52, 512)
	e := writeChunkEntry(1, 1, 10, 0, data)
	if err := sm.WriteData(e.Index, e.Term, e.Meta, data); err != nil {
		b.Fatal(err)
	}
	if err := sm.SyncData(); err != nil {
		b.Fatal(err)
	}
	b.Run("bare", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			cmd, err := decodeCommand(e.Meta)
			if _, err := sm.storeData(e.Index, e.Term, cmd, err, data, false); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("guarded", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := sm.writeData(e.Index, e.Term, e.Meta, data, false); err != nil {
				b.Fatal(err)
			}
		}
	})
}
