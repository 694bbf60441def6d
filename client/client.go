package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
)

// Defaults and limits of Config.
const (
	DefaultChunkSize         = 4 << 20
	DefaultBytesPerChecksum  = storage.DefaultBytesPerChecksum
	DefaultMaxBufferBytes    = 64 << 20
	DefaultMaxInflightChunks = 4
	// DefaultWaitAllTimeout bounds the wait for every replica of a
	// PutBlock / PutSmallFile: a slow or stopped follower delays a write
	// by at most this, then the pipeline and the laggards are excluded
	// and the data goes to a new block (Ozone's watch timeout).
	DefaultWaitAllTimeout = 3 * time.Second
	// DefaultSmallFilesInFlight is the default of Config.SmallFilesInFlight.
	DefaultSmallFilesInFlight = 1
	DefaultAllocateWait       = 15 * time.Second
	DefaultRPCTimeout         = 60 * time.Second
	DefaultMaxBlockRetries    = 5
	DefaultMaxMsgBytes        = 64 << 20
	// DefaultStreamThreshold is where auto switches from V1 to V2: seed
	// 000 keeps writes smaller than a chunk on V1, where one request does
	// what a stream needs a dial, a close and a sync on every datanode for.
	DefaultStreamThreshold = 4 << 20
	DefaultStreamTimeout   = 10 * time.Second

	// MaxChunkSize is the largest chunk a datanode stores (storage's hard
	// limit; datanodes refuse larger WriteChunks before they enter the
	// pipeline's log), well under the message limit.
	MaxChunkSize = storage.MaxChunkSize
	// MaxInflightChunksLimit bounds the concurrent WriteChunk calls of one
	// key.
	MaxInflightChunksLimit = 64
	// MaxStreamThreshold bounds StreamThreshold, which is also the size of
	// the look-ahead buffer an auto PutKey reads before choosing a path.
	MaxStreamThreshold = 64 << 20
	// maxListAll bounds the entries the List* helpers collect in memory.
	maxListAll = 1_000_000
)

