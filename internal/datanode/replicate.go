package datanode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// Container replication: SCM's replication manager sends a datanode a
// ReplicateContainer command naming a CLOSED container and its healthy
// replicas; the datanode pulls the container from one of them
// (ExportContainer: storage.Export's stream, every checksum verified on
// the way out) and imports it (storage.Import: every chunk checksum and
// the stream's SHA-256 verified before anything becomes visible), then
// reports it in its next full container report, which is how SCM learns
// the copy is done and records the new replica through Raft. A copy that
// fails on one source tries the next; one that fails on all, or is
// interrupted, leaves nothing behind (Import cleans up, and storage.Open
// removes what a crash left), and SCM sends the command again or gives
// the copy to another datanode.

// Bounds of the replication service.
const (
	// MaxConcurrentCopies: containers one datanode copies in at once;
	// more commands are ignored (SCM sends them again).
	MaxConcurrentCopies = 2
	// MaxConcurrentExports: containers one datanode streams out at once;
	// a source above it refuses (RESOURCE_EXHAUSTED) and the target tries
	// its next source.
	MaxConcurrentExports = 4
	// copyAttemptTimeout bounds one copy from one source.
	copyAttemptTimeout = 30 * time.Minute
	// exportPiece: bytes per ExportContainer message.
	exportPiece = 1 << 20
)

// replicator is a datanode's copy bookkeeping.
type replicator struct {
	mu      sync.Mutex
	active  map[uint64]bool // containers being copied in
	exports int
	// failures to report in the next heartbeat (at most
	// maxCopyFailures; SCM also gives a copy up by its timeout).
	failures []*metapb.CopyFailure
}

// maxCopyFailures bounds the copy failures waiting for a heartbeat.
const maxCopyFailures = 64

func (r *replicator) failed(cid uint64, err error) {
	msg := err.Error()
	if len(msg) > 256 {
		msg = msg[:256]
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.failures) < maxCopyFailures {
		r.failures = append(r.failures, &metapb.CopyFailure{ContainerId: cid, Message: msg})
	}
}

// takeCopyFailures moves the copy failures into a heartbeat. They are not
// sent again if the heartbeat is lost: SCM's copy timeout covers that.
func (d *Datanode) takeCopyFailures(req *metapb.HeartbeatRequest) {
	r := d.replicator()
	r.mu.Lock()
	req.CopyFailures, r.failures = r.failures, nil
	r.mu.Unlock()
}

func (d *Datanode) replicator() *replicator {
	r := &d.repl
	r.mu.Lock()
	if r.active == nil {
		r.active = map[uint64]bool{}
	}
	r.mu.Unlock()
	return r
}

// CopiesInFlight is the number of containers this datanode is copying in.
func (d *Datanode) CopiesInFlight() int {
	r := d.replicator()
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.active)
}

// replicateContainer starts copying a container in the background, unless
// it is here already, being copied, or the copy limit is reached.
func (d *Datanode) replicateContainer(cmd *metapb.ReplicateContainerCommand) error {
	cid := cmd.GetContainerId()
	if _, err := d.store.Container(storage.ContainerID(cid)); err == nil {
		d.reportSoon.Store(true) // here already: make sure SCM hears of it
		return nil
	}
	if len(cmd.GetSources()) == 0 {
		return fmt.Errorf("replicate container %d: no source", cid)
	}
	r := d.replicator()
	if err := d.ownsContainer(cid, cmd.GetPipelineId()); err != nil {
		// An import here would collide with the pipeline's writes
		// ("import in progress") and leave the replica UNHEALTHY. SCM
		// hears of it and chooses another target.
		d.log.Warn("replicate container: refused", "container", cid, "err", err)
		r.failed(cid, err)
		return nil
	}
	r.mu.Lock()
	if r.active[cid] {
		r.mu.Unlock()
		return nil
	}
	if len(r.active) >= MaxConcurrentCopies {
		r.mu.Unlock()
		d.log.Debug("replicate container: at the copy limit; SCM will ask again", "container", cid, "limit", MaxConcurrentCopies)
		return nil
	}
	select {
	case <-d.stopc:
		r.mu.Unlock()
		return nil
	default:
	}
	r.active[cid] = true
	d.wg.Add(1)
	r.mu.Unlock()
	go func() {
		defer d.wg.Done()
		defer func() {
			r.mu.Lock()
			delete(r.active, cid)
			r.mu.Unlock()
		}()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-d.stopc:
				cancel()
			case <-ctx.Done():
			}
		}()
		start := time.Now()
		rep, src, err := d.copyContainer(ctx, cid, cmd.GetSources(), cmd.GetToken(), cmd.GetMaxBytesPerSec())
		if err != nil {
			d.log.Warn("replicate container: copy failed", "container", cid, "err", err)
			if ctx.Err() == nil {
				r.failed(cid, err)
			}
			return
		}
		d.log.Info("replicate container: copied and verified", "container", cid, "from", src, "blocks", rep.BlockCount, "bytes", rep.UsedBytes, "took", time.Since(start).Round(time.Millisecond))
		d.reportSoon.Store(true)
	}()
	return nil
}

