package datanode

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// service implements datanodepb.DatanodeServer.
type service struct {
	datanodepb.UnimplementedDatanodeServer
	d *Datanode
}

// dnError builds a gRPC status carrying a datanodepb.Error the client acts on.
func dnError(c codes.Code, kind datanodepb.Error_Kind, msg string, detail *datanodepb.Error) error {
	if detail == nil {
		detail = &datanodepb.Error{}
	}
	detail.Kind = kind
	st, err := status.New(c, msg).WithDetails(detail)
	if err != nil {
		return status.Error(c, msg)
	}
	return st.Err()
}

// toStatus maps storage and raft errors to statuses with a kind.
func (s *service) toStatus(err error) error {
	if err == nil {
		return nil
	}
	var nle *raft.NotLeaderError
	var lag *raft.LagError
	var rf *replicaFailedError
	switch {
	case errors.As(err, &rf):
		return dnError(codes.Aborted, datanodepb.Error_REPLICA_FAILED, err.Error(), &datanodepb.Error{Failed: rf.ids()})
	case errors.Is(err, raft.ErrOutcomeUnknown):
		// The proposal reached the pipeline's log and may still commit: not
		// a retryable "unavailable" (checked before the context errors it
		// may wrap). The client must neither report success nor write the
		// data again as if it had not happened.
		return dnError(codes.Unknown, datanodepb.Error_OUTCOME_UNKNOWN, "outcome unknown, the write may or may not have been applied: "+err.Error(), nil)
	case errors.As(err, &nle):
		return dnError(codes.Unavailable, datanodepb.Error_NOT_LEADER, err.Error(),
			&datanodepb.Error{LeaderId: nle.Leader, LeaderAddr: s.d.peerDataAddr(nle.Leader)})
	case errors.As(err, &lag):
		var ids []uint64
		for id := range lag.Lagging {
			ids = append(ids, id)
		}
		return dnError(codes.DeadlineExceeded, datanodepb.Error_REPLICAS_LAG, err.Error(), &datanodepb.Error{Lagging: ids})
	case errors.Is(err, raft.ErrProposalDropped):
		// raft dropped it (no leader known, a leadership transfer, an entry
		// replaced by a new leader's). Never a full inflight budget:
		// Propose and ProposeMany wait for budget, and a wait the context
		// ends is a context error (DeadlineExceeded below), not an election.
		return dnError(codes.Unavailable, datanodepb.Error_NOT_LEADER, err.Error(), nil)
	case errors.Is(err, raft.ErrStopped), errors.Is(err, raft.ErrGroupNotFound):
		return dnError(codes.Unavailable, datanodepb.Error_PIPELINE_NOT_FOUND, err.Error(), nil)
	case errors.Is(err, storage.ErrContainerNotOpen):
		return dnError(codes.FailedPrecondition, datanodepb.Error_CONTAINER_NOT_OPEN, err.Error(), nil)
	case errors.Is(err, storage.ErrContainerFull):
		return dnError(codes.ResourceExhausted, datanodepb.Error_CONTAINER_FULL, err.Error(), nil)
	case errors.Is(err, storage.ErrContainerNotFound):
		return dnError(codes.NotFound, datanodepb.Error_NO_SUCH_CONTAINER, err.Error(), nil)
	case errors.Is(err, storage.ErrBlockNotFound):
		return dnError(codes.NotFound, datanodepb.Error_NO_SUCH_BLOCK, err.Error(), nil)
	case errors.Is(err, storage.ErrChecksumMismatch), errors.Is(err, storage.ErrCorruption):
		return dnError(codes.DataLoss, datanodepb.Error_CHECKSUM_MISMATCH, err.Error(), nil)
	case errors.Is(err, storage.ErrDiskFull), errors.Is(err, raft.ErrLogDiskFull):
		return dnError(codes.ResourceExhausted, datanodepb.Error_DISK_FULL, err.Error(), nil)
	case errors.Is(err, storage.ErrOutOfRange):
		return dnError(codes.OutOfRange, datanodepb.Error_BAD_REQUEST, err.Error(), nil)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return status.Error(codes.DeadlineExceeded, err.Error())
	default:
		return dnError(codes.Internal, datanodepb.Error_IO_ERROR, err.Error(), nil)
	}
}

// leaderGroup returns the pipeline's group if this datanode leads it.
func (s *service) leaderGroup(pipeline uint64) (*raft.Group, error) {
	g, err := s.d.host.Group(pipeline)
	if err != nil {
		return nil, dnError(codes.FailedPrecondition, datanodepb.Error_PIPELINE_NOT_FOUND,
			fmt.Sprintf("datanode %d is not in pipeline %d", s.d.ident.ID, pipeline), nil)
	}
	if !g.IsLeader() {
		return nil, s.toStatus(&raft.NotLeaderError{Group: pipeline, Leader: g.Leader()})
	}
	return g, nil
}

