package zoned

import (
	"errors"
	"fmt"
	"io"
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

// EmuFS emulates a zonefs mount on a directory of another vfs.FS (a real
// directory or an in-memory FS that can crash), for tests and benchmarks
// where no zoned device exists. Each sequential zone is a file
// <root>/seq/<i> whose size is the zone's write pointer, and EmuFS enforces
// every rule zonefs and the device impose, failing the call as Linux does
// and recording a violation:
//   - writes only through O_DIRECT handles (a buffered write fails EIO),
//     only at the write pointer (EINVAL), only in whole logical blocks from
//     memory aligned to the block size (EINVAL), never past the zone
//     capacity (EFBIG);
//   - O_DIRECT reads only aligned in offset, length and memory (EINVAL);
//   - truncate only to 0 (zone reset) or to the capacity (zone finish),
//     else EPERM; no files are created, removed or renamed under the root;
//   - at most MaxOpen zones open for writing that are neither empty nor
//     full (EBUSY on open) and at most MaxActive zones written but not full
//     (a write that would activate one more fails with EIO, as the device
//     refuses it).
//
// Everything outside root passes through to the wrapped FS, so a volume's
// metadata can live on the same FS.
type EmuFS struct {
	vfs.FS
	root string
	g    Geometry

	mu         sync.Mutex
	zones      []emuZone
	violations []string
	writes     atomic.Int64 // device writes accepted (all at the write pointer)
	written    atomic.Int64 // bytes written
}

type emuZone struct {
	wmu    sync.Mutex // one write, reset or finish at a time, as on the device
	wp     int64      // under EmuFS.mu
	writer int        // open write handles, under EmuFS.mu
}

// Violations counts rule violations of every EmuFS in the process, for a
// test harness that checks none happened.
var Violations atomic.Int64

// NewEmuFS opens the emulated zonefs at root on fs, formatting it with
// geometry g (all zones empty) when root/seq does not exist. An existing
// emulation keeps its zones; its write pointers are the files' sizes,
// rounded down to a block as a device's would be after a torn write.
func NewEmuFS(fs vfs.FS, root string, g Geometry) (*EmuFS, error) {
	if err := g.validate(); err != nil {
		return nil, fmt.Errorf("zoned: emulated geometry: %w", err)
	}
	e := &EmuFS{FS: fs, root: filepath.Clean(root), g: g, zones: make([]emuZone, g.Zones)}
	seq := filepath.Join(e.root, "seq")
	ok, err := vfs.Exists(fs, seq)
	if err != nil {
		return nil, err
	}
	if !ok {
		if err := vfs.MkdirAllSync(fs, filepath.Join(e.root, "cnv")); err != nil {
			return nil, err
		}
		tmp := seq + ".tmp"
		if err := fs.RemoveAll(tmp); err != nil {
			return nil, err
		}
		if err := fs.MkdirAll(tmp, 0o755); err != nil {
			return nil, err
		}
		for i := range g.Zones {
			f, err := fs.Create(filepath.Join(tmp, strconv.Itoa(i)), vfs.WriteCategory)
			if err != nil {
				return nil, err
			}
			f.Close()
		}
		if err := vfs.SyncDir(fs, tmp); err != nil {
			return nil, err
		}
		if err := fs.Rename(tmp, seq); err != nil {
			return nil, err
		}
		if err := vfs.SyncDir(fs, e.root); err != nil {
			return nil, err
		}
	}
	for i := range g.Zones {
		name := filepath.Join(seq, strconv.Itoa(i))
		fi, err := fs.Stat(name)
		if err != nil {
			return nil, fmt.Errorf("zoned: emulated zone %d: %w", i, err)
		}
		wp := fi.Size()
		if a := wp &^ int64(g.align()-1); a != wp || wp > g.ZoneCap {
			a = min(a, g.ZoneCap)
			f, err := fs.OpenFile(name, os.O_WRONLY, 0)
			if err != nil {
				return nil, err
			}
			err = f.Truncate(a)
			if err == nil {
				err = f.Sync()
			}
			f.Close()
			if err != nil {
				return nil, err
			}
			wp = a
		}
		e.zones[i].wp = wp
	}
	return e, nil
}

// ZoneGeometry implements geometrySource.
func (e *EmuFS) ZoneGeometry(mount string) (Geometry, bool) {
	return e.g, filepath.Clean(mount) == e.root
}

// Violations returns the rule violations seen so far.
func (e *EmuFS) Violations() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.violations...)
}

