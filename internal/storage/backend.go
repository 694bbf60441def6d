package storage

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// BlockFiles is where a volume keeps block data. The posix backend (one file
// per block) is the only one now; a zoned backend (sequential appends into
// zones, O_DIRECT, the unaligned tail held in memory and saved at close) and
// a persistent-memory cache tier plug in here without changing Store's
// callers. Contract:
//   - WriteAt offsets of one block arrive in increasing order unless the
//     store runs with Options.OutOfOrderWrites, so an append-only backend can
//     refuse anything else.
//   - Nothing written is durable until Sync returns; Store calls Sync (and
//     SyncContainer for newly created blocks) before it commits metadata.
//   - A block whose metadata is not committed may be removed or truncated at
//     any time by Store; the backend keeps no metadata of its own that
//     Store would need.
type BlockFiles interface {
	CreateContainer(cid ContainerID) error // durable when it returns
	RemoveContainer(cid ContainerID) error
	ListContainers() ([]ContainerID, error)
	// ListBlocks lists the block data present for a container, for
	// recovery; stray entries that are not block data are removed.
	ListBlocks(cid ContainerID) ([]BlockFileInfo, error)
	// OpenWriter opens a block for writing, creating it if absent.
	OpenWriter(cid ContainerID, lid LocalID) (BlockWriter, error)
	OpenReader(cid ContainerID, lid LocalID) (BlockReader, error)
	Remove(cid ContainerID, lid LocalID) error
	Truncate(cid ContainerID, lid LocalID, size int64) error
	// SyncContainer makes block creations and removals durable.
	SyncContainer(cid ContainerID) error
}

// BlockFileInfo describes stored block data.
type BlockFileInfo struct {
	LocalID LocalID
	Size    int64
}

// BlockWriter writes one block's data.
type BlockWriter interface {
	WriteAt(p []byte, off int64) (int, error)
	Sync() error
	Close() error
}

// BlockReader reads one block's data. ReadAt may return fewer bytes than
// asked only at the end of the data.
type BlockReader interface {
	ReadAt(p []byte, off int64) (int, error)
	Close() error
}

// DirectIO selects how the posix backend moves block data.
type DirectIO int

const (
	// DirectAuto uses O_DIRECT for 4 KiB-aligned pieces when the file
	// system accepts it and buffered I/O otherwise (the default; see
	// docs/BENCHMARKS.md for the measurements behind it).
	DirectAuto DirectIO = iota
	// DirectOff always uses the page cache.
	DirectOff
)

// directAlign is the alignment O_DIRECT needs for offset, length and buffer
// address on the devices we target (4 KiB logical sectors or less).
const directAlign = 4096

// AlignedBuffer returns a zeroed buffer of n bytes whose first byte is
// 4 KiB-aligned, so reads into it and writes from it can bypass the page
// cache without a copy.
func AlignedBuffer(n int) []byte {
	b := make([]byte, n+directAlign)
	a := int(uintptr(unsafe.Pointer(&b[0])) & (directAlign - 1))
	if a != 0 {
		a = directAlign - a
	}
	return b[a : a+n : a+n]
}

func isAligned(p []byte) bool {
	return len(p) > 0 && uintptr(unsafe.Pointer(&p[0]))&(directAlign-1) == 0
}

// copyBufSize bounds the scratch buffer used to align a caller's unaligned
// memory for O_DIRECT.
const copyBufSize = 4 << 20

var copyBufPool = sync.Pool{New: func() any { b := AlignedBuffer(copyBufSize); return &b }}

// Posix is the file-per-block backend: <dir>/<cid>/<localID>.block.
type Posix struct {
	dir      string
	fs       vfs.FS
	mode     DirectIO
	noDirect atomic.Bool // set once the file system refused O_DIRECT
	// syncDir: dir, opened when the backend is created, for syncFS. A
	// write-back error is reported by syncfs(2) to every descriptor of the
	// file system opened before it happened; one opened at flush time
	// would miss the errors of pages written back earlier.
	syncDir pvfs.File
}

