package scm

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"sync"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Pebble key layout of the SCM group (all integers big-endian uint64):
//
//	n/<datanode id>    DatanodeDetails
//	u/<uuid>           datanode id
//	p/<pipeline id>    Pipeline
//	c/<container id>   Container
//	d/<tx id>          DeleteBlocksTx, until every replica has done it
//	m/<counter>        next IDs: dn, pipeline, container, local, tx
//	k/<key id>         SecretKey (block token keys, secretkeys.go)
//
// Everything but d/ is mirrored in memory (the SCM state is small: one row
// per datanode, pipeline and container) so that reads never touch Pebble.
var (
	pfxDatanode  = []byte("n/")
	pfxUUID      = []byte("u/")
	pfxPipeline  = []byte("p/")
	pfxContainer = []byte("c/")
	pfxDeleteTx  = []byte("d/")
	keyNextDN    = []byte("m/next_dn")
	keyNextPipe  = []byte("m/next_pipeline")
	keyNextCont  = []byte("m/next_container")
	keyNextLocal = []byte("m/next_local")
	keyNextTx    = []byte("m/next_tx")
	keySafeExit  = []byte("m/safe_exit")
)

// FirstPipelineID is the first pipeline ID handed out. Pipeline IDs are
// Raft group IDs on the datanodes; starting high keeps them visibly apart
// from the meta groups (1 and 2) in logs and metrics.
const FirstPipelineID = 1000

// Limits on what one command may carry.
const (
	MaxIDRange          = 1 << 20
	MaxDeleteGroups     = 1024
	MaxLocalIDsPerGroup = 4096
	MaxUnhealthyPerOp   = 1024
	maxReasonBytes      = 256
)

func key(pfx []byte, id uint64) []byte { return append(append([]byte(nil), pfx...), store.U64(id)...) }

// State is the SCM state machine: the replicated part of SCM. Apply is
// called from one goroutine; readers use the accessors, which take mu.
type State struct {
	st *store.Store

	mu         sync.RWMutex
	datanodes  map[uint64]*metapb.DatanodeDetails
	byUUID     map[string]uint64
	pipelines  map[uint64]*metapb.Pipeline
	containers map[uint64]*metapb.Container
	next       counters

	// Indexes over the mirror, kept by setPipeline and setContainer (the
	// only writers of pipelines and containers), so that block allocation
	// and the leader loop look at the open pipelines and containers only,
	// not at every container ever created: the container count grows with
	// the data (and quickly with small blocks), the open ones stay at
	// pipelines × OpenContainersPerPipeline.
	openPipes map[metapb.Replication][]uint64 // OPEN pipelines, sorted IDs
	openConts map[metapb.Replication][]uint64 // OPEN containers, sorted IDs
	closing   map[uint64]struct{}             // CLOSING containers

	opStates map[uint64]*metapb.NodeOpRow      // operational states (opstate.go)
	reports  map[repKey]*metapb.CorruptReplica // reports against replicas
	safeExit bool                              // a leader left safe mode once
	keys     secretKeys                        // block token keys (secretkeys.go)
	cache    cacheDefs                         // cache pools and directives (cache.go)

	// halt: the apply halt (applyhalt): set, this replica applies nothing
	// more.
	halt *applyhalt.Group
}

// setPipeline stores p in the mirror and its indexes (caller holds mu for
// writing).
func (s *State) setPipeline(p *metapb.Pipeline) {
	if old := s.pipelines[p.Id]; old != nil && old.State == metapb.PipelineState_PIPELINE_OPEN {
		s.openPipes[old.Replication] = removeSorted(s.openPipes[old.Replication], old.Id)
	}
	s.pipelines[p.Id] = p
	if p.State == metapb.PipelineState_PIPELINE_OPEN {
		s.openPipes[p.Replication] = insertSorted(s.openPipes[p.Replication], p.Id)
	}
}