// checkWritable refuses writes to a container that is not open or has no
// room, before anything goes into the log.
func (s *service) checkWritable(cid storage.ContainerID, more int64) error {
	rep, err := s.d.store.Container(cid)
	if errors.Is(err, storage.ErrContainerNotFound) {
		return nil // created by the first write
	}
	if err != nil {
		return s.toStatus(err)
	}
	if rep.State != storage.StateOpen {
		return dnError(codes.FailedPrecondition, datanodepb.Error_CONTAINER_NOT_OPEN,
			fmt.Sprintf("container %d is %s", cid, rep.State), nil)
	}
	if rep.UsedBytes+more > rep.MaxSize {
		return dnError(codes.ResourceExhausted, datanodepb.Error_CONTAINER_FULL,
			fmt.Sprintf("container %d is full (%d of %d bytes used)", cid, rep.UsedBytes, rep.MaxSize), nil)
	}
	return nil
}

// checkSpace refuses new data before it enters the pipeline's log when
// this datanode's log disk or the container's volume is below its reserve:
// the reserve is what keeps Pebble (log store, volume metadata) from
// meeting ENOSPC, which it cannot survive. Cached figures, no statfs per
// request. Entries already in the log still apply.
func (s *service) checkSpace(g *raft.Group, cid storage.ContainerID, n int) error {
	if err := g.CheckLogSpace(n); err != nil {
		return s.toStatus(err)
	}
	if err := s.d.store.CheckSpace(cid, int64(n)); err != nil {
		return s.toStatus(err)
	}
	return nil
}

// badRequest is the answer to a request that failed validation.
func badRequest(op string, what any, err error) error {
	return dnError(codes.InvalidArgument, datanodepb.Error_BAD_REQUEST, fmt.Sprintf("%s %v: %v", op, what, err), nil)
}

func (s *service) WriteChunk(ctx context.Context, req *datanodepb.WriteChunkRequest) (*datanodepb.WriteChunkResponse, error) {
	b, c := req.GetBlock(), req.GetChunk()
	if err := checkChunk(s.d.store, b, c, len(req.GetData())); err != nil {
		return nil, badRequest("WriteChunk: block", b, err)
	}
	if err := s.checkWriteToken(ctx, b.GetContainerId(), b.GetLocalId(), req.GetPipelineId()); err != nil {
		return nil, err
	}
	g, err := s.leaderGroup(req.GetPipelineId())
	if err != nil {
		return nil, err
	}
	if err := s.checkOwner(b.GetContainerId(), req.GetPipelineId()); err != nil {
		return nil, err
	}
	cid := storage.ContainerID(b.GetContainerId())
	if err := s.checkWritable(cid, int64(len(req.GetData()))); err != nil {
		return nil, err
	}
	if err := s.checkSpace(g, cid, len(req.GetData())); err != nil {
		return nil, err
	}
	// Verify on the leader before replicating: data damaged on the way in
	// is refused here rather than stored three times.
	sum := toChecksum(c.GetChecksum())
	if sum.Type != storage.ChecksumNone {
		if bad := sum.Verify(req.GetData()); bad >= 0 {
			return nil, dnError(codes.DataLoss, datanodepb.Error_CHECKSUM_MISMATCH,
				fmt.Sprintf("container %d block %d: chunk at %d fails its checksum at +%d", cid, b.GetLocalId(), c.GetOffset(), bad), nil)
		}
	}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{
		WriteChunk: &datanodepb.WriteChunkCmd{Block: b, Chunk: c}}})
	res, err := g.Propose(ctx, meta, req.GetData())
	if err != nil {
		return nil, s.toStatus(err)
	}
	return &datanodepb.WriteChunkResponse{Index: res.Index}, nil
}

