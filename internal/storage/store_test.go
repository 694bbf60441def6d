package storage

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

func TestChecksumComputeVerify(t *testing.T) {
	data := blockBytes(1, 1, 200_000)
	for _, ck := range []Checksum{
		{ChecksumCRC32C, 0}, {ChecksumCRC32C, 512}, {ChecksumSHA256, 64 << 10}, {ChecksumNone, 0},
	} {
		t.Run(ck.Type.String(), func(t *testing.T) {
			d := ck.Compute(data)
			if err := d.validate(int64(len(data))); err != nil {
				t.Fatal(err)
			}
			if bad := d.Verify(data); bad != -1 {
				t.Fatalf("clean data fails at %d", bad)
			}
			if ck.Type == ChecksumNone {
				return
			}
			bpc := ck.bpc()
			flip := append([]byte(nil), data...)
			flip[bpc+7] ^= 1
			if bad := d.Verify(flip); bad != int64(bpc) {
				t.Fatalf("flipped byte at %d: reported window %d, want %d", bpc+7, bad, bpc)
			}
			if err := d.validate(int64(len(data) + bpc)); err == nil {
				t.Fatal("sums for a longer chunk accepted")
			}
		})
	}
}

func TestBlockRecordRoundTrip(t *testing.T) {
	bd := BlockData{LocalID: 7, Length: 5 << 20, BCSID: 99}
	for off := int64(0); off < bd.Length; off += 4 << 20 {
		n := min(4<<20, bd.Length-off)
		bd.Chunks = append(bd.Chunks, ChunkInfo{off, n, DefaultChecksum.Compute(make([]byte, n))})
	}
	got, err := decodeBlock(encodeBlock(&bd))
	if err != nil {
		t.Fatal(err)
	}
	if got.LocalID != 7 || got.Length != bd.Length || got.BCSID != 99 || len(got.Chunks) != 2 || !got.Chunks[1].Checksum.equal(bd.Chunks[1].Checksum) {
		t.Fatalf("round trip: %+v", got)
	}
	enc := encodeBlock(&bd)
	for _, cut := range []int{0, 1, 5, len(enc) / 2, len(enc) - 1} {
		if _, err := decodeBlock(enc[:cut]); err == nil {
			t.Fatalf("truncated record (%d of %d bytes) decoded", cut, len(enc))
		}
	}
}

func TestWriteReadRoundTrip(t *testing.T) {
	cases := []struct {
		name   string
		ck     Checksum
		length int
		chunk  int
	}{
		{"crc32c-aligned", DefaultChecksum, 8 << 20, 4 << 20},
		{"crc32c-unaligned-tail", DefaultChecksum, 5<<20 + 12345, 1 << 20},
		{"crc32c-small-window", Checksum{ChecksumCRC32C, 512}, 100_000, 33_333},
		{"sha256", Checksum{ChecksumSHA256, 16 << 10}, 300_000, 64 << 10},
		{"none", Checksum{}, 70_000, 10_000},
		{"one-byte", DefaultChecksum, 1, 1},
	}
	for _, dio := range []DirectIO{DirectAuto, DirectOff} {
		s := openStore(t, Options{DirectIO: dio})
		mustCreate(t, s, 1)
		for i, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				lid := LocalID(i + 1)
				data := blockBytes(1, lid, tc.length)
				writeBlock(t, s, 1, lid, data, tc.chunk, tc.ck, uint64(i))
				checkBlock(t, s, 1, lid, data)
				r := rand.New(rand.NewPCG(1, uint64(i)))
				for range 50 {
					off := r.IntN(tc.length)
					n := 1 + r.IntN(tc.length-off)
					p := make([]byte, n)
					if _, err := s.ReadAt(1, lid, p, int64(off)); err != nil {
						t.Fatalf("ReadAt(%d, %d): %v", off, n, err)
					}
					if !bytes.Equal(p, data[off:off+n]) {
						t.Fatalf("ReadAt(%d, %d): wrong data", off, n)
					}
				}
				bd, err := s.GetBlock(1, lid)
				if err != nil || bd.Length != int64(tc.length) || bd.BCSID != uint64(i) {
					t.Fatalf("GetBlock: %+v, %v", bd, err)
				}
			})
		}
		rep, _ := s.Container(1)
		if rep.BlockCount != int64(len(cases)) || rep.State != StateOpen {
			t.Fatalf("report %+v", rep)
		}
	}
}

