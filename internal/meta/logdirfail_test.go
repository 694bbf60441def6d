package meta

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/raft"
)

// TestLogDirFailedStopsMetaNode: when a meta node's raft log directory
// fails (WAL sync EIO), the node fail-stops: Failed closes, Err matches
// raft.ErrLogDirFailed, and the server is closed (no zombie with every
// group stopped), so `basalt meta` exits non-zero and is restarted.
func TestLogDirFailedStopsMetaNode(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "1")
	s, ffs, cl := faultNode(t, dir, 5*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "before"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Failed():
		t.Fatalf("failed before the fault: %v", s.Err())
	default:
	}
	raftDir := filepath.Join(dir, "raft") + string(filepath.Separator)
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, raftDir) && strings.HasSuffix(path, ".log") {
			return syscall.EIO
		}
		return nil
	})
	defer ffs.SetInject(nil)
	t0 := time.Now()
	_, werr := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "during"})
	t.Logf("CreateVolume during the fault: %v", werr)
	select {
	case <-s.Failed():
	case <-time.After(30 * time.Second):
		t.Fatal("the meta node did not stop after its raft log directory failed")
	}
	if err := s.Err(); !errors.Is(err, raft.ErrLogDirFailed) {
		t.Fatalf("Err = %v, want one matching raft.ErrLogDirFailed", err)
	}
	t.Logf("Err: %v (%v after the fault)", s.Err(), time.Since(t0))
	waitFor(t, 10*time.Second, "the server closed", func() bool {
		s.closeMu.Lock()
		defer s.closeMu.Unlock()
		return s.closed
	})
	t.Logf("closed %v after the fault", time.Since(t0))
	gctx, gcancel := context.WithTimeout(ctx, 3*time.Second)
	defer gcancel()
	if _, err := cl.Namespace.GetVolume(gctx, &metapb.GetVolumeRequest{Name: "before"}); err == nil {
		t.Fatal("GetVolume served after the node stopped")
	}
}
