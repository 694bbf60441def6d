package storage

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// A failing disk takes out its volume, not the datanode (fatal.go): a
// fatal error of one volume's Pebble DB (on our goroutine or on Pebble's
// own) or a panic on a storage goroutine fails that volume; the other
// volume goes on, nothing after the failure is acknowledged from the
// failed one, and a restart on a healthy disk finds what was durable.

const (
	fatalVol1 = "/v1"
	fatalVol2 = "/v2"
)

// fatalRig is a two-volume store on a crashable FS with fault injection.
type fatalRig struct {
	cfs  *crashFS
	ffs  *vfs.FaultFS
	s    *Store
	o    Options
	mu   sync.Mutex
	logs []string
}

func newFatalRig(t *testing.T) *fatalRig {
	t.Helper()
	r := &fatalRig{cfs: newCrashFS()}
	r.ffs = vfs.NewFaultFS(r.cfs)
	target := fatalVol1
	r.o = Options{Volumes: []string{fatalVol1, fatalVol2}, FS: r.ffs, ContainerSize: 64 << 20, KeepUncommitted: true,
		// Containers 1.. go to /v1, 101.. to /v2 (see create).
		AvoidVolume: func(p string) bool { return p != target },
		Logf: func(f string, a ...any) {
			r.mu.Lock()
			r.logs = append(r.logs, fmt.Sprintf(f, a...))
			r.mu.Unlock()
		}}
	s, err := Open(r.o)
	if err != nil {
		t.Fatal(err)
	}
	r.s = s
	for _, cid := range []ContainerID{1, 101} {
		target = fatalVol1
		if cid > 100 {
			target = fatalVol2
		}
		mustCreate(t, s, cid)
		if rep, _ := s.Container(cid); rep.Volume != target {
			t.Fatalf("container %d on %s, want %s", cid, rep.Volume, target)
		}
	}
	return r
}

// logged counts the log lines containing sub.
func (r *fatalRig) logged(sub string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, l := range r.logs {
		if strings.Contains(l, sub) {
			n++
		}
	}
	return n
}

// closeWithin closes the store, failing if Close blocks (a wedged DB's
// Close waits forever).
func (r *fatalRig) closeWithin(t *testing.T, d time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { r.s.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("Close still blocked after %v", d)
	}
}

// waitFailed waits until volume i reads as failed.
func waitFailed(t *testing.T, s *Store, i int, d time.Duration) VolumeReport {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		vr := s.Volumes()[i]
		if vr.Failed {
			return vr
		}
		if time.Now().After(deadline) {
			t.Fatalf("volume %s not failed after %v", vr.Path, d)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// checkSurvivor checks volume 2 still takes writes and serves reads, and
// volume 1 refuses both, with its containers reported UNHEALTHY.
func checkSurvivor(t *testing.T, s *Store, lid LocalID) {
	t.Helper()
	data := blockBytes(101, lid, 96<<10)
	writeBlock(t, s, 101, lid, data, 32<<10, DefaultChecksum, uint64(lid))
	if err := s.Sync(); err != nil && !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("Sync: %v", err)
	}
	if err := s.SyncContainers([]ContainerID{101}); err != nil {
		t.Fatalf("SyncContainers on the healthy volume: %v", err)
	}
	checkBlock(t, s, 101, lid, data)
	checkBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10))
	if _, err := s.ReadChunk(1, 1, 0, 10); !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("read on the failed volume: %v, want ErrVolumeFailed", err)
	}
	if _, err := tryWriteBlock(s, 1, lid, blockBytes(1, lid, 4096), 4096, DefaultChecksum, uint64(lid)); !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("write on the failed volume: %v, want ErrVolumeFailed", err)
	}
	if rep, err := s.Container(1); err != nil || rep.State != StateUnhealthy {
		t.Fatalf("container 1 on the failed volume: %v %v, want UNHEALTHY", rep.State, err)
	}
	if vr := s.Volumes()[1]; vr.Failed {
		t.Fatalf("healthy volume reads as failed: %v", vr.Error)
	}
}

