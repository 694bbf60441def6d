package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"
)

// Deferred writes (BlueStore's name for them): a small chunk that is all
// of its block's unsynced data is made durable by its Sync round in the
// volume's Pebble batch — its bytes under a deferred key beside its chunk
// record — instead of by an fdatasync of its block file and a sync of the
// file's directory entry. The bytes are in the block file too (written
// through the page cache), so every reader, the scrubber, exports and
// short-circuit readers use the file as for any block. A background
// flusher per volume later fdatasyncs those files and their directories
// and then deletes the deferred keys; Open writes any deferred keys left
// by a crash back into their files (creating them), syncs them and deletes
// the keys before it recovers anything else. So a Sync of N small blocks
// costs one WAL flush, where it cost N fdatasyncs, a directory sync per
// container and a WAL flush.
//
// Ordering rules:
//   - a deferred key is written in the same batch as its chunk record and
//     deleted in the same batch as the block's record (DeleteBlocks),
//     with the container's keys (DeleteContainer's range), or after its
//     file and directory are synced (the flusher);
//   - while a container has deferred keys, a Sync of any of its other
//     blocks syncs the container directory too: a later, normally synced
//     chunk of a block whose file entry is not durable yet must not rely
//     on a file the crash may remove (Open restores the deferred bytes,
//     not the rest).
//
// Deferred keys are
//
//	containerID (8) | kindDeferred (1) | localID (8) | offset (8)
//
// with the chunk's bytes as the value.
const kindDeferred = 0x03

// DefaultDeferredMax is the largest chunk written as a deferred write.
const DefaultDeferredMax = 32 << 10

// deferFlushEvery and deferFlushCount pace the flusher: it runs when this
// much time passed since a deferred write, or when this many wait.
const (
	deferFlushEvery = 500 * time.Millisecond
	deferFlushCount = 512
)

func makeDeferredKey(cid ContainerID, lid LocalID, off int64) []byte {
	k := makeChunkKey(cid, lid, off)
	k[8] = kindDeferred
	return k
}

func parseDeferredKey(k []byte) (cid ContainerID, lid LocalID, off int64, ok bool) {
	if len(k) != chunkKeyLen || k[8] != kindDeferred {
		return 0, 0, 0, false
	}
	off = int64(binary.BigEndian.Uint64(k[17:]))
	if off < 0 {
		return 0, 0, 0, false
	}
	return ContainerID(binary.BigEndian.Uint64(k)), LocalID(binary.BigEndian.Uint64(k[9:])), off, true
}

// deferredRange returns [lo, hi) covering every deferred key of a block.
func deferredRange(cid ContainerID, lid LocalID) (lo, hi []byte) {
	lo, hi = chunkRange(cid, lid)
	lo[8], hi[8] = kindDeferred, kindDeferred
	return lo, hi
}

// deferOK reports whether chunks on v may be deferred writes: the posix
// backend (a zoned backend keeps its own tails), and syncing on.
func (s *Store) deferOK(v *volume) bool {
	if s.opts.DeferredMax <= 0 || s.opts.Sync == SyncNone {
		return false
	}
	_, ok := v.files.(*Posix)
	return ok
}

// deferredChunk is a deferred write the flusher has yet to make durable in
// its file.
type deferredChunk struct {
	c   *container
	lid LocalID
	off int64
	dir bool   // the file may be new: sync its directory entry too
	gen uint64 // the key's generation when it was set (deferrer.gens)
}

// deferrer is a volume's flusher state.
type deferrer struct {
	mu      sync.Mutex
	pending []deferredChunk
	kick    chan struct{} // buffered(1): pending reached deferFlushCount
	stop    chan struct{}
	done    chan struct{}
	// flushMu: one flush at a time (the loop's, Close's).
	flushMu sync.Mutex
	stopped atomic.Bool // Close ran (twice is a no-op)

	// Under genMu: gens maps a deferred key to the generation of its
	// latest Set (from lastGen). The flusher deletes a key only if its
	// generation is still the one it synced the file for: a key deleted
	// (AbortBlock) and set again by a rewrite at the same offset after
	// the flusher's sync holds bytes the sync did not cover, and must
	// stay. The flusher holds genMu across its delete batch's commit, so
	// a Set's generation is either seen by it or committed after it.
	genMu   sync.Mutex
	gens    map[string]uint64
	lastGen uint64

	// afterSync, if set (tests), runs between a flush's syncs and its
	// deletions.
	afterSync atomic.Pointer[func()]
}

