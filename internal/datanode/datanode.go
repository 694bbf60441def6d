// Package datanode is the datanode role: it stores containers (package
// storage), joins the Raft group of every pipeline SCM puts it in (package
// raft, one host for all of them: multi-raft), serves the V1 write path
// (WriteChunk and PutBlock through the pipeline's group, data kept out of
// the log) and reads from any replica, and reports to SCM by heartbeat.
package datanode

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/guard"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
	"github.com/basalt-store/basalt/internal/vfs"
)

// Config configures a datanode. Zero values take the defaults noted.
type Config struct {
	// DataDir holds the datanode's identity, its pipeline list and, by
	// default, its data volume and Raft log directory.
	DataDir string
	// SmallDataInLog keeps a small file's data in its Raft log entry
	// (raft.DataLogger: the log fsync makes it durable, no volume flush
	// before the append is acknowledged; see WriteDataLogged). Off by
	// default: on a quiet disk it measured no faster end to end (warp 4 KiB
	// PUTs, slightly slower) and it puts every small file's bytes in the
	// log too (docs/BENCHMARKS.md, "Small objects: datanode batch latency
	// (session 12)").
	SmallDataInLog bool
	// Volumes are the data directories, one per disk (default DataDir/data).
	Volumes []string
	// LogDirs are the Raft log directories, one per disk (default
	// DataDir/raft).
	LogDirs []string
	// Location is the network location, e.g. "/dc1/rack2".
	Location string
	Hostname string
	// MetaAddrs are the gRPC addresses of the metadata service.
	MetaAddrs []string
	// ListenAddr serves clients (gRPC); RaftAddr the pipelines' Raft
	// transport. "127.0.0.1:0" picks a port.
	ListenAddr string
	RaftAddr   string
	// StreamAddr serves V2 streaming writes (package stream; default
	// "127.0.0.1:0").
	StreamAddr string
	// StreamOnlyVersion, for tests of rolling upgrades: the stream port
	// speaks only this protocol version (stream.ServerConfig.OnlyVersion)
	// and registration advertises it as the previous release did (4:
	// stream_version left 0, as a datanode that predates the field). 0:
	// stream.MinVersion to stream.Version, advertised as stream.Version.
	StreamOnlyVersion uint8
	// StreamAdvertiseVersion, for tests: registration advertises this
	// stream protocol version instead (a registration that no longer
	// matches the binary behind it). 0: as above.
	StreamAdvertiseVersion uint32
	// TickInterval of the pipelines' Raft groups (default 100ms).
	TickInterval time.Duration
	// Storage options; Volumes, KeepUncommitted are set by the datanode.
	Storage storage.Options
	// SlowDisk: slow-disk detection and avoidance (slowdisk.go).
	SlowDisk SlowDiskConfig
	// LogBallastBytes is raft.HostConfig.LogBallastBytes: the emergency
	// ballast beside each Raft log directory (0: none).
	LogBallastBytes int64
	// FullReportEvery: full container reports every this many heartbeats
	// (default 10).
	FullReportEvery int
	// GRPCStreamWorkers is the number of goroutines kept to serve gRPC
	// calls (default DefaultGRPCStreamWorkers; negative: a new goroutine
	// per call, gRPC's default). A kept goroutine keeps the stack it grew,
	// where a new one grows (copies) its stack again on every call; calls
	// beyond the workers still run, each on a new goroutine.
	GRPCStreamWorkers int
	// FS holds the datanode's own files (identity, pipeline list, each
	// pipeline's applied index and containers), its Raft logs and, unless
	// Storage.FS is set, its data volumes (default vfs.Default).
	FS vfs.FS
	// TLS is this datanode's certificate (basalt://datanode/<uuid>) and
	// the cluster CA. Every port (gRPC, raft, stream) requires a
	// certificate from that CA of every caller, and the datanode presents
	// its own to SCM and its peers. A new datanode takes its UUID from the
	// certificate. Required; pki.Insecure() turns authentication off
	// (benchmarks only).
	TLS        *pki.Credentials
	Registerer prometheus.Registerer
	Logger     *slog.Logger

	// ScrubRate is the scrubber's read rate in bytes per second (default
	// DefaultScrubRate; negative: no background scrubbing). ScrubInterval
	// is the time from the start of one pass to the start of the next
	// (default DefaultScrubInterval). See scrub.go.
	ScrubRate     int64
	ScrubInterval time.Duration
	// VolumeCheckInterval: how often each volume's health is checked
	// (default DefaultVolumeCheckInterval; negative: never);
	// VolumeCheckTimeout: a probe not done by then fails its volume
	// (default DefaultVolumeCheckTimeout).
	VolumeCheckInterval time.Duration
	VolumeCheckTimeout  time.Duration

	// CacheDirs are the cache tier's directories (a DAX-mounted pmem file
	// system in production; tmpfs or any directory otherwise), each of
	// CacheBytes. No CacheDirs but CacheBytes > 0: a DRAM cache of that
	// size. Neither: no cache tier. See cache.go and docs/CACHE.md.
	CacheDirs  []string
	CacheBytes int64
	// ShortCircuitSocket is the Unix socket local readers get cached
	// blocks' files and, on the posix backend, any committed block's
	// file from (cache_shortcircuit.go, shortcircuit_block.go; default
	// DataDir/short-circuit.sock with cache directories or a posix
	// volume; "-": none).
	ShortCircuitSocket string
}

