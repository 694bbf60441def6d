package storage

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// Crash tests run the real store on crashFS: Restart is a killed process
// (page cache kept), Crash a power loss (only what was synced survives).

const crashVol = "/vol"

func openOn(t testing.TB, fs vfs.FS, o Options) *Store {
	t.Helper()
	o.FS = fs
	o.Volumes = []string{crashVol}
	if o.ContainerSize == 0 {
		o.ContainerSize = 1 << 30
	}
	s, err := Open(o)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return s
}

// chunked splits data into chunks of n bytes with default checksums.
func chunked(data []byte, n int) []ChunkInfo {
	var out []ChunkInfo
	for off := 0; off < len(data); off += n {
		p := data[off:min(off+n, len(data))]
		out = append(out, ChunkInfo{int64(off), int64(len(p)), DefaultChecksum.Compute(p)})
	}
	return out
}

func writeChunks(t testing.TB, s *Store, cid ContainerID, lid LocalID, data []byte, chunks []ChunkInfo) {
	t.Helper()
	for _, ch := range chunks {
		if err := s.WriteChunk(cid, lid, ch.Offset, data[ch.Offset:ch.Offset+ch.Length], ch.Checksum, true); err != nil {
			t.Fatalf("write %d/%d at %d: %v", cid, lid, ch.Offset, err)
		}
	}
}

func blockOf(lid LocalID, chunks []ChunkInfo, bcsid uint64) BlockData {
	bd := BlockData{LocalID: lid, Chunks: chunks, BCSID: bcsid}
	for _, ch := range chunks {
		bd.Length += ch.Length
	}
	return bd
}

// TestSyncedChunksSurviveCrash (issue 11, scenario 2): a chunk is durable
// once Sync returns and only then; after a power loss a replayed PutBlock
// commits the synced chunks and refuses, naming the range, a block that
// needs a chunk that was not synced.
func TestSyncedChunksSurviveCrash(t *testing.T) {
	fs := newCrashFS()
	o := Options{KeepUncommitted: true, OutOfOrderWrites: true}
	s := openOn(t, fs, o)
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 256<<10)
	chunks := chunked(data, 64<<10)
	writeChunks(t, s, 1, 1, data, chunks[:3])
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	writeChunks(t, s, 1, 1, data, chunks[3:]) // never synced
	writeChunks(t, s, 1, 2, data, chunks[:1]) // never synced

	s2 := openOn(t, fs.Crash(), o)
	defer s2.Close()
	err := s2.PutBlock(1, blockOf(1, chunks, 7))
	wantErr(t, err, ErrChunkMissing, "block 1", "offset 196608", "[196608,262144)")
	wantErr(t, s2.PutBlock(1, blockOf(2, chunks[:1], 8)), ErrChunkMissing, "block 2", "offset 0")
	if _, err := s2.GetBlock(1, 1); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("refused PutBlock left a block: %v", err)
	}
	// The leader resends what it needs; the lost range reads as lost.
	if _, err := s2.ReadWritten(1, 1, 3*64<<10, 64<<10, chunks[3].Checksum); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("ReadWritten of an unsynced chunk after a crash: %v", err)
	}
	if got, err := s2.ReadWritten(1, 1, 64<<10, 64<<10, chunks[1].Checksum); err != nil || !bytes.Equal(got, data[64<<10:128<<10]) {
		t.Fatalf("ReadWritten of a synced chunk after a crash: %v", err)
	}
	for i, want := range []bool{true, true, true, false} {
		if got, err := s2.HasChunk(1, 1, chunks[i].Offset, chunks[i].Length); got != want || err != nil {
			t.Fatalf("HasChunk(chunk %d) = %v, %v after a crash; want %v", i, got, err, want)
		}
	}
	if err := s2.PutBlock(1, blockOf(1, chunks[:3], 9)); err != nil {
		t.Fatalf("commit of the synced chunks: %v", err)
	}
	checkBlock(t, s2, 1, 1, data[:3*64<<10])
	writeChunks(t, s2, 1, 1, data, chunks[3:])
	if err := s2.PutBlock(1, blockOf(1, chunks, 10)); err != nil {
		t.Fatalf("commit after a resend: %v", err)
	}
	checkBlock(t, s2, 1, 1, data)
}