// setContainer stores c in the mirror and its indexes (caller holds mu for
// writing).
func (s *State) setContainer(c *metapb.Container) {
	if old := s.containers[c.Id]; old != nil {
		switch old.State {
		case metapb.ContainerState_CONTAINER_OPEN:
			s.openConts[old.Replication] = removeSorted(s.openConts[old.Replication], old.Id)
		case metapb.ContainerState_CONTAINER_CLOSING:
			delete(s.closing, old.Id)
		}
	}
	s.containers[c.Id] = c
	switch c.State {
	case metapb.ContainerState_CONTAINER_OPEN:
		s.openConts[c.Replication] = insertSorted(s.openConts[c.Replication], c.Id)
	case metapb.ContainerState_CONTAINER_CLOSING:
		s.closing[c.Id] = struct{}{}
	}
}

func insertSorted(ids []uint64, id uint64) []uint64 {
	i, found := slices.BinarySearch(ids, id)
	if found {
		return ids
	}
	return slices.Insert(ids, i, id)
}

func removeSorted(ids []uint64, id uint64) []uint64 {
	i, found := slices.BinarySearch(ids, id)
	if !found {
		panic(fmt.Sprintf("scm: index lost id %d", id))
	}
	return slices.Delete(ids, i, i+1)
}

type counters struct {
	dn, pipeline, container, local, tx uint64
}

// Open opens the SCM state in dir.
func Open(dir string, opts store.Options) (*State, error) { return OpenHiding(dir, opts, nil) }

// OpenHiding is Open for a replica that treats the ops hidden (ScmCommand
// field numbers) as unknown, as a binary without them (tests).
func OpenHiding(dir string, opts store.Options, hidden []int32) (*State, error) {
	st, err := store.Open(dir, opts)
	if err != nil {
		return nil, err
	}
	s := &State{st: st, halt: applyhalt.New("scm", st, &metapb.ScmCommand{}, hidden)}
	if err := s.halt.Load(); err != nil {
		st.Close()
		return nil, err
	}
	if err := s.load(); err != nil {
		st.Close()
		return nil, err
	}
	return s, nil
}

// Halt is the apply halt of this replica (applyhalt).
func (s *State) Halt() *applyhalt.Group { return s.halt }

// Close closes the store.
func (s *State) Close() error { return s.st.Close() }

// Store exposes the underlying store (snapshots, durable index).
func (s *State) Store() *store.Store { return s.st }

func (s *State) load() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loadLocked()
}

// loadLocked is load with s.mu held.
func (s *State) loadLocked() error {
	s.datanodes = map[uint64]*metapb.DatanodeDetails{}
	s.byUUID = map[string]uint64{}
	s.pipelines = map[uint64]*metapb.Pipeline{}
	s.containers = map[uint64]*metapb.Container{}
	s.openPipes = map[metapb.Replication][]uint64{}
	s.openConts = map[metapb.Replication][]uint64{}
	s.closing = map[uint64]struct{}{}
	s.next = counters{dn: 1, pipeline: FirstPipelineID, container: 1, local: 1, tx: 1}
	return s.st.View(func(r pebble.Reader) error {
		if err := s.loadExtra(r); err != nil {
			return err
		}
		if err := s.loadCache(r); err != nil {
			return err
		}
		for _, c := range []struct {
			k   []byte
			dst *uint64
		}{{keyNextDN, &s.next.dn}, {keyNextPipe, &s.next.pipeline}, {keyNextCont, &s.next.container}, {keyNextLocal, &s.next.local}, {keyNextTx, &s.next.tx}} {
			v, closer, err := r.Get(c.k)
			if errors.Is(err, pebble.ErrNotFound) {
				continue
			}
			if err != nil {
				return err
			}
			*c.dst = decodeU64(v)
			closer.Close()
		}
		if err := store.Scan(r, pfxDatanode, func(_, v []byte) error {
			d := &metapb.DatanodeDetails{}
			if err := proto.Unmarshal(v, d); err != nil {
				return err
			}
			s.datanodes[d.Id] = d
			s.byUUID[d.Uuid] = d.Id
			return nil
		}); err != nil {
			return err
		}
		if err := store.Scan(r, pfxPipeline, func(_, v []byte) error {
			p := &metapb.Pipeline{}
			if err := proto.Unmarshal(v, p); err != nil {
				return err
			}
			s.setPipeline(p)
			return nil
		}); err != nil {
			return err
		}
		if err := store.Scan(r, pfxContainer, func(_, v []byte) error {
			c := &metapb.Container{}
			if err := proto.Unmarshal(v, c); err != nil {
				return err
			}
			s.setContainer(c)
			return nil
		}); err != nil {
			return err
		}
		return s.loadSecretKeys(r)
	})
}

