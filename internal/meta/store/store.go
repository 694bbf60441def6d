// Package store is the Pebble database behind a metadata Raft group: state
// changes only through applied log entries, each Apply call commits one
// batch that also records the applied index, and snapshots are Pebble
// checkpoints streamed as a tar archive.
//
// Durability: batches are committed without fsync (the Raft log already
// holds the entries durably), and a background loop syncs the Pebble WAL
// every SyncInterval. DurableIndex reports only what such a sync covered,
// which is what raft.StateMachine.AppliedIndex must return: the host never
// truncates its log past it and replays from it after a crash. Because the
// applied index is written in the same batch as the state it describes,
// whatever Pebble recovers after a crash is self-consistent.
//
// The applied index only grows: Commit panics on an index at or below it,
// and Restore refuses a snapshot at or below it (ErrStaleSnapshot), since
// moving the state back would lose committed entries raft never resends.
//
// Every file goes through one vfs.FS (Options.FS; the Pebble DB gets the
// same), and every directory entry the store creates, renames or removes
// is followed by a sync of its parent before it counts, so a test on a
// crashable in-memory FS sees exactly what a machine that lost power would.
package store

import (
	"archive/tar"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"

	"github.com/basalt-store/basalt/internal/vfs"
)

// appliedKey sorts before every state-machine key (they use printable
// prefixes), so scans of a state machine's tables never meet it.
var appliedKey = []byte("\x00applied")

// Options configure a Store. Zero values take the defaults noted.
type Options struct {
	// SyncInterval between WAL syncs (default 200ms). Negative: sync on
	// every commit (slower, DurableIndex == AppliedIndex at all times).
	SyncInterval time.Duration
	// CacheBytes is the Pebble block cache size (default 64 MiB).
	CacheBytes int64
	// FS is the file system everything goes through: the Pebble DB,
	// checkpoints, snapshot streams and restores (default vfs.Default).
	// Tests pass a crashable in-memory FS to see only what was synced.
	FS vfs.FS
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// ReserveBytes is the free space Open expects for the DB (default
	// DefaultReserve; negative: none); BallastBytes the size of the
	// emergency ballast file kept in dir (0: none). Open removes the
	// ballast when the disk is below the reserve, so Pebble can replay its
	// WAL instead of waiting forever for a flush it cannot write; it is
	// recreated once there is room. Callers refuse new proposals below the
	// reserve (CheckSpace), since Pebble treats a failed WAL write as fatal.
	ReserveBytes int64
	BallastBytes int64
}

// DefaultReserve is Options.ReserveBytes's default.
const DefaultReserve = 64 << 20

// ErrDiskFull: the store's disk is below its reserve (CheckSpace).
var ErrDiskFull = errors.New("store: disk below its reserve")

// Store is one group's Pebble database.
type Store struct {
	dir  string
	opts Options
	fs   vfs.FS
	log  *slog.Logger

	// mu guards db against Restore swapping it; readers hold it shared.
	mu sync.RWMutex
	db *pebble.DB
	// space keeps the reserve and the ballast.
	space *vfs.Space

	// applied only grows (setApplied asserts it): a state that went back
	// would silently lose committed entries, because raft never resends
	// what it believes the state machine already holds.
	applied atomic.Uint64
	durable atomic.Uint64
	snapSeq atomic.Uint64

	stop   chan struct{}
	done   chan struct{}
	closed atomic.Bool
}

const (
	dbName      = "db"
	restoreName = "db.restore"
	oldName     = "db.old"
	snapsName   = "snapshots"
)

