package storage

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// A failing disk takes out its volume, not the datanode.
//
// Each volume has its own Pebble DB, and Pebble calls its Logger's Fatalf
// where it cannot go on: a failed WAL write or sync ("fatal commit error",
// on the committing goroutine: ours), a failed MANIFEST write, sync or
// CURRENT update (from its flush and compaction goroutines: Pebble's own),
// data corruption met by a read or compaction, and invariant violations.
// Pebble's default Fatalf exits the process; a panic does the same on
// Pebble's goroutines. FatalLogger instead fails only the volume:
//
//  1. OnFatal runs first (the volume is marked failed and its DB wedged:
//     every storage path checks the mark before it touches the DB, and
//     Close does not close a wedged DB, whose Close would wait forever for
//     a flush that is never to finish).
//  2. If the goroutine is inside one of our calls (a frame of this module
//     is on its stack), Fatalf panics with a value that the call's guard
//     (Catch) turns into an error wrapping ErrVolumeFailed: the request in
//     flight gets an error, never success.
//  3. Otherwise the goroutine is one of Pebble's own (flush, compaction,
//     table stats): Fatalf ends it with runtime.Goexit, which runs its
//     deferred calls (Pebble's flush and compaction release DB.mu and the
//     MANIFEST lock by defer) without taking the process down. The DB is
//     not called again until the next Open, which replays what is durable.
//
// Pebble does not turn every WAL error into a Fatalf (a failed WAL rotation
// panics with DB.mu released, which aborts the runtime): metafs.go wedges
// the volume at the first WAL or MANIFEST I/O error, before Pebble sees it.
//
// Nothing is acknowledged from a wedged volume after the fatal error
// (fsyncgate: after a failed fsync nothing on it is trusted to be durable).

// FatalError is the cause recorded for a volume whose metadata store met a
// fatal error; it matches ErrVolumeFailed.
type FatalError struct {
	Msg string
}

func (e *FatalError) Error() string        { return "pebble fatal error: " + e.Msg }
func (e *FatalError) Is(target error) bool { return target == ErrVolumeFailed }

// FatalLogger is the pebble.Logger of one volume's metadata store (the
// volume's own DB, or a zoned backend's): see above. Its zero value is not
// usable; OnFatal must be set.
type FatalLogger struct {
	// Prefix starts every Errorf line ("pebble: ").
	Prefix string
	// Logf reports Errorf lines; nil: discarded.
	Logf func(format string, args ...any)
	// OnFatal marks the volume failed; it runs once per Fatalf, before
	// anything else, on the goroutine that called Fatalf, and must not
	// call into the DB.
	OnFatal func(err *FatalError)

	fatals atomic.Uint64
	// ioErr: the first error on a WAL or MANIFEST file (metafs.go).
	ioErr atomic.Pointer[FatalError]
	// dbMu: the DB's DB.mu (SetDB), for a failed WAL rotation.
	dbMu atomic.Pointer[sync.Mutex]
	// abandoned, stuck: writes left inside a wedged DB (GuardedDB).
	abandoned atomic.Uint64
	stuck     atomic.Int64
	calls     committers // GuardedDB's committers
	// writes: calls that entered the commit pipeline (GuardedDB.write);
	// each is a Pebble commit and, with Wedged, a committer hand-off.
	writes atomic.Uint64
}

var _ pebble.Logger = (*FatalLogger)(nil)

// fatalPanic is the panic value of a Fatalf raised on our goroutine.
type fatalPanic struct {
	l   *FatalLogger
	err *FatalError
}

func (l *FatalLogger) Infof(string, ...any) {}

func (l *FatalLogger) Errorf(f string, a ...any) {
	if l.Logf != nil {
		l.Logf(l.Prefix+f, a...)
	}
}

// Fatalf marks the volume failed, then panics (our goroutine: see Catch)
// or ends the goroutine (Pebble's).
func (l *FatalLogger) Fatalf(f string, a ...any) {
	err := &FatalError{Msg: fmt.Sprintf(f, a...)}
	l.fatals.Add(1)
	l.OnFatal(err)
	if onOurStack() {
		panic(fatalPanic{l, err})
	}
	runtime.Goexit()
}

