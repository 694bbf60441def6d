package vfs

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"os"
	"path"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"
)

// MemFS is an in-memory FS that keeps, beside what a program sees, what a
// disk would still hold after a power failure. It follows the durability
// rules in the package comment to the letter, no more generously than a
// real disk:
//
//   - file data and size are durable after File.Sync, SyncData or SyncTo;
//   - a directory entry (created, renamed, removed, linked) is durable only
//     after its parent directory is synced (SyncDir, or Sync on OpenDir);
//     syncing a file does not make its name durable;
//   - nothing else is.
//
// CrashClone returns the file system a crash at this instant could leave:
// everything synced, plus a seeded random subset of the operations that
// were not — each unsynced write kept, dropped, or torn at sector
// granularity; each unsynced directory operation kept or dropped — so
// a test replays the same crash from the same seed. Crash returns the
// synced state alone.
//
// Faults come from outside (SetInject, same ops and torn-write convention
// as FaultFS, plus "read"), and so does time: MemFS never sleeps; it
// reports every operation to the latency callback (SetLatency) so a
// simulator can charge it to a simulated clock. Capacity bounds the bytes
// of all files; a write past it writes what fits and fails with ENOSPC.
//
// All methods are safe for concurrent use (Pebble calls from its own
// goroutines); one mutex guards the whole tree.
type MemFS struct {
	opts MemOptions

	mu    sync.Mutex
	root  *memNode
	used  int64 // bytes of linked files, what GetDiskUsage reports
	locks map[*memNode]bool

	hookMu   sync.Mutex
	inject   func(op, path string) error
	latency  func(op, path string, n int)
	reserved func(path string) bool
}

// MemOptions configure a MemFS. The zero value is a usable unlimited disk
// that refuses O_DIRECT.
type MemOptions struct {
	// Capacity is the disk size in bytes; 0 means 1 TiB.
	Capacity int64
	// DirectIO accepts O_DIRECT in OpenFile; then every read and write
	// through that handle must be aligned to SectorSize in offset and
	// length (EINVAL otherwise, as Linux does). When false OpenFile fails
	// with EINVAL, as tmpfs does.
	DirectIO bool
	// SectorSize is the unit of torn writes and of O_DIRECT alignment;
	// 0 means 512.
	SectorSize int
	// Now stamps modification times; nil stamps the zero time, so output
	// never depends on the wall clock.
	Now func() time.Time
}

const defaultMemCapacity = 1 << 40

// NewMem returns an empty MemFS holding only the root directory.
func NewMem(opts MemOptions) *MemFS {
	if opts.Capacity <= 0 {
		opts.Capacity = defaultMemCapacity
	}
	if opts.SectorSize <= 0 {
		opts.SectorSize = 512
	}
	root := newDir()
	root.nlink = 1
	return &MemFS{opts: opts, root: root, locks: map[*memNode]bool{}}
}

// SetInject installs a fault injector consulted before every operation:
// op is one of "open", "create", "write", "read", "sync", "truncate",
// "mkdir", "remove", "rename", "link", "syncdir". A non-nil error is
// returned instead of doing the operation; for "write", ErrTornWrite
// (ENOSPC) first writes the leading half of the buffer, rounded down to a
// sector. nil removes the injector. The injector runs without MemFS's lock
// held and may be called from several goroutines.
func (fs *MemFS) SetInject(fn func(op, path string) error) {
	fs.hookMu.Lock()
	fs.inject = fn
	fs.hookMu.Unlock()
}

// SetLatency installs a callback told of every operation that completed
// (op as in SetInject, n the bytes moved), so a simulator can advance its
// clock by what the operation would have cost. nil removes it.
func (fs *MemFS) SetLatency(fn func(op, path string, n int)) {
	fs.hookMu.Lock()
	fs.latency = fn
	fs.hookMu.Unlock()
}

// SetReserved names the files whose writes Capacity does not limit, as
// if space were set aside for them (nil: none). A simulator uses it for
// files whose writer cannot survive ENOSPC in a way the simulation could
// contain (a Pebble WAL committed on a background goroutine panics the
// whole process).
func (fs *MemFS) SetReserved(fn func(path string) bool) {
	fs.hookMu.Lock()
	fs.reserved = fn
	fs.hookMu.Unlock()
}