// Datanode is one running datanode.
type Datanode struct {
	cfg   Config
	log   *slog.Logger
	store *storage.Store
	host  *raft.Host
	meta  *metaclient.Client
	grpc  *grpc.Server
	lis   net.Listener
	stats stats

	streamLis      net.Listener
	streamSrv      *stream.Server
	streamMetrics  []prometheus.Collector
	streamJoinWait time.Duration // awaitPipeline's bound (stream.go)
	ident          identity

	mu             sync.Mutex
	peers          map[uint64]*metapb.DatanodeDetails // by datanode ID
	refreshMu      sync.Mutex                         // one peer refresh at a time (auth.go)
	peersRefreshed time.Time                          // under refreshMu: the last refresh for a peer (auth.go)
	pipelines      map[uint64]*metapb.Pipeline
	sms            map[uint64]*containerSM
	pipeJoined     chan struct{}               // closed (and replaced) when a pipeline is joined (stream.go)
	pipesLeft      leftPipelines               // pipelines this datanode left (stream.go)
	leftSick       leftReasons                 // why left pipelines' containers are UNHEALTHY (reasons.go)
	recov          recoveries                  // RecoverContainer runs and failures (recover.go)
	peerConns      map[string]*grpc.ClientConn // by data address (ApplyStatus)
	// ApplyStatus asks batched per follower and pipeline
	// (applystatus_batch.go).
	statusMu      sync.Mutex
	statusBatches map[statusKey]*statusBatch
	// Delete-block transactions to acknowledge in the next heartbeat
	// (delete.go), and the ones being proposed through a pipeline.
	acks         map[uint64]deleteAck
	ackOrder     []uint64
	recentAcks   []deleteAck // the newest maxRecentAcks, for DeleteAck
	proposingDel map[uint64]bool

	repl        replicator // container copies in and out (replicate.go)
	tokens      tokenCheck // block token keys from SCM (token.go)
	hbInterval  time.Duration
	reportSoon  atomic.Bool    // a container changed state: full report next
	logFail     logDirFailures // pipelines stopped by a failed log dir (logdirfail.go)
	stopc       chan struct{}
	wg          sync.WaitGroup
	closeOnce   sync.Once
	statusCalls callPool // the followers' batched ApplyStatus calls (smallfiles.go)

	disks *diskWatch // slow-disk detection (slowdisk.go); nil: off

	// scrub verifies stored blocks in the background (scrub.go).
	scrub                        *scrubber
	scrubMetrics                 []prometheus.Collector
	cmds                         *cmdQueue                                     // SCM's commands from heartbeats (commands.go)
	commandHook                  atomic.Pointer[func(*metapb.DatanodeCommand)] // tests: runs before each command
	saveMu                       sync.Mutex                                    // orders pipelines.json writes (savePipelines)
	volChecksOK, volChecksFailed atomic.Uint64

	cache *blockCache   // cache tier (cache.go); nil without one
	sc    *shortCircuit // short-circuit reads of cached blocks; nil without

	// applyStatusHook, tests only: runs at the start of every ApplyStatus
	// call this datanode serves (e.g. to make a follower stop answering).
	applyStatusHook atomic.Pointer[func(context.Context)]
}

type identity struct {
	UUID string `json:"uuid"`
	ID   uint64 `json:"id"`
}

// DefaultGRPCStreamWorkers is Config.GRPCStreamWorkers' default: a
// pipeline leader holds a call for the whole Raft round (and the wait for
// every replica), so it needs about as many as the writes in flight.
const DefaultGRPCStreamWorkers = 64