// Config configures a Client. Zero values take the defaults noted.
type Config struct {
	// MetaAddrs are the gRPC addresses of the metadata service nodes.
	MetaAddrs []string
	// NoShortCircuit: never map a local datanode's cache file; read cached
	// blocks over gRPC too (shortcircuit.go, docs/CACHE.md).
	NoShortCircuit bool
	// Location is this client's network location ("/dc1/rack1"); the
	// services order replicas nearest first from it. "" = unknown.
	Location string
	// ChunkSize is the size of one WriteChunk (default 4 MiB); a multiple
	// of BytesPerChecksum, at most MaxChunkSize.
	ChunkSize int
	// BlockSize caps the block size (0 = the server's). Larger values than
	// the server's are lowered to it.
	BlockSize int64
	// BytesPerChecksum is the checksum window (default 64 KiB).
	BytesPerChecksum int
	// MaxBufferBytes bounds the data one PutKey holds that is not yet
	// committed on every replica (default 64 MiB, at least 2 chunks). The
	// writer blocks when it is reached.
	MaxBufferBytes int64
	// MaxInflightChunks bounds concurrent WriteChunk calls per key
	// (default 4).
	MaxInflightChunks int
	// FlushBytes: a PutBlock is sent every FlushBytes within a block so
	// buffers are released before the block ends (default MaxBufferBytes/4,
	// rounded to whole chunks).
	FlushBytes int64
	// WaitAllTimeout is how long a PutBlock waits for every replica
	// (default 3s); past it the datanode answers REPLICAS_LAG and the
	// client moves the data to another pipeline.
	WaitAllTimeout time.Duration
	// SmallFilesInFlight: small keys (one chunk) written at once to the
	// same pipeline leader are coalesced into PutSmallFiles calls, at most
	// this many in flight per datanode and pipeline (default 1); a lone
	// key still leaves at once. Negative: no coalescing (one PutSmallFile
	// call per key).
	SmallFilesInFlight int
	// ReserveBlocks: small keys (one chunk) are written to blocks the
	// client reserves ahead of need, per bucket, and committed with one
	// meta call instead of an open and a commit (issue 15); a
	// reservation asks for at most this many blocks (1..64, default
	// DefaultReserveBlocks; fewer while keys come slowly). Negative: every
	// key is opened. A server without reservations, or refusing them for
	// a bucket, gets its keys opened.
	ReserveBlocks int
	// AllocateWait bounds how long a write waits for the service to have
	// somewhere to put a block (no open pipeline yet after a start or a
	// failover, SCM in safe mode), retrying with jittered backoff
	// (default 15s).
	AllocateWait time.Duration
	// ExcludeFor is how long the whole client avoids a datanode, pipeline
	// or container that failed a write (default 10 minutes).
	ExcludeFor time.Duration
	// ProbeAfter and ProbeTimeout detect hung servers (metadata nodes and
	// datanodes): a call that has waited ProbeAfter makes the client
	// probe the server, and one that answers no probe within ProbeTimeout
	// is abandoned (defaults 1s and 1s; see metaclient.Prober).
	ProbeAfter, ProbeTimeout time.Duration
	// RPCTimeout bounds one datanode call (default 60s).
	RPCTimeout time.Duration
	// LeaderWait bounds the time spent finding a pipeline's leader
	// (elections in progress) before the pipeline is excluded (default
	// 10s).
	LeaderWait time.Duration
	// MaxBlockRetries bounds the block re-allocations of one key after
	// failures (default 5).
	MaxBlockRetries int
	// MaxMsgBytes is the gRPC message limit to datanodes (default 64 MiB).
	MaxMsgBytes int
	// MetaCallTimeout bounds one metadata call including retries (default
	// 30s, see metaclient).
	MetaCallTimeout time.Duration
	// Pipeline is the write path of PutKeys that do not choose one
	// (default PipelineAuto).
	Pipeline Pipeline
	// StreamThreshold: with PipelineAuto, keys shorter than this go
	// through V1, longer ones through V2 (default 4 MiB or MaxBufferBytes
	// if smaller; at most MaxStreamThreshold and MaxBufferBytes). PutKey
	// reads up to this many bytes ahead to decide, so the size need not be
	// known.
	StreamThreshold int64
	// StreamTimeout is the stall timeout of a V2 stream: a datanode that
	// makes no progress for this long is named and excluded (default 10s).
	StreamTimeout time.Duration
	// OnStream, if set, is called on the writing goroutine each time a V2
	// stream opens, before data goes to it: for tracing routes, and for
	// tests that fail a datanode at a chosen position of the chain. It
	// must not block.
	OnStream func(StreamInfo)
	// DialOptions are added to the datanode and meta connections.
	DialOptions []grpc.DialOption
	// Credentials are the client's certificate and the cluster CA
	// (LoadCredentials): every connection to the metadata service and to
	// datanodes (gRPC and V2 streams) is mutual TLS, and the servers are
	// checked to be meta nodes and datanodes of the cluster. Nil:
	// plaintext, which the servers of a secured cluster refuse.
	Credentials *pki.Credentials
	// AccessKey and SecretKey authenticate a client without Credentials:
	// it proves the S3 key to the metadata service and gets a user token
	// (renewed before it expires) that goes with every metadata call;
	// datanodes take its reads and writes on the block tokens the
	// metadata service returns. CACertFile is the cluster CA (ca.pem)
	// the servers' certificates are checked against (required with an
	// access key). Such a client writes through V1 (the stream port
	// takes members' certificates only). KeysFromEnv reads the keys from
	// the environment.
	AccessKey, SecretKey string
	CACertFile           string
	// ServiceToken is the cluster service token, sent to the metadata
	// service only (never to datanodes). Only callers of the S3 secret
	// RPCs need it: S3 gateways and admin tools.
	ServiceToken string
	// Logger receives retries, exclusions and corruption reports (default
	// slog.Default()).
	Logger *slog.Logger
}

