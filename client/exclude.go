package client

import (
	"fmt"
	"slices"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// maxExcluded bounds each list of an exclude list; a key that needs more
// exclusions than this has failed for other reasons.
const maxExcluded = 256

// excludeList is what a writer asks the allocator to avoid: datanodes that
// failed, pipelines that failed as a whole (timeouts, lagging replicas, no
// leader) and containers that are closed or full.
type excludeList struct {
	datanodes, pipelines, containers []uint64
}

func addID(s []uint64, id uint64) []uint64 {
	if id == 0 || slices.Contains(s, id) || len(s) >= maxExcluded {
		return s
	}
	return append(s, id)
}

func (e *excludeList) addDatanode(id uint64)  { e.datanodes = addID(e.datanodes, id) }
func (e *excludeList) addPipeline(id uint64)  { e.pipelines = addID(e.pipelines, id) }
func (e *excludeList) addContainer(id uint64) { e.containers = addID(e.containers, id) }

func (e *excludeList) empty() bool {
	return len(e.datanodes) == 0 && len(e.pipelines) == 0 && len(e.containers) == 0
}

func (e *excludeList) proto() *metapb.ExcludeList {
	if e.empty() {
		return nil
	}
	return &metapb.ExcludeList{Datanodes: slices.Clone(e.datanodes), Pipelines: slices.Clone(e.pipelines), Containers: slices.Clone(e.containers)}
}

// excludes reports whether blk is on anything excluded: pre-allocated
// blocks there are dropped rather than tried.
func (e *excludeList) excludes(blk *metapb.BlockLocation) bool {
	if slices.Contains(e.pipelines, blk.PipelineId) || slices.Contains(e.containers, blk.GetId().GetContainerId()) {
		return true
	}
	for _, d := range blk.Datanodes {
		if slices.Contains(e.datanodes, d.Id) {
			return true
		}
	}
	return false
}

func (e *excludeList) String() string {
	return fmt.Sprintf("datanodes %v pipelines %v containers %v", e.datanodes, e.pipelines, e.containers)
}

// apply adds what a failure implicates.
func (e *excludeList) apply(f *failure) {
	for _, d := range f.datanodes {
		e.addDatanode(d)
	}
	e.addPipeline(f.pipeline)
	e.addContainer(f.container)
}
