package scm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/topology"
)

// Proposer submits commands to the SCM Raft group.
type Proposer interface {
	// Propose replicates cmd and returns what State.Apply returned for it
	// on this replica (an error result comes back as the error).
	Propose(ctx context.Context, cmd []byte) (any, error)
	// IsLeader reports whether this replica leads the group now.
	IsLeader() bool
}

// Config holds SCM's tunables. Zero values take the defaults noted.
type Config struct {
	HeartbeatInterval time.Duration // datanode heartbeat period (default 3s)
	StaleInterval     time.Duration // no heartbeat for this long: STALE (default 30s)
	DeadInterval      time.Duration // no heartbeat for this long: DEAD (default 90s)
	LoopInterval      time.Duration // background work period (default 1s)

	PipelineLimit             int    // THREE pipelines per datanode (default 2)
	OpenContainersPerPipeline int    // default 3
	ContainerSize             uint64 // default 5 GiB
	BlockSize                 uint64 // default 256 MiB
	SafeModeMinDatanodes      int    // datanodes that must report before leaving safe mode (default 1)
	IDRangeSize               uint64 // local IDs a leader takes per Raft round (default 10000)
	// CommandRetryInterval: a command not yet acted on (seen in reports) is
	// sent again after this long (default 3 × HeartbeatInterval).
	CommandRetryInterval    time.Duration
	MaxCommandsPerHeartbeat int // default 64

	// Replication manager (replication.go). MaxCopiesPerTarget: container
	// copies in flight into one datanode (default 2); CopyTimeout: a copy
	// not recorded by then is given up and scheduled elsewhere (default
	// 10m).
	MaxCopiesPerTarget int
	CopyTimeout        time.Duration
	// MaxCopyBytesPerTarget: bytes of the copies in flight into one
	// datanode (default 2 × ContainerSize; one copy always goes, however
	// large).
	MaxCopyBytesPerTarget uint64
	// CopyBandwidthPerTarget: bytes per second a datanode takes in copies
	// (0: no cap); each copy is capped at it / MaxCopiesPerTarget.
	CopyBandwidthPerTarget uint64

	// SecretKeys tunes block token key rotation (secretkeys.go).
	SecretKeys SecretKeyConfig

	// CacheRescanInterval: how often the cache monitor resolves the cache
	// directives again (default DefaultCacheRescanInterval; cache_monitor.go).
	CacheRescanInterval time.Duration

	// SlowDisk: closing pipelines on datanodes' slow disks (slowdisk.go).
	SlowDisk SlowDiskConfig

	// Registerer receives the replication manager's gauges (nil: none).
	Registerer prometheus.Registerer

	Now    func() time.Time // default time.Now
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.HeartbeatInterval, 3*time.Second)
	def(&c.StaleInterval, 30*time.Second)
	def(&c.DeadInterval, 90*time.Second)
	def(&c.LoopInterval, time.Second)
	def(&c.CommandRetryInterval, 3*c.HeartbeatInterval)
	def(&c.CopyTimeout, 10*time.Minute)
	if c.MaxCopiesPerTarget == 0 {
		c.MaxCopiesPerTarget = 2
	}
	if c.PipelineLimit == 0 {
		c.PipelineLimit = 2
	}
	if c.OpenContainersPerPipeline == 0 {
		c.OpenContainersPerPipeline = 3
	}
	if c.ContainerSize == 0 {
		c.ContainerSize = 5 << 30
	}
	if c.BlockSize == 0 {
		c.BlockSize = 256 << 20
	}
	if c.SafeModeMinDatanodes == 0 {
		c.SafeModeMinDatanodes = 1
	}
	if c.MaxCopyBytesPerTarget == 0 {
		c.MaxCopyBytesPerTarget = 2 * c.ContainerSize
	}
	if c.IDRangeSize == 0 {
		c.IDRangeSize = 10000
	}
	if c.MaxCommandsPerHeartbeat == 0 {
		c.MaxCommandsPerHeartbeat = 64
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// MaxBlocksPerRequest bounds AllocateBlocks.
const MaxBlocksPerRequest = 64

// maxPipelinesPerLoop bounds the pipelines one loop iteration creates.
const maxPipelinesPerLoop = 32

// Bounds on the leader's soft state and per-round work.
const (
	// maxDeleteScan: delete transactions looked at per heartbeat (for one
	// datanode) and per purge round. Each walks all pending transactions
	// with its own cursor, a slice per round, and wraps around.
	maxDeleteScan = 1024
	// MaxDeleteAcksPerHeartbeat: acknowledgements read from one heartbeat;
	// the rest are ignored (the transactions are sent again and answered
	// again).
	MaxDeleteAcksPerHeartbeat = 4096
	// maxPendingUnhealthy: unhealthy replicas waiting to be recorded
	// through Raft; more are dropped and recorded from a later report.
	maxPendingUnhealthy = 4096
)

// Manager is the leader-side part of SCM: datanode liveness, safe mode,
// pipeline and container upkeep, block allocation and datanode commands.
// Its state is soft: it lives only on the leader and is rebuilt from the
// replicated State and from datanode heartbeats after a failover (see
// doc.go).
type Manager struct {
	cfg  Config
	st   *State
	prop Proposer
	log  *slog.Logger

	// keyMu serializes key rotation (Tick, and a registration that finds
	// no key yet), so two proposals never race for the same key ID.
	keyMu sync.Mutex

	mu       sync.Mutex
	leading  bool
	since    time.Time // when this leadership began (as seen by the loop)
	nodes    map[uint64]*nodeSoft
	safeMode bool
	// allocated counts block bytes handed out per container during this
	// leadership; with reported usage it decides when a container is full.
	allocated map[uint64]uint64
	full      map[uint64]bool // containers to close
	rr        uint64
	rng       *rand.Rand
	// Scratch slices of pickContainer (under mu), so an allocation does
	// not allocate.
	pickPipes []uint64
	pickCands []*metapb.Container
	// acked: delete tx → datanodes that no longer owe it (done, or
	// answered that their replica is unhealthy or missing). Entries exist
	// only for pending transactions and go when they are purged.
	acked map[uint64]map[uint64]bool
	// unhealthy: replicas reported unhealthy, container → datanode →
	// reason, not yet recorded through Raft (Tick does). Allocation skips
	// their containers at once.
	unhealthy map[uint64]map[uint64]string
	recov     map[uint64]*recovery // containers being recovered (recover.go)
	// purgeCursor: the last delete tx the purge round looked at.
	purgeCursor uint64
	// repl: the replication manager's schedule and last round.
	repl    replSoft
	metrics *replMetrics
	// reporters: rate limit of corrupt-replica reports (reports.go).
	reporters map[string]*bucket

	cacheMon cacheMonitor // cache directives' plan and reports (cache_monitor.go)
	slow     slowSoft     // pipelines closed for slow disks (slowdisk.go)
	// pipeFailed: open pipelines a member reported failed, not yet
	// closed (pipefail.go); at most one entry per open pipeline.
	pipeFailed map[uint64]pipeFailure

	idMu   sync.Mutex // serializes ID range refills
	idNext uint64
	idEnd  uint64
}

type nodeSoft struct {
	lastSeen time.Time
	heard    bool // heartbeat received during this leadership
	// fullReported: a full container report received during this
	// leadership, so a replica it lacks is missing, not just unreported.
	fullReported bool
	// cacheReported: a list of cached blocks received during this
	// leadership (full reports carry one too).
	cacheReported bool
	fullAt        time.Time // when the last full report came
	state         metapb.NodeState
	volumes       []*metapb.VolumeReport
	containers    map[uint64]*metapb.ContainerReport
	pipelines     map[uint64]bool
	leads         map[uint64]bool // pipelines it reported leading
	// sent: command key → when last sent, so a command is repeated only
	// after CommandRetryInterval. Bounded (maxSent): entries go when the
	// command is acknowledged (delete txs), when the retry interval has
	// passed (Tick prunes), and when the datanode is dead.
	sent map[string]time.Time
	// delCursor: the last delete tx looked at for this datanode.
	delCursor uint64
	// slowDisks: its slow disks, and per pipeline the slow disk it uses
	// there, from the last heartbeat (slowdisk.go).
	slowDisks []*metapb.SlowDisk
	slowPipes map[uint64]string
	// logDirs, logDirsFailed: its Raft log directories and the failed
	// ones, from the last heartbeat (0, 0: not told); failWarned: the
	// pipelines it reported failed without being a member, logged once
	// (at most maxFailWarned; failWarnedFull: the line saying further
	// ones are not logged was written) (pipefail.go).
	logDirs, logDirsFailed uint32
	failWarned             map[uint64]bool
	failWarnedFull         bool
}

// maxSent bounds nodeSoft.sent: with the pruning above it holds what was
// sent within one retry interval, a few heartbeats' commands.
func (m *Manager) maxSent() int { return 16 * m.cfg.MaxCommandsPerHeartbeat }

// NewManager returns a Manager over st.
func NewManager(cfg Config, st *State, prop Proposer) *Manager {
	cfg.setDefaults()
	return &Manager{cfg: cfg, st: st, prop: prop, log: cfg.Logger, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7)),
		repl: newReplSoft(), metrics: newReplMetrics(cfg.Registerer)}
}

