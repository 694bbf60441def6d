package faulttest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// Cluster is 3 meta processes and 5 datanode processes on loopback.
type Cluster struct {
	Bin  string
	Dir  string // data/ and logs/ below it
	Logs string

	Metas    []*Proc
	MetaGRPC []string
	// MetaHTTP and DNHTTP serve each process's /metrics and /debug/pprof.
	MetaHTTP []string
	DNHTTP   []string
	DNs      []*Proc
	DNData   []string // client gRPC address per datanode (--listen)
	// Creds are a client certificate of the cluster's CA (every process
	// gets its own under Dir/tls).
	Creds *pki.Credentials

	metaConns []*grpc.ClientConn

	mu      sync.Mutex
	crashes []Crash
}

// Crash is a server process that exited without the harness killing it.
type Crash struct {
	At   time.Time
	Name string
	Err  string
	Tail string
}

// ClusterConfig says where the processes keep their data.
type ClusterConfig struct {
	Bin string
	Dir string
	// DNVolumes, if set for datanode i, is its data volume (e.g. a small
	// loop-mounted file system); otherwise DATA_DIR/data.
	DNVolumes map[int]string
	// MetaLogLevel is the meta nodes' --log-level (default info).
	MetaLogLevel string
}

func (c ClusterConfig) metaLogLevel() string {
	if c.MetaLogLevel == "" {
		return "info"
	}
	return c.MetaLogLevel
}

const (
	numMeta = 3
	numDN   = 5
)

// NewCluster lays out the processes (ports, directories); Start starts them.
func NewCluster(cfg ClusterConfig) (*Cluster, error) {
	c := &Cluster{Bin: cfg.Bin, Dir: cfg.Dir, Logs: filepath.Join(cfg.Dir, "logs")}
	if err := os.MkdirAll(c.Logs, 0o755); err != nil {
		return nil, err
	}
	ports, err := freePorts(3*numMeta + 4*numDN)
	if err != nil {
		return nil, err
	}
	addr := func(i int) string { return fmt.Sprintf("127.0.0.1:%d", ports[i]) }
	prov, err := pki.NewProvisioner(filepath.Join(cfg.Dir, "tls"))
	if err != nil {
		return nil, err
	}
	tlsDir := func(role pki.Role, id string) (string, error) {
		ident := pki.Identity{Role: role, ID: id}
		_, err := prov.Credentials(ident)
		return prov.DirOf(ident), err
	}
	if c.Creds, err = prov.Credentials(pki.Identity{Role: pki.RoleClient, ID: "faulttest"}); err != nil {
		return nil, err
	}
	var peers []string
	for i := range numMeta {
		peers = append(peers, fmt.Sprintf("%d=%s/%s", i+1, addr(2*i), addr(2*i+1)))
		c.MetaGRPC = append(c.MetaGRPC, addr(2*i+1))
	}
	for i := range numMeta {
		name := fmt.Sprintf("meta%d", i+1)
		c.MetaHTTP = append(c.MetaHTTP, addr(3*numMeta+4*numDN-1-i))
		td, err := tlsDir(pki.RoleMeta, fmt.Sprint(i+1))
		if err != nil {
			return nil, err
		}
		c.Metas = append(c.Metas, &Proc{Name: name, Bin: cfg.Bin, LogPath: filepath.Join(c.Logs, name+".log"),
			Args: []string{"meta", "--id", fmt.Sprint(i + 1), "--data-dir", filepath.Join(cfg.Dir, "data", name), "--tls-dir", td,
				"--raft", addr(2 * i), "--grpc", addr(2*i + 1), "--peers", strings.Join(peers, ","), "--log-level", cfg.metaLogLevel(),
				"--metrics", c.MetaHTTP[i], "--admins", "faulttest"}})
	}
	base := 2 * numMeta
	for i := range numDN {
		name := fmt.Sprintf("dn%d", i+1)
		rack := "/rack1"
		if i >= 3 {
			rack = "/rack2"
		}
		dir := filepath.Join(cfg.Dir, "data", name)
		td, err := tlsDir(pki.RoleDatanode, name)
		if err != nil {
			return nil, err
		}
		args := []string{"datanode", "--data-dir", dir, "--tls-dir", td, "--meta", strings.Join(c.MetaGRPC, ","),
			"--listen", addr(base + 3*i), "--raft", addr(base + 3*i + 1), "--stream", addr(base + 3*i + 2),
			"--location", rack, "--hostname", name, "--log-level", "info", "--metrics", addr(2*numMeta + 3*numDN + i)}
		c.DNHTTP = append(c.DNHTTP, addr(2*numMeta+3*numDN+i))
		if v := cfg.DNVolumes[i]; v != "" {
			args = append(args, "--volumes", v)
		}
		c.DNData = append(c.DNData, addr(base+3*i))
		c.DNs = append(c.DNs, &Proc{Name: name, Bin: cfg.Bin, LogPath: filepath.Join(c.Logs, name+".log"), Args: args})
	}
	for _, p := range c.all() {
		p.onCrash = c.recordCrash
	}
	for _, a := range c.MetaGRPC {
		conn, err := grpc.NewClient(a, c.Creds.GRPCDialOption(pki.RoleMeta))
		if err != nil {
			return nil, err
		}
		c.metaConns = append(c.metaConns, conn)
	}
	return c, nil
}

