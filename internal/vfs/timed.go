package vfs

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
)

// TimedFS wraps an FS and reports how long each flush (Sync, SyncData, a
// full SyncTo) of a file or directory under one of its roots takes, so a
// datanode can tell a slow disk from its peers (internal/slowdisk). Files
// opened read-only are not wrapped.
type TimedFS struct {
	FS
	roots   []string
	observe func(root string, d time.Duration)
}

// NewTimedFS wraps fs; observe gets the root (the longest one holding the
// file) and the duration of every flush under it. observe must be cheap and
// safe for concurrent use.
func NewTimedFS(fs FS, roots []string, observe func(root string, d time.Duration)) *TimedFS {
	t := &TimedFS{FS: fs, observe: observe}
	for _, r := range roots {
		t.roots = append(t.roots, filepath.Clean(r))
	}
	return t
}

// RootOf is the longest root holding path, or "".
func (t *TimedFS) RootOf(path string) string {
	p := filepath.Clean(path)
	best := ""
	for _, r := range t.roots {
		if (p == r || strings.HasPrefix(p, r+string(filepath.Separator))) && len(r) > len(best) {
			best = r
		}
	}
	return best
}

func (t *TimedFS) wrap(f pvfs.File, name string) pvfs.File {
	r := t.RootOf(name)
	if r == "" {
		return f
	}
	ff, ok := f.(File)
	if !ok {
		ff = noTruncate{f}
	}
	return &timedFile{File: ff, fs: t, root: r}
}

func (t *TimedFS) Create(name string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	f, err := t.FS.Create(name, c)
	if err != nil {
		return nil, err
	}
	return t.wrap(f, name), nil
}

func (t *TimedFS) OpenReadWrite(name string, c pvfs.DiskWriteCategory, opts ...pvfs.OpenOption) (pvfs.File, error) {
	f, err := t.FS.OpenReadWrite(name, c, opts...)
	if err != nil {
		return nil, err
	}
	return t.wrap(f, name), nil
}

func (t *TimedFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	f, err := t.FS.OpenFile(name, flag, perm)
	if err != nil || flag&(os.O_WRONLY|os.O_RDWR) == 0 {
		return f, err
	}
	return t.wrap(f, name).(File), nil
}

func (t *TimedFS) OpenDir(name string) (pvfs.File, error) {
	f, err := t.FS.OpenDir(name)
	if err != nil {
		return nil, err
	}
	return t.wrap(f, name), nil
}

func (t *TimedFS) ReuseForWrite(o, n string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	f, err := t.FS.ReuseForWrite(o, n, c)
	if err != nil {
		return nil, err
	}
	return t.wrap(f, n), nil
}

// Lock is the wrapped FS's (spelled out: io.Closer is not a File).
func (t *TimedFS) Lock(name string) (io.Closer, error) { return t.FS.Lock(name) }

// Unwrap returns the wrapped FS.
func (t *TimedFS) Unwrap() pvfs.FS { return t.FS }

type timedFile struct {
	File
	fs   *TimedFS
	root string
}

func (f *timedFile) timed(sync func() error) error {
	t0 := time.Now()
	err := sync()
	if err == nil {
		f.fs.observe(f.root, time.Since(t0))
	}
	return err
}

func (f *timedFile) Sync() error     { return f.timed(f.File.Sync) }
func (f *timedFile) SyncData() error { return f.timed(f.File.SyncData) }

func (f *timedFile) SyncTo(length int64) (bool, error) {
	t0 := time.Now()
	full, err := f.File.SyncTo(length)
	if err == nil && full {
		f.fs.observe(f.root, time.Since(t0))
	}
	return full, err
}