// TestErrors drives every refusal and checks the sentinel, that the message
// names the inputs, and that a block stored before is unharmed.
func TestErrors(t *testing.T) {
	ck := DefaultChecksum
	good := blockBytes(1, 1, 1<<20)
	chunk := blockBytes(1, 2, 64<<10)
	sum := ck.Compute(chunk)
	cases := []struct {
		name  string
		run   func(s *Store) error
		kind  error
		names []string
	}{
		{"unknown container", func(s *Store) error { return s.WriteChunk(99, 2, 0, chunk, sum, true) }, ErrContainerNotFound, []string{"container 99"}},
		{"unknown block", func(s *Store) error { _, err := s.GetBlock(1, 42); return err }, ErrBlockNotFound, []string{"container 1", "block 42"}},
		{"read unknown block", func(s *Store) error { _, err := s.ReadChunk(1, 42, 0, 1); return err }, ErrBlockNotFound, []string{"block 42"}},
		{"create existing", func(s *Store) error { _, err := s.CreateContainer(1, CreateOptions{}); return err }, ErrContainerExists, []string{"container 1"}},
		{"write closed", func(s *Store) error { return s.WriteChunk(3, 2, 0, chunk, sum, true) }, ErrContainerNotOpen, []string{"container 3", "block 2", "CLOSED"}},
		{"put closed", func(s *Store) error {
			return s.PutBlock(3, BlockData{LocalID: 2, Length: int64(len(chunk)), Chunks: []ChunkInfo{{0, int64(len(chunk)), sum}}})
		}, ErrContainerNotOpen, []string{"container 3", "block 2"}},
		{"past block size", func(s *Store) error { return s.WriteChunk(1, 2, 4<<20-100, chunk, sum, true) }, ErrBlockTooLarge, []string{"block 2", "offset 4194204"}},
		{"chunk too large", func(s *Store) error { return s.WriteChunk(1, 2, 0, make([]byte, 2<<20), ChecksumData{}, false) }, ErrChunkTooLarge, []string{"block 2"}},
		{"past container size", func(s *Store) error {
			for i := range 3 {
				if _, err := tryWriteBlock(s, 2, LocalID(10+i), blockBytes(2, 1, 1<<20), 1<<20, ck, 0); err != nil {
					return err
				}
			}
			return nil
		}, ErrContainerFull, []string{"container 2", "block 12", "offset 0"}},
		{"out of order", func(s *Store) error { return s.WriteChunk(1, 2, 4096, chunk, sum, true) }, ErrChunkOutOfOrder, []string{"block 2", "offset 4096", "expected offset 0"}},
		{"overlap committed", func(s *Store) error { return s.WriteChunk(1, 1, 4096, chunk, sum, true) }, ErrChunkOverlap, []string{"block 1", "offset 4096"}},
		{"partial overlap", func(s *Store) error {
			if err := s.WriteChunk(1, 2, 0, chunk, sum, true); err != nil {
				return err
			}
			return s.WriteChunk(1, 2, 100, chunk[:200], ChecksumData{}, false)
		}, ErrChunkOverlap, []string{"block 2", "offset 100"}},
		{"conflicting rewrite", func(s *Store) error {
			if err := s.WriteChunk(1, 2, 0, chunk, sum, true); err != nil {
				return err
			}
			other := blockBytes(9, 9, len(chunk))
			return s.WriteChunk(1, 2, 0, other, ck.Compute(other), true)
		}, ErrChunkOverlap, []string{"block 2", "offset 0"}},
		{"checksum mismatch on write", func(s *Store) error {
			bad := append([]byte(nil), chunk...)
			bad[40000] ^= 0xff
			return s.WriteChunk(1, 2, 0, bad, sum, true)
		}, ErrChecksumMismatch, []string{"block 2", "offset 0"}},
		{"malformed checksum", func(s *Store) error {
			return s.WriteChunk(1, 2, 0, chunk, ChecksumData{Type: ChecksumCRC32C, BytesPerChecksum: 65536, Sums: []byte{1, 2}}, true)
		}, ErrBadChecksum, []string{"block 2"}},
		{"put unwritten data", func(s *Store) error {
			return s.PutBlock(1, BlockData{LocalID: 2, Length: int64(len(chunk)), Chunks: []ChunkInfo{{0, int64(len(chunk)), sum}}})
		}, ErrChunkMissing, []string{"block 2", "offset 0", "[0,65536)"}},
		{"put gap in chunks", func(s *Store) error {
			return s.PutBlock(1, BlockData{LocalID: 2, Length: 10, Chunks: []ChunkInfo{{5, 5, ChecksumData{}}}})
		}, ErrBadBlockData, []string{"block 2", "offset 5"}},
		{"put shrinks committed", func(s *Store) error {
			return s.PutBlock(1, BlockData{LocalID: 1, Length: 10, Chunks: []ChunkInfo{{0, 10, ChecksumData{}}}})
		}, ErrBadBlockData, []string{"block 1"}},
		{"read past end", func(s *Store) error { _, err := s.ReadAt(1, 1, make([]byte, 10), 1<<20-5); return err }, ErrOutOfRange, []string{"block 1", "offset 1048571"}},
		{"export open container", func(s *Store) error { return s.Export(1, &bytes.Buffer{}) }, ErrContainerNotClosed, []string{"container 1"}},
		{"delete open container", func(s *Store) error { return s.DeleteContainer(1, false) }, ErrContainerNotClosed, []string{"container 1"}},
		{"delete unknown blocks", func(s *Store) error { return s.DeleteBlocks(1, []LocalID{1, 77}) }, ErrBlockNotFound, []string{"block 77"}},
		{"disk full by reserve", func(s *Store) error {
			setReserved(s, 1<<62)
			return s.WriteChunk(1, 2, 0, chunk, sum, true)
		}, ErrDiskFull, []string{"block 2", "offset 0"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, Options{MaxBlockSize: 4 << 20, MaxChunkSize: 1 << 20})
			mustCreate(t, s, 1)
			if _, err := s.CreateContainer(2, CreateOptions{MaxSize: 5 << 19}); err != nil {
				t.Fatal(err)
			}
			mustCreate(t, s, 3)
			writeBlock(t, s, 1, 1, good, 256<<10, ck, 1)
			if err := s.CloseContainer(3); err != nil {
				t.Fatal(err)
			}
			before, _ := s.Container(1)
			wantErr(t, tc.run(s), tc.kind, tc.names...)
			setReserved(s, 0)
			checkBlock(t, s, 1, 1, good)
			if after, _ := s.Container(1); after.BlockCount != before.BlockCount || after.UsedBytes != before.UsedBytes {
				t.Fatalf("counters changed: %+v -> %+v", before, after)
			}
		})
	}
}