// Fatals counts the Fatalf calls met.
func (l *FatalLogger) Fatals() uint64 { return l.fatals.Load() }

// Catch, deferred directly by a function that calls into l's DB, turns a
// Fatalf of l raised inside it into *errp (a *FatalError, which matches
// ErrVolumeFailed). Any other panic goes on.
func (l *FatalLogger) Catch(errp *error) {
	if p := recover(); p != nil {
		if fp, ok := p.(fatalPanic); ok && fp.l == l {
			*errp = fp.err
			return
		}
		if e, ok := p.(error); ok && l.ioErr.Load() != nil {
			// Pebble's own panic(err) after a WAL error the wrapper
			// has seen (commitWrite's WriteRecord): the volume is
			// wedged already (metafs.go).
			*errp = &FatalError{Msg: "commit after a metadata I/O error: " + e.Error()}
			return
		}
		panic(p)
	}
}

// errEarlyPanic is the early commit's result when its goroutine panicked
// (the volume is failed by guardVolume).
var errEarlyPanic error = &FatalError{Msg: "panic in the early commit of a sync round"}

// ourModule prefixes the functions of this module.
const ourModule = "github.com/basalt-store/basalt/"

// onOurStack reports whether the calling goroutine has a frame of this
// module below Fatalf (its caller's callers): then it runs one of our calls
// into Pebble, whose guard catches the panic. Pebble's own goroutines
// (flush, compaction, table stats, cleaners) start in Pebble and call
// nothing of ours that calls Fatalf back. Only Fatalf pays for the walk.
func onOurStack() bool {
	pcs := make([]uintptr, 64)
	for {
		n := runtime.Callers(3, pcs) // skip Callers, onOurStack, Fatalf
		frames := runtime.CallersFrames(pcs[:n])
		for {
			fr, more := frames.Next()
			if strings.HasPrefix(fr.Function, ourModule) && !strings.Contains(fr.Function, ".(*FatalLogger).") &&
				!strings.Contains(fr.Function, ".(*fatalFile).") && !strings.Contains(fr.Function, ".(*fatalFS).") {
				return true
			}
			if !more {
				break
			}
		}
		if n < len(pcs) {
			return false
		}
		pcs = make([]uintptr, 2*len(pcs))
	}
}

// wedge is v's OnFatal: v is failed with err, and its DB is not called
// again.
func (s *Store) wedge(v *volume, err *FatalError) {
	v.setWedged(err) // before anything else
	s.testPoint("wedged")
	s.fatalVolume(v, err)
}

// setWedged wedges v's DB, with err as the cause unless one was recorded
// first. The cause is stored before the flag: a call that sees the flag
// (usable) and fails the volume with usable's error records the cause,
// never a bare "volume wedged", even while the goroutine that wedged v has
// not yet recorded it as the volume's failure.
func (v *volume) setWedged(err error) {
	v.wedgeErr.CompareAndSwap(nil, &err)
	v.wedged.Store(true)
	v.wedgeOnce.Do(func() {
		if v.wedgedCh != nil {
			close(v.wedgedCh) // CloseBatch keeps the batches
		}
		if v.log != nil {
			v.log.AbandonWrites() // writes inside the DB return (GuardedDB)
		}
	})
}

// fatalVolume fails v for a fatal error of a metadata store (its own, or
// its backend's), logging and counting it once.
func (s *Store) fatalVolume(v *volume, err error) {
	v.failed.Store(true)
	if v.fatalLogged.CompareAndSwap(false, true) {
		s.volumeFatals.Add(1)
		s.opts.Logf("storage: volume %s FAILED: its metadata store met a fatal error (%v); its containers are reported UNHEALTHY, the other volumes go on", v.path, err)
	}
	v.fail(err, func(string, ...any) {}) // logged above
}