// New opens the datanode's storage; Start registers it and starts serving.
func New(cfg Config) (*Datanode, error) {
	if cfg.GRPCStreamWorkers == 0 {
		cfg.GRPCStreamWorkers = DefaultGRPCStreamWorkers
	}
	if cfg.DataDir == "" {
		return nil, errors.New("datanode: DataDir is required")
	}
	if len(cfg.MetaAddrs) == 0 {
		return nil, errors.New("datanode: MetaAddrs is required")
	}
	if len(cfg.Volumes) == 0 {
		cfg.Volumes = []string{filepath.Join(cfg.DataDir, "data")}
	}
	if len(cfg.LogDirs) == 0 {
		cfg.LogDirs = []string{filepath.Join(cfg.DataDir, "raft")}
	}
	if cfg.Location == "" {
		cfg.Location = "/default-rack"
	}
	if cfg.Hostname == "" {
		cfg.Hostname, _ = os.Hostname()
	}
	if cfg.ListenAddr == "" {
		cfg.ListenAddr = "127.0.0.1:0"
	}
	if cfg.RaftAddr == "" {
		cfg.RaftAddr = "127.0.0.1:0"
	}
	if cfg.StreamAddr == "" {
		cfg.StreamAddr = "127.0.0.1:0"
	}
	if cfg.FullReportEvery == 0 {
		cfg.FullReportEvery = 10
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.FS == nil {
		cfg.FS = vfs.Default
	}
	if cfg.TLS == nil {
		return nil, errors.New("datanode: TLS credentials are required (pki.Load of a TLS directory; see `basalt admin ca issue --role datanode`)")
	}
	if !cfg.TLS.IsInsecure() && cfg.TLS.Identity.Role != pki.RoleDatanode {
		return nil, fmt.Errorf("datanode: the certificate is %s, not a datanode's", cfg.TLS.Identity)
	}
	if cfg.TLS.IsInsecure() {
		cfg.Logger.Error("datanode: AUTHENTICATION IS OFF: gRPC, raft and stream ports accept anyone in plaintext (insecure mode, for benchmarks only)", "dir", cfg.DataDir)
	}
	if err := vfs.MkdirAllSync(cfg.FS, filepath.Join(cfg.DataDir, "pipelines")); err != nil {
		return nil, err
	}
	d := &Datanode{cfg: cfg, log: cfg.Logger, peers: map[uint64]*metapb.DatanodeDetails{},
		pipelines: map[uint64]*metapb.Pipeline{}, sms: map[uint64]*containerSM{}, peerConns: map[string]*grpc.ClientConn{},
		acks: map[uint64]deleteAck{}, proposingDel: map[uint64]bool{}, stopc: make(chan struct{}), pipeJoined: make(chan struct{}), cmds: newCmdQueue()}
	if err := d.loadIdentity(); err != nil {
		return nil, err
	}
	d.watchDisks() // slowdisk.go: may wrap d.cfg.FS
	cfg.FS = d.cfg.FS
	so := cfg.Storage
	so.Volumes = cfg.Volumes
	so.AvoidVolume = d.avoidVolume
	if so.FS == nil {
		so.FS = cfg.FS
	}
	// A chunk acknowledged through Raft must survive a restart until its
	// block is committed or abandoned: the leader may need to resend it.
	so.KeepUncommitted = true
	// Clients keep several WriteChunks of a block in flight; they reach
	// the log in arrival order, not offset order.
	so.OutOfOrderWrites = true
	if so.Logf == nil {
		// Volume failures, recovery actions and a full disk at start
		// (ballast removed) must reach the operator.
		so.Logf = func(f string, a ...any) { d.log.Warn(fmt.Sprintf(f, a...)) }
	}
	st, err := storage.Open(so)
	if err != nil {
		return nil, err
	}
	d.store = st
	// The cache tier is recovered before the first heartbeat, so its
	// blocks are reported (and served) from the start.
	if d.cache, err = openCache(cfg.CacheDirs, cfg.CacheBytes, st, d.log); err != nil {
		st.Close()
		return nil, err
	}
	if d.cfg.ShortCircuitSocket == "" && (d.cache != nil && !d.cache.dram || st.PassesBlockFiles()) {
		d.cfg.ShortCircuitSocket = filepath.Join(cfg.DataDir, "short-circuit.sock")
	}
	mc, err := metaclient.New(metaclient.Config{Addrs: cfg.MetaAddrs, DialOptions: []grpc.DialOption{cfg.TLS.GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		st.Close()
		return nil, err
	}
	d.meta = mc
	lis, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		st.Close()
		mc.Close()
		return nil, fmt.Errorf("datanode: listen on %s: %w", cfg.ListenAddr, err)
	}
	d.lis = lis
	slis, err := net.Listen("tcp", cfg.StreamAddr)
	if err != nil {
		st.Close()
		mc.Close()
		lis.Close()
		return nil, fmt.Errorf("datanode: stream listen on %s: %w", cfg.StreamAddr, err)
	}
	d.streamLis = slis
	return d, nil
}

func (d *Datanode) identityFile() string { return filepath.Join(d.cfg.DataDir, "datanode.json") }

func (d *Datanode) loadIdentity() error {
	b, err := vfs.ReadFile(d.cfg.FS, d.identityFile())
	if err == nil {
		if err := json.Unmarshal(b, &d.ident); err != nil || d.ident.UUID == "" {
			return fmt.Errorf("datanode: corrupt identity file %s", d.identityFile())
		}
		if c := d.cfg.TLS; !c.IsInsecure() && c.Identity.ID != d.ident.UUID {
			return fmt.Errorf("datanode: %s is datanode %s, but the certificate is %s (issue one with `basalt admin ca issue --role datanode --id %s`)",
				d.cfg.DataDir, d.ident.UUID, c.Identity, d.ident.UUID)
		}
		return nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if c := d.cfg.TLS; !c.IsInsecure() {
		// A new datanode is the one its certificate names.
		d.ident.UUID = c.Identity.ID
	} else {
		var u [16]byte
		rand.Read(u[:])
		d.ident.UUID = hex.EncodeToString(u[:])
	}
	return d.saveIdentity()
}

func (d *Datanode) saveIdentity() error {
	return vfs.WriteFileAtomic(d.cfg.FS, d.identityFile(), mustJSON(d.ident))
}

// ID is the datanode ID SCM assigned (0 before the first registration).
func (d *Datanode) ID() uint64 { return d.ident.ID }

// Addr is the client (gRPC) address.
func (d *Datanode) Addr() string { return d.lis.Addr().String() }

// RaftAddr is the pipelines' Raft transport address.
func (d *Datanode) RaftAddr() string {
	if d.host == nil {
		return ""
	}
	return d.host.Addr()
}

// Store exposes the container storage (tests, admin).
func (d *Datanode) Store() *storage.Store { return d.store }

// Start registers with SCM (retrying until the metadata service answers or
// ctx ends), starts the Raft host with the pipelines it was in, and serves.
func (d *Datanode) Start(ctx context.Context) error {
	raftAddr := d.cfg.RaftAddr
	var raftLn net.Listener
	if d.ident.ID == 0 {
		// First start: SCM assigns the ID the Raft host needs, and wants the
		// Raft address at registration; bind the port now and keep it bound
		// for the Raft host (closing it and listening again later would let
		// another process take a kernel-picked port in between).
		l, err := net.Listen("tcp", raftAddr)
		if err != nil {
			return fmt.Errorf("datanode: raft address %s: %w", raftAddr, err)
		}
		raftAddr, raftLn = l.Addr().String(), l
		if err := d.register(ctx, raftAddr); err != nil {
			l.Close()
			return err
		}
	}
	h, err := raft.NewHost(raft.HostConfig{
		ID: d.ident.ID, LogDirs: d.cfg.LogDirs, ListenAddr: raftAddr, Listener: raftLn, Resolve: d.resolveRaft, Security: d.raftSecurity(),
		TickInterval: d.cfg.TickInterval, FS: d.cfg.FS, Registerer: d.cfg.Registerer, Logger: d.log,
		LogBallastBytes: d.cfg.LogBallastBytes,
		// Chunk data is in the block files, so a log entry is small, but
		// keep more of the log for followers that fall behind briefly.
		CompactEvery: 4096, CompactKeep: 1024,
		AvoidLogDir:    d.avoidLogDir,
		OnLogDirFailed: d.onLogDirFailed,
	})
	if err != nil {
		if raftLn != nil {
			raftLn.Close()
		}
		return err
	}
	d.host = h
	if err := d.register(ctx, h.Addr()); err != nil {
		return err
	}
	if err := d.restorePipelines(); err != nil {
		return err
	}
	d.grpc = grpc.NewServer(d.grpcServerOption(),
		grpc.ChainUnaryInterceptor(guard.UnaryServerInterceptor(d.cfg.Registerer, d.log), d.authUnary),
		grpc.ChainStreamInterceptor(guard.StreamServerInterceptor(d.cfg.Registerer, d.log), d.authStream), grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20),
		grpc.NumStreamWorkers(uint32(max(d.cfg.GRPCStreamWorkers, 0))))
	datanodepb.RegisterDatanodeServer(d.grpc, &service{d: d})
	d.startStream()
	if err := d.startShortCircuit(); err != nil {
		// Local readers fall back to gRPC.
		d.log.Warn("short-circuit reads off", "err", err)
	}
	if d.cache != nil && d.cfg.Registerer != nil {
		for _, c := range d.cache.metrics() {
			d.cfg.Registerer.Register(c)
		}
	}
	if err := d.startScrubber(); err != nil {
		return err
	}
	d.registerCommandMetrics()
	d.wg.Add(3)
	go func() {
		defer d.wg.Done()
		d.grpc.Serve(d.lis)
	}()
	go d.commandLoop()
	go d.heartbeatLoop()
	if d.disks != nil {
		d.wg.Add(1)
		go d.diskLoop()
	}
	return nil
}

func (d *Datanode) details(raftAddr string) *metapb.DatanodeDetails {
	return &metapb.DatanodeDetails{Id: d.ident.ID, Uuid: d.ident.UUID, Hostname: d.cfg.Hostname,
		DataAddr: d.Addr(), RaftAddr: raftAddr, Location: d.cfg.Location, StreamAddr: d.StreamAddr(), ShortCircuitSocket: d.shortCircuitPath(),
		StreamVersion: d.streamVersion()}
}

// streamVersion is the stream protocol version registration advertises:
// stream.Version, or what StreamOnlyVersion restricts it to (0 for 4: the
// previous release did not send the field).
func (d *Datanode) streamVersion() uint32 {
	if v := d.cfg.StreamAdvertiseVersion; v != 0 {
		return v
	}
	if v := d.cfg.StreamOnlyVersion; v != 0 {
		if v <= 4 {
			return 0
		}
		return uint32(v)
	}
	return stream.Version
}

func (d *Datanode) register(ctx context.Context, raftAddr string) error {
	backoff := 100 * time.Millisecond
	for {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err := d.meta.Scm.RegisterDatanode(rctx, &metapb.RegisterDatanodeRequest{Details: d.details(raftAddr), Volumes: d.volumeReports()})
		cancel()
		if err == nil {
			if d.ident.ID != 0 && d.ident.ID != resp.GetDatanodeId() {
				return fmt.Errorf("datanode %s: SCM assigned ID %d but this datanode is %d", d.ident.UUID, resp.GetDatanodeId(), d.ident.ID)
			}
			if d.ident.ID == 0 {
				d.ident.ID = resp.GetDatanodeId()
				if err := d.saveIdentity(); err != nil {
					return err
				}
			}
			d.setKeys(resp.GetSecretKeys())
			d.hbInterval = time.Duration(resp.GetHeartbeatIntervalMs()) * time.Millisecond
			if d.hbInterval <= 0 {
				d.hbInterval = 3 * time.Second
			}
			return nil
		}
		if c := status.Code(err); c == codes.InvalidArgument || c == codes.AlreadyExists || c == codes.PermissionDenied {
			return fmt.Errorf("datanode: SCM refused registration: %w", err)
		}
		d.log.Info("registration with SCM failed; retrying", "err", err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("datanode: registering with SCM at %v: %w", d.cfg.MetaAddrs, err)
		case <-d.stopc:
			return raft.ErrStopped
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

func (d *Datanode) resolveRaft(id uint64) (string, error) {
	d.mu.Lock()
	p, ok := d.peers[id]
	d.mu.Unlock()
	if ok && p.GetRaftAddr() != "" {
		return p.GetRaftAddr(), nil
	}
	d.refreshPeers()
	d.mu.Lock()
	defer d.mu.Unlock()
	if p, ok := d.peers[id]; ok && p.GetRaftAddr() != "" {
		return p.GetRaftAddr(), nil
	}
	return "", fmt.Errorf("datanode: no raft address known for datanode %d", id)
}

// refreshPeers learns every datanode's addresses from SCM (addresses may
// change when a datanode restarts on another port).
func (d *Datanode) refreshPeers() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := d.meta.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
	if err != nil {
		return
	}
	d.mu.Lock()
	for _, s := range resp.GetDatanodes() {
		d.peers[s.GetDetails().GetId()] = s.GetDetails()
	}
	d.mu.Unlock()
}

func (d *Datanode) peerDataAddr(id uint64) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if p, ok := d.peers[id]; ok {
		return p.GetDataAddr()
	}
	return ""
}

// pipelinesFile lists the pipelines this datanode is in, so a restart
// rejoins them.
func (d *Datanode) pipelinesFile() string { return filepath.Join(d.cfg.DataDir, "pipelines.json") }

type savedPipelines struct {
	Pipelines []json.RawMessage `json:"pipelines"`
}

// savePipelines writes the pipeline list (pipelines.json) as it is now.
// The file is written and synced outside d.mu, which heartbeats take
// (a slow data-directory disk must not hold them up, see commands.go);
// saveMu orders the writes, each with the list as of its own snapshot,
// so the file never goes back to an older list.
func (d *Datanode) savePipelines() error {
	d.saveMu.Lock()
	defer d.saveMu.Unlock()
	d.mu.Lock()
	b, err := d.pipelinesJSONLocked()
	d.mu.Unlock()
	if err != nil {
		return err
	}
	return vfs.WriteFileAtomic(d.cfg.FS, d.pipelinesFile(), b)
}

func (d *Datanode) pipelinesJSONLocked() ([]byte, error) {
	ids := make([]uint64, 0, len(d.pipelines))
	for id := range d.pipelines {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	var sp savedPipelines
	for _, id := range ids {
		b, err := protoJSON(d.pipelines[id])
		if err != nil {
			return nil, err
		}
		sp.Pipelines = append(sp.Pipelines, b)
	}
	return mustJSON(sp), nil
}

func (d *Datanode) restorePipelines() error {
	b, err := vfs.ReadFile(d.cfg.FS, d.pipelinesFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var sp savedPipelines
	if err := json.Unmarshal(b, &sp); err != nil {
		return fmt.Errorf("datanode: corrupt %s: %w", d.pipelinesFile(), err)
	}
	for _, raw := range sp.Pipelines {
		p := &metapb.Pipeline{}
		if err := protoUnJSON(raw, p); err != nil {
			return fmt.Errorf("datanode: corrupt %s: %w", d.pipelinesFile(), err)
		}
		if err := d.joinPipeline(p, nil); err != nil {
			return err
		}
	}
	return nil
}

// joinPipeline starts (or restarts) this datanode's replica of a pipeline.
func (d *Datanode) joinPipeline(p *metapb.Pipeline, members []*metapb.DatanodeDetails) error {
	d.mu.Lock()
	for _, m := range members {
		d.peers[m.GetId()] = m
	}
	if _, ok := d.sms[p.GetId()]; ok {
		d.mu.Unlock()
		return nil
	}
	d.mu.Unlock()
	sm, err := newContainerSM(p.GetId(), d.store, d.cfg.FS, filepath.Join(d.cfg.DataDir, "pipelines"), &d.stats, d.log)
	if err != nil {
		return err
	}
	sm.dataInLog = d.cfg.SmallDataInLog
	pid := p.GetId()
	sm.isLeader = func() bool { return d.IsPipelineLeader(pid) }
	sm.now = time.Now
	sm.onUnhealthy = func() { d.reportSoon.Store(true) }
	sm.owner = func(cid uint64) error { return d.ownerError(cid, pid) }
	sm.onDeleted = d.ack
	if _, err := d.host.AddGroup(raft.GroupConfig{ID: p.GetId(), Peers: p.GetDatanodes(), StateMachine: sm}); err != nil && !errors.Is(err, raft.ErrGroupExists) {
		return err
	}
	d.mu.Lock()
	d.sms[p.GetId()] = sm
	d.pipelines[p.GetId()] = p
	d.pipelineJoinedLocked(p.GetId())
	d.mu.Unlock()
	return d.savePipelines()
}

func (d *Datanode) leavePipeline(id uint64) error {
	d.mu.Lock()
	sm, ok := d.sms[id]
	d.pipesLeft.add(id)
	if !ok {
		delete(d.pipelines, id)
		d.mu.Unlock()
		return d.savePipelines()
	}
	d.mu.Unlock()
	// Stop applying first (no Apply runs beside the removal of the
	// pipeline's log and files), persist the applied index and check it
	// (a loss recorded only in memory is saved to the unhealthy list
	// first, see persist), and only then forget the pipeline durably and
	// drop its log. If that fails, the pipeline stays: listed in the
	// pipelines file, its log and files kept; a restart rejoins it, and a
	// repeated close tries again.
	if err := d.host.StopGroup(id); err != nil && !errors.Is(err, raft.ErrGroupNotFound) {
		return err
	}
	if err := sm.persist(sm.applied.Load()); err != nil {
		d.log.Error("cannot leave pipeline: its applied index is not durable; log kept", "pipeline", id, "err", err)
		return err
	}
	// Why the state machine marked its containers UNHEALTHY outlives it
	// (the sick file goes with the pipeline): the reports keep the cause.
	// Taken before d.mu (no sm.mu under d.mu); the group is stopped, so
	// nothing adds to the map after this.
	sick := sm.sickReasons()
	d.mu.Lock()
	delete(d.sms, id)
	delete(d.pipelines, id)
	d.leftSick.add(sick)
	d.mu.Unlock()
	if err := d.savePipelines(); err != nil {
		// Still listed on disk: a restart rejoins it (from its kept log).
		return err
	}
	// On a failed log directory the log stays (logdirfail.go).
	if rerr := d.host.RemoveGroup(id); rerr != nil && !errors.Is(rerr, raft.ErrGroupNotFound) && !errors.Is(rerr, raft.ErrLogDirFailed) {
		return rerr
	}
	sm.removeFiles()
	return nil
}

func (d *Datanode) heartbeatLoop() {
	defer d.wg.Done()
	n := 0
	for {
		select {
		case <-d.stopc:
			return
		case <-time.After(d.hbInterval):
		}
		if err := d.heartbeat(n%d.cfg.FullReportEvery == 0 || d.reportSoon.Swap(false)); err != nil {
			d.log.Debug("heartbeat failed", "err", err)
		}
		d.watchStuckCommand(time.Now())
		n++
		if n%5 == 0 {
			d.refreshPeers()
		}
	}
}

// Heartbeat sends one heartbeat now (tests use it to speed things up).
func (d *Datanode) Heartbeat() error { return d.heartbeat(true) }

func (d *Datanode) heartbeat(full bool) error {
	d.checkLogDirs()
	req := &metapb.HeartbeatRequest{DatanodeId: d.ident.ID, FullReport: full}
	req.Volumes, req.Containers = d.reports(full)
	d.mu.Lock()
	for id := range d.sms {
		req.Pipelines = append(req.Pipelines, &metapb.PipelineReport{PipelineId: id})
	}
	d.mu.Unlock()
	cacheSent := func() {}
	if d.cache != nil {
		cacheSent = d.cache.report(req, full)
	}
	sent := d.takeAcks(req)
	d.takeCopyFailures(req)
	for _, p := range req.Pipelines {
		if g, err := d.host.Group(p.PipelineId); err == nil {
			p.IsLeader = g.IsLeader()
		}
	}
	d.reportSlowDisks(req)
	d.reportFailedLogDirs(req)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := d.meta.Scm.Heartbeat(ctx, req)
	if err != nil {
		return err
	}
	d.clearAcks(sent)
	if resp.GetReregister() {
		// SCM recorded nothing: the cached-block list goes again.
		return d.register(ctx, d.host.Addr())
	}
	cacheSent()
	d.setKeys(resp.GetSecretKeys())
	// Run by commandLoop, so a slow command never holds up the next
	// heartbeat (commands.go).
	for _, cmd := range resp.GetCommands() {
		d.queueCommand(cmd)
	}
	return nil
}

// Execute runs one SCM command now, as if it came in a heartbeat
// response (tests, admin).
func (d *Datanode) Execute(cmd *metapb.DatanodeCommand) error { return d.execute(cmd) }

func (d *Datanode) execute(cmd *metapb.DatanodeCommand) error {
	if h := d.commandHook.Load(); h != nil {
		(*h)(cmd)
	}
	switch c := cmd.GetCommand().(type) {
	case *metapb.DatanodeCommand_CreatePipeline:
		return d.joinPipeline(c.CreatePipeline.GetPipeline(), c.CreatePipeline.GetDatanodes())
	case *metapb.DatanodeCommand_ClosePipeline:
		return d.leavePipeline(c.ClosePipeline.GetPipelineId())
	case *metapb.DatanodeCommand_CloseContainer:
		// A full report soon, so SCM sees the container CLOSED (and
		// can repair it) without waiting FullReportEvery heartbeats.
		defer d.reportSoon.Store(true)
		return d.closeContainer(c.CloseContainer.GetContainerId(), c.CloseContainer.GetPipelineId())
	case *metapb.DatanodeCommand_DeleteBlocks:
		return d.executeDelete(c.DeleteBlocks)
	case *metapb.DatanodeCommand_ReplicateContainer:
		return d.replicateContainer(c.ReplicateContainer)
	case *metapb.DatanodeCommand_DeleteContainer:
		return d.deleteContainer(c.DeleteContainer)
	case *metapb.DatanodeCommand_CacheBlocks:
		return d.executeCache(c.CacheBlocks.GetBlocks(), nil)
	case *metapb.DatanodeCommand_UncacheBlocks:
		return d.executeCache(nil, c.UncacheBlocks.GetBlocks())
	case *metapb.DatanodeCommand_RecoverContainer:
		return d.recoverContainer(c.RecoverContainer)
	}
	return nil
}

// closeContainer closes a container through its pipeline's log, so every
// replica closes it after the same last write; if the pipeline is gone,
// locally.
func (d *Datanode) closeContainer(cid, pipeline uint64) error {
	g, err := d.host.Group(pipeline)
	if err != nil {
		err := d.store.CloseContainer(storage.ContainerID(cid))
		if errors.Is(err, storage.ErrContainerNotFound) {
			return nil
		}
		return err
	}
	if !g.IsLeader() {
		return nil // the leader proposes it
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = g.Propose(ctx, mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_CloseContainer{
		CloseContainer: &datanodepb.CloseContainerCmd{ContainerId: cid}}}), nil)
	return err
}

// reports are a heartbeat's volume reports and, if full, its container
// reports (one scan of the volumes serves both).
func (d *Datanode) reports(full bool) ([]*metapb.VolumeReport, []*metapb.ContainerReport) {
	vols := d.store.Volumes()
	if !full {
		return volumeReports(vols), nil
	}
	return volumeReports(vols), d.containerReports(vols)
}

// ContainerReports are the container reports a full heartbeat carries.
// An UNHEALTHY one carries why (unhealthyReason).
func (d *Datanode) ContainerReports() []*metapb.ContainerReport {
	return d.containerReports(nil)
}

// containerReports is ContainerReports; vols, if not nil, are storage's
// volume reports from just before (read only if a container is UNHEALTHY;
// scanned again if a container's volume is not failed in them: it may
// have failed since).
func (d *Datanode) containerReports(vols []storage.VolumeReport) []*metapb.ContainerReport {
	d.mu.Lock()
	leftMark := d.leftSick.seq
	d.mu.Unlock()
	cs := d.store.ListContainers()
	// Why this replica lacks each container, as the pipelines' state
	// machines recorded it (their sick maps, read only), then as the
	// state machines of pipelines left since the start recorded it
	// (leftSick). Read after storage's list: a state machine records a
	// container there before it marks storage, so every container listed
	// UNHEALTHY by its mark is found here (in its map, or, if the
	// pipeline was left meanwhile, in leftSick: the map is handed over
	// under d.mu as the state machine is dropped).
	d.mu.Lock()
	sms := make([]*containerSM, 0, len(d.sms))
	for _, sm := range d.sms {
		sms = append(sms, sm)
	}
	left := d.leftSick.snapshot()
	d.mu.Unlock()
	sick := map[uint64]string{}
	for _, sm := range sms {
		sm.mu.Lock()
		for cid, why := range sm.sick {
			if _, ok := sick[cid]; !ok {
				sick[cid] = why
			}
		}
		sm.mu.Unlock()
	}
	out := make([]*metapb.ContainerReport, 0, len(cs))
	have := make(map[uint64]bool, len(cs))
	unhealthy := map[uint64]bool{}
	var failed map[string]string // failed volume path → its error
	rescanned := false
	scan := func() {
		failed = map[string]string{}
		if vols == nil {
			vols = d.store.Volumes()
		}
		for _, v := range vols {
			if v.Failed {
				failed[v.Path] = v.Error
			}
		}
	}
	for _, c := range cs {
		have[uint64(c.ID)] = true
		r := &metapb.ContainerReport{
			ContainerId: uint64(c.ID), State: containerState(c.State), UsedBytes: uint64(c.UsedBytes),
			BlockCount: uint64(c.BlockCount), Bcsid: c.BCSID,
		}
		if r.State == metapb.ContainerState_CONTAINER_UNHEALTHY {
			unhealthy[uint64(c.ID)] = true
			if failed == nil {
				scan()
			}
			_, known := sick[uint64(c.ID)]
			if _, ok := left[uint64(c.ID)]; ok {
				known = true
			}
			if _, ok := failed[c.Volume]; !ok && !known && !rescanned {
				// The volumes were scanned before the list: this one may
				// have failed since (its containers are then listed
				// UNHEALTHY). Scan once more, after the list.
				vols, rescanned = nil, true
				scan()
			}
			r.UnhealthyReason = d.recov.note(uint64(c.ID), unhealthyReason(sick, left, failed, uint64(c.ID), c.Volume))
		}
		out = append(out, r)
	}
	// A container a pipeline wrote into that this replica lacks and could
	// not even create (no volume with room: a filled disk) has no storage
	// record to carry its UNHEALTHY mark; without this report SCM kept
	// allocating into it for minutes (the fault test's pipeline 1009).
	for _, cid := range slices.Sorted(maps.Keys(sick)) {
		if !have[cid] {
			have[cid] = true
			out = append(out, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY,
				UnhealthyReason: boundReason(sick[cid] + " (container not held here)")})
		}
	}
	// A left pipeline's reason goes once its container is no longer
	// UNHEALTHY here (deleted, replaced, healthy again); one handed over
	// after the list is kept for the next report.
	d.mu.Lock()
	d.leftSick.prune(leftMark, unhealthy)
	d.mu.Unlock()
	return out
}

// maxUnhealthyReason bounds ContainerReport.unhealthy_reason, in bytes.
const maxUnhealthyReason = 256

// UnknownUnhealthyReason starts the reason of an UNHEALTHY replica whose
// cause this datanode does not know: storage's own mark (a read or scrub
// failing its checksums, a block lost at open), whose cause storage logs
// but does not keep, or a state machine's mark from before a restart (the
// reasons of left pipelines are kept in memory only). basalt admin shows
// SCM's record instead.
const UnknownUnhealthyReason = "UNHEALTHY here; cause not known"

// unhealthyReason is why this replica of container cid (on volume vol)
// is UNHEALTHY: the reason a pipeline's state machine recorded (sick,
// else left: a state machine dropped since the start), else its volume's
// failure, else UnknownUnhealthyReason.
func unhealthyReason(sick, left map[uint64]string, failedVolumes map[string]string, cid uint64, vol string) string {
	if why, ok := sick[cid]; ok {
		return boundReason(why)
	}
	if why, ok := left[cid]; ok {
		return boundReason(why)
	}
	if err, ok := failedVolumes[vol]; ok {
		return boundReason(fmt.Sprintf("volume %s failed: %s", vol, err))
	}
	return boundReason(UnknownUnhealthyReason + " (storage's own mark, or marked before this datanode restarted): see this datanode's log (\"storage: container " +
		strconv.FormatUint(cid, 10) + " UNHEALTHY\") / SCM's record")
}

// boundReason makes s valid UTF-8 of at most maxUnhealthyReason bytes
// without control characters (a newline, tab or ESC becomes a space: a
// reason is one line on an operator's terminal), cut at a rune boundary
// with "…" when longer.
func boundReason(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	if len(s) <= maxUnhealthyReason {
		return s
	}
	const ell = "…"
	s = s[:maxUnhealthyReason-len(ell)]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + ell
}

func (d *Datanode) volumeReports() []*metapb.VolumeReport {
	return volumeReports(d.store.Volumes())
}

func volumeReports(vols []storage.VolumeReport) []*metapb.VolumeReport {
	var out []*metapb.VolumeReport
	for _, v := range vols {
		out = append(out, &metapb.VolumeReport{Path: v.Path, CapacityBytes: uint64(v.Capacity), UsedBytes: uint64(v.Used), Failed: v.Failed,
			AvailableBytes: uint64(max(v.Available, 0)), AvailableKnown: true})
	}
	return out
}

func containerState(s storage.State) metapb.ContainerState {
	switch s {
	case storage.StateOpen:
		return metapb.ContainerState_CONTAINER_OPEN
	case storage.StateClosing:
		return metapb.ContainerState_CONTAINER_CLOSING
	case storage.StateUnhealthy:
		// Not CLOSED: SCM must stop allocating into it, close it on the
		// other replicas, and not count this replica.
		return metapb.ContainerState_CONTAINER_UNHEALTHY
	default:
		return metapb.ContainerState_CONTAINER_CLOSED
	}
}

// Close stops serving and closes everything. It does not tell SCM.
func (d *Datanode) Close() error {
	var err error
	d.closeOnce.Do(func() {
		close(d.stopc)
		// The scrubber saves its cursor and makes no more reports.
		d.stopScrubber()
		// Streams first: each discards its partial block while storage is
		// still open.
		d.stopStream()
		d.stopShortCircuit()
		if d.grpc != nil {
			d.grpc.Stop()
		} else {
			d.lis.Close()
		}
		if d.host != nil {
			// Persist where each pipeline got to, so a restart replays less.
			d.mu.Lock()
			for _, sm := range d.sms {
				sm.persist(sm.applied.Load())
			}
			d.mu.Unlock()
			err = d.host.Close()
		}
		d.wg.Wait()
		d.unwatchDisks()
		if d.cache != nil {
			d.cache.close()
			if d.cfg.Registerer != nil {
				for _, c := range d.cache.metrics() {
					d.cfg.Registerer.Unregister(c)
				}
			}
		}
		if d.cfg.Registerer != nil {
			for _, c := range d.cmds.collectors {
				d.cfg.Registerer.Unregister(c)
			}
		}
		d.closePeerConns()
		if serr := d.store.Close(); err == nil {
			err = serr
		}
		d.meta.Close()
	})
	return err
}

// IsPipelineLeader reports whether this datanode leads the pipeline.
func (d *Datanode) IsPipelineLeader(pipeline uint64) bool {
	if d.host == nil {
		return false
	}
	g, err := d.host.Group(pipeline)
	return err == nil && g.IsLeader()
}

// PipelineLogDir is the Raft log directory holding the pipeline's log on
// this datanode ("" if it is not here), for benchmarks and tests.
func (d *Datanode) PipelineLogDir(pipeline uint64) string {
	if d.host == nil {
		return ""
	}
	g, err := d.host.Group(pipeline)
	if err != nil {
		return ""
	}
	return g.Status().LogDir
}

// ChunksWritten counts the chunks this datanode stored (every replica
// counts its own), for tests and Info.
func (d *Datanode) ChunksWritten() uint64 { return d.stats.chunksWritten.Load() }

// SmallFiles counts the blocks this datanode committed from PutSmallFile
// entries (every replica counts).
func (d *Datanode) SmallFiles() uint64 { return d.stats.smallFiles.Load() }

// SmallFileBatches counts the PutSmallFiles calls this datanode led that
// proposed at least one file, and the files they proposed (tests, Info).
func (d *Datanode) SmallFileBatches() (calls, files uint64) {
	return d.stats.smallBatches.Load(), d.stats.smallBatchFiles.Load()
}

// ApplyStatusCalls counts the ApplyStatus calls this datanode served (a
// pipeline leader's asks, batched: applystatus_batch.go), for tests.
func (d *Datanode) ApplyStatusCalls() uint64 { return d.stats.applyStatus.Load() }

// shortCircuitPath is the socket registered with SCM ("" without one).
func (d *Datanode) shortCircuitPath() string {
	if d.cfg.ShortCircuitSocket == "-" {
		return ""
	}
	return d.cfg.ShortCircuitSocket
}