func TestRedeliveryAndExtend(t *testing.T) {
	s := openStore(t, Options{})
	mustCreate(t, s, 1)
	ck := DefaultChecksum
	data := blockBytes(1, 5, 3<<20)
	a, b := data[:2<<20], data[2<<20:]
	sa, sb := ck.Compute(a), ck.Compute(b)
	for range 3 { // Raft re-delivery of the same chunk
		if err := s.WriteChunk(1, 5, 0, a, sa, true); err != nil {
			t.Fatal(err)
		}
	}
	bd := BlockData{LocalID: 5, Length: int64(len(a)), Chunks: []ChunkInfo{{0, int64(len(a)), sa}}, BCSID: 10}
	for range 2 { // Raft re-apply of PutBlock
		if err := s.PutBlock(1, bd); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.WriteChunk(1, 5, 0, a, sa, true); err != nil {
		t.Fatalf("re-delivery of committed chunk: %v", err)
	}
	// Extend with a second chunk and commit again (Ozone's periodic PutBlock).
	if err := s.WriteChunk(1, 5, int64(len(a)), b, sb, true); err != nil {
		t.Fatal(err)
	}
	bd.Chunks = append(bd.Chunks, ChunkInfo{int64(len(a)), int64(len(b)), sb})
	bd.Length, bd.BCSID = int64(len(data)), 11
	if err := s.PutBlock(1, bd); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s, 1, 5, data)
	rep, _ := s.Container(1)
	if rep.BlockCount != 1 || rep.UsedBytes != int64(len(data)) || rep.BCSID != 11 {
		t.Fatalf("report %+v", rep)
	}
}

