package meta

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/guard"
	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/vfs"
)

// Raft group IDs of the metadata service.
const (
	NamespaceGroup uint64 = 1
	ScmGroup       uint64 = 2
)

// DefaultGRPCStreamWorkers is Config.GRPCStreamWorkers' default: enough for
// the calls a busy gateway and its clients keep in flight (calls beyond it
// still run, each on a new goroutine).
const DefaultGRPCStreamWorkers = 64

// Peer is one meta node's addresses.
type Peer struct {
	RaftAddr string // raft transport
	GRPCAddr string // gRPC API (what clients and leader hints use)
}

// Config configures a meta Server. Zero values take the defaults noted.
type Config struct {
	// NodeID is this node's ID (nonzero, stable across restarts); it is
	// the replica ID in both groups.
	NodeID uint64
	// DataDir holds raft/ (the log), scm/ and namespace/ (Pebble).
	DataDir string
	// FS is the file system of everything under DataDir (default
	// vfs.Default): the raft log store (raft.HostConfig.FS), the two Pebble
	// stores with their snapshots and restores, and the service-token
	// file. A test can run a whole node on a crashable in-memory FS.
	FS vfs.FS
	// DiskReserveBytes is the free space kept on DataDir's disk for the
	// Pebble stores and the raft log, which treat a failed WAL write as
	// fatal: below it, state-changing requests are refused with
	// ResourceExhausted before they are proposed; reads keep working
	// (default 64 MiB; negative: none). BallastBytes is the size of the
	// emergency ballast kept beside each store and the raft log, removed
	// at start on a full disk so the node comes up (0: none).
	DiskReserveBytes int64
	BallastBytes     int64
	// RaftAddr and GRPCAddr are the listen addresses ("127.0.0.1:0" picks
	// a port; see Server.RaftAddr and GRPCAddr).
	RaftAddr string
	GRPCAddr string
	// Peers are all members, this node included, by node ID. A single-node
	// service may leave it empty. All initial members must get the same
	// set. Addresses can be updated later with SetPeer. Members added
	// later (members.go) are in the replicated member table, which
	// overrides Peers (a removed member is refused even if listed here).
	Peers map[uint64]Peer
	// Join starts a node that is not yet a member: it bootstraps no
	// group and waits for the leaders to add it (basalt admin meta add).
	// Peers then names the current members (their addresses), not
	// necessarily this node. A DataDir that holds state is refused.
	Join bool

	// Raft timing: TickInterval (default 100ms) × ElectionTicks (default
	// 10) is the election timeout; failover takes about 1–2 of those.
	TickInterval  time.Duration
	ElectionTicks int
	// StoreSyncInterval: how often the state machines' Pebble WAL is
	// synced (default 200ms; see package store).
	StoreSyncInterval time.Duration
	// NamespaceCacheBytes is the namespace store's Pebble block cache
	// (default 256 MiB): every lookup reads a key row, and a row whose
	// block is not cached costs a pread and a decompression of the data
	// block (and often of index blocks), several times the lookup itself.
	NamespaceCacheBytes int64
	// LookupCacheBytes bounds the namespace's cache of decoded key records
	// (the lookup path's Pebble read and decoding; default 128 MiB,
	// namespace.DefaultLookupCacheBytes; negative: no cache).
	LookupCacheBytes int64
	// ProposeTimeout bounds a proposal or read barrier when the caller
	// gave no deadline (default 10s).
	ProposeTimeout time.Duration
	// MaxRecvMsgBytes bounds a gRPC request (default 16 MiB).
	MaxRecvMsgBytes int
	// GRPCStreamWorkers is the number of goroutines kept to serve gRPC
	// calls (default DefaultGRPCStreamWorkers; negative: a new goroutine
	// per call, gRPC's default). A kept goroutine keeps the stack it grew,
	// where a new one grows (copies) its stack again on every call.
	GRPCStreamWorkers int

	// ServiceToken guards the S3 secret RPCs (see token.go). Empty: read
	// ServiceTokenFile, creating it with a random token on first start.
	ServiceToken string
	// ServiceTokenFile defaults to DataDir/service-token.
	ServiceTokenFile string

	// Admins are the users (client certificate IDs, end users named by
	// gateways) who may do everything: admin RPCs and every namespace
	// operation (namespace.Authorizer).
	Admins []string
	// Groups maps users to their groups, for ACL entries of type GROUP and
	// policy principals "group:<name>" (ParseGroups; every node the same).
	Groups map[string][]string

	// TLS is this node's certificate (basalt://meta/<NodeID>) and the
	// cluster CA: the gRPC port and the raft transport require a
	// certificate from that CA of every caller, and RPCs check the
	// caller's role (auth.go). Required; pki.Insecure() turns
	// authentication off (benchmarks only).
	TLS *pki.Credentials
	// CA, CAKeySecret, CertValidity: the cluster CA kept through Raft
	// (ca.go). CA is recorded by the first CA group leader if the cluster
	// has none (the operator's CA, or one made for a new cluster);
	// CAKeySecret, if set, seals its key in the log and the store (every
	// meta node needs the same); CertValidity is the life of certificates
	// issued (default pki.NodeValidity).
	CA           *pki.CA
	CAKeySecret  []byte
	CertValidity time.Duration
	// CertRenewed, if set, is called after this node renewed its own
	// certificate from the cluster CA (to save it where it is loaded from).
	CertRenewed func(*pki.Credentials)

	SCM       scm.Config
	Namespace namespace.Config
	// UserTokens tunes user tokens (usertoken.go).
	UserTokens UserTokenConfig
	// TestSupportedLayout, if nonzero, makes this node support only layout
	// versions up to it, as an older binary (tests; upgrade.go).
	TestSupportedLayout uint32
	// TestHiddenOps: by group (ScmGroup, CaGroup, UserTokenGroup), ops
	// (field numbers of the group's command message) this node treats as
	// unknown, as an older binary (tests; applyhalt).
	TestHiddenOps map[uint64][]int32

	// Registerer receives all metrics (the raft host's and the service's).
	// Nil: a private registry, served by Handler.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Server is one node of the metadata service: the namespace group and the
// SCM group on one raft host, and the gRPC API.
type Server struct {
	cfg Config
	log *slog.Logger
	reg *prometheus.Registry // nil when cfg.Registerer was given

	layoutInitMu sync.Mutex // awaitLayout: one layout init at a time
	lastKeepLog  time.Time  // handOver (runUpgrade's goroutine): last "keeping leadership" warning

	peersMu sync.RWMutex
	peers   map[uint64]Peer // Config.Peers and SetPeer; members.peer overrides

	members *membersState // the member table (members_state.go)
	// joined: this data directory joined (--join); initialVoters: else
	// the cluster's initial voters, the only bootstrap configuration
	// (members_marker.go).
	joined        bool
	initialVoters []uint64
	// memberOpMu: one AddMember/RemoveMember at a time on the members
	// leader; changeMu: one group change at a time on a group leader
	// (from the checks to the proposal). members.go.
	memberOpMu sync.Mutex
	changeMu   sync.Mutex
	// revokePoke wakes runRevokeRemoved (members_revoke.go).
	revokePoke chan struct{}
	memGroup   *raft.Group // MembersGroup

	scmState *scm.State
	nsState  *namespace.State
	host     *raft.Host
	nsGroup  *raft.Group
	scmGroup *raft.Group
	ca       *caService // the cluster CA (ca.go)
	ut       *utState   // user tokens (usertoken.go)
	utCache  utCache    // tokens whose MAC was checked
	s3Keys   s3KeyCache // S3 keys as the token check sees them
	// GetUserToken attempts by source address and by access key.
	utBySource, utByKey utLimiter
	utGroup             *raft.Group // UserTokenGroup

	scmMgr *scm.Manager
	nsSvc  *namespace.Service
	// fwdp: the client to the other meta nodes (forwarding to the SCM,
	// CA leaders), nil on a single node; rebuilt when the member table
	// changes (members.go: fwd, rebuildForwarder).
	fwdp      atomic.Pointer[metaclient.Client]
	fwdMu     sync.Mutex
	fwdAddrs  []string
	fwdOld    []*metaclient.Client // replaced ones, closed by Close
	fwdClosed bool

	lis  net.Listener
	grpc *grpc.Server

	admins  map[string]bool        // Config.Admins
	token   atomic.Pointer[string] // cluster service token; nil until known
	metrics *metrics
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	closeMu sync.Mutex
	closed  bool
	fail    failStop // a fatal failure stopped the server (logdirfail.go)
}

// New opens the state, starts the raft transport and binds the gRPC
// listener. Call Start to join the groups and serve.
func New(cfg Config) (*Server, error) {
	if cfg.NodeID == 0 {
		return nil, errors.New("meta: NodeID must be nonzero")
	}
	if cfg.DataDir == "" {
		return nil, errors.New("meta: DataDir is required")
	}
	if cfg.RaftAddr == "" {
		cfg.RaftAddr = "127.0.0.1:0"
	}
	if cfg.GRPCAddr == "" {
		cfg.GRPCAddr = "127.0.0.1:0"
	}
	if cfg.ProposeTimeout == 0 {
		cfg.ProposeTimeout = 10 * time.Second
	}
	if cfg.MaxRecvMsgBytes == 0 {
		cfg.MaxRecvMsgBytes = 16 << 20
	}
	if cfg.GRPCStreamWorkers == 0 {
		cfg.GRPCStreamWorkers = DefaultGRPCStreamWorkers
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.FS == nil {
		cfg.FS = vfs.Default
	}
	if cfg.TLS == nil {
		return nil, errors.New("meta: TLS credentials are required (pki.Load of a TLS directory; see `basalt admin ca issue --role meta`)")
	}
	if want := (pki.Identity{Role: pki.RoleMeta, ID: fmt.Sprint(cfg.NodeID)}); !cfg.TLS.IsInsecure() && cfg.TLS.Identity != want {
		return nil, fmt.Errorf("meta: the certificate is %s, but this is node %d: want %s", cfg.TLS.Identity, cfg.NodeID, want)
	}
	if cfg.TLS.IsInsecure() {
		cfg.Logger.Error("meta: AUTHENTICATION IS OFF: the gRPC port and the raft transport accept anyone in plaintext (insecure mode, for benchmarks only)", "node", cfg.NodeID)
	}
	s := &Server{cfg: cfg, log: cfg.Logger.With("node", cfg.NodeID), peers: map[uint64]Peer{}, revokePoke: make(chan struct{}, 1)}
	for id, p := range cfg.Peers {
		s.peers[id] = p
	}
	s.admins = map[string]bool{}
	for _, a := range cfg.Admins {
		s.admins[a] = true
	}
	if len(s.admins) == 0 && !cfg.TLS.IsInsecure() {
		s.log.Warn("meta: no admins configured (basalt meta --admins): nobody may create or delete volumes, manage S3 keys or decommission datanodes")
	}
	if cfg.Join {
		if err := checkJoinDir(cfg.FS, cfg.DataDir); err != nil {
			return nil, err
		}
		// The wiped-node guard: the ID must be new to the cluster (no
		// row, a voter of no group).
		if err := CheckNotWiped(context.Background(), cfg.TLS, cfg.NodeID, cfg.Peers, cmp.Or(cfg.ProposeTimeout/2, 5*time.Second), true); err != nil {
			return nil, err
		}
		// First: from now on this data directory never bootstraps a
		// group (members_marker.go).
		if err := writeMarker(cfg.FS, cfg.DataDir, JoinedMarker, []byte("joined\n")); err != nil {
			return nil, err
		}
	}
	reg := cfg.Registerer
	if reg == nil {
		s.reg = prometheus.NewRegistry()
		s.reg.MustRegister(prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
		reg = s.reg
	}
	s.metrics = newMetrics(reg)

	ok := false
	defer func() {
		if !ok {
			s.closeParts()
		}
	}()
	var err error
	tok := cfg.ServiceToken
	if tok == "" {
		if cfg.ServiceTokenFile == "" {
			cfg.ServiceTokenFile = filepath.Join(cfg.DataDir, ServiceTokenFile)
		}
		// A missing file: the token is the cluster's replicated one,
		// adopted (and written here) once Start sees it.
		if tok, err = loadServiceToken(cfg.FS, cfg.ServiceTokenFile); err != nil {
			return nil, err
		}
		s.cfg.ServiceTokenFile = cfg.ServiceTokenFile
	}
	if tok != "" {
		s.token.Store(&tok)
	}
	if cfg.DiskReserveBytes == 0 {
		cfg.DiskReserveBytes = store.DefaultReserve
	}
	s.cfg.DiskReserveBytes = cfg.DiskReserveBytes
	sopts := store.Options{SyncInterval: cfg.StoreSyncInterval, FS: cfg.FS, Logger: s.log,
		ReserveBytes: cfg.DiskReserveBytes, BallastBytes: cfg.BallastBytes}
	if s.scmState, err = scm.OpenHiding(filepath.Join(cfg.DataDir, "scm"), sopts, cfg.TestHiddenOps[ScmGroup]); err != nil {
		return nil, err
	}
	nsOpts := sopts
	nsOpts.CacheBytes = cmp.Or(cfg.NamespaceCacheBytes, 256<<20)
	if s.nsState, err = namespace.OpenSupporting(filepath.Join(cfg.DataDir, "namespace"), nsOpts, cfg.TestSupportedLayout); err != nil {
		return nil, err
	}
	s.nsState.SetLookupCacheBytes(cfg.LookupCacheBytes)
	s.metrics.lookupCache(reg, s.nsState.LookupCacheStats)
	s.metrics.storeStats(reg, "namespace", s.nsState.Store())
	s.metrics.storeStats(reg, "scm", s.scmState.Store())
	if err := s.openCA(sopts); err != nil {
		return nil, err
	}
	if s.ut, err = openUTState(filepath.Join(cfg.DataDir, "usertoken"), sopts, cfg.TestHiddenOps[UserTokenGroup]...); err != nil {
		return nil, err
	}
	if s.members, err = openMembersState(filepath.Join(cfg.DataDir, "members"), sopts); err != nil {
		return nil, err
	}
	if s.members.Removed(cfg.NodeID) {
		return nil, fmt.Errorf("meta: node %d was removed from the cluster (basalt admin meta remove); it may not run again under this ID: wipe %s and join as a new node with a new ID (basalt meta --join)", cfg.NodeID, cfg.DataDir)
	}
	s.members.changed = s.onMembersChanged
	if s.joined, s.initialVoters, err = bootMembership(cfg.FS, cfg.DataDir, cfg.NodeID, cfg.Join, peerIDs(s.peers), s.members.Get(cfg.NodeID) != nil); err != nil {
		return nil, err
	}
	// A node added later (basalt admin meta add) is in the member table,
	// not necessarily in its --peers.
	if _, ok := s.peers[cfg.NodeID]; !ok && len(s.peers) > 0 && !s.joined && s.members.Get(cfg.NodeID) == nil {
		return nil, fmt.Errorf("meta: node %d is not among the peers %v (nor in the member table: to add a node, start it with --join)", cfg.NodeID, peerIDs(s.peers))
	}
	// The log directory's entry is durable before anything is logged in it
	// (DataDir's own entry was synced when the stores created it).
	if err := cfg.FS.MkdirAll(filepath.Join(cfg.DataDir, "raft"), 0o755); err != nil {
		return nil, err
	}
	if err := vfs.SyncDir(cfg.FS, cfg.DataDir); err != nil {
		return nil, fmt.Errorf("meta: sync %s: %w", cfg.DataDir, err)
	}
	s.host, err = raft.NewHost(raft.HostConfig{
		ID: cfg.NodeID, LogDirs: []string{filepath.Join(cfg.DataDir, "raft")},
		ListenAddr: cfg.RaftAddr, Resolve: s.resolve, Security: s.raftSecurity(),
		TickInterval: cfg.TickInterval, ElectionTicks: cfg.ElectionTicks,
		Registerer: reg, Logger: cfg.Logger, FS: cfg.FS,
		LogReserveBytes: cfg.DiskReserveBytes, LogBallastBytes: cfg.BallastBytes,
		OnLogDirFailed: s.onLogDirFailed, // fail-stop (logdirfail.go)
	})
	if err != nil {
		return nil, fmt.Errorf("meta: raft host: %w", err)
	}
	if s.lis, err = net.Listen("tcp", cfg.GRPCAddr); err != nil {
		return nil, fmt.Errorf("meta: listen %s: %w", cfg.GRPCAddr, err)
	}
	s.peersMu.Lock()
	if p, ok := s.peers[cfg.NodeID]; ok || len(s.peers) == 0 || s.joined || s.members.Get(cfg.NodeID) != nil {
		p.RaftAddr, p.GRPCAddr = s.host.Addr(), s.lis.Addr().String()
		s.peers[cfg.NodeID] = p
	}
	s.peersMu.Unlock()

	scmCfg := cfg.SCM
	if scmCfg.Logger == nil {
		scmCfg.Logger = s.log
	}
	if scmCfg.Registerer == nil {
		scmCfg.Registerer = reg
	}
	s.scmMgr = scm.NewManager(scmCfg, s.scmState, &scmRaft{s: s})
	s.scmMgr.SetCacheResolver(nsCacheResolver{s: s})
	nsCfg := cfg.Namespace
	if nsCfg.Logger == nil {
		nsCfg.Logger = s.log
	}
	nsCfg.Tokens = s.scmMgr       // block tokens signed with the local SCM replica's keys
	nsCfg.Translate = s.translate // per-key errors of LookupKeys
	nsCfg.AwaitLayout = s.awaitLayout
	s.nsSvc = namespace.NewService(nsCfg, s.nsState, &nsRaft{s: s}, &scmBlocks{s: s})
	// A client certificate is optional at the TLS level only so that a new
	// node can present a bootstrap token (ca.go); authorize refuses every
	// other call without one.
	s.grpc = grpc.NewServer(cfg.TLS.GRPCServerOptionCertOptional(), grpc.ChainUnaryInterceptor(guard.UnaryServerInterceptor(reg, s.log), s.intercept), grpc.ChainStreamInterceptor(guard.StreamServerInterceptor(reg, s.log), s.streamAuth), grpc.MaxRecvMsgSize(cfg.MaxRecvMsgBytes),
		grpc.NumStreamWorkers(uint32(max(cfg.GRPCStreamWorkers, 0))))
	metapb.RegisterNamespaceServer(s.grpc, s.nsSvc)
	metapb.RegisterScmServer(s.grpc, &scmServer{s: s})
	metapb.RegisterCaServer(s.grpc, s.ca)
	metapb.RegisterUserTokenServer(s.grpc, &userTokenServer{s: s})
	metapb.RegisterMembersServer(s.grpc, &membersServer{s: s})
	s.setupUpgrade(reg)
	ok = true
	return s, nil
}

// raftSecurity authenticates the raft transport: only meta nodes among
// the peers, each under its own node ID.
func (s *Server) raftSecurity() *raft.Security {
	if s.cfg.TLS.IsInsecure() {
		return nil
	}
	return &raft.Security{
		Server: s.cfg.TLS.ServerTLS(pki.RoleMeta), Client: s.cfg.TLS.ClientTLS(pki.RoleMeta),
		Authenticate: pki.AuthenticateNodeID(pki.RoleMeta, func(id uint64) bool { _, ok := s.peer(id); return ok }),
		Watch:        s.cfg.TLS.Watch, // a revocation closes the peer's open connections
	}
}

func peerIDs(m map[uint64]Peer) []uint64 {
	ids := make([]uint64, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	return ids
}

// RaftAddr is the bound raft transport address.
func (s *Server) RaftAddr() string { return s.host.Addr() }

// GRPCAddr is the bound gRPC address.
func (s *Server) GRPCAddr() string { return s.lis.Addr().String() }

// SetPeer sets or updates a peer's addresses (e.g. after it restarted on
// another port).
func (s *Server) SetPeer(id uint64, p Peer) {
	s.peersMu.Lock()
	s.peers[id] = p
	s.peersMu.Unlock()
}

// peer is id's addresses: none if the member table says it was removed;
// else from Peers (and SetPeer: an operator's or a test's newer word), or
// from the member table for a node added later.
func (s *Server) peer(id uint64) (Peer, bool) {
	var m *metapb.MemberInfo
	if id != s.cfg.NodeID && s.members != nil {
		if m = s.members.Get(id); m.GetRemoved() {
			return Peer{}, false
		}
	}
	if p, ok := s.staticPeer(id); ok && (p.RaftAddr != "" || m == nil) {
		return p, true
	}
	if m != nil {
		return Peer{RaftAddr: m.GetRaftAddr(), GRPCAddr: m.GetGrpcAddr()}, true
	}
	return Peer{}, false
}

// staticPeer is id's addresses from Config.Peers and SetPeer only.
func (s *Server) staticPeer(id uint64) (Peer, bool) {
	s.peersMu.RLock()
	defer s.peersMu.RUnlock()
	p, ok := s.peers[id]
	return p, ok
}

// memberIDs are the members as this node knows them: Peers and the
// member table, less the removed.
func (s *Server) memberIDs() []uint64 {
	s.peersMu.RLock()
	ids := peerIDs(s.peers)
	s.peersMu.RUnlock()
	for _, m := range s.members.Table() {
		if !slices.Contains(ids, m.GetId()) {
			ids = append(ids, m.GetId())
		}
	}
	ids = slices.DeleteFunc(ids, func(id uint64) bool { return s.members.Removed(id) })
	slices.Sort(ids)
	return ids
}

func (s *Server) resolve(id uint64) (string, error) {
	p, ok := s.peer(id)
	if !ok || p.RaftAddr == "" {
		return "", fmt.Errorf("meta: no raft address for node %d", id)
	}
	return p.RaftAddr, nil
}

// Start joins (or creates) both groups, serves gRPC and starts the
// leader-side background loops.
func (s *Server) Start() error {
	// Only an initial member bootstraps a group it has no state in, and
	// with the initial voters; a node that joined waits for the leader
	// (members_marker.go).
	voters := s.initialVoters
	if s.joined {
		voters = nil
	}
	var err error
	if s.memGroup, err = s.host.AddGroup(raft.GroupConfig{ID: MembersGroup, Peers: voters, StateMachine: &raftSM{sm: s.members}}); err != nil {
		return fmt.Errorf("meta: members group: %w", err)
	}
	if s.nsGroup, err = s.host.AddGroup(raft.GroupConfig{ID: NamespaceGroup, Peers: voters, StateMachine: &raftSM{sm: s.nsState}}); err != nil {
		return fmt.Errorf("meta: namespace group: %w", err)
	}
	if s.scmGroup, err = s.host.AddGroup(raft.GroupConfig{ID: ScmGroup, Peers: voters, StateMachine: &raftSM{sm: s.scmState}}); err != nil {
		return fmt.Errorf("meta: scm group: %w", err)
	}
	if err := s.ca.start(voters); err != nil {
		return err
	}
	if s.utGroup, err = s.host.AddGroup(raft.GroupConfig{ID: UserTokenGroup, Peers: voters, StateMachine: &raftSM{sm: s.ut}}); err != nil {
		return fmt.Errorf("meta: user-token group: %w", err)
	}
	// Every member, this one too: SCM leadership can move here while a
	// forwarded call is in flight, and the others' hints then name this
	// node; without its address the call would wait out its deadline.
	if err := s.rebuildForwarder(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Add(12)
	go func() { defer s.wg.Done(); s.runMemberRecords(ctx) }()
	go func() { defer s.wg.Done(); s.runRevokeRemoved(ctx) }()
	go func() { defer s.wg.Done(); s.runUpgrade(ctx) }()
	go func() { defer s.wg.Done(); s.runRevocationPull(ctx) }()
	go func() { defer s.wg.Done(); s.ca.establish(ctx) }()
	go func() { defer s.wg.Done(); s.ca.renewOwn(ctx) }()
	go func() { defer s.wg.Done(); s.runUserTokens(ctx) }()
	go func() { defer s.wg.Done(); s.establishToken(ctx) }()
	go func() { defer s.wg.Done(); _ = s.grpc.Serve(s.lis) }()
	go func() { defer s.wg.Done(); s.scmMgr.Run(ctx) }()
	go func() { defer s.wg.Done(); s.nsSvc.Run(ctx) }()
	go func() { defer s.wg.Done(); s.colocate(ctx) }()
	return nil
}

// colocate moves SCM leadership to the namespace leader, so that the
// namespace leader's block allocations are in-process calls. Forwarding
// over gRPC covers the time in between.
func (s *Server) colocate(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			ns := s.nsGroup.Leader()
			// Not to a namespace leader whose SCM replica halted: it
			// would hand the leadership back (upgrade.go).
			if s.scmGroup.IsLeader() && ns != 0 && ns != s.cfg.NodeID && !s.peerHaltedIn(ctx, ns, "scm") {
				s.scmGroup.TransferLeader(ns)
			}
		}
	}
}

// Handler serves the metrics of the private registry (nil if a
// Registerer was configured: serve that one instead).
func (s *Server) Handler() http.Handler {
	if s.reg == nil {
		return nil
	}
	return promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{})
}

// NamespaceStatus and ScmStatus return the groups' raft status.
func (s *Server) NamespaceStatus() raft.Status { return s.nsGroup.Status() }

// ScmStatus returns the SCM group's raft status.
func (s *Server) ScmStatus() raft.Status { return s.scmGroup.Status() }

// Close stops serving and closes everything. In-flight calls get up to 2s.
func (s *Server) Close() error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	if s.cancel != nil {
		s.cancel()
	}
	if s.grpc != nil {
		done := make(chan struct{})
		go func() { s.grpc.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
			s.grpc.Stop()
		}
	}
	s.wg.Wait()
	return s.closeParts()
}

func (s *Server) closeParts() error {
	var errs []error
	s.fwdMu.Lock()
	s.fwdClosed = true
	if c := s.fwdp.Load(); c != nil {
		errs = append(errs, c.Close())
	}
	for _, c := range s.fwdOld {
		errs = append(errs, c.Close())
	}
	s.fwdMu.Unlock()
	if s.host != nil {
		errs = append(errs, s.host.Close())
	}
	if s.lis != nil && s.grpc == nil {
		s.lis.Close()
	}
	if s.nsState != nil {
		errs = append(errs, s.nsState.Close())
	}
	if s.scmState != nil {
		errs = append(errs, s.scmState.Close())
	}
	if s.ca != nil {
		errs = append(errs, s.ca.state.Close())
	}
	if s.ut != nil {
		errs = append(errs, s.ut.Close())
	}
	if s.members != nil {
		errs = append(errs, s.members.Close())
	}
	return errors.Join(errs...)
}

// ---------------------------------------------------------------- adapters

// stateMachine is what scm.State and namespace.State have in common.
type stateMachine interface {
	Apply([]store.Entry) []any
	AppliedIndex() uint64
	Snapshot() (uint64, io.ReadCloser, error)
	Restore(uint64, io.Reader) error
}

// raftSM adapts a metadata state machine to raft.StateMachine: the
// command is the entry's metadata; raft's own entries carry none.
type raftSM struct{ sm stateMachine }

func (r *raftSM) Apply(ents []raft.Entry) []any {
	in := make([]store.Entry, len(ents))
	for i, e := range ents {
		in[i].Index = e.Index
		if e.Kind == raft.EntryNormal {
			in[i].Cmd = e.Meta
			if in[i].Cmd == nil {
				in[i].Cmd = []byte{}
			}
		}
	}
	return r.sm.Apply(in)
}

func (r *raftSM) AppliedIndex() uint64                     { return r.sm.AppliedIndex() }
func (r *raftSM) Snapshot() (uint64, io.ReadCloser, error) { return r.sm.Snapshot() }
func (r *raftSM) Restore(index uint64, rd io.Reader) error { return r.sm.Restore(index, rd) }

func (s *Server) withTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.cfg.ProposeTimeout)
}

