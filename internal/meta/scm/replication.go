package scm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The replication manager (Ozone's ReplicationManager, HDFS's
// re-replication) keeps every CLOSED container at its replication factor.
// Each round (Tick, on the leader) it classifies every closed container
// from the replicated State and the datanodes' last reports:
//
//   - healthy: exactly as many healthy replicas as the factor;
//   - under_replicated: fewer (a replica on a dead datanode, recorded
//     UNHEALTHY, or missing from its datanode's full report);
//   - over_replicated: more;
//   - missing: none at all. An alarm: logged at ERROR, counted, shown by
//     `basalt admin container health`; nothing can repair it.
//
// It repairs in this order: a verified copy reported by a datanode that is
// not yet a replica is recorded (ReplicaAddedOp); bad replicas of a
// container back at its factor are dropped (ReplicasRemovedOp), and so is
// one replica too many; then copies are scheduled for the under-replicated
// containers, fewest healthy replicas first, each to a target chosen by
// placement and throttled per target. A datanode holding a replica SCM no
// longer lists is told to delete it (commandsFor).
//
// The schedule (copies in flight) is soft state on the leader, like every
// command: a new leader rebuilds it. The replica sets are not: a copy
// counts only once ReplicaAddedOp is applied, and a replica goes only
// through ReplicasRemovedOp after its replacement was recorded, so a
// failover in the middle of a repair loses at most the copy in flight (the
// new leader adopts it from the target's report, or schedules it again).

// Health classes of a container (the label of basalt_scm_containers).
const (
	HealthHealthy         = "healthy"
	HealthUnderReplicated = "under_replicated"
	HealthOverReplicated  = "over_replicated"
	HealthMissing         = "missing"
	// HealthMisReplicated: enough healthy replicas, but all on one rack
	// while the cluster's live datanodes span two or more (a copy goes to
	// another rack, then one replica on the crowded rack is dropped).
	HealthMisReplicated = "mis_replicated"
	// HealthUnhealthyReplicas counts containers with a replica recorded
	// UNHEALTHY, whatever their class.
	HealthUnhealthyReplicas = "unhealthy_replicas"
)

// ReplicaStatus is how the replication manager sees one recorded replica.
type ReplicaStatus int

const (
	ReplicaHealthy   ReplicaStatus = iota // live and reported (or not yet fully reported)
	ReplicaUnhealthy                      // recorded or reported UNHEALTHY
	ReplicaDead                           // its datanode is DEAD (or unknown)
	ReplicaMissing                        // its datanode's full report lacks it
	// ReplicaLagging: reported CLOSED with a committed index (BCSID) below
	// the highest among the container's closed replicas: it lacks writes
	// the others have (Ozone's quasi-closed handling); replaced by a copy
	// of a replica with the highest.
	ReplicaLagging
	// ReplicaDecommissioning: on a DECOMMISSIONING or DECOMMISSIONED
	// datanode: not counted, a copy source while live, dropped once the
	// container has its full count elsewhere.
	ReplicaDecommissioning
	// ReplicaMaintenance: on a datanode entering or in maintenance: not
	// counted, kept; the container needs only min(2, factor) elsewhere.
	ReplicaMaintenance
)

func (s ReplicaStatus) String() string {
	return [...]string{"healthy", "unhealthy", "dead", "missing", "lagging", "decommissioning", "maintenance"}[s]
}

// Classification is one container's health.
type Classification struct {
	Health  string
	Want    int      // the replication factor
	Need    int      // healthy replicas it must have now (Want, less for maintenance)
	Healthy []uint64 // replicas that count
	Bad     []uint64 // replicas that do not (unhealthy, dead, missing, lagging)
	Decom   []uint64 // on decommissioning datanodes: not counted, sources
	Maint   []uint64 // on datanodes in maintenance: not counted, kept
}

// Classify classifies a container from the status of each of its recorded
// replicas. With replicas in maintenance it needs only
// max(factor - in maintenance, min(2, factor)) healthy ones.
func Classify(c *metapb.Container, status func(dn uint64) ReplicaStatus) Classification {
	cl := Classification{Want: max(int(c.Replication), 1)}
	for _, r := range c.Replicas {
		switch status(r) {
		case ReplicaHealthy:
			cl.Healthy = append(cl.Healthy, r)
		case ReplicaDecommissioning:
			cl.Decom = append(cl.Decom, r)
		case ReplicaMaintenance:
			cl.Maint = append(cl.Maint, r)
		default:
			cl.Bad = append(cl.Bad, r)
		}
	}
	cl.Need = cl.Want
	if len(cl.Maint) > 0 {
		cl.Need = max(cl.Want-len(cl.Maint), min(2, cl.Want))
	}
	switch n := len(cl.Healthy); {
	case n == 0 && len(cl.Decom)+len(cl.Maint) == 0:
		cl.Health = HealthMissing
	case n < cl.Need:
		cl.Health = HealthUnderReplicated
	case n > cl.Want:
		cl.Health = HealthOverReplicated
	default:
		cl.Health = HealthHealthy
	}
	return cl
}

// TargetCandidate is a datanode that may receive a copy.
type TargetCandidate struct {
	ID             uint64
	Rack           string
	Available      uint64 // free bytes beyond the reserve (best volume)
	AvailableKnown bool
	InFlight       int // copies already going to it
}

// ChooseTarget picks the datanode a copy of a container of need bytes goes
// to, among cands (which the caller limited to healthy datanodes that are
// not replicas, not throttled, and did not fail this copy before):
// one with room; off the replicas' rack if they all share one and the
// cluster has two racks or more (Ozone's rack-aware placement: a rack
// failure must not take every copy); then most free space, fewest copies
// in flight, lowest ID. It falls back to the same rack rather than leave a
// container under-replicated. ok is false when no candidate has room.
func ChooseTarget(cands []TargetCandidate, replicaRacks []string, clusterRacks int, need uint64) (id uint64, ok bool) {
	var fit []TargetCandidate
	for _, c := range cands {
		if c.AvailableKnown && c.Available < need {
			continue
		}
		fit = append(fit, c)
	}
	if len(fit) == 0 {
		return 0, false
	}
	if clusterRacks >= 2 && len(replicaRacks) > 0 {
		one := true
		for _, r := range replicaRacks[1:] {
			if r != replicaRacks[0] {
				one = false
			}
		}
		if one {
			var other []TargetCandidate
			for _, c := range fit {
				if c.Rack != replicaRacks[0] {
					other = append(other, c)
				}
			}
			if len(other) > 0 {
				fit = other
			}
		}
	}
	best := slices.MinFunc(fit, func(a, b TargetCandidate) int {
		return cmp.Or(-cmp.Compare(a.Available, b.Available), cmp.Compare(a.InFlight, b.InFlight), cmp.Compare(a.ID, b.ID))
	})
	return best.ID, true
}

// copyTask is a copy in flight: target was sent ReplicateContainer.
type copyTask struct {
	cid     uint64
	target  uint64
	sources []uint64
	started time.Time
	bytes   uint64
}

// copied is a copy recorded, for the repair rate.
type copied struct {
	at    time.Time
	bytes uint64
}

// rateWindow is how far back the repair rate looks.
const rateWindow = 5 * time.Minute

// replSoft is the replication manager's soft state (under Manager.mu;
// reset with the rest on a leadership change).
type replSoft struct {
	copies map[uint64]*copyTask // by container
	// failed: container → targets whose copy failed, and when; not chosen
	// again for that container for failedBackoff.
	failed map[uint64]map[uint64]time.Time
	// good: healthy replica count of each CLOSED container at the last
	// round, so commandsFor deletes a stray replica only of a container
	// known to be whole.
	good    map[uint64]int
	alarmed map[uint64]bool // missing containers already logged
	last    *metapb.GetContainerHealthResponse
	all     []*metapb.ContainerHealth // not healthy, worst first
	done    uint64
	failedN uint64
	// drain: decommission and maintenance progress per datanode.
	drain map[uint64]drainStat
	// recorded: copies recorded within rateWindow (at most maxRecorded).
	recorded  []copied
	bytesLeft uint64
}

const maxRecorded = 4096

func newReplSoft() replSoft {
	return replSoft{copies: map[uint64]*copyTask{}, failed: map[uint64]map[uint64]time.Time{}, good: map[uint64]int{}, alarmed: map[uint64]bool{},
		drain: map[uint64]drainStat{}}
}

// Bounds of one replication round.
const (
	// maxReplicationOps: Raft proposals (replicas added or removed) per
	// round; the rest wait for the next round.
	maxReplicationOps = 256
	// maxCopiesInFlight bounds the copies scheduled cluster-wide.
	maxCopiesInFlight = 1024
	// maxWorst bounds the containers GetContainerHealth lists.
	maxWorst = 1000
)

type replMetrics struct {
	containers *prometheus.GaugeVec
	inFlight   prometheus.Gauge
	copies     *prometheus.CounterVec
	bytes      *prometheus.GaugeVec
	opStates   *prometheus.GaugeVec
}

func newReplMetrics(reg prometheus.Registerer) *replMetrics {
	m := &replMetrics{
		containers: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "basalt_scm_containers",
			Help: "Closed containers by replica health at the replication manager's last round (SCM leader)."}, []string{"health"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "basalt_scm_replication_copies_in_flight",
			Help: "Container copies scheduled and not yet recorded (SCM leader)."}),
		copies: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "basalt_scm_replication_copies_total",
			Help: "Container copies finished, by result (done: recorded; failed: timed out or target lost)."}, []string{"result"}),
		bytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "basalt_scm_replication_bytes",
			Help: "Re-replication bytes at the last round: in_flight (copies running), left (containers short of replicas) (SCM leader)."}, []string{"kind"}),
		opStates: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "basalt_scm_datanodes_by_op_state",
			Help: "Datanodes by operational state (decommission, maintenance) at the last round (SCM leader)."}, []string{"state"}),
	}
	if reg != nil {
		m.containers = register(reg, m.containers)
		m.inFlight = register(reg, m.inFlight)
		m.copies = register(reg, m.copies)
		m.bytes = register(reg, m.bytes)
		m.opStates = register(reg, m.opStates)
	}
	return m
}