func TestOutOfOrderWrites(t *testing.T) {
	s := openStore(t, Options{OutOfOrderWrites: true})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 1<<20)
	ck := DefaultChecksum
	var chunks []ChunkInfo
	for _, off := range []int{768 << 10, 0, 512 << 10, 256 << 10} {
		p := data[off : off+256<<10]
		if err := s.WriteChunk(1, 1, int64(off), p, ck.Compute(p), true); err != nil {
			t.Fatal(err)
		}
	}
	for off := 0; off < len(data); off += 256 << 10 {
		chunks = append(chunks, ChunkInfo{int64(off), 256 << 10, ck.Compute(data[off : off+256<<10])})
	}
	if err := s.PutBlock(1, BlockData{LocalID: 1, Length: int64(len(data)), Chunks: chunks}); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s, 1, 1, data)
}

func TestStreamWriter(t *testing.T) {
	s := openStore(t, Options{MaxChunkSize: 1 << 20})
	mustCreate(t, s, 1)
	data := blockBytes(1, 3, 3<<20+100)
	w := s.OpenStream(1, 3, 0)
	for off := 0; off < len(data); off += 700_000 { // packets do not match chunks
		if _, err := w.Write(data[off:min(off+700_000, len(data))]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	bd := BlockData{LocalID: 3, Length: int64(len(data))}
	for off := 0; off < len(data); off += 4 << 20 {
		p := data[off:min(off+4<<20, len(data))]
		bd.Chunks = append(bd.Chunks, ChunkInfo{int64(off), int64(len(p)), DefaultChecksum.Compute(p)})
	}
	if err := s.PutBlock(1, bd); err != nil {
		t.Fatal(err)
	}
	checkBlock(t, s, 1, 3, data)
}

func TestCloseDeleteLifecycle(t *testing.T) {
	posixOnly(t)
	dir := t.TempDir()
	s := openStore(t, Options{Volumes: []string{dir}})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 300_000)
	writeBlock(t, s, 1, 1, data, 100_000, DefaultChecksum, 1)
	writeBlock(t, s, 1, 2, data, 100_000, DefaultChecksum, 2)
	// An uncommitted block is discarded by close.
	if err := s.WriteChunk(1, 3, 0, data, ChecksumData{}, false); err != nil {
		t.Fatal(err)
	}
	if err := s.MarkClosing(1); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteChunk(1, 4, 0, data[:10], ChecksumData{}, false); err != nil {
		t.Fatalf("CLOSING must still take writes: %v", err)
	}
	if err := s.CloseContainer(1); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseContainer(1); err != nil {
		t.Fatalf("second close: %v", err)
	}
	for _, lid := range []string{"3", "4"} {
		if _, err := os.Stat(filepath.Join(dir, "basalt/containers/1", lid+".block")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("uncommitted block %s survived close: %v", lid, err)
		}
	}
	if err := s.DeleteBlocks(1, []LocalID{2}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetBlock(1, 2); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("deleted block: %v", err)
	}
	if rep, _ := s.Container(1); rep.BlockCount != 1 || rep.UsedBytes != int64(len(data)) || rep.State != StateClosed {
		t.Fatalf("report %+v", rep)
	}
	if err := s.DeleteContainer(1, false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "basalt/containers/1")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("container dir survived delete: %v", err)
	}
	if len(s.ListContainers()) != 0 {
		t.Fatal("container still listed")
	}
	// State survives restart.
	mustCreate(t, s, 2)
	writeBlock(t, s, 2, 1, data, 100_000, DefaultChecksum, 5)
	if err := s.CloseContainer(2); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s2 := openStore(t, Options{Volumes: []string{dir}})
	got := s2.ListContainers()
	if len(got) != 1 || got[0].ID != 2 || got[0].State != StateClosed || got[0].BlockCount != 1 || got[0].BCSID != 5 {
		t.Fatalf("after restart: %+v", got)
	}
	checkBlock(t, s2, 2, 1, data)
}