func propose(ctx context.Context, s *Server, g *raft.Group, cmd []byte) (any, error) {
	// Below the disk reserve nothing new goes into the log: Pebble (the
	// log store, the stores) cannot survive ENOSPC. What is in the log
	// still applies, in the reserve.
	if err := g.CheckLogSpace(len(cmd)); err != nil {
		return nil, status.Errorf(codes.ResourceExhausted, "meta node %d: disk full: %v; state-changing requests are refused until space is freed (reads keep working)", s.cfg.NodeID, err)
	}
	ctx, cancel := s.withTimeout(ctx)
	defer cancel()
	res, err := g.Propose(ctx, cmd, nil)
	if err != nil {
		return nil, err
	}
	return res.Value, nil
}

type nsRaft struct{ s *Server }

func (r *nsRaft) Propose(ctx context.Context, cmd []byte) (any, error) {
	return proposeUnlessHalted(ctx, r.s, r.s.nsGroup, cmd, r.s.haltedErr(), namespace.ErrHalted)
}

// proposeUnlessHalted proposes cmd unless halted (the group's halt on
// this replica) refuses it. A result of errHalted is outcome-unknown:
// this replica halted at or before the entry, which the others may well
// have applied (upgrade.go).
func proposeUnlessHalted(ctx context.Context, s *Server, g *raft.Group, cmd []byte, halted, errHalted error) (any, error) {
	if halted != nil {
		return nil, halted
	}
	res, err := propose(ctx, s, g, cmd)
	if errors.Is(err, errHalted) {
		err = fmt.Errorf("%w: %w", raft.ErrOutcomeUnknown, err)
	}
	return res, err
}