// Open opens (or creates) the store in dir, finishing or rolling back a
// Restore that a crash interrupted.
func Open(dir string, opts Options) (*Store, error) {
	if opts.SyncInterval == 0 {
		opts.SyncInterval = 200 * time.Millisecond
	}
	if opts.CacheBytes == 0 {
		opts.CacheBytes = 64 << 20
	}
	if opts.FS == nil {
		opts.FS = vfs.Default
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.ReserveBytes == 0 {
		opts.ReserveBytes = DefaultReserve
	}
	fs := opts.FS
	if err := vfs.MkdirAllSync(fs, dir); err != nil {
		return nil, fmt.Errorf("store: create %s: %w", dir, err)
	}
	cur := filepath.Join(dir, dbName)
	old := filepath.Join(dir, oldName)
	curOK, err := vfs.Exists(fs, cur)
	if err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	if !curOK {
		// A crash between the two renames of Restore: the old DB is intact.
		if oldOK, _ := vfs.Exists(fs, old); oldOK {
			if err := fs.Rename(old, cur); err != nil {
				return nil, fmt.Errorf("store: roll back interrupted restore in %s: %w", dir, err)
			}
			if err := vfs.SyncDir(fs, dir); err != nil {
				return nil, fmt.Errorf("store: roll back interrupted restore in %s: %w", dir, err)
			}
		}
	}
	for _, n := range []string{restoreName, oldName, snapsName} {
		if err := fs.RemoveAll(filepath.Join(dir, n)); err != nil {
			return nil, fmt.Errorf("store: clean up %s: %w", filepath.Join(dir, n), err)
		}
	}
	s := &Store{dir: dir, opts: opts, fs: fs, log: opts.Logger, stop: make(chan struct{}), done: make(chan struct{})}
	// Before Pebble opens: on a full disk its open waits forever for a
	// flush it cannot write, so the ballast goes first.
	s.space, err = vfs.OpenSpace(fs, dir, vfs.SpaceOptions{
		Reserve:     max(0, opts.ReserveBytes),
		Ballast:     opts.BallastBytes,
		BallastPath: filepath.Join(dir, "emergency.ballast"),
		Logf:        func(f string, a ...any) { opts.Logger.Warn(fmt.Sprintf(f, a...)) },
	})
	if err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	db, err := s.openDB(cur)
	if err != nil {
		return nil, err
	}
	s.db = db
	idx, err := readApplied(db)
	if err != nil {
		db.Close()
		return nil, err
	}
	s.applied.Store(idx)
	s.durable.Store(idx)
	go s.syncLoop()
	return s, nil
}

// CheckSpace reports whether n more bytes may be proposed: nil, or an error
// wrapping ErrDiskFull once the disk is below the reserve (a cached
// figure, cheap per request). Entries already in the log still apply.
func (s *Store) CheckSpace(n int) error {
	if err := s.space.Admit(int64(n)); err != nil {
		if errors.Is(err, vfs.ErrNoSpace) {
			return fmt.Errorf("%w: %w", ErrDiskFull, err)
		}
		return fmt.Errorf("store: %w", err)
	}
	return nil
}

func (s *Store) openDB(path string) (*pebble.DB, error) {
	cache := pebble.NewCache(s.opts.CacheBytes)
	defer cache.Unref()
	o := &pebble.Options{
		FS:           s.fs,
		Cache:        cache,
		MemTableSize: 32 << 20,
		Logger:       quietLogger{},
	}
	// Bloom filters on every level (the others inherit L0's): a point
	// read (every lookup) skips the tables that lack its key instead of
	// searching each one's index. Tables written before lack them and
	// are read as before.
	o.Levels[0].FilterPolicy = bloom.FilterPolicy(10)
	db, err := pebble.Open(path, o)
	if err != nil {
		return nil, fmt.Errorf("store: open pebble at %s: %w", path, err)
	}
	return db, nil
}

func readApplied(r pebble.Reader) (uint64, error) {
	v, closer, err := r.Get(appliedKey)
	if errors.Is(err, pebble.ErrNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("store: read applied index: %w", err)
	}
	defer closer.Close()
	if len(v) != 8 {
		return 0, fmt.Errorf("store: applied index has %d bytes, want 8", len(v))
	}
	return binary.BigEndian.Uint64(v), nil
}

func (s *Store) syncLoop() {
	defer close(s.done)
	if s.opts.SyncInterval < 0 {
		return
	}
	t := time.NewTicker(s.opts.SyncInterval)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			_ = s.Sync()
		}
	}
}

// Sync makes everything applied so far durable.
func (s *Store) Sync() error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed.Load() {
		return nil
	}
	idx := s.applied.Load()
	if idx == s.durable.Load() {
		return nil
	}
	// A synced WAL record makes every earlier record durable too.
	if err := s.db.LogData(nil, pebble.Sync); err != nil {
		return fmt.Errorf("store: sync %s: %w", s.dir, err)
	}
	s.durable.Store(idx)
	return nil
}