// NewPosix returns the posix backend rooted at dir (created if needed).
func NewPosix(fs vfs.FS, dir string, mode DirectIO) (*Posix, error) {
	if err := vfs.MkdirAllSync(fs, dir); err != nil {
		return nil, err
	}
	p := &Posix{dir: dir, fs: fs, mode: mode}
	if d, err := fs.OpenDir(dir); err == nil {
		if d.Fd() != pvfs.InvalidFd {
			p.syncDir = d
		} else {
			d.Close()
		}
	}
	if mode == DirectOff {
		p.noDirect.Store(true)
	}
	return p, nil
}

func (p *Posix) cdir(cid ContainerID) string {
	return filepath.Join(p.dir, strconv.FormatUint(uint64(cid), 10))
}

func (p *Posix) path(cid ContainerID, lid LocalID) string {
	return filepath.Join(p.cdir(cid), strconv.FormatUint(uint64(lid), 10)+".block")
}

func (p *Posix) CreateContainer(cid ContainerID) error {
	if err := p.fs.MkdirAll(p.cdir(cid), 0o755); err != nil {
		return err
	}
	return vfs.SyncDir(p.fs, p.dir)
}

func (p *Posix) RemoveContainer(cid ContainerID) error {
	if err := p.fs.RemoveAll(p.cdir(cid)); err != nil {
		return err
	}
	return vfs.SyncDir(p.fs, p.dir)
}

func (p *Posix) ListContainers() ([]ContainerID, error) {
	ents, err := vfs.ReadDir(p.fs, p.dir)
	if err != nil {
		return nil, err
	}
	var ids []ContainerID
	for _, e := range ents {
		id, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil || !e.IsDir() {
			// Not ours to interpret; leave it for the operator.
			continue
		}
		ids = append(ids, ContainerID(id))
	}
	return ids, nil
}

