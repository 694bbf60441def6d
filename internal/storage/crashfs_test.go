package storage

import (
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// crashFS is a test-only in-memory vfs.FS that can crash: Crash returns the
// file system a machine would find after losing power now — file data as
// of each file's last Sync/SyncData, directory entries as of each
// directory's last Sync. (internal/vfs is getting a MemFS of its own; this
// one exists so storage's crash tests need nothing outside the package.
// Pebble's crashable MemFS cannot truncate a file in place.)
type crashFS struct {
	mu   sync.Mutex
	root *cnode
	// skipSync, if set, makes a file's Sync return nil without syncing:
	// the machine stops before that flush while later ones completed.
	skipSync func(name string) bool
	// walSyncs counts syncs of Pebble WAL files (*.log), syncs all
	// syncs (files and directories).
	walSyncs, syncs int64
}

// syncCount returns how many times a file or directory was synced.
func (fs *crashFS) syncCount() int64 {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.syncs
}

// walSyncCount returns how many times a Pebble WAL file was synced.
func (fs *crashFS) walSyncCount() int64 {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.walSyncs
}

type cnode struct {
	dir      bool
	children map[string]*cnode // live entries
	synced   map[string]*cnode // entries as of the last directory sync
	data     []byte
	sdata    []byte // data as of the last file sync
	mtime    time.Time
}

func newCrashFS() *crashFS {
	return &crashFS{root: &cnode{dir: true, children: map[string]*cnode{}, synced: map[string]*cnode{}}}
}

// Crash returns what survives a power loss now. The receiver keeps
// working (its open files too), but the test should stop using it.
func (fs *crashFS) Crash() *crashFS {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return &crashFS{root: fs.root.crashClone()}
}

// Restart returns what a process finds after it was killed (not the
// machine): everything written, with what is durable still marked so, so
// a later Crash of the result loses exactly what a power loss would have.
func (fs *crashFS) Restart() *crashFS {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return &crashFS{root: fs.root.deepClone(map[*cnode]*cnode{})}
}

func (n *cnode) deepClone(seen map[*cnode]*cnode) *cnode {
	if c := seen[n]; c != nil {
		return c // hard link
	}
	c := &cnode{dir: n.dir, data: slices.Clone(n.data), sdata: slices.Clone(n.sdata), mtime: n.mtime}
	seen[n] = c
	if n.dir {
		c.children = map[string]*cnode{}
		c.synced = map[string]*cnode{}
		for k, v := range n.children {
			c.children[k] = v.deepClone(seen)
		}
		for k, v := range n.synced {
			c.synced[k] = v.deepClone(seen)
		}
	}
	return c
}

// CrashPartial is Crash where each unsynced directory entry and each
// unsynced 4 KiB page of file data survives with probability pct/100, as
// a disk that wrote back some of its cache before the power went.
func (fs *crashFS) CrashPartial(r *rand.Rand, pct int) *crashFS {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return &crashFS{root: fs.root.crashCloneP(r, pct)}
}

func (n *cnode) crashClone() *cnode { return n.crashCloneP(nil, 0) }

func (n *cnode) crashCloneP(r *rand.Rand, pct int) *cnode {
	keep := func() bool { return r != nil && r.IntN(100) < pct }
	if !n.dir {
		data := slices.Clone(n.sdata)
		const page = 4096
		for off := 0; off < len(n.data); off += page {
			if !keep() {
				continue
			}
			p := n.data[off:min(off+page, len(n.data))]
			if end := off + len(p); end > len(data) {
				data = append(data, make([]byte, end-len(data))...)
			}
			copy(data[off:], p)
		}
		return &cnode{data: data, sdata: slices.Clone(data), mtime: n.mtime}
	}
	c := &cnode{dir: true, children: map[string]*cnode{}, synced: map[string]*cnode{}}
	names := map[string]*cnode{}
	for name, child := range n.synced {
		names[name] = child
	}
	// Sorted, so a seed replays exactly.
	live := make([]string, 0, len(n.children))
	for name := range n.children {
		live = append(live, name)
	}
	sort.Strings(live)
	for _, name := range live {
		if names[name] != n.children[name] && keep() {
			names[name] = n.children[name]
		}
	}
	order := make([]string, 0, len(names))
	for name := range names {
		order = append(order, name)
	}
	sort.Strings(order)
	for _, name := range order {
		cc := names[name].crashCloneP(r, pct)
		c.children[name], c.synced[name] = cc, cc
	}
	return c
}

func perr(op, path string, err error) error { return &os.PathError{Op: op, Path: path, Err: err} }

func split(p string) []string {
	p = filepath.Clean("/" + p)
	if p == "/" {
		return nil
	}
	return strings.Split(p[1:], "/")
}

// lookup returns the parent directory of p, p's base name and p's node
// (nil if absent). Caller holds fs.mu.
func (fs *crashFS) lookup(op, p string) (parent *cnode, base string, n *cnode, err error) {
	parts := split(p)
	if len(parts) == 0 {
		return nil, "", fs.root, nil
	}
	d := fs.root
	for _, part := range parts[:len(parts)-1] {
		next := d.children[part]
		if next == nil {
			return nil, "", nil, perr(op, p, unix.ENOENT)
		}
		if !next.dir {
			return nil, "", nil, perr(op, p, unix.ENOTDIR)
		}
		d = next
	}
	base = parts[len(parts)-1]
	return d, base, d.children[base], nil
}

func (fs *crashFS) open(op, name string, flag int) (*cfile, error) {
	if flag&unix.O_DIRECT != 0 {
		return nil, perr(op, name, unix.EINVAL) // like tmpfs
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	parent, base, n, err := fs.lookup(op, name)
	if err != nil {
		return nil, err
	}
	switch {
	case n == nil && flag&os.O_CREATE == 0:
		return nil, perr(op, name, unix.ENOENT)
	case n == nil:
		if parent == nil {
			return nil, perr(op, name, unix.EINVAL)
		}
		n = &cnode{mtime: time.Now()}
		parent.children[base] = n
	case flag&(os.O_CREATE|os.O_EXCL) == os.O_CREATE|os.O_EXCL:
		return nil, perr(op, name, unix.EEXIST)
	}
	write := flag&(os.O_WRONLY|os.O_RDWR) != 0
	if n.dir && write {
		return nil, perr(op, name, unix.EISDIR)
	}
	if flag&os.O_TRUNC != 0 && write {
		n.data = nil
	}
	return &cfile{fs: fs, n: n, name: name, write: write, read: flag&os.O_WRONLY == 0}, nil
}

func (fs *crashFS) OpenFile(name string, flag int, perm os.FileMode) (vfs.File, error) {
	return fs.open("open", name, flag)
}

func (fs *crashFS) Create(name string, _ pvfs.DiskWriteCategory) (pvfs.File, error) {
	return fs.open("create", name, os.O_RDWR|os.O_CREATE|os.O_TRUNC)
}

func (fs *crashFS) Link(oldname, newname string) error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	_, _, n, err := fs.lookup("link", oldname)
	if err != nil {
		return err
	}
	if n == nil {
		return perr("link", oldname, unix.ENOENT)
	}
	parent, base, m, err := fs.lookup("link", newname)
	if err != nil {
		return err
	}
	if m != nil {
		return perr("link", newname, unix.EEXIST)
	}
	parent.children[base] = n
	return nil
}

func (fs *crashFS) Open(name string, _ ...pvfs.OpenOption) (pvfs.File, error) {
	return fs.open("open", name, os.O_RDONLY)
}

func (fs *crashFS) OpenReadWrite(name string, _ pvfs.DiskWriteCategory, _ ...pvfs.OpenOption) (pvfs.File, error) {
	return fs.open("open", name, os.O_RDWR|os.O_CREATE)
}

func (fs *crashFS) OpenDir(name string) (pvfs.File, error) {
	f, err := fs.open("open", name, os.O_RDONLY)
	if err == nil && !f.n.dir {
		return nil, perr("open", name, unix.ENOTDIR)
	}
	return f, err
}

func (fs *crashFS) Remove(name string) error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	parent, base, n, err := fs.lookup("remove", name)
	if err != nil {
		return err
	}
	if n == nil {
		return perr("remove", name, unix.ENOENT)
	}
	if n.dir && len(n.children) > 0 {
		return perr("remove", name, unix.ENOTEMPTY)
	}
	delete(parent.children, base)
	return nil
}

