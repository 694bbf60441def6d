package namespace

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/topology"
)

// Raft is the namespace group as the service needs it.
type Raft interface {
	// Propose replicates cmd and returns Apply's result on this replica.
	Propose(ctx context.Context, cmd []byte) (any, error)
	// ReadBarrier returns once this replica has applied everything
	// committed before the call, as confirmed by the leader (ReadIndex);
	// it fails on a replica that is not the leader.
	ReadBarrier(ctx context.Context) error
	// IsLeader reports whether this replica leads the group.
	IsLeader() bool
}

// Blocks is SCM as the namespace needs it: in-process when the local SCM
// replica leads, over gRPC to the SCM leader otherwise.
type Blocks interface {
	AllocateBlocks(ctx context.Context, req *metapb.AllocateBlocksRequest) (*metapb.AllocateBlocksResponse, error)
	DeleteBlocks(ctx context.Context, req *metapb.DeleteBlocksRequest) error
	// Locate returns containers and their replicas from the local SCM
	// replica (container placement changes rarely; a slightly stale answer
	// only costs the reader a retry on another replica).
	Locate(containerID uint64) (*metapb.Container, []*metapb.DatanodeDetails)
}

// Config holds the namespace tunables. Zero values take the defaults noted.
type Config struct {
	OpenKeyExpiry   time.Duration // uncommitted keys older than this are reclaimed (default 24h)
	ServiceInterval time.Duration // background services period (default 1s)
	// Batch limits of the background services.
	DeleteBatchRows int // deleted rows handed to SCM per batch (default 1000)
	// DeleteBatchesPerRound bounds the batches one round hands over (default
	// 64): deletion must keep up with writes (a bench writes ~1,000 small
	// keys/s and deletes them as fast), or the disks fill with garbage.
	DeleteBatchesPerRound   int
	ExpireBatch             int    // open keys expired per round (default 1000)
	ReclaimBatch            int    // children of a deleted directory reclaimed per command (default 1000)
	DefaultBytesPerChecksum uint32 // default 64 KiB
	Now                     func() time.Time
	Logger                  *slog.Logger

	// UploadExpiry: incomplete multipart uploads older than this are
	// aborted and their parts' blocks reclaimed, as S3's lifecycle rule
	// AbortIncompleteMultipartUpload (default 7 days; negative: never).
	UploadExpiry time.Duration

	// ReservationExpiry: block reservations (reserve.go) older than this
	// are reclaimed (default DefaultReservationExpiry).
	ReservationExpiry time.Duration

	// Tokens signs the block token of every location returned (tokens.go;
	// nil: locations carry none).
	Tokens TokenIssuer

	// Translate, when set, turns an error of method into the status the
	// server's interceptor would return for it (the meta server's
	// translate); LookupKeys applies it to each key's error.
	Translate func(method string, err error) error
	// AwaitLayout (the meta server) records a fresh cluster's layout
	// version; the first write of a fresh namespace whose layout is not
	// recorded yet waits for it (checkLayout), so that no early write
	// makes the new cluster look used and leaves it at layout 1.
	AwaitLayout func(ctx context.Context)
}