func (r *nsRaft) ReadBarrier(ctx context.Context) error {
	if err := r.s.haltedErr(); err != nil {
		return err
	}
	// Lookups answer with SCM's block locations from this replica.
	if err := r.s.scmHaltedErr(); err != nil {
		return err
	}
	g := r.s.nsGroup
	if !g.IsLeader() {
		return &raft.NotLeaderError{Group: NamespaceGroup, Leader: g.Leader()}
	}
	ctx, cancel := r.s.withTimeout(ctx)
	defer cancel()
	if err := g.ReadIndex(ctx); err != nil {
		return err
	}
	// Raft's read index passes a replica that halted meanwhile (its
	// applied index moves on, the state does not: upgrade.go).
	return r.s.haltedErr()
}

func (r *nsRaft) IsLeader() bool { return r.s.nsGroup != nil && r.s.nsGroup.IsLeader() }

type scmRaft struct{ s *Server }

func (r *scmRaft) Propose(ctx context.Context, cmd []byte) (any, error) {
	return proposeUnlessHalted(ctx, r.s, r.s.scmGroup, cmd, r.s.scmHaltedErr(), applyhalt.ErrHalted)
}

// scmHaltedErr refuses SCM reads and proposals on a replica whose SCM
// apply halted (upgrade.go).
func (s *Server) scmHaltedErr() error { return s.groupHaltedErr("scm", s.scmState.Halt()) }