func TestRestartCleansUncommitted(t *testing.T) {
	posixOnly(t)
	dir := t.TempDir()
	s := openStore(t, Options{Volumes: []string{dir}})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 200_000)
	writeBlock(t, s, 1, 1, data, 100_000, DefaultChecksum, 1)
	if err := s.WriteChunk(1, 1, 200_000, data[:5000], ChecksumData{}, false); err != nil { // uncommitted tail
		t.Fatal(err)
	}
	if err := s.WriteChunk(1, 2, 0, data, ChecksumData{}, false); err != nil { // uncommitted block
		t.Fatal(err)
	}
	// A directory from a create that crashed before its record.
	if err := os.MkdirAll(filepath.Join(dir, "basalt/containers/77"), 0o755); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s2 := openStore(t, Options{Volumes: []string{dir}})
	checkBlock(t, s2, 1, 1, data)
	fi, err := os.Stat(filepath.Join(dir, "basalt/containers/1/1.block"))
	if err != nil || fi.Size() != 200_000 {
		t.Fatalf("committed block not truncated to its length: %v %v", fi, err)
	}
	for _, p := range []string{"basalt/containers/1/2.block", "basalt/containers/77"} {
		if _, err := os.Stat(filepath.Join(dir, p)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s survived restart: %v", p, err)
		}
	}
	// The tail can be rewritten now.
	if err := s2.WriteChunk(1, 1, 200_000, data[:10], ChecksumData{}, false); err != nil {
		t.Fatal(err)
	}
	// A committed block whose file lost data marks the container UNHEALTHY.
	s2.Close()
	if err := os.Truncate(filepath.Join(dir, "basalt/containers/1/1.block"), 1000); err != nil {
		t.Fatal(err)
	}
	s3 := openStore(t, Options{Volumes: []string{dir}})
	if rep, _ := s3.Container(1); rep.State != StateUnhealthy {
		t.Fatalf("state %v, want UNHEALTHY", rep.State)
	}
}

func TestCorruptionDetected(t *testing.T) {
	posixOnly(t)
	for _, tc := range []struct {
		name string
		ck   Checksum
		flip int64
		want int64 // offset of the bad window
	}{
		{"crc32c", DefaultChecksum, 5<<20 + 70000, 5<<20 + 65536},
		{"crc32c-first-byte", DefaultChecksum, 0, 0},
		{"sha256", Checksum{ChecksumSHA256, 4096}, 123_456, 122_880},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			s := openStore(t, Options{Volumes: []string{dir}})
			mustCreate(t, s, 7)
			data := blockBytes(7, 9, 6<<20)
			writeBlock(t, s, 7, 9, data, 4<<20, tc.ck, 1)
			writeBlock(t, s, 7, 10, data, 4<<20, tc.ck, 2)
			f, err := os.OpenFile(filepath.Join(dir, "basalt/containers/7/9.block"), os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			b := []byte{0}
			f.ReadAt(b, tc.flip)
			b[0] ^= 0x40
			f.WriteAt(b, tc.flip)
			f.Sync()
			f.Close()
			_, err = s.ReadChunk(7, 9, 0, int64(len(data)))
			wantErr(t, err, ErrCorruption, "container 7", "block 9", "offset "+itoa(tc.want))
			var se *Error
			errors.As(err, &se)
			if se.Container != 7 || se.Block != 9 || se.Offset != tc.want || !errors.Is(err, ErrChecksumMismatch) {
				t.Fatalf("error fields %+v", se)
			}
			// A read that avoids the bad window still works; the other block too.
			if tc.want > 0 {
				if _, err := s.ReadChunk(7, 9, 0, tc.want); err != nil {
					t.Fatalf("clean prefix: %v", err)
				}
			}
			checkBlock(t, s, 7, 10, data)
		})
	}
}

