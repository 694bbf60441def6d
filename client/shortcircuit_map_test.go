package client

import (
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// blockOnDisk writes data as a block file with 16 KiB CRC32C windows in
// chunks of 4 MiB and returns it open read-only with its BlockData.
func blockOnDisk(t testing.TB, data []byte) (*os.File, *datanodepb.BlockData) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "block")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	const w, chunk = 16 << 10, 4 << 20
	bd := &datanodepb.BlockData{Length: uint64(len(data))}
	for cs := 0; cs < len(data); cs += chunk {
		ce := min(cs+chunk, len(data))
		var sums []byte
		for ws := cs; ws < ce; ws += w {
			sums = binary.BigEndian.AppendUint32(sums, crc32.Checksum(data[ws:min(ws+w, ce)], crc32.MakeTable(crc32.Castagnoli)))
		}
		bd.Chunks = append(bd.Chunks, &datanodepb.ChunkInfo{Offset: uint64(cs), Length: uint64(ce - cs),
			Checksum: &datanodepb.ChecksumData{Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: w, Sums: sums}})
	}
	return f, bd
}

// TestMappedBlockFileShrunkIsAnError: a block file truncated under its
// mapping (what the datanode never does to committed bytes, but an
// operator or a failing disk can: SIGBUS on the access) makes the
// checksum check, the copy and a writer given the mapping fail with an
// error; the process goes on. Without the guard the test binary dies.
func TestMappedBlockFileShrunkIsAnError(t *testing.T) {
	data := randBytes(7, 1<<20)
	f, bd := blockOnDisk(t, data)
	m := mapBlockFile(f, bd.Length)
	if m == nil {
		t.Fatal("not mapped")
	}
	defer func() { _ = unix.Munmap(m) }()
	if err := verifyMapped(bd, m, 0, int64(len(m)), 0, int64(len(m))); err != nil {
		t.Fatalf("intact file: %v", err)
	}
	if err := os.Truncate(f.Name(), 0); err != nil {
		t.Fatal(err)
	}
	var fe *faultError
	if err := verifyMapped(bd, m, 0, int64(len(m)), 0, int64(len(m))); !errors.As(err, &fe) {
		t.Fatalf("checksums over a truncated mapping: %v, want a fault error", err)
	}
	if err := copyMapped(make([]byte, 100), m, 1<<19); !errors.As(err, &fe) {
		t.Fatalf("copy from a truncated mapping: %v, want a fault error", err)
	}
	bf := &scBlockFile{f: f, m: m, bd: bd}
	bf.refs.Store(2) // the test keeps the mapping
	bf.refs.Add(1)
	if _, _, copied, err := (mappedPiece{bf: bf, off: 4096, n: 8192}).write(syncTouchWriter{}); !errors.As(err, &fe) || copied {
		t.Fatalf("writer given a truncated mapping: %v (copied %v), want a fault error", err, copied)
	}
	if _, _, copied, err := (mappedPiece{bf: bf, off: 4096, n: 8192}).write(touchWriter{}); !errors.As(err, &fe) || !copied {
		t.Fatalf("copy for a writer from a truncated mapping: %v (copied %v), want a fault error", err, copied)
	}
	// A fault outside the mapping is a bug and still panics.
	func() {
		defer func() {
			if recover() == nil {
				t.Error("a nil dereference under guarded did not panic")
			}
		}()
		var p *int
		_ = guarded(m, func() { _ = *p })
	}()
}

// touchWriter reads every byte it is given (as a hash or TLS would).
type touchWriter struct{}

// syncTouchWriter is a touchWriter that says it reads in the calling
// goroutine: it is given the mapping itself.
type syncTouchWriter struct{ touchWriter }

func (syncTouchWriter) WritesInCallingGoroutine() bool { return true }

var touched byte

func (touchWriter) Write(p []byte) (int, error) {
	for _, b := range p {
		touched += b
	}
	return len(p), nil
}