func decodeU64(v []byte) uint64 {
	if len(v) != 8 {
		panic(fmt.Sprintf("scm: counter has %d bytes, want 8", len(v)))
	}
	return uint64(v[0])<<56 | uint64(v[1])<<48 | uint64(v[2])<<40 | uint64(v[3])<<32 |
		uint64(v[4])<<24 | uint64(v[5])<<16 | uint64(v[6])<<8 | uint64(v[7])
}

// AppliedIndex is the durable applied index (raft.StateMachine).
func (s *State) AppliedIndex() uint64 { return s.st.DurableIndex() }

// Snapshot returns a checkpoint stream (raft.StateMachine).
func (s *State) Snapshot() (uint64, io.ReadCloser, error) { return s.st.Snapshot() }

// Restore replaces the state and reloads the in-memory mirror.
func (s *State) Restore(index uint64, r io.Reader) error {
	if err := s.halt.CheckRestore(); err != nil {
		return err
	}
	if err := s.st.Restore(index, r); err != nil {
		return err
	}
	if err := s.halt.Drop(); err != nil { // the sender's row, if any (applyhalt.Key)
		return err
	}
	return s.load()
}

// Apply applies entries in order, in one Pebble batch, and returns one
// result per entry: a value or an error (a gRPC status for user errors).
func (s *State) Apply(entries []store.Entry) []any {
	// One batch under s.mu; the halt rule and the apply guard of
	// applyhalt; a failed commit panics (the mirror would be ahead of the
	// disk: replay the log on restart).
	return applyhalt.ApplyMirrored(s.halt, entries, &s.mu, func() *metapb.ScmCommand { return &metapb.ScmCommand{} }, s.apply, s.loadLocked)
}

func (s *State) put(b *pebble.Batch, k []byte, m proto.Message) {
	v, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	if err := b.Set(k, v, nil); err != nil {
		panic(err)
	}
}

func (s *State) putU64(b *pebble.Batch, k []byte, v uint64) {
	if err := b.Set(k, store.U64(v), nil); err != nil {
		panic(err)
	}
}