// setGen gives the deferred key k a new generation before its Set is
// committed; undo restores the previous one if that commit failed.
func (d *deferrer) setGen(k []byte) (gen uint64, undo func()) {
	d.genMu.Lock()
	defer d.genMu.Unlock()
	if d.gens == nil {
		d.gens = map[string]uint64{}
	}
	d.lastGen++
	gen = d.lastGen
	prev, had := d.gens[string(k)]
	d.gens[string(k)] = gen
	return gen, func() {
		d.genMu.Lock()
		defer d.genMu.Unlock()
		if d.gens[string(k)] == gen {
			if had {
				d.gens[string(k)] = prev
			} else {
				delete(d.gens, string(k))
			}
		}
	}
}

// dropGen forgets deferred key k's generation: the key was deleted by an
// inline block's commit, and the flusher never had it (inline.go).
func (d *deferrer) dropGen(k []byte) {
	d.genMu.Lock()
	delete(d.gens, string(k))
	d.genMu.Unlock()
}

func (s *Store) startDeferrer(v *volume) {
	d := &deferrer{kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	v.defer_ = d
	go func() {
		defer close(d.done)
		// A panic here fails the volume, not the process; the pending
		// writes keep their keys, which the next Open replays.
		defer s.guardVolume(v, "the deferred-write flusher")
		t := time.NewTicker(deferFlushEvery)
		defer t.Stop()
		for {
			select {
			case <-d.stop:
				return
			case <-t.C:
			case <-d.kick:
			}
			s.flushDeferred(v)
		}
	}()
}

// addDeferred hands durable deferred writes to the flusher. The caller
// counted them in c.deferredKeys already.
func (v *volume) addDeferred(chunks []deferredChunk) {
	d := v.defer_
	d.mu.Lock()
	d.pending = append(d.pending, chunks...)
	n := len(d.pending)
	d.mu.Unlock()
	if n >= deferFlushCount {
		select {
		case d.kick <- struct{}{}:
		default:
		}
	}
}

// flushDeferred makes the files of pending deferred writes durable and
// then deletes their deferred keys. A file that is gone was deleted with
// its block (its keys went in the same batch). On an error the writes stay
// pending: their keys still hold the bytes, and the volume is failed.
func (s *Store) flushDeferred(v *volume) {
	d := v.defer_
	d.flushMu.Lock()
	defer d.flushMu.Unlock()
	d.mu.Lock()
	todo := d.pending
	d.pending = nil
	d.mu.Unlock()
	if len(todo) == 0 {
		return
	}
	p := v.files.(*Posix)
	type fileKey struct {
		cid ContainerID
		lid LocalID
	}
	files := map[fileKey]bool{}
	dirs := map[ContainerID]bool{}
	for _, dc := range todo {
		files[fileKey{dc.c.id, dc.lid}] = true
		if dc.dir {
			dirs[dc.c.id] = true
		}
	}
	var firstErr error
	if ok, err := p.syncFS(); ok {
		// One syncfs(2) wrote back and flushed every file and directory
		// of the file system (one call where there were a thousand).
		firstErr = err
		files, dirs = nil, nil
	}
	var mu sync.Mutex
	sem := make(chan struct{}, maxSyncParallel)
	var wg sync.WaitGroup
	run := func(f func() error) {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil {
						err = &syncPanic{fmt.Sprintf("storage: panic in a deferred-write sync: %v", p)}
						s.opts.Logf("storage: volume %s: panic in a deferred-write sync: %v\n%s", v.path, p, debug.Stack())
					}
				}()
				err = f()
			}()
			<-sem
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				mu.Lock()
				firstErr = err
				mu.Unlock()
			}
		}()
	}
	for fk := range files {
		run(func() error {
			f, err := p.fs.OpenFile(p.path(fk.cid, fk.lid), os.O_RDONLY, 0)
			if err != nil {
				return err
			}
			err = f.SyncData()
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			return err
		})
	}
	for cid := range dirs {
		run(func() error { return p.SyncContainer(cid) })
	}
	wg.Wait()
	if f := d.afterSync.Load(); f != nil {
		(*f)()
	}
	if firstErr == nil {
		b := v.db.NewBatch()
		d.genMu.Lock()
		var mine []string
		s.mu.RLock()
		for _, dc := range todo {
			k := makeDeferredKey(dc.c.id, dc.lid, dc.off)
			if d.gens[string(k)] != dc.gen {
				// Set again since (a rewrite after an abort): its bytes
				// may postdate the sync; its own entry deletes it.
				continue
			}
			mine = append(mine, string(k))
			// A container deleted since took its keys with it; one made
			// again under the same ID is not this one.
			if s.containers[dc.c.id] == dc.c {
				b.Delete(k, nil)
			}
		}
		s.mu.RUnlock()
		// Not synced: a deletion lost in a crash only makes Open write
		// the same bytes into the file again.
		firstErr = v.commit(b, pebble.NoSync)
		v.closeBatch(b)
		if firstErr == nil {
			for _, k := range mine {
				delete(d.gens, k)
			}
		}
		d.genMu.Unlock()
	}
	if firstErr != nil {
		if sp := (*syncPanic)(nil); errors.As(firstErr, &sp) {
			s.panicVolume(v, firstErr) // logged with its stack above
		} else {
			v.fail(firstErr, s.opts.Logf)
		}
		d.mu.Lock()
		d.pending = append(todo, d.pending...)
		d.mu.Unlock()
		return
	}
	for _, dc := range todo {
		dc.c.deferredKeys.Add(-1)
	}
}