// ownsContainer returns an error if one of this datanode's pipelines may
// still write into container cid: it runs pid, the pipeline the container
// was written through (its log may not have created the container here
// yet), or a pipeline's state machine here holds cid.
func (d *Datanode) ownsContainer(cid, pid uint64) error {
	d.mu.Lock()
	_, runs := d.sms[pid]
	if _, ok := d.pipelines[pid]; ok {
		runs = true
	}
	sms := make(map[uint64]*containerSM, len(d.sms))
	for id, sm := range d.sms {
		sms[id] = sm
	}
	d.mu.Unlock()
	if pid != 0 && runs {
		return fmt.Errorf("replicate container %d: this datanode still runs its pipeline %d, whose log writes into it", cid, pid)
	}
	for id, sm := range sms {
		if sm.hasContainer(cid) {
			return fmt.Errorf("replicate container %d: this datanode's pipeline %d holds it", cid, id)
		}
	}
	return nil
}

// copyContainer imports container cid from the first source that streams
// it whole.
func (d *Datanode) copyContainer(ctx context.Context, cid uint64, sources []*metapb.DatanodeDetails, token []byte, rate uint64) (storage.ContainerReport, uint64, error) {
	var errs []error
	for _, src := range sources {
		if src.GetId() == d.ident.ID {
			continue
		}
		rep, err := d.copyFrom(ctx, cid, src, token, rate)
		if err == nil {
			return rep, src.GetId(), nil
		}
		errs = append(errs, fmt.Errorf("from datanode %d: %w", src.GetId(), err))
		if errors.Is(err, storage.ErrContainerExists) || ctx.Err() != nil {
			break
		}
	}
	return storage.ContainerReport{}, 0, fmt.Errorf("container %d: %w", cid, errors.Join(errs...))
}