// TestRestartNeverCommitsHoles (issue 11, scenario 2): a block file with a
// never-written range (the chunk was lost) must not become a committed
// block of zeros after a restart; before, recovery took the whole file as
// written and the replayed PutBlock committed it.
func TestRestartNeverCommitsHoles(t *testing.T) {
	dir := t.TempDir()
	o := Options{Volumes: []string{dir}, KeepUncommitted: true, OutOfOrderWrites: true}
	s := openStore(t, o)
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 192<<10)
	chunks := chunked(data, 64<<10)
	writeChunks(t, s, 1, 1, data, chunks[1:]) // chunk 0 never arrived
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = openStore(t, o)
	wantErr(t, s.PutBlock(1, blockOf(1, chunks, 5)), ErrChunkMissing, "block 1", "offset 0", "[0,65536)")
	if _, err := s.GetBlock(1, 1); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("block with a hole committed: %v", err)
	}
	// Chunks written with other checksums are not the chunks named either.
	other := DefaultChecksum.Compute(bytes.Repeat([]byte{7}, 64<<10))
	writeChunks(t, s, 1, 1, data, chunks[:1])
	bad := blockOf(1, chunks, 6)
	bad.Chunks = append([]ChunkInfo(nil), chunks...)
	bad.Chunks[2].Checksum = other
	wantErr(t, s.PutBlock(1, bad), ErrChunkMissing, "block 1", "offset 131072", "other checksums")
	if err := s.PutBlock(1, blockOf(1, chunks, 6)); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s, 1, 1, data)
}

// TestDirectoryEntriesSurviveCrash (issue 11, scenario 11): every
// directory entry a committed block depends on — the volume's basalt and
// containers directories, the Pebble directory, the container directory,
// the block file — is durable before the commit is acknowledged, including
// a block file that recovery at Open kept for a replayed PutBlock.
func TestDirectoryEntriesSurviveCrash(t *testing.T) {
	o := Options{KeepUncommitted: true}
	data := blockBytes(1, 1, 100_000)
	chunks := chunked(data, 64<<10)

	t.Run("fresh volume", func(t *testing.T) {
		fs := newCrashFS()
		s := openOn(t, fs, o)
		mustCreate(t, s, 1)
		writeChunks(t, s, 1, 1, data, chunks)
		if err := s.PutBlock(1, blockOf(1, chunks, 1)); err != nil {
			t.Fatal(err)
		}
		s2 := openOn(t, fs.Crash(), o)
		defer s2.Close()
		checkBlock(t, s2, 1, 1, data)
	})

	t.Run("block file recovered at open", func(t *testing.T) {
		fs := newCrashFS()
		s := openOn(t, fs, o)
		mustCreate(t, s, 1)
		if err := s.Sync(); err != nil { // nothing pending: a no-op
			t.Fatal(err)
		}
		writeChunks(t, s, 1, 1, data, chunks)
		if err := s.Sync(); err != nil {
			t.Fatal(err)
		}
		// The process dies; the restarted one replays the PutBlock, then
		// the machine loses power.
		fs2 := fs.Restart()
		s2 := openOn(t, fs2, o)
		if err := s2.PutBlock(1, blockOf(1, chunks, 1)); err != nil {
			t.Fatal(err)
		}
		s3 := openOn(t, fs2.Crash(), o)
		defer s3.Close()
		if rep, _ := s3.Container(1); rep.State != StateOpen || rep.BlockCount != 1 {
			t.Fatalf("after crash: %+v", rep)
		}
		checkBlock(t, s3, 1, 1, data)
	})

	t.Run("removals", func(t *testing.T) {
		fs := newCrashFS()
		s := openOn(t, fs, o)
		mustCreate(t, s, 1)
		mustCreate(t, s, 2)
		writeChunks(t, s, 1, 1, data, chunks)
		if err := s.PutBlock(1, blockOf(1, chunks, 1)); err != nil {
			t.Fatal(err)
		}
		writeChunks(t, s, 1, 2, data, chunks)
		if err := s.PutBlock(1, blockOf(2, chunks, 2)); err != nil {
			t.Fatal(err)
		}
		writeChunks(t, s, 1, 3, data, chunks)
		if err := s.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := s.AbortBlock(1, 3); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteBlocks(1, []LocalID{2}); err != nil {
			t.Fatal(err)
		}
		if err := s.CloseContainer(2); err != nil {
			t.Fatal(err)
		}
		if err := s.DeleteContainer(2, false); err != nil {
			t.Fatal(err)
		}
		crashed := fs.Crash()
		for _, p := range []string{"/vol/basalt/containers/1/2.block", "/vol/basalt/containers/1/3.block", "/vol/basalt/containers/2"} {
			if ok, _ := vfs.Exists(crashed, p); ok {
				t.Fatalf("%s came back after a crash", p)
			}
		}
		s2 := openOn(t, crashed, o)
		defer s2.Close()
		checkBlock(t, s2, 1, 1, data)
		if got := s2.ListContainers(); len(got) != 1 || got[0].BlockCount != 1 {
			t.Fatalf("after crash: %+v", got)
		}
	})
}