// backendFatal returns the fatal error of v's backend's own metadata
// store (the zoned backend's Fatal), or nil.
func backendFatal(v *volume) error {
	if f, ok := v.files.(interface{ Fatal() error }); ok {
		return f.Fatal()
	}
	return nil
}

// checkBackend fails v if its backend met a fatal error, and reports
// whether this call failed it.
func (s *Store) checkBackend(v *volume) bool {
	if v.files == nil || v.fatalLogged.Load() {
		return false
	}
	err := backendFatal(v)
	if err == nil {
		return false
	}
	s.fatalVolume(v, err)
	return true
}

// usable returns nil if v's DB may be called, or the error that wedged it.
func (v *volume) usable() error {
	if !v.wedged.Load() {
		return nil
	}
	if err := v.err(); err != nil {
		return err
	}
	if p := v.wedgeErr.Load(); p != nil { // stored before wedged (setWedged)
		return *p
	}
	return &FatalError{Msg: "volume wedged"} // not reached: setWedged sets wedged

}

// GuardedDB is a Pebble DB behind its FatalLogger: every call first asks
// Usable (a wedged store answers with its error and the DB is not touched)
// and a Fatalf raised inside the call comes back as its error (Catch). A
// volume's DB and the zoned backend's own DB are called only through one.
//
// A write (Commit, Set, Delete, DeleteRange, LogData: every call that
// enters Pebble's commit pipeline) escapes a wedge that happens while it is
// inside the DB: it runs on one of the DB's committer goroutines and the
// caller waits for the call's done token, which the committer sends when
// the commit ends, or FatalLogger.AbandonWrites (called by the store's
// wedge, after Usable fails) sends for every call in flight. A commit in
// flight when another goroutine's rotation Fatalf unwound through
// commitPipeline.prepare would otherwise wait for good: on the pipeline's
// mutex, which prepare takes without defer, or in publish behind the dead
// batch at the head of the pending queue (metafs.go). On the wedge the
// caller gets the stored cause (ErrVolumeFailed) and the committer is
// abandoned: counted (FatalLogger.Abandoned, Stuck), never waited for
// (Close does not close a wedged DB). Which of the two sends the token is
// decided by a CAS on the call's state, so a call that finished at the
// same moment returns its own result.
//
// Committers are long-lived: a write goes to the idle one parked last
// (LIFO: the warmest stack), woken on a channel of its own, or starts one
// if none is idle (so concurrent commits still meet in Pebble's group
// commit, and a committer's stack, grown through Pebble's commit once, is
// not grown afresh per call as a goroutine per call's was). A committer
// that would be idle beyond maxIdleCommitters ends, so their number falls
// back after a burst. They end on Stop (the store's Close) or on the wedge.
//
// A batch whose commit was abandoned may still be read by its committer:
// it is released only through CloseBatch, which does not give a wedged
// store's batches back to Pebble's pool (shared by every DB of the
// process).
//
// Reads (Get, NewIter) never enter the commit pipeline and run on the
// caller's goroutine (Pebble v2.1.7: commitPipeline.mu is taken by Apply's
// prepare, AllocateSeqNum (ingest, excise), AsyncFlush, Compact and Close,
// none of which storage calls outside Close): they do not escape a wedge.
type GuardedDB struct {
	DB     *pebble.DB
	Log    *FatalLogger
	Usable func() error
	// Wedged is closed when the store wedges (after Usable returns its
	// error; the store then calls Log.AbandonWrites); nil: writes run on
	// the caller's goroutine, with no escape.
	Wedged <-chan struct{}
	// Wedge wedges the store (nil: nothing); a write whose commit
	// panicked (not a Fatalf) calls it before the panic goes on on the
	// caller's goroutine, so the store is wedged before the caller's
	// deferred CloseBatch runs: a panic that unwound through Pebble may
	// have left the batch in its pending queue.
	Wedge func(error)
}

// CommitPanic is the panic value raised again on a write's caller when
// its commit panicked on a committer (not a Fatalf): the committer's value
// and stack (the Pebble frames that panicked).
type CommitPanic struct {
	Value any
	Stack []byte
}