func (fs *MemFS) isReserved(name string) bool {
	fs.hookMu.Lock()
	fn := fs.reserved
	fs.hookMu.Unlock()
	return fn != nil && fn(name)
}

// SetCapacity changes the disk size (bytes already stored stay, so a
// capacity below the usage makes every growing write fail).
func (fs *MemFS) SetCapacity(c int64) {
	fs.mu.Lock()
	fs.opts.Capacity = c
	fs.mu.Unlock()
}

func (fs *MemFS) fault(op, name string) error {
	fs.hookMu.Lock()
	fn := fs.inject
	fs.hookMu.Unlock()
	if fn == nil {
		return nil
	}
	return fn(op, name)
}

func (fs *MemFS) observe(op, name string, n int) {
	fs.hookMu.Lock()
	fn := fs.latency
	fs.hookMu.Unlock()
	if fn != nil {
		fn(op, name, n)
	}
}

func (fs *MemFS) now() time.Time {
	if fs.opts.Now != nil {
		return fs.opts.Now()
	}
	return time.Time{}
}

// memNode is a file or a directory. Both keep the current state and the
// durable one; the pending list is what a crash may or may not keep.
type memNode struct {
	dir     bool
	nlink   int // names in the current tree; space is freed at 0
	modTime time.Time

	// Files: data as read now; synced as a crash keeps it for sure;
	// pending holds the writes and truncations since the last sync, in
	// order.
	data    []byte
	synced  []byte
	pending []fileOp

	// Directories: entries as listed now; syncedEnts as a crash keeps
	// them for sure; pendingEnts the changes since the last directory sync.
	ents        map[string]*memNode
	syncedEnts  map[string]*memNode
	pendingEnts []entOp
}

func newDir() *memNode {
	return &memNode{dir: true, ents: map[string]*memNode{}, syncedEnts: map[string]*memNode{}}
}

// fileOp is an unsynced write (data at off) or truncation (to size).
type fileOp struct {
	off   int64
	data  []byte
	trunc bool
	size  int64
}

// entOp is an unsynced directory change: name now points to node (nil:
// removed). A rename within one directory is a single op (from != ""), so
// a crash keeps it whole or not at all, as journaling file systems do.
type entOp struct {
	name string
	node *memNode
	from string
}

func applyFileOp(b []byte, op fileOp) []byte {
	if op.trunc {
		if int64(len(b)) >= op.size {
			return b[:op.size]
		}
		return append(b, make([]byte, op.size-int64(len(b)))...)
	}
	end := op.off + int64(len(op.data))
	if end > int64(len(b)) {
		b = append(b, make([]byte, end-int64(len(b)))...)
	}
	copy(b[op.off:], op.data)
	return b
}

func applyEntOp(m map[string]*memNode, op entOp) {
	if op.from != "" {
		delete(m, op.from)
	}
	if op.node == nil {
		delete(m, op.name)
	} else {
		m[op.name] = op.node
	}
}

func (n *memNode) syncFile() {
	for _, op := range n.pending {
		n.synced = applyFileOp(n.synced, op)
	}
	n.pending = nil
}

func (n *memNode) syncDir() {
	n.syncedEnts = make(map[string]*memNode, len(n.ents))
	for k, v := range n.ents {
		n.syncedEnts[k] = v
	}
	n.pendingEnts = nil
}

func (n *memNode) size() int64 {
	if n.dir {
		return 0
	}
	return int64(len(n.data))
}

func pathErr(op, name string, err error) error {
	return &os.PathError{Op: op, Path: name, Err: err}
}

// split cleans name into its components; relative names start at the root.
func split(name string) []string {
	name = path.Clean("/" + name)
	if name == "/" {
		return nil
	}
	return strings.Split(name[1:], "/")
}

// lookup returns the node at name (mu held).
func (fs *MemFS) lookup(name string) (*memNode, error) {
	n := fs.root
	for _, c := range split(name) {
		if !n.dir {
			return nil, unix.ENOTDIR
		}
		next, ok := n.ents[c]
		if !ok {
			return nil, unix.ENOENT
		}
		n = next
	}
	return n, nil
}

