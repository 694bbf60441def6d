package meta

import (
	"context"
	"slices"

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