func (s *State) apply(b *pebble.Batch, cmd *metapb.ScmCommand) any {
	now := cmd.NowUnixMs
	switch op := cmd.Op.(type) {
	case *metapb.ScmCommand_RegisterDatanode:
		return s.applyRegister(b, op.RegisterDatanode.Details)
	case *metapb.ScmCommand_CreatePipeline:
		return s.applyCreatePipeline(b, op.CreatePipeline, now)
	case *metapb.ScmCommand_ClosePipelines:
		for _, id := range op.ClosePipelines.PipelineIds {
			s.closePipeline(b, id, op.ClosePipelines.Reason, now)
		}
		return nil
	case *metapb.ScmCommand_CreateContainer:
		p := s.pipelines[op.CreateContainer.PipelineId]
		if p == nil || p.State != metapb.PipelineState_PIPELINE_OPEN {
			return status.Errorf(codes.FailedPrecondition, "create container: pipeline %d is not open", op.CreateContainer.PipelineId)
		}
		c := &metapb.Container{
			Id: s.next.container, PipelineId: p.Id, Replication: p.Replication,
			State: metapb.ContainerState_CONTAINER_OPEN, Replicas: slices.Clone(p.Datanodes), CreatedUnixMs: now,
		}
		s.next.container++
		s.putU64(b, keyNextCont, s.next.container)
		s.setContainer(c)
		s.put(b, key(pfxContainer, c.Id), c)
		return proto.Clone(c)
	case *metapb.ScmCommand_CloseContainers:
		for _, id := range op.CloseContainers.ContainerIds {
			if c := s.containers[id]; c != nil && c.State == metapb.ContainerState_CONTAINER_OPEN {
				s.setContainerState(b, c, metapb.ContainerState_CONTAINER_CLOSING)
			}
		}
		return nil
	case *metapb.ScmCommand_ContainerClosed:
		c := s.containers[op.ContainerClosed.ContainerId]
		if c == nil {
			return status.Errorf(codes.NotFound, "container %d not found", op.ContainerClosed.ContainerId)
		}
		if c.State != metapb.ContainerState_CONTAINER_CLOSED {
			c = proto.Clone(c).(*metapb.Container)
			c.State = metapb.ContainerState_CONTAINER_CLOSED
			c.UsedBytes = op.ContainerClosed.UsedBytes
			if bc := op.ContainerClosed.Bcsid; bc > c.GetBcsidFloor().GetBcsid() {
				c.BcsidFloor = &metapb.BcsidFloor{Bcsid: bc, UnixMs: now, Reason: "closed: the lowest BCSID its healthy closed replicas reported"}
			}
			s.setContainer(c)
			s.put(b, key(pfxContainer, c.Id), c)
		}
		return nil
	case *metapb.ScmCommand_AllocateIdRange:
		n := op.AllocateIdRange.Count
		if n == 0 || n > MaxIDRange {
			return status.Errorf(codes.InvalidArgument, "id range of %d, want 1..%d", n, MaxIDRange)
		}
		start := s.next.local
		s.next.local += n
		s.putU64(b, keyNextLocal, s.next.local)
		return start
	case *metapb.ScmCommand_AddDeleteBlocks:
		groups := op.AddDeleteBlocks.Groups
		if len(groups) > MaxDeleteGroups {
			return status.Errorf(codes.InvalidArgument, "delete blocks: %d groups, at most %d", len(groups), MaxDeleteGroups)
		}
		var txs []uint64
		for _, g := range groups {
			if len(g.LocalIds) == 0 {
				continue
			}
			if len(g.LocalIds) > MaxLocalIDsPerGroup {
				return status.Errorf(codes.InvalidArgument, "delete blocks: container %d has %d blocks in one group, at most %d", g.ContainerId, len(g.LocalIds), MaxLocalIDsPerGroup)
			}
		}
		for _, g := range groups {
			if len(g.LocalIds) == 0 || s.containers[g.ContainerId] == nil {
				// Blocks of an unknown container never reached a disk.
				continue
			}
			tx := &metapb.DeleteBlocksTx{TxId: s.next.tx, ContainerId: g.ContainerId, LocalIds: g.LocalIds}
			s.next.tx++
			s.put(b, key(pfxDeleteTx, tx.TxId), tx)
			txs = append(txs, tx.TxId)
		}
		s.putU64(b, keyNextTx, s.next.tx)
		return txs
	case *metapb.ScmCommand_ReplicasUnhealthy:
		return s.applyUnhealthy(b, op.ReplicasUnhealthy.Replicas, now)
	case *metapb.ScmCommand_ReplicaAdded:
		return s.applyReplicaAdded(b, op.ReplicaAdded)
	case *metapb.ScmCommand_ReplicasRemoved:
		return s.applyReplicasRemoved(b, op.ReplicasRemoved, now)
	case *metapb.ScmCommand_ReplicaRecovered:
		return s.applyReplicaRecovered(b, op.ReplicaRecovered, now)
	case *metapb.ScmCommand_SetNodeOpState:
		return s.applySetNodeOpState(b, op.SetNodeOpState, now)
	case *metapb.ScmCommand_ReplicaReports:
		return s.applyReplicaReports(b, op.ReplicaReports.Reports, now)
	case *metapb.ScmCommand_SafeModeExited:
		if !s.safeExit {
			s.safeExit = true
			s.putU64(b, keySafeExit, uint64(now))
		}
		return nil
	case *metapb.ScmCommand_SecretKeys:
		return s.applySecretKeys(b, op.SecretKeys)
	case *metapb.ScmCommand_ForcedKeyRotation:
		return s.applyForcedKeyRotation(b, op.ForcedKeyRotation)
	case *metapb.ScmCommand_CachePool:
		return s.applyCachePool(b, op.CachePool)
	case *metapb.ScmCommand_CacheDirective:
		return s.applyCacheDirective(b, op.CacheDirective, now)
	case *metapb.ScmCommand_PurgeDeleteTxs:
		for _, id := range op.PurgeDeleteTxs.TxIds {
			if err := b.Delete(key(pfxDeleteTx, id), nil); err != nil {
				panic(err)
			}
		}
		return nil
	default:
		return fmt.Errorf("scm: unknown command %T", cmd.Op)
	}
}

