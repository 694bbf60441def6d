package storage

import (
	"sync"
	"testing"
)

// CheckSpace and SyncContainers may run while CreateContainer of the same
// ID is in progress (a write's space check beside the create its first
// write triggers): they must not read the container's volume before the
// create has set it (go test -race found this through the S3 gateway).
func TestCheckSpaceDuringCreate(t *testing.T) {
	s := openStore(t, Options{Volumes: []string{t.TempDir(), t.TempDir()}})
	for cid := ContainerID(1); cid <= 40; cid++ {
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if _, err := s.CreateContainer(cid, CreateOptions{}); err != nil {
				t.Error(err)
			}
		}()
		go func() {
			defer wg.Done()
			for range 50 {
				if err := s.CheckSpace(cid, 4096); err != nil {
					t.Error(err)
					return
				}
				if err := s.SyncContainers([]ContainerID{cid}); err != nil {
					t.Error(err)
					return
				}
			}
		}()
		wg.Wait()
	}
}