// DeviceWrites returns the writes and bytes the emulated device accepted;
// every one was at its zone's write pointer (others fail).
func (e *EmuFS) DeviceWrites() (writes, bytes int64) { return e.writes.Load(), e.written.Load() }

func (e *EmuFS) violate(op, name string, errno error, format string, args ...any) error {
	msg := fmt.Sprintf("%s %s: %s", op, name, fmt.Sprintf(format, args...))
	e.mu.Lock()
	if len(e.violations) < 1000 {
		e.violations = append(e.violations, msg)
	}
	e.mu.Unlock()
	Violations.Add(1)
	return &os.PathError{Op: op, Path: name, Err: fmt.Errorf("%w (emulated zonefs: %s)", errno, msg)}
}

// zoneOf returns the zone index of a path under root/seq, -1 for other
// paths under root (the root, seq/, cnv/), -2 outside root.
func (e *EmuFS) zoneOf(name string) int {
	name = filepath.Clean(name)
	rel, err := filepath.Rel(e.root, name)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return -2
	}
	if d, f := filepath.Split(rel); d == "seq/" {
		if i, err := strconv.Atoi(f); err == nil && i >= 0 && i < len(e.zones) && strconv.Itoa(i) == f {
			return i
		}
	}
	return -1
}

func (e *EmuFS) refuse(op, name string) error {
	if e.zoneOf(name) != -2 {
		return e.violate(op, name, unix.EPERM, "zonefs files cannot be created, removed or renamed")
	}
	return nil
}

// activeLocked counts zones written but not full. Caller holds mu.
func (e *EmuFS) activeLocked() (active, open int) {
	for i := range e.zones {
		z := &e.zones[i]
		if z.wp > 0 && z.wp < e.g.ZoneCap {
			active++
		}
	}
	return active, e.openLocked()
}

// openLocked counts zones not full with a handle open for writing (what
// zonefs's explicit-open mode counts against the device's open limit).
func (e *EmuFS) openLocked() int {
	n := 0
	for i := range e.zones {
		z := &e.zones[i]
		if z.wp < e.g.ZoneCap && z.writer > 0 {
			n++
		}
	}
	return n
}

func (e *EmuFS) OpenFile(name string, flag int, perm os.FileMode) (vfs.File, error) {
	i := e.zoneOf(name)
	if i == -2 {
		return e.FS.OpenFile(name, flag, perm)
	}
	if i < 0 {
		if flag&(os.O_WRONLY|os.O_RDWR|os.O_CREATE) != 0 {
			return nil, e.violate("open", name, unix.EPERM, "only zone files can be written")
		}
		return e.FS.OpenFile(name, flag&^unix.O_DIRECT, perm)
	}
	if flag&os.O_TRUNC != 0 {
		return nil, e.violate("open", name, unix.EPERM, "O_TRUNC")
	}
	write := flag&(os.O_WRONLY|os.O_RDWR) != 0
	if write {
		e.mu.Lock()
		z := &e.zones[i]
		if z.wp < e.g.ZoneCap && z.writer == 0 && e.g.MaxOpen > 0 {
			if open := e.openLocked(); open >= e.g.MaxOpen {
				e.mu.Unlock()
				return nil, e.violate("open", name, unix.EBUSY, "more than %d open zones", e.g.MaxOpen)
			}
		}
		z.writer++
		e.mu.Unlock()
	}
	// Direct I/O passes through when the underlying FS has it (so the
	// emulation costs what a device would), else it is only checked.
	inner := flag &^ (os.O_CREATE | os.O_APPEND)
	f, err := e.FS.OpenFile(name, inner, 0)
	if err != nil && inner&unix.O_DIRECT != 0 && errors.Is(err, unix.EINVAL) {
		f, err = e.FS.OpenFile(name, inner&^unix.O_DIRECT, 0)
	}
	if err != nil {
		if write {
			e.mu.Lock()
			e.zones[i].writer--
			e.mu.Unlock()
		}
		return nil, err
	}
	return &emuFile{File: f, e: e, zone: i, name: name, write: write, direct: flag&unix.O_DIRECT != 0}, nil
}