// IsLeader: the SCM manager leads only where the group leads and its
// replica is not halted (a halted leader hands leadership over; until
// then its manager answers ErrNotLeader and proposes nothing).
func (r *scmRaft) IsLeader() bool {
	return r.s.scmGroup != nil && r.s.scmGroup.IsLeader() && r.s.scmState.Halt().Halted() == nil
}

// scmBlocks is SCM as the namespace service sees it.
type scmBlocks struct{ s *Server }

func (b *scmBlocks) AllocateBlocks(ctx context.Context, req *metapb.AllocateBlocksRequest) (*metapb.AllocateBlocksResponse, error) {
	if err := b.s.scmHaltedErr(); err != nil {
		return nil, err // the local SCM state stops at the halt (review drift 4)
	}
	if b.s.scmGroup.IsLeader() || b.s.fwd() == nil {
		return b.s.scmMgr.AllocateBlocks(ctx, req)
	}
	return b.s.fwd().Scm.AllocateBlocks(ctx, req)
}

func (b *scmBlocks) DeleteBlocks(ctx context.Context, req *metapb.DeleteBlocksRequest) error {
	if err := b.s.scmHaltedErr(); err != nil {
		return err // the local SCM state stops at the halt (review drift 4)
	}
	if b.s.scmGroup.IsLeader() || b.s.fwd() == nil {
		return b.s.scmMgr.DeleteBlocks(ctx, req)
	}
	_, err := b.s.fwd().Scm.DeleteBlocks(ctx, req)
	return err
}