// TestSyncFailureForgetsChunks: a failed fdatasync is not retried as if the
// data were still there (Linux may drop the dirty pages): the chunks of
// that block are forgotten, PutBlock refuses them, a resend restores them.
func TestSyncFailureForgetsChunks(t *testing.T) {
	posixOnly(t)
	ffs := vfs.NewFaultFS(vfs.Default)
	s := openStore(t, Options{FS: ffs, KeepUncommitted: true})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 128<<10)
	chunks := chunked(data, 64<<10)
	writeChunks(t, s, 1, 1, data, chunks)
	writeChunks(t, s, 1, 2, data, chunks)
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasSuffix(path, "/1.block") {
			return unix.ENOSPC
		}
		return nil
	})
	err := s.Sync()
	wantErr(t, err, ErrDiskFull, "container 1", "block 1")
	ffs.SetInject(nil)
	if v := s.Volumes(); v[0].Failed {
		t.Fatal("ENOSPC on sync failed the volume")
	}
	wantErr(t, s.PutBlock(1, blockOf(1, chunks, 1)), ErrChunkMissing, "block 1", "offset 0")
	if err := s.PutBlock(1, blockOf(2, chunks, 2)); err != nil {
		t.Fatalf("block on the same volume whose sync worked: %v", err)
	}
	writeChunks(t, s, 1, 1, data, chunks)
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := s.PutBlock(1, blockOf(1, chunks, 3)); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s, 1, 1, data)
}

