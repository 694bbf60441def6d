package meta

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/topology"
)

// scmServer is the Scm gRPC service: datanode and block protocols on the
// SCM leader, admin listings.
type scmServer struct {
	metapb.UnimplementedScmServer
	s *Server
}

func (x *scmServer) leader() error {
	if !x.s.scmGroup.IsLeader() {
		return scm.ErrNotLeader
	}
	return nil
}

func (x *scmServer) RegisterDatanode(ctx context.Context, req *metapb.RegisterDatanodeRequest) (*metapb.RegisterDatanodeResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.Register(ctx, req)
}

func (x *scmServer) Heartbeat(ctx context.Context, req *metapb.HeartbeatRequest) (*metapb.HeartbeatResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.Heartbeat(ctx, req)
}

func (x *scmServer) AllocateBlocks(ctx context.Context, req *metapb.AllocateBlocksRequest) (*metapb.AllocateBlocksResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.AllocateBlocks(ctx, req)
}

func (x *scmServer) DeleteBlocks(ctx context.Context, req *metapb.DeleteBlocksRequest) (*metapb.DeleteBlocksResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	if len(req.Groups) > scm.MaxDeleteGroups {
		return nil, status.Errorf(codes.InvalidArgument, "delete blocks: %d groups, at most %d per call", len(req.Groups), scm.MaxDeleteGroups)
	}
	return &metapb.DeleteBlocksResponse{}, x.s.scmMgr.DeleteBlocks(ctx, req)
}

// maxContainersPerGet bounds GetContainers.
const maxContainersPerGet = 1000

func (x *scmServer) GetContainers(ctx context.Context, req *metapb.GetContainersRequest) (*metapb.GetContainersResponse, error) {
	if len(req.ContainerIds) > maxContainersPerGet {
		return nil, status.Errorf(codes.InvalidArgument, "get containers: %d ids, at most %d", len(req.ContainerIds), maxContainersPerGet)
	}
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	resp := &metapb.GetContainersResponse{}
	for _, id := range req.ContainerIds {
		c, dns := x.s.scmState.ContainerReplicas(id)
		if c == nil {
			return nil, status.Errorf(codes.NotFound, "container %d not found", id)
		}
		dns = slices.Clone(dns)
		topology.SortByDistance(dns, 0, req.ClientLocation, func(d *metapb.DatanodeDetails) uint64 { return d.Id }, func(d *metapb.DatanodeDetails) string { return d.Location })
		resp.Containers = append(resp.Containers, &metapb.ContainerWithLocation{Container: c, Datanodes: dns})
	}
	return resp, nil
}

func (x *scmServer) barrier(ctx context.Context) error {
	if err := x.leader(); err != nil {
		return err
	}
	ctx, cancel := x.s.withTimeout(ctx)
	defer cancel()
	return x.s.scmGroup.ReadIndex(ctx)
}

func (x *scmServer) ListDatanodes(ctx context.Context, _ *metapb.ListDatanodesRequest) (*metapb.ListDatanodesResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ListDatanodes()
}

func (x *scmServer) ListPipelines(ctx context.Context, _ *metapb.ListPipelinesRequest) (*metapb.ListPipelinesResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	return &metapb.ListPipelinesResponse{Pipelines: x.s.scmState.Pipelines()}, nil
}

func (x *scmServer) ListContainers(ctx context.Context, req *metapb.ListContainersRequest) (*metapb.ListContainersResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	limit := int(req.PageSize)
	if limit == 0 || limit > 10000 {
		limit = min(max(limit, 1000), 10000)
	}
	resp := &metapb.ListContainersResponse{}
	for _, c := range x.s.scmState.Containers() {
		if c.Id <= req.StartAfter {
			continue
		}
		if len(resp.Containers) == limit {
			resp.Truncated = true
			break
		}
		resp.Containers = append(resp.Containers, c)
	}
	return resp, nil
}

func (x *scmServer) GetSafeMode(ctx context.Context, _ *metapb.GetSafeModeRequest) (*metapb.GetSafeModeResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.SafeMode()
}

// GetContainerHealth returns the replication manager's last round.
func (x *scmServer) GetContainerHealth(ctx context.Context, req *metapb.GetContainerHealthRequest) (*metapb.GetContainerHealthResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	return x.s.scmMgr.ContainerHealth(int(req.Worst))
}

// maxCorruptReports bounds the corrupt-replica reports the SCM leader keeps.
const maxCorruptReports = 10000

// corruptReplicas are reports from clients that a replica failed its
// checksums. They are kept on the SCM leader (lost on failover, like
// liveness) and exported as a metric; the replication manager acts on
// them (scm.Manager.ReplicaCorrupt).
type corruptReplicas struct {
	mu   sync.Mutex
	byID map[[3]uint64]*metapb.CorruptReplica
}

func (x *scmServer) ReportCorruptReplica(ctx context.Context, req *metapb.ReportCorruptReplicaRequest) (*metapb.ReportCorruptReplicaResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	if req.GetBlock() == nil || req.GetDatanodeId() == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "report corrupt replica: block and datanode_id are required (got block %v, datanode %d)", req.GetBlock(), req.GetDatanodeId())
	}
	c := &x.s.corrupt
	key := [3]uint64{req.GetBlock().GetContainerId(), req.GetBlock().GetLocalId(), req.GetDatanodeId()}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byID == nil {
		c.byID = map[[3]uint64]*metapb.CorruptReplica{}
	}
	r, ok := c.byID[key]
	if !ok {
		if len(c.byID) >= maxCorruptReports {
			return nil, status.Errorf(codes.ResourceExhausted, "report corrupt replica: %d reports pending", len(c.byID))
		}
		r = &metapb.CorruptReplica{Block: req.GetBlock(), DatanodeId: req.GetDatanodeId()}
		c.byID[key] = r
	}
	r.Reason = req.GetReason()
	r.ReportedUnixMs = time.Now().UnixMilli()
	r.Reports++
	x.s.metrics.corrupt.Inc()
	x.s.log.Warn("corrupt replica reported", "container", key[0], "block", key[1], "datanode", key[2], "reason", req.GetReason())
	// The replica is replaced (replication manager): recorded unhealthy
	// through Raft, so that survives a failover even though this list
	// does not.
	x.s.scmMgr.ReplicaCorrupt(key[0], key[2], fmt.Sprintf("block %d: %s", key[1], req.GetReason()))
	return &metapb.ReportCorruptReplicaResponse{}, nil
}

func (x *scmServer) ListCorruptReplicas(ctx context.Context, req *metapb.ListCorruptReplicasRequest) (*metapb.ListCorruptReplicasResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	c := &x.s.corrupt
	c.mu.Lock()
	defer c.mu.Unlock()
	out := &metapb.ListCorruptReplicasResponse{}
	for _, r := range c.byID {
		out.Replicas = append(out.Replicas, r)
	}
	slices.SortFunc(out.Replicas, func(a, b *metapb.CorruptReplica) int {
		if a.GetBlock().GetContainerId() != b.GetBlock().GetContainerId() {
			return cmpU(a.GetBlock().GetContainerId(), b.GetBlock().GetContainerId())
		}
		if a.GetBlock().GetLocalId() != b.GetBlock().GetLocalId() {
			return cmpU(a.GetBlock().GetLocalId(), b.GetBlock().GetLocalId())
		}
		return cmpU(a.GetDatanodeId(), b.GetDatanodeId())
	})
	return out, nil
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
