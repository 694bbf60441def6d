package scm

import (
	"context"
	"fmt"
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
	// MinOpen: only while at least this many pipelines are open (default 2),
	// so writes always have somewhere to go.
	MinOpen int
}

type slowSoft struct {
	last    time.Time          // last close for a slow disk
	closed  uint64             // pipelines closed for slow disks during this leadership
	counter prometheus.Counter // basalt_scm_slow_disk_pipeline_closes_total, made at the first close
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
// a slow disk, if the rate limit and the other bounds allow one.
func (m *Manager) slowDiskVictim(now time.Time) (uint64, string) {
	c := m.cfg.SlowDisk.withDefaults()
	if c.CloseInterval < 0 {
		return 0, ""
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.slow.last.IsZero() && now.Sub(m.slow.last) < c.CloseInterval {
		return 0, ""
	}
	var open []*metapb.Pipeline
	for _, p := range m.st.Pipelines() {
		if p.State == metapb.PipelineState_PIPELINE_OPEN {
			open = append(open, p)
		}
	}
	if len(open) < c.MinOpen {
		return 0, ""
	}
	slices.SortFunc(open, func(a, b *metapb.Pipeline) int {
		if a.CreatedUnixMs != b.CreatedUnixMs {
			return int(a.CreatedUnixMs - b.CreatedUnixMs)
		}
		return int(a.Id - b.Id)
	})
	for _, p := range open {
		if now.Sub(time.UnixMilli(p.CreatedUnixMs)) < c.MinAge {
			continue
		}
		for _, dn := range p.Datanodes {
			n := m.nodes[dn]
			if n == nil || n.state != metapb.NodeState_HEALTHY {
				continue
			}
			if disk := n.slowPipes[p.Id]; disk != "" {
				return p.Id, fmt.Sprintf("slow disk on datanode %d: %s", dn, disk)
			}
		}
	}
	return 0, ""
}

// closeSlowDiskPipeline closes at most one pipeline on a slow disk (Tick).
func (m *Manager) closeSlowDiskPipeline(ctx context.Context, now time.Time) error {
	id, why := m.slowDiskVictim(now)
	if id == 0 {
		return nil
	}
	if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: []uint64{id}, Reason: why}}}); err != nil {
		return err
	}
	m.mu.Lock()
	m.slow.last = now
	m.slow.closed++
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