// Config returns the effective configuration.
func (m *Manager) Config() Config { return m.cfg }

func (m *Manager) propose(ctx context.Context, cmd *metapb.ScmCommand) (any, error) {
	cmd.NowUnixMs = m.cfg.Now().UnixMilli()
	b, err := proto.Marshal(cmd)
	if err != nil {
		return nil, err
	}
	return m.prop.Propose(ctx, b)
}

// syncLeadership resets the soft state when leadership changed. Callers
// hold m.mu. It returns whether this replica leads.
func (m *Manager) syncLeadership() bool {
	leading := m.prop.IsLeader()
	if leading == m.leading {
		return leading
	}
	m.leading = leading
	m.nodes = map[uint64]*nodeSoft{}
	m.allocated = map[uint64]uint64{}
	m.full = map[uint64]bool{}
	m.acked = map[uint64]map[uint64]bool{}
	m.unhealthy = map[uint64]map[uint64]string{}
	m.recov = map[uint64]*recovery{}
	m.pipeFailed = map[uint64]pipeFailure{}
	m.purgeCursor = 0
	m.repl = newReplSoft()
	m.safeMode = true
	if leading {
		// Every registered datanode gets a full grace period from now:
		// the new leader has not heard from anyone yet.
		m.since = m.cfg.Now()
		for _, d := range m.st.Datanodes() {
			m.nodes[d.Id] = m.newSoft(m.since)
		}
		m.log.Info("scm: leading; in safe mode", "datanodes", len(m.nodes), "required", m.cfg.SafeModeMinDatanodes)
	}
	return leading
}

func (m *Manager) newSoft(t time.Time) *nodeSoft {
	return &nodeSoft{lastSeen: t, state: metapb.NodeState_HEALTHY, containers: map[uint64]*metapb.ContainerReport{}, pipelines: map[uint64]bool{}, sent: map[string]time.Time{}}
}

// ErrNotLeader: the call needs the SCM leader. The server turns it into
// UNAVAILABLE with a NotLeader hint.
var ErrNotLeader = errors.New("scm: not the leader")

func notLeader() error { return ErrNotLeader }

// ---------------------------------------------------------------- datanodes

// Register registers a datanode (or re-registers one that restarted) and
// returns its ID.
func (m *Manager) Register(ctx context.Context, req *metapb.RegisterDatanodeRequest) (*metapb.RegisterDatanodeResponse, error) {
	d := req.GetDetails()
	if d == nil {
		return nil, status.Error(codes.InvalidArgument, "register datanode: details missing")
	}
	if d.Uuid == "" || len(d.Uuid) > 128 {
		return nil, status.Errorf(codes.InvalidArgument, "register datanode: uuid %q must be 1..128 bytes", d.Uuid)
	}
	if d.DataAddr == "" || d.RaftAddr == "" {
		return nil, status.Errorf(codes.InvalidArgument, "register datanode %s: data_addr %q and raft_addr %q are both required", d.Uuid, d.DataAddr, d.RaftAddr)
	}
	loc, err := topology.Normalize(d.Location)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "register datanode %s: %v", d.Uuid, err)
	}
	d = proto.Clone(d).(*metapb.DatanodeDetails)
	d.Location = loc
	if id, ok := m.st.DatanodeByUUID(d.Uuid); ok && d.Id != 0 && d.Id != id {
		return nil, status.Errorf(codes.FailedPrecondition, "register datanode %s: it claims ID %d but is registered as %d", d.Uuid, d.Id, id)
	}
	// The cluster's first block token key signs at once, so a datanode
	// must hold it before it can be in a pipeline (a client may write to
	// it as soon as the pipeline is open, before its first heartbeat
	// brings keys): a registration that finds no key yet records it first,
	// and the answer carries it.
	if len(m.st.SecretKeys()) == 0 {
		if err := m.rotateSecretKeys(ctx); err != nil {
			return nil, err
		}
	}
	res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_RegisterDatanode{RegisterDatanode: &metapb.RegisterDatanodeOp{Details: d}}})
	if err != nil {
		return nil, err
	}
	id := res.(uint64)
	m.mu.Lock()
	if m.syncLeadership() {
		n := m.nodes[id]
		if n == nil {
			n = m.newSoft(m.cfg.Now())
			m.nodes[id] = n
		}
		n.lastSeen = m.cfg.Now()
		n.heard = true
		n.state = metapb.NodeState_HEALTHY
		n.volumes = req.Volumes
	}
	m.mu.Unlock()
	return &metapb.RegisterDatanodeResponse{DatanodeId: id, HeartbeatIntervalMs: m.cfg.HeartbeatInterval.Milliseconds(), SecretKeys: m.st.SecretKeys()}, nil
}

