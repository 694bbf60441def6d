package vfs

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"
)

// step is one operation of a durability case.
type step func(t *testing.T, fs *MemFS)

func mkdir(d string) step {
	return func(t *testing.T, fs *MemFS) {
		if err := fs.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func syncDir(d string) step {
	return func(t *testing.T, fs *MemFS) {
		if err := SyncDir(fs, d); err != nil {
			t.Fatal(err)
		}
	}
}

// write writes data at off in name (creating it) and syncs the file when
// sync is set.
func write(name string, off int64, data string, sync bool) step {
	return func(t *testing.T, fs *MemFS) {
		f, err := fs.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte(data), off); err != nil {
			t.Fatal(err)
		}
		if sync {
			if err := f.Sync(); err != nil {
				t.Fatal(err)
			}
		}
		f.Close()
	}
}

func truncate(name string, size int64, sync bool) step {
	return func(t *testing.T, fs *MemFS) {
		f, err := fs.OpenFile(name, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		if sync {
			if err := f.SyncData(); err != nil {
				t.Fatal(err)
			}
		}
		f.Close()
	}
}

func rename(o, n string) step {
	return func(t *testing.T, fs *MemFS) {
		if err := fs.Rename(o, n); err != nil {
			t.Fatal(err)
		}
	}
}

func remove(name string) step {
	return func(t *testing.T, fs *MemFS) {
		if err := fs.Remove(name); err != nil {
			t.Fatal(err)
		}
	}
}

func link(o, n string) step {
	return func(t *testing.T, fs *MemFS) {
		if err := fs.Link(o, n); err != nil {
			t.Fatal(err)
		}
	}
}

func atomic(name, data string) step {
	return func(t *testing.T, fs *MemFS) {
		if err := WriteFileAtomic(fs, name, []byte(data)); err != nil {
			t.Fatal(err)
		}
	}
}

// absent marks a path that must not exist.
const absent = "\x00absent"

func TestMemFSCrashKeepsExactlySynced(t *testing.T) {
	cases := []struct {
		name  string
		steps []step
		want  map[string]string // path -> contents after Crash (absent: missing)
		now   map[string]string // before the crash, when it differs
	}{
		{"unsynced file and entry", []step{write("/a", 0, "x", false)},
			map[string]string{"/a": absent}, map[string]string{"/a": "x"}},
		{"file synced, entry not", []step{write("/a", 0, "x", true)},
			map[string]string{"/a": absent}, map[string]string{"/a": "x"}},
		{"entry synced, data not", []step{write("/a", 0, "x", false), syncDir("/")},
			map[string]string{"/a": ""}, map[string]string{"/a": "x"}},
		{"both synced", []step{write("/a", 0, "x", true), syncDir("/")},
			map[string]string{"/a": "x"}, nil},
		{"overwrite after sync", []step{write("/a", 0, "hello", true), syncDir("/"), write("/a", 1, "EL", false)},
			map[string]string{"/a": "hello"}, map[string]string{"/a": "hELlo"}},
		{"append after sync", []step{write("/a", 0, "ab", true), syncDir("/"), write("/a", 2, "cd", false)},
			map[string]string{"/a": "ab"}, map[string]string{"/a": "abcd"}},
		{"truncate unsynced", []step{write("/a", 0, "abcd", true), syncDir("/"), truncate("/a", 1, false)},
			map[string]string{"/a": "abcd"}, map[string]string{"/a": "a"}},
		{"truncate synced", []step{write("/a", 0, "abcd", true), syncDir("/"), truncate("/a", 1, true)},
			map[string]string{"/a": "a"}, nil},
		{"rename unsynced", []step{write("/a", 0, "x", true), syncDir("/"), rename("/a", "/b")},
			map[string]string{"/a": "x", "/b": absent}, map[string]string{"/a": absent, "/b": "x"}},
		{"rename synced", []step{write("/a", 0, "x", true), syncDir("/"), rename("/a", "/b"), syncDir("/")},
			map[string]string{"/a": absent, "/b": "x"}, nil},
		{"rename over, unsynced", []step{write("/a", 0, "new", true), write("/b", 0, "old", true), syncDir("/"), rename("/a", "/b")},
			map[string]string{"/a": "new", "/b": "old"}, map[string]string{"/a": absent, "/b": "new"}},
		{"remove unsynced", []step{write("/a", 0, "x", true), syncDir("/"), remove("/a")},
			map[string]string{"/a": "x"}, map[string]string{"/a": absent}},
		{"remove synced", []step{write("/a", 0, "x", true), syncDir("/"), remove("/a"), syncDir("/")},
			map[string]string{"/a": absent}, nil},
		{"nested dir, parent entry unsynced", []step{mkdir("/d/e"), write("/d/e/f", 0, "x", true), syncDir("/d/e"), syncDir("/d")},
			map[string]string{"/d/e/f": absent}, map[string]string{"/d/e/f": "x"}},
		{"nested dir, all synced", []step{mkdir("/d/e"), write("/d/e/f", 0, "x", true), syncDir("/d/e"), syncDir("/d"), syncDir("/")},
			map[string]string{"/d/e/f": "x"}, nil},
		{"cross-dir rename, only target synced", []step{mkdir("/p"), mkdir("/q"), write("/p/a", 0, "x", true), syncDir("/p"), syncDir("/"), rename("/p/a", "/q/a"), syncDir("/q")},
			map[string]string{"/p/a": "x", "/q/a": "x"}, map[string]string{"/p/a": absent, "/q/a": "x"}},
		{"hard link synced", []step{write("/a", 0, "x", true), link("/a", "/b"), syncDir("/"), write("/b", 1, "y", true)},
			map[string]string{"/a": "xy", "/b": "xy"}, nil},
		{"atomic write", []step{atomic("/a", "one"), atomic("/a", "two")},
			map[string]string{"/a": "two", "/a.tmp": absent}, nil},
		{"atomic write over unsynced content", []step{atomic("/a", "one"), write("/a", 0, "XXX", false)},
			map[string]string{"/a": "one"}, map[string]string{"/a": "XXX"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fs := NewMem(MemOptions{})
			for _, s := range tc.steps {
				s(t, fs)
			}
			now := tc.now
			if now == nil {
				now = tc.want
			}
			expect(t, "before crash", fs, now)
			crashed := fs.Crash()
			expect(t, "after crash", crashed, tc.want)
			// A crash of a crash loses nothing more: everything left is durable.
			expect(t, "after a second crash", crashed.CrashClone(rand.New(rand.NewPCG(1, 2))), tc.want)
		})
	}
}

func expect(t *testing.T, when string, fs *MemFS, want map[string]string) {
	t.Helper()
	for p, w := range want {
		b, err := ReadFile(fs, p)
		if w == absent {
			if !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s: %s should not exist (err %v, %q)\n%s", when, p, err, b, fs)
			}
			continue
		}
		if err != nil || string(b) != w {
			t.Errorf("%s: %s = %q, %v; want %q\n%s", when, p, b, err, w, fs)
		}
	}
}

// TestMemFSCrashCloneRandom checks that a random crash keeps every synced
// byte, keeps or drops each unsynced write (a torn one sector by sector),
// and is the same for the same seed.
func TestMemFSCrashCloneRandom(t *testing.T) {
	const sector = 512
	old := bytes.Repeat([]byte{'o'}, 8*sector)
	neu := bytes.Repeat([]byte{'n'}, 6*sector)
	build := func() *MemFS {
		fs := NewMem(MemOptions{})
		write("/f", 0, string(old), true)(t, fs)
		syncDir("/")(t, fs)
		write("/f", sector/2, string(neu), false)(t, fs) // straddles 7 sectors
		write("/g", 0, "g", true)(t, fs)                 // entry unsynced
		return fs
	}
	outcomes := map[string]bool{}
	gExists := map[bool]bool{}
	for seed := uint64(0); seed < 200; seed++ {
		fs := build()
		a := fs.CrashClone(rand.New(rand.NewPCG(seed, 0)))
		b := fs.CrashClone(rand.New(rand.NewPCG(seed, 0)))
		if a.String() != b.String() {
			t.Fatalf("seed %d: two clones differ:\n%s\n%s", seed, a, b)
		}
		fa, _ := a.Contents("/f")
		fb, _ := b.Contents("/f")
		if !bytes.Equal(fa, fb) {
			t.Fatalf("seed %d: clone contents differ", seed)
		}
		if len(fa) != len(old) {
			t.Fatalf("seed %d: size %d, want %d", seed, len(fa), len(old))
		}
		// Each sector is old or new as a whole; bytes outside the write are old.
		for s := 0; s < len(fa); s += sector {
			got := fa[s : s+sector]
			want := slicesOf(old, neu, s, sector)
			if !bytes.Equal(got, want[0]) && !bytes.Equal(got, want[1]) {
				t.Fatalf("seed %d: sector %d is neither old nor new: %q", seed, s/sector, got)
			}
		}
		outcomes[string(fa)] = true
		_, err := a.Stat("/g")
		gExists[err == nil] = true
	}
	if len(outcomes) < 3 {
		t.Fatalf("only %d distinct crash outcomes for the unsynced write; want whole, none and torn", len(outcomes))
	}
	if !gExists[true] || !gExists[false] {
		t.Fatalf("unsynced entry kept %v: want both outcomes over 200 seeds", gExists)
	}
}

// slicesOf returns sector s of the file before and after the straddling write.
func slicesOf(old, neu []byte, s, sector int) [2][]byte {
	after := bytes.Clone(old)
	copy(after[sector/2:], neu)
	return [2][]byte{old[s : s+sector], after[s : s+sector]}
}

func TestMemFSFaults(t *testing.T) {
	eio := func(op string) func(string, string) error {
		return func(o, p string) error {
			if o == op {
				return unix.EIO
			}
			return nil
		}
	}
	cases := []struct {
		name   string
		opts   MemOptions
		inject func(op, path string) error
		run    func(fs *MemFS) (int, error)
		wantN  int
		want   error
		after  string // contents of /f after the call ("" = not checked)
	}{
		{"capacity: write what fits", MemOptions{Capacity: 10}, nil,
			func(fs *MemFS) (int, error) { return openW(t, fs).WriteAt([]byte("0123456789abc"), 0) },
			10, unix.ENOSPC, "0123456789"},
		{"capacity: overwrite in place fits", MemOptions{Capacity: 4}, nil,
			func(fs *MemFS) (int, error) {
				f := openW(t, fs)
				f.WriteAt([]byte("abcd"), 0)
				return f.WriteAt([]byte("XY"), 1)
			}, 2, nil, "aXYd"},
		{"capacity: reserved file not limited", MemOptions{Capacity: 2}, nil,
			func(fs *MemFS) (int, error) {
				fs.SetReserved(func(p string) bool { return p == "/f" })
				return openW(t, fs).WriteAt([]byte("abcdef"), 0)
			}, 6, nil, "abcdef"},
		{"capacity: truncate up", MemOptions{Capacity: 4}, nil,
			func(fs *MemFS) (int, error) { return 0, openW(t, fs).Truncate(5) }, 0, unix.ENOSPC, ""},
		{"O_DIRECT refused", MemOptions{}, nil,
			func(fs *MemFS) (int, error) {
				_, err := fs.OpenFile("/f", os.O_RDWR|os.O_CREATE|unix.O_DIRECT, 0)
				return 0, err
			}, 0, unix.EINVAL, ""},
		{"O_DIRECT aligned", MemOptions{DirectIO: true}, nil,
			func(fs *MemFS) (int, error) { return openD(t, fs).WriteAt(make([]byte, 1024), 512) }, 1024, nil, ""},
		{"O_DIRECT unaligned offset", MemOptions{DirectIO: true}, nil,
			func(fs *MemFS) (int, error) { return openD(t, fs).WriteAt(make([]byte, 512), 1) }, 0, unix.EINVAL, ""},
		{"O_DIRECT unaligned length", MemOptions{DirectIO: true}, nil,
			func(fs *MemFS) (int, error) { return openD(t, fs).WriteAt(make([]byte, 100), 0) }, 0, unix.EINVAL, ""},
		{"EIO on write", MemOptions{}, eio("write"),
			func(fs *MemFS) (int, error) { return openW(t, fs).Write([]byte("abc")) }, 0, unix.EIO, ""},
		{"EIO on sync", MemOptions{}, eio("sync"),
			func(fs *MemFS) (int, error) { return 0, openW(t, fs).Sync() }, 0, unix.EIO, ""},
		{"EIO on read", MemOptions{}, eio("read"),
			func(fs *MemFS) (int, error) { return openW(t, fs).ReadAt(make([]byte, 1), 0) }, 0, unix.EIO, ""},
		{"EIO on syncdir", MemOptions{}, eio("syncdir"),
			func(fs *MemFS) (int, error) { return 0, SyncDir(fs, "/") }, 0, unix.EIO, ""},
		{"EIO on rename", MemOptions{}, eio("rename"),
			func(fs *MemFS) (int, error) { openW(t, fs); return 0, fs.Rename("/f", "/g") }, 0, unix.EIO, ""},
		{"torn write", MemOptions{}, func(op, p string) error {
			if op == "write" {
				return ErrTornWrite
			}
			return nil
		}, func(fs *MemFS) (int, error) { return openW(t, fs).WriteAt(bytes.Repeat([]byte{'t'}, 2048), 0) },
			1024, unix.ENOSPC, string(bytes.Repeat([]byte{'t'}, 1024))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fs := NewMem(tc.opts)
			fs.SetInject(tc.inject)
			n, err := tc.run(fs)
			if n != tc.wantN || !errors.Is(err, tc.want) {
				t.Fatalf("got n=%d err=%v; want n=%d err=%v", n, err, tc.wantN, tc.want)
			}
			if tc.after != "" {
				if b, _ := fs.Contents("/f"); string(b) != tc.after {
					t.Fatalf("contents %q, want %q", b, tc.after)
				}
			}
		})
	}
}