// AppliedIndex is the index of the last committed batch (maybe not synced).
func (s *Store) AppliedIndex() uint64 { return s.applied.Load() }

// DurableIndex is the last applied index a WAL sync covered.
func (s *Store) DurableIndex() uint64 { return s.durable.Load() }

// setApplied records index as applied. Only the apply goroutine calls it
// (Commit, Restore), so a plain load-compare-store is race free; an index
// that does not grow is a bug upstream (an entry applied twice, a stale
// snapshot restored) that would corrupt the state, so it stops the process
// instead.
func (s *Store) setApplied(index uint64) {
	if prev := s.applied.Load(); index <= prev {
		panic(fmt.Sprintf("store %s: applied index would go from %d to %d", s.dir, prev, index))
	}
	s.applied.Store(index)
}

// Metrics returns the DB's Pebble metrics (WAL bytes, flushes,
// compactions), nil once closed.
func (s *Store) Metrics() *pebble.Metrics {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed.Load() {
		return nil
	}
	return s.db.Metrics()
}

// NewBatch returns an indexed batch (reads see its own writes) for one
// Apply call. Only the apply goroutine writes.
func (s *Store) NewBatch() *pebble.Batch {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.db.NewIndexedBatch()
}

// Commit records index as applied in b and commits it. index must be above
// the applied index (it panics otherwise, before writing anything).
func (s *Store) Commit(b *pebble.Batch, index uint64) error {
	if prev := s.applied.Load(); index <= prev {
		panic(fmt.Sprintf("store %s: commit at index %d, but %d is already applied", s.dir, index, prev))
	}
	var v [8]byte
	binary.BigEndian.PutUint64(v[:], index)
	if err := b.Set(appliedKey, v[:], nil); err != nil {
		return err
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	opt := pebble.NoSync
	if s.opts.SyncInterval < 0 {
		opt = pebble.Sync
	}
	if err := b.Commit(opt); err != nil {
		return fmt.Errorf("store: commit batch at index %d: %w", index, err)
	}
	s.setApplied(index)
	if opt == pebble.Sync {
		s.durable.Store(index)
	}
	return b.Close()
}

// CommitSide commits b synchronously without moving the applied index:
// rows a state machine keeps about its replica beside the replicated ones
// (the namespace's apply halt). Everything committed before is durable
// with it.
func (s *Store) CommitSide(b *pebble.Batch) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	idx := s.applied.Load()
	if err := b.Commit(pebble.Sync); err != nil {
		return fmt.Errorf("store: commit %s: %w", s.dir, err)
	}
	s.durable.Store(idx)
	return b.Close()
}

// View runs f with a consistent reader of the committed state (a Pebble
// snapshot is not needed for point reads; f gets the DB itself).
func (s *Store) View(f func(r pebble.Reader) error) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed.Load() {
		return errors.New("store: closed")
	}
	return f(s.db)
}

// Snapshot checkpoints the DB and returns a tar stream of the checkpoint;
// closing the reader removes the checkpoint. Call it on the apply
// goroutine: the checkpoint then holds exactly the state at AppliedIndex.
// Checkpoints need no durability (Open removes any it finds).
func (s *Store) Snapshot() (uint64, io.ReadCloser, error) {
	s.mu.RLock()
	idx := s.applied.Load()
	tmp := filepath.Join(s.dir, snapsName, fmt.Sprintf("snap-%d-%d", idx, s.snapSeq.Add(1)))
	if err := s.fs.MkdirAll(tmp, 0o755); err != nil {
		s.mu.RUnlock()
		return 0, nil, fmt.Errorf("store: snapshot of %s: %w", s.dir, err)
	}
	cp := filepath.Join(tmp, "cp")
	err := s.db.Checkpoint(cp, pebble.WithFlushedWAL())
	s.mu.RUnlock()
	if err != nil {
		_ = s.fs.RemoveAll(tmp)
		return 0, nil, fmt.Errorf("store: checkpoint %s at index %d: %w", s.dir, idx, err)
	}
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(writeTar(s.fs, pw, cp))
	}()
	return idx, &snapReader{PipeReader: pr, fs: s.fs, dir: tmp}, nil
}

