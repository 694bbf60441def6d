package client

import (
	"fmt"
	"slices"
	"sync"
	"time"

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

// DefaultExcludeFor is how long the client as a whole avoids what a write
// found failing (Ozone keeps its exclude list 600 s).
const DefaultExcludeFor = 10 * time.Minute

// sharedExclude is the client-wide exclude list: what any key's write
// found failing (datanodes, pipelines, containers), avoided by every
// later allocation of this client until it expires. A key adds its
// failures here as well as to its own list; an allocation sends the union.
// If the union leaves nothing to allocate from, the allocation is asked
// again with the key's own list only (blockSource.next): the shared list
// is advice from other keys, not a reason to fail this one.
type sharedExclude struct {
	ttl time.Duration
	mu  sync.Mutex
	// id → expiry, per kind
	datanodes, pipelines, containers map[uint64]time.Time
}

func newSharedExclude(ttl time.Duration) *sharedExclude {
	return &sharedExclude{ttl: ttl, datanodes: map[uint64]time.Time{}, pipelines: map[uint64]time.Time{}, containers: map[uint64]time.Time{}}
}

func (s *sharedExclude) add(f *failure) {
	if f == nil || f.fatal {
		return
	}
	until := time.Now().Add(s.ttl)
	s.mu.Lock()
	defer s.mu.Unlock()
	put := func(m map[uint64]time.Time, id uint64) {
		if id != 0 && (len(m) < maxExcluded || !m[id].IsZero()) {
			m[id] = until
		}
	}
	for _, d := range f.datanodes {
		put(s.datanodes, d)
	}
	put(s.pipelines, f.pipeline)
	put(s.containers, f.container)
}

// snapshot returns the entries that have not expired (dropping the rest).
func (s *sharedExclude) snapshot() excludeList {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	var e excludeList
	live := func(m map[uint64]time.Time) []uint64 {
		var out []uint64
		for id, until := range m {
			if now.After(until) {
				delete(m, id)
				continue
			}
			out = append(out, id)
		}
		slices.Sort(out)
		return out
	}
	e.datanodes, e.pipelines, e.containers = live(s.datanodes), live(s.pipelines), live(s.containers)
	return e
}

// Excluded returns what the client currently avoids for new blocks (IDs
// of datanodes, pipelines and containers that failed a write within
// Config.ExcludeFor).
func (c *Client) Excluded() (datanodes, pipelines, containers []uint64) {
	e := c.excl.snapshot()
	return e.datanodes, e.pipelines, e.containers
}

// union returns a copy of e with o's entries added.
func (e *excludeList) union(o excludeList) excludeList {
	u := excludeList{datanodes: slices.Clone(e.datanodes), pipelines: slices.Clone(e.pipelines), containers: slices.Clone(e.containers)}
	for _, d := range o.datanodes {
		u.addDatanode(d)
	}
	for _, p := range o.pipelines {
		u.addPipeline(p)
	}
	for _, c := range o.containers {
		u.addContainer(c)
	}
	return u
}

func (s *sharedExclude) empty() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.datanodes)+len(s.pipelines)+len(s.containers) == 0
}
