package raft

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"

	"github.com/basalt-store/basalt/internal/storage"
)

// A failing log disk takes out its log directory, not the process.
//
// Each log directory has its own Pebble DB (logStore) and its own loop.
// The DB's Logger is a storage.FatalLogger (session 17's, shared with the
// data volumes) and its WAL and MANIFEST go through that logger's file
// system wrapper, so:
//
//   - the first error of a WAL or MANIFEST write, sync, stat, close or
//     create, or of a sync of the directory, fails the directory before
//     Pebble sees it (a failed WAL rotation would otherwise abort the
//     runtime with DB.mu released, see internal/storage/metafs.go);
//   - a Pebble Fatalf raised inside one of our calls (a commit whose WAL
//     sync failed: "fatal commit error") comes back as that call's error:
//     every call into the DB defers the logger's Catch;
//   - a Pebble Fatalf on Pebble's own goroutines (a flush or compaction
//     whose MANIFEST update failed) ends that goroutine (runtime.Goexit),
//     after the directory is marked failed;
//   - a read error other than "not found" (EIO on an SST) fails it too.
//
// A failed directory's DB is never called again (usable) nor closed (its
// Close would wait for the flush that Fatalf ended). Its loop stops every
// group placed on it: none of them acknowledges, votes, or applies anything
// after the failure, and an entry whose batch failed to commit is never
// reported as persisted (no Advance, no message sent). The other
// directories' groups go on. AddGroup never places a group on a failed
// directory. The failure shows in LogDirStatus (Failed, Error), in the
// metric basalt_raft_log_dir_failures_total, in each group's
// FailureError (which matches ErrLogDirFailed), and through
// HostConfig.OnLogDirFailed.
//
// Nothing is repaired in place: a restart opens the directory again. If
// the disk still fails, its Pebble open fails and NewHost returns the
// error (the datanode does not start: an operator removes the directory
// from LogDirs or replaces the disk); if it works again, Pebble replays
// what is durable, and every entry this replica acknowledged is in it.

// ErrLogDirFailed: the group's log directory met a fatal I/O error (see
// LogDirError); its groups are stopped until the host restarts.
var ErrLogDirFailed = errors.New("raft: log directory failed")

// LogDirError is why a log directory failed. It matches ErrLogDirFailed
// (and not storage.ErrVolumeFailed: a data volume is not involved).
type LogDirError struct {
	Dir   string
	Cause string
}

func (e *LogDirError) Error() string {
	return fmt.Sprintf("raft: log directory %s FAILED: %s", e.Dir, e.Cause)
}

func (e *LogDirError) Is(target error) bool { return target == ErrLogDirFailed }

// fatal is what a logStore needs to fail as a unit: the Pebble logger and
// the failure mark (set once, first cause kept).
type fatal struct {
	dir  string
	flog *storage.FatalLogger
	err  atomicLogDirErr
	// failc is closed when the directory fails: its loop then stops the
	// groups (failGroups). The goroutine that fails it may be Pebble's,
	// or hold a group's lock (a read under raft), so it does nothing else.
	failc chan struct{}
}

type atomicLogDirErr struct {
	mu  sync.Mutex
	err *LogDirError
}

func newFatal(dir string) *fatal {
	f := &fatal{dir: dir, failc: make(chan struct{})}
	f.flog = &storage.FatalLogger{
		Prefix:  "raft log store " + dir + ": ",
		OnFatal: func(err *storage.FatalError) { f.fail(err) },
	}
	return f
}

// fail marks the directory failed with cause (the first cause is kept) and
// returns the recorded error.
func (f *fatal) fail(cause error) *LogDirError {
	first := false
	f.err.mu.Lock()
	if f.err.err == nil {
		f.err.err = &LogDirError{Dir: f.dir, Cause: cause.Error()}
		first = true
	}
	e := f.err.err
	f.err.mu.Unlock()
	if first {
		close(f.failc)
	}
	return e
}

// failed returns the failure, or nil (the fast path: a closed-channel check).
func (f *fatal) failed() *LogDirError {
	select {
	case <-f.failc:
	default:
		return nil
	}
	f.err.mu.Lock()
	defer f.err.mu.Unlock()
	return f.err.err
}

// usable returns nil if the DB may be called, else the failure.
func (f *fatal) usable() error {
	if e := f.failed(); e != nil {
		return e
	}
	return nil
}