type snapReader struct {
	*io.PipeReader
	fs  vfs.FS
	dir string
}

func (r *snapReader) Close() error {
	err := r.PipeReader.Close()
	_ = r.fs.RemoveAll(r.dir)
	return err
}

// writeTar writes the files of a checkpoint directory (Pebble checkpoints
// are flat) as a tar stream.
func writeTar(fs vfs.FS, w io.Writer, dir string) error {
	tw := tar.NewWriter(w)
	ents, err := vfs.ReadDir(fs, dir)
	if err != nil {
		return err
	}
	for _, fi := range ents {
		if fi.IsDir() {
			return fmt.Errorf("store: checkpoint %s has a directory %s", dir, fi.Name())
		}
		if err := copyToTar(fs, tw, filepath.Join(dir, fi.Name()), fi.Name(), fi.Size()); err != nil {
			return err
		}
	}
	return tw.Close()
}

func copyToTar(fs vfs.FS, tw *tar.Writer, path, name string, size int64) error {
	hdr := &tar.Header{Name: name, Mode: 0o644, Size: size, Typeflag: tar.TypeReg}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	f, err := fs.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	// A checkpoint's files are immutable hard links, except the copied
	// manifest/WAL, which are final; copy exactly the size we announced.
	_, err = io.CopyN(tw, f, size)
	return err
}

// Limits on a restored snapshot (sanity: a snapshot comes off the network).
const (
	maxSnapshotFile  = 64 << 30
	maxSnapshotFiles = 1 << 16
)

// ErrStaleSnapshot: Restore was given a snapshot that is not newer than
// the applied state. Restoring it would move the state back and lose
// committed entries that raft will never send again.
var ErrStaleSnapshot = errors.New("store: snapshot is not newer than the applied state")

// Restore replaces the state with a snapshot stream taken at index. The new
// DB is written aside, verified, and made durable (every file synced, then
// its directory) before the swap, and the swap (two renames) is made
// durable by syncing the store's directory before Restore returns: after a
// crash the store holds either the old state or the whole new one. Any
// failure before the swap leaves the old state intact.
//
// A snapshot at or below the applied index is refused with
// ErrStaleSnapshot and changes nothing.
func (s *Store) Restore(index uint64, r io.Reader) error {
	if applied := s.applied.Load(); index <= applied {
		err := fmt.Errorf("%w: snapshot at index %d, applied index %d (%s)", ErrStaleSnapshot, index, applied, s.dir)
		s.log.Warn("store: refused a stale snapshot", "dir", s.dir, "snapshot_index", index, "applied_index", applied)
		return err
	}
	tmp := filepath.Join(s.dir, restoreName)
	if err := s.writeAside(tmp, index, r); err != nil {
		_ = s.fs.RemoveAll(tmp)
		return err
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	cur := filepath.Join(s.dir, dbName)
	old := filepath.Join(s.dir, oldName)
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("store: close before restore: %w", err)
	}
	if err := s.fs.Rename(cur, old); err != nil {
		_ = s.fs.RemoveAll(tmp)
		return s.reopen(cur, fmt.Errorf("store: restore: %w", err))
	}
	if err := s.fs.Rename(tmp, cur); err != nil {
		_ = s.fs.Rename(old, cur)
		_ = s.fs.RemoveAll(tmp)
		return s.reopen(cur, fmt.Errorf("store: restore: %w", err))
	}
	// Until this sync the swap may be undone by a crash (Open then finds
	// the old DB, or rolls db.old back); after it, the new state counts.
	if err := vfs.SyncDir(s.fs, s.dir); err != nil {
		// The swap happened in memory but its durability is unknown. The
		// new DB is what is in place, so serve it, and say so.
		err = fmt.Errorf("store: restore at index %d: sync %s after the swap: %w", index, s.dir, err)
		if rerr := s.reopen(cur, nil); rerr != nil {
			return errors.Join(err, rerr)
		}
		s.setApplied(index)
		s.durable.Store(s.applied.Load())
		return err
	}
	// Best effort: Open removes a leftover db.old too.
	_ = s.fs.RemoveAll(old)
	_ = vfs.SyncDir(s.fs, s.dir)
	if err := s.reopen(cur, nil); err != nil {
		return err
	}
	s.setApplied(index)
	s.durable.Store(index)
	return nil
}

