package storage

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/vfs"
)

// SyncContainers flushes only the volumes of its containers: a chunk on a
// fast volume is durable without waiting for a slow one (seed 001), and
// Sync still waits for every volume.
func TestSyncContainersSkipsOtherVolumes(t *testing.T) {
	root := t.TempDir()
	fast, slow := filepath.Join(root, "fast"), filepath.Join(root, "slow")
	const slowSync = 150 * time.Millisecond
	fs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{
		fast: {Capacity: 1 << 40},
		slow: {SyncLatency: slowSync, Capacity: 1 << 40},
	}, 1)
	// The model only: the host disk's own fsyncs would add their noise.
	fs.NoRealSync = true
	s := openStore(t, Options{Volumes: []string{fast, slow}, FS: fs})
	// Containers go to the volume with the most room: a block written
	// into the first one sends the next to the other volume.
	on := map[string]ContainerID{}
	for cid := ContainerID(1); len(on) < 2 && cid < 6; cid++ {
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
	fc, ok1 := on[fast]
	sc, ok2 := on[slow]
	if !ok1 || !ok2 {
		t.Fatalf("containers not on both volumes: %v", on)
	}
	write := func(cid ContainerID, lid LocalID) []byte {
		p := blockBytes(cid, lid, 64<<10)
		if err := s.WriteChunk(cid, lid, 0, p, DefaultChecksum.Compute(p), true); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write(fc, 1)
	write(sc, 1)
	t0 := time.Now()
	if err := s.SyncContainers([]ContainerID{fc}); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t0); el >= slowSync {
		t.Fatalf("SyncContainers of the fast volume's container took %v (the slow volume's flush is %v)", el, slowSync)
	}
	if ok, err := s.HasChunk(fc, 1, 0, 64<<10); !ok || err != nil {
		t.Fatalf("chunk on the fast volume after SyncContainers: %v %v", ok, err)
	}
	// The slow volume's chunk is still pending: Sync flushes it.
	write(fc, 2)
	t1 := time.Now()
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t1); el < slowSync {
		t.Fatalf("Sync took %v, want >= %v (it flushes every volume)", el, slowSync)
	}
	// An unknown container makes it a full Sync (nothing is skipped).
	write(sc, 2)
	t2 := time.Now()
	if err := s.SyncContainers([]ContainerID{999}); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t2); el < slowSync {
		t.Fatalf("SyncContainers of an unknown container took %v, want a full Sync", el)
	}
	if st := fs.DiskOf(slow).Stats(); st.Flushes < 2 {
		t.Fatalf("slow volume flushed %d times, want >= 2", st.Flushes)
	}
}
