package scm

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/prometheus/client_golang/prometheus"
)

// SlowDiskConfig: SCM's side of slow-disk avoidance. Datanodes place new
// Raft groups and containers off their slow disks themselves and report
// them (HeartbeatRequest.slow_disks); a pipeline created before a disk was
// found slow keeps using it, so SCM closes such pipelines, one at a time,
// and createPipelines replaces them (their new groups and containers land
// elsewhere).
type SlowDiskConfig struct {
	// CloseInterval: at most one pipeline closed for a slow disk per
	// interval, cluster-wide (default 2m; negative: never).
	CloseInterval time.Duration
	// MinAge: a pipeline younger than this is not closed for a slow disk
	// (default CloseInterval), so a replacement is not churned at once.
	MinAge time.Duration
	// MinOpen: only while at least this many pipelines of the pipeline's
	// replication type are open (default 2, at least 2), so writes of
	// every type always have somewhere to go: the last open pipeline of a
	// type is never closed for a slow disk.
	MinOpen int
}

// slowSoft is the leader's in-memory state of slow-disk closes: the rate
// limit (last) and the back-off (by) are per SCM leader, not replicated,
// so a new leader may close one pipeline at once.
type slowSoft struct {
	last    time.Time          // last close for a slow disk
	closed  uint64             // pipelines closed for slow disks during this leadership
	counter prometheus.Counter // basalt_scm_slow_disk_pipeline_closes_total, made at the first close
	// by: per datanode, slow disk and member set, when a pipeline was
	// last closed for it. A pipeline created after that close, on the same
	// members, that the datanode reports on the same disk is the
	// replacement landing where the old one was: closing it would help no
	// more than the first close did, and would repeat every interval; it
	// is left open. Entries go when the datanode stops reporting the disk.
	by map[slowKey]time.Time
}

type slowKey struct {
	dn      uint64
	disk    string
	members string // SetKey of the pipeline's members
}

// slowDisksLocked records a heartbeat's slow disks. Callers hold m.mu.
func (m *Manager) slowDisksLocked(n *nodeSoft, req *metapb.HeartbeatRequest) {
	n.slowDisks = req.SlowDisks
	n.slowPipes = nil
	for _, p := range req.Pipelines {
		if p.SlowDisk != "" {
			if n.slowPipes == nil {
				n.slowPipes = map[uint64]string{}
			}
			n.slowPipes[p.PipelineId] = p.SlowDisk
		}
	}
}

func (c SlowDiskConfig) withDefaults() SlowDiskConfig {
	if c.CloseInterval == 0 {
		c.CloseInterval = 2 * time.Minute
	}
	if c.MinAge == 0 {
		c.MinAge = c.CloseInterval
	}
	if c.MinOpen <= 0 {
		c.MinOpen = 2
	}
	return c
}

// slowDiskVictim picks the oldest open pipeline a healthy member reports on
// a slow disk, if the rate limit and the other bounds allow one, with the
// member and disk it is closed for.
func (m *Manager) slowDiskVictim(now time.Time) (uint64, string, slowKey) {
	c := m.cfg.SlowDisk.withDefaults()
	if c.CloseInterval < 0 {
		return 0, "", slowKey{}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.slow.last.IsZero() && now.Sub(m.slow.last) < c.CloseInterval {
		return 0, "", slowKey{}
	}
	var open []*metapb.Pipeline
	perType := map[metapb.Replication]int{}
	for _, p := range m.st.Pipelines() {
		if p.State == metapb.PipelineState_PIPELINE_OPEN {
			open = append(open, p)
			perType[p.Replication]++
		}
	}
	minOpen := max(c.MinOpen, 2)
	// Forget back-offs whose datanode no longer reports the disk slow.
	for k := range m.slow.by {
		n := m.nodes[k.dn]
		if n == nil || !slices.Contains(slices.Collect(maps.Values(n.slowPipes)), k.disk) {
			delete(m.slow.by, k)
		}
	}
	slices.SortFunc(open, func(a, b *metapb.Pipeline) int {
		if a.CreatedUnixMs != b.CreatedUnixMs {
			return int(a.CreatedUnixMs - b.CreatedUnixMs)
		}
		return int(a.Id - b.Id)
	})
	for _, p := range open {
		if now.Sub(time.UnixMilli(p.CreatedUnixMs)) < c.MinAge || perType[p.Replication] < minOpen {
			continue
		}
		members := SetKey(p.Datanodes)
		for _, dn := range p.Datanodes {
			n := m.nodes[dn]
			if n == nil || n.state != metapb.NodeState_HEALTHY {
				continue
			}
			disk := n.slowPipes[p.Id]
			if disk == "" {
				continue
			}
			k := slowKey{dn, disk, members}
			if at, ok := m.slow.by[k]; ok && p.CreatedUnixMs >= at.UnixMilli() {
				continue // the replacement of a pipeline closed for this disk, on it again
			}
			return p.Id, fmt.Sprintf("slow disk on datanode %d: %s", dn, disk), k
		}
	}
	return 0, "", slowKey{}
}

// closeSlowDiskPipeline closes at most one pipeline on a slow disk (Tick).
func (m *Manager) closeSlowDiskPipeline(ctx context.Context, now time.Time) error {
	id, why, k := m.slowDiskVictim(now)
	if id == 0 {
		return nil
	}
	if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: []uint64{id}, Reason: why}}}); err != nil {
		return err
	}
	m.mu.Lock()
	m.slow.last = now
	m.slow.closed++
	if m.slow.by == nil {
		m.slow.by = map[slowKey]time.Time{}
	}
	m.slow.by[k] = now
	if m.slow.counter == nil {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: "basalt_scm_slow_disk_pipeline_closes_total",
			Help: "Pipelines SCM closed because a member reported their Raft log or an open container on a slow disk."})
		if r := m.cfg.Registerer; r != nil {
			if err := r.Register(c); err != nil {
				if are, ok := err.(prometheus.AlreadyRegisteredError); ok {
					c, _ = are.ExistingCollector.(prometheus.Counter)
				}
			}
		}
		m.slow.counter = c
	}
	if m.slow.counter != nil {
		m.slow.counter.Inc()
	}
	m.mu.Unlock()
	m.log.Warn("scm: pipeline closed for a slow disk; a replacement avoids it", "pipeline", id, "reason", why)
	return nil
}
