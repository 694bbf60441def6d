// Package cluster starts a whole Basalt cluster in one process: one
// metadata node and N datanodes, each with its own directories, ports and
// network location. `basalt dev` runs it, and the integration tests use it
// with real components over loopback.
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
)

// Config describes the cluster. Zero values take the defaults noted.
type Config struct {
	Dir string
	// Admins are administrators besides Admins (the ready client
	// certificate's user).
	Admins    []string
	Datanodes int // default 3
	// Location of datanode i (0-based); default: the first half of them on
	// /dc1/rack1, the rest on /dc1/rack2 (two racks, as placement needs).
	Location func(i int) string
	// Fixed ports (so that a restart keeps its addresses): when BasePort is
	// nonzero, meta gRPC is BasePort, meta Raft BasePort+1, datanode i
	// serves on BasePort+10+2i, its Raft on BasePort+11+2i and its V2
	// streams on BasePort+40+i. Otherwise
	// every port is picked by the kernel.
	BasePort int
	// Timing: datanode heartbeats and the Raft tick.
	HeartbeatInterval time.Duration // default 1s
	TickInterval      time.Duration // default 100ms
	// SCM marks a datanode STALE, then DEAD, after this long without a
	// heartbeat (defaults 10 and 30 heartbeat intervals).
	StaleInterval, DeadInterval time.Duration
	// Sizes (defaults: 256 MiB blocks, 5 GiB containers).
	BlockSize     uint64
	ContainerSize uint64
	// PipelineLimit: pipelines per datanode (default 2).
	PipelineLimit int
	Storage       storage.Options
	// Insecure turns authentication off: every port plaintext and open
	// to anyone. Only for measuring what TLS costs. Otherwise the cluster
	// provisions its own CA and a certificate for every component under
	// Dir/tls (see TLSDir), kept across restarts.
	Insecure bool
	// SecretKeys: block token key rotation (default: SCM's).
	SecretKeys scm.SecretKeyConfig
	// CacheBytes > 0 gives every datanode a cache tier of that many bytes
	// in Dir/dnN/cache (docs/CACHE.md); CacheRescanInterval is how often
	// SCM resolves the cache directives (default SCM's).
	// CacheDRAM: the cache tier in memory instead (no directory);
	// CacheRoot: the cache directories under CacheRoot/dnN instead (a
	// tmpfs or DAX mount).
	CacheBytes          int64
	CacheDRAM           bool
	CacheRoot           string
	CacheRescanInterval time.Duration
	// NoShortCircuit: no datanode opens its short-circuit socket.
	NoShortCircuit bool
	// SlowDisk: SCM closing pipelines on slow disks (default SCM's).
	SlowDisk   scm.SlowDiskConfig
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// DatanodeConfig, if set, adjusts datanode i's configuration before
	// it starts (benchmarks: log directories and volumes on modelled
	// disks, vfs.LatencyFS).
	DatanodeConfig func(i int, c *datanode.Config)
	// Namespace is the meta node's namespace configuration (tests: short
	// expiries and service intervals).
	Namespace namespace.Config
}

// Cluster is a running in-process cluster.
type Cluster struct {
	cfg       Config
	pki       *pki.Provisioner // nil when Insecure
	Meta      *meta.Server
	mu        sync.Mutex
	Datanodes []*datanode.Datanode
}

func (c *Config) addr(off int) string {
	if c.BasePort == 0 {
		return "127.0.0.1:0"
	}
	return fmt.Sprintf("127.0.0.1:%d", c.BasePort+off)
}