func (p *CommitPanic) Error() string {
	return fmt.Sprintf("panic in a commit: %v\ncommitter's stack:\n%s", p.Value, p.Stack)
}

// Unwrap returns the committer's panic value if it is an error.
func (p *CommitPanic) Unwrap() error {
	err, _ := p.Value.(error)
	return err
}

// committers are the committer goroutines of one DB (kept in its
// FatalLogger, which exists before the DB opens and is what the store's
// wedge reaches).
type committers struct {
	mu      sync.Mutex
	idle    []*committer // parked, a stack: the last parked is woken first
	all     []*committer // every live committer: walked on the wedge
	wedged  bool         // AbandonWrites ran: no call is handed off again
	stopped bool         // Stop ran: committers end when done
}

// committer is one committer goroutine.
type committer struct {
	wake chan *dbCall // cap 1: its next call; nil: end
	cur  *dbCall      // the call it runs (under committers.mu)
	at   int          // its index in committers.all
}

// maxIdleCommitters bounds a DB's idle committers.
var maxIdleCommitters = max(4, 2*runtime.GOMAXPROCS(0))

// dbCall is one commit handed to a committer (GuardedDB.write).
type dbCall struct {
	b        *pebble.Batch
	wo       *pebble.WriteOptions
	done     chan struct{} // one token per call
	state    atomic.Int32  // callIdle (pooled), callQueued, callRunning, then callDone or callAbandoned
	err      error
	panicked bool
	p        any
}

const (
	callIdle   int32 = iota
	callQueued       // handed to a committer, not yet in the DB
	callRunning
	callDone
	callAbandoned
)

// dbCalls recycles the calls not abandoned.
var dbCalls = sync.Pool{New: func() any { return &dbCall{done: make(chan struct{}, 1)} }}

// errCommitterExited is a call's result if its committer ended inside the
// commit without returning or panicking (runtime.Goexit): never a false
// success.
var errCommitterExited error = &FatalError{Msg: "committer goroutine exited inside a commit"}

// Stop ends the idle committers; busy ones end when done (a committer
// stuck in a wedged DB stays). A write after Stop still runs, on a
// committer that then ends.
func (g *GuardedDB) Stop() {
	cs := &g.Log.calls
	cs.mu.Lock()
	defer cs.mu.Unlock()
	cs.stopped = true
	cs.endIdle()
}

// AbandonWrites is called by the store once it is wedged (Usable fails):
// every write in flight in the DB returns to its caller with Usable's
// error (its committer is left behind, counted in Abandoned and Stuck),
// no write is handed to a committer again, and the idle committers end.
func (l *FatalLogger) AbandonWrites() {
	cs := &l.calls
	cs.mu.Lock()
	defer cs.mu.Unlock()
	cs.wedged = true
	for _, k := range cs.all {
		c := k.cur
		if c == nil {
			continue
		}
		if c.state.CompareAndSwap(callQueued, callAbandoned) {
			c.done <- struct{}{} // not started: its committer skips it
			continue
		}
		l.stuck.Add(1) // before the CAS: the committer's -1 comes after it
		if c.state.CompareAndSwap(callRunning, callAbandoned) {
			l.abandoned.Add(1)
			c.done <- struct{}{}
		} else {
			l.stuck.Add(-1) // it ended meanwhile: its own result
		}
	}
	cs.endIdle()
}

// endIdle ends the idle committers; cs.mu is held.
func (cs *committers) endIdle() {
	for i, k := range cs.idle {
		k.wake <- nil
		cs.remove(k)
		cs.idle[i] = nil
	}
	cs.idle = cs.idle[:0]
}

// remove drops k from cs.all; cs.mu is held.
func (cs *committers) remove(k *committer) {
	last := len(cs.all) - 1
	cs.all[k.at] = cs.all[last]
	cs.all[k.at].at = k.at
	cs.all[last] = nil
	cs.all = cs.all[:last]
}

