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
package store

import (
	"archive/tar"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
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
}

// Store is one group's Pebble database.
type Store struct {
	dir  string
	opts Options

	// mu guards db against Restore swapping it; readers hold it shared.
	mu sync.RWMutex
	db *pebble.DB

	applied atomic.Uint64
	durable atomic.Uint64

	stop   chan struct{}
	done   chan struct{}
	closed atomic.Bool
}

const (
	dbName      = "db"
	restoreName = "db.restore"
	oldName     = "db.old"
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
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("store: create %s: %w", dir, err)
	}
	cur := filepath.Join(dir, dbName)
	if _, err := os.Stat(cur); errors.Is(err, os.ErrNotExist) {
		// A crash between the two renames of Restore: the old DB is intact.
		if _, err := os.Stat(filepath.Join(dir, oldName)); err == nil {
			if err := os.Rename(filepath.Join(dir, oldName), cur); err != nil {
				return nil, fmt.Errorf("store: roll back interrupted restore in %s: %w", dir, err)
			}
		}
	}
	_ = os.RemoveAll(filepath.Join(dir, restoreName))
	_ = os.RemoveAll(filepath.Join(dir, oldName))
	_ = os.RemoveAll(filepath.Join(dir, "snapshots"))
	s := &Store{dir: dir, opts: opts, stop: make(chan struct{}), done: make(chan struct{})}
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

func (s *Store) openDB(path string) (*pebble.DB, error) {
	cache := pebble.NewCache(s.opts.CacheBytes)
	defer cache.Unref()
	db, err := pebble.Open(path, &pebble.Options{
		Cache:        cache,
		MemTableSize: 32 << 20,
		Logger:       quietLogger{},
	})
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

// NewBatch returns an indexed batch (reads see its own writes) for one
// Apply call. Only the apply goroutine writes.
func (s *Store) NewBatch() *pebble.Batch {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.db.NewIndexedBatch()
}

// Commit records index as applied in b and commits it.
func (s *Store) Commit(b *pebble.Batch, index uint64) error {
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
	s.applied.Store(index)
	if opt == pebble.Sync {
		s.durable.Store(index)
	}
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
func (s *Store) Snapshot() (uint64, io.ReadCloser, error) {
	s.mu.RLock()
	idx := s.applied.Load()
	snapDir := filepath.Join(s.dir, "snapshots")
	if err := os.MkdirAll(snapDir, 0o755); err != nil {
		s.mu.RUnlock()
		return 0, nil, err
	}
	tmp, err := os.MkdirTemp(snapDir, fmt.Sprintf("snap-%d-", idx))
	if err != nil {
		s.mu.RUnlock()
		return 0, nil, err
	}
	cp := filepath.Join(tmp, "cp")
	err = s.db.Checkpoint(cp, pebble.WithFlushedWAL())
	s.mu.RUnlock()
	if err != nil {
		os.RemoveAll(tmp)
		return 0, nil, fmt.Errorf("store: checkpoint %s at index %d: %w", s.dir, idx, err)
	}
	pr, pw := io.Pipe()
	go func() {
		pw.CloseWithError(writeTar(pw, cp))
	}()
	return idx, &snapReader{PipeReader: pr, dir: tmp}, nil
}

type snapReader struct {
	*io.PipeReader
	dir string
}

func (r *snapReader) Close() error {
	err := r.PipeReader.Close()
	os.RemoveAll(r.dir)
	return err
}

func writeTar(w io.Writer, dir string) error {
	tw := tar.NewWriter(w)
	err := filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: rel, Mode: 0o644, Size: info.Size(), Typeflag: tar.TypeReg}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		// A checkpoint's files are immutable hard links, except the copied
		// manifest/WAL, which are final; copy exactly the size we announced.
		_, err = io.CopyN(tw, f, info.Size())
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// maxSnapshotFile bounds one file of a restored snapshot (sanity limit).
const maxSnapshotFile = 64 << 30

// Restore replaces the state with a snapshot stream taken at index. The new
// DB is written aside and verified before the swap, so a failure leaves the
// old state intact.
func (s *Store) Restore(index uint64, r io.Reader) error {
	tmp := filepath.Join(s.dir, restoreName)
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return err
	}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			os.RemoveAll(tmp)
			return fmt.Errorf("store: read snapshot at index %d: %w", index, err)
		}
		name := filepath.Clean(hdr.Name)
		if strings.HasPrefix(name, "..") || filepath.IsAbs(name) || hdr.Size > maxSnapshotFile {
			os.RemoveAll(tmp)
			return fmt.Errorf("store: snapshot at index %d has bad entry %q (%d bytes)", index, hdr.Name, hdr.Size)
		}
		p := filepath.Join(tmp, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			os.RemoveAll(tmp)
			return err
		}
		f, err := os.Create(p)
		if err == nil {
			_, err = io.Copy(f, tr)
			if err == nil {
				err = f.Sync()
			}
			f.Close()
		}
		if err != nil {
			os.RemoveAll(tmp)
			return fmt.Errorf("store: write snapshot file %s: %w", name, err)
		}
	}
	// Verify: it opens and holds the index it claims.
	ndb, err := s.openDB(tmp)
	if err != nil {
		os.RemoveAll(tmp)
		return err
	}
	got, err := readApplied(ndb)
	ndb.Close()
	if err != nil || got != index {
		os.RemoveAll(tmp)
		return fmt.Errorf("store: snapshot claims index %d but holds %d (%v)", index, got, err)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	cur := filepath.Join(s.dir, dbName)
	old := filepath.Join(s.dir, oldName)
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("store: close before restore: %w", err)
	}
	if err := os.Rename(cur, old); err != nil {
		return s.reopen(cur, fmt.Errorf("store: restore: %w", err))
	}
	if err := os.Rename(tmp, cur); err != nil {
		_ = os.Rename(old, cur)
		return s.reopen(cur, fmt.Errorf("store: restore: %w", err))
	}
	syncDir(s.dir)
	os.RemoveAll(old)
	if err := s.reopen(cur, nil); err != nil {
		return err
	}
	s.applied.Store(index)
	s.durable.Store(index)
	return nil
}

func (s *Store) reopen(path string, cause error) error {
	db, err := s.openDB(path)
	if err != nil {
		return errors.Join(cause, err)
	}
	s.db = db
	return cause
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
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
