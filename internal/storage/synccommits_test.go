package storage

import (
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/vfs"
)

// twoVolumeStore opens a store on volumes good and bad (a FaultFS over
// the real file system) and returns a container on each.
func twoVolumeStore(t *testing.T) (s *Store, ffs *vfs.FaultFS, bad string, gc, bc ContainerID) {
	t.Helper()
	root := t.TempDir()
	good := filepath.Join(root, "good")
	bad = filepath.Join(root, "bad")
	// Per-volume capacities (the latency model's) so containers spread.
	lfs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{
		good: {Capacity: 1 << 40},
		bad:  {Capacity: 1 << 40},
	}, 1)
	ffs = vfs.NewFaultFS(lfs)
	s = openStore(t, Options{Volumes: []string{good, bad}, FS: ffs})
	on := map[string]ContainerID{}
	// Containers go to the volume with the most room: a block written
	// into the first one sends the next to the other volume.
	for cid := ContainerID(1); len(on) < 2 && cid < 8; cid++ {
		r, err := s.CreateContainer(cid, CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := on[r.Volume]; !ok {
			on[r.Volume] = cid
		}
		p := blockBytes(cid, 100, 1<<20)
		if err := s.WriteChunk(cid, 100, 0, p, DefaultChecksum.Compute(p), true); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	var ok1, ok2 bool
	gc, ok1 = on[good]
	bc, ok2 = on[bad]
	if !ok1 || !ok2 {
		t.Fatalf("containers not on both volumes: %v", on)
	}
	return s, ffs, bad, gc, bc
}

// A failed disk fails only the batches with a container on it: a batch on
// the healthy volume is made durable (SyncCommits of every volume failed
// every pipeline's batch datanode-wide), and the failed volume is not
// asked again.
func TestSyncCommitsForSkipsFailedVolume(t *testing.T) {
	if onBackend() != "posix" {
		t.Skip("fails the volume through a posix block file's sync")
	}
	s, ffs, bad, gc, bc := twoVolumeStore(t)
	for _, cid := range []ContainerID{gc, bc} {
		if err := smallBlock(s, cid, 1); err != nil {
			t.Fatal(err)
		}
	}
	// The bad disk fails a block file's sync (Pebble takes a failed WAL
	// sync as fatal, so the WAL is left alone; after this it is never
	// touched again).
	var walSyncs atomic.Int32
	ffs.SetInject(func(op, path string) error {
		if op != "sync" || !strings.HasPrefix(path, bad+string(filepath.Separator)) {
			return nil
		}
		if strings.Contains(path, string(filepath.Separator)+"meta"+string(filepath.Separator)) {
			walSyncs.Add(1)
			return nil
		}
		return errors.New("injected: disk gone")
	})
	p := blockBytes(bc, 2, 1<<20)
	if err := s.WriteChunk(bc, 2, 0, p, DefaultChecksum.Compute(p), true); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncContainers([]ContainerID{bc}); !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("sync on the bad disk: %v, want ErrVolumeFailed", err)
	}
	walSyncs.Store(0)
	if err := s.SyncCommitsFor([]ContainerID{bc}); !errors.Is(err, ErrVolumeFailed) {
		t.Fatalf("SyncCommitsFor of the failed volume's container: %v, want ErrVolumeFailed", err)
	}
	if err := s.SyncCommitsFor([]ContainerID{gc}); err != nil {
		t.Fatalf("SyncCommitsFor of the healthy volume's container: %v", err)
	}
	// Another commit on the healthy volume syncs too, with an unknown
	// (deleted) container in the batch.
	if err := smallBlock(s, gc, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.SyncCommitsFor([]ContainerID{gc, 999}); err != nil {
		t.Fatalf("SyncCommitsFor of the healthy volume's container (and an unknown one): %v", err)
	}
	// Both: the error names the failed volume only.
	err := s.SyncCommitsFor([]ContainerID{gc, bc})
	if !errors.Is(err, ErrVolumeFailed) || !strings.Contains(err.Error(), bad) {
		t.Fatalf("SyncCommitsFor of both: %v", err)
	}
	if n := walSyncs.Load(); n != 0 {
		t.Fatalf("the failed volume's WAL was synced %d times after it failed", n)
	}
}

// A slow disk delays only the batches with a container on it.
func TestSyncCommitsForSkipsSlowVolume(t *testing.T) {
	s, ffs, bad, gc, bc := twoVolumeStore(t)
	for _, cid := range []ContainerID{gc, bc} {
		if err := smallBlock(s, cid, 1); err != nil {
			t.Fatal(err)
		}
	}
	release := make(chan struct{})
	var blocked atomic.Int32
	ffs.SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, bad+string(filepath.Separator)) {
			blocked.Add(1)
			<-release
		}
		return nil
	})
	slowDone := make(chan error, 1)
	go func() { slowDone <- s.SyncCommitsFor([]ContainerID{bc}) }()
	deadline := time.Now().Add(10 * time.Second)
	for blocked.Load() == 0 {
		if time.Now().After(deadline) {
			close(release)
			t.Fatal("the slow volume's WAL sync never started")
		}
		time.Sleep(time.Millisecond)
	}
	fastDone := make(chan error, 1)
	go func() { fastDone <- s.SyncCommitsFor([]ContainerID{gc}) }()
	select {
	case err := <-fastDone:
		if err != nil {
			t.Fatalf("SyncCommitsFor of the fast volume's container: %v", err)
		}
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("SyncCommitsFor of the fast volume's container waited for the stalled volume")
	}
	close(release)
	ffs.SetInject(nil)
	select {
	case err := <-slowDone:
		if err != nil {
			t.Fatalf("slow volume's SyncCommitsFor: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("slow volume's SyncCommitsFor never returned")
	}
}
