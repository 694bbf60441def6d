package zoned

import (
	"bytes"
	"errors"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// The zoned backend's own Pebble DB (fatal.go): a fatal error there fails
// its volume, not the process (the old logger panicked: on the committing
// goroutine that reached the datanode's guards, which re-panic anything but
// a runtime error; on Pebble's flush goroutine it was a crash outright).

type zfatalRig struct {
	fs       *vfs.MemFS
	o        storage.Options
	s        *storage.Store
	mu       sync.Mutex
	backends map[string]*Backend
}

func newZFatalRig(t *testing.T) *zfatalRig {
	t.Helper()
	r := &zfatalRig{fs: vfs.NewMem(vfs.MemOptions{}), backends: map[string]*Backend{}}
	target := "/v1"
	g := Geometry{Zones: 16, ZoneSize: 16 << 20, ZoneCap: 16 << 20, MaxOpen: 4, MaxActive: 4, BlockSize: 4096}
	r.o = storage.Options{Volumes: []string{"/v1", "/v2"}, FS: r.fs, ContainerSize: 32 << 20, MetaReserveBytes: -1,
		AvoidVolume: func(p string) bool { return p != target },
		NewBackend: func(fs vfs.FS, d string) (storage.BlockFiles, error) {
			vol := filepath.Dir(d) // <volume>/basalt
			emu, err := NewEmuFS(fs, filepath.Join(vol, "zonefs"), g)
			if err != nil {
				return nil, err
			}
			b, err := New(Config{Mount: filepath.Join(vol, "zonefs"), FS: emu, MetaDir: filepath.Join(vol, "zoned-meta"), MetaFS: fs,
				StageBytes: 256 << 10, CleanerRate: -1})
			if err == nil {
				r.mu.Lock()
				r.backends[filepath.Dir(vol)] = b
				r.mu.Unlock()
			}
			return b, err
		}}
	s, err := storage.Open(r.o)
	if err != nil {
		t.Fatal(err)
	}
	r.s = s
	for _, cid := range []storage.ContainerID{1, 101} {
		target = "/v1"
		if cid > 100 {
			target = "/v2"
		}
		if _, err := s.CreateContainer(cid, storage.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

func zblock(cid storage.ContainerID, lid storage.LocalID) []byte {
	return data(uint64(cid)<<20|uint64(lid), 200<<10)
}

func zwrite(s *storage.Store, cid storage.ContainerID, lid storage.LocalID) error {
	p := zblock(cid, lid)
	bd := storage.BlockData{LocalID: lid, Length: int64(len(p)), BCSID: uint64(lid)}
	for off := 0; off < len(p); off += 64 << 10 {
		c := p[off:min(off+64<<10, len(p))]
		sum := storage.DefaultChecksum.Compute(c)
		if err := s.WriteChunk(cid, lid, int64(off), c, sum, true); err != nil {
			return err
		}
		bd.Chunks = append(bd.Chunks, storage.ChunkInfo{Offset: int64(off), Length: int64(len(c)), Checksum: sum})
	}
	if err := s.Sync(); err != nil && !errors.Is(err, storage.ErrVolumeFailed) {
		return err
	}
	return s.PutBlock(cid, bd)
}

func zcheck(t *testing.T, s *storage.Store, cid storage.ContainerID, lid storage.LocalID) {
	t.Helper()
	p := zblock(cid, lid)
	got, err := s.ReadChunk(cid, lid, 0, int64(len(p)))
	if err != nil || !bytes.Equal(got, p) {
		t.Fatalf("read %d/%d: %v (or content differs)", cid, lid, err)
	}
}

func (r *zfatalRig) finish(t *testing.T, wantErr string) {
	t.Helper()
	s := r.s
	deadline := time.Now().Add(30 * time.Second)
	for !s.Volumes()[0].Failed {
		if time.Now().After(deadline) {
			t.Fatal("volume 1 not failed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if vr := s.Volumes()[0]; !strings.Contains(vr.Error, wantErr) {
		t.Fatalf("volume 1's error %q does not give the cause (%q)", vr.Error, wantErr)
	}
	if n := s.VolumeFatals(); n != 1 {
		t.Fatalf("VolumeFatals = %d, want 1", n)
	}
	// Volume 2 goes on; volume 1 refuses.
	if err := zwrite(s, 101, 2); err != nil {
		t.Fatalf("write on the healthy volume: %v", err)
	}
	zcheck(t, s, 101, 1)
	zcheck(t, s, 101, 2)
	if err := zwrite(s, 1, 3); !errors.Is(err, storage.ErrVolumeFailed) {
		t.Fatalf("write on the failed volume: %v, want ErrVolumeFailed", err)
	}
	if vr := s.Volumes()[1]; vr.Failed {
		t.Fatalf("healthy volume failed: %s", vr.Error)
	}
	done := make(chan struct{})
	go func() { s.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Close blocked")
	}
	// A restart on a healthy disk (what a power loss leaves) recovers
	// volume 1's durable blocks.
	o := r.o
	o.FS = r.fs.Crash()
	s2, err := storage.Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	for _, vr := range s2.Volumes() {
		if vr.Failed {
			t.Fatalf("volume %s failed after the restart: %s", vr.Path, vr.Error)
		}
	}
	zcheck(t, s2, 1, 1)
	zcheck(t, s2, 101, 1)
	zcheck(t, s2, 101, 2)
	if err := zwrite(s2, 1, 4); err != nil {
		t.Fatalf("write on the recovered volume: %v", err)
	}
}

// TestZonedMetaFatalWALSync: the WAL sync of volume 1's zoned DB fails
// (EIO) when a block is synced: the write gets ErrVolumeFailed, volume 1
// fails, volume 2 goes on.
func TestZonedMetaFatalWALSync(t *testing.T) {
	r := newZFatalRig(t)
	if err := zwrite(r.s, 1, 1); err != nil {
		t.Fatal(err)
	}
	if err := zwrite(r.s, 101, 1); err != nil {
		t.Fatal(err)
	}
	r.fs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/v1/basalt/zoned-meta/") && strings.HasSuffix(path, ".log") {
			return unix.EIO
		}
		return nil
	})
	if err := zwrite(r.s, 1, 2); !errors.Is(err, storage.ErrVolumeFailed) {
		t.Fatalf("write whose zoned WAL sync failed: %v, want ErrVolumeFailed", err)
	}
	r.finish(t, "input/output error")
}

// TestZonedMetaFatalManifestSync: the zoned DB's MANIFEST sync fails in a
// flush, on Pebble's goroutine: the backend is wedged, and storage fails
// the volume when it next looks (a volume report here; the health check
// in a datanode) without any write to it.
func TestZonedMetaFatalManifestSync(t *testing.T) {
	r := newZFatalRig(t)
	if err := zwrite(r.s, 1, 1); err != nil {
		t.Fatal(err)
	}
	if err := zwrite(r.s, 101, 1); err != nil {
		t.Fatal(err)
	}
	r.fs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, "/v1/basalt/zoned-meta/MANIFEST") {
			return unix.EIO
		}
		return nil
	})
	r.mu.Lock()
	b := r.backends["/v1"]
	r.mu.Unlock()
	if _, err := b.db.AsyncFlush(); err != nil {
		t.Fatal(err)
	}
	r.finish(t, "MANIFEST sync failed")
}