func (c *Config) setDefaults() error {
	if len(c.MetaAddrs) == 0 {
		return errors.New("client: no meta addresses (Config.MetaAddrs)")
	}
	if c.ChunkSize == 0 {
		c.ChunkSize = DefaultChunkSize
	}
	if c.BytesPerChecksum == 0 {
		c.BytesPerChecksum = DefaultBytesPerChecksum
	}
	if c.BytesPerChecksum < 512 || c.BytesPerChecksum > storage.MaxBytesPerChecksum {
		return fmt.Errorf("client: BytesPerChecksum %d outside [512, %d]", c.BytesPerChecksum, storage.MaxBytesPerChecksum)
	}
	if c.ChunkSize < c.BytesPerChecksum || c.ChunkSize > MaxChunkSize || c.ChunkSize%c.BytesPerChecksum != 0 {
		return fmt.Errorf("client: ChunkSize %d must be a multiple of BytesPerChecksum %d and at most %d", c.ChunkSize, c.BytesPerChecksum, MaxChunkSize)
	}
	if c.BlockSize < 0 || (c.BlockSize > 0 && c.BlockSize < int64(c.ChunkSize)) {
		return fmt.Errorf("client: BlockSize %d must be 0 (the server's) or at least ChunkSize %d", c.BlockSize, c.ChunkSize)
	}
	if c.MaxBufferBytes == 0 {
		c.MaxBufferBytes = DefaultMaxBufferBytes
	}
	if c.MaxBufferBytes < 2*int64(c.ChunkSize) {
		return fmt.Errorf("client: MaxBufferBytes %d is less than two chunks of %d", c.MaxBufferBytes, c.ChunkSize)
	}
	if c.MaxInflightChunks == 0 {
		c.MaxInflightChunks = DefaultMaxInflightChunks
	}
	if c.MaxInflightChunks < 1 || c.MaxInflightChunks > MaxInflightChunksLimit {
		return fmt.Errorf("client: MaxInflightChunks %d outside [1, %d]", c.MaxInflightChunks, MaxInflightChunksLimit)
	}
	if c.FlushBytes == 0 {
		c.FlushBytes = c.MaxBufferBytes / 4
	}
	// Whole chunks, at least one, and at most half the pool so that the
	// writer can fill the next segment while one PutBlock is in flight.
	c.FlushBytes = max(c.FlushBytes/int64(c.ChunkSize), 1) * int64(c.ChunkSize)
	c.FlushBytes = min(c.FlushBytes, max(c.MaxBufferBytes/2/int64(c.ChunkSize), 1)*int64(c.ChunkSize))
	if c.WaitAllTimeout == 0 {
		c.WaitAllTimeout = DefaultWaitAllTimeout
	}
	if c.SmallFilesInFlight == 0 {
		c.SmallFilesInFlight = DefaultSmallFilesInFlight
	}
	if c.ReserveBlocks == 0 {
		c.ReserveBlocks = DefaultReserveBlocks
	}
	c.ReserveBlocks = min(c.ReserveBlocks, 64)
	if c.RPCTimeout == 0 {
		c.RPCTimeout = DefaultRPCTimeout
	}
	if c.AllocateWait == 0 {
		c.AllocateWait = DefaultAllocateWait
	}
	if c.ExcludeFor == 0 {
		c.ExcludeFor = DefaultExcludeFor
	}
	if c.LeaderWait == 0 {
		c.LeaderWait = 10 * time.Second
	}
	if c.MaxBlockRetries == 0 {
		c.MaxBlockRetries = DefaultMaxBlockRetries
	}
	if c.MaxBlockRetries < 0 || c.MaxBlockRetries > 100 {
		return fmt.Errorf("client: MaxBlockRetries %d outside [0, 100]", c.MaxBlockRetries)
	}
	if c.MaxMsgBytes == 0 {
		c.MaxMsgBytes = DefaultMaxMsgBytes
	}
	if c.MaxMsgBytes < c.ChunkSize+(1<<20) {
		return fmt.Errorf("client: MaxMsgBytes %d must exceed ChunkSize %d by at least 1 MiB", c.MaxMsgBytes, c.ChunkSize)
	}
	if c.AccessKey != "" && c.Credentials != nil {
		return errors.New("client: give Credentials (a client certificate) or an access key, not both")
	}
	if c.AccessKey != "" && (c.SecretKey == "" || c.CACertFile == "") {
		return fmt.Errorf("client: access key %s needs its secret key and the cluster CA certificate (CACertFile)", c.AccessKey)
	}
	if c.AccessKey != "" && c.Pipeline == PipelineV2 {
		return errors.New("client: Pipeline v2 needs a client certificate (the stream port takes members' certificates only); with an access key use auto or v1")
	}
	switch c.Pipeline {
	case PipelineDefault:
		c.Pipeline = PipelineAuto
	case PipelineAuto, PipelineV1, PipelineV2:
	default:
		return fmt.Errorf("client: Pipeline %d: want auto, v1 or v2", c.Pipeline)
	}
	// The look-ahead counts against the buffer bound: the data read but
	// not committed stays within MaxBufferBytes (plus a chunk) on both
	// paths.
	if c.StreamThreshold == 0 {
		c.StreamThreshold = min(DefaultStreamThreshold, c.MaxBufferBytes)
	}
	if hi := min(MaxStreamThreshold, c.MaxBufferBytes); c.StreamThreshold < 1 || c.StreamThreshold > hi {
		return fmt.Errorf("client: StreamThreshold %d outside [1, %d] (at most MaxStreamThreshold and MaxBufferBytes)", c.StreamThreshold, hi)
	}
	if c.StreamTimeout == 0 {
		c.StreamTimeout = DefaultStreamTimeout
	}
	if c.StreamTimeout < 0 {
		return fmt.Errorf("client: StreamTimeout %v is negative", c.StreamTimeout)
	}
	if c.MetaCallTimeout == 0 {
		c.MetaCallTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Client is safe for concurrent use. Connections to the metadata service
// and to datanodes are persistent and shared by all calls.
type Client struct {
	cfg  Config
	meta *metaclient.Client
	ns   metapb.NamespaceClient
	scm  metapb.ScmClient
	dns  *dnPool
	sc   shortCircuits // mapped cache files of local datanodes (shortcircuit.go)
	log  *slog.Logger
	// streamTLS authenticates V2 streams (nil: plaintext).
	streamTLS *tls.Config
	// streamWatch watches a stream's first hop for the revocation of the
	// datanode's certificate (the credentials' revoked set, when an agent
	// keeps it; nil without credentials).
	streamWatch func(net.Conn, *tls.ConnectionState) func()
	// streamPool keeps V2 stream connections between blocks of the same
	// route (stream.ConnPool): a clean close hands the connection back,
	// the next block's stream on that route takes it.
	streamPool *stream.ConnPool
	// streamStaleRetries counts V2 segments written again after a
	// stream.CodeStale failure (StreamStaleRetries).
	streamStaleRetries atomic.Uint64
	// streamV4, streamDowngrades: StreamVersionStats.
	streamV4, streamDowngrades atomic.Uint64
	// oldStreamMu guards oldStream: datanodes that refused stream
	// protocol 5 as a version 4 datanode does, though registered as 5
	// (routeVersion), and when.
	oldStreamMu sync.Mutex
	oldStream   map[uint64]time.Time
	// noStreams: the client has no certificate (an access key), so it
	// writes through V1 only.
	noStreams bool
	// readAhead bounds the read-ahead pieces of all this client's readers
	// together (WriteRange; nil: no bound beyond each reader's).
	readAhead chan struct{}

	leadersMu sync.Mutex
	leaders   map[uint64]string // pipeline ID → leader address last seen

	small smallFiles // PutSmallFiles coalescing (smallbatch.go)

	excl   *sharedExclude     // client-wide exclude list
	prober *metaclient.Prober // hung datanodes

	// reportCorrupt tells SCM that a replica failed checksum verification.
	// Until metapb has ReportCorruptReplica it only logs; wire the RPC here.
	reportCorrupt func(ctx context.Context, r CorruptReport) error
}

// CorruptReport is what a reader tells SCM about a replica whose data did
// not match its checksums.
type CorruptReport struct {
	ContainerID, LocalID uint64
	DatanodeID           uint64
	DatanodeAddr         string
	Reason               string
}

// New returns a client. It does not contact any server: connections are
// made on first use, so New works with addresses alone.
func New(cfg Config) (*Client, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	metaOpts, dnOpts := cfg.DialOptions, cfg.DialOptions
	if cfg.Credentials != nil {
		metaOpts = append([]grpc.DialOption{cfg.Credentials.GRPCDialOption(pki.RoleMeta)}, cfg.DialOptions...)
		dnOpts = append([]grpc.DialOption{cfg.Credentials.GRPCDialOption(pki.RoleDatanode)}, cfg.DialOptions...)
	} else if cfg.AccessKey != "" {
		mo, err := pki.LoadCAOnlyDialOption(cfg.CACertFile, pki.RoleMeta)
		if err != nil {
			return nil, fmt.Errorf("client: %w", err)
		}
		do, _ := pki.LoadCAOnlyDialOption(cfg.CACertFile, pki.RoleDatanode)
		metaOpts = append([]grpc.DialOption{mo}, cfg.DialOptions...)
		dnOpts = append([]grpc.DialOption{do}, cfg.DialOptions...)
	}
	mc, err := metaclient.New(metaclient.Config{Addrs: cfg.MetaAddrs, CallTimeout: cfg.MetaCallTimeout, DialOptions: metaOpts,
		ServiceToken: cfg.ServiceToken, ProbeAfter: cfg.ProbeAfter, ProbeTimeout: cfg.ProbeTimeout,
		AccessKey: cfg.AccessKey, SecretKey: cfg.SecretKey})
	if err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	c := &Client{
		cfg: cfg, meta: mc, ns: mc.Namespace, scm: mc.Scm, log: cfg.Logger,
		dns:        newDNPool(cfg.MaxMsgBytes, dnOpts),
		leaders:    map[uint64]string{},
		excl:       newSharedExclude(cfg.ExcludeFor),
		readAhead:  make(chan struct{}, max(maxReadAheadBytes/cfg.ChunkSize, cfg.MaxInflightChunks, 1)),
		prober:     metaclient.NewProber(metaclient.ProberConfig{ProbeAfter: cfg.ProbeAfter, ProbeTimeout: cfg.ProbeTimeout}),
		noStreams:  cfg.AccessKey != "",
		streamPool: stream.NewConnPool(0, 0),
	}
	if cfg.Credentials != nil && !cfg.Credentials.IsInsecure() {
		c.streamTLS = cfg.Credentials.ClientTLS(pki.RoleDatanode)
		c.streamWatch = cfg.Credentials.Watch
	}
	c.reportCorrupt = func(ctx context.Context, r CorruptReport) error {
		c.log.Warn("basalt client: corrupt replica, reporting to SCM",
			"container", r.ContainerID, "local_id", r.LocalID, "datanode", r.DatanodeID, "addr", r.DatanodeAddr, "reason", r.Reason)
		_, err := c.scm.ReportCorruptReplica(ctx, &metapb.ReportCorruptReplicaRequest{
			Block:      &metapb.BlockID{ContainerId: r.ContainerID, LocalId: r.LocalID},
			DatanodeId: r.DatanodeID, Reason: r.Reason,
		})
		return err
	}
	return c, nil
}

// Config returns the configuration in effect (defaults filled in).
func (c *Client) Config() Config { return c.cfg }

// Close closes every connection. Calls in progress fail.
func (c *Client) Close() error {
	c.sc.close()
	if c.streamPool != nil {
		c.streamPool.Close()
	}
	return errors.Join(c.meta.Close(), c.dns.close())
}

// StreamPoolStats returns the counters of the client's pool of V2 stream
// connections.
func (c *Client) StreamPoolStats() stream.PoolStats { return c.streamPool.Stats() }

// StreamStaleRetries is how many V2 segments were written again, as a new
// block on new connections and without excluding any datanode, because a
// kept stream connection (the client's, or a datanode's to the next) ended
// before the stream's header was answered: a datanode that closed it idle
// as the header crossed (stream.CodeStale; at most once per segment and
// once per datanode named per key). A Go method, like StreamPoolStats:
// the client has no metrics registry.
func (c *Client) StreamStaleRetries() uint64 { return c.streamStaleRetries.Load() }

// StreamVersionStats counts the V2 streams this client opened at stream
// protocol version 4 (a route with a datanode of the previous release on
// it: while it counts, a rolling upgrade is not finished), and of those
// the downgraded ones: the route's datanodes all advertised version 5
// but one refused it as a version 4 datanode does (an old binary under a
// registration not yet updated), so the stream was opened again at 4
// (stream.Options.Version), blaming nobody.
func (c *Client) StreamVersionStats() (v4, downgraded uint64) {
	return c.streamV4.Load(), c.streamDowngrades.Load()
}

// Scm returns the SCM admin API (datanodes, pipelines, containers) for
// operator tools.
func (c *Client) Scm() metapb.ScmClient { return c.scm }

// Namespace returns the raw namespace API for tools that need more than
// this package offers.
func (c *Client) Namespace() metapb.NamespaceClient { return c.ns }

// UserTokens is the metadata service's user-token API (gateways issuing
// WebHDFS delegation tokens).
func (c *Client) UserTokens() metapb.UserTokenClient { return c.meta.UserToken }

// ---------------------------------------------------------------- types

// Replication is a key's or bucket's replication factor.
type Replication uint8

const (
	ReplicationDefault Replication = 0 // the bucket's (buckets: THREE)
	ReplicationOne     Replication = 1
	ReplicationThree   Replication = 3
)

func (r Replication) String() string {
	switch r {
	case ReplicationDefault:
		return "default"
	case ReplicationOne:
		return "ONE"
	case ReplicationThree:
		return "THREE"
	}
	return fmt.Sprintf("Replication(%d)", uint8(r))
}

func (r Replication) pb() metapb.Replication {
	switch r {
	case ReplicationOne:
		return metapb.Replication_ONE
	case ReplicationThree:
		return metapb.Replication_THREE
	}
	return metapb.Replication_REPLICATION_UNSPECIFIED
}

func replicationOf(r metapb.Replication) Replication {
	switch r {
	case metapb.Replication_ONE:
		return ReplicationOne
	case metapb.Replication_THREE:
		return ReplicationThree
	}
	return ReplicationDefault
}

// ParseReplication accepts "1", "3", "ONE", "THREE" (any case) and "".
func ParseReplication(s string) (Replication, error) {
	switch s {
	case "":
		return ReplicationDefault, nil
	case "1", "ONE", "one":
		return ReplicationOne, nil
	case "3", "THREE", "three":
		return ReplicationThree, nil
	}
	return 0, invalidf("parse replication", "replication %q: want 1 or 3 (ONE or THREE)", s)
}

// Pipeline is a write path (seed 000).
type Pipeline uint8

const (
	// PipelineDefault: for PutOptions, the client's Config.Pipeline; for
	// Config, PipelineAuto.
	PipelineDefault Pipeline = iota
	// PipelineAuto: V1 for keys shorter than Config.StreamThreshold, V2
	// for the rest (V1 also when the datanodes serve no streams).
	PipelineAuto
	// PipelineV1: chunks through the pipeline's Raft leader.
	PipelineV1
	// PipelineV2: a stream through the chain of datanodes, nearest first,
	// then one PutBlock through Raft per segment.
	PipelineV2
)

func (p Pipeline) String() string {
	switch p {
	case PipelineDefault:
		return "default"
	case PipelineAuto:
		return "auto"
	case PipelineV1:
		return "v1"
	case PipelineV2:
		return "v2"
	}
	return fmt.Sprintf("Pipeline(%d)", uint8(p))
}

// ParsePipeline accepts "auto", "v1", "v2" (any case) and "" (default).
func ParsePipeline(s string) (Pipeline, error) {
	switch s {
	case "":
		return PipelineDefault, nil
	case "auto", "AUTO":
		return PipelineAuto, nil
	case "v1", "V1":
		return PipelineV1, nil
	case "v2", "V2":
		return PipelineV2, nil
	}
	return 0, invalidf("parse pipeline", "pipeline %q: want auto, v1 or v2", s)
}

// Layout is a bucket's layout.
type Layout uint8

const (
	LayoutDefault Layout = 0 // OBJECT
	LayoutObject  Layout = 1 // flat keys; "/" is an ordinary character
	LayoutFS      Layout = 2 // a directory tree
)

func (l Layout) String() string {
	switch l {
	case LayoutDefault:
		return "default"
	case LayoutObject:
		return "OBJECT"
	case LayoutFS:
		return "FS"
	}
	return fmt.Sprintf("Layout(%d)", uint8(l))
}

// ParseLayout accepts "object", "obs", "fs", "fso" (any case) and "".
func ParseLayout(s string) (Layout, error) {
	switch s {
	case "":
		return LayoutDefault, nil
	case "object", "OBJECT", "obs", "OBS":
		return LayoutObject, nil
	case "fs", "FS", "fso", "FSO":
		return LayoutFS, nil
	}
	return 0, invalidf("parse layout", "layout %q: want object or fs", s)
}

// Volume is a volume's metadata.
type Volume struct {
	Name    string    `json:"name"`
	Owner   string    `json:"owner,omitempty"`
	Created time.Time `json:"created"`
	// Attrs are its Hadoop-style attributes (nil: none recorded).
	Attrs *metapb.FileAttrs `json:"attrs,omitempty"`
}

// Bucket is a bucket's metadata.
type Bucket struct {
	Volume      string      `json:"volume"`
	Name        string      `json:"name"`
	ID          uint64      `json:"id"`
	Layout      Layout      `json:"-"`
	Replication Replication `json:"-"`
	Created     time.Time   `json:"created"`
	// For JSON: readable names.
	LayoutName      string `json:"layout"`
	ReplicationName string `json:"replication"`
	// Attrs are its Hadoop-style attributes (nil: none recorded).
	Attrs *metapb.FileAttrs `json:"attrs,omitempty"`
}

func unixMs(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms).UTC()
}

func volumeOf(v *metapb.Volume) Volume {
	return Volume{Name: v.Name, Owner: v.Owner, Created: unixMs(v.CreatedUnixMs), Attrs: v.Attrs}
}

func bucketOf(b *metapb.Bucket) Bucket {
	l := Layout(b.Layout)
	r := replicationOf(b.Replication)
	return Bucket{Volume: b.Volume, Name: b.Name, ID: b.Id, Layout: l, Replication: r,
		Created: unixMs(b.CreatedUnixMs), LayoutName: l.String(), ReplicationName: r.String(), Attrs: b.Attrs}
}

// ListOptions selects a range of names.
type ListOptions struct {
	Prefix     string
	StartAfter string
	// PageSize is the entries per server call (0 = the server's default).
	PageSize int
	// Limit bounds the entries returned (0 = all, capped at one million).
	Limit int
}

func (o ListOptions) limit() int {
	if o.Limit <= 0 || o.Limit > maxListAll {
		return maxListAll
	}
	return o.Limit
}

func pageSize(n int) uint32 {
	if n <= 0 {
		return 0
	}
	return uint32(min(n, 10000))
}

// ---------------------------------------------------------------- volumes

// CreateVolume creates a volume. owner may be "".
func (c *Client) CreateVolume(ctx context.Context, name, owner string) (Volume, error) {
	v, err := c.ns.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: name, Owner: owner})
	if err != nil {
		return Volume{}, wrapErr(fmt.Sprintf("create volume %q", name), err)
	}
	return volumeOf(v), nil
}