// register registers c, or returns the collector already registered under
// its name (several meta nodes in one process may share a registry; only
// the leader sets the values).
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if old, ok := are.ExistingCollector.(C); ok {
				return old
			}
		}
	}
	return c
}

// replicaStatusLocked is how this leader sees datanode dn's replica of c.
// Callers hold m.mu.
func (m *Manager) replicaStatusLocked(c *metapb.Container, dn uint64) ReplicaStatus {
	if slices.Contains(c.UnhealthyReplicas, dn) || m.unhealthy[c.Id][dn] != "" {
		return ReplicaUnhealthy
	}
	op := m.st.OpState(dn).State
	if op == metapb.NodeOpState_IN_MAINTENANCE {
		return ReplicaMaintenance // down or not: that is what maintenance is for
	}
	n := m.nodes[dn]
	if n == nil || n.state == metapb.NodeState_DEAD || m.st.Datanode(dn) == nil {
		return ReplicaDead
	}
	offline := func() ReplicaStatus {
		switch {
		case isMaintenance(op):
			return ReplicaMaintenance
		case isDecommission(op):
			return ReplicaDecommissioning
		}
		return ReplicaHealthy
	}
	if !n.fullReported {
		return offline() // not heard in full yet under this leader
	}
	rep := n.containers[c.Id]
	switch {
	case rep == nil && n.pipelines[c.PipelineId] && !m.pipelineOpenLocked(c.PipelineId):
		// Its datanode still runs the container's closed pipeline: a
		// replica whose log apply lags (slow disk) creates the container
		// on its first write, which may still be coming (closedReports
		// closed the container without it). Not missing until it left
		// the pipeline (commandsFor tells it to, within
		// 2*CommandRetryInterval of the close), so no copy is made on the
		// strength of a replica the log is still writing.
		return offline()
	case rep == nil:
		return ReplicaMissing
	case rep.State == metapb.ContainerState_CONTAINER_UNHEALTHY:
		return ReplicaUnhealthy
	case c.State == metapb.ContainerState_CONTAINER_CLOSED && rep.State == metapb.ContainerState_CONTAINER_CLOSED && rep.Bcsid < max(m.newestLocked(c), bcsidFloor(c)):
		// Below the newest live replica, or below what a replica dropped
		// since (or the close) is recorded to have held: it lacks
		// committed writes.
		return ReplicaLagging
	}
	return offline()
}