// reopen opens a store on what a power loss leaves of the disks, with no
// faults, and checks the durable blocks of both volumes.
func (r *fatalRig) reopen(t *testing.T, durable1 []LocalID, lost1 []LocalID, durable2 []LocalID) {
	t.Helper()
	o := r.o
	o.FS = r.cfs.Crash()
	o.Logf = nil
	s, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, vr := range s.Volumes() {
		if vr.Failed {
			t.Fatalf("volume %s failed after the restart: %s", vr.Path, vr.Error)
		}
	}
	for _, lid := range durable1 {
		checkBlock(t, s, 1, lid, blockBytes(1, lid, 96<<10))
	}
	for _, lid := range lost1 {
		if _, err := s.GetBlock(1, lid); !errors.Is(err, ErrBlockNotFound) {
			t.Fatalf("block 1/%d, whose commit failed, after the restart: %v", lid, err)
		}
	}
	for _, lid := range durable2 {
		checkBlock(t, s, 101, lid, blockBytes(101, lid, 96<<10))
	}
	// The recovered volume takes writes again.
	writeBlock(t, s, 1, 50, blockBytes(1, 50, 96<<10), 32<<10, DefaultChecksum, 50)
}

// TestVolumeFatalWALSync: the WAL sync of volume 1's DB fails (EIO), so
// Pebble's commit pipeline calls Fatalf on the committing goroutine. The
// commit in flight gets ErrVolumeFailed (the old logger panicked there,
// taking the process down), volume 1 reads as failed with the cause,
// volume 2 goes on, and a restart recovers volume 1's durable blocks.
func TestVolumeFatalWALSync(t *testing.T) {
	r := newFatalRig(t)
	s := r.s
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	writeBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	r.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, fatalVol1+"/basalt/meta/") && strings.HasSuffix(path, ".log") {
			return unix.EIO
		}
		return nil
	})
	// The block's chunks sync (block files are fine); its PutBlock's WAL
	// sync fails.
	_, err := tryWriteBlock(s, 1, 2, blockBytes(1, 2, 96<<10), 32<<10, DefaultChecksum, 2)
	if !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("write whose WAL sync failed: %v, want ErrVolumeFailed", err)
	}
	vr := waitFailed(t, s, 0, 10*time.Second)
	if !strings.Contains(vr.Error, "fatal") || !strings.Contains(vr.Error, "input/output error") {
		t.Fatalf("volume 1's error %q does not give the cause", vr.Error)
	}
	if !s.volumes[0].wedged.Load() {
		t.Fatal("volume 1 not wedged")
	}
	if n := s.VolumeFatals(); n != 1 {
		t.Fatalf("VolumeFatals = %d, want 1", n)
	}
	if n := r.logged("metadata store met a fatal error"); n != 1 {
		t.Fatalf("fatal error logged %d times, want once", n)
	}
	// The next health check reports it newly failed, once (a datanode
	// then logs it at ERROR, reports soon and closes its replicas).
	for round, want := range []bool{true, false} {
		res := s.CheckVolumes(10 * time.Second)
		if !res[0].Failed || res[0].NewlyFailed != want || res[1].Failed {
			t.Fatalf("check %d: %+v, want volume 1 failed (newly: %v), volume 2 not", round, res, want)
		}
	}
	checkSurvivor(t, s, 2)
	// More commits on volume 1 never reach its DB.
	if _, err := s.GetBlock(1, 1); !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("GetBlock on the failed volume: %v", err)
	}
	if n := r.logged("metadata store met a fatal error"); n != 1 {
		t.Fatalf("fatal error logged %d times, want once", n)
	}
	r.closeWithin(t, 30*time.Second)
	r.ffs.SetInject(nil)
	r.reopen(t, []LocalID{1}, []LocalID{2}, []LocalID{1, 2})
}