func (c *Config) setDefaults() {
	if c.OpenKeyExpiry == 0 {
		c.OpenKeyExpiry = 24 * time.Hour
	}
	if c.ReservationExpiry == 0 {
		c.ReservationExpiry = DefaultReservationExpiry
	}
	if c.UploadExpiry == 0 {
		c.UploadExpiry = DefaultUploadExpiry
	}
	if c.ServiceInterval == 0 {
		c.ServiceInterval = time.Second
	}
	if c.DeleteBatchRows == 0 {
		c.DeleteBatchRows = 1000
	}
	if c.DeleteBatchesPerRound == 0 {
		c.DeleteBatchesPerRound = 64
	}
	if c.ExpireBatch == 0 {
		c.ExpireBatch = 1000
	}
	if c.ReclaimBatch == 0 {
		c.ReclaimBatch = 1000
	}
	if c.DefaultBytesPerChecksum == 0 {
		c.DefaultBytesPerChecksum = 64 << 10
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Service is the namespace manager's gRPC service on one replica.
type Service struct {
	metapb.UnimplementedNamespaceServer
	cfg    Config
	st     *State
	raft   Raft
	blocks Blocks

	uploadScan  uploadScan  // leader-only progress of the upload expiry
	reserveScan reserveScan // leader-only progress of the reservations' expiry
	pols        policyCache // parsed bucket policies (acl.go)
}

// NewService returns the service over st.
func NewService(cfg Config, st *State, r Raft, b Blocks) *Service {
	cfg.setDefaults()
	return &Service{cfg: cfg, st: st, raft: r, blocks: b, reserveScan: reserveScan{rows: reserveScanRows}}
}

// current is the read barrier a write takes before it authorizes and
// validates: this node's applied state can lag what is committed (a
// leader elected a moment ago), and a stale one refuses what exists or
// grants what a newer ACL or policy denies.
func (s *Service) current(ctx context.Context) error { return s.raft.ReadBarrier(ctx) }

// checkLayout refuses, before the log and before any allocation, a
// command whose op needs a layout above the finalized one (layout.go).
// On a fresh namespace whose layout is not recorded yet it first waits
// for the record (Config.AwaitLayout; one atomic load once recorded).
func (s *Service) checkLayout(ctx context.Context, cmd *metapb.NsCommand) error {
	if s.cfg.AwaitLayout != nil && !s.st.LayoutRecorded() && s.st.layout.fresh.Load() {
		s.cfg.AwaitLayout(ctx)
	}
	return s.st.CheckLayout(cmd)
}

func (s *Service) propose(ctx context.Context, cmd *metapb.NsCommand) (any, error) {
	if err := s.checkLayout(ctx, cmd); err != nil {
		return nil, err
	}
	cmd.NowUnixMs = s.cfg.Now().UnixMilli()
	b, err := proto.Marshal(cmd)
	if err != nil {
		return nil, err
	}
	return s.raft.Propose(ctx, b)
}

// ---- volumes and buckets

func (s *Service) CreateVolume(ctx context.Context, req *metapb.CreateVolumeRequest) (*metapb.Volume, error) {
	if err := ValidateBucketName("volume", req.Name); err != nil {
		return nil, err
	}
	req = proto.Clone(req).(*metapb.CreateVolumeRequest)
	if err := s.authz(ctx).CreateVolume(req); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CreateVolume{CreateVolume: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.Volume), nil
}

func (s *Service) GetVolume(ctx context.Context, req *metapb.GetVolumeRequest) (*metapb.Volume, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	v, err := s.st.GetVolume(req.Name)
	if err != nil {
		return nil, err
	}
	return s.volumeForCaller(ctx, v), nil
}

func (s *Service) ListVolumes(ctx context.Context, req *metapb.ListVolumesRequest) (*metapb.ListVolumesResponse, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	r, err := s.st.ListVolumes(req)
	if err != nil {
		return nil, err
	}
	for i, v := range r.Volumes {
		r.Volumes[i] = s.volumeForCaller(ctx, v)
	}
	return r, nil
}

func (s *Service) DeleteVolume(ctx context.Context, req *metapb.DeleteVolumeRequest) (*metapb.DeleteVolumeResponse, error) {
	if err := checkNameBound("volume", req.Name, 63); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Admin("delete volume " + req.Name); err != nil {
		return nil, err
	}
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_DeleteVolume{DeleteVolume: req}}); err != nil {
		return nil, err
	}
	return &metapb.DeleteVolumeResponse{}, nil
}

func (s *Service) CreateBucket(ctx context.Context, req *metapb.CreateBucketRequest) (*metapb.Bucket, error) {
	if err := ValidateBucketName("bucket", req.Name); err != nil {
		return nil, err
	}
	if err := checkCreateBucket(req); err != nil {
		return nil, err
	}
	if err := validateAcls(req.Acls, "create bucket "+req.Name); err != nil {
		return nil, err
	}
	if req.GetPublicAccessBlock().GetBlockPublicAcls() && publicAcl(req.Acls) {
		return nil, status.Errorf(codes.PermissionDenied, "create bucket %q: its Block Public Access settings block public ACLs, and its ACL has WORLD or ANONYMOUS entries", req.Name)
	}
	req = proto.Clone(req).(*metapb.CreateBucketRequest)
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).CreateBucket(req); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CreateBucket{CreateBucket: req}})
	if err != nil {
		return nil, err
	}
	b := proto.Clone(r.(*metapb.Bucket)).(*metapb.Bucket)
	publicBucket(b)
	return b, nil
}

func (s *Service) GetBucket(ctx context.Context, req *metapb.GetBucketRequest) (*metapb.Bucket, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	b, err := s.st.GetBucket(req.Volume, req.Name)
	if err != nil {
		return nil, err
	}
	publicBucket(b)
	s.hideBucketAcl(ctx, b)
	return b, nil
}

