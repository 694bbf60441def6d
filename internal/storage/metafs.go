package storage

import (
	"fmt"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"github.com/cockroachdb/pebble/v2"
	pvfs "github.com/cockroachdb/pebble/v2/vfs"
)

// The WAL and MANIFEST of a volume's metadata store go through a FatalLogger's
// file system wrapper (WrapFS), because Pebble (v2.1.7) does not always turn
// an I/O error on them into a Fatalf:
//
//   - A failed write or sync of the WAL on a NoSync commit (the apply loop's
//     PutBlockDeferred before its SyncCommitsFor) is seen only by the
//     LogWriter's flusher goroutine, which keeps it (sticky) and returns it to
//     no one; the next memtable rotation's rotateWAL then gets it from
//     LogWriter.Close and calls panic(err) with DB.mu released, and the
//     deferred DB.mu.Unlock of its caller throws "sync: unlock of unlocked
//     mutex": an unrecoverable runtime fatal error that kills the process.
//     The close's own sync, or the new WAL's create, can also be the first to
//     fail there.
//   - The next WriteRecord after the flusher's error makes commitWrite call
//     panic(err) on the committing goroutine (commitPipeline.mu held).
//
// So the wrapper wedges the volume (OnFatal) at the FIRST error of a write,
// sync, stat or close of a WAL or MANIFEST file, of their creation
// or of a sync of the DB directory, before
// Pebble sees it: every later call into the volume's DB is refused by the
// guards. For a call already inside the DB when that happens:
//
//   - a rotateWAL that meets the error (or any WAL file operation after it)
//     re-locks DB.mu, which Pebble released, and raises a Fatalf there: the
//     unwinding's deferred DB.mu.Unlock is then balanced, and the Fatalf
//     becomes the caller's ErrVolumeFailed (our goroutine) or ends Pebble's
//     goroutine (the delayed-flush timer, which rotates too). DB.mu is found
//     by reflection (dbMutex); if a Pebble upgrade moves it, that rotation
//     aborts the process as before (TestDBMutexFound fails first);
//   - commitWrite's raw panic(err) is caught by Catch as a fatal error of
//     the volume.
//
// Both unwind through commitPipeline.prepare (a commit's rotation runs in
// it), leaving commitPipeline.mu locked and the batch pending, never
// published: a commit of another goroutine that had passed the guard's
// check would wait for good for that lock, or for its publish behind the
// dead batch (releasing the mutex would not unblock it). Its caller does
// not: GuardedDB returns it on the wedge and abandons its committer
// (fatal.go; ARCHITECTURE, "A write inside a DB when it wedges returns").
//
// The cost on the hot path is one more method call per WAL write and sync
// (BenchmarkSyncRoundMem, docs/BENCHMARKS.md).

// WrapFS returns fs with the WAL and MANIFEST files watched for l (see
// above). Call SetDB once the DB is open.
func (l *FatalLogger) WrapFS(fs pvfs.FS) pvfs.FS { return &fatalFS{FS: fs, l: l} }

// SetDB tells l the DB whose WAL it watches (for its DB.mu).
func (l *FatalLogger) SetDB(db *pebble.DB) { l.dbMu.Store(dbMutex(db)) }

// dbMutex returns db's DB.mu (the unexported mu.Mutex of pebble.DB), or nil
// if this Pebble has no such field.
func dbMutex(db *pebble.DB) *sync.Mutex {
	if db == nil {
		return nil
	}
	mu := reflect.ValueOf(db).Elem().FieldByName("mu")
	if !mu.IsValid() || mu.Kind() != reflect.Struct {
		return nil
	}
	m := mu.FieldByName("Mutex")
	if !m.IsValid() || m.Type() != reflect.TypeOf(sync.Mutex{}) {
		return nil
	}
	return (*sync.Mutex)(unsafe.Pointer(m.UnsafeAddr()))
}

// watchedFile reports whether name is a WAL or MANIFEST file.
func watchedFile(name string) (string, bool) {
	base := filepath.Base(name)
	switch {
	case strings.HasSuffix(base, ".log"):
		return "WAL", true
	case strings.HasPrefix(base, "MANIFEST"):
		return "MANIFEST", true
	}
	return "", false
}