// TestZonedMetaFatalReadFirst: the zoned DB is wedged (MANIFEST sync EIO in
// a flush, on Pebble's goroutine) and the first thing to reach volume 1 is
// a read, before any volume report or health check noticed. The read must
// fail the volume (ErrVolumeFailed), never mark the container UNHEALTHY as
// a damaged block: its data is intact, and after a restart on a healthy
// disk the container is healthy and its block reads back. (Review finding
// 2: the read was ErrBlockUnreadable and container 1 stayed UNHEALTHY
// across the restart.)
func TestZonedMetaFatalReadFirst(t *testing.T) {
	for _, how := range []string{"read", "verify"} {
		t.Run(how, func(t *testing.T) {
			r := newZFatalRig(t)
			if err := zwrite(r.s, 1, 1); err != nil {
				t.Fatal(err)
			}
			if err := zwrite(r.s, 101, 1); err != nil {
				t.Fatal(err)
			}
			r.fs.SetInject(func(op, path string) error {
				if op == "sync" && strings.HasPrefix(path, "/v1/basalt/zoned-meta/MANIFEST") {
					return unix.EIO
				}
				return nil
			})
			r.mu.Lock()
			b := r.backends["/v1"]
			r.mu.Unlock()
			if _, err := b.db.AsyncFlush(); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(30 * time.Second)
			for b.Fatal() == nil {
				if time.Now().After(deadline) {
					t.Fatal("backend not wedged")
				}
				time.Sleep(time.Millisecond)
			}
			var err error
			if how == "read" {
				_, err = r.s.ReadChunk(1, 1, 0, 4096)
			} else {
				_, err = r.s.VerifyBlock(1, 1, storage.VerifyOptions{})
			}
			if !errors.Is(err, storage.ErrVolumeFailed) || errors.Is(err, storage.ErrCorruption) {
				t.Fatalf("%s on the wedged zoned volume: %v, want ErrVolumeFailed (not a damaged block)", how, err)
			}
			r.finish(t, "MANIFEST sync failed")
			o := r.o
			o.FS = r.fs.Crash()
			s2, err := storage.Open(o)
			if err != nil {
				t.Fatal(err)
			}
			defer s2.Close()
			if rep, _ := s2.Container(1); rep.State == storage.StateUnhealthy {
				t.Fatalf("container 1 UNHEALTHY after a restart on a healthy disk: %+v", rep)
			}
			zcheck(t, s2, 1, 1)
		})
	}
}