func (c *Cluster) all() []*Proc { return append(append([]*Proc{}, c.Metas...), c.DNs...) }

func (c *Cluster) recordCrash(p *Proc, err error, tail string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	msg := "exit 0"
	if err != nil {
		msg = err.Error()
	}
	c.crashes = append(c.crashes, Crash{At: time.Now(), Name: p.Name, Err: msg, Tail: tail})
}

// Crashes returns the unexpected exits so far.
func (c *Cluster) Crashes() []Crash {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Crash(nil), c.crashes...)
}

// Start starts the meta nodes, waits for a namespace leader, then starts
// the datanodes and waits until all five are registered and the THREE
// pipelines exist.
func (c *Cluster) Start(ctx context.Context) error {
	for _, p := range c.Metas {
		if err := p.Start(); err != nil {
			return err
		}
	}
	if _, err := c.WaitLeader(ctx); err != nil {
		return err
	}
	for i, p := range c.DNs {
		if err := p.Start(); err != nil {
			return err
		}
		if err := waitPort(ctx, c.DNData[i]); err != nil {
			return fmt.Errorf("%s: %w", p.Name, err)
		}
	}
	return c.WaitDatanodes(ctx, true)
}

// Close kills every process (by its PID) and closes connections.
func (c *Cluster) Close() {
	for _, p := range c.all() {
		p.Kill()
	}
	for _, conn := range c.metaConns {
		conn.Close()
	}
}