// Heartbeat records a datanode's liveness and reports and returns the
// commands it should carry out. It never goes through Raft.
func (m *Manager) Heartbeat(ctx context.Context, req *metapb.HeartbeatRequest) (*metapb.HeartbeatResponse, error) {
	if m.st.Datanode(req.DatanodeId) == nil {
		return &metapb.HeartbeatResponse{Reregister: true}, nil
	}
	now := m.cfg.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return nil, notLeader()
	}
	n := m.nodes[req.DatanodeId]
	if n == nil {
		n = m.newSoft(now)
		m.nodes[req.DatanodeId] = n
	}
	n.lastSeen = now
	n.heard = true
	if n.state == metapb.NodeState_DEAD {
		// A dead datanode that comes back is healthy again, but its old
		// pipelines stay closed; new ones will include it.
		m.log.Info("scm: datanode back", "datanode", req.DatanodeId)
	}
	n.state = metapb.NodeState_HEALTHY
	if len(req.Volumes) > 0 {
		n.volumes = req.Volumes
	}
	if req.FullReport {
		n.containers = make(map[uint64]*metapb.ContainerReport, len(req.Containers))
		for _, c := range req.Containers {
			// The reason is kept only for an UNHEALTHY replica, bounded
			// whatever the datanode sent.
			if c.State != metapb.ContainerState_CONTAINER_UNHEALTHY {
				c.UnhealthyReason = ""
			} else if c.UnhealthyReason != "" {
				c.UnhealthyReason = cleanReason(c.UnhealthyReason, maxReasonBytes)
			}
			n.containers[c.ContainerId] = c
			m.checkReport(req.DatanodeId, c)
		}
		n.fullReported = true
		n.fullAt = now
	}
	// Datanodes list their pipelines in every heartbeat (and whether they
	// lead each): allocation waits for a new pipeline to have a leader.
	if req.FullReport || len(req.Pipelines) > 0 {
		n.pipelines = make(map[uint64]bool, len(req.Pipelines))
		n.leads = make(map[uint64]bool, len(req.Pipelines))
		for _, p := range req.Pipelines {
			n.pipelines[p.PipelineId] = true
			if p.IsLeader {
				n.leads[p.PipelineId] = true
			}
		}
	}
	m.slowDisksLocked(n, req)
	m.pipelineFailuresLocked(n, req)
	m.deleteAcks(req, n)
	m.copyFailuresLocked(req, now)
	m.cacheReportLocked(req)
	n.cacheReported = n.cacheReported || req.CacheReport
	cmds := m.commandsFor(req.DatanodeId, n, now)
	cmds = m.cacheCommandsLocked(req.DatanodeId, now, cmds)
	return &metapb.HeartbeatResponse{Commands: cmds, State: n.state, SecretKeys: m.st.SecretKeys()}, nil
}

// checkReport acts on one replica's report at once, before anything goes
// through Raft: an UNHEALTHY replica is queued to be recorded (Tick) and
// its container gets no more blocks from now on; a replica that reports a
// container closed or closing that SCM still has OPEN takes no more writes
// either, so the container is closed. Callers hold m.mu.
func (m *Manager) checkReport(dn uint64, rep *metapb.ContainerReport) {
	c := m.st.Container(rep.ContainerId)
	if c == nil || !slices.Contains(c.Replicas, dn) {
		return
	}
	switch rep.State {
	case metapb.ContainerState_CONTAINER_UNHEALTHY:
		if !slices.Contains(c.UnhealthyReplicas, dn) {
			why := fmt.Sprintf("datanode %d reports its replica UNHEALTHY", dn)
			if rep.UnhealthyReason != "" {
				// The datanode's part is cut to fit the record, with "…".
				why += ": "
				why += cleanReason(rep.UnhealthyReason, maxReasonBytes-len(why))
			}
			m.markUnhealthy(c.Id, dn, why)
		}
	case metapb.ContainerState_CONTAINER_CLOSING, metapb.ContainerState_CONTAINER_CLOSED:
		if c.State == metapb.ContainerState_CONTAINER_OPEN && !m.full[c.Id] {
			m.log.Info("scm: replica closed under an open container; closing it", "container", c.Id, "datanode", dn, "state", rep.State)
			m.full[c.Id] = true
		}
	}
}

// markUnhealthy queues a replica to be recorded unhealthy. Callers hold
// m.mu.
func (m *Manager) markUnhealthy(cid, dn uint64, reason string) {
	if m.unhealthy[cid][dn] != "" {
		return
	}
	if len(m.unhealthy) >= maxPendingUnhealthy && m.unhealthy[cid] == nil {
		return // recorded from a later report
	}
	reason = truncReason(reason)
	if m.unhealthy[cid] == nil {
		m.unhealthy[cid] = map[uint64]string{}
	}
	m.unhealthy[cid][dn] = reason
	m.log.Warn("scm: unhealthy replica", "container", cid, "datanode", dn, "reason", reason)
}

// deleteAcks records a heartbeat's delete-tx results: the datanode no
// longer owes those transactions. CONTAINER_UNHEALTHY (and CONTAINER_MISSING
// for a CLOSED container) also marks the replica unhealthy, so it is never
// served as a location again and no later delete waits for it. Acks of unknown transactions (purged already) are
// dropped. Callers hold m.mu.
func (m *Manager) deleteAcks(req *metapb.HeartbeatRequest, n *nodeSoft) {
	dn := req.DatanodeId
	budget := MaxDeleteAcksPerHeartbeat
	ack := func(id uint64, st metapb.DeleteTxStatus, msg string) {
		if budget == 0 {
			return
		}
		budget--
		delete(n.sent, deleteKey(id))
		tx, err := m.st.DeleteTx(id)
		if err != nil {
			m.log.Warn("scm: read delete tx", "tx", id, "err", err)
			return
		}
		if tx == nil {
			return
		}
		c := m.st.Container(tx.ContainerId)
		if c == nil || !slices.Contains(c.Replicas, dn) {
			return
		}
		if m.acked[id] == nil {
			m.acked[id] = map[uint64]bool{}
		}
		m.acked[id][dn] = true
		if slices.Contains(c.UnhealthyReplicas, dn) {
			return
		}
		switch st {
		case metapb.DeleteTxStatus_DELETE_TX_DONE, metapb.DeleteTxStatus_DELETE_TX_STATUS_UNSPECIFIED:
		case metapb.DeleteTxStatus_DELETE_TX_CONTAINER_MISSING:
			// Datanodes create a container on its first write, so a
			// replica of an OPEN or CLOSING container may lack it without
			// having lost anything (nothing written yet, or a follower
			// that has not applied the first write: the pipeline's log
			// brings the container and the deletion both). A CLOSED
			// container was reported closed by this replica: now it is
			// gone.
			if c.State == metapb.ContainerState_CONTAINER_CLOSED {
				m.markUnhealthy(c.Id, dn, fmt.Sprintf("delete tx %d: %v: %s", id, st, msg))
			}
		default:
			m.markUnhealthy(c.Id, dn, fmt.Sprintf("delete tx %d: %v: %s", id, st, msg))
		}
	}
	for _, id := range req.DeletedBlockTxs {
		ack(id, metapb.DeleteTxStatus_DELETE_TX_DONE, "")
	}
	for _, a := range req.DeleteAcks {
		ack(a.TxId, a.Status, a.Message)
	}
}