// parent returns the directory holding name and name's last component.
func (fs *MemFS) parent(name string) (*memNode, string, error) {
	parts := split(name)
	if len(parts) == 0 {
		return nil, "", unix.EINVAL // the root has no parent entry
	}
	dir, err := fs.lookup("/" + strings.Join(parts[:len(parts)-1], "/"))
	if err != nil {
		return nil, "", err
	}
	if !dir.dir {
		return nil, "", unix.ENOTDIR
	}
	return dir, parts[len(parts)-1], nil
}

// setEnt changes one entry of dir now and records it for a crash.
func (fs *MemFS) setEnt(dir *memNode, name string, node *memNode) {
	if old, ok := dir.ents[name]; ok {
		fs.unlink(old)
	}
	if node == nil {
		delete(dir.ents, name)
	} else {
		dir.ents[name] = node
		node.nlink++
		if node.nlink == 1 {
			fs.used += node.size()
		}
	}
	dir.pendingEnts = append(dir.pendingEnts, entOp{name: name, node: node})
	dir.modTime = fs.now()
}

func (fs *MemFS) unlink(n *memNode) {
	n.nlink--
	if n.nlink == 0 {
		fs.used -= n.size()
	}
}

// CrashClone returns what a disk could hold after a crash now: all synced
// state, plus each unsynced directory change and file write kept or not as
// rng decides (writes possibly torn at sector granularity). A nil rng keeps
// nothing unsynced. The same rng state on the same MemFS gives the same
// result. Each file and directory draws from its own stream, seeded by
// rng and its path, so what a crash does to one file does not depend on
// how many unsynced operations other files had (background work such as
// Pebble's file deletions does not shift every other outcome). The clone
// has the options of fs and no hooks; fs is unchanged.
func (fs *MemFS) CrashClone(rng *rand.Rand) *MemFS {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	c := &crasher{sector: int64(fs.opts.SectorSize), done: map[*memNode]*memNode{}}
	if rng != nil {
		c.seeded, c.base = true, rng.Uint64()
	}
	out := &MemFS{opts: fs.opts, locks: map[*memNode]bool{}}
	out.root = c.clone(fs.root, "/")
	out.root.nlink = 1
	out.used = usage(out.root, map[*memNode]bool{})
	return out
}

// Crash returns exactly the synced state of fs: CrashClone(nil).
func (fs *MemFS) Crash() *MemFS { return fs.CrashClone(nil) }

type crasher struct {
	seeded bool
	base   uint64
	rng    *rand.Rand // of the node being cloned
	sector int64
	done   map[*memNode]*memNode // hard links share one clone
}

func (c *crasher) keep() bool { return c.seeded && c.rng.IntN(2) == 0 }

func (c *crasher) clone(n *memNode, p string) *memNode {
	if cl, ok := c.done[n]; ok {
		cl.nlink++
		return cl
	}
	if c.seeded {
		h := fnv.New64a()
		h.Write([]byte(p))
		c.rng = rand.New(rand.NewPCG(c.base, h.Sum64()))
	}
	cl := &memNode{dir: n.dir, modTime: n.modTime, nlink: 1}
	c.done[n] = cl
	if !n.dir {
		b := slices.Clone(n.synced)
		for _, op := range n.pending {
			if !c.keep() {
				continue
			}
			if op.trunc || c.rng.IntN(4) != 0 {
				b = applyFileOp(b, op)
				continue
			}
			b = c.torn(b, op)
		}
		cl.data, cl.synced = b, slices.Clone(b)
		return cl
	}
	ents := make(map[string]*memNode, len(n.syncedEnts))
	for k, v := range n.syncedEnts {
		ents[k] = v
	}
	for _, op := range n.pendingEnts {
		if c.keep() {
			applyEntOp(ents, op)
		}
	}
	cl.ents = make(map[string]*memNode, len(ents))
	// Sorted, so rng draws happen in the same order on every run.
	for _, name := range sortedKeys(ents) {
		cl.ents[name] = c.clone(ents[name], path.Join(p, name))
	}
	cl.syncedEnts = make(map[string]*memNode, len(cl.ents))
	for k, v := range cl.ents {
		cl.syncedEnts[k] = v
	}
	return cl
}