// applyUnhealthy records replicas as unhealthy and stops writes to their
// containers: an OPEN container becomes CLOSING, so no block is allocated
// in it again and the leader closes it on the remaining replicas. Entries
// naming an unknown container or a datanode that is not its replica are
// skipped (the leader checked them; the state may have moved since).
func (s *State) applyUnhealthy(b *pebble.Batch, reps []*metapb.UnhealthyReplica, now int64) any {
	if len(reps) > MaxUnhealthyPerOp {
		return status.Errorf(codes.InvalidArgument, "unhealthy replicas: %d in one command, at most %d", len(reps), MaxUnhealthyPerOp)
	}
	var n int
	for _, r := range reps {
		c := s.containers[r.ContainerId]
		if c == nil || !slices.Contains(c.Replicas, r.DatanodeId) || slices.Contains(c.UnhealthyReplicas, r.DatanodeId) {
			continue
		}
		s.recordReport(b, c.Id, 0, r.DatanodeId, r.Reason, "scm", now)
		c = proto.Clone(c).(*metapb.Container)
		c.UnhealthyReplicas = insertSorted(c.UnhealthyReplicas, r.DatanodeId)
		if c.State == metapb.ContainerState_CONTAINER_OPEN {
			c.State = metapb.ContainerState_CONTAINER_CLOSING
		}
		s.setContainer(c)
		s.put(b, key(pfxContainer, c.Id), c)
		n++
	}
	return n
}

// applyReplicaAdded records a verified copy of a CLOSED container. It
// returns whether the replica set changed: a repeat (the leader proposed
// it again after a failover or a lost answer) changes nothing.
func (s *State) applyReplicaAdded(b *pebble.Batch, op *metapb.ReplicaAddedOp) any {
	c := s.containers[op.ContainerId]
	if c == nil {
		return status.Errorf(codes.NotFound, "replica added: container %d not found", op.ContainerId)
	}
	if c.State != metapb.ContainerState_CONTAINER_CLOSED {
		return status.Errorf(codes.FailedPrecondition, "replica added: container %d is %v, not CLOSED", c.Id, c.State)
	}
	if s.datanodes[op.DatanodeId] == nil {
		return status.Errorf(codes.NotFound, "replica added: datanode %d not registered", op.DatanodeId)
	}
	if slices.Contains(c.Replicas, op.DatanodeId) {
		return false
	}
	c = proto.Clone(c).(*metapb.Container)
	c.Replicas = append(c.Replicas, op.DatanodeId)
	s.setContainer(c)
	s.put(b, key(pfxContainer, c.Id), c)
	return true
}