// VolumeInfo returns a volume's metadata.
func (c *Client) VolumeInfo(ctx context.Context, name string) (Volume, error) {
	v, err := c.ns.GetVolume(ctx, &metapb.GetVolumeRequest{Name: name})
	if err != nil {
		return Volume{}, wrapErr(fmt.Sprintf("volume info %q", name), err)
	}
	return volumeOf(v), nil
}

// ListVolumes pages through the volumes matching o.
func (c *Client) ListVolumes(ctx context.Context, o ListOptions) ([]Volume, error) {
	var out []Volume
	after := o.StartAfter
	for len(out) < o.limit() {
		r, err := c.ns.ListVolumes(ctx, &metapb.ListVolumesRequest{Prefix: o.Prefix, StartAfter: after, PageSize: pageSize(o.PageSize)})
		if err != nil {
			return out, wrapErr("list volumes", err)
		}
		for _, v := range r.Volumes {
			out = append(out, volumeOf(v))
		}
		if !r.Truncated || len(r.Volumes) == 0 {
			break
		}
		after = r.Volumes[len(r.Volumes)-1].Name
	}
	return out[:min(len(out), o.limit())], nil
}

// DeleteVolume deletes an empty volume.
func (c *Client) DeleteVolume(ctx context.Context, name string) error {
	_, err := c.ns.DeleteVolume(ctx, &metapb.DeleteVolumeRequest{Name: name})
	return wrapErr(fmt.Sprintf("delete volume %q", name), err)
}