func (e *EmuFS) Open(name string, opts ...pvfs.OpenOption) (pvfs.File, error) {
	if e.zoneOf(name) >= 0 {
		f, err := e.OpenFile(name, os.O_RDONLY, 0)
		if err != nil {
			return nil, err
		}
		for _, o := range opts {
			o.Apply(f)
		}
		return f, nil
	}
	return e.FS.Open(name, opts...)
}

func (e *EmuFS) Create(name string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := e.refuse("create", name); err != nil {
		return nil, err
	}
	return e.FS.Create(name, c)
}

func (e *EmuFS) OpenReadWrite(name string, c pvfs.DiskWriteCategory, opts ...pvfs.OpenOption) (pvfs.File, error) {
	if err := e.refuse("open", name); err != nil {
		return nil, err
	}
	return e.FS.OpenReadWrite(name, c, opts...)
}

func (e *EmuFS) Remove(name string) error {
	if err := e.refuse("remove", name); err != nil {
		return err
	}
	return e.FS.Remove(name)
}

func (e *EmuFS) RemoveAll(name string) error {
	if err := e.refuse("remove", name); err != nil {
		return err
	}
	if rel, err := filepath.Rel(filepath.Clean(name), e.root); err == nil && !strings.HasPrefix(rel, "..") {
		return e.violate("remove", name, unix.EPERM, "would remove the zonefs mount")
	}
	return e.FS.RemoveAll(name)
}

func (e *EmuFS) Rename(o, n string) error {
	if err := e.refuse("rename", o); err != nil {
		return err
	}
	if err := e.refuse("rename", n); err != nil {
		return err
	}
	return e.FS.Rename(o, n)
}

func (e *EmuFS) Link(o, n string) error {
	if err := e.refuse("link", n); err != nil {
		return err
	}
	return e.FS.Link(o, n)
}

func (e *EmuFS) ReuseForWrite(o, n string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := e.refuse("rename", o); err != nil {
		return nil, err
	}
	if err := e.refuse("create", n); err != nil {
		return nil, err
	}
	return e.FS.ReuseForWrite(o, n, c)
}

func (e *EmuFS) MkdirAll(dir string, perm os.FileMode) error {
	if e.zoneOf(dir) != -2 {
		if ok, _ := vfs.Exists(e.FS, dir); ok {
			return nil
		}
		return e.violate("mkdir", dir, unix.EPERM, "zonefs has no directories to create")
	}
	return e.FS.MkdirAll(dir, perm)
}

func (e *EmuFS) Lock(name string) (io.Closer, error) {
	if err := e.refuse("lock", name); err != nil {
		return nil, err
	}
	return e.FS.Lock(name)
}

func (e *EmuFS) Unwrap() pvfs.FS { return e.FS }

