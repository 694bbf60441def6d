package vfs

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// syncAll creates one file per path, writes a byte and syncs them all at
// once; it returns how long the syncs took together.
func syncAll(t *testing.T, fs FS, paths []string) time.Duration {
	t.Helper()
	files := make([]File, len(paths))
	for i, p := range paths {
		f, err := fs.OpenFile(p, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		files[i] = f
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(files))
	t0 := time.Now()
	for _, f := range files {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- f.SyncData()
		}()
	}
	wg.Wait()
	el := time.Since(t0)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return el
}

func latencyDisks(t *testing.T, n int, p DiskProfile) (string, map[string]DiskProfile) {
	root := t.TempDir()
	disks := map[string]DiskProfile{}
	for i := range n {
		d := filepath.Join(root, fmt.Sprintf("disk%d", i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		disks[d] = p
	}
	return root, disks
}

// A disk flushes one flush at a time (syncs queued behind a running flush
// share the next one, or each has its own with NoFlushMerge); different
// disks flush in parallel.
func TestLatencyFSSyncsSerializePerDisk(t *testing.T) {
	const lat = 50 * time.Millisecond
	root, disks := latencyDisks(t, 4, DiskProfile{SyncLatency: lat})
	strict := filepath.Join(root, "strict")
	if err := os.MkdirAll(strict, 0o755); err != nil {
		t.Fatal(err)
	}
	disks[strict] = DiskProfile{SyncLatency: lat, NoFlushMerge: true}
	fs := NewLatencyFS(Default, disks, 1)
	same := make([]string, 4)
	own := make([]string, 4)
	spread := make([]string, 4)
	for i := range 4 {
		same[i] = filepath.Join(root, "disk0", fmt.Sprint("f", i))
		own[i] = filepath.Join(strict, fmt.Sprint("f", i))
		spread[i] = filepath.Join(root, fmt.Sprintf("disk%d", i), "g")
	}
	// Without merging: 4 flushes in a row.
	if el := syncAll(t, fs, own); el < 4*lat {
		t.Fatalf("4 syncs on one disk without merging took %v, want >= %v", el, 4*lat)
	}
	st := fs.DiskOf(own[0]).Stats()
	if st.Syncs != 4 || st.Flushes != 4 || st.Wait < 3*lat || st.Busy < 4*lat || st.Max < 3*lat {
		t.Fatalf("strict disk stats %+v: want 4 syncs and flushes, >= %v waited, >= %v busy", st, 3*lat, 4*lat)
	}
	// Merging: the first sync's flush, then one for the rest (a straggler
	// may need a third); flushes never overlap.
	el := syncAll(t, fs, same)
	st = fs.DiskOf(same[0]).Stats()
	if st.Syncs != 4 || st.Flushes < 2 || st.Flushes > 3 || el < time.Duration(st.Flushes)*lat {
		t.Fatalf("4 syncs on one disk took %v with stats %+v: want 2-3 flushes, one at a time", el, st)
	}
	if el := syncAll(t, fs, spread); el >= 3*lat {
		t.Fatalf("4 syncs on 4 disks took %v, want < %v (parallel)", el, 3*lat)
	}
	// Many writers syncing in a loop: flushes serialize, syncs merge.
	var wg sync.WaitGroup
	st0 := fs.DiskOf(filepath.Join(root, "disk1")).Stats()
	t0 := time.Now()
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := fs.Create(filepath.Join(root, "disk1", fmt.Sprint("w", w)), WriteCategory)
			if err != nil {
				t.Error(err)
				return
			}
			defer f.Close()
			for range 5 {
				if err := f.Sync(); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	el = time.Since(t0)
	st = fs.DiskOf(filepath.Join(root, "disk1")).Stats()
	st.Syncs -= st0.Syncs
	st.Flushes -= st0.Flushes
	if st.Syncs != 40 || st.Flushes >= 30 || el < time.Duration(st.Flushes)*lat {
		t.Fatalf("8 writers × 5 syncs: %v, stats %+v: want 40 syncs merged into < 30 flushes, one at a time", el, st)
	}
	// A file outside every disk is not delayed and not counted.
	if d := fs.DiskOf(filepath.Join(root, "other")); d != nil {
		t.Fatalf("DiskOf outside: %v", d.Root)
	}
	if d := fs.DiskOf(filepath.Join(root, "disk10", "x")); d != nil {
		t.Fatalf("disk10 matched %s", d.Root)
	}
	before := totalSyncs(fs)
	syncAll(t, fs, []string{filepath.Join(root, "other")})
	if totalSyncs(fs) != before {
		t.Fatal("a sync outside the disks was counted")
	}
}

func totalSyncs(fs *LatencyFS) (n int64) {
	for _, d := range fs.Disks() {
		n += d.Stats().Syncs
	}
	return n
}

// The slow disk is slow, the fast ones are not; bandwidth and stalls add.
func TestLatencyFSSlowDiskBandwidthAndStall(t *testing.T) {
	root := t.TempDir()
	fast, slow, bw, stall := filepath.Join(root, "fast"), filepath.Join(root, "slow"), filepath.Join(root, "bw"), filepath.Join(root, "stall")
	for _, d := range []string{fast, slow, bw, stall} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	fs := NewLatencyFS(Default, map[string]DiskProfile{
		fast:  {SyncLatency: 2 * time.Millisecond, SyncJitter: time.Millisecond},
		slow:  {SyncLatency: 80 * time.Millisecond},
		bw:    {WriteBytesPerSec: 10 << 20},
		stall: {StallEvery: time.Hour, StallFor: 300 * time.Millisecond},
	}, 1)
	// The stall runs from NewLatencyFS for 300 ms: a sync now waits for
	// its end, a later one does not.
	t0 := time.Now()
	if el := syncAll(t, fs, []string{filepath.Join(stall, "a")}); time.Since(t0) < 300*time.Millisecond || el < 100*time.Millisecond {
		t.Fatalf("sync during a stall took %v", el)
	}
	if el := syncAll(t, fs, []string{filepath.Join(stall, "a")}); el > 250*time.Millisecond {
		t.Fatalf("sync after the stall took %v", el)
	}
	if st := fs.DiskOf(stall).Stats(); st.Stalled != 1 || st.Syncs != 2 || st.Flushes != 2 {
		t.Fatalf("stall disk: %+v", st)
	}
	var fastMax time.Duration
	for range 5 {
		fastMax = max(fastMax, syncAll(t, fs, []string{filepath.Join(fast, "a")}))
	}
	slowEl := syncAll(t, fs, []string{filepath.Join(slow, "a")})
	if slowEl < 80*time.Millisecond {
		t.Fatalf("slow disk sync took %v", slowEl)
	}
	if fastMax >= slowEl {
		t.Fatalf("fast disk sync %v not faster than the slow disk's %v", fastMax, slowEl)
	}
	// 2 MiB at 10 MiB/s: the sync pays 200 ms; the next one, nothing.
	f, err := fs.Create(filepath.Join(bw, "big"), WriteCategory)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(make([]byte, 2<<20)); err != nil {
		t.Fatal(err)
	}
	t1 := time.Now()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t1); el < 200*time.Millisecond {
		t.Fatalf("sync of 2 MiB at 10 MiB/s took %v", el)
	}
	t2 := time.Now()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t2); el > 150*time.Millisecond {
		t.Fatalf("second sync (nothing written) took %v", el)
	}
	if st := fs.DiskOf(bw).Stats(); st.Written != 2<<20 {
		t.Fatalf("bw disk written %d", st.Written)
	}
}

// Data written through the FS reads back the same, with and without real
// syncs, and a Pebble DB runs on it; capacity is modelled per disk.
func TestLatencyFSDataAndPebble(t *testing.T) {
	for _, noReal := range []bool{false, true} {
		root, disks := latencyDisks(t, 2, DiskProfile{SyncLatency: time.Millisecond, Capacity: 1 << 30})
		fs := NewLatencyFS(Default, disks, 7)
		fs.NoRealSync = noReal
		p := filepath.Join(root, "disk1", "blob")
		want := bytes.Repeat([]byte("basalt"), 10000)
		f, err := fs.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(want, 0); err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(int64(len(want))); err != nil {
			t.Fatal(err)
		}
		if err := f.SyncData(); err != nil {
			t.Fatal(err)
		}
		f.Close()
		got, err := ReadFile(fs, p)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("read back %d bytes, %v", len(got), err)
		}
		u, err := fs.GetDiskUsage(filepath.Join(root, "disk1"))
		if err != nil || u.TotalBytes != 1<<30 || u.AvailBytes != 1<<30-uint64(len(want)) {
			t.Fatalf("disk1 usage %+v, %v", u, err)
		}
		if u, _ := fs.GetDiskUsage(filepath.Join(root, "disk0")); u.AvailBytes != 1<<30 {
			t.Fatalf("disk0 usage %+v", u)
		}

		dbDir := filepath.Join(root, "disk0", "db")
		db, err := pebble.Open(dbDir, &pebble.Options{FS: fs, Logger: nopLogger{}})
		if err != nil {
			t.Fatal(err)
		}
		for i := range 100 {
			if err := db.Set([]byte(fmt.Sprint("k", i)), []byte(fmt.Sprint("v", i)), pebble.Sync); err != nil {
				t.Fatal(err)
			}
		}
		if err := db.Close(); err != nil {
			t.Fatal(err)
		}
		if st := fs.DiskOf(dbDir).Stats(); st.Syncs < 100 {
			t.Fatalf("pebble's synced sets: %d syncs on its disk, want >= 100", st.Syncs)
		}
		db, err = pebble.Open(dbDir, &pebble.Options{FS: fs, Logger: nopLogger{}})
		if err != nil {
			t.Fatal(err)
		}
		for i := range 100 {
			v, c, err := db.Get([]byte(fmt.Sprint("k", i)))
			if err != nil || string(v) != fmt.Sprint("v", i) {
				t.Fatalf("k%d: %q %v", i, v, err)
			}
			c.Close()
		}
		db.Close()
	}
}

type nopLogger struct{}

func (nopLogger) Infof(string, ...any)  {}
func (nopLogger) Errorf(string, ...any) {}
func (nopLogger) Fatalf(f string, a ...any) {
	panic(fmt.Sprintf(f, a...))
}