func deleteKey(tx uint64) string { return "db" + strconv.FormatUint(tx, 10) }

// commandsFor derives the commands a datanode needs from the replicated
// state and its last report, so a new leader sends the right commands
// without any command queue having been replicated.
func (m *Manager) commandsFor(dn uint64, n *nodeSoft, now time.Time) []*metapb.DatanodeCommand {
	var cmds []*metapb.DatanodeCommand
	due := func(k string) bool {
		if len(cmds) >= m.cfg.MaxCommandsPerHeartbeat {
			return false
		}
		t, ok := n.sent[k]
		if ok && now.Sub(t) < m.cfg.CommandRetryInterval {
			return false
		}
		if !ok && len(n.sent) >= m.maxSent() {
			return false // Tick prunes; it goes out in a later heartbeat
		}
		n.sent[k] = now
		return true
	}
	for _, p := range m.st.Pipelines() {
		member := slices.Contains(p.Datanodes, dn)
		switch {
		case p.State == metapb.PipelineState_PIPELINE_OPEN && member && !n.pipelines[p.Id]:
			if due(fmt.Sprintf("cp%d", p.Id)) {
				var dns []*metapb.DatanodeDetails
				for _, id := range p.Datanodes {
					if d := m.st.Datanode(id); d != nil {
						dns = append(dns, d)
					}
				}
				cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CreatePipeline{CreatePipeline: &metapb.CreatePipelineCommand{Pipeline: p, Datanodes: dns}}})
			}
		case p.State == metapb.PipelineState_PIPELINE_CLOSED && n.pipelines[p.Id]:
			if m.stillClosing(p, n, now) {
				continue // its containers close through its log first
			}
			if due(fmt.Sprintf("xp%d", p.Id)) {
				cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_ClosePipeline{ClosePipeline: &metapb.ClosePipelineCommand{PipelineId: p.Id}}})
			}
		}
	}
	for id, rep := range n.containers {
		if rep.State != metapb.ContainerState_CONTAINER_OPEN {
			continue
		}
		c := m.st.Container(id)
		if c != nil && c.State != metapb.ContainerState_CONTAINER_OPEN && due(fmt.Sprintf("xc%d", id)) {
			cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_CloseContainer{CloseContainer: &metapb.CloseContainerCommand{ContainerId: id, PipelineId: c.PipelineId}}})
		}
	}
	cmds = m.closeUnreportedLocked(dn, n, due, cmds)
	cmds = m.replicationCommandsLocked(dn, n, due, cmds)
	cmds = m.recoverCommandsLocked(dn, n, now, due, cmds)
	// Delete-block transactions for containers this datanode holds, from
	// its cursor on: a bounded slice of the pending transactions per
	// heartbeat, wrapping around at the end, so every pending transaction
	// is reached however many others are stuck (a container whose
	// replicas never answer cannot hide the rest).
	txs, err := m.st.DeleteTxs(n.delCursor, maxDeleteScan)
	if err != nil {
		m.log.Warn("scm: read delete txs", "err", err)
		return cmds
	}
	cursor, full := n.delCursor, false
	for _, tx := range txs {
		if len(cmds) >= m.cfg.MaxCommandsPerHeartbeat {
			full = true
			break // resume at this tx next time
		}
		cursor = tx.TxId
		if m.acked[tx.TxId][dn] {
			continue
		}
		c := m.st.Container(tx.ContainerId)
		if c == nil || !slices.Contains(c.Replicas, dn) || slices.Contains(c.UnhealthyReplicas, dn) {
			continue
		}
		if due(deleteKey(tx.TxId)) {
			cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_DeleteBlocks{DeleteBlocks: &metapb.DeleteBlocksCommand{TxId: tx.TxId, ContainerId: tx.ContainerId, LocalIds: tx.LocalIds}}})
		}
	}
	if !full && len(txs) < maxDeleteScan {
		cursor = 0 // reached the end: start over
	}
	n.delCursor = cursor
	return cmds
}

// NodeState returns the liveness of a datanode as this leader sees it.
func (m *Manager) NodeState(id uint64) metapb.NodeState {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return metapb.NodeState_NODE_STATE_UNSPECIFIED
	}
	if n := m.nodes[id]; n != nil {
		return n.state
	}
	return metapb.NodeState_NODE_STATE_UNSPECIFIED
}

// ListDatanodes returns every registered datanode with its liveness.
func (m *Manager) ListDatanodes() (*metapb.ListDatanodesResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return nil, notLeader()
	}
	count := map[uint64]uint32{}
	for _, p := range m.st.Pipelines() {
		if p.State == metapb.PipelineState_PIPELINE_OPEN {
			for _, id := range p.Datanodes {
				count[id]++
			}
		}
	}
	resp := &metapb.ListDatanodesResponse{}
	for _, d := range m.st.Datanodes() {
		ds := &metapb.DatanodeStatus{Details: d, Pipelines: count[d.Id], State: metapb.NodeState_HEALTHY}
		if n := m.nodes[d.Id]; n != nil {
			ds.State = n.state
			ds.Volumes = n.volumes
			ds.SlowDisks = n.slowDisks
			ds.LogDirs, ds.LogDirsFailed = n.logDirs, n.logDirsFailed
			if n.heard {
				ds.LastHeartbeatUnixMs = n.lastSeen.UnixMilli()
			}
		}
		m.fillOpStatus(ds)
		ds.Cache = m.cacheStatsOf(d.Id)
		resp.Datanodes = append(resp.Datanodes, ds)
	}
	return resp, nil
}

// SafeMode reports whether SCM is in safe mode and the reporting progress.
func (m *Manager) SafeMode() (*metapb.GetSafeModeResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return nil, notLeader()
	}
	m.updateSafeMode()
	return &metapb.GetSafeModeResponse{InSafeMode: m.safeMode, ReportedDatanodes: uint32(m.heardCount()), RequiredDatanodes: uint32(m.cfg.SafeModeMinDatanodes)}, nil
}

func (m *Manager) heardCount() int {
	k := 0
	for _, n := range m.nodes {
		if n.heard {
			k++
		}
	}
	return k
}

// updateSafeMode leaves safe mode once SafeModeMinDatanodes datanodes
// have reported to this leader. A leader of a cluster that left safe mode
// before (a failover, a meta restart: recorded through Raft) needs only
// the reports it actually gets: one datanode heard is enough, since every
// datanode it has not heard from yet keeps its grace period (HEALTHY,
// not fully reported, so none of its replicas is counted lost); datanodes
// still heartbeating a hung old leader do not hold it back. Callers hold
// m.mu.
func (m *Manager) updateSafeMode() {
	if !m.safeMode {
		return
	}
	h := m.heardCount()
	if h >= m.cfg.SafeModeMinDatanodes || (h >= 1 && m.st.SafeModeExited()) {
		m.safeMode = false
		m.log.Info("scm: leaving safe mode", "reported", h, "required", m.cfg.SafeModeMinDatanodes, "failover", m.st.SafeModeExited())
	}
}