// after turns the error of a DB call into the directory's failure: a
// Fatalf caught by the call's Catch (a *storage.FatalError), or any error
// once the directory is failed. Other errors (not found, a decoding error
// of ours) pass unchanged; readErr also fails the directory.
func (f *fatal) after(err error) error {
	if err == nil {
		return nil
	}
	var fe *storage.FatalError
	if errors.As(err, &fe) {
		return f.fail(fe)
	}
	if e := f.failed(); e != nil {
		return e
	}
	return err
}

// backgroundError is the log store's Pebble EventListener.BackgroundError:
// a flush or compaction that failed (an SST write or sync: no Fatalf, and
// Pebble retries it at once, forever, with no back-off) fails the
// directory, and on Pebble's own flush or compaction goroutine it then ends
// that goroutine (runtime.Goexit), instead of retrying the failing work in
// a busy loop on a dead directory:
//   - a flush (DB.flush, pebble v2.1.7 compaction.go) holds only DB.mu,
//     released by its defer; its flushing mark stays set, so Pebble
//     schedules no more flushes;
//   - a compaction (DB.compact → handleCompactFailure) holds DB.mu,
//     released by the inner func's defer (pprof.Do's label defer runs
//     too); its compactingCount and inProgress entry stay raised and its
//     GrantHandle().Done() is skipped, which only keeps this dead DB from
//     scheduling more compactions (the scheduler is the DB's own);
//     Close would wait for compactingCount, but a failed DB is never
//     closed (storage.CloseDB).
//
// Else (a disk-usage check, or on a goroutine of ours) it only marks.
func (f *fatal) backgroundError(err error) {
	f.fail(fmt.Errorf("background error: %w", err))
	if inPebbleBackground() {
		runtime.Goexit()
	}
}

// inPebbleBackground reports whether the caller is Pebble's flush
// (DB.flush) or a failed compaction (DB.handleCompactFailure under
// DB.compact) on one of Pebble's goroutines (no frame of this module on
// the stack).
func inPebbleBackground() bool {
	pcs := make([]uintptr, 64)
	n := runtime.Callers(3, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	flush, failedCompact, compact := false, false, false
	for {
		fr, more := frames.Next()
		switch {
		case strings.HasSuffix(fr.Function, "pebble/v2.(*DB).flush"):
			flush = true
		case strings.HasSuffix(fr.Function, "pebble/v2.(*DB).handleCompactFailure"):
			failedCompact = true
		case strings.HasSuffix(fr.Function, "pebble/v2.(*DB).compact"):
			compact = true
		case strings.HasPrefix(fr.Function, "github.com/basalt-store/basalt/") && !strings.Contains(fr.Function, "raft.(*fatal)."):
			return false
		}
		if !more {
			return (flush || failedCompact && compact) && n < len(pcs)
		}
	}
}

// failWith fails the directory for err (an I/O error Pebble returned
// without a Fatalf: a failed read, a failed commit) and returns the
// failure.
func (f *fatal) failWith(what string, err error) error {
	if err == nil {
		return nil
	}
	if e := f.after(err); errors.Is(e, ErrLogDirFailed) {
		return e
	}
	return f.fail(fmt.Errorf("%s: %w", what, err))
}

// failGroups stops every group of this loop's directory, once it failed
// (err, its failure); the first call also counts it (first), logs and
// reports it (HostConfig.OnLogDirFailed, after the groups stopped). It runs
// on the loop's goroutine only (or Poll's), never under a group's lock.
func (l *storeLoop) failGroups(err error) {
	if err == nil {
		return
	}
	h := l.host
	first := false
	l.failOnce.Do(func() {
		first = true
		h.metrics.logDirFailures.Inc()
	})
	var ids []uint64
	for _, g := range h.groupList() {
		if g.loop == l {
			ids = append(ids, g.id)
			g.fail(err)
		}
	}
	if first {
		h.log.Error("raft log directory FAILED: its groups are stopped, it gets no new ones; the other log directories go on",
			"dir", l.store.dir, "groups", len(ids), "err", err)
		if h.cfg.OnLogDirFailed != nil {
			h.cfg.OnLogDirFailed(l.store.dir, err, ids)
		}
	}
}

// Failure is why the group stopped after a fatal error (it matches
// ErrLogDirFailed when its log directory failed), or nil.
func (g *Group) Failure() error {
	if f := g.failure.Load(); f != nil {
		return *f
	}
	return nil
}
