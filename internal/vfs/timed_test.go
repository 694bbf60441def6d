package vfs

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// Flushes under a root are reported with that root (the longest one) and
// their modelled latency; read-only opens and other paths are not.
func TestTimedFSReportsFlushesPerRoot(t *testing.T) {
	dir := t.TempDir()
	slow, fast := filepath.Join(dir, "slow"), filepath.Join(dir, "fast")
	lat := NewLatencyFS(Default, map[string]DiskProfile{
		slow: {SyncLatency: 30 * time.Millisecond},
		fast: {SyncLatency: time.Millisecond},
	}, 1)
	lat.NoRealSync = true
	var mu sync.Mutex
	got := map[string][]time.Duration{}
	fs := NewTimedFS(lat, []string{slow, fast, filepath.Join(fast, "sub")}, func(root string, d time.Duration) {
		mu.Lock()
		got[root] = append(got[root], d)
		mu.Unlock()
	})
	for _, d := range []string{slow, filepath.Join(fast, "sub"), filepath.Join(dir, "other")} {
		if err := fs.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{filepath.Join(slow, "a"), filepath.Join(fast, "sub", "b"), filepath.Join(dir, "other", "c")} {
		f, err := fs.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		if err := f.SyncData(); err != nil {
			t.Fatal(err)
		}
		f.Close()
		r, err := fs.OpenFile(p, os.O_RDONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := r.(*timedFile); ok {
			t.Fatalf("%s: read-only open wrapped", p)
		}
		r.Close()
	}
	if err := SyncDir(fs, slow); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 2 || len(got[slow]) != 2 || len(got[filepath.Join(fast, "sub")]) != 1 {
		t.Fatalf("observed %v", got)
	}
	for _, d := range got[slow] {
		if d < 30*time.Millisecond {
			t.Fatalf("slow disk flush took %v, modelled 30ms", d)
		}
	}
}

func TestLatencyFSSetSlowdown(t *testing.T) {
	dir := t.TempDir()
	l := NewLatencyFS(Default, map[string]DiskProfile{dir: {SyncLatency: 5 * time.Millisecond}}, 1)
	l.NoRealSync = true
	f, err := l.Create(filepath.Join(dir, "f"), WriteCategory)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	took := func() time.Duration {
		t0 := time.Now()
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		return time.Since(t0)
	}
	took()
	l.Disks()[0].SetSlowdown(10)
	if d := took(); d < 50*time.Millisecond {
		t.Fatalf("slowed ×10: sync took %v, want ≥ 50ms", d)
	}
	l.Disks()[0].SetSlowdown(1)
	if d := l.Disks()[0].Stats().Max; d < 50*time.Millisecond {
		t.Fatalf("max %v", d)
	}
}