// ---------------------------------------------------------------- background

// Run does the leader's background work every LoopInterval until ctx ends.
func (m *Manager) Run(ctx context.Context) {
	t := time.NewTicker(m.cfg.LoopInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := m.Tick(ctx); err != nil && ctx.Err() == nil {
				m.log.Debug("scm: background tick", "err", err)
			}
		}
	}
}

// Tick runs one round of background work (tests call it directly).
func (m *Manager) Tick(ctx context.Context) error {
	m.mu.Lock()
	if !m.syncLeadership() {
		m.mu.Unlock()
		return nil
	}
	now := m.cfg.Now()
	var dead, stale []uint64
	healthy := map[uint64]bool{}
	allFull := true // every healthy datanode told this leader what it has cached
	m.pruneSent(now)
	for id, n := range m.nodes {
		age := now.Sub(n.lastSeen)
		old := n.state
		switch {
		case age >= m.cfg.DeadInterval:
			n.state = metapb.NodeState_DEAD
		case age >= m.cfg.StaleInterval:
			n.state = metapb.NodeState_STALE
		default:
			n.state = metapb.NodeState_HEALTHY
		}
		if n.state != old {
			m.log.Info("scm: datanode state", "datanode", id, "from", old, "to", n.state)
		}
		if n.state == metapb.NodeState_DEAD {
			dead = append(dead, id)
		}
		if n.state == metapb.NodeState_STALE {
			stale = append(stale, id)
		}
		if n.state == metapb.NodeState_HEALTHY {
			healthy[id] = true
			allFull = allFull && (n.fullReported || n.cacheReported)
		}
	}
	m.updateSafeMode()
	safe := m.safeMode
	full := m.full
	m.full = map[uint64]bool{}
	acked := m.acked
	reports := m.closedReports()
	unhealthy := m.unhealthyBatch()
	since := m.since
	m.mu.Unlock()

	if !safe {
		m.cacheRound(now, since, healthy, allFull, false)
	}

	// Block token keys first: a pipeline's first token needs one.
	if err := m.rotateSecretKeys(ctx); err != nil {
		return err
	}

	// 0. Record unhealthy replicas (their containers stop taking blocks
	// and start closing in the same entry).
	if len(unhealthy) > 0 {
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicasUnhealthy{ReplicasUnhealthy: &metapb.ReplicasUnhealthyOp{Replicas: unhealthy}}}); err != nil {
			return err
		}
		m.mu.Lock()
		for _, r := range unhealthy {
			if u := m.unhealthy[r.ContainerId]; u != nil {
				delete(u, r.DatanodeId)
				if len(u) == 0 {
					delete(m.unhealthy, r.ContainerId)
				}
			}
		}
		m.mu.Unlock()
	}

	if err := m.recoverRound(ctx); err != nil {
		return err
	}
	if !safe && !m.st.SafeModeExited() {
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_SafeModeExited{SafeModeExited: &metapb.SafeModeExitedOp{}}}); err != nil {
			return err
		}
	}
	// 1a. Close the pipelines a member reported failed (pipefail.go): at
	// once, before lostMembers, so the close reason names the failure.
	if err := m.closeFailedPipelines(ctx); err != nil {
		return err
	}
	// 1. Close the pipelines that lost a member: a dead or stale datanode,
	// one leaving service (decommission, maintenance), or a replica
	// recorded unhealthy (checked every tick, so a failover in between
	// loses nothing). Their open containers become CLOSING in the same
	// entry, and createPipelines replaces them so writes keep spreading.
	if toClose, why := m.lostMembers(stale, dead); len(toClose) > 0 {
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: toClose, Reason: why}}}); err != nil {
			return err
		}
		m.log.Info("scm: pipelines closed", "pipelines", toClose, "reason", why)
	}
	// 1b. At most one pipeline per SlowDisk.CloseInterval whose log or
	// open container is on a member's slow disk (slowdisk.go).
	if err := m.closeSlowDiskPipeline(ctx, now); err != nil {
		return err
	}
	// 2. Close full containers; mark closed the ones every live replica
	// reported closed.
	if len(full) > 0 {
		ids := make([]uint64, 0, len(full))
		for id := range full {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CloseContainers{CloseContainers: &metapb.CloseContainersOp{ContainerIds: ids, Reason: "full"}}}); err != nil {
			return err
		}
	}
	for id, cr := range reports {
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ContainerClosed{ContainerClosed: &metapb.ContainerClosedOp{ContainerId: id, UsedBytes: cr.used, Bcsid: cr.bcsid}}}); err != nil {
			return err
		}
	}
	// 3. Replication manager: repair closed containers (replication.go;
	// not in safe mode, when too few datanodes have reported to tell a
	// lost replica from an unreported one).
	if !safe {
		if err := m.replicate(ctx); err != nil {
			return err
		}
	}
	// 4. Purge delete transactions every replica has carried out.
	if err := m.purgeDeleteTxs(ctx, acked, dead); err != nil {
		return err
	}
	if safe {
		return nil
	}
	// 5. Pipelines, then containers on them.
	if err := m.createPipelines(ctx, healthy); err != nil {
		return err
	}
	return m.fillContainers(ctx)
}

// pruneSent drops what no longer holds back a command: entries older
// than the retry interval (the command would be sent again anyway) and
// everything of a dead datanode. Callers hold m.mu.
func (m *Manager) pruneSent(now time.Time) {
	for _, n := range m.nodes {
		if n.state == metapb.NodeState_DEAD {
			clear(n.sent)
			continue
		}
		for k, t := range n.sent {
			if now.Sub(t) >= m.cfg.CommandRetryInterval {
				delete(n.sent, k)
			}
		}
	}
}

// unhealthyBatch returns up to MaxUnhealthyPerOp queued unhealthy
// replicas, in a stable order. Callers hold m.mu.
func (m *Manager) unhealthyBatch() []*metapb.UnhealthyReplica {
	var out []*metapb.UnhealthyReplica
	for cid, dns := range m.unhealthy {
		for dn, why := range dns {
			out = append(out, &metapb.UnhealthyReplica{ContainerId: cid, DatanodeId: dn, Reason: why})
		}
	}
	slices.SortFunc(out, func(a, b *metapb.UnhealthyReplica) int {
		return cmp.Or(cmp.Compare(a.ContainerId, b.ContainerId), cmp.Compare(a.DatanodeId, b.DatanodeId))
	})
	if len(out) > MaxUnhealthyPerOp {
		out = out[:MaxUnhealthyPerOp]
	}
	return out
}