func (d *Datanode) copyFrom(ctx context.Context, cid uint64, src *metapb.DatanodeDetails, token []byte, rate uint64) (storage.ContainerReport, error) {
	d.mu.Lock()
	if src.GetDataAddr() != "" {
		d.peers[src.GetId()] = src
	}
	d.mu.Unlock()
	cl, err := d.peerClient(src.GetId())
	if err != nil {
		return storage.ContainerReport{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, copyAttemptTimeout)
	defer cancel()
	st, err := cl.ExportContainer(ctx, &datanodepb.ExportContainerRequest{ContainerId: cid, Token: token})
	if err != nil {
		return storage.ContainerReport{}, err
	}
	rep, err := d.store.Import(paced(ctx, &exportReader{st: st}, rate))
	if err != nil {
		return storage.ContainerReport{}, err
	}
	if uint64(rep.ID) != cid {
		// The source sent another container: not what SCM asked for.
		if derr := d.store.DeleteContainer(rep.ID, true); derr != nil {
			d.log.Warn("replicate container: drop wrong container", "container", rep.ID, "err", derr)
		}
		return storage.ContainerReport{}, fmt.Errorf("source sent container %d", rep.ID)
	}
	return rep, nil
}

// exportReader reads an ExportContainer stream as bytes.
type exportReader struct {
	st   datanodepb.Datanode_ExportContainerClient
	left []byte
}

func (r *exportReader) Read(p []byte) (int, error) {
	for len(r.left) == 0 {
		m, err := r.st.Recv()
		if err != nil {
			if err == io.EOF {
				return 0, io.EOF
			}
			return 0, err
		}
		r.left = m.GetData()
	}
	n := copy(p, r.left)
	r.left = r.left[n:]
	return n, nil
}

// deleteContainer removes a replica SCM no longer lists.
func (d *Datanode) deleteContainer(cmd *metapb.DeleteContainerCommand) error {
	cid := storage.ContainerID(cmd.GetContainerId())
	unlock, err := d.persistOwners(cid)
	if err != nil {
		return err
	}
	defer unlock()
	err = d.store.DeleteContainer(cid, false)
	if errors.Is(err, storage.ErrContainerNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	d.mu.Lock()
	d.leftSick.drop(uint64(cid))
	d.mu.Unlock()
	d.log.Info("container replica deleted", "container", cid, "reason", cmd.GetReason())
	d.reportSoon.Store(true)
	return nil
}

// persistOwners persists the applied index of the pipeline that wrote
// cid, before cid is deleted: a restart must never apply again an entry
// that wrote into it (a PutBlock replayed into a deleted container would
// create it afresh, without its data, and mark it UNHEALTHY). Every such
// entry was applied before the container was closed, and a container is
// deleted only closed, so the applied index, once durable, is past all of
// them: replay starts above it. The durable index never goes backwards.
// The pipeline's apply waits until unlock is called (the container is
// gone), so applied covers every entry storage shows the effects of. If
// the index cannot be persisted, the delete is refused; SCM asks again.
func (d *Datanode) persistOwners(cid storage.ContainerID) (unlock func(), err error) {
	d.mu.Lock()
	var sms []*containerSM
	for _, id := range slices.Sorted(maps.Keys(d.sms)) {
		if sm := d.sms[id]; sm.hasContainer(uint64(cid)) {
			sms = append(sms, sm)
		}
	}
	d.mu.Unlock()
	var locked []*containerSM
	unlock = func() {
		for _, sm := range locked {
			sm.applyMu.Unlock()
		}
	}
	for _, sm := range sms {
		sm.applyMu.Lock()
		locked = append(locked, sm)
		if err := sm.persist(sm.applied.Load()); err != nil {
			unlock()
			return nil, fmt.Errorf("datanode: container %d not deleted: %w", cid, err)
		}
	}
	return unlock, nil
}

// ExportContainer streams a CLOSED container (see storage.Export).
func (s *service) ExportContainer(req *datanodepb.ExportContainerRequest, st datanodepb.Datanode_ExportContainerServer) error {
	// A container token (local ID 0) from SCM's ReplicateContainer.
	if err := tokenStatus(s.d.verifyToken(req.GetToken(), req.GetContainerId(), 0, blocktoken.Read)); err != nil {
		return err
	}
	r := s.d.replicator()
	r.mu.Lock()
	if r.exports >= MaxConcurrentExports {
		r.mu.Unlock()
		return status.Errorf(codes.ResourceExhausted, "export container %d: %d exports running (at most %d)", req.GetContainerId(), MaxConcurrentExports, MaxConcurrentExports)
	}
	r.exports++
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.exports--
		r.mu.Unlock()
	}()
	err := s.d.store.Export(storage.ContainerID(req.GetContainerId()), &exportWriter{st: st})
	if err != nil {
		return s.toStatus(err)
	}
	return nil
}

// exportWriter sends what it is given as ExportContainer messages of at
// most exportPiece bytes.
type exportWriter struct {
	st datanodepb.Datanode_ExportContainerServer
}

func (w *exportWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		k := min(len(p), exportPiece)
		if err := w.st.Send(&datanodepb.ExportContainerResponse{Data: p[:k]}); err != nil {
			return n, err
		}
		n += k
		p = p[k:]
	}
	return n, nil
}