func (b *scmBlocks) Locate(id uint64) (*metapb.Container, []*metapb.DatanodeDetails) {
	return b.s.scmState.ContainerReplicas(id)
}

// ---------------------------------------------------------------- errors

// intercept records metrics and turns "not the leader" errors into
// UNAVAILABLE with a NotLeader detail naming the leader's gRPC address.
func (s *Server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	ctx, err := s.authorize(ctx, info.FullMethod, req)
	if err != nil {
		s.metrics.observe(info.FullMethod, status.Code(err), time.Since(start))
		return nil, err
	}
	if err := s.checkServiceToken(ctx, info.FullMethod); err != nil {
		s.metrics.observe(info.FullMethod, status.Code(err), time.Since(start))
		return nil, err
	}
	resp, err := handler(ctx, req)
	if err != nil {
		err = s.translate(info.FullMethod, err)
	}
	s.metrics.observe(info.FullMethod, status.Code(err), time.Since(start))
	return resp, err
}

func (s *Server) translate(method string, err error) error {
	group, g := NamespaceGroup, s.nsGroup
	if serviceName(method) == "Scm" {
		group, g = ScmGroup, s.scmGroup
	}
	var nle *raft.NotLeaderError
	switch {
	case errors.Is(err, raft.ErrOutcomeUnknown) && !metaclient.RetrySafe(method):
		// The proposal reached the log and may still commit: never a
		// retryable NotLeader/Unavailable (checked first: it also wraps ctx errors).
		st, _ := status.Newf(codes.Unknown, "meta node %d: outcome unknown, the operation may or may not have been applied: %v", s.cfg.NodeID, err).
			WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonOutcomeUnknown, Domain: metapb.ReasonDomain})
		return st.Err()
	case errors.As(err, &nle), errors.Is(err, raft.ErrNotLeader), errors.Is(err, scm.ErrNotLeader),
		errors.Is(err, raft.ErrProposalDropped), errors.Is(err, raft.ErrStopped),
		// A call that is harmless to repeat (a second OpenKey leaves an
		// open key that expires) may be retried whatever happened to it.
		errors.Is(err, raft.ErrOutcomeUnknown):
		leader := uint64(0)
		if g != nil {
			leader = g.Leader()
		}
		if nle != nil && nle.Leader != 0 {
			leader = nle.Leader
		}
		nl := &metapb.NotLeader{GroupId: group}
		if leader != s.cfg.NodeID {
			nl.LeaderId = leader
			if p, ok := s.peer(leader); ok {
				nl.LeaderAddr = p.GRPCAddr
			}
		}
		st, _ := status.New(codes.Unavailable, fmt.Sprintf("meta node %d: %v", s.cfg.NodeID, err)).WithDetails(nl)
		return st.Err()
	case errors.Is(err, context.DeadlineExceeded):
		return status.Errorf(codes.DeadlineExceeded, "meta node %d: %v", s.cfg.NodeID, err)
	case errors.Is(err, context.Canceled):
		return status.Errorf(codes.Canceled, "meta node %d: %v", s.cfg.NodeID, err)
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(codes.Internal, "meta node %d: %v", s.cfg.NodeID, err)
}

func serviceName(method string) string {
	// "/basalt.meta.v1.Scm/Heartbeat" → "Scm"
	for i := len(method) - 1; i > 0; i-- {
		if method[i] == '/' {
			svc := method[1:i]
			for j := len(svc) - 1; j >= 0; j-- {
				if svc[j] == '.' {
					return svc[j+1:]
				}
			}
			return svc
		}
	}
	return method
}