// closedReports returns CLOSING containers that every live, healthy
// replica reports closed, with the largest reported size. Unhealthy
// replicas (recorded, or reporting UNHEALTHY) never close; the container
// closes on the others. So does a replica that lacks the container in a
// full report sent after its pipeline closed: it never got a write (a
// datanode creates a container on the first one) or lost it, and no write
// can reach it any more; the replication manager repairs it if the
// container holds data. A container no replica ever got closes empty.
// The LOWEST BCSID the healthy closed replicas report goes in the op: the
// container's BCSID floor (Container.bcsid_floor). A write is acknowledged
// only once every pipeline member applied it (WaitAll), so a healthy
// member's BCSID bounds every acknowledged write from above: what one
// replica holds above the lowest healthy one was never acknowledged, and a
// floor above a healthy replica the container keeps would strand it
// (missing, with no copy source). Callers hold m.mu.
func (m *Manager) closedReports() map[uint64]closedReport {
	out := map[uint64]closedReport{}
	for _, c := range m.st.ClosingContainers() {
		ok, any, seen := true, false, false
		var used, bcsid uint64
		p := m.st.Pipeline(c.PipelineId)
		for _, r := range c.Replicas {
			n := m.nodes[r]
			if n == nil || n.state == metapb.NodeState_DEAD || slices.Contains(c.UnhealthyReplicas, r) || m.unhealthy[c.Id][r] != "" {
				continue
			}
			rep := n.containers[c.Id]
			if rep == nil && n.fullReported && p != nil && p.State == metapb.PipelineState_PIPELINE_CLOSED && n.fullAt.UnixMilli() > p.ClosedUnixMs {
				any = true
				continue
			}
			if rep == nil || rep.State != metapb.ContainerState_CONTAINER_CLOSED {
				ok = false
				break
			}
			any = true
			used = max(used, rep.UsedBytes)
			if !seen || rep.Bcsid < bcsid {
				bcsid, seen = rep.Bcsid, true
			}
		}
		if ok && any {
			out[c.Id] = closedReport{used: used, bcsid: bcsid}
		}
	}
	return out
}

// closedReport: what the closed replicas of a CLOSING container report
// (closedReports).
type closedReport struct{ used, bcsid uint64 }

// purgeDeleteTxs purges the delete transactions no replica owes any more.
// Each round looks at maxDeleteScan transactions from a cursor that walks
// all of them and wraps around, so stuck transactions at the front never
// stop the ones behind them from being purged.
func (m *Manager) purgeDeleteTxs(ctx context.Context, acked map[uint64]map[uint64]bool, dead []uint64) error {
	m.mu.Lock()
	cursor := m.purgeCursor
	m.mu.Unlock()
	txs, err := m.st.DeleteTxs(cursor, maxDeleteScan)
	if err != nil {
		return err
	}
	next := uint64(0) // reached the end: start over
	if len(txs) == maxDeleteScan {
		next = txs[len(txs)-1].TxId
	}
	var done []uint64
	var owed [][]uint64 // replicas of each done tx, to prune their sent maps
	m.mu.Lock()
	m.purgeCursor = next
	for _, tx := range txs {
		c := m.st.Container(tx.ContainerId)
		all := c != nil
		if c != nil {
			for _, r := range c.Replicas {
				// A dead or unhealthy replica's container will be rebuilt
				// from the healthy ones (later: replication manager),
				// without the blocks.
				if !acked[tx.TxId][r] && !slices.Contains(dead, r) && !slices.Contains(c.UnhealthyReplicas, r) {
					all = false
					break
				}
			}
		}
		if all {
			done = append(done, tx.TxId)
			if c != nil {
				owed = append(owed, c.Replicas)
			} else {
				owed = append(owed, nil)
			}
		}
	}
	m.mu.Unlock()
	if len(done) == 0 {
		return nil
	}
	if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_PurgeDeleteTxs{PurgeDeleteTxs: &metapb.PurgeDeleteTxsOp{TxIds: done}}}); err != nil {
		return err
	}
	m.mu.Lock()
	for i, id := range done {
		delete(m.acked, id)
		for _, r := range owed[i] {
			if n := m.nodes[r]; n != nil {
				delete(n.sent, deleteKey(id))
			}
		}
	}
	m.mu.Unlock()
	return nil
}

func (m *Manager) createPipelines(ctx context.Context, healthy map[uint64]bool) error {
	for range maxPipelinesPerLoop {
		pipes := m.st.Pipelines()
		load := map[uint64]int{}
		hasOne := map[uint64]bool{}
		existing := map[string]bool{}
		for _, p := range pipes {
			if p.State != metapb.PipelineState_PIPELINE_OPEN {
				continue
			}
			if p.Replication == metapb.Replication_ONE {
				hasOne[p.Datanodes[0]] = true
				continue
			}
			existing[SetKey(p.Datanodes)] = true
			for _, id := range p.Datanodes {
				load[id]++
			}
		}
		// One ONE pipeline per healthy datanode (single-node clusters and
		// replication ONE buckets).
		var op *metapb.CreatePipelineOp
		racks := map[string]bool{}
		var cands []Candidate
		m.mu.Lock()
		room := map[uint64]bool{}
		noLog := map[uint64]bool{}
		for _, d := range m.st.Datanodes() {
			_, room[d.Id] = m.roomLocked(d.Id)
			noLog[d.Id] = m.nodes[d.Id].noLogDirs()
		}
		m.mu.Unlock()
		for _, d := range m.st.Datanodes() {
			if !healthy[d.Id] || !m.inService(d.Id) {
				continue
			}
			// A datanode that reports no room for a container gets no new
			// pipeline: SCM would create containers there that it cannot
			// hold (a filled disk: the fault test's pipeline 1012).
			if !room[d.Id] {
				continue
			}
			// Nor one whose Raft log directories all failed: it could not
			// start it (pipefail.go).
			if noLog[d.Id] {
				continue
			}
			racks[d.Location] = true
			if !hasOne[d.Id] && op == nil {
				op = &metapb.CreatePipelineOp{Replication: metapb.Replication_ONE, Datanodes: []uint64{d.Id}}
			}
			if load[d.Id] < m.cfg.PipelineLimit {
				cands = append(cands, Candidate{ID: d.Id, Rack: d.Location, Pipelines: load[d.Id]})
			}
		}
		if op == nil {
			m.mu.Lock()
			ids := ChooseMembers(cands, 3, len(racks), existing, m.rng)
			m.mu.Unlock()
			if ids == nil {
				return nil
			}
			op = &metapb.CreatePipelineOp{Replication: metapb.Replication_THREE, Datanodes: ids}
		}
		res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreatePipeline{CreatePipeline: op}})
		if err != nil {
			return err
		}
		p := res.(*metapb.Pipeline)
		m.log.Info("scm: pipeline created", "pipeline", p.Id, "replication", p.Replication, "datanodes", p.Datanodes)
	}
	return nil
}

func (m *Manager) fillContainers(ctx context.Context) error {
	open := map[uint64]int{}
	for _, c := range m.st.OpenContainers() {
		open[c.PipelineId]++
	}
	pipes := slices.Concat(m.st.OpenPipelines(metapb.Replication_ONE), m.st.OpenPipelines(metapb.Replication_THREE))
	slices.SortFunc(pipes, func(a, b *metapb.Pipeline) int { return cmp.Compare(a.Id, b.Id) })
	for _, p := range pipes {
		for i := open[p.Id]; i < m.cfg.OpenContainersPerPipeline; i++ {
			if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: p.Id}}}); err != nil {
				return err
			}
		}
	}
	return nil
}