// ---------------------------------------------------------------- buckets

// BucketOptions are the settings of a new bucket.
type BucketOptions struct {
	Layout      Layout      // default OBJECT
	Replication Replication // default THREE
	Attrs       *metapb.FileAttrs
}

// CreateBucket creates a bucket in a volume.
func (c *Client) CreateBucket(ctx context.Context, volume, name string, o BucketOptions) (Bucket, error) {
	b, err := c.ns.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: volume, Name: name,
		Layout: metapb.BucketLayout(o.Layout), Replication: o.Replication.pb(), Attrs: o.Attrs})
	if err != nil {
		return Bucket{}, wrapErr(fmt.Sprintf("create bucket /%s/%s", volume, name), err)
	}
	return bucketOf(b), nil
}

// BucketInfo returns a bucket's metadata.
func (c *Client) BucketInfo(ctx context.Context, volume, name string) (Bucket, error) {
	b, err := c.ns.GetBucket(ctx, &metapb.GetBucketRequest{Volume: volume, Name: name})
	if err != nil {
		return Bucket{}, wrapErr(fmt.Sprintf("bucket info /%s/%s", volume, name), err)
	}
	return bucketOf(b), nil
}

// ListBuckets pages through a volume's buckets matching o.
func (c *Client) ListBuckets(ctx context.Context, volume string, o ListOptions) ([]Bucket, error) {
	var out []Bucket
	after := o.StartAfter
	for len(out) < o.limit() {
		r, err := c.ns.ListBuckets(ctx, &metapb.ListBucketsRequest{Volume: volume, Prefix: o.Prefix, StartAfter: after, PageSize: pageSize(o.PageSize)})
		if err != nil {
			return out, wrapErr(fmt.Sprintf("list buckets of volume %q", volume), err)
		}
		for _, b := range r.Buckets {
			out = append(out, bucketOf(b))
		}
		if !r.Truncated || len(r.Buckets) == 0 {
			break
		}
		after = r.Buckets[len(r.Buckets)-1].Name
	}
	return out[:min(len(out), o.limit())], nil
}

// DeleteBucket deletes an empty bucket.
func (c *Client) DeleteBucket(ctx context.Context, volume, name string) error {
	_, err := c.ns.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: volume, Name: name})
	return wrapErr(fmt.Sprintf("delete bucket /%s/%s", volume, name), err)
}

// KeysFromEnv returns the S3 keys in the environment: BASALT_ACCESS_KEY
// and BASALT_SECRET_KEY, else AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.
func KeysFromEnv() (accessKey, secretKey string) {
	if a := os.Getenv("BASALT_ACCESS_KEY"); a != "" {
		return a, os.Getenv("BASALT_SECRET_KEY")
	}
	return os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY")
}

// LoadCredentials reads a TLS directory (ca.pem, cert.pem, key.pem; see
// `basalt admin ca issue`) for Config.Credentials.
func LoadCredentials(dir string) (*pki.Credentials, error) { return pki.Load(dir) }