// applyReplicasRemoved drops replicas of a CLOSED container. The leader
// removes a replica only once enough healthy ones are recorded; Apply
// re-checks the part it can see, that at least one replica not recorded
// unhealthy stays, so no command can leave a container without a
// location. It raises the container's BCSID floor to the highest of
// op.bcsids among the replicas it really drops (the proposer computed
// them, capped at the healthy replicas it keeps: dropBcsidsLocked; Apply
// reads no soft state), so a replica below that never counts afterwards
// (recover.go, replication.go).
func (s *State) applyReplicasRemoved(b *pebble.Batch, op *metapb.ReplicasRemovedOp, now int64) any {
	c := s.containers[op.ContainerId]
	if c == nil {
		return status.Errorf(codes.NotFound, "replicas removed: container %d not found", op.ContainerId)
	}
	if c.State != metapb.ContainerState_CONTAINER_CLOSED {
		return status.Errorf(codes.FailedPrecondition, "replicas removed: container %d is %v, not CLOSED", c.Id, c.State)
	}
	if len(op.Bcsids) > len(op.DatanodeIds) {
		return status.Errorf(codes.InvalidArgument, "replicas removed: %d BCSIDs for %d datanodes", len(op.Bcsids), len(op.DatanodeIds))
	}
	var keep, unhealthy, gone []uint64
	good := 0
	for _, r := range c.Replicas {
		if slices.Contains(op.DatanodeIds, r) {
			gone = append(gone, r)
			continue
		}
		keep = append(keep, r)
		if slices.Contains(c.UnhealthyReplicas, r) {
			unhealthy = append(unhealthy, r)
		} else {
			good++
		}
	}
	if len(keep) == len(c.Replicas) {
		return 0
	}
	if good == 0 {
		return status.Errorf(codes.FailedPrecondition, "replicas removed: removing %v from container %d (replicas %v, unhealthy %v) would leave no healthy replica",
			op.DatanodeIds, c.Id, c.Replicas, c.UnhealthyReplicas)
	}
	n := len(c.Replicas) - len(keep)
	for _, r := range gone {
		s.dropReports(b, c.Id, r)
	}
	floor := c.GetBcsidFloor()
	for i, dn := range op.DatanodeIds {
		if i < len(op.Bcsids) && op.Bcsids[i] > floor.GetBcsid() && slices.Contains(gone, dn) {
			floor = &metapb.BcsidFloor{Bcsid: op.Bcsids[i], DatanodeId: dn, UnixMs: now, Reason: truncReason("replica dropped: " + op.Reason)}
		}
	}
	c = proto.Clone(c).(*metapb.Container)
	c.Replicas = keep
	c.UnhealthyReplicas = unhealthy
	c.BcsidFloor = floor
	s.setContainer(c)
	s.put(b, key(pfxContainer, c.Id), c)
	return n
}

func (s *State) applyRegister(b *pebble.Batch, d *metapb.DatanodeDetails) any {
	if d == nil || d.Uuid == "" {
		return status.Error(codes.InvalidArgument, "register datanode: uuid is empty")
	}
	d = proto.Clone(d).(*metapb.DatanodeDetails)
	if id, ok := s.byUUID[d.Uuid]; ok {
		d.Id = id
	} else if d.Id != 0 && s.datanodes[d.Id] == nil {
		// A datanode that kept its ID while SCM lost (or never had) its
		// row: keep the ID so its pipelines' Raft groups stay valid.
		if d.Id >= s.next.dn {
			s.next.dn = d.Id + 1
		}
	} else {
		d.Id = s.next.dn
		s.next.dn++
	}
	s.putU64(b, keyNextDN, s.next.dn)
	s.datanodes[d.Id] = d
	s.byUUID[d.Uuid] = d.Id
	s.put(b, key(pfxDatanode, d.Id), d)
	if err := b.Set(append(append([]byte(nil), pfxUUID...), d.Uuid...), store.U64(d.Id), nil); err != nil {
		panic(err)
	}
	return d.Id
}

// SetKey is the identity of a pipeline's member set (sorted IDs).
func SetKey(ids []uint64) string {
	s := slices.Clone(ids)
	slices.Sort(s)
	return fmt.Sprint(s)
}

