package raft

import (
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// countingFS wraps a vfs.FS and counts the fsyncs issued through it, so the
// group-commit claim ("one fsync covers many groups") is measured, not
// assumed.
type countingFS struct {
	vfs.FS
	syncs *atomic.Int64
}

func (fs countingFS) wrap(f vfs.File, err error) (vfs.File, error) {
	if err != nil {
		return f, err
	}
	return countingFile{File: f, syncs: fs.syncs}, nil
}

func (fs countingFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	return fs.wrap(fs.FS.Create(name, c))
}

func (fs countingFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	return fs.wrap(fs.FS.OpenReadWrite(name, c, opts...))
}

func (fs countingFS) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	return fs.wrap(fs.FS.ReuseForWrite(oldname, newname, c))
}

func (fs countingFS) OpenDir(name string) (vfs.File, error) {
	return fs.wrap(fs.FS.OpenDir(name))
}

func (fs countingFS) Unwrap() vfs.FS { return fs.FS }

type countingFile struct {
	vfs.File
	syncs *atomic.Int64
}

func (f countingFile) Sync() error {
	f.syncs.Add(1)
	return f.File.Sync()
}

func (f countingFile) SyncData() error {
	f.syncs.Add(1)
	return f.File.SyncData()
}

func (f countingFile) SyncTo(length int64) (bool, error) {
	full, err := f.File.SyncTo(length)
	if full {
		f.syncs.Add(1)
	}
	return full, err
}
