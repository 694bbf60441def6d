package vfs

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
)

// FS is a file system: Pebble's vfs.FS plus OpenFile.
type FS interface {
	pvfs.FS
	// OpenFile opens name with os.OpenFile's flags (O_RDONLY, O_WRONLY,
	// O_RDWR, O_CREATE, O_EXCL, O_TRUNC, O_APPEND). O_DIRECT
	// (golang.org/x/sys/unix.O_DIRECT) is a request: an FS that cannot do
	// it fails with EINVAL, as tmpfs does, and callers fall back to
	// buffered I/O.
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
}

// File is an open file of an FS.
type File interface {
	pvfs.File
	// Truncate changes the file's size. Like a write, the new size is
	// durable only after Sync or SyncData.
	Truncate(size int64) error
}

// Aliases so callers need not import Pebble's package as well.
type (
	FileInfo  = pvfs.FileInfo
	DiskUsage = pvfs.DiskUsage
)

// WriteCategory is the category this package's helpers pass to Create.
const WriteCategory pvfs.DiskWriteCategory = "basalt"

// Default is the operating system's file system.
var Default FS = osFS{FS: pvfs.Default}

// SyncDir makes the entries of directory dir (files created, renamed or
// removed in it) durable.
func SyncDir(fs FS, dir string) error {
	d, err := fs.OpenDir(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

// ReadFile reads a whole file.
func ReadFile(fs FS, name string) ([]byte, error) {
	f, err := fs.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

// WriteFileAtomic replaces path with data durably: it writes a temporary
// file beside it, syncs it, renames it over path and syncs the directory.
// After a crash path holds either the old or the new contents, whole.
func WriteFileAtomic(fs FS, path string, data []byte) error {
	tmp := path + ".tmp"
	f, err := fs.Create(tmp, WriteCategory)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fs.Rename(tmp, path)
	}
	if err != nil {
		_ = fs.Remove(tmp)
		return err
	}
	return SyncDir(fs, filepath.Dir(path))
}

// Exists reports whether name exists (an error other than "not found" is
// returned as is).
func Exists(fs FS, name string) (bool, error) {
	_, err := fs.Stat(name)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return false, err
}

// ReadDir lists a directory sorted by name, with each entry's FileInfo.
func ReadDir(fs FS, dir string) ([]FileInfo, error) {
	names, err := fs.List(dir)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	out := make([]FileInfo, 0, len(names))
	for _, n := range names {
		fi, err := fs.Stat(filepath.Join(dir, n))
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue // removed while listing
			}
			return nil, err
		}
		out = append(out, fi)
	}
	return out, nil
}