// hostsPipelineLocked reports whether datanode dn (soft state n) may
// still apply writes to container c through c's pipeline: it reports
// running the pipeline, or the pipeline is open and dn a member of it
// (about to create it). Callers hold m.mu.
func (m *Manager) hostsPipelineLocked(c *metapb.Container, dn uint64, n *nodeSoft) bool {
	if c.PipelineId == 0 {
		return false
	}
	if n != nil && n.pipelines[c.PipelineId] {
		return true
	}
	p := m.st.Pipeline(c.PipelineId)
	return p != nil && p.State == metapb.PipelineState_PIPELINE_OPEN && slices.Contains(p.Datanodes, dn)
}

// pipelineOpenLocked reports whether pipeline id is OPEN. Callers hold m.mu.
func (m *Manager) pipelineOpenLocked(id uint64) bool {
	p := m.st.Pipeline(id)
	return p != nil && p.State == metapb.PipelineState_PIPELINE_OPEN
}

// verifiedLocked returns the replicas of c among healthy whose datanode
// has sent this leader a full container report listing c (the healthy
// ones that are more than a record). Callers hold m.mu.
func (m *Manager) verifiedLocked(c *metapb.Container, healthy []uint64) []uint64 {
	var out []uint64
	for _, r := range healthy {
		if n := m.nodes[r]; n != nil && n.fullReported && n.containers[c.Id] != nil {
			out = append(out, r)
		}
	}
	return out
}

// newestLocked is the highest committed index (BCSID) a live replica of
// c not recorded unhealthy reports for it CLOSED. Callers hold m.mu.
func (m *Manager) newestLocked(c *metapb.Container) uint64 {
	var newest uint64
	for _, r := range c.Replicas {
		if slices.Contains(c.UnhealthyReplicas, r) {
			continue
		}
		if n := m.nodes[r]; n != nil && n.state != metapb.NodeState_DEAD {
			if rep := n.containers[c.Id]; rep != nil && rep.State == metapb.ContainerState_CONTAINER_CLOSED {
				newest = max(newest, rep.Bcsid)
			}
		}
	}
	return newest
}

// bcsidFloor is the BCSID below which SCM's replicated state says a
// replica of c lacks acknowledged writes (Container.bcsid_floor: the
// close's lowest healthy BCSID, a drop's capped one, dropBcsidsLocked): no replica below it counts or is a copy source.
func bcsidFloor(c *metapb.Container) uint64 { return c.GetBcsidFloor().GetBcsid() }

// dropBcsidsLocked is, for each of drop, the BCSID the ReplicasRemovedOp
// that drops it carries (Apply raises Container.bcsid_floor to the highest
// of those really dropped): the BCSID its datanode last reported for c (0
// if not known to this leader: never reported, or not since it became
// leader), capped at the highest BCSID among the healthy replicas the op
// keeps. Invariant: a drop never makes a replica it keeps lagging. A write
// is acknowledged only once every pipeline member applied it (WaitAll),
// so whatever a dropped replica held above a healthy kept one was never
// acknowledged. Healthy kept: not dropped, not recorded unhealthy, not
// pending as unhealthy, and not reporting UNHEALTHY; one with no report
// known to this leader counts with BCSID 0 (the floor is not raised on
// its account: never above a replica whose BCSID is unknown). Only when
// the op keeps no healthy replica (all recorded or reporting UNHEALTHY:
// the recover case) does the dropped replica's own BCSID travel. The
// proposer computes the value; Apply reads only the op. Callers hold
// m.mu.
func (m *Manager) dropBcsidsLocked(c *metapb.Container, drop []uint64) []uint64 {
	var keptMax uint64
	healthyKept := false
	for _, r := range c.Replicas {
		if slices.Contains(drop, r) || slices.Contains(c.UnhealthyReplicas, r) || m.unhealthy[c.Id][r] != "" {
			continue
		}
		var rep *metapb.ContainerReport
		if n := m.nodes[r]; n != nil {
			rep = n.containers[c.Id]
		}
		if rep != nil && rep.State == metapb.ContainerState_CONTAINER_UNHEALTHY {
			continue
		}
		healthyKept = true
		if rep != nil && rep.State == metapb.ContainerState_CONTAINER_CLOSED {
			keptMax = max(keptMax, rep.Bcsid)
		}
	}
	out := make([]uint64, len(drop))
	for i, dn := range drop {
		if n := m.nodes[dn]; n != nil {
			if rep := n.containers[c.Id]; rep != nil {
				out[i] = rep.Bcsid
			}
		}
		if healthyKept {
			out[i] = min(out[i], keptMax)
		}
	}
	return out
}