// TestVolumeFatalDeferredWAL: the apply loop's group commit (NoSync
// PutBlockDeferred, then SyncCommits) on volume 1 while its WAL's sync or
// write fails (EIO). No synced commit runs, so Pebble's "fatal commit error"
// is not what meets it: the LogWriter's flusher keeps the error, and the
// next memtable rotation's rotateWAL panicked with DB.mu released ("sync:
// unlock of unlocked mutex", a runtime fatal error: review finding 1).
// Now the first error wedges the volume (metafs.go): the batch's
// PutBlockDeferred gets ErrVolumeFailed, SyncCommits fails (nothing after
// the error is acknowledged), volume 2 goes on, and a restart recovers.
func TestVolumeFatalDeferredWAL(t *testing.T) {
	for _, op := range []string{"sync", "write", "dirsync"} {
		t.Run(op, func(t *testing.T) {
			r := newFatalRig(t)
			s := r.s
			writeBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10), 32<<10, DefaultChecksum, 1)
			// Blocks whose chunks are durable; their PutBlocks come
			// after the fault. Small chunks: many records, so
			// memtables (which start small) rotate often.
			const n, nch = 300, 32
			bds := make([]BlockData, 0, n)
			for lid := LocalID(1001); lid < 1001+n; lid++ {
				data := blockBytes(1, lid, 1024*nch)
				bd := BlockData{LocalID: lid, Length: int64(len(data)), BCSID: uint64(lid)}
				for off := 0; off < len(data); off += 1024 {
					p := data[off : off+1024]
					sum := DefaultChecksum.Compute(p)
					if err := s.WriteChunk(1, lid, int64(off), p, sum, true); err != nil {
						t.Fatal(err)
					}
					bd.Chunks = append(bd.Chunks, ChunkInfo{Offset: int64(off), Length: 1024, Checksum: sum})
				}
				bds = append(bds, bd)
			}
			if err := s.SyncContainers([]ContainerID{1, 101}); err != nil {
				t.Fatal(err)
			}
			r.ffs.SetInject(func(o, path string) error {
				if o == op && strings.HasPrefix(path, fatalVol1+"/basalt/meta/") && strings.HasSuffix(path, ".log") {
					return unix.EIO
				}
				// The DB directory's sync: a rotation syncs it for
				// the new WAL's entry.
				if op == "dirsync" && o == "syncdir" && path == fatalVol1+"/basalt/meta" {
					return unix.EIO
				}
				return nil
			})
			// A commit already inside Pebble when another goroutine's
			// commit (the deferred-write flusher's) rotates the WAL into
			// the error used to wait for good: the rotation's Fatalf (or
			// Pebble's raw panic) unwinds through commitPipeline.prepare,
			// leaving the pipeline's mutex held and its batch pending.
			// Now the guard returns it on the wedge (GuardedDB): the loop
			// must end within 2 s of the volume's wedge, and a loop
			// blocked with the volume not wedged fails too.
			var perr error
			putDone := make(chan error, 1)
			go func() {
				var err error
				for _, bd := range bds {
					if err = s.PutBlockDeferred(1, bd); err != nil {
						break
					}
				}
				putDone <- err
			}()
			tick := time.NewTicker(20 * time.Millisecond)
			giveUp, grace := time.Now().Add(60*time.Second), time.Time{}
		wait:
			for {
				select {
				case perr = <-putDone:
					t.Logf("PutBlockDeferred: %v", perr)
					break wait
				case <-tick.C:
				}
				now := time.Now()
				if grace.IsZero() && s.volumes[0].wedged.Load() {
					grace = now.Add(2 * time.Second)
				}
				if !grace.IsZero() && now.After(grace) {
					t.Fatal("PutBlockDeferred still blocked 2 s after volume 1 was wedged")
				}
				if now.After(giveUp) {
					t.Fatal("PutBlockDeferred blocked for 60 s and volume 1 not wedged")
				}
			}
			tick.Stop()
			t.Logf("writes abandoned in the wedged DB: %d (still stuck: %d)", s.volumes[0].log.Abandoned(), s.volumes[0].log.Stuck())
			// (On the zoned backend's suite the records may all fit
			// in the memtable: then SyncCommits is the first to meet
			// the error.)
			if perr != nil && !errors.Is(perr, ErrVolumeFailed) {
				t.Fatalf("PutBlockDeferred on a volume whose WAL %s fails: %v, want ErrVolumeFailed", op, perr)
			}
			if op == "dirsync" && perr == nil {
				// No rotation (the zoned backend's suite): no new WAL,
				// no directory sync met.
				r.closeWithin(t, 30*time.Second)
				t.Skip("no WAL rotation: the directory sync was not reached")
			}
			if err := s.SyncCommits(); !errors.Is(err, ErrVolumeFailed) {
				t.Fatalf("SyncCommits after the WAL error: %v, want ErrVolumeFailed", err)
			}
			vr := waitFailed(t, s, 0, 10*time.Second)
			want := "WAL " + op + " failed"
			if op == "dirsync" {
				want = "directory sync failed"
			}
			if !strings.Contains(vr.Error, want) || !strings.Contains(vr.Error, "input/output error") {
				t.Fatalf("volume 1's error %q does not give the cause", vr.Error)
			}
			if !s.volumes[0].wedged.Load() {
				t.Fatal("volume 1 not wedged")
			}
			if n := s.VolumeFatals(); n != 1 {
				t.Fatalf("VolumeFatals = %d, want 1", n)
			}
			checkSurvivor(t, s, 2)
			r.closeWithin(t, 30*time.Second)
			r.ffs.SetInject(nil)
			r.reopen(t, nil, nil, []LocalID{1, 2})
		})
	}
}

