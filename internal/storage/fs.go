package storage

import (
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// FS is the file system the block data goes through. It is an interface so
// tests can inject faults (ENOSPC, EIO, torn writes) and so a later backend
// can run over an emulated device; OSFS is the real one. The Pebble metadata
// DB has its own vfs.FS (Options.MetaFS).
type FS interface {
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
	MkdirAll(path string, perm os.FileMode) error
	Remove(name string) error
	RemoveAll(path string) error
	Rename(oldpath, newpath string) error
	ReadDir(name string) ([]os.DirEntry, error)
	Stat(name string) (os.FileInfo, error)
	// SyncDir makes the entries of a directory (created, renamed and
	// removed files) durable.
	SyncDir(name string) error
	// DiskUsage reports the capacity of the file system holding path.
	DiskUsage(path string) (DiskUsage, error)
}

// File is an open file of an FS.
type File interface {
	io.ReaderAt
	io.WriterAt
	io.Closer
	Sync() error
	Truncate(size int64) error
	Stat() (os.FileInfo, error)
}

// DiskUsage is the capacity of a file system in bytes.
type DiskUsage struct {
	Total, Free, Avail int64 // Avail: free to unprivileged users
}

// OSFS is the operating system's file system.
type OSFS struct{}

func (OSFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := os.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

// osFile uses fdatasync: block files are preallocated by nothing and only
// their size and data matter, which fdatasync covers.
type osFile struct{ *os.File }

func (f osFile) Sync() error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err != unix.EINTR {
			if err != nil {
				return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: err}
			}
			return nil
		}
	}
}

func (OSFS) MkdirAll(p string, perm os.FileMode) error  { return os.MkdirAll(p, perm) }
func (OSFS) Remove(name string) error                   { return os.Remove(name) }
func (OSFS) RemoveAll(p string) error                   { return os.RemoveAll(p) }
func (OSFS) Rename(o, n string) error                   { return os.Rename(o, n) }
func (OSFS) ReadDir(name string) ([]os.DirEntry, error) { return os.ReadDir(name) }
func (OSFS) Stat(name string) (os.FileInfo, error)      { return os.Stat(name) }

func (OSFS) SyncDir(name string) error {
	d, err := os.Open(name)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

func (OSFS) DiskUsage(p string) (DiskUsage, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		return DiskUsage{}, &os.PathError{Op: "statfs", Path: p, Err: err}
	}
	bs := int64(st.Bsize)
	return DiskUsage{Total: int64(st.Blocks) * bs, Free: int64(st.Bfree) * bs, Avail: int64(st.Bavail) * bs}, nil
}

// FaultFS wraps an FS and injects errors, for tests of this package and of
// its callers. Inject is consulted before every mutating call (op is
// "open", "write", "sync", "truncate", "mkdir", "remove", "rename",
// "syncdir") with the path; a non-nil result is returned instead of doing
// the call. Writes may also be torn: Inject("write", path) returning
// ErrTornWrite writes the first half of the buffer and then fails with
// ENOSPC, like a disk that fills mid-write. Capacity, when set, overrides
// DiskUsage so tests can fake a small or full disk.
type FaultFS struct {
	FS FS

	mu       sync.Mutex
	inject   func(op, path string) error
	capacity *DiskUsage
}

// ErrTornWrite is returned by a FaultFS injector to request a half write.
var ErrTornWrite = unix.ENOSPC

// SetInject installs the fault injector (nil removes it).
func (f *FaultFS) SetInject(fn func(op, path string) error) {
	f.mu.Lock()
	f.inject = fn
	f.mu.Unlock()
}

// SetCapacity overrides DiskUsage (nil restores the real figures).
func (f *FaultFS) SetCapacity(u *DiskUsage) {
	f.mu.Lock()
	f.capacity = u
	f.mu.Unlock()
}

func (f *FaultFS) fault(op, path string) error {
	f.mu.Lock()
	fn := f.inject
	f.mu.Unlock()
	if fn == nil {
		return nil
	}
	return fn(op, path)
}

func (f *FaultFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	if flag&(os.O_WRONLY|os.O_RDWR|os.O_CREATE) != 0 {
		if err := f.fault("open", name); err != nil {
			return nil, &os.PathError{Op: "open", Path: name, Err: err}
		}
	}
	file, err := f.FS.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return &faultFile{File: file, fs: f, name: name}, nil
}

func (f *FaultFS) MkdirAll(p string, perm os.FileMode) error {
	if err := f.fault("mkdir", p); err != nil {
		return &os.PathError{Op: "mkdir", Path: p, Err: err}
	}
	return f.FS.MkdirAll(p, perm)
}

func (f *FaultFS) Remove(name string) error {
	if err := f.fault("remove", name); err != nil {
		return &os.PathError{Op: "remove", Path: name, Err: err}
	}
	return f.FS.Remove(name)
}

func (f *FaultFS) RemoveAll(p string) error {
	if err := f.fault("remove", p); err != nil {
		return &os.PathError{Op: "remove", Path: p, Err: err}
	}
	return f.FS.RemoveAll(p)
}

func (f *FaultFS) Rename(o, n string) error {
	if err := f.fault("rename", n); err != nil {
		return &os.LinkError{Op: "rename", Old: o, New: n, Err: err}
	}
	return f.FS.Rename(o, n)
}

func (f *FaultFS) ReadDir(name string) ([]os.DirEntry, error) { return f.FS.ReadDir(name) }
func (f *FaultFS) Stat(name string) (os.FileInfo, error)      { return f.FS.Stat(name) }

func (f *FaultFS) SyncDir(name string) error {
	if err := f.fault("syncdir", name); err != nil {
		return &os.PathError{Op: "sync", Path: name, Err: err}
	}
	return f.FS.SyncDir(name)
}

func (f *FaultFS) DiskUsage(p string) (DiskUsage, error) {
	f.mu.Lock()
	c := f.capacity
	f.mu.Unlock()
	if c != nil {
		return *c, nil
	}
	return f.FS.DiskUsage(p)
}

type faultFile struct {
	File
	fs   *FaultFS
	name string
}

func (f *faultFile) WriteAt(p []byte, off int64) (int, error) {
	if err := f.fs.fault("write", f.name); err != nil {
		n := 0
		if err == ErrTornWrite && len(p) > 1 {
			n, _ = f.File.WriteAt(p[:len(p)/2], off)
		}
		return n, &os.PathError{Op: "write", Path: f.name, Err: err}
	}
	return f.File.WriteAt(p, off)
}

func (f *faultFile) Sync() error {
	if err := f.fs.fault("sync", f.name); err != nil {
		return &os.PathError{Op: "sync", Path: f.name, Err: err}
	}
	return f.File.Sync()
}

func (f *faultFile) Truncate(size int64) error {
	if err := f.fs.fault("truncate", f.name); err != nil {
		return &os.PathError{Op: "truncate", Path: f.name, Err: err}
	}
	return f.File.Truncate(size)
}