// BenchmarkShortCircuitPiece: one 4 MiB read-ahead piece of a block in
// the page cache, the ways a short-circuit read can serve it: pread into
// a buffer and verify (session 6), copy from the mapping after verifying
// on it (ReadAt now), and verify on the mapping only (WriteRange now: the
// writer gets the mapping, or sendfile sends the file).
func BenchmarkShortCircuitPiece(b *testing.B) {
	const piece = 4 << 20
	data := randBytes(8, 32<<20)
	f, bd := blockOnDisk(b, data)
	m := mapBlockFile(f, bd.Length)
	if m == nil {
		b.Fatal("not mapped")
	}
	defer func() { _ = unix.Munmap(m) }()
	buf := make([]byte, piece)
	run := func(name string, fn func(off int64) error) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(piece)
			off := int64(0)
			for b.Loop() {
				if err := fn(off); err != nil {
					b.Fatal(err)
				}
				off = (off + piece) % int64(len(data))
			}
		})
	}
	run("pread+verify", func(off int64) error {
		if _, err := f.ReadAt(buf, off); err != nil && err != io.EOF {
			return err
		}
		return verifyRange(bd, off, buf, off, off+piece)
	})
	run("mapped-verify+copy", func(off int64) error {
		if err := verifyMapped(bd, m, off, off+piece, off, off+piece); err != nil {
			return err
		}
		return copyMapped(buf, m[:off+piece], off)
	})
	run("mapped-verify", func(off int64) error {
		return verifyMapped(bd, m, off, off+piece, off, off+piece)
	})
	// Verified through a small buffer that stays in the CPU's cache (the
	// bytes then go out with sendfile, not from the buffer).
	small := make([]byte, 256<<10)
	run("pread-small+verify", func(off int64) error {
		for o := off; o < off+piece; o += int64(len(small)) {
			if _, err := f.ReadAt(small, o); err != nil && err != io.EOF {
				return err
			}
			if err := verifyRange(bd, o, small, o, o+int64(len(small))); err != nil {
				return err
			}
		}
		return nil
	})
	// A reader maps each block once and reads it once: every page of a
	// piece is touched for the first time (page faults), as here.
	for _, populate := range []bool{false, true} {
		name := "fresh-map-verify"
		if populate {
			name += "+populate"
		}
		run(name, func(off int64) error {
			fm, err := unix.Mmap(int(f.Fd()), off, piece, unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				return err
			}
			defer unix.Munmap(fm)
			if populate {
				if err := unix.Madvise(fm, unix.MADV_POPULATE_READ); err != nil {
					return err
				}
			}
			var verr error
			if err := guarded(fm, func() { verr = verifyRange(bd, off, fm, off, off+piece) }); err != nil {
				return err
			}
			return verr
		})
	}
}

// TestLazyMappedPieceVerifies: a piece verified as it is written stops
// before the step holding a bad window, having written only the steps
// before it.
func TestLazyMappedPieceVerifies(t *testing.T) {
	data := randBytes(9, 4<<20)
	f, bd := blockOnDisk(t, data)
	m := mapBlockFile(f, bd.Length)
	if m == nil {
		t.Fatal("not mapped")
	}
	bf := &scBlockFile{f: f, m: m, bd: bd}
	bf.refs.Store(1)
	bad := int64(3*lazyStep + 100)
	wf, err := os.OpenFile(f.Name(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wf.WriteAt([]byte{data[bad] ^ 1}, bad); err != nil {
		t.Fatal(err)
	}
	wf.Close()
	var got bytesWriter
	n, _, _, err := (mappedPiece{bf: bf, bpc: 16 << 10, blen: int64(len(data)), off: lazyStep / 2, n: 2 << 20, lazy: true}).write(&got)
	// Steps [128K, 384K) and [384K, 640K) are written; [640K, 896K)
	// holds the bad byte.
	if !errors.Is(err, errVerifyLater) || n != 2*lazyStep || len(got) != n || string(got) != string(data[lazyStep/2:lazyStep/2+2*lazyStep]) {
		t.Fatalf("wrote %d bytes, %v; want %d bytes then errVerifyLater", n, err, 2*lazyStep)
	}
}

type bytesWriter []byte

func (b *bytesWriter) Write(p []byte) (int, error) { *b = append(*b, p...); return len(p), nil }

// TestVerifyPopulatesOnce: a cached mapping fills its page tables once per
// unit (the bits), and still verifies every window on every read: a byte
// changed after the first read is caught by the second.
func TestVerifyPopulatesOnce(t *testing.T) {
	data := randBytes(10, 3<<20+5000)
	f, bd := blockOnDisk(t, data)
	m := mapBlockFile(f, bd.Length)
	if m == nil {
		t.Fatal("not mapped")
	}
	bf := &scBlockFile{f: f, m: m, bd: bd, populated: make([]atomic.Uint64, 1)}
	bf.refs.Store(1)
	defer bf.release()
	n := int64(len(data))
	if err := bf.verify(popUnit+16<<10, 3*popUnit, popUnit+16<<10, 3*popUnit); err != nil {
		t.Fatal(err)
	}
	if got := bf.populated[0].Load(); got != 0b110 {
		t.Fatalf("populated %b after verifying units 1 and 2, want 110", got)
	}
	if err := bf.verify(0, n, 0, n); err != nil {
		t.Fatal(err)
	}
	if got, want := bf.populated[0].Load(), uint64(1)<<((n-1)/popUnit+1)-1; got != want {
		t.Fatalf("populated %b after verifying all, want %b", got, want)
	}
	wf, err := os.OpenFile(f.Name(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wf.WriteAt([]byte{data[2*popUnit+7] ^ 1}, 2*popUnit+7); err != nil {
		t.Fatal(err)
	}
	wf.Close()
	if err := bf.verify(0, n, 0, n); err == nil {
		t.Fatal("a byte changed after the page tables were filled passed verification")
	}
}