// TestVolumeFatalManifestSync: volume 1's MANIFEST sync fails during a
// flush, on Pebble's own flush goroutine, where a panic cannot be
// recovered (the old logger took the process down). Fatalf fails the
// volume and ends that goroutine; volume 2 goes on, Close does not wait
// for the flush that never finishes, and a restart replays volume 1's WAL.
func TestVolumeFatalManifestSync(t *testing.T) {
	r := newFatalRig(t)
	s := r.s
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	writeBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	r.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, fatalVol1+"/basalt/meta/MANIFEST") {
			return unix.EIO
		}
		return nil
	})
	if _, err := s.volumes[0].db.AsyncFlush(); err != nil { // the flush runs on Pebble's goroutine
		t.Fatal(err)
	}
	vr := waitFailed(t, s, 0, 30*time.Second)
	if !strings.Contains(vr.Error, "MANIFEST sync failed") {
		t.Fatalf("volume 1's error %q does not give the cause", vr.Error)
	}
	if n := s.VolumeFatals(); n != 1 {
		t.Fatalf("VolumeFatals = %d, want 1", n)
	}
	checkSurvivor(t, s, 2)
	r.closeWithin(t, 30*time.Second)
	r.ffs.SetInject(nil)
	r.reopen(t, []LocalID{1}, nil, []LocalID{1, 2})
}

// TestVolumeFatalBackgroundPanic: a panic on the deferred-write flusher of
// volume 1 (a storage goroutine: it used to take the process down) fails
// volume 1 only; its deferred writes stay in its WAL for the next Open.
func TestVolumeFatalBackgroundPanic(t *testing.T) {
	posixOnly(t) // deferred writes are the posix backend's
	r := newFatalRig(t)
	s := r.s
	writeBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	hook := func() { panic("injected panic in the flusher") }
	s.volumes[0].defer_.afterSync.Store(&hook)
	small := blockBytes(1, 3, 4<<10)
	sum := DefaultChecksum.Compute(small)
	if err := s.WriteChunk(1, 3, 0, small, sum, true); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil { // durable in the WAL: a deferred write
		t.Fatal(err)
	}
	if err := s.PutBlock(1, BlockData{LocalID: 3, Length: int64(len(small)), BCSID: 3,
		Chunks: []ChunkInfo{{Offset: 0, Length: int64(len(small)), Checksum: sum}}}); err != nil {
		t.Fatal(err)
	}
	vr := waitFailed(t, s, 0, 30*time.Second) // the flusher runs every 500 ms
	if !strings.Contains(vr.Error, "injected panic") {
		t.Fatalf("volume 1's error %q does not give the cause", vr.Error)
	}
	if n := r.logged("injected panic"); n != 1 {
		t.Fatalf("panic logged %d times, want once", n)
	}
	if n := s.VolumeFatals(); n != 1 {
		t.Fatalf("VolumeFatals = %d, want 1", n)
	}
	checkSurvivor(t, s, 2)
	r.closeWithin(t, 30*time.Second)
	o := r.o
	o.FS = r.cfs.Crash()
	o.Logf = nil
	s2, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	checkBlock(t, s2, 1, 3, small)
	checkBlock(t, s2, 1, 1, blockBytes(1, 1, 96<<10))
}