// torn applies the sectors of a write that rng keeps, each on its own:
// a disk persists a multi-sector write in any order.
func (c *crasher) torn(b []byte, op fileOp) []byte {
	end := op.off + int64(len(op.data))
	for s := op.off; s < end; {
		e := (s/c.sector + 1) * c.sector
		if e > end {
			e = end
		}
		if c.rng.IntN(2) == 0 {
			b = applyFileOp(b, fileOp{off: s, data: op.data[s-op.off : e-op.off]})
		}
		s = e
	}
	return b
}

func usage(n *memNode, seen map[*memNode]bool) int64 {
	if seen[n] {
		return 0
	}
	seen[n] = true
	if !n.dir {
		return int64(len(n.data))
	}
	var u int64
	for _, name := range sortedKeys(n.ents) {
		u += usage(n.ents[name], seen)
	}
	return u
}

func sortedKeys(m map[string]*memNode) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// String lists every path with its size and how much of it is unsynced,
// for test failures.
func (fs *MemFS) String() string {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	var b strings.Builder
	var walk func(n *memNode, p string)
	walk = func(n *memNode, p string) {
		for _, name := range sortedKeys(n.ents) {
			c := n.ents[name]
			cp := path.Join(p, name)
			_, durable := n.syncedEnts[name]
			mark := ""
			if !durable || n.syncedEnts[name] != c {
				mark = " (entry unsynced)"
			}
			if c.dir {
				fmt.Fprintf(&b, "%s/%s\n", cp, mark)
				walk(c, cp)
			} else {
				fmt.Fprintf(&b, "%s %d bytes, %d unsynced ops%s\n", cp, len(c.data), len(c.pending), mark)
			}
		}
	}
	walk(fs.root, "/")
	return b.String()
}

// open opens or creates a file (the heart of Create, Open*, OpenFile).
func (fs *MemFS) open(name string, flag int) (*memFile, error) {
	write := flag&(os.O_WRONLY|os.O_RDWR) != 0
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n, err := fs.lookup(name)
	switch {
	case err == unix.ENOENT && flag&os.O_CREATE != 0:
		dir, base, perr := fs.parent(name)
		if perr != nil {
			return nil, pathErr("open", name, perr)
		}
		n = &memNode{modTime: fs.now()}
		fs.setEnt(dir, base, n)
	case err != nil:
		return nil, pathErr("open", name, err)
	case flag&(os.O_CREATE|os.O_EXCL) == os.O_CREATE|os.O_EXCL:
		return nil, pathErr("open", name, unix.EEXIST)
	case n.dir && write:
		return nil, pathErr("open", name, unix.EISDIR)
	}
	if flag&os.O_TRUNC != 0 && write && len(n.data) > 0 {
		fs.truncate(n, 0)
	}
	f := &memFile{fs: fs, n: n, name: name, read: flag&os.O_WRONLY == 0, write: write,
		append: flag&os.O_APPEND != 0, direct: flag&unix.O_DIRECT != 0}
	return f, nil
}

func (fs *MemFS) truncate(n *memNode, size int64) error {
	grow := size - int64(len(n.data))
	if grow > 0 && n.nlink > 0 && fs.used+grow > fs.opts.Capacity {
		return unix.ENOSPC
	}
	if n.nlink > 0 {
		fs.used += grow
	}
	n.data = applyFileOp(n.data, fileOp{trunc: true, size: size})
	n.pending = append(n.pending, fileOp{trunc: true, size: size})
	n.modTime = fs.now()
	return nil
}

// Create creates or truncates name for writing, like os.Create.
func (fs *MemFS) Create(name string, _ pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := fs.fault("create", name); err != nil {
		return nil, pathErr("create", name, err)
	}
	f, err := fs.open(name, os.O_RDWR|os.O_CREATE|os.O_TRUNC)
	if err != nil {
		return nil, err
	}
	fs.observe("create", name, 0)
	return f, nil
}