func TestDiskFullInjected(t *testing.T) {
	posixOnly(t) // the zones' free space is not the file system's
	ffs := vfs.NewFaultFS(vfs.Default)
	s := openStore(t, Options{FS: ffs})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 2<<20)
	writeBlock(t, s, 1, 1, data, 1<<20, DefaultChecksum, 1)

	// ENOSPC mid-write (half the chunk lands): a clean ErrDiskFull, the
	// volume stays healthy, the block can be retried.
	ffs.SetInject(func(op, path string) error {
		if op == "write" {
			return vfs.ErrTornWrite
		}
		return nil
	})
	err := s.WriteChunk(1, 2, 0, data[:1<<20], DefaultChecksum.Compute(data[:1<<20]), true)
	wantErr(t, err, ErrDiskFull, "container 1", "block 2", "offset 0")
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("cause lost: %v", err)
	}
	// ENOSPC from fsync at commit.
	ffs.SetInject(nil)
	if err := s.WriteChunk(1, 3, 0, data[:4096], ChecksumData{}, false); err != nil {
		t.Fatal(err)
	}
	ffs.SetInject(func(op, path string) error {
		if op == "sync" {
			return unix.ENOSPC
		}
		return nil
	})
	err = s.PutBlock(1, BlockData{LocalID: 3, Length: 4096, Chunks: []ChunkInfo{{0, 4096, ChecksumData{}}}})
	wantErr(t, err, ErrDiskFull, "block 3")
	// The volume reports full via capacity too.
	ffs.SetInject(nil)
	ffs.SetCapacity(&vfs.DiskUsage{TotalBytes: 1 << 30, AvailBytes: 1000})
	s.Volumes() // a report refreshes the cached free space
	wantErr(t, s.WriteChunk(1, 4, 0, data[:4096], ChecksumData{}, false), ErrDiskFull, "block 4")
	_, err = s.CreateContainer(2, CreateOptions{})
	wantErr(t, err, ErrNoVolume, "container 2")
	ffs.SetCapacity(nil)

	checkBlock(t, s, 1, 1, data)
	if v := s.Volumes(); v[0].Failed {
		t.Fatalf("disk full failed the volume: %+v", v[0])
	}
	writeBlock(t, s, 1, 2, data, 1<<20, DefaultChecksum, 2)
	checkBlock(t, s, 1, 2, data)
}