func (fs *crashFS) RemoveAll(name string) error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	parent, base, n, err := fs.lookup("remove", name)
	if err != nil || n == nil || parent == nil {
		return nil
	}
	delete(parent.children, base)
	return nil
}

func (fs *crashFS) Rename(oldname, newname string) error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	op, ob, n, err := fs.lookup("rename", oldname)
	if err != nil {
		return err
	}
	if n == nil {
		return perr("rename", oldname, unix.ENOENT)
	}
	np, nb, _, err := fs.lookup("rename", newname)
	if err != nil {
		return err
	}
	delete(op.children, ob)
	np.children[nb] = n
	return nil
}

func (fs *crashFS) ReuseForWrite(oldname, newname string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := fs.Rename(oldname, newname); err != nil {
		return nil, err
	}
	return fs.OpenReadWrite(newname, c)
}

func (fs *crashFS) MkdirAll(dir string, perm os.FileMode) error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	d := fs.root
	for _, part := range split(dir) {
		next := d.children[part]
		if next == nil {
			next = &cnode{dir: true, children: map[string]*cnode{}, mtime: time.Now()}
			d.children[part] = next
		} else if !next.dir {
			return perr("mkdir", dir, unix.ENOTDIR)
		}
		d = next
	}
	return nil
}

type nopCloser struct{}

func (nopCloser) Close() error { return nil }

