package client

import (
	"bytes"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"os"
	"runtime/debug"
	"slices"
	"sort"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// Mapped short-circuit reads. A block file passed by a datanode
// (shortcircuit_block.go) is also mapped read-only (MAP_SHARED,
// PROT_READ) over its committed bytes [0, Length): checksum windows are
// verified on the mapping, ReadAt copies from it (one copy, as pread's),
// and WriteRange hands the verified mapping to the writer itself (no copy
// in user space; only to a SyncWriter, else it copies each step out of
// the mapping first) or, to a FileSender (the S3 gateway on plain HTTP), the
// file's range to send with sendfile (no copy at all on this side).
//
// Why a mapping cannot take the process down. A committed block's bytes
// are never rewritten or truncated by the datanode (storage truncates a
// block only down to its committed length, and deletion unlinks the file,
// which leaves the mapped inode alive), and the client maps only
// [0, Length) after checking that the file holds at least Length bytes.
// What remains is what no check can exclude: someone else truncating the
// file, or the disk failing to page a block in; both raise SIGBUS on the
// access. Every access to a mapping in user space (checksums, copies,
// writers given the mapping) runs with debug.SetPanicOnFault, and a fault
// inside a mapping becomes an error of that read (which falls back to
// gRPC or fails the WriteRange); the kernel's own accesses (write(2) from
// the mapping) return EFAULT instead. A mapping is unmapped only when the
// last read using it is done (reference counts), so closing a reader
// while a WriteRange of it runs cannot pull it away under an access.

// FileSender is an io.Writer that can also send bytes of a file without
// passing them through user memory (sendfile). WriteRange gives it ranges
// of local block files whose checksums it verified: SendFile must write
// exactly n bytes of f from f's current offset, or fail.
type FileSender interface {
	io.Writer
	SendFile(f *os.File, n int64) (int64, error)
}

// mapBlockFile maps [0, length) of f read-only after checking (fstat)
// that f holds at least length bytes; nil when length is 0, the file is
// shorter or the mapping fails (the file is then read with pread).
func mapBlockFile(f *os.File, length uint64) []byte {
	if length == 0 || length > 1<<40 {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Size < int64(length) {
		return nil
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(length), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil
	}
	return m
}

// acquire takes a reference on bf for one read; false: bf is released
// (its file closed), read otherwise.
func (bf *scBlockFile) acquire() bool {
	for {
		n := bf.refs.Load()
		if n <= 0 {
			return false
		}
		if bf.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// release drops a reference; the last one closes the file and unmaps it.
func (bf *scBlockFile) release() {
	if bf.refs.Add(-1) != 0 {
		return
	}
	if bf.m != nil {
		unix.Munmap(bf.m)
		bf.m = nil
	}
	if bf.f != nil {
		bf.f.Close()
	}
}

// faultError is a memory fault inside a mapped block file.
type faultError struct {
	addr uintptr
	v    any
}

func (e *faultError) Error() string {
	return fmt.Sprintf("fault at %#x reading a mapped block file (file shrunk or disk error): %v", e.addr, e.v)
}

// guarded runs fn with memory faults turned into panics, and returns a
// fault inside m as a *faultError. A fault elsewhere (a bug) panics on.
func guarded(m []byte, fn func()) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		v := recover()
		if v == nil {
			return
		}
		if fe, ok := v.(interface{ Addr() uintptr }); ok && len(m) > 0 {
			base := uintptr(unsafe.Pointer(unsafe.SliceData(m)))
			if a := fe.Addr(); a >= base && a < base+uintptr(len(m)) {
				err = &faultError{addr: a, v: v}
				return
			}
		}
		panic(v)
	}()
	fn()
	return nil
}

// verifyMapped checks every checksum window of bd overlapping [off, end)
// on the mapping m, under guarded; rs, re is the range checked (whole
// windows). The range's page table entries are filled first in one call
// (MADV_POPULATE_READ): a page fault per 64 KiB costs more than the
// checksum of those bytes in a VM; an error there (an old kernel, a file
// shrunk: EFAULT) is left to the guarded access.
func verifyMapped(bd *datanodepb.BlockData, m []byte, rs, re, off, end int64) error {
	if ps := int64(os.Getpagesize()); re > rs {
		_ = unix.Madvise(m[rs&^(ps-1):re], unix.MADV_POPULATE_READ)
	}
	return verifyOn(bd, m, rs, re, off, end)
}

// verifyOn is verifyMapped without filling the page tables first.
func verifyOn(bd *datanodepb.BlockData, m []byte, rs, re, off, end int64) error {
	var verr error
	if err := guarded(m, func() { verr = verifyRange(bd, rs, m[rs:re], off, end) }); err != nil {
		return err
	}
	return verr
}

// popUnit is the granularity at which a block file's mapping remembers
// that its page tables were filled (scBlockFile.populated).
const popUnit = 256 << 10

// verify is verifyMapped on bf's mapping, filling the page tables of
// [rs, re) only where this mapping has not had them filled before: with
// the client's cache a mapping serves many readers, and
// MADV_POPULATE_READ walks every page again even when all are present
// (13% of the S3 gateway's CPU on repeated GETs). Pages the kernel has
// reclaimed since just fault in again on access (under the guard).
func (bf *scBlockFile) verify(rs, re, off, end int64) error {
	if re > rs && len(bf.populated) > 0 {
		first, last := rs/popUnit, (re-1)/popUnit
		need := false
		for i := first; i <= last && !need; i++ {
			need = bf.populated[i/64].Load()&(1<<(i%64)) == 0
		}
		if need {
			if unix.Madvise(bf.m[first*popUnit:min((last+1)*popUnit, int64(len(bf.m)))], unix.MADV_POPULATE_READ) == nil {
				for i := first; i <= last; i++ {
					bf.populated[i/64].Or(1 << (i % 64))
				}
			}
		}
	}
	return verifyOn(bf.bd, bf.m, rs, re, off, end)
}

// copyMapped copies m[from:] into dst under guarded.
func copyMapped(dst, m []byte, from int64) error {
	return guarded(m, func() { copy(dst, m[from:]) })
}

// mappedPiece is [off, off+n) of a block file for WriteRange, verified
// unless lazy (then write verifies it step by step): it holds a
// reference on bf until written.
type mappedPiece struct {
	bf   *scBlockFile
	bpc  int64 // the key's bytes per checksum
	blen int64 // the block's length in the key
	off  int64
	n    int64
	lazy bool
}

// lazyStep is what a lazy piece verifies and writes at a time: a few
// checksum windows, well inside a core's L2 cache.
const lazyStep = 256 << 10

// errVerifyLater: a step of a lazy piece failed its checksum or faulted;
// nothing of it was written.
var errVerifyLater = errors.New("mapped piece failed verification")

// mapPiece returns key range [pos, end) as a verified range of a mapped
// local block file, when the range lies in one block, a replica of it
// (not failed before for this reader, and read before any replica cached
// elsewhere) is local and mapped, and its checksums match. false: read
// the range the ordinary way (readAt), which also handles every failure.
func (r *KeyReader) mapPiece(pos, end int64, lazy bool) (mappedPiece, bool) {
	c := r.c
	if c.cfg.NoShortCircuit {
		return mappedPiece{}, false
	}
	locs := r.raw.Locations
	bi := sort.Search(len(locs), func(i int) bool { return int64(locs[i].Offset+locs[i].Length) > pos })
	if bi >= len(locs) {
		return mappedPiece{}, false
	}
	l := locs[bi]
	off := pos - int64(l.Offset)
	if off+(end-pos) > int64(l.Length) || len(l.CachedDatanodes) > 0 {
		return mappedPiece{}, false
	}
	ds := slices.Clone(l.Datanodes)
	c.sc.cachedFirst(l, ds)
	for _, d := range ds {
		r.mu.Lock()
		bad := r.bad[d.Id]
		r.mu.Unlock()
		if bad || d.ShortCircuitSocket == "" {
			continue
		}
		k := scKey{d.Id, l.Id.GetContainerId(), l.Id.GetLocalId()}
		bf, err := r.scb.file(k, d, l, r.token(bi, l), &c.sc)
		if err != nil {
			return mappedPiece{}, false
		}
		// acquire before looking at bf.m: the last release sets it nil.
		if bf == nil || !bf.acquire() {
			continue
		}
		if bf.m == nil {
			bf.release()
			continue
		}
		r.mu.Lock()
		if r.layout[bi] == nil {
			r.layout[bi] = bf.bd
		}
		r.mu.Unlock()
		mp := mappedPiece{bf: bf, bpc: int64(r.raw.BytesPerChecksum), blen: int64(l.Length), off: off, n: end - pos, lazy: lazy}
		rs, re := alignRange(bf.bd, mp.bpc, mp.blen, off, off+(end-pos))
		if re > int64(len(bf.m)) || (!lazy && bf.verify(rs, re, off, off+(end-pos)) != nil) {
			// readAt reads it again and tells a corrupt replica from
			// anything else.
			bf.release()
			return mappedPiece{}, false
		}
		return mp, true
	}
	return mappedPiece{}, false
}

// SyncWriter is an io.Writer that reads the bytes given to Write only in
// the calling goroutine or in the kernel (as write(2) does), and never
// after Write returns; WritesInCallingGoroutine says whether that holds
// for this writer now (an HTTP response writer: on HTTP/1.1, not on
// HTTP/2). WriteRange hands such a writer the mapping of a local block
// file itself. A fault on a mapping (the file truncated under it, a disk
// error) becomes an error only in the goroutine that set
// debug.SetPanicOnFault: in any other it kills the process, and writers
// such as io.PipeWriter or HTTP/2's ResponseWriter pass the slice to
// another goroutine. So every other writer gets each verified step
// copied out of the mapping (under the guard) into a buffer first.
type SyncWriter interface {
	io.Writer
	WritesInCallingGoroutine() bool
}

// writesInPlace reports whether w may be given a mapping (SyncWriter).
// Besides SyncWriters: files, TCP and Unix sockets (write(2): a fault is
// EFAULT), io.Discard (reads nothing), hashes (stdlib hashes read p in
// Write) and bytes.Buffers (copy p in Write).
func writesInPlace(w io.Writer) bool {
	switch w := w.(type) {
	case SyncWriter:
		return w.WritesInCallingGoroutine()
	case *os.File, *net.TCPConn, *net.UnixConn, hash.Hash, *bytes.Buffer:
		return true
	}
	return w == io.Discard
}

// stepBufs are the buffers a step of a mapped piece is copied into for a
// writer not given the mapping.
var stepBufs = sync.Pool{New: func() any { b := make([]byte, lazyStep); return &b }}

// write sends the piece to w: with sendfile to a FileSender (sent), else
// from the mapping, or, for a writer that may read it in another
// goroutine (!writesInPlace), from a copy of each step (copied). It
// releases the piece.
func (p mappedPiece) write(w io.Writer) (n int, sent, copied bool, err error) {
	defer p.bf.release()
	if fs, ok := w.(FileSender); ok {
		p.bf.seekMu.Lock()
		defer p.bf.seekMu.Unlock()
		if _, err := p.bf.f.Seek(p.off, io.SeekStart); err != nil {
			return 0, true, false, err
		}
		k, err := fs.SendFile(p.bf.f, p.n)
		if err == nil && k != p.n {
			err = fmt.Errorf("sent %d of %d bytes of %s", k, p.n, p.bf.f.Name())
		}
		return int(k), true, false, err
	}
	copied = !writesInPlace(w)
	var buf *[]byte
	if copied {
		buf = stepBufs.Get().(*[]byte)
		defer stepBufs.Put(buf)
	}
	step := p.n
	if p.lazy || copied {
		step = lazyStep
	}
	for a := p.off; a < p.off+p.n; {
		b := min(a+step, p.off+p.n)
		if p.lazy {
			rs, re := alignRange(p.bf.bd, p.bpc, p.blen, a, b)
			if err := p.bf.verify(rs, re, a, b); err != nil {
				return n, false, copied, fmt.Errorf("%w: %w", errVerifyLater, err)
			}
		}
		var k int
		var werr error
		if copied {
			dst := (*buf)[:b-a]
			if err := copyMapped(dst, p.bf.m, a); err != nil {
				return n, false, copied, err
			}
			k, werr = w.Write(dst)
		} else if err := guarded(p.bf.m, func() { k, werr = w.Write(p.bf.m[a:b]) }); err != nil {
			return n + k, false, copied, err
		}
		n += k
		if werr != nil {
			return n, false, copied, werr
		}
		a = b
	}
	return n, false, copied, nil
}
