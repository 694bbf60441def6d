package vfs

import (
	"io"
	"os"
	"sync"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"
)

// FaultFS wraps an FS and injects errors, for tests of every package that
// touches disk. The injector is consulted before every mutating call (op is
// "open", "create", "write", "sync", "truncate", "mkdir", "remove",
// "rename", "link", "syncdir") with the path; a non-nil result is returned
// instead of doing the call. A write may be torn: an injector returning
// ErrTornWrite for "write" writes the first half of the buffer and then
// fails with ENOSPC, like a disk that fills mid-write. Capacity, when set,
// overrides GetDiskUsage so tests can fake a small or full disk.
type FaultFS struct {
	FS FS

	mu       sync.Mutex
	inject   func(op, path string) error
	capacity *DiskUsage
}

// ErrTornWrite is returned by an injector to request a half write.
var ErrTornWrite = unix.ENOSPC

// NewFaultFS wraps fs.
func NewFaultFS(fs FS) *FaultFS { return &FaultFS{FS: fs} }

// SetInject installs the fault injector (nil removes it).
func (f *FaultFS) SetInject(fn func(op, path string) error) {
	f.mu.Lock()
	f.inject = fn
	f.mu.Unlock()
}

// SetCapacity overrides GetDiskUsage (nil restores the real figures).
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

func (f *FaultFS) wrap(file pvfs.File, name string) File {
	if ff, ok := file.(File); ok {
		return &faultFile{File: ff, fs: f, name: name}
	}
	return &faultFile{File: noTruncate{file}, fs: f, name: name}
}

func (f *FaultFS) Create(name string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := f.fault("create", name); err != nil {
		return nil, &os.PathError{Op: "create", Path: name, Err: err}
	}
	file, err := f.FS.Create(name, c)
	if err != nil {
		return nil, err
	}
	return f.wrap(file, name), nil
}

func (f *FaultFS) Link(o, n string) error {
	if err := f.fault("link", n); err != nil {
		return &os.LinkError{Op: "link", Old: o, New: n, Err: err}
	}
	return f.FS.Link(o, n)
}

func (f *FaultFS) Open(name string, opts ...pvfs.OpenOption) (pvfs.File, error) {
	file, err := f.FS.Open(name, opts...)
	if err != nil {
		return nil, err
	}
	return f.wrap(file, name), nil
}

func (f *FaultFS) OpenReadWrite(name string, c pvfs.DiskWriteCategory, opts ...pvfs.OpenOption) (pvfs.File, error) {
	if err := f.fault("open", name); err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	file, err := f.FS.OpenReadWrite(name, c, opts...)
	if err != nil {
		return nil, err
	}
	return f.wrap(file, name), nil
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

func (f *FaultFS) OpenDir(name string) (pvfs.File, error) {
	d, err := f.FS.OpenDir(name)
	if err != nil {
		return nil, err
	}
	return &faultDir{File: d, fs: f, name: name}, nil
}

func (f *FaultFS) Remove(name string) error {
	if err := f.fault("remove", name); err != nil {
		return &os.PathError{Op: "remove", Path: name, Err: err}
	}
	return f.FS.Remove(name)
}

func (f *FaultFS) RemoveAll(name string) error {
	if err := f.fault("remove", name); err != nil {
		return &os.PathError{Op: "remove", Path: name, Err: err}
	}
	return f.FS.RemoveAll(name)
}

func (f *FaultFS) Rename(o, n string) error {
	if err := f.fault("rename", n); err != nil {
		return &os.LinkError{Op: "rename", Old: o, New: n, Err: err}
	}
	return f.FS.Rename(o, n)
}

func (f *FaultFS) ReuseForWrite(o, n string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := f.fault("rename", n); err != nil {
		return nil, &os.LinkError{Op: "rename", Old: o, New: n, Err: err}
	}
	file, err := f.FS.ReuseForWrite(o, n, c)
	if err != nil {
		return nil, err
	}
	return f.wrap(file, n), nil
}

func (f *FaultFS) MkdirAll(dir string, perm os.FileMode) error {
	if err := f.fault("mkdir", dir); err != nil {
		return &os.PathError{Op: "mkdir", Path: dir, Err: err}
	}
	return f.FS.MkdirAll(dir, perm)
}

func (f *FaultFS) Lock(name string) (io.Closer, error)     { return f.FS.Lock(name) }
func (f *FaultFS) List(dir string) ([]string, error)       { return f.FS.List(dir) }
func (f *FaultFS) Stat(name string) (pvfs.FileInfo, error) { return f.FS.Stat(name) }
func (f *FaultFS) PathBase(p string) string                { return f.FS.PathBase(p) }
func (f *FaultFS) PathJoin(elem ...string) string          { return f.FS.PathJoin(elem...) }
func (f *FaultFS) PathDir(p string) string                 { return f.FS.PathDir(p) }
func (f *FaultFS) Unwrap() pvfs.FS                         { return f.FS }

func (f *FaultFS) GetDiskUsage(p string) (DiskUsage, error) {
	f.mu.Lock()
	c := f.capacity
	f.mu.Unlock()
	if c != nil {
		return *c, nil
	}
	return f.FS.GetDiskUsage(p)
}

type faultFile struct {
	File
	fs   *FaultFS
	name string
}

func (f *faultFile) torn(p []byte, write func([]byte) (int, error)) (int, error) {
	err := f.fs.fault("write", f.name)
	if err == nil {
		return write(p)
	}
	n := 0
	if err == ErrTornWrite && len(p) > 1 {
		n, _ = write(p[:len(p)/2])
	}
	return n, &os.PathError{Op: "write", Path: f.name, Err: err}
}

func (f *faultFile) Write(p []byte) (int, error) { return f.torn(p, f.File.Write) }

func (f *faultFile) WriteAt(p []byte, off int64) (int, error) {
	return f.torn(p, func(b []byte) (int, error) { return f.File.WriteAt(b, off) })
}

func (f *faultFile) Sync() error {
	if err := f.fs.fault("sync", f.name); err != nil {
		return &os.PathError{Op: "sync", Path: f.name, Err: err}
	}
	return f.File.Sync()
}

func (f *faultFile) SyncData() error {
	if err := f.fs.fault("sync", f.name); err != nil {
		return &os.PathError{Op: "sync", Path: f.name, Err: err}
	}
	return f.File.SyncData()
}

func (f *faultFile) SyncTo(length int64) (bool, error) {
	if err := f.fs.fault("sync", f.name); err != nil {
		return false, &os.PathError{Op: "sync", Path: f.name, Err: err}
	}
	return f.File.SyncTo(length)
}

func (f *faultFile) Truncate(size int64) error {
	if err := f.fs.fault("truncate", f.name); err != nil {
		return &os.PathError{Op: "truncate", Path: f.name, Err: err}
	}
	return f.File.Truncate(size)
}

type faultDir struct {
	pvfs.File
	fs   *FaultFS
	name string
}

func (d *faultDir) Sync() error {
	if err := d.fs.fault("syncdir", d.name); err != nil {
		return &os.PathError{Op: "sync", Path: d.name, Err: err}
	}
	return d.File.Sync()
}

// noTruncate is a Pebble file (from Create or Open) seen as a File; such
// files are written sequentially and never truncated.
type noTruncate struct{ pvfs.File }

func (noTruncate) Truncate(int64) error { return unix.ENOTSUP }