func (s *State) applyCreatePipeline(b *pebble.Batch, op *metapb.CreatePipelineOp, now int64) any {
	want := int(op.Replication)
	if want != 1 && want != 3 {
		return status.Errorf(codes.InvalidArgument, "create pipeline: replication %v, want ONE or THREE", op.Replication)
	}
	if len(op.Datanodes) != want {
		return status.Errorf(codes.InvalidArgument, "create pipeline: %d datanodes for replication %v", len(op.Datanodes), op.Replication)
	}
	seen := map[uint64]bool{}
	for _, id := range op.Datanodes {
		if s.datanodes[id] == nil {
			return status.Errorf(codes.NotFound, "create pipeline: datanode %d not registered", id)
		}
		if seen[id] {
			return status.Errorf(codes.InvalidArgument, "create pipeline: datanode %d listed twice", id)
		}
		seen[id] = true
	}
	k := SetKey(op.Datanodes)
	for _, p := range s.pipelines {
		if p.State == metapb.PipelineState_PIPELINE_OPEN && SetKey(p.Datanodes) == k {
			return status.Errorf(codes.AlreadyExists, "create pipeline: pipeline %d already has datanodes %s", p.Id, k)
		}
	}
	p := &metapb.Pipeline{
		Id: s.next.pipeline, Replication: op.Replication, Datanodes: slices.Clone(op.Datanodes),
		State: metapb.PipelineState_PIPELINE_OPEN, CreatedUnixMs: now,
	}
	s.next.pipeline++
	s.putU64(b, keyNextPipe, s.next.pipeline)
	s.setPipeline(p)
	s.put(b, key(pfxPipeline, p.Id), p)
	return proto.Clone(p)
}

func (s *State) closePipeline(b *pebble.Batch, id uint64, reason string, now int64) {
	p := s.pipelines[id]
	if p == nil || p.State == metapb.PipelineState_PIPELINE_CLOSED {
		return
	}
	p = proto.Clone(p).(*metapb.Pipeline)
	p.State = metapb.PipelineState_PIPELINE_CLOSED
	p.ClosedUnixMs = now
	p.CloseReason = reason
	s.setPipeline(p)
	s.put(b, key(pfxPipeline, id), p)
	// Its open containers can take no more writes. (Collected first:
	// setContainerState changes the index.)
	var open []*metapb.Container
	for _, cid := range s.openConts[p.Replication] {
		if c := s.containers[cid]; c.PipelineId == id {
			open = append(open, c)
		}
	}
	for _, c := range open {
		s.setContainerState(b, c, metapb.ContainerState_CONTAINER_CLOSING)
	}
}

func (s *State) setContainerState(b *pebble.Batch, c *metapb.Container, st metapb.ContainerState) {
	c = proto.Clone(c).(*metapb.Container)
	c.State = st
	s.setContainer(c)
	s.put(b, key(pfxContainer, c.Id), c)
}

// ---- readers. They return shared immutable objects: Apply replaces
// objects instead of changing them, so callers must not modify them.

// Datanode returns a registered datanode.
func (s *State) Datanode(id uint64) *metapb.DatanodeDetails {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.datanodes[id]
}

// DatanodeByUUID returns the ID of a registered datanode.
func (s *State) DatanodeByUUID(uuid string) (uint64, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	id, ok := s.byUUID[uuid]
	return id, ok
}