func (fs *crashFS) Lock(name string) (io.Closer, error) {
	f, err := fs.open("lock", name, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return nil, err
	}
	f.Close()
	return nopCloser{}, nil
}

func (fs *crashFS) List(dir string) ([]string, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	_, _, n, err := fs.lookup("list", dir)
	if err != nil {
		return nil, err
	}
	if n == nil {
		return nil, perr("list", dir, unix.ENOENT)
	}
	if !n.dir {
		return nil, perr("list", dir, unix.ENOTDIR)
	}
	names := make([]string, 0, len(n.children))
	for name := range n.children {
		names = append(names, name)
	}
	sort.Strings(names)
	return names, nil
}

func (fs *crashFS) Stat(name string) (vfs.FileInfo, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	_, _, n, err := fs.lookup("stat", name)
	if err != nil {
		return nil, err
	}
	if n == nil {
		return nil, perr("stat", name, unix.ENOENT)
	}
	return n.info(filepath.Base(name)), nil
}

func (fs *crashFS) PathBase(p string) string       { return filepath.Base(p) }
func (fs *crashFS) PathJoin(elem ...string) string { return filepath.Join(elem...) }
func (fs *crashFS) PathDir(p string) string        { return filepath.Dir(p) }
func (fs *crashFS) Unwrap() pvfs.FS                { return nil }
func (fs *crashFS) GetDiskUsage(string) (vfs.DiskUsage, error) {
	return vfs.DiskUsage{AvailBytes: 1 << 40, TotalBytes: 1 << 40}, nil
}

// Caller holds fs.mu.
func (n *cnode) info(name string) cinfo {
	return cinfo{name: name, size: int64(len(n.data)), dir: n.dir, mtime: n.mtime}
}

type cinfo struct {
	name  string
	size  int64
	dir   bool
	mtime time.Time
}

func (i cinfo) Name() string { return i.name }
func (i cinfo) Size() int64  { return i.size }
func (i cinfo) Mode() os.FileMode {
	if i.dir {
		return os.ModeDir | 0o755
	}
	return 0o644
}
func (i cinfo) ModTime() time.Time      { return i.mtime }
func (i cinfo) IsDir() bool             { return i.dir }
func (i cinfo) Sys() any                { return nil }
func (i cinfo) DeviceID() pvfs.DeviceID { return pvfs.DeviceID{} }

type cfile struct {
	fs          *crashFS
	n           *cnode
	name        string
	pos         int64
	read, write bool
}

func (f *cfile) Close() error { return nil }

func (f *cfile) ReadAt(p []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if f.n.dir || !f.read {
		return 0, perr("read", f.name, unix.EBADF)
	}
	if off >= int64(len(f.n.data)) {
		return 0, io.EOF
	}
	n := copy(p, f.n.data[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (f *cfile) Read(p []byte) (int, error) {
	n, err := f.ReadAt(p, f.pos)
	f.pos += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

func (f *cfile) WriteAt(p []byte, off int64) (int, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if !f.write {
		return 0, perr("write", f.name, unix.EBADF)
	}
	if end := off + int64(len(p)); end > int64(len(f.n.data)) {
		f.n.data = append(f.n.data, make([]byte, end-int64(len(f.n.data)))...)
	}
	copy(f.n.data[off:], p)
	f.n.mtime = time.Now()
	return len(p), nil
}

func (f *cfile) Write(p []byte) (int, error) {
	n, err := f.WriteAt(p, f.pos)
	f.pos += int64(n)
	return n, err
}

func (f *cfile) Truncate(size int64) error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if !f.write {
		return perr("truncate", f.name, unix.EBADF)
	}
	if size < int64(len(f.n.data)) {
		f.n.data = f.n.data[:size:size]
	} else {
		f.n.data = append(f.n.data, make([]byte, size-int64(len(f.n.data)))...)
	}
	return nil
}

func (f *cfile) Sync() error {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	if !f.n.dir && f.fs.skipSync != nil && f.fs.skipSync(f.name) {
		return nil
	}
	f.fs.syncs++
	if !f.n.dir && strings.HasSuffix(f.name, ".log") {
		f.fs.walSyncs++
	}
	if f.n.dir {
		f.n.synced = make(map[string]*cnode, len(f.n.children))
		for k, v := range f.n.children {
			f.n.synced[k] = v
		}
	} else {
		f.n.sdata = slices.Clone(f.n.data)
	}
	return nil
}

func (f *cfile) SyncData() error                     { return f.Sync() }
func (f *cfile) SyncTo(int64) (bool, error)          { return true, f.Sync() }
func (f *cfile) Preallocate(off, length int64) error { return nil }
func (f *cfile) Prefetch(off, length int64) error    { return nil }
func (f *cfile) Fd() uintptr                         { return pvfs.InvalidFd }
func (f *cfile) Stat() (vfs.FileInfo, error) {
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	return f.n.info(filepath.Base(f.name)), nil
}

var _ vfs.FS = (*crashFS)(nil)