// Leader returns the index of the meta node that leads the namespace
// group now (-1 if none answers as leader). It asks each node directly: a
// follower answers UNAVAILABLE with a NotLeader detail.
func (c *Cluster) Leader(ctx context.Context) int {
	for i, conn := range c.metaConns {
		if !c.Metas[i].Running() {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := metapb.NewNamespaceClient(conn).ListVolumes(cctx, &metapb.ListVolumesRequest{PageSize: 1})
		cancel()
		if err == nil {
			return i
		}
	}
	return -1
}

// WaitLeader waits until a meta node answers as namespace leader.
func (c *Cluster) WaitLeader(ctx context.Context) (int, error) {
	for {
		if i := c.Leader(ctx); i >= 0 {
			return i, nil
		}
		select {
		case <-ctx.Done():
			return -1, fmt.Errorf("no namespace leader among %v: %w", c.MetaGRPC, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// scm returns an SCM client for the current leader.
func (c *Cluster) scm(ctx context.Context) (metapb.ScmClient, error) {
	for i, conn := range c.metaConns {
		if !c.Metas[i].Running() {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := metapb.NewScmClient(conn).GetSafeMode(cctx, &metapb.GetSafeModeRequest{})
		cancel()
		if err == nil {
			return metapb.NewScmClient(conn), nil
		}
	}
	return nil, errors.New("no SCM leader answers")
}

// Datanodes lists the datanodes as the SCM leader sees them.
func (c *Cluster) Datanodes(ctx context.Context) ([]*metapb.DatanodeStatus, error) {
	s, err := c.scm(ctx)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r, err := s.ListDatanodes(cctx, &metapb.ListDatanodesRequest{})
	if err != nil {
		return nil, err
	}
	return r.Datanodes, nil
}

// Containers lists every container SCM knows.
func (c *Cluster) Containers(ctx context.Context) (map[uint64]*metapb.Container, error) {
	s, err := c.scm(ctx)
	if err != nil {
		return nil, err
	}
	out := map[uint64]*metapb.Container{}
	var after uint64
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		r, err := s.ListContainers(cctx, &metapb.ListContainersRequest{StartAfter: after, PageSize: 5000})
		cancel()
		if err != nil {
			return nil, err
		}
		for _, ct := range r.Containers {
			out[ct.Id] = ct
			after = ct.Id
		}
		if !r.Truncated || len(r.Containers) == 0 {
			return out, nil
		}
	}
}

// CorruptReplicas lists the replicas clients reported corrupt.
func (c *Cluster) CorruptReplicas(ctx context.Context) ([]*metapb.CorruptReplica, error) {
	s, err := c.scm(ctx)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r, err := s.ListCorruptReplicas(cctx, &metapb.ListCorruptReplicasRequest{})
	if err != nil {
		return nil, err
	}
	return r.Replicas, nil
}

// Roles returns how many THREE pipelines datanode i leads and follows in,
// from its own Info.
func (c *Cluster) Roles(ctx context.Context, i int) (lead, follow int, err error) {
	conn, err := grpc.NewClient(c.DNData[i], c.Creds.GRPCDialOption(pki.RoleDatanode))
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close()
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	r, err := datanodepb.NewDatanodeClient(conn).Info(cctx, &datanodepb.InfoRequest{})
	if err != nil {
		return 0, 0, err
	}
	for _, p := range r.Pipelines {
		if len(p.Members) < 3 {
			continue
		}
		if p.Leader == r.DatanodeId {
			lead++
		} else {
			follow++
		}
	}
	return lead, follow, nil
}

// WaitDatanodes waits until the SCM leader lists all five datanodes
// HEALTHY with a heartbeat heard, and (if pipelines) every datanode is in
// an open THREE pipeline.
func (c *Cluster) WaitDatanodes(ctx context.Context, pipelines bool) error {
	var last string
	for {
		ok, why := c.datanodesReady(ctx, pipelines)
		if ok {
			return nil
		}
		last = why
		select {
		case <-ctx.Done():
			return fmt.Errorf("datanodes not ready: %s: %w", last, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func (c *Cluster) datanodesReady(ctx context.Context, pipelines bool) (bool, string) {
	dns, err := c.Datanodes(ctx)
	if err != nil {
		return false, err.Error()
	}
	healthy := 0
	for _, d := range dns {
		if d.State == metapb.NodeState_HEALTHY && d.LastHeartbeatUnixMs > 0 {
			healthy++
		}
	}
	if healthy < numDN {
		return false, fmt.Sprintf("%d of %d datanodes healthy (%d registered)", healthy, numDN, len(dns))
	}
	if !pipelines {
		return true, ""
	}
	s, err := c.scm(ctx)
	if err != nil {
		return false, err.Error()
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r, err := s.ListPipelines(cctx, &metapb.ListPipelinesRequest{})
	if err != nil {
		return false, err.Error()
	}
	in := map[uint64]bool{}
	for _, p := range r.Pipelines {
		if p.State == metapb.PipelineState_PIPELINE_OPEN && p.Replication == metapb.Replication_THREE {
			for _, d := range p.Datanodes {
				in[d] = true
			}
		}
	}
	if len(in) < numDN {
		return false, fmt.Sprintf("%d of %d datanodes in an open THREE pipeline", len(in), numDN)
	}
	return true, ""
}