// BenchmarkVolumeGuard measures what the guard of a call into a volume's
// DB (the wedged check and the deferred Catch) adds to a Get and to a
// NoSync Set, against the same calls made directly.
func BenchmarkVolumeGuard(b *testing.B) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	v := s.volumes[0]
	key := makeKey(1, kindBlock, 1)
	val := make([]byte, 64)
	if err := v.db.Set(key, val, pebble.NoSync); err != nil {
		b.Fatal(err)
	}
	b.Run("get/direct", func(b *testing.B) {
		for range b.N {
			_, c, err := v.db.Get(key)
			if err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
	b.Run("get/guarded", func(b *testing.B) {
		for range b.N {
			_, c, err := v.get(key)
			if err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
	b.Run("set/direct", func(b *testing.B) {
		for range b.N {
			if err := v.db.Set(key, val, pebble.NoSync); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("set/guarded", func(b *testing.B) {
		for range b.N {
			if err := v.set(key, val, pebble.NoSync); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestDBMutexFound: dbMutex finds pebble.DB's DB.mu (metafs.go re-locks it
// for a failed WAL rotation); if a Pebble upgrade moves it, this fails
// before a failing disk would abort the process.
func TestDBMutexFound(t *testing.T) {
	db, err := pebble.Open("", &pebble.Options{FS: pvfs.NewMem()})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	mu := dbMutex(db)
	if mu == nil {
		t.Fatal("pebble.DB has no mu.Mutex")
	}
	mu.Lock()
	done := make(chan struct{})
	go func() { db.Metrics(); close(done) }() // takes DB.mu
	select {
	case <-done:
		t.Fatal("DB.Metrics ran while the mutex found was held: it is not DB.mu")
	case <-time.After(50 * time.Millisecond):
	}
	mu.Unlock()
	<-done
}

// TestVolumeFatalDuringClose: a flush already running when Close begins
// fails its MANIFEST sync (slowly: a dying disk) and ends by Fatalf, after
// Close checked the volume. Pebble's Close would wait for that flush
// forever; Close gives up on the DB once it is wedged, and holds no store
// lock meanwhile (review finding 3).
func TestVolumeFatalDuringClose(t *testing.T) {
	r := newFatalRig(t)
	s := r.s
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	writeBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	r.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, fatalVol1+"/basalt/meta/MANIFEST") {
			<-release
			return unix.EIO
		}
		return nil
	})
	if _, err := s.volumes[0].db.AsyncFlush(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { s.Close(); close(done) }()
	// Close reaches the DB while the flush waits on its sync; the store
	// lock is not held meanwhile.
	deadline := time.Now().Add(10 * time.Second)
	closing := func() bool {
		if !s.mu.TryRLock() {
			return true
		}
		defer s.mu.RUnlock()
		return s.closed
	}
	for !closing() {
		if time.Now().After(deadline) {
			t.Fatal("Close did not start")
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	if s.volumes[0].wedged.Load() {
		t.Fatal("wedged before the sync failed")
	}
	vols := make(chan []VolumeReport, 1)
	go func() { vols <- s.Volumes() }()
	select {
	case <-vols:
	case <-time.After(10 * time.Second):
		t.Fatal("Volumes blocked while Close waits on a DB")
	}
	close(release)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close blocked on a DB wedged while it closed")
	}
	if !s.volumes[0].wedged.Load() {
		t.Fatal("volume 1 not wedged")
	}
}

// TestVolumeGuardsRefuseWedged: each call into a volume's DB refuses a
// wedged DB (ErrVolumeFailed) without touching it, whatever the caller
// checked before (the deferrer's commit and SyncCommits reach the DB without
// Store.container's failed check). Fails if the guards' wedged check goes
// (review nit 8).
func TestVolumeGuardsRefuseWedged(t *testing.T) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	v := s.volumes[0]
	v.setWedged(&FatalError{Msg: "test wedge"})
	k := []byte("\xffguard-test")
	b := v.db.NewBatch()
	b.Set(k, []byte("b"), nil)
	calls := map[string]error{
		"commit":      v.commit(b, pebble.Sync),
		"set":         v.set(k, []byte("s"), pebble.Sync),
		"deleteRange": v.deleteRange(k, append(k, 0), pebble.Sync),
		"logData":     v.logData(pebble.Sync),
	}
	_, _, calls["get"] = v.get(k)
	_, calls["newIter"] = v.newIter(nil)
	b.Close()
	for name, err := range calls {
		if !errors.Is(err, ErrVolumeFailed) {
			t.Errorf("%s on a wedged DB: %v, want ErrVolumeFailed", name, err)
		}
	}
	v.wedged.Store(false)
	if _, c, err := v.db.Get(k); err == nil {
		c.Close()
		t.Error("a write reached the wedged DB")
	}
}

// TestVolumeFatalCauseFirst: a request that meets volume 1's wedge while
// the goroutine that wedged it has not yet recorded the cause (the hook
// runs there, on Pebble's flush goroutine, after the wedged flag is set)
// fails the volume with the cause, never with a bare "volume wedged": an
// operator sees the first error. Under load the race did happen
// (TestVolumeFatalDeferredWAL, volume 1's error "pebble fatal error:
// volume wedged"); the hook makes it deterministic.
func TestVolumeFatalCauseFirst(t *testing.T) {
	r := newFatalRig(t)
	s := r.s
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	met := make(chan error, 1)
	s.SetTestHook(func(p string) {
		if p != "wedged" {
			return
		}
		once.Do(func() {
			// A lookup that reaches the DB guard (no cached record).
			_, err := s.GetBlock(1, 999)
			met <- err
		})
	})
	r.ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, fatalVol1+"/basalt/meta/MANIFEST") {
			return unix.EIO
		}
		return nil
	})
	if _, err := s.volumes[0].db.AsyncFlush(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-met:
		if !errors.Is(err, ErrVolumeFailed) {
			t.Fatalf("GetBlock on the volume being wedged: %v, want ErrVolumeFailed", err)
		}
		if !strings.Contains(err.Error(), "MANIFEST sync failed") {
			t.Errorf("GetBlock's error %q does not give the cause", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("volume 1 not wedged after 30 s")
	}
	vr := waitFailed(t, s, 0, 10*time.Second)
	if !strings.Contains(vr.Error, "MANIFEST sync failed") || strings.Contains(vr.Error, "volume wedged") {
		t.Fatalf("volume 1's error %q does not give the cause", vr.Error)
	}
	if n := s.VolumeFatals(); n != 1 {
		t.Fatalf("VolumeFatals = %d, want 1", n)
	}
	// The hook stays set (runs once): a later flush's Fatalf may still
	// reach it.
	r.closeWithin(t, 30*time.Second)
}

// TestVolumeFatalCommitInFlight: commits queued inside volume 1's DB when
// it wedges return ErrVolumeFailed at once (GuardedDB). Commit A carries a
// batch bigger than the memtable, so its commitWrite rotates the WAL inside
// commitPipeline.prepare (the pipeline's mutex held, taken without defer);
// the rotation's directory sync blocks until commits B (synced and not)
// wait on that mutex, then fails (EIO). The wrapper wedges the volume and
// raises a Fatalf in rotateWAL (metafs.go), which unwinds through prepare
// and leaves the mutex locked: before the escape, every B waited for good
// (the hang TestVolumeFatalDeferredWAL tolerated in session 17). Each
// caller must return within 2 s; the B goroutines stay stuck in Pebble and
// are counted (Stuck).
func TestVolumeFatalCommitInFlight(t *testing.T) {
	r := newFatalRig(t)
	s := r.s
	v := s.volumes[0]
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	writeBlock(t, s, 101, 1, blockBytes(101, 1, 96<<10), 32<<10, DefaultChecksum, 1)
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	// Goroutines left in an earlier run's wedged DB (-count) stay counted.
	before := inCommitPipeline()
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.ffs.SetInject(func(op, path string) error {
		if op == "syncdir" && path == fatalVol1+"/basalt/meta" {
			first := false
			once.Do(func() { first = true; close(entered) })
			if !first {
				return unix.EIO
			}
			<-release
			return unix.EIO
		}
		return nil
	})
	const nB = 4
	errs := make(chan error, 1+nB)
	big := make([]byte, pebbleMemTableSize)
	go func() { errs <- v.set([]byte("\xffin-flight/a"), big, pebble.NoSync) }()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("commit A's rotation did not reach the directory sync")
	}
	for i := range nB {
		wo := pebble.Sync
		if i%2 == 1 {
			wo = pebble.NoSync
		}
		k := fmt.Appendf(nil, "\xffin-flight/b%d", i)
		go func() {
			b := v.db.NewBatch()
			b.Set(k, []byte("b"), nil)
			err := v.commit(b, wo)
			v.closeBatch(b)
			errs <- err
		}()
	}
	// Every B is inside Pebble's commit pipeline (waiting on its mutex,
	// which A holds) before A's sync fails.
	deadline := time.Now().Add(30 * time.Second)
	for inCommitPipeline()-before < 1+nB {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines in the commit pipeline, want %d", inCommitPipeline()-before, 1+nB)
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	timeout := time.After(2 * time.Second)
	for i := range 1 + nB {
		select {
		case err := <-errs:
			if !errors.Is(err, ErrVolumeFailed) || !strings.Contains(err.Error(), "directory sync failed") {
				t.Fatalf("commit %d in flight when the volume wedged: %v, want ErrVolumeFailed with the cause", i, err)
			}
		case <-timeout:
			t.Fatalf("%d of %d commits in flight still blocked 2 s after the volume wedged", 1+nB-i, 1+nB)
		}
	}
	// A returned by its own Fatalf; the Bs are left in Pebble, counted.
	if n := v.log.Abandoned(); n < nB || n > nB+1 {
		t.Errorf("Abandoned = %d, want %d or %d", n, nB, nB+1)
	}
	for v.log.Stuck() != nB {
		if time.Now().After(deadline) {
			t.Fatalf("Stuck = %d, want %d", v.log.Stuck(), nB)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if a, st := s.AbandonedWrites(); a != v.log.Abandoned() || st != nB {
		t.Errorf("AbandonedWrites = %d, %d; want %d, %d", a, st, v.log.Abandoned(), nB)
	}
	checkSurvivor(t, s, 2)
	r.closeWithin(t, 10*time.Second)
}

// inCommitPipeline counts the goroutines inside Pebble's commit pipeline.
func inCommitPipeline() int {
	buf := make([]byte, 4<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "pebble/v2.(*commitPipeline).Commit(")
}

// TestCloseBatchKeepsWedged: a batch of a wedged volume is not released to
// Pebble's batch pool (shared by every DB of the process) by closeBatch: a
// committer abandoned in the DB may still read it, and a batch taken from
// the pool by another volume would be overwritten under it. A healthy
// volume's batch is released as by Close. Fails if closeBatch is b.Close.
func TestCloseBatchKeepsWedged(t *testing.T) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	v := s.volumes[0]
	b := v.db.NewBatch()
	b.Set([]byte("k"), []byte("v"), nil)
	v.closeBatch(b)
	if b.Count() != 0 {
		t.Fatalf("healthy volume: batch not released (count %d)", b.Count())
	}
	b = v.db.NewBatch()
	b.Set([]byte("k"), []byte("v"), nil)
	v.setWedged(&FatalError{Msg: "test wedge"})
	v.closeBatch(b)
	if b.Count() != 1 || len(b.Repr()) == 0 {
		t.Fatalf("wedged volume: batch released (count %d): an abandoned commit may still read it", b.Count())
	}
}

// TestCommittersBounded: after a burst of concurrent commits, a DB keeps at
// most maxIdleCommitters committer goroutines (each that would be idle
// beyond it ends), and none after Close.
func TestCommittersBounded(t *testing.T) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	v := s.volumes[0]
	live := func() int {
		v.log.calls.mu.Lock()
		defer v.log.calls.mu.Unlock()
		return len(v.log.calls.all)
	}
	peak := 0
	for round := 0; round < 5; round++ {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range 512 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				b := v.db.NewBatch()
				b.Set(fmt.Appendf(nil, "k%d", i), []byte("v"), nil)
				if err := v.commit(b, pebble.Sync); err != nil {
					t.Error(err)
				}
				v.closeBatch(b)
			}()
		}
		close(start)
		wg.Wait()
		peak = max(peak, live())
	}
	deadline := time.Now().Add(2 * time.Second)
	for live() > maxIdleCommitters && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := live(); n > maxIdleCommitters {
		t.Fatalf("%d committers alive after the bursts, want at most %d", n, maxIdleCommitters)
	}
	t.Logf("committers: peak %d after a burst, %d after the bursts (bound %d)", peak, live(), maxIdleCommitters)
	s.Close()
	if n := live(); n != 0 {
		t.Fatalf("%d committers alive after Close", n)
	}
}

// TestQueuedCallSkipsWedgedDB: a write handed to a committer is not
// committed into a DB wedged before the committer started it, whether the
// wedge abandoned it while queued or the committer meets the wedge first,
// and neither counts as Abandoned or Stuck (it never was inside the DB).
func TestQueuedCallSkipsWedgedDB(t *testing.T) {
	for _, abandonFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("abandonFirst=%v", abandonFirst), func(t *testing.T) {
			s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			v := s.volumes[0]
			b := v.db.NewBatch()
			b.Set([]byte("queued"), []byte("v"), nil)
			c := &dbCall{b: b, wo: pebble.NoSync, done: make(chan struct{}, 1)}
			c.state.Store(callQueued)
			k := &committer{wake: make(chan *dbCall, 1)}
			cs := &v.log.calls
			cs.mu.Lock()
			k.at, k.cur = len(cs.all), c
			cs.all = append(cs.all, k)
			cs.mu.Unlock()
			if abandonFirst {
				v.setWedged(&FatalError{Msg: "test wedge"}) // AbandonWrites sees c queued
			} else {
				// The wedge lands after the committer took c, before it
				// commits: only the flag, as if AbandonWrites came later.
				v.wedgeErr.CompareAndSwap(nil, new(error))
				*v.wedgeErr.Load() = &FatalError{Msg: "test wedge"}
				v.wedged.Store(true)
			}
			g := &v.g
			g.runCall(k, c)
			<-c.done
			if _, closer, err := v.db.Get([]byte("queued")); err == nil {
				closer.Close()
				t.Fatal("a call queued before the wedge was committed into the wedged DB")
			}
			if abandonFirst && c.state.Load() != callAbandoned {
				t.Fatalf("state %d, want abandoned", c.state.Load())
			}
			if !abandonFirst && (c.state.Load() != callDone || !errors.Is(c.err, ErrVolumeFailed)) {
				t.Fatalf("state %d err %v, want done with ErrVolumeFailed", c.state.Load(), c.err)
			}
			if a, st := v.log.Abandoned(), v.log.Stuck(); a != 0 || st != 0 {
				t.Fatalf("Abandoned %d Stuck %d, want 0 0", a, st)
			}
		})
	}
}

// TestCommitPanicWedgesFirst: a commit that panics on its committer (not a
// Fatalf: here a nil batch) wedges the volume before the panic goes on on
// the caller, so the caller's deferred closeBatch, run while it unwinds,
// keeps the batch from Pebble's pool; the panic value carries the
// committer's stack.
func TestCommitPanicWedgesFirst(t *testing.T) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	v := s.volumes[0]
	var p any
	wedgedWhileUnwinding := false
	func() {
		defer func() { p = recover() }()
		defer func() { wedgedWhileUnwinding = v.usable() != nil }() // where closeBatch would run
		v.commit(nil, pebble.NoSync)
	}()
	if p == nil {
		t.Fatal("no panic")
	}
	if !wedgedWhileUnwinding {
		t.Fatal("the volume was not wedged when the caller's deferred calls ran")
	}
	cp, ok := p.(*CommitPanic)
	if !ok || !strings.Contains(string(cp.Stack), "runCall") {
		t.Fatalf("panic value %T does not carry the committer's stack: %v", p, p)
	}
	if !errors.Is(v.usable(), ErrVolumeFailed) {
		t.Fatalf("usable() = %v, want ErrVolumeFailed", v.usable())
	}
}
