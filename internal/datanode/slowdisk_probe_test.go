package datanode

import (
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/slowdisk"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestDiskProbeOnePerHungDisk: a disk whose probe flush hangs is not
// probed again each round (before: one more goroutine and descriptor per
// round, forever); it is observed with the time its probe has taken. The
// probe files are removed on close.
func TestDiskProbeOnePerHungDisk(t *testing.T) {
	dir := t.TempDir()
	hung, ok := filepath.Join(dir, "hung"), filepath.Join(dir, "ok")
	ffs := vfs.NewFaultFS(vfs.Default)
	release := make(chan struct{})
	var inHung atomic.Int32
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, hung+string(filepath.Separator)) {
			inHung.Add(1)
			<-release
		}
		return nil
	})
	roots := []string{hung, ok}
	w := &diskWatch{kind: map[string]*slowdisk.Detector{}, logDirs: roots}
	w.logs = slowdisk.New(slowdisk.Config{}, roots)
	w.vols = slowdisk.New(slowdisk.Config{}, nil)
	for _, r := range roots {
		w.kind[r] = w.logs
	}
	w.fs = vfs.NewTimedFS(ffs, roots, func(root string, d time.Duration) { w.logs.Observe(root, d, time.Now()) })
	stop := make(chan struct{})
	for range 4 {
		w.probe(1, 20*time.Millisecond, time.Time{}, stop)
	}
	if n := inHung.Load(); n != 1 {
		t.Errorf("%d probes hung on the hung disk after 4 rounds, want 1", n)
	}
	close(release)
	deadline := time.Now().Add(10 * time.Second)
	for {
		w.busyMu.Lock()
		busy := len(w.probing)
		w.busyMu.Unlock()
		if busy == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d probes still running", busy)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for _, r := range roots {
		if _, err := os.Stat(probeFile(r)); err != nil {
			t.Fatalf("probe file under %s: %v", r, err)
		}
	}
	w.removeProbeFiles()
	for _, r := range roots {
		if _, err := os.Stat(probeFile(r)); !os.IsNotExist(err) {
			t.Errorf("probe file under %s after close: %v", r, err)
		}
	}
}