// Datanodes returns all registered datanodes sorted by ID.
func (s *State) Datanodes() []*metapb.DatanodeDetails {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.DatanodeDetails, 0, len(s.datanodes))
	for _, d := range s.datanodes {
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

// Pipeline returns a pipeline.
func (s *State) Pipeline(id uint64) *metapb.Pipeline {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pipelines[id]
}

// Pipelines returns all pipelines sorted by ID.
func (s *State) Pipelines() []*metapb.Pipeline {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.Pipeline, 0, len(s.pipelines))
	for _, p := range s.pipelines {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

// Container returns a container.
func (s *State) Container(id uint64) *metapb.Container {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.containers[id]
}

// Containers returns all containers sorted by ID.
func (s *State) Containers() []*metapb.Container {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.Container, 0, len(s.containers))
	for _, c := range s.containers {
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

// OpenPipelines returns the OPEN pipelines of a replication, sorted by ID.
func (s *State) OpenPipelines(repl metapb.Replication) []*metapb.Pipeline {
	s.mu.RLock()
	defer s.mu.RUnlock()
	ids := s.openPipes[repl]
	out := make([]*metapb.Pipeline, len(ids))
	for i, id := range ids {
		out[i] = s.pipelines[id]
	}
	return out
}

// EachOpenContainer calls f for the OPEN containers of a replication in ID
// order, until f returns false. f runs under the state's read lock: it
// must not call State.
func (s *State) EachOpenContainer(repl metapb.Replication, f func(*metapb.Container) bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, id := range s.openConts[repl] {
		if !f(s.containers[id]) {
			return
		}
	}
}

// OpenContainers returns the OPEN containers of every replication, sorted
// by ID.
func (s *State) OpenContainers() []*metapb.Container {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []*metapb.Container
	for _, ids := range s.openConts {
		for _, id := range ids {
			out = append(out, s.containers[id])
		}
	}
	slices.SortFunc(out, func(a, b *metapb.Container) int { return cmp.Compare(a.Id, b.Id) })
	return out
}

// ClosingContainers returns the CLOSING containers, sorted by ID.
func (s *State) ClosingContainers() []*metapb.Container {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*metapb.Container, 0, len(s.closing))
	for id := range s.closing {
		out = append(out, s.containers[id])
	}
	slices.SortFunc(out, func(a, b *metapb.Container) int { return cmp.Compare(a.Id, b.Id) })
	return out
}

// ContainerReplicas returns a container and the details of its healthy
// replicas under one lock: replicas recorded unhealthy, and datanodes no
// longer registered, are left out, so no caller (block allocation,
// LookupKey, GetContainers) ever offers one as a location.
func (s *State) ContainerReplicas(id uint64) (*metapb.Container, []*metapb.DatanodeDetails) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.containers[id]
	if c == nil {
		return nil, nil
	}
	dns := make([]*metapb.DatanodeDetails, 0, len(c.Replicas))
	for _, r := range c.Replicas {
		if slices.Contains(c.UnhealthyReplicas, r) {
			continue
		}
		if d := s.datanodes[r]; d != nil {
			dns = append(dns, d)
		}
	}
	return c, dns
}

// DeleteTx returns one delete-block transaction, or nil if there is none
// with that ID (never added, or purged).
func (s *State) DeleteTx(id uint64) (*metapb.DeleteBlocksTx, error) {
	var tx *metapb.DeleteBlocksTx
	err := s.st.View(func(r pebble.Reader) error {
		v, closer, err := r.Get(key(pfxDeleteTx, id))
		if errors.Is(err, pebble.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		defer closer.Close()
		tx = &metapb.DeleteBlocksTx{}
		return proto.Unmarshal(v, tx)
	})
	return tx, err
}

// DeleteTxs returns up to limit delete-block transactions with IDs > after.
func (s *State) DeleteTxs(after uint64, limit int) ([]*metapb.DeleteBlocksTx, error) {
	var out []*metapb.DeleteBlocksTx
	err := s.st.View(func(r pebble.Reader) error {
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: key(pfxDeleteTx, after+1), UpperBound: store.PrefixEnd(pfxDeleteTx)})
		if err != nil {
			return err
		}
		defer it.Close()
		for it.First(); it.Valid() && len(out) < limit; it.Next() {
			tx := &metapb.DeleteBlocksTx{}
			if err := proto.Unmarshal(it.Value(), tx); err != nil {
				return err
			}
			out = append(out, tx)
		}
		return it.Error()
	})
	return out, err
}
