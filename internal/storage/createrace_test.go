package storage

import (
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/vfs"
)

// Two writers of a new container (a pipeline's first entries, a stream
// beside them) both create it: the one that finds it being created must
// get "exists" only once it is usable. Before, the second create returned
// ErrContainerExists while the first still synced the record, and the
// writer's next call found the container "not found (import in progress)":
// the container went UNHEALTHY and its pipeline was replaced.
func TestConcurrentCreateWaitsForTheFirst(t *testing.T) {
	root := t.TempDir()
	vol := filepath.Join(root, "v")
	fs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{
		vol: {SyncLatency: 30 * time.Millisecond},
	}, 1)
	fs.NoRealSync = true
	s := openStore(t, Options{Volumes: []string{vol}, FS: fs})
	for cid := ContainerID(1); cid <= 3; cid++ {
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := s.CreateContainer(cid, CreateOptions{})
				if err != nil && !errors.Is(err, ErrContainerExists) {
					errs <- err
					return
				}
				if _, err := s.Container(cid); err != nil {
					errs <- err
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("container %d: %v", cid, err)
		}
	}
}