// write commits b under the guard: see GuardedDB. b must stay valid until
// its committer is done with it: the caller may return before (on the
// wedge), so b is released only by CloseBatch.
func (g *GuardedDB) write(b *pebble.Batch, wo *pebble.WriteOptions) error {
	if g.Log != nil {
		g.Log.writes.Add(1)
	}
	c, err := g.start(b, wo)
	if c == nil {
		return err
	}
	return g.wait(c)
}

// start hands b's commit to a committer and returns its call, for wait
// (exactly once); nil: err is the commit's result (refused on a wedged
// store, or run on the caller's goroutine with no Wedged).
func (g *GuardedDB) start(b *pebble.Batch, wo *pebble.WriteOptions) (*dbCall, error) {
	if err := g.Usable(); err != nil {
		return nil, err
	}
	if g.Wedged == nil {
		return nil, commitCaught(g.Log, b, wo)
	}
	c := dbCalls.Get().(*dbCall)
	c.b, c.wo = b, wo
	c.state.Store(callQueued)
	cs := &g.Log.calls
	cs.mu.Lock()
	if cs.wedged { // wedged since Usable: AbandonWrites would not see c
		cs.mu.Unlock()
		*c = dbCall{done: c.done}
		dbCalls.Put(c)
		return nil, g.wedgedErr()
	}
	var k *committer
	if n := len(cs.idle); n > 0 {
		k = cs.idle[n-1]
		cs.idle[n-1] = nil
		cs.idle = cs.idle[:n-1]
	}
	fresh := k == nil
	if fresh {
		k = &committer{wake: make(chan *dbCall, 1), at: len(cs.all)}
		cs.all = append(cs.all, k)
	}
	k.cur = c // seen by AbandonWrites from here on
	cs.mu.Unlock()
	if fresh {
		go g.committer(k, c)
	} else {
		k.wake <- c
	}
	return c, nil
}

// wait waits for c (from start) and returns its result, or the wedge's
// error if the wedge abandoned it; c is recycled. A panic of the commit
// (not a Fatalf) wedges the store (Wedge) and goes on here.
func (g *GuardedDB) wait(c *dbCall) error {
	<-c.done
	if c.state.Load() == callAbandoned {
		return g.wedgedErr() // c is not reused: its committer may still hold it
	}
	err, panicked, p := c.err, c.panicked, c.p
	*c = dbCall{done: c.done}
	dbCalls.Put(c)
	if panicked {
		// A panic that is no fatal error of the DB wedges the store, then
		// goes on, on the caller's goroutine.
		if g.Wedge != nil {
			g.Wedge(&FatalError{Msg: fmt.Sprintf("panic in a commit: %v", p.(*CommitPanic).Value)})
		}
		panic(p)
	}
	return err
}

// wedgedErr is a write's error on the wedge.
func (g *GuardedDB) wedgedErr() error {
	if err := g.Usable(); err != nil {
		return err
	}
	return &FatalError{Msg: "volume wedged"} // not reached: AbandonWrites runs after Usable fails
}

// committer runs c, then the calls handed to it while idle, until it ends
// (Stop, the wedge, or too many idle).
func (g *GuardedDB) committer(k *committer, c *dbCall) {
	for {
		if g.runCall(k, c) {
			return
		}
		if c = <-k.wake; c == nil {
			return
		}
	}
}

// runCall commits c's batch unless c was abandoned before it started or
// the store is wedged by now (a wedged DB is never called again), then parks k (or reports that it ends) before
// it sends c's token, if the wedge did not send it. c is not touched after
// that (its caller then reuses it). A committer ended by runtime.Goexit
// inside the commit still sends its token, with errCommitterExited.
func (g *GuardedDB) runCall(k *committer, c *dbCall) (exit bool) {
	l := g.Log
	if !c.state.CompareAndSwap(callQueued, callRunning) {
		return g.park(k, false) // abandoned before it started: AbandonWrites sent its token
	}
	returned := false
	defer func() {
		if p := recover(); p != nil {
			c.panicked, c.p = true, &CommitPanic{Value: p, Stack: debug.Stack()}
		} else if !returned {
			exit = true // Goexit: c.err is errCommitterExited
		}
		won := c.state.CompareAndSwap(callRunning, callDone)
		exit = g.park(k, exit)
		if won {
			c.done <- struct{}{}
		} else {
			l.stuck.Add(-1) // abandoned, and ended after all
		}
	}()
	c.err = errCommitterExited
	if err := g.Usable(); err != nil {
		c.err = err // wedged since the caller's check: not counted as stuck
	} else {
		c.err = commitCaught(l, c.b, c.wo)
	}
	returned = true
	return false
}