// TestBadChunkMetadataRefused (issue 11, scenario 12): malformed checksum
// metadata and oversized chunks are refused with an InvalidArgument-class
// error by the validator and by the store, and never panic or hang.
func TestBadChunkMetadataRefused(t *testing.T) {
	s := openStore(t, Options{})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 200_000)
	good := DefaultChecksum.Compute(data)
	crc := func(bpc uint32, sums int) ChecksumData {
		return ChecksumData{Type: ChecksumCRC32C, BytesPerChecksum: bpc, Sums: make([]byte, sums)}
	}
	for _, tc := range []struct {
		name string
		off  int64
		n    int64
		sum  ChecksumData
		kind error
	}{
		{"bytes per checksum 0", 0, 200_000, crc(0, 16), ErrBadChecksum},
		{"bytes per checksum 0 no sums", 0, 200_000, crc(0, 0), ErrBadChecksum},
		{"short checksum list", 0, 200_000, crc(65536, 8), ErrBadChecksum},
		{"long checksum list", 0, 200_000, crc(65536, 20), ErrBadChecksum},
		{"sums with type NONE", 0, 200_000, ChecksumData{Sums: []byte{1}}, ErrBadChecksum},
		{"unknown type", 0, 200_000, ChecksumData{Type: 9, BytesPerChecksum: 65536, Sums: make([]byte, 16)}, ErrBadChecksum},
		{"huge window", 0, 200_000, crc(1<<31, 4), ErrBadChecksum},
		{"chunk over the limit", 0, MaxChunkSize + 1, ChecksumData{}, ErrChunkTooLarge},
		{"32 MiB chunk", 0, 32 << 20, ChecksumData{}, ErrChunkTooLarge},
		{"past the block limit", MaxBlockSize - 10, 200_000, good, ErrBlockTooLarge},
		{"offset overflow", 1<<63 - 10, 200_000, good, ErrBlockTooLarge},
		{"negative offset", -1, 200_000, good, ErrInvalidArgument},
		{"empty", 0, 0, ChecksumData{}, ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateChunk(tc.off, tc.n, tc.sum)
			if !errors.Is(err, tc.kind) || !errors.Is(err, ErrInvalidArgument) {
				t.Fatalf("ValidateChunk: %v, want %v (an invalid argument)", err, tc.kind)
			}
			if err := s.ValidateChunk(1, 1, tc.off, tc.n, tc.sum); !errors.Is(err, tc.kind) {
				t.Fatalf("Store.ValidateChunk: %v, want %v", err, tc.kind)
			}
			p := data
			if tc.n != int64(len(data)) {
				p = make([]byte, tc.n)
			}
			wantErr(t, s.WriteChunk(1, 1, tc.off, p, tc.sum, true), tc.kind, "block 1")
			if tc.kind == ErrBadChecksum {
				bd := BlockData{LocalID: 1, Length: tc.n, Chunks: []ChunkInfo{{0, tc.n, tc.sum}}}
				if err := s.ValidateBlock(1, bd); !errors.Is(err, ErrBadChecksum) {
					t.Fatalf("ValidateBlock: %v, want %v", err, ErrBadChecksum)
				}
				wantErr(t, s.PutBlock(1, bd), ErrBadChecksum, "block 1", "offset 0")
			}
			// Verify on malformed metadata reports a mismatch; it does not
			// panic (short list) or loop forever (window 0).
			done := make(chan int64, 1)
			go func() {
				defer func() {
					if r := recover(); r != nil {
						done <- -2
					}
				}()
				done <- tc.sum.Verify(p)
			}()
			select {
			case bad := <-done:
				if bad == -2 {
					t.Fatal("Verify panicked")
				}
				if tc.sum.Type != ChecksumNone && tc.kind == ErrBadChecksum && bad < 0 {
					t.Fatalf("Verify accepted malformed sums")
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Verify did not return")
			}
		})
	}
	if err := ValidateChunk(0, int64(len(data)), good); err != nil {
		t.Fatalf("good chunk refused: %v", err)
	}
	if rep, _ := s.Container(1); rep.BlockCount != 0 {
		t.Fatalf("refused requests stored something: %+v", rep)
	}
}

// TestBCSIDNeverGoesBack: extending a committed block with an older BCSID
// (a log applied out of order) is refused.
func TestBCSIDNeverGoesBack(t *testing.T) {
	s := openStore(t, Options{})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 128<<10)
	chunks := chunked(data, 64<<10)
	writeChunks(t, s, 1, 1, data, chunks[:1])
	if err := s.PutBlock(1, blockOf(1, chunks[:1], 20)); err != nil {
		t.Fatal(err)
	}
	writeChunks(t, s, 1, 1, data, chunks[1:])
	wantErr(t, s.PutBlock(1, blockOf(1, chunks, 19)), ErrBadBlockData, "block 1", "BCSID 19", "20")
	if err := s.PutBlock(1, blockOf(1, chunks, 21)); err != nil {
		t.Fatal(err)
	}
	if rep, _ := s.Container(1); rep.BCSID != 21 {
		t.Fatalf("BCSID %d, want 21", rep.BCSID)
	}
}