// Open opens name for reading.
func (fs *MemFS) Open(name string, opts ...pvfs.OpenOption) (pvfs.File, error) {
	f, err := fs.open(name, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	for _, o := range opts {
		o.Apply(f)
	}
	return f, nil
}

// OpenReadWrite opens name for reading and writing, creating it if needed.
func (fs *MemFS) OpenReadWrite(name string, _ pvfs.DiskWriteCategory, opts ...pvfs.OpenOption) (pvfs.File, error) {
	if err := fs.fault("open", name); err != nil {
		return nil, pathErr("open", name, err)
	}
	f, err := fs.open(name, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return nil, err
	}
	for _, o := range opts {
		o.Apply(f)
	}
	return f, nil
}

// OpenFile opens name with os.OpenFile's flags; see FS.
func (fs *MemFS) OpenFile(name string, flag int, _ os.FileMode) (File, error) {
	if flag&unix.O_DIRECT != 0 && !fs.opts.DirectIO {
		return nil, pathErr("open", name, unix.EINVAL)
	}
	if flag&(os.O_WRONLY|os.O_RDWR|os.O_CREATE) != 0 {
		if err := fs.fault("open", name); err != nil {
			return nil, pathErr("open", name, err)
		}
	}
	f, err := fs.open(name, flag)
	if err != nil {
		return nil, err
	}
	return f, nil
}

// OpenDir opens a directory; Sync on it makes its entries durable.
func (fs *MemFS) OpenDir(name string) (pvfs.File, error) {
	f, err := fs.open(name, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	if !f.n.dir {
		return nil, pathErr("open", name, unix.ENOTDIR)
	}
	return f, nil
}

// Link makes newname another name of oldname's file.
func (fs *MemFS) Link(oldname, newname string) error {
	if err := fs.fault("link", newname); err != nil {
		return &os.LinkError{Op: "link", Old: oldname, New: newname, Err: err}
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n, err := fs.lookup(oldname)
	if err == nil && n.dir {
		err = unix.EPERM
	}
	var dir *memNode
	var base string
	if err == nil {
		dir, base, err = fs.parent(newname)
	}
	if err == nil {
		if _, ok := dir.ents[base]; ok {
			err = unix.EEXIST
		}
	}
	if err != nil {
		return &os.LinkError{Op: "link", Old: oldname, New: newname, Err: err}
	}
	fs.setEnt(dir, base, n)
	return nil
}

// Remove removes a file or an empty directory.
func (fs *MemFS) Remove(name string) error {
	if err := fs.fault("remove", name); err != nil {
		return pathErr("remove", name, err)
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	dir, base, err := fs.parent(name)
	if err != nil {
		return pathErr("remove", name, err)
	}
	n, ok := dir.ents[base]
	if !ok {
		return pathErr("remove", name, unix.ENOENT)
	}
	if n.dir && len(n.ents) > 0 {
		return pathErr("remove", name, unix.ENOTEMPTY)
	}
	fs.setEnt(dir, base, nil)
	return nil
}

// RemoveAll removes name and everything under it; a missing name is no
// error.
func (fs *MemFS) RemoveAll(name string) error {
	if err := fs.fault("remove", name); err != nil {
		return pathErr("remove", name, err)
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	dir, base, err := fs.parent(name)
	if err == unix.ENOENT {
		return nil
	}
	if err != nil {
		return pathErr("remove", name, err)
	}
	n, ok := dir.ents[base]
	if !ok {
		return nil
	}
	fs.removeTree(n)
	fs.setEnt(dir, base, nil)
	return nil
}

// removeTree removes the entries below n, children first, each recorded
// like a Remove so a crash can keep any of them.
func (fs *MemFS) removeTree(n *memNode) {
	if !n.dir {
		return
	}
	for _, name := range sortedKeys(n.ents) {
		fs.removeTree(n.ents[name])
		fs.setEnt(n, name, nil)
	}
}

// Rename renames oldname to newname, replacing a file (or an empty
// directory) there.
func (fs *MemFS) Rename(oldname, newname string) error {
	if err := fs.fault("rename", newname); err != nil {
		return &os.LinkError{Op: "rename", Old: oldname, New: newname, Err: err}
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if err := fs.rename(oldname, newname); err != nil {
		return &os.LinkError{Op: "rename", Old: oldname, New: newname, Err: err}
	}
	return nil
}

func (fs *MemFS) rename(oldname, newname string) error {
	odir, obase, err := fs.parent(oldname)
	if err != nil {
		return err
	}
	n, ok := odir.ents[obase]
	if !ok {
		return unix.ENOENT
	}
	ndir, nbase, err := fs.parent(newname)
	if err != nil {
		return err
	}
	if odir == ndir && obase == nbase {
		return nil
	}
	if t, ok := ndir.ents[nbase]; ok {
		switch {
		case t.dir && !n.dir:
			return unix.EISDIR
		case !t.dir && n.dir:
			return unix.ENOTDIR
		case t.dir && len(t.ents) > 0:
			return unix.ENOTEMPTY
		}
	}
	if n.dir {
		// A directory may not move below itself.
		for p := strings.Split(path.Clean("/"+newname), "/"); len(p) > 0; p = p[:len(p)-1] {
			if d, err := fs.lookup(strings.Join(p, "/")); err == nil && d == n {
				return unix.EINVAL
			}
		}
	}
	if odir != ndir {
		fs.setEnt(ndir, nbase, n)
		fs.setEnt(odir, obase, nil)
		return nil
	}
	// One op, so a crash keeps the rename whole or not at all.
	if old, ok := odir.ents[nbase]; ok {
		fs.unlink(old)
	}
	delete(odir.ents, obase)
	odir.ents[nbase] = n
	odir.pendingEnts = append(odir.pendingEnts, entOp{name: nbase, node: n, from: obase})
	odir.modTime = fs.now()
	return nil
}

// ReuseForWrite renames oldname to newname and opens it for writing.
func (fs *MemFS) ReuseForWrite(oldname, newname string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	if err := fs.Rename(oldname, newname); err != nil {
		return nil, err
	}
	return fs.OpenReadWrite(newname, c)
}

// MkdirAll creates dir and any missing parents.
func (fs *MemFS) MkdirAll(dir string, _ os.FileMode) error {
	if err := fs.fault("mkdir", dir); err != nil {
		return pathErr("mkdir", dir, err)
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n := fs.root
	for _, c := range split(dir) {
		next, ok := n.ents[c]
		if !ok {
			next = newDir()
			next.modTime = fs.now()
			fs.setEnt(n, c, next)
		} else if !next.dir {
			return pathErr("mkdir", dir, unix.ENOTDIR)
		}
		n = next
	}
	return nil
}

// Lock creates name if needed and holds it locked until the closer is
// closed; a second Lock of the same file fails, as flock between
// processes does.
func (fs *MemFS) Lock(name string) (io.Closer, error) {
	f, err := fs.open(name, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return nil, err
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.locks[f.n] {
		return nil, pathErr("lock", name, unix.EAGAIN)
	}
	fs.locks[f.n] = true
	return &memLock{fs: fs, n: f.n}, nil
}

type memLock struct {
	fs   *MemFS
	n    *memNode
	once sync.Once
}

func (l *memLock) Close() error {
	l.once.Do(func() {
		l.fs.mu.Lock()
		delete(l.fs.locks, l.n)
		l.fs.mu.Unlock()
	})
	return nil
}

// List returns the names in dir, sorted.
func (fs *MemFS) List(dir string) ([]string, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n, err := fs.lookup(dir)
	if err != nil {
		return nil, pathErr("open", dir, err)
	}
	if !n.dir {
		return nil, pathErr("readdir", dir, unix.ENOTDIR)
	}
	return sortedKeys(n.ents), nil
}

// Stat describes name.
func (fs *MemFS) Stat(name string) (pvfs.FileInfo, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n, err := fs.lookup(name)
	if err != nil {
		return nil, pathErr("stat", name, err)
	}
	return memInfo{name: path.Base(path.Clean("/" + name)), size: n.size(), dir: n.dir, mod: n.modTime}, nil
}

func (*MemFS) PathBase(p string) string         { return path.Base(p) }
func (*MemFS) PathJoin(elem ...string) string   { return path.Join(elem...) }
func (*MemFS) PathDir(p string) string          { return path.Dir(p) }
func (*MemFS) Unwrap() pvfs.FS                  { return nil }
func (fs *MemFS) Options() MemOptions           { fs.mu.Lock(); defer fs.mu.Unlock(); return fs.opts }
func (fs *MemFS) Used() int64                   { fs.mu.Lock(); defer fs.mu.Unlock(); return fs.used }
func (fs *MemFS) sectorAligned(v int64) bool    { return v%int64(fs.opts.SectorSize) == 0 }
func (fs *MemFS) roundDownSector(v int64) int64 { return v - v%int64(fs.opts.SectorSize) }

// GetDiskUsage reports Capacity and the bytes of all files.
func (fs *MemFS) GetDiskUsage(string) (DiskUsage, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	u := DiskUsage{TotalBytes: uint64(fs.opts.Capacity), UsedBytes: uint64(fs.used)}
	if fs.used < fs.opts.Capacity {
		u.AvailBytes = uint64(fs.opts.Capacity - fs.used)
	}
	return u, nil
}

type memInfo struct {
	name string
	size int64
	dir  bool
	mod  time.Time
}

func (i memInfo) Name() string { return i.name }
func (i memInfo) Size() int64  { return i.size }
func (i memInfo) Mode() os.FileMode {
	if i.dir {
		return os.ModeDir | 0o755
	}
	return 0o644
}
func (i memInfo) ModTime() time.Time              { return i.mod }
func (i memInfo) IsDir() bool                     { return i.dir }
func (i memInfo) Sys() any                        { return nil }
func (i memInfo) DeviceID() pvfs.DeviceID         { return pvfs.DeviceID{} }
func (f *memFile) Fd() uintptr                    { return pvfs.InvalidFd }
func (f *memFile) Prefetch(int64, int64) error    { return nil }
func (f *memFile) Preallocate(int64, int64) error { return nil }

// memFile is an open file or directory.
type memFile struct {
	fs     *MemFS
	n      *memNode
	name   string
	read   bool
	write  bool
	append bool
	direct bool

	mu     sync.Mutex // guards pos and closed
	pos    int64
	closed bool
}

func (f *memFile) check(op string, write bool) error {
	f.mu.Lock()
	closed := f.closed
	f.mu.Unlock()
	switch {
	case closed:
		return pathErr(op, f.name, os.ErrClosed)
	case f.n.dir && op != "sync" && op != "stat":
		return pathErr(op, f.name, unix.EISDIR)
	case write && !f.write, !write && !f.read && op == "read":
		return pathErr(op, f.name, unix.EBADF)
	}
	return nil
}

func (f *memFile) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return pathErr("close", f.name, os.ErrClosed)
	}
	f.closed = true
	return nil
}

func (f *memFile) Stat() (pvfs.FileInfo, error) {
	if err := f.check("stat", false); err != nil {
		return nil, err
	}
	f.fs.mu.Lock()
	defer f.fs.mu.Unlock()
	return memInfo{name: path.Base(path.Clean("/" + f.name)), size: f.n.size(), dir: f.n.dir, mod: f.n.modTime}, nil
}

func (f *memFile) Read(p []byte) (int, error) {
	f.mu.Lock()
	pos := f.pos
	f.mu.Unlock()
	n, err := f.ReadAt(p, pos)
	f.mu.Lock()
	f.pos += int64(n)
	f.mu.Unlock()
	return n, err
}

func (f *memFile) ReadAt(p []byte, off int64) (int, error) {
	if err := f.check("read", false); err != nil {
		return 0, err
	}
	if off < 0 {
		return 0, pathErr("read", f.name, unix.EINVAL)
	}
	if f.direct && (!f.fs.sectorAligned(off) || !f.fs.sectorAligned(int64(len(p)))) {
		return 0, pathErr("read", f.name, unix.EINVAL)
	}
	if err := f.fs.fault("read", f.name); err != nil {
		return 0, pathErr("read", f.name, err)
	}
	f.fs.mu.Lock()
	var n int
	if off < int64(len(f.n.data)) {
		n = copy(p, f.n.data[off:])
	}
	f.fs.mu.Unlock()
	f.fs.observe("read", f.name, n)
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (f *memFile) Write(p []byte) (int, error) {
	f.mu.Lock()
	pos := f.pos
	f.mu.Unlock()
	if f.append {
		pos = -1
	}
	n, err := f.writeAt(p, pos)
	f.mu.Lock()
	if f.append {
		f.pos = int64(len(f.n.data)) // read without fs.mu: only a hint for Read
	} else {
		f.pos += int64(n)
	}
	f.mu.Unlock()
	return n, err
}

func (f *memFile) WriteAt(p []byte, off int64) (int, error) {
	if f.append {
		return 0, pathErr("write", f.name, unix.EINVAL) // os.File refuses too
	}
	if off < 0 {
		return 0, pathErr("write", f.name, unix.EINVAL)
	}
	return f.writeAt(p, off)
}

// writeAt writes p at off (-1: at the end). An injected ErrTornWrite
// writes the leading half, rounded down to a sector, and fails.
func (f *memFile) writeAt(p []byte, off int64) (int, error) {
	if err := f.check("write", true); err != nil {
		return 0, err
	}
	if f.direct && (!f.fs.sectorAligned(off) || !f.fs.sectorAligned(int64(len(p)))) {
		return 0, pathErr("write", f.name, unix.EINVAL)
	}
	var ferr error
	if err := f.fs.fault("write", f.name); err != nil {
		if err != ErrTornWrite {
			return 0, pathErr("write", f.name, err)
		}
		p = p[:f.fs.roundDownSector(int64(len(p)/2))]
		ferr = err
	}
	reserved := f.fs.isReserved(f.name)
	f.fs.mu.Lock()
	n := f.n
	if off < 0 {
		off = int64(len(n.data))
	}
	end := off + int64(len(p))
	if grow := end - int64(len(n.data)); grow > 0 && n.nlink > 0 && !reserved {
		if room := f.fs.opts.Capacity - f.fs.used; grow > room {
			// Write what fits, as a full disk does, then fail.
			fit := max(int64(len(n.data))+max(room, 0)-off, 0)
			p = p[:min(fit, int64(len(p)))]
			ferr = unix.ENOSPC
		}
	}
	if len(p) > 0 {
		if grow := off + int64(len(p)) - int64(len(n.data)); grow > 0 && n.nlink > 0 {
			f.fs.used += grow
		}
		op := fileOp{off: off, data: slices.Clone(p)}
		n.data = applyFileOp(n.data, op)
		n.pending = append(n.pending, op)
		n.modTime = f.fs.now()
	}
	f.fs.mu.Unlock()
	f.fs.observe("write", f.name, len(p))
	if ferr != nil {
		return len(p), pathErr("write", f.name, ferr)
	}
	return len(p), nil
}

func (f *memFile) Truncate(size int64) error {
	if err := f.check("truncate", true); err != nil {
		return err
	}
	if size < 0 {
		return pathErr("truncate", f.name, unix.EINVAL)
	}
	if err := f.fs.fault("truncate", f.name); err != nil {
		return pathErr("truncate", f.name, err)
	}
	f.fs.mu.Lock()
	err := f.fs.truncate(f.n, size)
	f.fs.mu.Unlock()
	if err != nil {
		return pathErr("truncate", f.name, err)
	}
	f.fs.observe("truncate", f.name, 0)
	return nil
}

// Sync makes the file's data and size durable, or for a directory its
// entries.
func (f *memFile) Sync() error {
	if err := f.check("sync", false); err != nil {
		return err
	}
	op := "sync"
	if f.n.dir {
		op = "syncdir"
	}
	if err := f.fs.fault(op, f.name); err != nil {
		return pathErr("sync", f.name, err)
	}
	f.fs.mu.Lock()
	if f.n.dir {
		f.n.syncDir()
	} else {
		f.n.syncFile()
	}
	f.fs.mu.Unlock()
	f.fs.observe(op, f.name, 0)
	return nil
}

// SyncData is Sync: a file's size is all the metadata MemFS keeps.
func (f *memFile) SyncData() error { return f.Sync() }

func (f *memFile) SyncTo(int64) (bool, error) { return true, f.Sync() }

// Contents returns a copy of name's current bytes, for tests.
func (fs *MemFS) Contents(name string) ([]byte, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n, err := fs.lookup(name)
	if err != nil {
		return nil, pathErr("open", name, err)
	}
	if n.dir {
		return nil, pathErr("read", name, unix.EISDIR)
	}
	return bytes.Clone(n.data), nil
}

var _ FS = (*MemFS)(nil)
var _ File = (*memFile)(nil)