func (s *service) PutBlock(ctx context.Context, req *datanodepb.PutBlockRequest) (*datanodepb.PutBlockResponse, error) {
	bd := req.GetBlock()
	if err := checkBlock(s.d.store, bd); err != nil {
		return nil, badRequest("PutBlock: block", bd.GetId(), err)
	}
	if err := s.checkWriteToken(ctx, bd.GetId().GetContainerId(), bd.GetId().GetLocalId(), req.GetPipelineId()); err != nil {
		return nil, err
	}
	g, err := s.leaderGroup(req.GetPipelineId())
	if err != nil {
		return nil, err
	}
	if err := s.checkOwner(bd.GetId().GetContainerId(), req.GetPipelineId()); err != nil {
		return nil, err
	}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{
		PutBlock: &datanodepb.PutBlockCmd{Block: bd, CloseContainer: req.GetCloseContainer()}}})
	res, err := g.Propose(ctx, meta, nil)
	if err != nil {
		return nil, s.toStatus(err)
	}
	if req.GetWaitAll() {
		if err := s.waitAll(ctx, g, res.Index, storage.ContainerID(bd.GetId().GetContainerId()), req.GetWaitTimeoutMs()); err != nil {
			return nil, err
		}
	}
	return &datanodepb.PutBlockResponse{Index: res.Index}, nil
}

// waitAll waits until every replica of g applied index successfully
// (default timeout 30s). It fails with REPLICAS_LAG naming the replicas
// that had not applied it in time, or REPLICA_FAILED naming those that
// applied it but could not store it.
//
// Raft only tells the leader how far each replica applied, not whether
// the entry failed there (a replica that cannot store data must not stop
// its group, so it applies the entry as failed and moves on). So once
// raft says every replica applied index, the leader asks each one (and
// itself) whether the entry failed or the container went UNHEALTHY
// there: ApplyStatus. See docs/ARCHITECTURE.md for the raft hook that
// would carry the failure with the applied index instead.
func (s *service) waitAll(ctx context.Context, g *raft.Group, index uint64, cid storage.ContainerID, timeoutMs uint32) error {
	return s.waitAllTimed(ctx, g, index, cid, timeoutMs, nil)
}

// PutSmallFile writes and commits a whole one-chunk block with one
// proposal: WriteData stores the chunk on every replica before the entry
// is acknowledged there, and the entry's apply commits the block (see
// containerSM). It returns once every replica applied it.
func (s *service) PutSmallFile(ctx context.Context, req *datanodepb.PutSmallFileRequest) (*datanodepb.PutSmallFileResponse, error) {
	g, cid, meta, err := s.checkSmall(blocktoken.FromIncoming(ctx), req.GetPipelineId(), req.GetBlock(), req.GetData())
	if err != nil {
		return nil, err
	}
	res, err := g.Propose(ctx, meta, req.GetData())
	if err != nil {
		return nil, s.toStatus(err)
	}
	if err := s.waitAll(ctx, g, res.Index, cid, req.GetWaitTimeoutMs()); err != nil {
		return nil, err
	}
	return &datanodepb.PutSmallFileResponse{Index: res.Index}, nil
}

// checkSmall checks one small file (a PutSmallFile's, or one of a
// PutSmallFiles batch) before anything goes into the log: the request's
// shape, its block token, this datanode leading the pipeline, the
// container's owner, state and room, and the data's checksum. It returns
// the pipeline's group, the container and the entry's metadata, or the
// status the file fails with.
func (s *service) checkSmall(tok []byte, pipeline uint64, bd *datanodepb.BlockData, data []byte) (*raft.Group, storage.ContainerID, []byte, error) {
	if bd.GetId() == nil || len(data) == 0 || bd.GetLength() != uint64(len(data)) || len(bd.GetChunks()) != 1 ||
		bd.GetChunks()[0].GetOffset() != 0 || bd.GetChunks()[0].GetLength() != uint64(len(data)) {
		return nil, 0, nil, dnError(codes.InvalidArgument, datanodepb.Error_BAD_REQUEST,
			fmt.Sprintf("PutSmallFile: block %v with %d bytes of data: a block id, a length equal to the data's and exactly one chunk [0, length) are required", bd.GetId(), len(data)), nil)
	}
	if err := checkBlock(s.d.store, bd); err != nil {
		return nil, 0, nil, badRequest("PutSmallFile: block", bd.GetId(), err)
	}
	if err := checkChunk(s.d.store, bd.GetId(), bd.GetChunks()[0], len(data)); err != nil {
		return nil, 0, nil, badRequest("PutSmallFile: block", bd.GetId(), err)
	}
	if err := tokenStatus(s.d.verifyTokenVia(tok, bd.GetId().GetContainerId(), bd.GetId().GetLocalId(), blocktoken.Write, pipeline)); err != nil {
		return nil, 0, nil, err
	}
	g, err := s.leaderGroup(pipeline)
	if err != nil {
		return nil, 0, nil, err
	}
	if err := s.checkOwner(bd.GetId().GetContainerId(), pipeline); err != nil {
		return nil, 0, nil, err
	}
	cid := storage.ContainerID(bd.GetId().GetContainerId())
	if err := s.checkWritable(cid, int64(len(data))); err != nil {
		return nil, 0, nil, err
	}
	if err := s.checkSpace(g, cid, len(data)); err != nil {
		return nil, 0, nil, err
	}
	c := bd.GetChunks()[0]
	sum := toChecksum(c.GetChecksum())
	if sum.Type != storage.ChecksumNone {
		if bad := sum.Verify(data); bad >= 0 {
			return nil, 0, nil, dnError(codes.DataLoss, datanodepb.Error_CHECKSUM_MISMATCH,
				fmt.Sprintf("container %d block %d: small file fails its checksum at +%d", cid, bd.GetId().GetLocalId(), bad), nil)
		}
	}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutSmallFile{
		PutSmallFile: &datanodepb.PutSmallFileCmd{Block: bd}}})
	return g, cid, meta, nil
}