// TestKilledProcessKeepsOnlyRecordedChunks (issue 11, scenario 2): after a
// kill -9 the page cache still holds bytes that were never synced; Open
// keeps exactly the recorded chunks, truncates the rest, and PutBlock
// refuses a block that needs the unsynced tail.
func TestKilledProcessKeepsOnlyRecordedChunks(t *testing.T) {
	posixOnly(t)
	fs := newCrashFS()
	o := Options{KeepUncommitted: true}
	s := openOn(t, fs, o)
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 256<<10)
	chunks := chunked(data, 64<<10)
	writeChunks(t, s, 1, 1, data, chunks[:2])
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	writeChunks(t, s, 1, 1, data, chunks[2:])
	fs2 := fs.Restart()
	s2 := openOn(t, fs2, o)
	defer s2.Close()
	fi, err := fs2.Stat("/vol/basalt/containers/1/1.block")
	if err != nil || fi.Size() != 128<<10 {
		t.Fatalf("block file after recovery: %v bytes, %v; want %d", fi.Size(), err, 128<<10)
	}
	wantErr(t, s2.PutBlock(1, blockOf(1, chunks, 3)), ErrChunkMissing, "block 1", "offset 131072")
	// The sequential writer continues where the durable data ends.
	writeChunks(t, s2, 1, 1, data, chunks[2:])
	if err := s2.PutBlock(1, blockOf(1, chunks, 3)); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s2, 1, 1, data)
}

// TestRecordBeforeDataIsChecked: the record of a checksummed chunk is
// committed while its data is being synced (one flush per Sync, not
// three); if the machine stops after the record but before the data, the
// recovered chunk fails its checksums and becomes a hole: PutBlock refuses
// it, HasChunk and ReadWritten report it lost, and a resend (which must not
// be taken for a harmless re-delivery) restores it.
func TestRecordBeforeDataIsChecked(t *testing.T) {
	fs := newCrashFS()
	o := Options{KeepUncommitted: true, OutOfOrderWrites: true}
	s := openOn(t, fs, o)
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 128<<10)
	chunks := chunked(data, 64<<10)
	writeChunks(t, s, 1, 1, data, chunks[1:])
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	writeChunks(t, s, 1, 1, data, chunks[:1])
	fs.skipSync = func(name string) bool { return isBlockData(name, ".block") }
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	s2 := openOn(t, fs.Crash(), o)
	defer s2.Close()
	if ok, err := s2.HasChunk(1, 1, 0, 64<<10); ok || err != nil {
		t.Fatalf("HasChunk of a chunk whose data never reached disk: %v, %v", ok, err)
	}
	if _, err := s2.ReadWritten(1, 1, 0, 64<<10, chunks[0].Checksum); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("ReadWritten of a lost chunk: %v", err)
	}
	wantErr(t, s2.PutBlock(1, blockOf(1, chunks, 2)), ErrChunkMissing, "block 1", "offset 0")
	writeChunks(t, s2, 1, 1, data, chunks[:1])
	if err := s2.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := s2.PutBlock(1, blockOf(1, chunks, 2)); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s2, 1, 1, data)

	// Same crash, but the resend comes before anything looked: the
	// re-delivery must rewrite, not trust the record.
	fs = newCrashFS()
	s = openOn(t, fs, o)
	mustCreate(t, s, 1)
	writeChunks(t, s, 1, 1, data, chunks[1:])
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	writeChunks(t, s, 1, 1, data, chunks[:1])
	fs.skipSync = func(name string) bool { return isBlockData(name, ".block") }
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	s3 := openOn(t, fs.Crash(), o)
	defer s3.Close()
	writeChunks(t, s3, 1, 1, data, chunks[:1])
	if err := s3.PutBlock(1, blockOf(1, chunks, 2)); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s3, 1, 1, data)
}