func (p *Posix) ListBlocks(cid ContainerID) ([]BlockFileInfo, error) {
	ents, err := vfs.ReadDir(p.fs, p.cdir(cid))
	if err != nil {
		return nil, err
	}
	var out []BlockFileInfo
	removed := false
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".block")
		id, perr := strconv.ParseUint(name, 10, 64)
		if !ok || perr != nil || e.IsDir() {
			if err := p.fs.RemoveAll(filepath.Join(p.cdir(cid), e.Name())); err != nil {
				return nil, err
			}
			removed = true
			continue
		}
		out = append(out, BlockFileInfo{LocalID: LocalID(id), Size: e.Size()})
	}
	if removed {
		if err := vfs.SyncDir(p.fs, p.cdir(cid)); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (p *Posix) OpenWriter(cid ContainerID, lid LocalID) (BlockWriter, error) {
	name := p.path(cid, lid)
	f, err := p.fs.OpenFile(name, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	// The O_DIRECT descriptor is opened at the first write that can use
	// it: a small block (one 4 KiB chunk) is written through the page
	// cache and costs one open, not two.
	return &posixWriter{f: f, p: p, name: name}, nil
}

// directMin is the smallest write sent through O_DIRECT. Below it the page
// cache costs less than a second open of the file (the fdatasync that
// makes the write durable is the same).
const directMin = 64 << 10

// openDirect opens w's O_DIRECT descriptor if it can be used.
func (w *posixWriter) openDirect() error {
	if w.direct != nil || w.p == nil || w.p.noDirect.Load() {
		return nil
	}
	d, err := w.p.fs.OpenFile(w.name, os.O_WRONLY|unix.O_DIRECT, 0)
	switch {
	case err == nil:
		w.direct = d
	case errors.Is(err, unix.EINVAL):
		// tmpfs and some FUSE file systems refuse O_DIRECT.
		w.p.noDirect.Store(true)
	default:
		return err
	}
	w.p = nil // tried: not again
	return nil
}

func (p *Posix) OpenReader(cid ContainerID, lid LocalID) (BlockReader, error) {
	name := p.path(cid, lid)
	f, err := p.fs.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	r := &posixReader{f: f}
	if !p.noDirect.Load() {
		if d, err := p.fs.OpenFile(name, os.O_RDONLY|unix.O_DIRECT, 0); err == nil {
			r.direct = d
		}
	}
	return r, nil
}

func (p *Posix) Remove(cid ContainerID, lid LocalID) error {
	err := p.fs.Remove(p.path(cid, lid))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

func (p *Posix) Truncate(cid ContainerID, lid LocalID, size int64) error {
	f, err := p.fs.OpenFile(p.path(cid, lid), os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if err == nil {
		err = f.SyncData()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func (p *Posix) SyncContainer(cid ContainerID) error { return vfs.SyncDir(p.fs, p.cdir(cid)) }

// posixWriter sends the 4 KiB-aligned part of each write through an
// O_DIRECT descriptor and the rest through a buffered one. Linux keeps the
// two coherent: a direct write flushes and invalidates cached pages it
// overlaps. fdatasync on either descriptor covers both, and is still needed
// after O_DIRECT to persist the file size and flush the device cache.
type posixWriter struct {
	f      vfs.File
	direct vfs.File // nil when O_DIRECT is off, refused or not opened yet
	// p and name open direct at the first large aligned write (p is nil
	// once that was tried).
	p    *Posix
	name string
}

func (w *posixWriter) WriteAt(p []byte, off int64) (int, error) {
	done := 0
	if w.direct == nil && w.p != nil && off%directAlign == 0 && len(p) >= directMin {
		if err := w.openDirect(); err != nil {
			return 0, err
		}
	}
	if w.direct != nil && off%directAlign == 0 && len(p) >= directAlign {
		n := len(p) &^ (directAlign - 1)
		var err error
		done, err = w.writeDirect(p[:n], off)
		if err != nil {
			if !errors.Is(err, unix.EINVAL) {
				return done, err
			}
			// The device wants larger alignment than we assumed: stop
			// trying and finish through the page cache.
			w.direct.Close()
			w.direct = nil
		}
	}
	n, err := w.f.WriteAt(p[done:], off+int64(done))
	return done + n, err
}

func (w *posixWriter) writeDirect(p []byte, off int64) (int, error) {
	if isAligned(p) {
		return w.direct.WriteAt(p, off)
	}
	bp := copyBufPool.Get().(*[]byte)
	defer copyBufPool.Put(bp)
	done := 0
	for done < len(p) {
		n := copy(*bp, p[done:])
		m, err := w.direct.WriteAt((*bp)[:n], off+int64(done))
		done += m
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// Sync is fdatasync: a block file's size and data are all that matter.
func (w *posixWriter) Sync() error { return w.f.SyncData() }

func (w *posixWriter) Close() error {
	var err error
	if w.direct != nil {
		err = w.direct.Close()
	}
	if cerr := w.f.Close(); err == nil {
		err = cerr
	}
	return err
}

type posixReader struct {
	f      vfs.File
	direct vfs.File
}

// ReadAt reads through O_DIRECT when buffer, offset and length are aligned
// (Store arranges that for verified reads), else through the page cache.
func (r *posixReader) ReadAt(p []byte, off int64) (int, error) {
	if r.direct != nil && off%directAlign == 0 && len(p)%directAlign == 0 && isAligned(p) {
		n, err := fullReadAt(r.direct, p, off)
		if err == nil || !errors.Is(err, unix.EINVAL) {
			return n, err
		}
		r.direct.Close()
		r.direct = nil
	}
	return fullReadAt(r.f, p, off)
}

// fullReadAt retries short reads, which O_DIRECT can return mid-file, and
// reports io.EOF-free short counts only at the end of the file.
func fullReadAt(f vfs.File, p []byte, off int64) (int, error) {
	done := 0
	for done < len(p) {
		n, err := f.ReadAt(p[done:], off+int64(done))
		done += n
		if err != nil {
			if isEOF(err) {
				return done, nil
			}
			return done, err
		}
		if n == 0 {
			return done, nil
		}
	}
	return done, nil
}

func (r *posixReader) Close() error {
	var err error
	if r.direct != nil {
		err = r.direct.Close()
	}
	if cerr := r.f.Close(); err == nil {
		err = cerr
	}
	return err
}

var _ BlockFiles = (*Posix)(nil)

func (p *Posix) String() string { return fmt.Sprintf("posix(%s)", p.dir) }