func (s *Service) ListBuckets(ctx context.Context, req *metapb.ListBucketsRequest) (*metapb.ListBucketsResponse, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	r, err := s.st.ListBuckets(req)
	if err != nil {
		return nil, err
	}
	for _, b := range r.Buckets {
		publicBucket(b)
		s.hideBucketAcl(ctx, b)
	}
	return r, nil
}

func (s *Service) DeleteBucket(ctx context.Context, req *metapb.DeleteBucketRequest) (*metapb.DeleteBucketResponse, error) {
	if err := checkBucketRef(req.Volume, req.Name); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).DeleteBucket(req.Volume, req.Name); err != nil {
		return nil, err
	}
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_DeleteBucket{DeleteBucket: req}}); err != nil {
		return nil, err
	}
	return &metapb.DeleteBucketResponse{}, nil
}

// ---- keys

// OpenKey validates, allocates the first blocks from SCM and records the
// open key, all before answering, so the client can write at once.
func (s *Service) OpenKey(ctx context.Context, req *metapb.OpenKeyRequest) (*metapb.OpenKeyResponse, error) {
	if err := checkOpenKey(req); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	b, err := s.st.cachedBucket(req.Volume, req.Bucket) // (read only)
	if err != nil {
		return nil, err
	}
	if err := validateKeyFor(b, req.Key); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Write(req.Volume, req.Bucket, req.Key, "write"); err != nil {
		return nil, err
	}
	req = proto.Clone(req).(*metapb.OpenKeyRequest)
	if req.Replication == metapb.Replication_REPLICATION_UNSPECIFIED {
		req.Replication = b.Replication
	}
	if req.ChecksumType == metapb.ChecksumType_CHECKSUM_TYPE_UNSPECIFIED {
		req.ChecksumType = metapb.ChecksumType_CRC32C
	}
	if req.BytesPerChecksum == 0 {
		req.BytesPerChecksum = s.cfg.DefaultBytesPerChecksum
	}
	// One block to start; the size hint asks for more up front (bounded).
	// The hint also tells SCM how much of the first block will be used.
	alloc, err := s.blocks.AllocateBlocks(ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: req.Replication, Exclude: req.Exclude,
		ClientLocation: req.ClientLocation, ExpectedBytes: req.SizeHint})
	if err != nil {
		return nil, err
	}
	if n := req.SizeHint / max(alloc.BlockSize, 1); n > 0 {
		more, err := s.blocks.AllocateBlocks(ctx, &metapb.AllocateBlocksRequest{Count: uint32(min(n, MaxOpenBlocks-1)), Replication: req.Replication, Exclude: req.Exclude, ClientLocation: req.ClientLocation})
		if err != nil {
			return nil, err
		}
		alloc.Blocks = append(alloc.Blocks, more.Blocks...)
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_OpenKey{OpenKey: logOpen(req, alloc.Blocks)}})
	if err != nil {
		return nil, err
	}
	if err := s.attachTokens(ctx, alloc.Blocks, writeModes); err != nil {
		return nil, err
	}
	return &metapb.OpenKeyResponse{OpenId: r.(uint64), Blocks: alloc.Blocks, BlockSize: alloc.BlockSize}, nil
}

// logOpen is the OpenKeyOp an entry records: the request's fields and
// the blocks' IDs, all that Apply reads of them. The blocks' locations
// (every replica's addresses, about 0.5 KiB a block) go to the caller,
// not into the state, so the log does not carry them; nor the size hint,
// exclude list and client location, which only steered the allocation.
// (Apply of an older entry with them gives the same rows.)
func logOpen(req *metapb.OpenKeyRequest, blocks []*metapb.BlockLocation) *metapb.OpenKeyOp {
	op := &metapb.OpenKeyOp{Request: &metapb.OpenKeyRequest{Volume: req.Volume, Bucket: req.Bucket, Key: req.Key,
		Replication: req.Replication, ChecksumType: req.ChecksumType, BytesPerChecksum: req.BytesPerChecksum}}
	op.Blocks = make([]*metapb.BlockLocation, len(blocks))
	for i, b := range blocks {
		op.Blocks[i] = &metapb.BlockLocation{Id: b.Id}
	}
	return op
}