func openW(t *testing.T, fs *MemFS) File {
	f, err := fs.OpenFile("/f", os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func openD(t *testing.T, fs *MemFS) File {
	f, err := fs.OpenFile("/f", os.O_RDWR|os.O_CREATE|unix.O_DIRECT, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestMemFSBasics(t *testing.T) {
	fs := NewMem(MemOptions{Capacity: 1 << 20})
	var ops []string
	fs.SetLatency(func(op, p string, n int) { ops = append(ops, fmt.Sprintf("%s %s %d", op, p, n)) })
	if err := fs.MkdirAll("/d", 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := fs.Create("/d/x", WriteCategory)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("hello ")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("world")); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := f.Write([]byte("!")); err == nil {
		t.Fatal("write after close succeeded")
	}
	r, err := fs.Open("/d/x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Write([]byte("x")); !errors.Is(err, unix.EBADF) {
		t.Fatalf("write to a read-only handle: %v", err)
	}
	b, err := io.ReadAll(r)
	if err != nil || string(b) != "hello world" {
		t.Fatalf("read %q %v", b, err)
	}
	if fi, err := fs.Stat("/d/x"); err != nil || fi.Size() != 11 || fi.IsDir() || fi.Name() != "x" {
		t.Fatalf("stat %v %v", fi, err)
	}
	if _, err := fs.OpenFile("/d/x", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0); !errors.Is(err, os.ErrExist) {
		t.Fatalf("O_EXCL on an existing file: %v", err)
	}
	if err := fs.Remove("/d"); !errors.Is(err, unix.ENOTEMPTY) {
		t.Fatalf("remove non-empty dir: %v", err)
	}
	if _, err := fs.Open("/nope"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("open missing: %v", err)
	}
	u, _ := fs.GetDiskUsage("/")
	if u.UsedBytes != 11 || u.TotalBytes != 1<<20 || u.AvailBytes != 1<<20-11 {
		t.Fatalf("usage %+v", u)
	}
	l, err := fs.Lock("/d/LOCK")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Lock("/d/LOCK"); err == nil {
		t.Fatal("second lock succeeded")
	}
	l.Close()
	if l2, err := fs.Lock("/d/LOCK"); err != nil {
		t.Fatalf("lock after unlock: %v", err)
	} else {
		l2.Close()
	}
	names, _ := fs.List("/d")
	if fmt.Sprint(names) != "[LOCK x]" {
		t.Fatalf("list %v", names)
	}
	if err := fs.RemoveAll("/d"); err != nil {
		t.Fatal(err)
	}
	if u, _ := fs.GetDiskUsage("/"); u.UsedBytes != 0 {
		t.Fatalf("usage after RemoveAll %+v", u)
	}
	if len(ops) == 0 {
		t.Fatal("latency callback never called")
	}
}

// TestMemFSPebbleCrash runs a real Pebble DB on MemFS: after a crash that
// keeps only synced state it must hold exactly the keys committed with
// Sync, and after random crashes at least those.
func TestMemFSPebbleCrash(t *testing.T) {
	for seed := uint64(0); seed < 16; seed++ {
		fs := NewMem(MemOptions{})
		db, err := pebble.Open("/db", &pebble.Options{FS: fs, Logger: quiet{}})
		if err != nil {
			t.Fatal(err)
		}
		synced := map[string]string{}
		for i := 0; i < 50; i++ {
			k, v := fmt.Sprintf("k%03d", i), fmt.Sprintf("v%d-%d", seed, i)
			if err := db.Set([]byte(k), []byte(v), pebble.Sync); err != nil {
				t.Fatal(err)
			}
			synced[k] = v
		}
		if err := db.Flush(); err != nil {
			t.Fatal(err)
		}
		for i := 50; i < 60; i++ {
			if err := db.Set([]byte(fmt.Sprintf("k%03d", i)), []byte("nosync"), pebble.NoSync); err != nil {
				t.Fatal(err)
			}
		}
		var crashed *MemFS
		if seed == 0 {
			crashed = fs.Crash()
		} else {
			crashed = fs.CrashClone(rand.New(rand.NewPCG(seed, 7)))
		}
		db.Close()
		db2, err := pebble.Open("/db", &pebble.Options{FS: crashed, Logger: quiet{}})
		if err != nil {
			t.Fatalf("seed %d: reopen after crash: %v\n%s", seed, err, crashed)
		}
		for k, v := range synced {
			got, closer, err := db2.Get([]byte(k))
			if err != nil || string(got) != v {
				t.Fatalf("seed %d: synced key %s = %q, %v; want %q", seed, k, got, err, v)
			}
			closer.Close()
		}
		if seed == 0 {
			it, _ := db2.NewIter(nil)
			n := 0
			for it.First(); it.Valid(); it.Next() {
				n++
			}
			it.Close()
			if n != len(synced) {
				t.Fatalf("after a synced-only crash: %d keys, want exactly %d", n, len(synced))
			}
		}
		db2.Close()
	}
}

type quiet struct{}

func (quiet) Infof(string, ...any)         {}
func (quiet) Errorf(string, ...any)        {}
func (quiet) Fatalf(f string, args ...any) { panic(fmt.Sprintf(f, args...)) }

// TestMemFSCrashIndependentOfOtherFiles: the crash outcome of one file
// depends on the seed and that file alone, not on unsynced activity
// elsewhere (which background goroutines make timing-dependent).
func TestMemFSCrashIndependentOfOtherFiles(t *testing.T) {
	for seed := uint64(0); seed < 50; seed++ {
		var got [2]string
		for i := range got {
			fs := NewMem(MemOptions{})
			write("/f", 0, "base", true)(t, fs)
			syncDir("/")(t, fs)
			write("/f", 2, "XXXXXXXXXXXXXXXXXXXX", false)(t, fs)
			for j := 0; j < i*5; j++ {
				write(fmt.Sprintf("/other%d", j), 0, "o", false)(t, fs)
			}
			c := fs.CrashClone(rand.New(rand.NewPCG(seed, 3)))
			b, _ := c.Contents("/f")
			got[i] = string(b)
		}
		if got[0] != got[1] {
			t.Fatalf("seed %d: /f after a crash depends on other files: %q vs %q", seed, got[0], got[1])
		}
	}
}