// adoptableLocked is the first of extra (datanodes in service, live,
// reporting a CLOSED copy of c in a full report) that is not a replica of
// c and whose copy is at or above both the newest live replica and the
// floor; a stale copy (an old replica come back) is no source of truth.
// Callers hold m.mu.
func (m *Manager) adoptableLocked(c *metapb.Container, extra []uint64) (uint64, bool) {
	newest := max(m.newestLocked(c), bcsidFloor(c))
	for _, dn := range extra {
		if slices.Contains(c.Replicas, dn) {
			continue
		}
		if rep := m.nodes[dn].containers[c.Id]; rep == nil || rep.Bcsid < newest {
			continue
		}
		return dn, true
	}
	return 0, false
}

// replOp is one replica-set change a round decided on.
type replOp struct {
	cmd  *metapb.ScmCommand
	what string
	cid  uint64
	dn   uint64 // ReplicaAdded: the new replica (ends its copy)
}

// replicate runs one round of the replication manager. It decides under
// m.mu and proposes outside it.
func (m *Manager) replicate(ctx context.Context) error {
	now := m.cfg.Now()
	m.mu.Lock()
	if !m.leading {
		m.mu.Unlock()
		return nil
	}
	ops, missing, trans := m.planLocked(now)
	m.mu.Unlock()
	for _, cid := range missing {
		m.log.Error("scm: container MISSING: no healthy replica left; data in it is unreadable until a replica returns", "container", cid)
	}
	for _, op := range ops {
		if _, err := m.propose(ctx, op.cmd); err != nil {
			m.log.Warn("scm: replication: "+op.what, "container", op.cid, "err", err)
			continue
		}
		m.log.Info("scm: replication: "+op.what, "container", op.cid)
		if op.dn != 0 {
			m.mu.Lock()
			if t := m.repl.copies[op.cid]; t != nil && t.target == op.dn {
				delete(m.repl.copies, op.cid)
				m.repl.done++
				m.metrics.copies.WithLabelValues("done").Inc()
			}
			if c := m.st.Container(op.cid); c != nil {
				m.repl.recorded = append(m.repl.recorded, copied{at: now, bytes: c.UsedBytes})
				if len(m.repl.recorded) > maxRecorded {
					m.repl.recorded = slices.Delete(m.repl.recorded, 0, len(m.repl.recorded)-maxRecorded)
				}
			}
			m.mu.Unlock()
		}
	}
	for _, op := range trans {
		res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_SetNodeOpState{SetNodeOpState: op}})
		if err != nil {
			m.log.Warn("scm: datanode operational state", "datanode", op.DatanodeId, "to", op.State, "err", err)
			continue
		}
		if row, ok := res.(*metapb.NodeOpRow); ok && row.State == op.State {
			m.log.Info("scm: datanode operational state", "datanode", op.DatanodeId, "to", op.State)
		}
	}
	return nil
}