// TestDiskFullTmpfs fills a real 8 MiB tmpfs when mounting is allowed.
func TestDiskFullTmpfs(t *testing.T) {
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=8m"); err != nil {
		t.Skipf("cannot mount tmpfs (%v); TestDiskFullInjected covers ENOSPC", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	s, err := Open(Options{Volumes: []string{dir}, ContainerSize: 4 << 20, MetaReserveBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	mustCreate(t, s, 1)
	if _, err := s.CreateContainer(2, CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	data := blockBytes(1, 1, 1<<20)
	writeBlock(t, s, 1, 1, data, 1<<20, DefaultChecksum, 1)
	var full error
	for i := range 20 {
		cid := ContainerID(1 + i%2)
		if _, err := tryWriteBlock(s, cid, LocalID(100+i), data, 1<<20, DefaultChecksum, 0); err != nil {
			full = err
			break
		}
	}
	if full == nil {
		t.Fatal("20 MiB fit in an 8 MiB tmpfs")
	}
	if !errors.Is(full, ErrDiskFull) && !errors.Is(full, ErrContainerFull) {
		t.Fatalf("got %v, want disk or container full", full)
	}
	checkBlock(t, s, 1, 1, data)
}

func TestVolumePlacementAndFailure(t *testing.T) {
	posixOnly(t) // fakes the file system's free space
	f1, f2 := vfs.NewFaultFS(vfs.Default), vfs.NewFaultFS(vfs.Default)
	d1, d2 := t.TempDir(), t.TempDir()
	// One FS per volume would need per-volume options; instead route by path.
	fs := &routeFS{FS: vfs.Default, routes: map[string]*vfs.FaultFS{d1: f1, d2: f2}}
	f1.SetCapacity(&vfs.DiskUsage{TotalBytes: 100 << 30, AvailBytes: 10 << 30})
	f2.SetCapacity(&vfs.DiskUsage{TotalBytes: 100 << 30, AvailBytes: 50 << 30})
	s := openStore(t, Options{Volumes: []string{d1, d2}, FS: fs, ContainerSize: 5 << 30, ReservedBytes: 6 << 30})
	r, err := s.CreateContainer(1, CreateOptions{})
	if err != nil || r.Volume != d2 {
		t.Fatalf("placed on %q (%v), want the emptier %q", r.Volume, err, d2)
	}
	f2.SetCapacity(&vfs.DiskUsage{TotalBytes: 100 << 30, AvailBytes: 8 << 30})
	f1.SetCapacity(&vfs.DiskUsage{TotalBytes: 100 << 30, AvailBytes: 12 << 30})
	if r, _ = s.CreateContainer(2, CreateOptions{}); r.Volume != d1 {
		t.Fatalf("placed on %q, want %q", r.Volume, d1)
	}
	// Reserve leaves neither volume room for 5 GiB.
	f1.SetCapacity(&vfs.DiskUsage{TotalBytes: 100 << 30, AvailBytes: 7 << 30})
	_, err = s.CreateContainer(3, CreateOptions{})
	wantErr(t, err, ErrNoVolume, "container 3")
	f1.SetCapacity(nil)
	f2.SetCapacity(nil)
	s.opts.ReservedBytes = 0

	data := blockBytes(1, 1, 100_000)
	writeBlock(t, s, 1, 1, data, 100_000, DefaultChecksum, 1)
	writeBlock(t, s, 2, 1, data, 100_000, DefaultChecksum, 1)
	// EIO on volume 2 fails it; volume 1 carries on.
	f2.SetInject(func(op, path string) error { return unix.EIO })
	_, err = tryWriteBlock(s, 1, 2, data, 100_000, DefaultChecksum, 2)
	wantErr(t, err, ErrVolumeFailed, "container 1", "block 2", d2)
	reps := map[ContainerID]ContainerReport{}
	for _, r := range s.ListContainers() {
		reps[r.ID] = r
	}
	if reps[1].State != StateUnhealthy || reps[2].State != StateOpen {
		t.Fatalf("reports after failure: %+v", reps)
	}
	vols := s.Volumes()
	if vols[0].Failed || !vols[1].Failed || vols[1].Error == "" {
		t.Fatalf("volume reports: %+v", vols)
	}
	_, err = s.ReadChunk(1, 1, 0, 10)
	wantErr(t, err, ErrVolumeFailed, "container 1")
	checkBlock(t, s, 2, 1, data)
	r, err = s.CreateContainer(4, CreateOptions{MaxSize: 1 << 20})
	if err != nil || r.Volume != d1 {
		t.Fatalf("new container on %q (%v), want healthy %q", r.Volume, err, d1)
	}
}

// routeFS sends each volume's calls to its own FaultFS.
type routeFS struct {
	vfs.FS
	routes map[string]*vfs.FaultFS
}

func (r *routeFS) pick(p string) vfs.FS {
	for dir, f := range r.routes {
		if rel, err := filepath.Rel(dir, p); err == nil && !filepath.IsAbs(rel) && (rel == "." || rel[0] != '.') {
			return f
		}
	}
	return r.FS
}
func (r *routeFS) OpenFile(n string, fl int, m os.FileMode) (vfs.File, error) {
	return r.pick(n).OpenFile(n, fl, m)
}
func (r *routeFS) Create(n string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	return r.pick(n).Create(n, c)
}
func (r *routeFS) Link(o, n string) error { return r.pick(n).Link(o, n) }
func (r *routeFS) Open(n string, o ...pvfs.OpenOption) (pvfs.File, error) {
	return r.pick(n).Open(n, o...)
}
func (r *routeFS) OpenReadWrite(n string, c pvfs.DiskWriteCategory, o ...pvfs.OpenOption) (pvfs.File, error) {
	return r.pick(n).OpenReadWrite(n, c, o...)
}
func (r *routeFS) OpenDir(n string) (pvfs.File, error) { return r.pick(n).OpenDir(n) }
func (r *routeFS) Remove(p string) error               { return r.pick(p).Remove(p) }
func (r *routeFS) RemoveAll(p string) error            { return r.pick(p).RemoveAll(p) }
func (r *routeFS) Rename(o, n string) error            { return r.pick(n).Rename(o, n) }
func (r *routeFS) ReuseForWrite(o, n string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	return r.pick(n).ReuseForWrite(o, n, c)
}
func (r *routeFS) MkdirAll(p string, m os.FileMode) error { return r.pick(p).MkdirAll(p, m) }
func (r *routeFS) Lock(p string) (io.Closer, error)       { return r.pick(p).Lock(p) }
func (r *routeFS) List(p string) ([]string, error)        { return r.pick(p).List(p) }
func (r *routeFS) Stat(p string) (vfs.FileInfo, error)    { return r.pick(p).Stat(p) }
func (r *routeFS) GetDiskUsage(p string) (vfs.DiskUsage, error) {
	return r.pick(p).GetDiskUsage(p)
}

func TestExportImport(t *testing.T) {
	src := openStore(t, Options{})
	dst := openStore(t, Options{})
	mustCreate(t, src, 5)
	var blocks [][]byte
	for i := range 4 {
		d := blockBytes(5, LocalID(i), 1<<20+i*1000)
		blocks = append(blocks, d)
		ck := DefaultChecksum
		if i == 3 {
			ck = Checksum{ChecksumSHA256, 8192}
		}
		writeBlock(t, src, 5, LocalID(i), d, 300_000, ck, uint64(i+20))
	}
	if err := src.CloseContainer(5); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := src.Export(5, &buf); err != nil {
		t.Fatal(err)
	}
	stream := buf.Bytes()

	// Damaged streams are refused and leave nothing behind.
	for _, tc := range []struct {
		name string
		mut  func([]byte) []byte
	}{
		{"flipped data byte", func(b []byte) []byte { b = bytes.Clone(b); b[len(b)/2] ^= 1; return b }},
		{"flipped trailer", func(b []byte) []byte { b = bytes.Clone(b); b[len(b)-1] ^= 1; return b }},
		{"truncated", func(b []byte) []byte { return b[:len(b)-100_000] }},
		{"bad magic", func(b []byte) []byte { b = bytes.Clone(b); b[0] = 'X'; return b }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := dst.Import(bytes.NewReader(tc.mut(stream)))
			if !errors.Is(err, ErrBadExport) {
				t.Fatalf("got %v, want ErrBadExport", err)
			}
			if len(dst.ListContainers()) != 0 {
				t.Fatal("failed import left a container")
			}
		})
	}
	rep, err := dst.Import(bytes.NewReader(stream))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := src.Container(5)
	want.Volume = rep.Volume
	if rep != want {
		t.Fatalf("imported %+v, want %+v", rep, want)
	}
	for i, d := range blocks {
		checkBlock(t, dst, 5, LocalID(i), d)
	}
	_, err = dst.Import(bytes.NewReader(stream))
	wantErr(t, err, ErrContainerExists, "container 5")
}

func TestDirectIOFallbackTmpfs(t *testing.T) {
	if fi, err := os.Stat("/dev/shm"); err != nil || !fi.IsDir() {
		t.Skip("no /dev/shm")
	}
	dir, err := os.MkdirTemp("/dev/shm", "basalt-storage-test")
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := openStore(t, Options{Volumes: []string{dir}})
	mustCreate(t, s, 1)
	data := blockBytes(1, 1, 4<<20+777)
	writeBlock(t, s, 1, 1, data, 1<<20, DefaultChecksum, 1)
	checkBlock(t, s, 1, 1, data)
}

func TestTooManyOpenBlocks(t *testing.T) {
	s := openStore(t, Options{MaxOpenBlocks: 2})
	mustCreate(t, s, 1)
	p := []byte("x")
	for lid := range LocalID(2) {
		if err := s.WriteChunk(1, lid, 0, p, ChecksumData{}, false); err != nil {
			t.Fatal(err)
		}
	}
	wantErr(t, s.WriteChunk(1, 9, 0, p, ChecksumData{}, false), ErrTooManyOpenBlocks, "block 9")
	if err := s.PutBlock(1, BlockData{LocalID: 0, Length: 1, Chunks: []ChunkInfo{{0, 1, ChecksumData{}}}}); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteChunk(1, 9, 0, p, ChecksumData{}, false); err != nil {
		t.Fatalf("slot not freed by commit: %v", err)
	}
}