// writeAside writes the snapshot stream into dir as a Pebble DB, verifies
// that it opens and holds index, and makes it durable: each file synced,
// then dir itself.
func (s *Store) writeAside(dir string, index uint64, r io.Reader) error {
	if err := s.fs.RemoveAll(dir); err != nil {
		return fmt.Errorf("store: restore at index %d: clear %s: %w", index, dir, err)
	}
	if err := s.fs.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("store: restore at index %d: %w", index, err)
	}
	tr := tar.NewReader(r)
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("store: read snapshot at index %d: %w", index, err)
		}
		name := hdr.Name
		// Pebble checkpoints are flat: one plain file name per entry.
		if n >= maxSnapshotFiles || name == "" || name == "." || name == ".." || strings.ContainsAny(name, `/\`) ||
			hdr.Typeflag != tar.TypeReg || hdr.Size < 0 || hdr.Size > maxSnapshotFile {
			return fmt.Errorf("store: snapshot at index %d has bad entry %d %q (type %c, %d bytes)", index, n, name, hdr.Typeflag, hdr.Size)
		}
		if err := s.writeFile(filepath.Join(dir, name), tr); err != nil {
			return fmt.Errorf("store: restore at index %d: write snapshot file %s: %w", index, name, err)
		}
	}
	// Verify: it opens and holds the index it claims. (Opening may write
	// files of its own; Pebble syncs those.)
	ndb, err := s.openDB(dir)
	if err != nil {
		return err
	}
	got, err := readApplied(ndb)
	if cerr := ndb.Close(); err == nil {
		err = cerr
	}
	if err != nil || got != index {
		return fmt.Errorf("store: snapshot claims index %d but holds %d (%v)", index, got, err)
	}
	// The files' directory entries: without this a crash after the swap
	// can leave db/ empty or partial even though every file was synced.
	if err := vfs.SyncDir(s.fs, dir); err != nil {
		return fmt.Errorf("store: restore at index %d: sync %s: %w", index, dir, err)
	}
	return nil
}

func (s *Store) writeFile(path string, r io.Reader) error {
	f, err := s.fs.Create(path, vfs.WriteCategory)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func (s *Store) reopen(path string, cause error) error {
	db, err := s.openDB(path)
	if err != nil {
		return errors.Join(cause, err)
	}
	s.db = db
	return cause
}

// Close syncs and closes the DB.
func (s *Store) Close() error {
	if s.closed.Load() {
		return nil
	}
	close(s.stop)
	<-s.done
	_ = s.Sync()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed.Store(true)
	return s.db.Close()
}

// U64 encodes v big-endian (keys sort numerically).
func U64(v uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	return b[:]
}

// Scan calls f with every key and value under the prefix pfx in r, in
// key order, stopping at f's first error.
func Scan(r pebble.Reader, pfx []byte, f func(k, v []byte) error) error {
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: pfx, UpperBound: PrefixEnd(pfx)})
	if err != nil {
		return err
	}
	defer it.Close()
	for it.First(); it.Valid(); it.Next() {
		if err := f(it.Key(), it.Value()); err != nil {
			return err
		}
	}
	return it.Error()
}

// PrefixEnd returns the smallest key greater than every key with prefix p,
// or nil if there is none (p is all 0xFF).
func PrefixEnd(p []byte) []byte {
	end := append([]byte(nil), p...)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] != 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return nil
}

// Entry is one applied log entry as the metadata state machines see it;
// Cmd is nil for entries raft itself made (empty, membership change), whose
// index must still be recorded.
type Entry struct {
	Index uint64
	Cmd   []byte
}

// quietLogger drops Pebble's informational chatter (WAL replay lines on
// every open) and keeps errors on the default slog logger.
type quietLogger struct{}

func (quietLogger) Infof(string, ...any) {}
func (quietLogger) Errorf(format string, args ...any) {
	slog.Error(fmt.Sprintf("pebble: "+format, args...))
}
func (quietLogger) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf("pebble: "+format, args...))
}
