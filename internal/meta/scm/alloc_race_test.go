package scm

import (
	"fmt"
	"sync"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestConcurrentAllocationsWhileContainersFill: containers that take two
// blocks, many concurrent allocations and no loop tick in between: every
// allocation must succeed (a caller that had to create a container uses
// it, even if the others' new containers filled up meanwhile).
func TestConcurrentAllocationsWhileContainersFill(t *testing.T) {
	e := newEnv(t, Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3, BlockSize: 1 << 20, ContainerSize: 2 << 20})
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/r%d", i%2))
	}
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				if _, err := e.m.AllocateBlocks(e.ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: metapb.Replication_THREE}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("allocation failed while containers filled: %v", err)
	}
	checkIndexes(t, e.st)
}