// park puts k, done with its call, on the idle stack, or drops it and
// reports that it ends (end, Stop, the wedge, or maxIdleCommitters idle).
func (g *GuardedDB) park(k *committer, end bool) (exit bool) {
	cs := &g.Log.calls
	cs.mu.Lock()
	defer cs.mu.Unlock()
	k.cur = nil
	exit = end || cs.stopped || cs.wedged || len(cs.idle) >= maxIdleCommitters
	if exit {
		cs.remove(k)
	} else {
		cs.idle = append(cs.idle, k)
	}
	return exit
}

func commitCaught(l *FatalLogger, b *pebble.Batch, wo *pebble.WriteOptions) (err error) {
	defer l.Catch(&err)
	return b.Commit(wo)
}

// Abandoned counts the writes whose caller returned on a wedge while they
// were inside the DB; Stuck is how many of them have not ended (goroutines
// blocked in a wedged DB until the process exits).
func (l *FatalLogger) Abandoned() uint64 { return l.abandoned.Load() }
func (l *FatalLogger) Stuck() int64      { return l.stuck.Load() }

// Writes counts the calls that entered the DB's commit pipeline through
// its GuardedDB: each one Pebble commit and one committer hand-off.
func (l *FatalLogger) Writes() uint64 { return l.writes.Load() }

// CloseBatch releases b (a batch of DB) unless the store is wedged: then a
// write abandoned in the DB may still read b, and b is left to the garbage
// collector instead of Pebble's batch pool. Every batch given to Commit is
// released by CloseBatch, never by b.Close.
func (g *GuardedDB) CloseBatch(b *pebble.Batch) {
	if g.Wedged != nil {
		select {
		case <-g.Wedged:
			return
		default:
		}
	}
	b.Close()
}

// Commit commits b (a batch of DB); release b with CloseBatch.
func (g *GuardedDB) Commit(b *pebble.Batch, wo *pebble.WriteOptions) error {
	return g.write(b, wo)
}

// Set, Delete, DeleteRange and LogData build their batch on the caller's
// goroutine (k and val are copied into it before the hand-off: the caller
// may reuse them once the call returns, even on a wedge), as Pebble's own
// DB.Set does, and commit it as Commit does.
func (g *GuardedDB) Set(k, val []byte, wo *pebble.WriteOptions) error {
	if err := g.Usable(); err != nil {
		return err
	}
	b := g.DB.NewBatch()
	_ = b.Set(k, val, nil) // errors only on a closed batch
	return g.commitOwn(b, wo)
}

func (g *GuardedDB) Delete(k []byte, wo *pebble.WriteOptions) error {
	if err := g.Usable(); err != nil {
		return err
	}
	b := g.DB.NewBatch()
	_ = b.Delete(k, nil)
	return g.commitOwn(b, wo)
}

func (g *GuardedDB) DeleteRange(lo, hi []byte, wo *pebble.WriteOptions) error {
	if err := g.Usable(); err != nil {
		return err
	}
	b := g.DB.NewBatch()
	_ = b.DeleteRange(lo, hi, nil)
	return g.commitOwn(b, wo)
}

// LogData writes an empty record to the WAL (with wo.Sync: syncs it).
func (g *GuardedDB) LogData(wo *pebble.WriteOptions) error {
	if err := g.Usable(); err != nil {
		return err
	}
	b := g.DB.NewBatch()
	_ = b.LogData(nil, nil)
	return g.commitOwn(b, wo)
}