// AllocateBlock adds a block to an open key.
func (s *Service) AllocateBlock(ctx context.Context, req *metapb.AllocateBlockRequest) (*metapb.AllocateBlockResponse, error) {
	if err := checkExclude(req.Exclude); err != nil {
		return nil, err
	}
	if len(req.ClientLocation) > maxLocationBytes {
		return nil, invalid("allocate block: client location is %d bytes, at most %d", len(req.ClientLocation), maxLocationBytes)
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	row, err := s.st.OpenKey(req.OpenId)
	if err != nil {
		return nil, err
	}
	if err := s.authz(ctx).WriteRow(row, "write"); err != nil {
		return nil, err
	}
	alloc, err := s.blocks.AllocateBlocks(ctx, &metapb.AllocateBlocksRequest{Count: 1, Replication: row.Replication, Exclude: req.Exclude, ClientLocation: req.ClientLocation})
	if err != nil {
		return nil, err
	}
	blk := alloc.Blocks[0]
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_AddBlock{AddBlock: &metapb.AddBlockOp{OpenId: req.OpenId, Block: &metapb.BlockLocation{Id: blk.Id}}}}); err != nil {
		return nil, err
	}
	if err := s.attachTokens(ctx, alloc.Blocks[:1], writeModes); err != nil {
		return nil, err
	}
	return &metapb.AllocateBlockResponse{Block: blk}, nil
}

func (s *Service) CommitKey(ctx context.Context, req *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
	errs, err := s.checkCommits(ctx, []*metapb.CommitKeyRequest{req})
	if err != nil {
		return nil, err
	}
	if errs[0] != nil {
		return nil, errs[0]
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CommitKey{CommitKey: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.KeyInfo), nil
}

// LookupKey returns the key with each block's offset and its replicas,
// nearest to client_location first: everything a reader needs.
func (s *Service) LookupKey(ctx context.Context, req *metapb.LookupKeyRequest) (*metapb.KeyInfo, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	ki, _, err := s.lookupKey(ctx, s.authz(ctx), req)
	return ki, err
}

// MaxLookupBatch bounds the keys of one LookupKeys call.
const MaxLookupBatch = 1024

// MaxLookupsBytes bounds the encoded results of one LookupKeys call, well
// under a client's 4 MiB default receive limit: once the results reach it,
// the remaining keys are answered RetryAlone (each then goes as a
// LookupKey of its own), so that one call never builds an answer of
// 1,024 large keys.
const MaxLookupsBytes = 3 << 20

// LookupKeys answers many lookups after one read barrier: the barrier
// starts after the call arrived, so every answer is as linearizable as
// LookupKey's. Each key is authorized on its own; a key's refusal or
// absence is its own result, not the call's.
func (s *Service) LookupKeys(ctx context.Context, req *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
	if n := len(req.Requests); n > MaxLookupBatch {
		return nil, invalid("LookupKeys of %d keys: at most %d per call", n, MaxLookupBatch)
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	az := s.authz(ctx)
	resp := &metapb.LookupKeysResponse{Results: make([]*metapb.LookupKeyResult, len(req.Requests))}
	res := make([]metapb.LookupKeyResult, len(req.Requests)) // one allocation for all results
	size := 0                                                // encoded bytes of the results so far
	for i, r := range req.Requests {
		out := &res[i]
		resp.Results[i] = out
		if size >= MaxLookupsBytes {
			out.Code, out.RetryAlone = uint32(codes.ResourceExhausted), true
			out.Message = fmt.Sprintf("LookupKeys answer reached %d bytes: look this key up alone", MaxLookupsBytes)
			continue
		}
		if r == nil {
			out.Code, out.Message = uint32(codes.InvalidArgument), "empty lookup request"
			continue
		}
		ki, kiSize, err := s.lookupKey(ctx, az, r)
		if err != nil {
			if s.cfg.Translate != nil {
				// As the server's interceptor would have for LookupKey:
				// not-leader errors become a retryable UNAVAILABLE, raw
				// errors INTERNAL rather than UNKNOWN.
				err = s.cfg.Translate(metapb.Namespace_LookupKey_FullMethodName, err)
			}
			st, _ := status.FromError(err)
			out.Code, out.Message = uint32(st.Code()), st.Message()
			if len(st.Details()) > 0 {
				out.Status, _ = proto.Marshal(st.Proto())
			}
			size += proto.Size(out) + 4
			continue
		}
		out.Key = ki
		// kiSize is the key's encoded size (without a pass over it); + the
		// key field's and the result's tags and lengths.
		size += kiSize + 8
	}
	return resp, nil
}

// lookupKey is LookupKey after the read barrier; size is the answer's
// encoded size.
func (s *Service) lookupKey(ctx context.Context, az *Authorizer, req *metapb.LookupKeyRequest) (ki *metapb.KeyInfo, size int, err error) {
	if req.NoLocations {
		err = az.Stat(req.Volume, req.Bucket, req.Key)
	} else {
		err = az.Read(req.Volume, req.Bucket, req.Key)
	}
	if err != nil {
		return nil, 0, err
	}
	ki, size, err = s.st.lookupKeySized(req.Volume, req.Bucket, req.Key)
	if err != nil || req.NoLocations {
		return ki, size, err
	}
	var off uint64
	for _, kb := range ki.Blocks {
		loc := &metapb.BlockLocation{Id: kb.Id, Offset: off, Length: kb.Length}
		off += kb.Length
		if c, dns := s.blocks.Locate(kb.GetId().GetContainerId()); c != nil {
			loc.PipelineId = c.PipelineId
			loc.ContainerState = c.State
			loc.Datanodes = slices.Clone(dns)
			// Spread readers over equally near replicas.
			rand.Shuffle(len(loc.Datanodes), func(i, j int) { loc.Datanodes[i], loc.Datanodes[j] = loc.Datanodes[j], loc.Datanodes[i] })
			topology.SortByDistance(loc.Datanodes, 0, req.ClientLocation, func(d *metapb.DatanodeDetails) uint64 { return d.Id }, func(d *metapb.DatanodeDetails) string { return d.Location })
			if cb, ok := s.blocks.(interface {
				CachedOn(*metapb.BlockID) []uint64
			}); ok {
				loc.CachedDatanodes = cb.CachedOn(kb.Id) // cache directives (docs/CACHE.md)
			}
		}
		ki.Locations = append(ki.Locations, loc)
	}
	if err := s.attachTokens(ctx, ki.Locations, readModes); err != nil {
		return nil, 0, err
	}
	for _, loc := range ki.Locations {
		size += proto.Size(loc) + 4 // + the field's tag and length
	}
	return ki, size, nil
}

func (s *Service) ListKeys(ctx context.Context, req *metapb.ListKeysRequest) (*metapb.ListKeysResponse, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).ListAs(req.Volume, req.Bucket, "", "s3:ListBucket", listConditions(req)); err != nil {
		return nil, err
	}
	return s.st.ListKeys(req)
}

func (s *Service) RenameKey(ctx context.Context, req *metapb.RenameKeyRequest) (*metapb.RenameKeyResponse, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := checkKeyRef(req.Key); err != nil {
		return nil, err
	}
	if err := ValidateKey(req.NewKey); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	az := s.authz(ctx)
	if err := az.Delete(req.Volume, req.Bucket, req.Key, "rename"); err != nil {
		return nil, err
	}
	if err := az.Write(req.Volume, req.Bucket, req.NewKey, "rename onto"); err != nil {
		return nil, err
	}
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_RenameKey{RenameKey: req}}); err != nil {
		return nil, err
	}
	return &metapb.RenameKeyResponse{}, nil
}

