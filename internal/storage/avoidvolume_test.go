package storage

import (
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/basalt-store/basalt/internal/vfs"
)

// New containers skip a volume AvoidVolume names (a slow disk) even when
// it has the most room, and use it only when no other volume has room.
func TestCreateContainerAvoidsVolume(t *testing.T) {
	root := t.TempDir()
	a, b := filepath.Join(root, "a"), filepath.Join(root, "b")
	fs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{
		a: {Capacity: 1 << 40},
		b: {Capacity: 2 << 40}, // the most room
	}, 1)
	fs.NoRealSync = true
	var avoidA atomic.Bool
	s := openStore(t, Options{Volumes: []string{a, b}, FS: fs, ContainerSize: 1 << 30,
		AvoidVolume: func(p string) bool { return p == b || avoidA.Load() && p == a }})
	for cid := ContainerID(1); cid <= 3; cid++ {
		r, err := s.CreateContainer(cid, CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Volume != a {
			t.Fatalf("container %d on %s, want %s (%s avoided)", cid, r.Volume, a, b)
		}
	}
	avoidA.Store(true) // both avoided: placed by room as before
	if _, err := s.CreateContainer(4, CreateOptions{}); err != nil {
		t.Fatalf("every volume avoided: %v", err)
	}
}

// The volumes' Pebble stores share one block cache, bounded whatever the
// number of volumes.
func TestSharedCacheSize(t *testing.T) {
	for _, c := range []struct {
		volumes int
		want    int64
	}{{1, 64 << 20}, {2, 96 << 20}, {4, 160 << 20}, {24, 512 << 20}, {0, 64 << 20}} {
		if got := sharedCacheSize(c.volumes); got != c.want {
			t.Errorf("%d volumes: cache %d, want %d", c.volumes, got, c.want)
		}
	}
}