func (g *GuardedDB) commitOwn(b *pebble.Batch, wo *pebble.WriteOptions) error {
	err := g.Commit(b, wo)
	g.CloseBatch(b)
	return err
}

// Get is DB.Get; the closer is nil when err is not.
func (g *GuardedDB) Get(k []byte) (val []byte, c io.Closer, err error) {
	if err := g.Usable(); err != nil {
		return nil, nil, err
	}
	defer g.Log.Catch(&err)
	return g.DB.Get(k)
}

func (g *GuardedDB) NewIter(o *pebble.IterOptions) (it *pebble.Iterator, err error) {
	if err := g.Usable(); err != nil {
		return nil, err
	}
	defer g.Log.Catch(&err)
	return g.DB.NewIter(o)
}

// A volume's calls into its DB (v.g, set when the DB opens).
func (v *volume) commit(b *pebble.Batch, wo *pebble.WriteOptions) error { return v.g.Commit(b, wo) }
func (v *volume) set(k, val []byte, wo *pebble.WriteOptions) error      { return v.g.Set(k, val, wo) }
func (v *volume) deleteRange(lo, hi []byte, wo *pebble.WriteOptions) error {
	return v.g.DeleteRange(lo, hi, wo)
}
func (v *volume) logData(wo *pebble.WriteOptions) error                   { return v.g.LogData(wo) }
func (v *volume) closeBatch(b *pebble.Batch)                              { v.g.CloseBatch(b) }
func (v *volume) get(k []byte) ([]byte, io.Closer, error)                 { return v.g.Get(k) }
func (v *volume) newIter(o *pebble.IterOptions) (*pebble.Iterator, error) { return v.g.NewIter(o) }

// guardVolume runs a storage background goroutine's body for volume v: a
// panic in it (a Fatalf of v's DB, or a bug) fails v instead of the
// process, with the stack logged.
func (s *Store) guardVolume(v *volume, what string) {
	p := recover()
	if p == nil {
		return
	}
	if fp, ok := p.(fatalPanic); ok && fp.l == v.log {
		return // v is wedged already
	}
	err := fmt.Errorf("storage: panic in %s: %v", what, p)
	s.opts.Logf("storage: volume %s FAILED: panic in %s: %v\n%s", v.path, what, p, debug.Stack())
	s.panicVolume(v, err)
}

// panicVolume fails v for a panic on one of its storage goroutines (the
// caller logged it with its stack): counted and reported newly failed once,
// as a fatal error is, and v's DB is wedged, because a panic that unwound
// through Pebble (its own panic(err) on a WAL error) may have left its
// locks held: a later call, or Close, would block on them for good.
func (s *Store) panicVolume(v *volume, err error) {
	v.setWedged(err)
	if v.fatalLogged.CompareAndSwap(false, true) {
		s.volumeFatals.Add(1)
	}
	v.fail(err, func(string, ...any) {})
}

// CloseDB closes db (whose logger is l) unless it is or becomes wedged
// (wedged reports it): a wedged DB's Close waits forever for a flush or
// compaction that Fatalf ended, or for a commit stalled behind it. Close
// runs on its own goroutine, polled: if the DB is wedged meanwhile (a
// background job failed after Close began) it is left to the process exit,
// with its files and LOCK, and CloseDB returns nil.
func CloseDB(db *pebble.DB, l *FatalLogger, wedged func() bool) error {
	if wedged() {
		return nil
	}
	done := make(chan error, 1)
	go func() {
		var err error
		defer func() { done <- err }()
		defer l.Catch(&err) // a Fatalf in Close is our goroutine's
		err = db.Close()
	}()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case err := <-done:
			return err
		case <-t.C:
			if wedged() {
				return nil
			}
		}
	}
}

// waitUnlessWedged waits for done unless v is or becomes wedged (a
// goroutine stalled inside v's wedged DB never ends).
func waitUnlessWedged(done <-chan struct{}, wedged func() bool) {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			if wedged() {
				return
			}
		}
	}
}