// planLocked classifies every container, updates the health summary and
// gauges, times out copies, schedules new ones, and returns the replica
// set changes to propose, the containers newly found missing, and the
// operational-state changes the round allows. Callers hold m.mu.
func (m *Manager) planLocked(now time.Time) (ops []replOp, newlyMissing []uint64, trans []*metapb.SetNodeOpStateOp) {
	rs := &m.repl
	// Copies that will not finish: target gone, or too slow.
	for cid, t := range rs.copies {
		n := m.nodes[t.target]
		c := m.st.Container(cid)
		if c != nil && slices.Contains(c.Replicas, t.target) {
			delete(rs.copies, cid) // recorded (by this leader or a previous one)
			continue
		}
		if n == nil || n.state != metapb.NodeState_HEALTHY || now.Sub(t.started) >= m.cfg.CopyTimeout || c == nil || c.State != metapb.ContainerState_CONTAINER_CLOSED {
			m.log.Warn("scm: replication: copy given up; trying elsewhere", "container", cid, "target", t.target, "age", now.Sub(t.started).Round(time.Millisecond))
			m.giveUpLocked(t, now)
		}
	}
	for cid, ts := range rs.failed {
		for dn, at := range ts {
			if now.Sub(at) >= m.failedBackoff() {
				delete(ts, dn)
			}
		}
		if len(ts) == 0 {
			delete(rs.failed, cid)
		}
	}
	// Who reports a closed copy it is not a recorded replica of.
	extra := map[uint64][]uint64{}
	inFlight := map[uint64]int{}
	bytesInFlight := map[uint64]uint64{}
	var allInFlight uint64
	for _, t := range rs.copies {
		inFlight[t.target]++
		bytesInFlight[t.target] += t.bytes
		allInFlight += t.bytes
	}
	dns := m.st.Datanodes()
	racks := map[uint64]string{}
	rackSet := map[string]bool{}
	liveRacks := map[string]bool{} // racks of live datanodes in service
	for _, d := range dns {
		racks[d.Id] = d.Location
		rackSet[d.Location] = true
	}
	for _, d := range dns {
		n := m.nodes[d.Id]
		if n == nil || n.state != metapb.NodeState_HEALTHY || !m.inService(d.Id) {
			continue
		}
		liveRacks[d.Location] = true
		for cid, rep := range n.containers {
			if rep.State == metapb.ContainerState_CONTAINER_CLOSED {
				extra[cid] = append(extra[cid], d.Id)
			}
		}
	}
	// blocked: datanodes still in an open pipeline or holding a replica
	// of an unclosed container; they are not drained yet.
	blocked := map[uint64]bool{}
	for _, p := range slices.Concat(m.st.OpenPipelines(metapb.Replication_ONE), m.st.OpenPipelines(metapb.Replication_THREE)) {
		for _, id := range p.Datanodes {
			blocked[id] = true
		}
	}
	drain := map[uint64]drainStat{}

	counts := map[string]uint64{HealthHealthy: 0, HealthUnderReplicated: 0, HealthOverReplicated: 0, HealthMisReplicated: 0, HealthMissing: 0, HealthUnhealthyReplicas: 0, "closing": 0, "open": 0}
	type under struct {
		c   *metapb.Container
		cl  Classification
		mis bool
	}
	var unders []under
	var bad []*metapb.ContainerHealth
	good := map[uint64]int{}
	missingNow := map[uint64]bool{}
	for _, c := range m.st.Containers() {
		switch c.State {
		case metapb.ContainerState_CONTAINER_OPEN:
			counts["open"]++
			for _, r := range c.Replicas {
				blocked[r] = true
			}
			continue
		case metapb.ContainerState_CONTAINER_CLOSING:
			// Closed by the existing paths (closedReports skips dead and
			// unhealthy replicas); repaired once CLOSED. One that can
			// never close because no replica is left, and that held data
			// when last reported (a ONE container on a dead datanode), is
			// missing.
			counts["closing"]++
			for _, r := range c.Replicas {
				blocked[r] = true
			}
			if m.lostLocked(c) {
				counts[HealthMissing]++
				missingNow[c.Id] = true
				bad = append(bad, &metapb.ContainerHealth{ContainerId: c.Id, State: c.State, Health: HealthMissing,
					WantReplicas: uint32(max(int(c.Replication), 1)), Replicas: c.Replicas, Unhealthy: c.Replicas, UsedBytes: c.UsedBytes})
				if !rs.alarmed[c.Id] {
					rs.alarmed[c.Id] = true
					newlyMissing = append(newlyMissing, c.Id)
				}
			}
			continue
		case metapb.ContainerState_CONTAINER_CLOSED:
		default:
			continue
		}
		if c.UsedBytes == 0 && !reportedAny(m, c) {
			// Closed before any replica got a write: nothing to lose
			// or copy (replicas create a container on the first write).
			counts[HealthHealthy]++
			continue
		}
		cl := Classify(c, func(dn uint64) ReplicaStatus { return m.replicaStatusLocked(c, dn) })
		// verified: the healthy replicas this leader has seen, in a full
		// report of their datanode. A replica on a datanode not heard in
		// full yet counts as healthy (its grace period: nothing is copied
		// for it) but is only what the replicated state remembers; after
		// a failover or a cold start it may be gone. Nothing is removed
		// (a replica dropped, a datanode told to delete a copy, a datanode
		// let go) on the strength of unverified replicas.
		verified := m.verifiedLocked(c, cl.Healthy)
		// Drain progress of the replicas on datanodes leaving service:
		// every recorded replica on such a datanode, however it is
		// classified (one on a dead decommissioning datanode is Bad, and
		// may be the only copy).
		for _, r := range c.Replicas {
			op := m.st.OpState(r).State
			if !isDecommission(op) && !isMaintenance(op) {
				continue
			}
			d := drain[r]
			d.containers++
			enough := len(verified) >= cl.Want
			if isMaintenance(op) {
				enough = len(verified) >= min(2, cl.Want)
			}
			if !enough {
				d.left++
				d.bytesLeft += c.UsedBytes
			}
			drain[r] = d
		}
		// Replicas in maintenance come back: their racks count for the
		// rack rule (those of decommissioning ones do not).
		if cl.Health == HealthHealthy && cl.Want >= 2 && len(liveRacks) >= 2 && oneRack(slices.Concat(cl.Healthy, cl.Maint), racks) {
			cl.Health = HealthMisReplicated
		}
		counts[cl.Health]++
		if len(c.UnhealthyReplicas) > 0 {
			counts[HealthUnhealthyReplicas]++
		}
		good[c.Id] = len(verified)
		if cl.Health != HealthHealthy {
			h := &metapb.ContainerHealth{ContainerId: c.Id, State: c.State, Health: cl.Health, HealthyReplicas: uint32(len(cl.Healthy)),
				WantReplicas: uint32(cl.Want), Replicas: c.Replicas, Unhealthy: slices.Concat(cl.Bad, cl.Decom, cl.Maint), UsedBytes: c.UsedBytes}
			if t := rs.copies[c.Id]; t != nil {
				h.CopyTarget = t.target
			}
			bad = append(bad, h)
		}
		if cl.Health == HealthMissing {
			missingNow[c.Id] = true
			if !rs.alarmed[c.Id] {
				rs.alarmed[c.Id] = true
				newlyMissing = append(newlyMissing, c.Id)
			}
			// A verified CLOSED copy at or above the floor on a datanode
			// that is not a replica (the dropped replica's datanode come
			// back) holds everything acknowledged: adopt it, and the
			// container heals without anyone accepting a loss. Only with
			// a floor set: without one, nothing bounds what the dead or
			// missing replicas held.
			if bcsidFloor(c) > 0 && len(ops) < maxReplicationOps {
				if dn, ok := m.adoptableLocked(c, extra[c.Id]); ok {
					ops = append(ops, replOp{what: fmt.Sprintf("replica on datanode %d recorded (at or above the floor of a missing container)", dn), cid: c.Id, dn: dn,
						cmd: &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: c.Id, DatanodeId: dn}}}})
				}
			}
			continue
		}
		if len(ops) >= maxReplicationOps {
			continue
		}
		// 1. A verified copy on a datanode that is not a replica yet:
		// record it if the container needs it, or if this leader asked
		// for it (the container may have become whole another way; the
		// extra replica then goes in a later round). Its replica set
		// grows first; removals wait for a later round.
		if t := rs.copies[c.Id]; t != nil && len(cl.Healthy) >= cl.Need && slices.Contains(extra[c.Id], t.target) {
			ops = append(ops, replOp{what: fmt.Sprintf("replica on datanode %d recorded", t.target), cid: c.Id, dn: t.target,
				cmd: &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: c.Id, DatanodeId: t.target}}}})
			continue
		}
		if len(cl.Healthy) < cl.Need {
			if dn, ok := m.adoptableLocked(c, extra[c.Id]); ok {
				ops = append(ops, replOp{what: fmt.Sprintf("replica on datanode %d recorded", dn), cid: c.Id, dn: dn,
					cmd: &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaAdded{ReplicaAdded: &metapb.ReplicaAddedOp{ContainerId: c.Id, DatanodeId: dn}}}})
				continue
			}
			unders = append(unders, under{c: c, cl: cl})
			continue
		}
		// 2. Back at (or above) the factor: drop what does not count
		// (replicas on decommissioning datanodes too), then one replica
		// too many. Never while a copy is in flight (it may be what makes
		// the count), and not while replicas in maintenance stand in for
		// healthy ones.
		if rs.copies[c.Id] != nil {
			continue
		}
		if cl.Health == HealthMisReplicated {
			unders = append(unders, under{c: c, cl: cl, mis: true})
			continue
		}
		if len(verified) < cl.Want {
			continue // the count rests on replicas not seen yet: remove nothing
		}
		if drop := slices.Concat(cl.Bad, cl.Decom); len(drop) > 0 {
			ops = append(ops, replOp{what: fmt.Sprintf("replicas %v dropped (replaced)", drop), cid: c.Id,
				cmd: &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{ContainerId: c.Id, DatanodeIds: drop, Reason: "replaced by healthy replicas", Bcsids: m.dropBcsidsLocked(c, drop)}}}})
			continue
		}
		if len(cl.Healthy) > cl.Want {
			if len(verified) < len(cl.Healthy) {
				continue // one too many only once every replica was seen
			}
			victim := extraReplica(verified, racks)
			ops = append(ops, replOp{what: fmt.Sprintf("replica on datanode %d dropped (over-replicated)", victim), cid: c.Id,
				cmd: &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasRemoved{ReplicasRemoved: &metapb.ReplicasRemovedOp{ContainerId: c.Id, DatanodeIds: []uint64{victim}, Reason: "over-replicated", Bcsids: m.dropBcsidsLocked(c, []uint64{victim})}}}})
		}
	}
	for cid := range rs.alarmed {
		if !missingNow[cid] {
			delete(rs.alarmed, cid)
			m.log.Warn("scm: container no longer missing", "container", cid)
		}
	}
	rs.good = good
	rs.drain = drain
	trans = m.opTransitionsLocked(now, blocked)

	// 3. Schedule copies, fewest healthy replicas first.
	slices.SortFunc(unders, func(a, b under) int {
		return cmp.Or(cmp.Compare(len(a.cl.Healthy), len(b.cl.Healthy)), cmp.Compare(a.c.Id, b.c.Id))
	})
	var bytesLeft uint64
	for _, u := range unders {
		bytesLeft += u.c.UsedBytes
	}
	for _, u := range unders {
		if len(rs.copies) >= maxCopiesInFlight {
			break
		}
		if rs.copies[u.c.Id] != nil {
			continue
		}
		// Never a source below the container's BCSID floor: with a floor
		// set, only a replica whose datanode reported it at or above the
		// floor (one not reported yet under this leader may be older).
		floor := bcsidFloor(u.c)
		belowFloor := func(n *nodeSoft) bool {
			if floor == 0 {
				return false
			}
			rep := n.containers[u.c.Id]
			return rep == nil || rep.Bcsid < floor
		}
		var sources []uint64
		var repRacks []string
		for _, r := range u.cl.Healthy {
			repRacks = append(repRacks, racks[r])
			if n := m.nodes[r]; n != nil && n.state == metapb.NodeState_HEALTHY && !belowFloor(n) {
				sources = append(sources, r)
			}
		}
		// Replicas on datanodes leaving service are sources too, after
		// the ones in service (a decommissioning datanode may hold the
		// only copy of a ONE container).
		var offline []uint64
		for _, r := range slices.Concat(u.cl.Decom, u.cl.Maint) {
			if n := m.nodes[r]; n != nil && n.state == metapb.NodeState_HEALTHY && n.containers[u.c.Id] != nil && !belowFloor(n) {
				offline = append(offline, r)
			}
		}
		if len(sources)+len(offline) == 0 {
			continue // only stale replicas: wait
		}
		// Newest first (highest committed index), then the least busy.
		byNewest := func(a, b uint64) int {
			var ba, bb uint64
			if rep := m.nodes[a].containers[u.c.Id]; rep != nil {
				ba = rep.Bcsid
			}
			if rep := m.nodes[b].containers[u.c.Id]; rep != nil {
				bb = rep.Bcsid
			}
			return cmp.Or(-cmp.Compare(ba, bb), cmp.Compare(a, b))
		}
		slices.SortFunc(sources, byNewest)
		slices.SortFunc(offline, byNewest)
		sources = append(sources, offline...)
		var cands []TargetCandidate
		for _, d := range dns {
			n := m.nodes[d.Id]
			if n == nil || n.state != metapb.NodeState_HEALTHY || !n.heard || slices.Contains(u.c.Replicas, d.Id) || !m.inService(d.Id) ||
				inFlight[d.Id] >= m.cfg.MaxCopiesPerTarget || !rs.failed[u.c.Id][d.Id].IsZero() {
				continue
			}
			if bytesInFlight[d.Id] > 0 && bytesInFlight[d.Id]+u.c.UsedBytes > m.cfg.MaxCopyBytesPerTarget {
				continue // throttled: bytes in flight into it
			}
			if u.mis && len(repRacks) > 0 && d.Location == repRacks[0] {
				continue // mis-replicated: only another rack helps
			}
			if rep := n.containers[u.c.Id]; rep != nil {
				continue // holds an old or broken copy: it must delete it first
			}
			if m.hostsPipelineLocked(u.c, d.Id, n) {
				// Its pipeline's log may still write into the container
				// here: an import would collide with those writes ("import
				// in progress"), fail them and leave the replica UNHEALTHY.
				continue
			}
			tc := TargetCandidate{ID: d.Id, Rack: d.Location, InFlight: inFlight[d.Id]}
			for _, v := range n.volumes {
				if v.AvailableKnown && !v.Failed {
					tc.AvailableKnown = true
					tc.Available = max(tc.Available, v.AvailableBytes)
				}
			}
			cands = append(cands, tc)
		}
		target, ok := ChooseTarget(cands, repRacks, len(rackSet), u.c.UsedBytes)
		if !ok {
			continue
		}
		rs.copies[u.c.Id] = &copyTask{cid: u.c.Id, target: target, sources: sources, started: now, bytes: u.c.UsedBytes}
		inFlight[target]++
		bytesInFlight[target] += u.c.UsedBytes
		allInFlight += u.c.UsedBytes
		m.log.Info("scm: replication: copy scheduled", "container", u.c.Id, "healthy", len(u.cl.Healthy), "want", u.cl.Want, "mis_replicated", u.mis, "target", target, "sources", sources)
	}

	// Summary for GetContainerHealth, worst first.
	slices.SortFunc(bad, func(a, b *metapb.ContainerHealth) int {
		return cmp.Or(cmp.Compare(a.HealthyReplicas, b.HealthyReplicas), cmp.Compare(a.ContainerId, b.ContainerId))
	})
	for _, h := range bad {
		if t := rs.copies[h.ContainerId]; t != nil {
			h.CopyTarget = t.target
		}
	}
	if len(bad) > maxWorst {
		bad = bad[:maxWorst]
	}
	rs.all = bad
	rs.bytesLeft = bytesLeft
	rs.last = &metapb.GetContainerHealthResponse{Counts: counts, RoundUnixMs: now.UnixMilli()}
	for h, n := range counts {
		if h != "open" && h != "closing" {
			m.metrics.containers.WithLabelValues(h).Set(float64(n))
		}
	}
	m.metrics.inFlight.Set(float64(len(rs.copies)))
	m.metrics.bytes.WithLabelValues("in_flight").Set(float64(allInFlight))
	m.metrics.bytes.WithLabelValues("left").Set(float64(bytesLeft))
	ops1 := map[metapb.NodeOpState]int{}
	for _, o := range m.st.OpStates() {
		ops1[o.State]++
	}
	for _, st := range []metapb.NodeOpState{metapb.NodeOpState_DECOMMISSIONING, metapb.NodeOpState_DECOMMISSIONED, metapb.NodeOpState_ENTERING_MAINTENANCE, metapb.NodeOpState_IN_MAINTENANCE} {
		m.metrics.opStates.WithLabelValues(strings.ToLower(st.String())).Set(float64(ops1[st]))
	}
	return ops, newlyMissing, trans
}