// GetDiskUsage of the mount reports the zones' capacity and the unwritten
// part of it, as statfs on zonefs does.
func (e *EmuFS) GetDiskUsage(p string) (vfs.DiskUsage, error) {
	if e.zoneOf(p) == -2 {
		return e.FS.GetDiskUsage(p)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	total := uint64(e.g.ZoneCap) * uint64(len(e.zones))
	var used uint64
	for i := range e.zones {
		z := &e.zones[i]
		used += uint64(z.wp)
	}
	return vfs.DiskUsage{TotalBytes: total, UsedBytes: used, AvailBytes: total - used}, nil
}

// emuFile is an open zone file.
type emuFile struct {
	vfs.File
	e      *EmuFS
	zone   int
	name   string
	write  bool
	direct bool
	closed bool
}

func aligned(p []byte, a int) bool {
	return len(p) == 0 || uintptr(unsafe.Pointer(&p[0]))%uintptr(a) == 0
}

func (f *emuFile) Write(p []byte) (int, error) {
	return 0, f.e.violate("write", f.name, unix.EINVAL, "write without an offset")
}

func (f *emuFile) WriteAt(p []byte, off int64) (int, error) {
	e := f.e
	bs := int64(e.g.BlockSize)
	switch {
	case !f.write:
		return 0, &os.PathError{Op: "write", Path: f.name, Err: unix.EBADF}
	case !f.direct:
		return 0, e.violate("write", f.name, unix.EIO, "buffered write to a sequential zone")
	case off%bs != 0 || int64(len(p))%bs != 0:
		return 0, e.violate("write", f.name, unix.EINVAL, "unaligned write [%d,+%d) (block %d)", off, len(p), bs)
	case !aligned(p, e.g.BlockSize):
		return 0, e.violate("write", f.name, unix.EINVAL, "buffer address not aligned to %d", bs)
	}
	z := &e.zones[f.zone]
	z.wmu.Lock()
	defer z.wmu.Unlock()
	e.mu.Lock()
	wp := z.wp
	var active int
	if wp == 0 && e.g.MaxActive > 0 {
		active, _ = e.activeLocked()
	}
	e.mu.Unlock()
	switch {
	case off != wp:
		return 0, e.violate("write", f.name, unix.EINVAL, "write at %d, write pointer %d", off, wp)
	case off+int64(len(p)) > e.g.ZoneCap:
		return 0, e.violate("write", f.name, unix.EFBIG, "write [%d,+%d) past capacity %d", off, len(p), e.g.ZoneCap)
	case wp == 0 && len(p) > 0 && e.g.MaxActive > 0 && active >= e.g.MaxActive && int64(len(p)) < e.g.ZoneCap:
		return 0, e.violate("write", f.name, unix.EIO, "more than %d active zones", e.g.MaxActive)
	}
	// The zone's write lock is held across the write: the device takes
	// one write at the pointer at a time, and the pointer moves only when
	// it lands.
	n, err := f.File.WriteAt(p, off)
	if n%int(bs) != 0 {
		// A torn write leaves the pointer at a block boundary.
		n = n &^ (int(bs) - 1)
	}
	e.mu.Lock()
	z.wp += int64(n)
	e.mu.Unlock()
	if n > 0 {
		e.writes.Add(1)
		e.written.Add(int64(n))
	}
	return n, err
}

func (f *emuFile) ReadAt(p []byte, off int64) (int, error) {
	if f.direct {
		bs := int64(f.e.g.BlockSize)
		if off%bs != 0 || int64(len(p))%bs != 0 || !aligned(p, f.e.g.BlockSize) {
			return 0, f.e.violate("read", f.name, unix.EINVAL, "unaligned O_DIRECT read [%d,+%d)", off, len(p))
		}
	}
	return f.File.ReadAt(p, off)
}

func (f *emuFile) Truncate(size int64) error {
	e := f.e
	if !f.write {
		return &os.PathError{Op: "truncate", Path: f.name, Err: unix.EBADF}
	}
	if size != 0 && size != e.g.ZoneCap {
		return e.violate("truncate", f.name, unix.EPERM, "truncate to %d (only 0 or the capacity %d)", size, e.g.ZoneCap)
	}
	z := &e.zones[f.zone]
	z.wmu.Lock()
	defer z.wmu.Unlock()
	// A zone reset or finish is immediate on the device: the emulation
	// makes it durable at once, as zonefs does.
	if err := f.File.Truncate(size); err != nil {
		return err
	}
	if err := f.File.Sync(); err != nil {
		return err
	}
	e.mu.Lock()
	z.wp = size
	e.mu.Unlock()
	return nil
}

func (f *emuFile) Close() error {
	if f.closed {
		return nil
	}
	f.closed = true
	if f.write {
		f.e.mu.Lock()
		f.e.zones[f.zone].writer--
		f.e.mu.Unlock()
	}
	return f.File.Close()
}

var _ vfs.FS = (*EmuFS)(nil)