// TestConcurrentWritersShareSync: writers on many blocks, each calling Sync
// after its chunks and PutBlock after, with a background Sync and an abort
// mixed in; every committed block reads back and nothing is left pending.
func TestConcurrentWritersShareSync(t *testing.T) {
	fs := newCrashFS()
	o := Options{KeepUncommitted: true}
	s := openOn(t, fs, o)
	mustCreate(t, s, 1)
	mustCreate(t, s, 2)
	const writers, blocks = 6, 15
	data := blockBytes(1, 1, 96<<10)
	chunks := chunked(data, 32<<10)
	stop := make(chan struct{})
	bg := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				bg <- nil
				return
			default:
			}
			if err := s.Sync(); err != nil {
				bg <- err
				return
			}
		}
	}()
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			cid := ContainerID(1 + w%2)
			for i := range blocks {
				lid := LocalID(w*1000 + i)
				for _, ch := range chunks {
					if err := s.WriteChunk(cid, lid, ch.Offset, data[ch.Offset:ch.Offset+ch.Length], ch.Checksum, true); err != nil {
						errs <- err
						return
					}
				}
				if i%5 == 4 {
					if err := s.AbortBlock(cid, lid); err != nil {
						errs <- err
						return
					}
					continue
				}
				if err := s.Sync(); err != nil {
					errs <- err
					return
				}
				if err := s.PutBlock(cid, blockOf(lid, chunks, uint64(i+1))); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	if err := <-bg; err != nil {
		t.Fatal(err)
	}
	s2 := openOn(t, fs.Crash(), o)
	defer s2.Close()
	for w := range writers {
		for i := range blocks {
			cid, lid := ContainerID(1+w%2), LocalID(w*1000+i)
			if i%5 == 4 {
				if _, err := s2.GetBlock(cid, lid); !errors.Is(err, ErrBlockNotFound) {
					t.Fatalf("aborted block %d/%d: %v", cid, lid, err)
				}
				continue
			}
			checkBlock(t, s2, cid, lid, data)
		}
	}
	if n := s2.openBlocks.Load(); n != 0 {
		t.Fatalf("%d blocks still open after everything committed or aborted", n)
	}
}

// TestWriteChunkDurableSeesForeignFailure: a Sync round started by another
// caller fails for this writer's block before the writer syncs; plain Sync
// then finds nothing to do and returns nil, so a writer acknowledging its
// chunk must learn of the loss from WriteChunkDurable.
func TestWriteChunkDurableSeesForeignFailure(t *testing.T) {
	posixOnly(t)
	ffs := vfs.NewFaultFS(vfs.Default)
	s := openStore(t, Options{FS: ffs, KeepUncommitted: true})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 128<<10)
	chunks := chunked(data, 64<<10)
	failSync := func(op, path string) error {
		if op == "sync" && strings.HasSuffix(path, "/1.block") {
			return unix.ENOSPC
		}
		return nil
	}
	// The writer's chunk is written; another caller's Sync fails for it.
	writeChunks(t, s, 1, 1, data, chunks[:1])
	ffs.SetInject(failSync)
	wantErr(t, s.Sync(), ErrDiskFull, "block 1")
	ffs.SetInject(nil)
	if err := s.Sync(); err != nil {
		t.Fatalf("plain Sync after the failure: %v", err) // nothing pending: nil
	}
	// The writer's own check says the chunk is lost.
	wantErr(t, s.awaitDurable(1, 1, 0, 64<<10), ErrDiskFull, "block 1", "offset 0", "[0,65536) lost")
	// WriteChunkDurable: a failing round is reported, a good one is not.
	ffs.SetInject(failSync)
	wantErr(t, s.WriteChunkDurable(1, 1, 0, data[:64<<10], chunks[0].Checksum, true), ErrDiskFull, "block 1")
	ffs.SetInject(nil)
	for _, ch := range chunks {
		if err := s.WriteChunkDurable(1, 1, ch.Offset, data[ch.Offset:ch.Offset+ch.Length], ch.Checksum, true); err != nil {
			t.Fatal(err)
		}
	}
	// A re-delivery of a durable chunk is durable at once.
	if err := s.WriteChunkDurable(1, 1, 0, data[:64<<10], chunks[0].Checksum, true); err != nil {
		t.Fatal(err)
	}
	if err := s.PutBlock(1, blockOf(1, chunks, 1)); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteChunkDurable(1, 1, 0, data[:64<<10], chunks[0].Checksum, true); err != nil {
		t.Fatalf("re-delivery of a committed chunk: %v", err)
	}
	checkBlock(t, s, 1, 1, data)
}