// TestZonedGuardsRefuseWedged: each call into the zoned backend's DB
// refuses a wedged backend without touching it (review nit 8: fails if the
// guards' check goes).
func TestZonedGuardsRefuseWedged(t *testing.T) {
	r := newZFatalRig(t)
	defer r.s.Close()
	r.mu.Lock()
	b := r.backends["/v1"]
	r.mu.Unlock()
	b.fatal.Store(&storage.FatalError{Msg: "test wedge"})
	k := []byte("\xffguard-test")
	batch := b.db.NewBatch()
	batch.Set(k, []byte("b"), nil)
	calls := map[string]error{
		"commit":  b.commit(batch, pebble.Sync),
		"set":     b.set(k, []byte("s"), pebble.Sync),
		"del":     b.del(k, pebble.Sync),
		"logData": b.logData(pebble.Sync),
	}
	_, _, calls["get"] = b.get(k)
	_, calls["newIter"] = b.newIter(nil)
	batch.Close()
	for name, err := range calls {
		if !errors.Is(err, storage.ErrVolumeFailed) {
			t.Errorf("%s on a wedged backend: %v, want ErrVolumeFailed", name, err)
		}
	}
	b.fatal.Store(nil)
	if _, c, err := b.db.Get(k); err == nil {
		c.Close()
		t.Error("a write reached the wedged DB")
	}
}

// inCommitPipeline counts the goroutines inside Pebble's commit pipeline.
func inCommitPipeline() int {
	buf := make([]byte, 4<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "pebble/v2.(*commitPipeline).Commit(")
}

// TestZonedMetaFatalCommitInFlight: commits queued inside volume 1's zoned
// DB when it wedges return ErrVolumeFailed at once (storage.GuardedDB, as
// storage's TestVolumeFatalCommitInFlight for a volume's own DB). Commit A
// carries a batch of the memtable's size, so it rotates the WAL inside
// commitPipeline.prepare; the rotation's directory sync blocks until
// commits B wait on the pipeline's mutex, then fails (EIO), which wedges
// the backend and leaves the mutex locked. Each caller must return within
// 2 s; the Bs stay stuck in Pebble, counted, and their batches are kept
// from Pebble's pool (CloseBatch). Without the escape the Bs block for good.
func TestZonedMetaFatalCommitInFlight(t *testing.T) {
	r := newZFatalRig(t)
	if err := zwrite(r.s, 1, 1); err != nil {
		t.Fatal(err)
	}
	if err := zwrite(r.s, 101, 1); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	b := r.backends["/v1"]
	r.mu.Unlock()
	before := inCommitPipeline() // goroutines left by an earlier run (-count)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.fs.SetInject(func(op, path string) error {
		if op == "syncdir" && path == "/v1/basalt/zoned-meta" {
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
	go func() { errs <- b.set([]byte("\xffin-flight/a"), make([]byte, 4<<20), pebble.NoSync) }()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("commit A's rotation did not reach the directory sync")
	}
	kept := make(chan *pebble.Batch, nB)
	for i := range nB {
		wo := pebble.Sync
		if i%2 == 1 {
			wo = pebble.NoSync
		}
		k := []byte{0xff, 'b', byte(i)}
		go func() {
			batch := b.db.NewBatch()
			batch.Set(k, []byte("b"), nil)
			err := b.commit(batch, wo)
			b.gdb.CloseBatch(batch)
			kept <- batch
			errs <- err
		}()
	}
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
			if !errors.Is(err, storage.ErrVolumeFailed) || !strings.Contains(err.Error(), "directory sync failed") {
				t.Fatalf("commit %d in flight when the backend wedged: %v, want ErrVolumeFailed with the cause", i, err)
			}
		case <-timeout:
			t.Fatalf("%d of %d commits in flight still blocked 2 s after the backend wedged", 1+nB-i, 1+nB)
		}
	}
	for range nB {
		if batch := <-kept; batch.Count() != 1 {
			t.Fatal("a batch abandoned in the wedged DB was released to Pebble's pool")
		}
	}
	for b.log.Stuck() != nB {
		if time.Now().After(deadline) {
			t.Fatalf("Stuck = %d, want %d", b.log.Stuck(), nB)
		}
		time.Sleep(5 * time.Millisecond)
	}
	r.finish(t, "directory sync failed")
}
