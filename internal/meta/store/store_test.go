package store

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// crashFS is Pebble's crashable MemFS as a vfs.FS: CrashClone keeps only
// what was synced (file data after Sync, directory entries after the
// directory's Sync). The store never calls OpenFile.
type crashFS struct{ *pvfs.MemFS }

func (crashFS) OpenFile(name string, flag int, perm os.FileMode) (vfs.File, error) {
	return nil, &os.PathError{Op: "open", Path: name, Err: unix.ENOTSUP}
}

func (fs crashFS) crash() crashFS { return crashFS{fs.CrashClone(pvfs.CrashCloneCfg{})} }

func put(t *testing.T, s *Store, index uint64, k, v string) {
	t.Helper()
	b := s.NewBatch()
	if err := b.Set([]byte(k), []byte(v), nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(b, index); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, s *Store, k string) (string, bool) {
	t.Helper()
	var out string
	var found bool
	err := s.View(func(r pebble.Reader) error {
		v, c, err := r.Get([]byte(k))
		if errors.Is(err, pebble.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		out, found = string(v), true
		return c.Close()
	})
	if err != nil {
		t.Fatal(err)
	}
	return out, found
}

func snapshot(t *testing.T, s *Store) (uint64, []byte) {
	t.Helper()
	idx, rc, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return idx, b
}

func key(i int) string { return fmt.Sprintf("k%03d", i) }

// A leader's store with keys 1..n, each written at its own index, and
// snapshots taken at the given indexes.
func leaderSnapshots(t *testing.T, opts Options, n int, at ...int) map[int][]byte {
	t.Helper()
	src, err := Open(t.TempDir(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	snaps := map[int][]byte{}
	for i := 1; i <= n; i++ {
		put(t, src, uint64(i), key(i), fmt.Sprint(i))
		for _, a := range at {
			if a == i {
				idx, b := snapshot(t, src)
				if idx != uint64(i) {
					t.Fatalf("snapshot index %d, want %d", idx, i)
				}
				snaps[i] = b
			}
		}
	}
	return snaps
}

// Issue 11 scenario 3: two snapshots arriving newer-then-older must leave
// the newer state (every committed key) in place.
func TestRestoreRefusesOlderSnapshot(t *testing.T) {
	opts := Options{SyncInterval: -1}
	snaps := leaderSnapshots(t, opts, 31, 15, 31)
	s, err := Open(t.TempDir(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Restore(31, bytes.NewReader(snaps[31])); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		index uint64
		snap  []byte
	}{
		{"older", 15, snaps[15]},
		{"same", 31, snaps[31]},
		{"zero", 0, snaps[15]},
	} {
		err := s.Restore(tc.index, bytes.NewReader(tc.snap))
		if !errors.Is(err, ErrStaleSnapshot) {
			t.Errorf("%s snapshot at %d: got %v, want ErrStaleSnapshot", tc.name, tc.index, err)
		}
	}
	if got := s.AppliedIndex(); got != 31 {
		t.Fatalf("applied index %d after restoring 31 then 15, want 31", got)
	}
	var missing []string
	for i := 1; i <= 31; i++ {
		if v, ok := get(t, s, key(i)); !ok || v != fmt.Sprint(i) {
			missing = append(missing, key(i))
		}
	}
	if len(missing) > 0 {
		t.Fatalf("%d of 31 committed keys lost: %v", len(missing), missing)
	}
	// The store still moves forward: the next entry applies.
	put(t, s, 32, key(32), "32")
}

func TestAppliedIndexOnlyGrows(t *testing.T) {
	s, err := Open(t.TempDir(), Options{SyncInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	put(t, s, 5, "a", "1")
	for _, idx := range []uint64{5, 4} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Commit at %d after 5 did not panic", idx)
				}
			}()
			put(t, s, idx, "b", "2")
		}()
	}
	if _, ok := get(t, s, "b"); ok {
		t.Fatal("a refused commit wrote its batch")
	}
}

// Issue 11 scenario 11: a crash right after Restore returns keeps the
// restored state (the restored files' directory and the swap's parent are
// synced before Restore returns).
func TestRestoreSurvivesCrash(t *testing.T) {
	snaps := leaderSnapshots(t, Options{SyncInterval: -1}, 20, 20)
	fs := crashFS{pvfs.NewCrashableMem()}
	opts := Options{SyncInterval: -1, FS: fs}
	s, err := Open("/meta/scm", opts)
	if err != nil {
		t.Fatal(err)
	}
	put(t, s, 1, "old", "x")
	if err := s.Restore(20, bytes.NewReader(snaps[20])); err != nil {
		t.Fatal(err)
	}
	crashed := fs.crash()
	s.Close()

	r, err := Open("/meta/scm", Options{SyncInterval: -1, FS: crashed})
	if err != nil {
		t.Fatalf("open after crash: %v", err)
	}
	defer r.Close()
	if got := r.AppliedIndex(); got != 20 {
		t.Fatalf("applied index after crash %d, want 20", got)
	}
	for i := 1; i <= 20; i++ {
		if v, ok := get(t, r, key(i)); !ok || v != fmt.Sprint(i) {
			t.Fatalf("key %s after crash: %q %v", key(i), v, ok)
		}
	}
	if _, ok := get(t, r, "old"); ok {
		t.Fatal("the replaced state is back after the crash")
	}
}

// A crash at any point of Restore (before each file-system call it
// makes, Pebble's included) leaves the old state or the new one, whole.
func TestRestoreCrashAtEachStep(t *testing.T) {
	snaps := leaderSnapshots(t, Options{SyncInterval: -1}, 10, 10)
	// run restores with a crash image taken before the crashAt-th mutating
	// call (0: never) and returns that image and the number of calls.
	run := func(crashAt int) (*crashFS, int) {
		mem := crashFS{pvfs.NewCrashableMem()}
		ff := vfs.NewFaultFS(mem)
		s, err := Open("/m", Options{SyncInterval: -1, FS: ff})
		if err != nil {
			t.Fatal(err)
		}
		put(t, s, 1, "old", "x")
		var img *crashFS
		calls := 0
		ff.SetInject(func(op, path string) error {
			if calls++; calls == crashAt {
				c := mem.crash()
				img = &c
			}
			return nil
		})
		err = s.Restore(10, bytes.NewReader(snaps[10]))
		ff.SetInject(nil)
		s.Close()
		if err != nil {
			t.Fatal(err)
		}
		return img, calls
	}
	_, n := run(0)
	if n < 10 {
		t.Fatalf("Restore made only %d file-system calls", n)
	}
	sawNew := false
	for k := 1; k <= n; k++ {
		img, _ := run(k)
		if img == nil {
			continue // Pebble's background work made fewer calls this time
		}
		r, err := Open("/m", Options{SyncInterval: -1, FS: *img})
		if err != nil {
			t.Fatalf("crash before call %d of %d: open: %v", k, n, err)
		}
		switch r.AppliedIndex() {
		case 1:
			if _, ok := get(t, r, "old"); !ok {
				t.Fatalf("crash before call %d of %d: old state incomplete", k, n)
			}
		case 10:
			sawNew = true
			for i := 1; i <= 10; i++ {
				if _, ok := get(t, r, key(i)); !ok {
					t.Fatalf("crash before call %d of %d: new state lacks %s", k, n, key(i))
				}
			}
		default:
			t.Fatalf("crash before call %d of %d: applied index %d, want 1 or 10", k, n, r.AppliedIndex())
		}
		r.Close()
	}
	if !sawNew {
		t.Fatal("no crash point kept the new state")
	}
}

// A failed write of the new DB (a file, its sync, the directory's sync)
// is a failed Restore: the old state stays and serves.
func TestRestoreFailureKeepsOldState(t *testing.T) {
	snaps := leaderSnapshots(t, Options{SyncInterval: -1}, 10, 10)
	for _, op := range []string{"create", "sync", "mkdir"} {
		t.Run(op, func(t *testing.T) {
			ff := vfs.NewFaultFS(crashFS{pvfs.NewCrashableMem()})
			s, err := Open("/m", Options{SyncInterval: -1, FS: ff})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			put(t, s, 1, "old", "x")
			fired := false // once: Pebble retries a failing sync forever
			ff.SetInject(func(o, path string) error {
				if o == op && strings.Contains(path, restoreName) && !fired {
					fired = true
					return unix.EIO
				}
				return nil
			})
			if err := s.Restore(10, bytes.NewReader(snaps[10])); !errors.Is(err, unix.EIO) {
				t.Fatalf("Restore with a failing %s: %v, want EIO", op, err)
			}
			ff.SetInject(nil)
			if s.AppliedIndex() != 1 {
				t.Fatalf("applied %d, want 1", s.AppliedIndex())
			}
			if _, ok := get(t, s, "old"); !ok {
				t.Fatal("old state lost")
			}
			put(t, s, 2, "next", "y")
			if err := s.Restore(10, bytes.NewReader(snaps[10])); err != nil {
				t.Fatalf("Restore after the fault cleared: %v", err)
			}
		})
	}
}

func TestRestoreRejectsBadEntries(t *testing.T) {
	s, err := Open(t.TempDir(), Options{SyncInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	put(t, s, 1, "old", "x")
	for _, name := range []string{"../x", "a/b", "/abs", ".."} {
		var buf bytes.Buffer
		if err := newTar(&buf, name, "data"); err != nil {
			t.Fatal(err)
		}
		if err := s.Restore(5, &buf); err == nil || !strings.Contains(err.Error(), "bad entry") {
			t.Errorf("entry %q: %v", name, err)
		}
	}
	if _, ok := get(t, s, "old"); !ok || s.AppliedIndex() != 1 {
		t.Fatal("a refused snapshot changed the state")
	}
}

func newTar(w io.Writer, name, data string) error {
	tw := tar.NewWriter(w)
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	if _, err := tw.Write([]byte(data)); err != nil {
		return err
	}
	return tw.Close()
}