// oneRack reports whether the datanodes are all on one rack.
func oneRack(ids []uint64, racks map[uint64]string) bool {
	for _, id := range ids[1:] {
		if racks[id] != racks[ids[0]] {
			return false
		}
	}
	return len(ids) > 0
}

// rateLocked is the repair rate: bytes of the copies recorded within
// rateWindow (or since this leadership began) per second. Callers hold
// m.mu.
func (m *Manager) rateLocked(now time.Time) float64 {
	rs := &m.repl
	from := now.Add(-rateWindow)
	i := 0
	for i < len(rs.recorded) && rs.recorded[i].at.Before(from) {
		i++
	}
	rs.recorded = rs.recorded[i:]
	if len(rs.recorded) == 0 {
		return 0
	}
	var sum uint64
	for _, c := range rs.recorded {
		sum += c.bytes
	}
	start := from
	for _, t := range []time.Time{m.since, rs.recorded[0].at.Add(-time.Second)} {
		if t.After(start) {
			start = t
		}
	}
	span := now.Sub(start)
	return float64(sum) / max(span.Seconds(), 1)
}

// maxCopyFailuresPerHeartbeat bounds the copy failures read from one
// heartbeat (a datanode has at most a few copies running).
const maxCopyFailuresPerHeartbeat = 64

