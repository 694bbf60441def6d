package vfs

import (
	"os"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"
)

// osFS is Pebble's default file system plus OpenFile.
type osFS struct{ pvfs.FS }

func (osFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := os.OpenFile(name, flag, perm)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (fs osFS) Unwrap() pvfs.FS { return nil }

// osFile is an *os.File as a File. Sync is fsync; SyncData is fdatasync,
// which covers a file whose size and data are all that matter.
type osFile struct{ *os.File }

func (f osFile) Preallocate(off, length int64) error { return nil }

func (f osFile) Stat() (FileInfo, error) {
	fi, err := f.File.Stat()
	if err != nil {
		return nil, err
	}
	return fileInfo{fi}, nil
}

func (f osFile) SyncData() error {
	for {
		err := unix.Fdatasync(int(f.File.Fd()))
		if err != unix.EINTR {
			if err != nil {
				return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: err}
			}
			return nil
		}
	}
}

func (f osFile) SyncTo(length int64) (bool, error) { return true, f.SyncData() }

func (f osFile) Prefetch(off, length int64) error { return nil }

func (f osFile) Fd() uintptr { return f.File.Fd() }

// fileInfo adds Pebble's DeviceID to an os.FileInfo.
type fileInfo struct{ os.FileInfo }

func (fileInfo) DeviceID() pvfs.DeviceID { return pvfs.DeviceID{} }