func (s *Service) DeleteKey(ctx context.Context, req *metapb.DeleteKeyRequest) (*metapb.DeleteKeyResponse, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if len(req.Key) > MaxKeyBytes {
		return nil, invalid("key name %.64q... is %d bytes; at most %d allowed", req.Key, len(req.Key), MaxKeyBytes)
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Delete(req.Volume, req.Bucket, req.Key, "delete"); err != nil {
		return nil, err
	}
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_DeleteKey{DeleteKey: req}}); err != nil {
		return nil, err
	}
	return &metapb.DeleteKeyResponse{}, nil
}

func (s *Service) CreateDirectory(ctx context.Context, req *metapb.CreateDirectoryRequest) (*metapb.FileStatus, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if _, err := SplitPath(req.Path, false); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	az := s.authz(ctx)
	if err := az.Write(req.Volume, req.Bucket, req.Path, "create directory"); err != nil {
		return nil, err
	}
	req = proto.Clone(req).(*metapb.CreateDirectoryRequest)
	attrs, err := az.OwnAttrs(req.Attrs, "directory "+req.Path)
	if err != nil {
		return nil, err
	}
	req.Attrs = attrs
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CreateDirectory{CreateDirectory: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.FileStatus), nil
}

func (s *Service) GetFileStatus(ctx context.Context, req *metapb.GetFileStatusRequest) (*metapb.FileStatus, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Stat(req.Volume, req.Bucket, req.Path); err != nil {
		return nil, err
	}
	return s.st.GetFileStatus(req)
}