// copyFailuresLocked gives up the copies a datanode reports failed, so the
// next round schedules them on another target. Callers hold m.mu.
func (m *Manager) copyFailuresLocked(req *metapb.HeartbeatRequest, now time.Time) {
	for i, f := range req.CopyFailures {
		if i == maxCopyFailuresPerHeartbeat {
			break
		}
		t := m.repl.copies[f.ContainerId]
		if t == nil || t.target != req.DatanodeId {
			continue
		}
		msg := f.Message
		if len(msg) > maxReasonBytes {
			msg = msg[:maxReasonBytes]
		}
		m.log.Warn("scm: replication: copy failed on the target; trying elsewhere", "container", f.ContainerId, "target", req.DatanodeId, "err", msg)
		m.giveUpLocked(t, now)
	}
}

// giveUpLocked ends a copy that will not finish and keeps its target out
// of that container's choices for a while. Callers hold m.mu.
func (m *Manager) giveUpLocked(t *copyTask, now time.Time) {
	rs := &m.repl
	delete(rs.copies, t.cid)
	if rs.failed[t.cid] == nil {
		rs.failed[t.cid] = map[uint64]time.Time{}
	}
	rs.failed[t.cid][t.target] = now
	rs.failedN++
	m.metrics.copies.WithLabelValues("failed").Inc()
}

// lostLocked reports whether every replica of an unclosed container is
// dead or unhealthy while one of them last reported data in it. Callers
// hold m.mu.
func (m *Manager) lostLocked(c *metapb.Container) bool {
	data := false
	for _, r := range c.Replicas {
		if st := m.replicaStatusLocked(c, r); st != ReplicaDead && st != ReplicaUnhealthy {
			return false
		}
		if n := m.nodes[r]; n != nil {
			if rep := n.containers[c.Id]; rep != nil && rep.BlockCount > 0 {
				data = true
			}
		}
	}
	return data
}

// reportedAny reports whether any datanode reports holding container c.
// Callers hold m.mu.
func reportedAny(m *Manager, c *metapb.Container) bool {
	for _, r := range c.Replicas {
		if n := m.nodes[r]; n != nil && n.containers[c.Id] != nil {
			return true
		}
	}
	return false
}