// metaIO is the outcome of an operation on a watched file: a first error
// wedges the volume; inside rotateWAL after any error it raises a Fatalf
// with DB.mu re-locked (it does not return).
func (l *FatalLogger) metaIO(kind, op string, err error) error {
	if err != nil && l.ioErr.CompareAndSwap(nil, &FatalError{Msg: fmt.Sprintf("%s %s failed: %v", kind, op, err)}) {
		l.OnFatal(l.ioErr.Load())
	}
	if l.ioErr.Load() != nil && inRotateWAL() {
		if mu := l.dbMu.Load(); mu != nil {
			mu.Lock() // rotateWAL released it; its caller's defer unlocks it
			l.Fatalf("WAL rotation after an I/O error: %v", l.ioErr.Load().Msg)
		}
	}
	return err
}

// inRotateWAL reports whether the calling goroutine is inside Pebble's
// DB.rotateWAL (where DB.mu is released around every file operation).
func inRotateWAL() bool {
	pcs := make([]uintptr, 64)
	n := runtime.Callers(3, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	for {
		fr, more := frames.Next()
		if strings.HasSuffix(fr.Function, "pebble/v2.(*DB).rotateWAL") {
			return true
		}
		if !more {
			return false
		}
	}
}

type fatalFS struct {
	pvfs.FS
	l *FatalLogger
}

func (f *fatalFS) watch(file pvfs.File, name string, err error) (pvfs.File, error) {
	kind, ok := watchedFile(name)
	if !ok {
		return file, err
	}
	if err := f.l.metaIO(kind, "create", err); err != nil {
		return nil, err
	}
	return &fatalFile{File: file, l: f.l, kind: kind}, nil
}

func (f *fatalFS) Create(name string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	file, err := f.FS.Create(name, c)
	return f.watch(file, name, err)
}

// OpenDir: the DB directory, whose sync makes a new WAL's (and the
// MANIFEST's) entry durable, inside rotateWAL among others.
func (f *fatalFS) OpenDir(name string) (pvfs.File, error) {
	file, err := f.FS.OpenDir(name)
	if err := f.l.metaIO("directory", "open", err); err != nil {
		return nil, err
	}
	return &fatalFile{File: file, l: f.l, kind: "directory"}, nil
}

func (f *fatalFS) ReuseForWrite(oldname, newname string, c pvfs.DiskWriteCategory) (pvfs.File, error) {
	file, err := f.FS.ReuseForWrite(oldname, newname, c)
	return f.watch(file, newname, err)
}

type fatalFile struct {
	pvfs.File
	l    *FatalLogger
	kind string
}

func (f *fatalFile) Write(p []byte) (int, error) {
	n, err := f.File.Write(p)
	if err != nil {
		err = f.l.metaIO(f.kind, "write", err)
	}
	return n, err
}

func (f *fatalFile) WriteAt(p []byte, off int64) (int, error) {
	n, err := f.File.WriteAt(p, off)
	if err != nil {
		err = f.l.metaIO(f.kind, "write", err)
	}
	return n, err
}

// Preallocate is not watched: Pebble ignores its error (a failed
// preallocation is no failed write; TestDiskFullTmpfs meets one).

func (f *fatalFile) Stat() (pvfs.FileInfo, error) {
	fi, err := f.File.Stat()
	if err != nil {
		err = f.l.metaIO(f.kind, "stat", err)
	}
	return fi, err
}

func (f *fatalFile) Sync() error {
	err := f.File.Sync()
	if err != nil || f.l.ioErr.Load() != nil {
		err = f.l.metaIO(f.kind, "sync", err)
	}
	return err
}

func (f *fatalFile) SyncData() error {
	err := f.File.SyncData()
	if err != nil || f.l.ioErr.Load() != nil {
		err = f.l.metaIO(f.kind, "sync", err)
	}
	return err
}

func (f *fatalFile) SyncTo(length int64) (bool, error) {
	full, err := f.File.SyncTo(length)
	if err != nil || f.l.ioErr.Load() != nil {
		err = f.l.metaIO(f.kind, "sync", err)
	}
	return full, err
}

func (f *fatalFile) Close() error {
	err := f.File.Close()
	if err != nil || f.l.ioErr.Load() != nil {
		err = f.l.metaIO(f.kind, "close", err)
	}
	return err
}
