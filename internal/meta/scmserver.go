package meta

import (
	"context"
	"net"
	"regexp"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/topology"
	"github.com/basalt-store/basalt/internal/pki"
)

// scmServer is the Scm gRPC service: datanode and block protocols on the
// SCM leader, admin listings.
type scmServer struct {
	metapb.UnimplementedScmServer
	s *Server
}

func (x *scmServer) leader() error {
	if err := x.s.scmHaltedErr(); err != nil {
		return err
	}
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
	if err := x.s.scmGroup.ReadIndex(ctx); err != nil {
		return err
	}
	// Raft's read index passes a replica that halted meanwhile.
	return x.s.scmHaltedErr()
}

func (x *scmServer) ListDatanodes(ctx context.Context, _ *metapb.ListDatanodesRequest) (*metapb.ListDatanodesResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	r, err := x.s.scmMgr.ListDatanodes()
	if err != nil || x.showsPaths(ctx) {
		return r, err
	}
	return hideDatanodePaths(r), nil
}

// hiddenPath stands for a datanode-local directory path in the answers of
// ListDatanodes and ListPipelines to callers other than admins (and meta
// nodes): a data disk's or log disk's path is the datanode's layout, which
// members need not see. The reasons and records that carry more than
// paths (GetContainerReplicas, ListCorruptReplicas) are admins only
// (auth.go adminMethods).
const hiddenPath = "(hidden)"

// showsPaths: the caller of ctx sees datanode-local paths (admins, meta
// nodes, insecure benchmark clusters). Datanodes and other members see
// hiddenPath.
func (x *scmServer) showsPaths(ctx context.Context) bool {
	if x.s.cfg.TLS.IsInsecure() {
		return true
	}
	c, ok := namespace.CallerOf(ctx)
	return ok && c.Admin
}

// hideDatanodePaths returns r with every volume and slow disk path
// replaced by hiddenPath. r's messages are shared with the manager's
// state: changed ones are cloned first.
func hideDatanodePaths(r *metapb.ListDatanodesResponse) *metapb.ListDatanodesResponse {
	out := &metapb.ListDatanodesResponse{Datanodes: make([]*metapb.DatanodeStatus, len(r.Datanodes))}
	for i, d := range r.Datanodes {
		if len(d.Volumes) == 0 && len(d.SlowDisks) == 0 {
			out.Datanodes[i] = d
			continue
		}
		c := proto.CloneOf(d)
		for _, v := range c.Volumes {
			v.Path = hiddenPath
		}
		for _, sd := range c.SlowDisks {
			sd.Path = hiddenPath
		}
		out.Datanodes[i] = c
	}
	return out
}

// slowDiskReason matches the close reason of a pipeline closed for a slow
// disk (scm/slowdisk.go): "slow disk on datanode N: <path>", or for a
// member's failed report (scm/pipefail.go): "failed on datanode N:
// <reason naming its raft log directory>".
var slowDiskReason = regexp.MustCompile(`^((?:slow disk|failed) on datanode [0-9]+): .*$`)

// hidePipelinePaths returns ps with the disk paths in close reasons
// replaced by hiddenPath (ps is shared with the state: changed pipelines
// are cloned).
func hidePipelinePaths(ps []*metapb.Pipeline) []*metapb.Pipeline {
	out := make([]*metapb.Pipeline, len(ps))
	for i, p := range ps {
		out[i] = p
		if m := slowDiskReason.FindStringSubmatch(p.CloseReason); m != nil {
			c := proto.CloneOf(p)
			c.CloseReason = m[1] + ": " + hiddenPath
			out[i] = c
		}
	}
	return out
}