// stopDeferrer stops v's flusher after a last flush.
func (s *Store) stopDeferrer(v *volume) {
	d := v.defer_
	if d == nil || !d.stopped.CompareAndSwap(false, true) {
		return
	}
	close(d.stop)
	// A flusher stalled inside a wedged DB never ends (fatal.go).
	waitUnlessWedged(d.done, v.wedged.Load)
	if !v.failed.Load() {
		s.flushDeferred(v)
	}
}

// replayDeferred writes the deferred keys found at Open back into their
// block files, syncs the files and their directories, then deletes the
// keys (synced). Keys of containers without a directory (deleted) are
// only deleted.
func (s *Store) replayDeferred(v *volume, keys [][]byte, vals [][]byte) error {
	if len(keys) == 0 {
		return nil
	}
	dirs := map[ContainerID]bool{}
	for i, k := range keys {
		cid, lid, off, _ := parseDeferredKey(k)
		w, err := v.files.OpenWriter(cid, lid)
		if errors.Is(err, os.ErrNotExist) {
			continue // no container directory: the container is gone
		}
		if err != nil {
			return err
		}
		_, err = w.WriteAt(vals[i], off)
		if err == nil {
			err = w.Sync()
		}
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		dirs[cid] = true
	}
	for cid := range dirs {
		if err := v.files.SyncContainer(cid); err != nil {
			return err
		}
	}
	b := v.db.NewBatch()
	defer v.closeBatch(b)
	for _, k := range keys {
		b.Delete(k, nil)
	}
	s.opts.Logf("storage: volume %s: %d deferred writes replayed into their block files", v.path, len(keys))
	return v.commit(b, pebble.Sync)
}

// deferrable reports whether ob's unsynced data is all chunks that keep
// their bytes for a deferred write (small, checksummed; see writeLocked).
func deferrable(ob *openBlock) bool {
	found := false
	for _, sp := range ob.written {
		if sp.durable {
			continue
		}
		if sp.data == nil {
			return false
		}
		found = true
	}
	return found
}

// syncFS makes everything written to p's file system durable with one
// syncfs(2) (data, inodes and directory entries: the journal commit and
// device flush of every file written before the call), if p's files are
// the operating system's; ok is false on other file systems (in-memory
// and crash-test ones), whose callers sync file by file. It syncs through
// the descriptor opened with the backend, so it also reports write-back
// errors of pages flushed since then by the kernel on its own.
func (p *Posix) syncFS() (ok bool, err error) {
	if p.syncDir == nil {
		return false, nil
	}
	return true, unix.Syncfs(int(p.syncDir.Fd()))
}

// Close releases the descriptor kept for syncFS.
func (p *Posix) Close() error {
	if p.syncDir == nil {
		return nil
	}
	return p.syncDir.Close()
}

// syncPanic is the error of a deferred-write sync that panicked.
type syncPanic struct{ msg string }

func (e *syncPanic) Error() string { return e.msg }