// Start starts the metadata node and the datanodes and waits until the
// cluster can take writes (pipelines have leaders), or ctx ends.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Dir == "" {
		return nil, errors.New("cluster: Dir is required")
	}
	if cfg.Datanodes == 0 {
		cfg.Datanodes = 3
	}
	if cfg.Location == nil {
		n := cfg.Datanodes
		cfg.Location = func(i int) string {
			if i < (n+1)/2 {
				return "/dc1/rack1"
			}
			return "/dc1/rack2"
		}
	}
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = time.Second
	}
	if cfg.TickInterval == 0 {
		cfg.TickInterval = 100 * time.Millisecond
	}
	if cfg.StaleInterval == 0 {
		cfg.StaleInterval = 10 * cfg.HeartbeatInterval
	}
	if cfg.DeadInterval == 0 {
		cfg.DeadInterval = max(30*cfg.HeartbeatInterval, cfg.StaleInterval)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	c := &Cluster{cfg: cfg}
	if !cfg.Insecure {
		var err error
		if c.pki, err = pki.NewProvisioner(TLSDir(cfg.Dir)); err != nil {
			return nil, err
		}
	}
	metaCreds, err := c.Credentials(pki.Identity{Role: pki.RoleMeta, ID: "1"})
	if err != nil {
		return nil, err
	}
	replication := cfg.Datanodes
	minDN := 3
	if replication < 3 {
		minDN = 1
	}
	ms, err := meta.New(meta.Config{
		NodeID: 1, DataDir: filepath.Join(cfg.Dir, "meta"), RaftAddr: cfg.addr(1), GRPCAddr: cfg.addr(0),
		TickInterval: cfg.TickInterval, TLS: metaCreds, CA: c.CA(), Admins: append(slices.Clone(Admins), cfg.Admins...),
		SCM: scm.Config{
			HeartbeatInterval: cfg.HeartbeatInterval, StaleInterval: cfg.StaleInterval, DeadInterval: cfg.DeadInterval,
			PipelineLimit: cfg.PipelineLimit, BlockSize: cfg.BlockSize, ContainerSize: cfg.ContainerSize,
			SafeModeMinDatanodes: minDN, LoopInterval: min(time.Second, cfg.HeartbeatInterval),
			SecretKeys:          cfg.SecretKeys,
			CacheRescanInterval: cfg.CacheRescanInterval,
			SlowDisk:            cfg.SlowDisk,
		},
		Namespace: cfg.Namespace,
		// datanode="" gives the meta service's metrics the label names the
		// datanodes' have: a name both export (basalt_raft_*: the meta raft
		// host and each datanode's) must have one label set in a registry, or
		// the second registration fails and its series are never exported.
		Registerer: prometheus.WrapRegistererWith(prometheus.Labels{"role": "meta", "datanode": ""}, cfg.Registerer),
		Logger:     cfg.Logger.With("role", "meta"),
	})
	if err != nil {
		return nil, err
	}
	if err := ms.Start(); err != nil {
		ms.Close()
		return nil, err
	}
	c.Meta = ms
	for i := 0; i < cfg.Datanodes; i++ {
		dn, err := c.newDatanode(i)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.Datanodes = append(c.Datanodes, dn)
	}
	for i, dn := range c.Datanodes {
		if err := dn.Start(ctx); err != nil {
			c.Close()
			return nil, fmt.Errorf("cluster: datanode %d: %w", i, err)
		}
	}
	if err := c.WaitWritable(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) newDatanode(i int) (*datanode.Datanode, error) {
	so := c.cfg.Storage
	if c.cfg.ContainerSize != 0 {
		so.ContainerSize = int64(c.cfg.ContainerSize)
	}
	if c.cfg.BlockSize != 0 && int64(c.cfg.BlockSize) > so.MaxBlockSize {
		so.MaxBlockSize = int64(c.cfg.BlockSize)
	}
	dir := filepath.Join(c.cfg.Dir, fmt.Sprintf("dn%d", i+1))
	creds, err := c.datanodeCredentials(dir)
	if err != nil {
		return nil, err
	}
	var cacheDirs []string
	switch {
	case c.cfg.CacheBytes <= 0 || c.cfg.CacheDRAM:
	case c.cfg.CacheRoot != "":
		cacheDirs = []string{filepath.Join(c.cfg.CacheRoot, fmt.Sprintf("dn%d", i+1))}
	default:
		cacheDirs = []string{filepath.Join(dir, "cache")}
	}
	sock := ""
	if c.cfg.NoShortCircuit {
		sock = "-"
	}
	dc := datanode.Config{
		DataDir: dir, Location: c.cfg.Location(i), TLS: creds,
		Hostname: fmt.Sprintf("dn%d", i+1), MetaAddrs: []string{c.MetaAddr()},
		ListenAddr: c.cfg.addr(10 + 2*i), RaftAddr: c.cfg.addr(11 + 2*i), StreamAddr: c.cfg.addr(40 + i), TickInterval: c.cfg.TickInterval,
		Storage:   so,
		CacheDirs: cacheDirs, CacheBytes: c.cfg.CacheBytes,
		Registerer:         prometheus.WrapRegistererWith(prometheus.Labels{"role": "datanode", "datanode": fmt.Sprint(i + 1)}, c.cfg.Registerer),
		Logger:             c.cfg.Logger.With("role", "datanode", "dn", i+1),
		ShortCircuitSocket: sock,
	}
	if c.cfg.DatanodeConfig != nil {
		c.cfg.DatanodeConfig(i, &dc)
	}
	return datanode.New(dc)
}

// ServiceToken is the metadata service's cluster service token (S3
// gateways and admin tools need it; see meta.Config.ServiceToken).
func (c *Cluster) ServiceToken() string { return c.Meta.ServiceToken() }

// MetaAddr is the metadata service's gRPC address.
func (c *Cluster) MetaAddr() string { return c.Meta.GRPCAddr() }

// WaitWritable waits until SCM is out of safe mode and has an open
// pipeline whose group has a leader on the datanodes.
func (c *Cluster) WaitWritable(ctx context.Context) error {
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		return err
	}
	defer mc.Close()
	for {
		if c.writable(ctx, mc) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: not writable: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (c *Cluster) writable(ctx context.Context, mc *metaclient.Client) bool {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	sm, err := mc.Scm.GetSafeMode(rctx, &metapb.GetSafeModeRequest{})
	if err != nil || sm.GetInSafeMode() {
		return false
	}
	pl, err := mc.Scm.ListPipelines(rctx, &metapb.ListPipelinesRequest{})
	if err != nil {
		return false
	}
	c.mu.Lock()
	dns := append([]*datanode.Datanode(nil), c.Datanodes...)
	c.mu.Unlock()
	for _, p := range pl.GetPipelines() {
		if p.GetState() != metapb.PipelineState_PIPELINE_OPEN {
			continue
		}
		for _, dn := range dns {
			if dn != nil && dn.IsPipelineLeader(p.GetId()) {
				return true
			}
		}
	}
	return false
}

// StopDatanode stops datanode i abruptly (as far as peers can tell).
func (c *Cluster) StopDatanode(i int) error {
	c.mu.Lock()
	dn := c.Datanodes[i]
	c.Datanodes[i] = nil
	c.mu.Unlock()
	if dn == nil {
		return nil
	}
	return dn.Close()
}

// RestartDatanode starts datanode i again on its directories.
func (c *Cluster) RestartDatanode(ctx context.Context, i int) error {
	c.StopDatanode(i)
	dn, err := c.newDatanode(i)
	if err != nil {
		return err
	}
	if err := dn.Start(ctx); err != nil {
		dn.Close()
		return err
	}
	c.mu.Lock()
	c.Datanodes[i] = dn
	c.mu.Unlock()
	return nil
}

// Datanode returns datanode i (nil while stopped).
func (c *Cluster) Datanode(i int) *datanode.Datanode {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.Datanodes[i]
}

// Close stops everything.
func (c *Cluster) Close() error {
	var errs []error
	c.mu.Lock()
	dns := c.Datanodes
	c.Datanodes = nil
	c.mu.Unlock()
	for _, dn := range dns {
		if dn != nil {
			errs = append(errs, dn.Close())
		}
	}
	if c.Meta != nil {
		errs = append(errs, c.Meta.Close())
	}
	return errors.Join(errs...)
}

// TLSDir is where a cluster in dir keeps its CA (ca/) and every
// component's TLS directory (<role>-<id>/: ca.pem, cert.pem, key.pem).
func TLSDir(dir string) string { return filepath.Join(dir, "tls") }

// ClientID is the identity of the cluster's ready client certificate
// (ClientCredentials; `basalt dev` points the CLI at it).
var ClientID = pki.Identity{Role: pki.RoleClient, ID: "cli"}

// Admins are the cluster's administrators: the ready client certificate
// (ClientID) is one, so tools and tests may do everything.
var Admins = []string{ClientID.ID}

// GatewayCredentials are a gateway's certificate (pki.GatewayPrefix +
// name): it acts for the end users it names (metaclient.WithUser).
func (c *Cluster) GatewayCredentials(name string) (*pki.Credentials, error) {
	return c.Credentials(pki.Identity{Role: pki.RoleClient, ID: pki.GatewayPrefix + name})
}

// Credentials returns id's credentials from the cluster's CA, issued on
// first use (pki.Insecure() for an insecure cluster).
func (c *Cluster) Credentials(id pki.Identity) (*pki.Credentials, error) {
	if c.pki == nil {
		return pki.Insecure(), nil
	}
	return c.pki.Credentials(id)
}

// ClientCredentials are a client certificate (ClientID) for tools and
// tests.
func (c *Cluster) ClientCredentials() *pki.Credentials {
	cr, err := c.Credentials(ClientID)
	if err != nil {
		panic(fmt.Sprintf("cluster: client credentials: %v", err)) // the files were written at Start
	}
	return cr
}

// ClientTLSDir is the TLS directory of ClientCredentials ("" when
// Insecure): what `basalt dev` tells the CLI to use.
func (c *Cluster) ClientTLSDir() string {
	if c.pki == nil {
		return ""
	}
	c.ClientCredentials()
	return c.pki.DirOf(ClientID)
}

// MetaDialOption authenticates a gRPC connection to the metadata service
// with ClientCredentials.
func (c *Cluster) MetaDialOption() grpc.DialOption {
	return c.ClientCredentials().GRPCDialOption(pki.RoleMeta)
}

// DatanodeDialOption authenticates a gRPC connection to a datanode with
// ClientCredentials.
func (c *Cluster) DatanodeDialOption() grpc.DialOption {
	return c.ClientCredentials().GRPCDialOption(pki.RoleDatanode)
}

// CA is the cluster's CA (nil when Insecure), for tests that forge.
func (c *Cluster) CA() *pki.CA {
	if c.pki == nil {
		return nil
	}
	return c.pki.CA()
}

// datanodeCredentials are the certificate of the datanode in dir: the
// UUID it already has (its identity file), or a new one.
func (c *Cluster) datanodeCredentials(dir string) (*pki.Credentials, error) {
	if c.pki == nil {
		return pki.Insecure(), nil
	}
	uuid, err := datanode.StoredUUID(dir)
	if err != nil {
		return nil, err
	}
	if uuid == "" {
		var u [16]byte
		rand.Read(u[:])
		uuid = hex.EncodeToString(u[:])
	}
	return c.pki.Credentials(pki.Identity{Role: pki.RoleDatanode, ID: uuid})
}