func (s *Service) ListStatus(ctx context.Context, req *metapb.ListStatusRequest) (*metapb.ListStatusResponse, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).List(req.Volume, req.Bucket, req.Path); err != nil {
		return nil, err
	}
	return s.st.ListStatus(req)
}

// ---- background services (leader only)

// Run runs the background services every ServiceInterval until ctx ends.
func (s *Service) Run(ctx context.Context) {
	t := time.NewTicker(s.cfg.ServiceInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if !s.raft.IsLeader() {
				continue
			}
			if err := s.RunOnce(ctx); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Debug("namespace: background services", "err", err)
			}
		}
	}
}

// RunOnce runs one round of each background service: expire open keys
// and multipart uploads, reclaim deleted directories, hand deleted blocks
// to SCM.
func (s *Service) RunOnce(ctx context.Context) error {
	exp, err := s.expiredOpens()
	if err != nil {
		return err
	}
	if len(exp.OpenIds) > 0 {
		if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_ExpireOpenKeys{ExpireOpenKeys: exp}}); err != nil {
			return err
		}
	}
	if err := s.expireUploads(ctx); err != nil {
		return err
	}
	dirs, err := s.st.PendingDirs(16)
	if err != nil {
		return err
	}
	for _, d := range dirs {
		if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_ReclaimDir{ReclaimDir: &metapb.ReclaimDirOp{Seq: d.Seq, MaxChildren: uint32(s.cfg.ReclaimBatch)}}}); err != nil {
			return err
		}
	}
	// Hand deleted blocks to SCM until none are left, within a budget of
	// batches and half a service interval per round.
	deadline := time.Now().Add(s.cfg.ServiceInterval / 2)
	for range s.cfg.DeleteBatchesPerRound {
		more, err := s.handOverDeleted(ctx)
		if err != nil || !more || time.Now().After(deadline) {
			return err
		}
	}
	return nil
}

// handOverDeleted hands one batch of deleted rows' blocks to SCM and
// purges the rows; more reports whether the batch was full.
func (s *Service) handOverDeleted(ctx context.Context) (more bool, err error) {
	rows, err := s.st.DeletedRows(s.cfg.DeleteBatchRows)
	if err != nil || len(rows) == 0 {
		return false, err
	}
	// Group by container, bounded by SCM's per-command limits.
	groups := map[uint64][]uint64{}
	var seqs []uint64
	for _, r := range rows {
		for _, b := range r.Blocks {
			groups[b.ContainerId] = append(groups[b.ContainerId], b.LocalId)
		}
		seqs = append(seqs, r.Seq)
	}
	req := &metapb.DeleteBlocksRequest{}
	for c, ids := range groups {
		for len(ids) > 0 {
			n := min(len(ids), 4096)
			req.Groups = append(req.Groups, &metapb.DeleteBlocksGroup{ContainerId: c, LocalIds: ids[:n]})
			ids = ids[n:]
		}
	}
	slices.SortFunc(req.Groups, func(a, b *metapb.DeleteBlocksGroup) int { return cmp.Compare(a.ContainerId, b.ContainerId) })
	for len(req.Groups) > 0 {
		n := min(len(req.Groups), 1024)
		if err := s.blocks.DeleteBlocks(ctx, &metapb.DeleteBlocksRequest{Groups: req.Groups[:n]}); err != nil {
			return false, fmt.Errorf("hand %d deleted-block groups to scm: %w", n, err)
		}
		req.Groups = req.Groups[n:]
	}
	// A crash between the two steps hands the blocks to SCM twice; deleting
	// a block twice on a datanode is harmless.
	_, err = s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_PurgeDeleted{PurgeDeleted: &metapb.PurgeDeletedOp{Seqs: seqs}}})
	return len(rows) == s.cfg.DeleteBatchRows, err
}

// listConditions are a listing's policy condition keys (those given).
func listConditions(req *metapb.ListKeysRequest) map[string]string {
	m := map[string]string{}
	if req.Prefix != "" {
		m["s3:prefix"] = req.Prefix
	}
	if req.Delimiter != "" {
		m["s3:delimiter"] = req.Delimiter
	}
	if req.PageSize != 0 {
		m["s3:max-keys"] = strconv.FormatUint(uint64(req.PageSize), 10)
	}
	return m
}