// failedBackoff: how long a target whose copy failed is not chosen again
// for that container.
func (m *Manager) failedBackoff() time.Duration { return 5 * m.cfg.CopyTimeout }

// extraReplica picks the replica to drop from an over-replicated
// container: one on the rack with the most replicas (so the rest stay
// spread), the highest ID among those.
func extraReplica(healthy []uint64, racks map[uint64]string) uint64 {
	per := map[string]int{}
	for _, r := range healthy {
		per[racks[r]]++
	}
	return slices.MaxFunc(healthy, func(a, b uint64) int {
		return cmp.Or(cmp.Compare(per[racks[a]], per[racks[b]]), cmp.Compare(a, b))
	})
}

// replicationCommandsLocked adds the replication manager's commands for
// datanode dn: the copies it is the target of, and the deletion of
// replicas it holds of CLOSED containers that no longer list it, once the
// last round found those containers whole. Callers hold m.mu.
func (m *Manager) replicationCommandsLocked(dn uint64, n *nodeSoft, due func(string) bool, cmds []*metapb.DatanodeCommand) []*metapb.DatanodeCommand {
	for _, t := range m.repl.copies {
		if t.target != dn || !due("rc"+strconv.FormatUint(t.cid, 10)) {
			continue
		}
		var pid uint64
		if c := m.st.Container(t.cid); c != nil {
			pid = c.PipelineId
		}
		cmd := &metapb.ReplicateContainerCommand{ContainerId: t.cid, Token: m.containerToken(t.cid), PipelineId: pid,
			MaxBytesPerSec: m.cfg.CopyBandwidthPerTarget / uint64(max(m.cfg.MaxCopiesPerTarget, 1))}
		for _, s := range t.sources {
			if d := m.st.Datanode(s); d != nil {
				cmd.Sources = append(cmd.Sources, d)
			}
		}
		cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_ReplicateContainer{ReplicateContainer: cmd}})
	}
	for cid, rep := range n.containers {
		if rep.State != metapb.ContainerState_CONTAINER_CLOSED && rep.State != metapb.ContainerState_CONTAINER_UNHEALTHY {
			continue
		}
		c := m.st.Container(cid)
		if c == nil || c.State != metapb.ContainerState_CONTAINER_CLOSED || slices.Contains(c.Replicas, dn) {
			continue
		}
		if t := m.repl.copies[cid]; t != nil && t.target == dn {
			continue // about to be recorded
		}
		if g, ok := m.repl.good[cid]; !ok || g < max(int(c.Replication), 1) {
			continue // it may yet be needed
		}
		if due("dc" + strconv.FormatUint(cid, 10)) {
			cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_DeleteContainer{DeleteContainer: &metapb.DeleteContainerCommand{
				ContainerId: cid, Reason: fmt.Sprintf("datanode %d is not a replica of container %d (replicas %v)", dn, cid, c.Replicas)}}})
		}
	}
	return cmds
}

// ContainerHealth returns the last round's summary with up to worst of the
// worst containers.
func (m *Manager) ContainerHealth(worst int) (*metapb.GetContainerHealthResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return nil, notLeader()
	}
	if worst <= 0 {
		worst = 20
	}
	worst = min(worst, maxWorst)
	resp := &metapb.GetContainerHealthResponse{Counts: map[string]uint64{}, CopiesDone: m.repl.done, CopiesFailed: m.repl.failedN}
	if l := m.repl.last; l != nil {
		for k, v := range l.Counts {
			resp.Counts[k] = v
		}
		resp.RoundUnixMs = l.RoundUnixMs
	}
	for _, h := range m.repl.all[:min(worst, len(m.repl.all))] {
		resp.Worst = append(resp.Worst, h)
	}
	for _, t := range m.repl.copies {
		resp.Copies = append(resp.Copies, &metapb.ReplicationCopy{ContainerId: t.cid, Target: t.target, Sources: t.sources, StartedUnixMs: t.started.UnixMilli(), Bytes: t.bytes})
		resp.BytesInFlight += t.bytes
	}
	resp.BytesLeft = m.repl.bytesLeft
	resp.RateBytesPerSec = m.rateLocked(m.cfg.Now())
	if resp.RateBytesPerSec > 0 && resp.BytesLeft > 0 {
		resp.EtaMs = int64(float64(resp.BytesLeft) / resp.RateBytesPerSec * 1000)
	}
	slices.SortFunc(resp.Copies, func(a, b *metapb.ReplicationCopy) int { return cmp.Compare(a.ContainerId, b.ContainerId) })
	return resp, nil
}

// ReplicaCorrupt acts on datanode dn's own report that its replica of
// container cid failed its checksums (its scrubber, or its re-verification
// of a block a client read found damaged; ReportCorrupt does not call it
// for a client's report): the replica is queued to be recorded unhealthy
// (through Raft, by Tick), as an UNHEALTHY container report would be, so
// it is no longer offered as a location and the replication manager
// replaces it. It is not condemned when that would leave the container
// without a replica that is not (the datanode's UNHEALTHY container
// report still condemns it).
func (m *Manager) ReplicaCorrupt(cid, dn uint64, reason string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return
	}
	c := m.st.Container(cid)
	if c == nil || !slices.Contains(c.Replicas, dn) || slices.Contains(c.UnhealthyReplicas, dn) {
		return
	}
	left := 0
	for _, r := range c.Replicas {
		if r != dn && !slices.Contains(c.UnhealthyReplicas, r) && m.unhealthy[cid][r] == "" {
			left++
		}
	}
	if left == 0 {
		m.log.Warn("scm: corrupt replica reported, but it is the container's last one not condemned; kept", "container", cid, "datanode", dn, "reason", reason)
		return
	}
	m.markUnhealthy(cid, dn, "its datanode reports it failed its checksums: "+reason)
}