// ---------------------------------------------------------------- blocks

// nextLocalID hands out a local ID from this leader's range, taking a new
// range through Raft when it runs out. Ranges never overlap, so no ID is
// ever handed out twice, whoever leads.
func (m *Manager) nextLocalID(ctx context.Context, n uint64) (uint64, error) {
	m.idMu.Lock()
	defer m.idMu.Unlock()
	if m.idEnd-m.idNext < n {
		size := max(m.cfg.IDRangeSize, n)
		res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_AllocateIdRange{AllocateIdRange: &metapb.AllocateIDRangeOp{Count: size}}})
		if err != nil {
			return 0, err
		}
		m.idNext = res.(uint64)
		m.idEnd = m.idNext + size
	}
	id := m.idNext
	m.idNext += n
	return id, nil
}

// AllocateBlocks allocates blocks in open containers of healthy pipelines
// outside the exclude list.
func (m *Manager) AllocateBlocks(ctx context.Context, req *metapb.AllocateBlocksRequest) (*metapb.AllocateBlocksResponse, error) {
	if req.Count == 0 || req.Count > MaxBlocksPerRequest {
		return nil, status.Errorf(codes.InvalidArgument, "allocate blocks: count %d, want 1..%d", req.Count, MaxBlocksPerRequest)
	}
	repl := req.Replication
	if repl == metapb.Replication_REPLICATION_UNSPECIFIED {
		repl = metapb.Replication_THREE
	}
	if repl != metapb.Replication_ONE && repl != metapb.Replication_THREE {
		return nil, status.Errorf(codes.InvalidArgument, "allocate blocks: replication %v, want ONE or THREE", repl)
	}
	if ex := req.GetExclude(); len(ex.GetDatanodes())+len(ex.GetPipelines())+len(ex.GetContainers()) > maxExcludeIDs || len(req.ClientLocation) > maxLocationBytes {
		return nil, status.Errorf(codes.InvalidArgument, "allocate blocks: exclude list of %d entries (at most %d) or client location of %d bytes (at most %d)",
			len(ex.GetDatanodes())+len(ex.GetPipelines())+len(ex.GetContainers()), maxExcludeIDs, len(req.ClientLocation), maxLocationBytes)
	}
	// A leader that just took over is in safe mode until datanodes
	// heartbeat to it, which they do within a heartbeat interval: wait for
	// that (bounded) rather than fail every write during a failover.
	//
	// A cluster that left safe mode before (recorded through Raft) is not
	// held back at all: the recorded pipelines take writes whether or not
	// their datanodes have reached this leader yet (they may still be
	// heartbeating a hung old one), and a datanode that is really gone
	// turns STALE after StaleInterval like any other.
	var deadline time.Time // real time, set on the first look
	for {
		m.mu.Lock()
		if !m.syncLeadership() {
			m.mu.Unlock()
			return nil, notLeader()
		}
		m.updateSafeMode()
		if !m.safeMode || m.st.SafeModeExited() {
			m.mu.Unlock()
			break
		}
		h := m.heardCount()
		if deadline.IsZero() {
			deadline = time.Now().Add(m.since.Add(2 * m.cfg.HeartbeatInterval).Sub(m.cfg.Now()))
		}
		m.mu.Unlock()
		if !time.Now().Before(deadline) || ctx.Err() != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "scm: in safe mode: %d of %d datanodes reported", h, m.cfg.SafeModeMinDatanodes)
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	first, err := m.nextLocalID(ctx, uint64(req.Count))
	if err != nil {
		return nil, err
	}
	ex := req.GetExclude()
	resp := &metapb.AllocateBlocksResponse{BlockSize: m.cfg.BlockSize}
	for i := range req.Count {
		c, err := m.pickContainer(ctx, repl, ex, chargeFor(req.ExpectedBytes, m.cfg.BlockSize))
		if err != nil {
			return nil, err
		}
		c, dns := m.st.ContainerReplicas(c.Id)
		dns = writeRoute(c.PipelineId, dns)
		topology.SortByDistance(dns, 0, req.ClientLocation, func(d *metapb.DatanodeDetails) uint64 { return d.Id }, func(d *metapb.DatanodeDetails) string { return d.Location })
		resp.Blocks = append(resp.Blocks, &metapb.BlockLocation{
			Id:             &metapb.BlockID{ContainerId: c.Id, LocalId: first + uint64(i)},
			PipelineId:     c.PipelineId,
			ContainerState: c.State,
			Datanodes:      dns,
		})
	}
	return resp, nil
}

// pickContainer chooses an open container round-robin among the eligible
// pipelines. If an eligible pipeline has none (all full, or none yet), it
// creates one through Raft and allocates from it: under many concurrent
// allocations the containers others created may fill up again before this
// caller looks, so the one it created is the one it uses. The block counts
// n bytes against the container (see chargeFor).
// It looks only at the open pipelines and containers of the replication
// (State's indexes), so its cost does not grow with the containers SCM
// ever created.
func (m *Manager) pickContainer(ctx context.Context, repl metapb.Replication, ex *metapb.ExcludeList, n uint64) (*metapb.Container, error) {
	m.mu.Lock()
	pipes := m.pickPipes[:0]
	for _, p := range m.st.OpenPipelines(repl) {
		// A pipeline a member reported failed is closed at the next Tick;
		// until then it takes no block and no new container (pipefail.go).
		if _, failed := m.pipeFailed[p.Id]; failed || slices.Contains(ex.GetPipelines(), p.Id) {
			continue
		}
		ok := true
		for _, id := range p.Datanodes {
			n := m.nodes[id]
			// noLogDirs: its replica cannot run; Tick closes the pipeline.
			if n == nil || n.state != metapb.NodeState_HEALTHY || n.noLogDirs() || slices.Contains(ex.GetDatanodes(), id) || !m.inService(id) {
				ok = false
				break
			}
		}
		if ok {
			pipes = append(pipes, p.Id)
		}
	}
	// A pipeline created moments ago may have no leader yet (its
	// datanodes join it at their next heartbeat): writes to it would fail
	// and get it excluded. Prefer the ready ones; fall back to the rest.
	if ready := slices.DeleteFunc(slices.Clone(pipes), func(id uint64) bool { return !m.pipelineReadyLocked(id) }); len(ready) > 0 {
		pipes = append(pipes[:0], ready...)
	}
	m.pickPipes = pipes
	cands := m.pickCands[:0]
	m.st.EachOpenContainer(repl, func(c *metapb.Container) bool {
		if slices.Contains(pipes, c.PipelineId) && !slices.Contains(ex.GetContainers(), c.Id) && !m.full[c.Id] &&
			m.unhealthy[c.Id] == nil && len(c.UnhealthyReplicas) == 0 {
			cands = append(cands, c)
		}
		return true
	})
	if len(cands) > 0 {
		m.rr++
		c := cands[m.rr%uint64(len(cands))]
		// Reused by the next call (under m.mu); cleared so it pins no
		// replaced container.
		clear(cands)
		m.pickCands = cands[:0]
		m.charge(c, n)
		m.mu.Unlock()
		return c, nil
	}
	// A new container goes on the first eligible pipeline whose datanodes
	// all have room for one; creating containers where they cannot exist
	// would only fail the write and make the client ask again.
	var first uint64
	var noRoom []string
	for _, p := range pipes {
		if short := m.noRoomLocked(p); short != "" {
			noRoom = append(noRoom, short)
			continue
		}
		first = p
		break
	}
	m.mu.Unlock()
	if first == 0 && len(noRoom) > 0 {
		return nil, status.Errorf(codes.ResourceExhausted, "allocate blocks: out of space: every open container is full or excluded, and no %v pipeline has room for a new %d-byte container (%s)",
			repl, m.cfg.ContainerSize, strings.Join(noRoom, "; "))
	}
	if first == 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "allocate blocks: no open %v pipeline with healthy datanodes outside the exclude list (%d datanodes, %d pipelines, exclude %v)",
			repl, len(m.st.Datanodes()), len(m.st.Pipelines()), ex)
	}
	res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_CreateContainer{CreateContainer: &metapb.CreateContainerOp{PipelineId: first}}})
	if err != nil {
		return nil, err
	}
	c := res.(*metapb.Container)
	m.mu.Lock()
	m.charge(c, n)
	m.mu.Unlock()
	return c, nil
}