// readPiece is what one storage read fetches; sendPiece what one message
// carries (well under gRPC's default 4 MiB receive limit).
const (
	readPiece = 4 << 20
	sendPiece = 1 << 20
)

// readBufs holds the aligned read buffers of ReadBlock: a fresh 4 MiB
// buffer per call cost a 4 MiB clear (memclr was 13% of the datanode's
// read CPU). A buffer returns here when gRPC has sent it (bufRelease).
var readBufs = sync.Pool{New: func() any { b := storage.AlignedBuffer(readPiece); return &b }}

func (s *service) ReadBlock(req *datanodepb.ReadBlockRequest, stream datanodepb.Datanode_ReadBlockServer) error {
	cid := storage.ContainerID(req.GetBlock().GetContainerId())
	lid := storage.LocalID(req.GetBlock().GetLocalId())
	if err := s.checkToken(stream.Context(), uint64(cid), uint64(lid), blocktoken.Read); err != nil {
		return err
	}
	if bc := s.d.cache; bc != nil {
		// The cache tier first (cache.go): served from the mapping, the
		// data disk untouched.
		if e := bc.get(uint64(cid), uint64(lid)); e != nil {
			off, n := int64(req.GetOffset()), int64(req.GetLength())
			if n == 0 {
				n = e.bd.Length - off
			}
			if off >= 0 && n >= 0 && off+n <= e.bd.Length {
				done, err := bc.serve(e, cid, off, n, stream)
				e.mu.RUnlock()
				if done {
					return err
				}
				// The cached copy fails its checksums: drop it (SCM has it
				// cached again) and read the disk.
				bc.dropped.Add(1)
				go bc.uncache(e.key)
			} else {
				e.mu.RUnlock()
			}
		} else {
			bc.misses.Add(1)
		}
	}
	bd, err := s.d.store.GetBlock(cid, lid)
	if err != nil {
		return s.toStatus(err)
	}
	off, n := int64(req.GetOffset()), int64(req.GetLength())
	if n == 0 {
		n = bd.Length - off
	}
	if off < 0 || n < 0 || off+n > bd.Length {
		return dnError(codes.OutOfRange, datanodepb.Error_BAD_REQUEST,
			fmt.Sprintf("container %d block %d: range [%d,%d) outside block length %d", cid, lid, off, off+n, bd.Length), nil)
	}
	if err := stream.Send(&datanodepb.ReadBlockResponse{Block: fromBlockData(cid, bd)}); err != nil {
		return err
	}
	// A reader that verifies the windows itself (client_verifies) gets the
	// stored bytes unverified: each byte is checked once, by the client,
	// from the checksums in the BlockData just sent.
	read := s.d.store.ReadAt
	if req.GetClientVerifies() {
		read = s.d.store.ReadAtUnverified
	}
	for n > 0 {
		k := min(n, readPiece)
		// Frames go out of buf without a copy (dataFrame), so buf returns
		// to the pool only when gRPC has written all of them (rel).
		pb := readBufs.Get().(*[]byte)
		buf := *pb
		rel := &bufRelease{buf: pb}
		rel.refs.Store(1 + int32((k+sendPiece-1)/sendPiece))
		got, err := read(cid, lid, buf[:k], off)
		if err != nil {
			if errors.Is(err, storage.ErrCorruption) && s.d.scrub != nil {
				// Verify the whole block now: a confirmed fault marks the
				// container UNHEALTHY and is reported, as a scrub finding.
				s.d.scrub.suspect(cid, lid)
			}
			return s.toStatus(err)
		}
		for p := 0; p < got; p += sendPiece {
			e := min(p+sendPiece, got)
			if err := stream.SendMsg(&dataFrame{offset: uint64(off) + uint64(p), data: buf[p:e], rel: rel}); err != nil {
				return err
			}
		}
		rel.Put(nil)
		s.d.stats.bytesRead.Add(uint64(got))
		off += int64(got)
		n -= int64(got)
	}
	return nil
}