func (x *scmServer) ListPipelines(ctx context.Context, _ *metapb.ListPipelinesRequest) (*metapb.ListPipelinesResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	ps := x.s.scmState.Pipelines()
	if !x.showsPaths(ctx) {
		ps = hidePipelinePaths(ps)
	}
	return &metapb.ListPipelinesResponse{Pipelines: ps}, nil
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

// ReportCorruptReplica records, through Raft, a report that a replica
// failed its checksums and has the replica replaced (scm.ReportCorrupt:
// validated, rate-limited per reporter, bounded in size and number).
func (x *scmServer) ReportCorruptReplica(ctx context.Context, req *metapb.ReportCorruptReplicaRequest) (*metapb.ReportCorruptReplicaResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	reporter := "client"
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		host, _, err := net.SplitHostPort(p.Addr.String())
		if err != nil {
			host = p.Addr.String()
		}
		reporter = "client " + host
	}
	// Only the datanode holding the replica, authenticated by its
	// certificate, condemns it; anyone else's report is a record.
	byHolder := false
	if id, err := pki.FromContext(ctx); err == nil && id.Role == pki.RoleDatanode {
		reporter = "datanode " + clip(id.ID)
		if d := x.s.scmState.Datanode(req.GetDatanodeId()); d != nil && d.GetUuid() == id.ID {
			byHolder = true
		}
	}
	if err := x.s.scmMgr.ReportCorrupt(ctx, req, reporter, byHolder); err != nil {
		return nil, err
	}
	x.s.metrics.corrupt.Inc()
	x.s.log.Warn("corrupt replica reported", "container", req.GetBlock().GetContainerId(), "block", req.GetBlock().GetLocalId(),
		"datanode", req.GetDatanodeId(), "reporter", reporter, "reason", req.GetReason())
	return &metapb.ReportCorruptReplicaResponse{}, nil
}

// ListCorruptReplicas lists the stored reports of corrupt blocks
// (replicated: they survive a failover and a restart). The records of why
// SCM recorded a replica unhealthy (block 0) are shown by
// GetContainerReplicas.
func (x *scmServer) ListCorruptReplicas(ctx context.Context, req *metapb.ListCorruptReplicasRequest) (*metapb.ListCorruptReplicasResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	out := &metapb.ListCorruptReplicasResponse{}
	for _, r := range x.s.scmState.ReplicaReports(0) {
		if r.GetBlock().GetLocalId() != 0 {
			out.Replicas = append(out.Replicas, r)
		}
	}
	return out, nil
}

// SetDatanodeOpState decommissions, puts into maintenance or
// recommissions a datanode.
func (x *scmServer) SetDatanodeOpState(ctx context.Context, req *metapb.SetDatanodeOpStateRequest) (*metapb.SetDatanodeOpStateResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	d, err := x.s.scmMgr.SetOpState(ctx, req)
	if err != nil {
		return nil, err
	}
	return &metapb.SetDatanodeOpStateResponse{Datanode: d}, nil
}

// RecoverContainer starts or reports the recovery of a container made
// MISSING by a deterministic apply bug (admins only: auth.go; scm/recover.go).
func (x *scmServer) RecoverContainer(ctx context.Context, req *metapb.RecoverContainerRequest) (*metapb.RecoverContainerResponse, error) {
	if err := x.leader(); err != nil {
		return nil, err
	}
	// The SCM group has no layout gate: a meta node on a binary without
	// ReplicaRecoveredOp halts its SCM replica at the first one. Refuse to
	// start while an upgrade is not finalized (a meta node may still run
	// an older binary); the operator runs recover only once every meta
	// node runs this one.
	if f, sw := x.s.nsState.FinalizedLayout(), namespace.SoftwareLayoutVersion(); !req.GetStatusOnly() && f < sw {
		return nil, status.Errorf(codes.FailedPrecondition,
			"recover container %d: the cluster's upgrade is not finalized (layout %d, this binary %d): upgrade every meta node to this binary and run basalt admin upgrade finalize first (SCM replicas on an older binary would halt at the recovery's Raft op)",
			req.GetContainerId(), f, sw)
	}
	return x.s.scmMgr.RecoverContainer(ctx, req)
}

// GetContainerReplicas lists replicas with their health and reports.
func (x *scmServer) GetContainerReplicas(ctx context.Context, req *metapb.GetContainerReplicasRequest) (*metapb.GetContainerReplicasResponse, error) {
	if err := x.barrier(ctx); err != nil {
		return nil, err
	}
	return x.s.scmMgr.Replicas(req.ContainerId, int(req.Limit))
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