// pipelineReadyLocked reports whether pipeline id can take writes as far
// as this leader knows: every member reported it and one leads it, or it is older than
// pipelineReadyGrace heartbeats (created before this leader heard of its
// members, or its reports are late). Callers hold m.mu.
func (m *Manager) pipelineReadyLocked(id uint64) bool {
	p := m.st.Pipeline(id)
	if p == nil {
		return false
	}
	if m.cfg.Now().UnixMilli()-p.CreatedUnixMs >= (pipelineReadyGrace * m.cfg.HeartbeatInterval).Milliseconds() {
		return true
	}
	// Every member must have joined (a V2 stream opens the pipeline on
	// each member and a member that has not is refused "not in
	// pipeline"), and one of them leads it.
	led := false
	for _, dn := range p.Datanodes {
		n := m.nodes[dn]
		if n == nil || !n.pipelines[id] {
			return false
		}
		led = led || n.leads[id]
	}
	return led
}

// pipelineReadyGrace: heartbeats after which a pipeline counts as ready
// without a report of its leader.
const pipelineReadyGrace = 10

// noRoomLocked says which datanode of pipeline p last reported no volume
// with room for a new container, or "" if all have room (or have not
// reported free space). Callers hold m.mu.
func (m *Manager) noRoomLocked(p uint64) string {
	pl := m.st.Pipeline(p)
	if pl == nil {
		return ""
	}
	for _, id := range pl.Datanodes {
		if best, ok := m.roomLocked(id); !ok {
			return fmt.Sprintf("pipeline %d: datanode %d has %d bytes free beyond its reserve", p, id, best)
		}
	}
	return ""
}

// roomLocked reports whether datanode id last reported a volume with room
// for a new container (true if it has not reported free space), and the
// most it reported free. Callers hold m.mu.
func (m *Manager) roomLocked(id uint64) (uint64, bool) {
	n := m.nodes[id]
	if n == nil || len(n.volumes) == 0 {
		return 0, true
	}
	var best uint64
	known := false
	for _, v := range n.volumes {
		if v.AvailableKnown && !v.Failed {
			known = true
			best = max(best, v.AvailableBytes)
		}
	}
	return best, !known || best >= m.cfg.ContainerSize
}

// chargeFor is what an allocated block counts against its container: the
// whole block unless the caller expects to write less (a small key), then
// that, in 4 KiB pages. Reported usage (heartbeats) corrects the estimate.
func chargeFor(expected, blockSize uint64) uint64 {
	if expected == 0 || expected >= blockSize {
		return blockSize
	}
	return (expected + 4095) &^ 4095
}

// charge counts a block of n bytes allocated in c and marks c full (to be
// closed by the loop) when its allocations or reported usage reach the
// container size. Callers hold m.mu.
func (m *Manager) charge(c *metapb.Container, n uint64) {
	m.allocated[c.Id] += n
	used := m.allocated[c.Id]
	for _, r := range c.Replicas {
		if n := m.nodes[r]; n != nil && n.containers[c.Id] != nil {
			used = max(used, n.containers[c.Id].UsedBytes+m.cfg.BlockSize)
		}
	}
	if used >= m.cfg.ContainerSize {
		m.full[c.Id] = true
	}
}

// DeleteBlocks queues blocks for deletion on their containers' replicas.
func (m *Manager) DeleteBlocks(ctx context.Context, req *metapb.DeleteBlocksRequest) error {
	if len(req.Groups) == 0 {
		return nil
	}
	if err := checkDeleteBlocks(req); err != nil {
		return err
	}
	_, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_AddDeleteBlocks{AddDeleteBlocks: req}})
	return err
}

// Bounds of an allocation request (it does not enter the log, but its
// lists are scanned under the manager's lock).
const (
	maxExcludeIDs    = 1024
	maxLocationBytes = 1024
)

// checkDeleteBlocks refuses, before anything is proposed, a request that
// State.Apply would refuse: it would only take a log entry on every
// replica to fail there.
func checkDeleteBlocks(req *metapb.DeleteBlocksRequest) error {
	if len(req.Groups) > MaxDeleteGroups {
		return status.Errorf(codes.InvalidArgument, "delete blocks: %d groups, at most %d", len(req.Groups), MaxDeleteGroups)
	}
	for _, g := range req.Groups {
		if len(g.LocalIds) > MaxLocalIDsPerGroup {
			return status.Errorf(codes.InvalidArgument, "delete blocks: container %d has %d blocks in one group, at most %d", g.ContainerId, len(g.LocalIds), MaxLocalIDsPerGroup)
		}
	}
	return nil
}

// writeRoute is the order a pipeline's blocks are written in (the V2
// chain's route; the V1 leader is the pipeline's Raft leader either way):
// the replicas by datanode ID, rotated by the pipeline's ID. The same
// pipeline gets the same route on every allocation, so a client's stream
// connections are reused from block to block (internal/stream, protocol
// v5: a connection is reused only for the same route), and different
// pipelines start at different datanodes. A chain loads its hops evenly
// but for the last, which forwards nothing; the rotation spreads that
// role over pipelines rather than over allocations. SortByDistance then
// moves the replicas nearest the client first, stably.
func writeRoute(pipeline uint64, dns []*metapb.DatanodeDetails) []*metapb.DatanodeDetails {
	out := slices.Clone(dns)
	slices.SortFunc(out, func(a, b *metapb.DatanodeDetails) int { return cmp.Compare(a.Id, b.Id) })
	if n := len(out); n > 1 {
		k := int(pipeline % uint64(n))
		slices.Reverse(out[:k])
		slices.Reverse(out[k:])
		slices.Reverse(out)
	}
	return out
}