func (s *service) GetBlock(ctx context.Context, req *datanodepb.GetBlockRequest) (*datanodepb.BlockData, error) {
	cid := storage.ContainerID(req.GetBlock().GetContainerId())
	if err := s.checkToken(ctx, uint64(cid), req.GetBlock().GetLocalId(), blocktoken.Read); err != nil {
		return nil, err
	}
	bd, err := s.d.store.GetBlock(cid, storage.LocalID(req.GetBlock().GetLocalId()))
	if err != nil {
		return nil, s.toStatus(err)
	}
	return fromBlockData(cid, bd), nil
}

func (s *service) Info(ctx context.Context, req *datanodepb.InfoRequest) (*datanodepb.InfoResponse, error) {
	d := s.d
	resp := &datanodepb.InfoResponse{
		DatanodeId: d.ident.ID, Location: d.cfg.Location,
		ChunksWritten: d.stats.chunksWritten.Load(), BytesWritten: d.stats.bytesWritten.Load(),
		BlocksCommitted: d.stats.blocksCommitted.Load(), BytesRead: d.stats.bytesRead.Load(),
		SmallFiles: d.stats.smallFiles.Load(),
	}
	ss := d.StreamStats()
	resp.StreamsFirstHop, resp.StreamsDownstream, resp.StreamBytesReceived, resp.StreamsFailed = ss.FirstHop, ss.Downstream, ss.BytesReceived, ss.Failed
	for _, id := range d.host.Groups() {
		g, err := d.host.Group(id)
		if err != nil {
			continue
		}
		st := g.Status()
		resp.Pipelines = append(resp.Pipelines, &datanodepb.PipelineInfo{Id: id, Leader: st.Leader, Members: st.Voters, Applied: st.Applied})
	}
	return resp, nil
}

// ApplyStatus answers a pipeline leader's wait for all replicas (see
// waitAll).
func (s *service) ApplyStatus(ctx context.Context, req *datanodepb.ApplyStatusRequest) (*datanodepb.ApplyStatusResponse, error) {
	s.d.stats.applyStatus.Add(1)
	if h := s.d.applyStatusHook.Load(); h != nil {
		(*h)(ctx)
	}
	if len(req.GetMore()) > maxApplyStatusBatch {
		return nil, dnError(codes.InvalidArgument, datanodepb.Error_BAD_REQUEST,
			fmt.Sprintf("ApplyStatus: %d entries > %d", len(req.GetMore()), maxApplyStatusBatch), nil)
	}
	if w := req.GetWaitMs(); w > 0 {
		// Asked beside the leader's wait for the applied reports: wait
		// (bounded) for this replica's apply of the highest entry asked,
		// then answer as usual; a wait that ends early answers "not yet".
		high := req.GetIndex()
		for _, m := range req.GetMore() {
			high = max(high, m.GetIndex())
		}
		// An index far past this replica's log is not waited for (answered
		// at once, "not yet" for it): a follower a little behind the
		// leader's log waits, a bogus or far-ahead index holds nothing.
		if g, err := s.d.host.Group(req.GetPipelineId()); err == nil && high <= g.LastIndex()+maxApplyStatusAhead {
			wctx, cancel := context.WithTimeout(ctx, time.Duration(min(w, maxApplyStatusWaitMs))*time.Millisecond)
			g.WaitApplied(wctx, high)
			cancel()
		}
	}
	applied, why, err := s.d.applyStatus(req.GetPipelineId(), req.GetIndex(), storage.ContainerID(req.GetContainerId()))
	if err != nil {
		return nil, dnError(codes.FailedPrecondition, datanodepb.Error_PIPELINE_NOT_FOUND, err.Error(), nil)
	}
	resp := &datanodepb.ApplyStatusResponse{Applied: applied, Failed: why != "", Reason: why}
	if len(req.GetMore()) > 0 {
		resp.More = make([]*datanodepb.ApplyStatusResult, len(req.GetMore()))
		for i, m := range req.GetMore() {
			// Asked after the first, so the applied index can only be
			// higher: an entry past it is "not yet" (empty reason), and
			// the caller asks again, as for the first.
			_, why, err := s.d.applyStatus(req.GetPipelineId(), m.GetIndex(), storage.ContainerID(m.GetContainerId()))
			if err != nil {
				return nil, dnError(codes.FailedPrecondition, datanodepb.Error_PIPELINE_NOT_FOUND, err.Error(), nil)
			}
			resp.More[i] = &datanodepb.ApplyStatusResult{Failed: why != "", Reason: why}
		}
	}
	return resp, nil
}
