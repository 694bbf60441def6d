package namespace

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// What the namespace manager keeps for S3 gateways: per-key attributes
// (KeyInfo.meta), multipart uploads and access keys. Gateways are
// stateless; everything they must agree on lives here.
//
// Key layout, in addition to state.go's:
//
//	s/<access key id>                   S3Secret
//	u/<bucket id><key>\x00<upload id>   MultipartUpload (sorted by key, then
//	                                    upload: ListMultipartUploads order)
//	q/<upload id>\x00<part number u32>  PartInfo with its blocks
//
// Upload IDs are "<hex id>-<nonce>" ([0-9a-zA-Z_-]), unique across the
// namespace, so a part row is found from the ID alone.
var (
	pfxSecret = []byte("s/")
	pfxUpload = []byte("u/")
	pfxPart   = []byte("q/")
)

// S3 limits (AWS's).
const (
	MaxPartNumber       = 10000
	DefaultMinPartSize  = 5 << 20
	MaxUploadIDBytes    = 128
	MaxAccessKeyIDBytes = 128
	// MaxCompletedBlocks bounds the blocks of a completed multipart
	// object: every part is at least one block, and a part of a few GiB is
	// a few more.
	MaxCompletedBlocks = 4 * MaxBlocksPerKey
	maxMetaBytes       = 16 << 10 // all of an object's S3 attributes
)

// Reasons in the ErrorInfo detail of S3-specific failures, so gateways
// map them to S3 error codes without parsing messages.
const (
	ReasonNoSuchUpload     = metapb.ReasonNoSuchUpload
	ReasonInvalidPart      = metapb.ReasonInvalidPart
	ReasonInvalidPartOrder = metapb.ReasonInvalidPartOrder
	ReasonEntityTooSmall   = metapb.ReasonEntityTooSmall
	ReasonVersionChanged   = metapb.ReasonVersionChanged
	ReasonNotShareable     = metapb.ReasonNotShareable
	ErrorDomain            = metapb.ReasonDomain
)

// s3Error is a status error carrying reason in an ErrorInfo detail.
func s3Error(c codes.Code, reason, format string, args ...any) error {
	st, err := status.New(c, fmt.Sprintf(format, args...)).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain})
	if err != nil {
		panic(err)
	}
	return st.Err()
}

// Reason returns the ErrorInfo reason of a namespace error, "" if none.
func Reason(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.Domain == ErrorDomain {
			return ei.Reason
		}
	}
	return ""
}

func uploadKey(bucketID uint64, key, uploadID string) []byte {
	return cat(pfxUpload, store.U64(bucketID), []byte(key), []byte{0}, []byte(uploadID))
}
func partPrefix(uploadID string) []byte { return cat(pfxPart, []byte(uploadID), []byte{0}) }
func partKey(uploadID string, n uint32) []byte {
	return binary.BigEndian.AppendUint32(partPrefix(uploadID), n)
}
func secretKey(id string) []byte { return cat(pfxSecret, []byte(id)) }

func validateUploadID(id string) error {
	if id == "" || len(id) > MaxUploadIDBytes || strings.IndexByte(id, 0) >= 0 {
		return s3Error(codes.NotFound, ReasonNoSuchUpload, "upload ID %.64q is not valid", id)
	}
	return nil
}

func validateMeta(m *metapb.ObjectMeta) error {
	if m == nil {
		return nil
	}
	if n := proto.Size(m); n > maxMetaBytes {
		return invalid("object attributes are %d bytes encoded, at most %d", n, maxMetaBytes)
	}
	return nil
}

func validateAccessKeyID(id string) error {
	if len(id) < 3 || len(id) > MaxAccessKeyIDBytes {
		return invalid("access key ID %.64q is %d characters; it must be 3 to %d", id, len(id), MaxAccessKeyIDBytes)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return invalid("access key ID %q has character %q at offset %d; only letters, digits, '.', '_' and '-' are allowed", id, c, i)
		}
	}
	return nil
}

// objectBucket returns b or an error if it is not an object bucket.
func objectBucket(b *metapb.Bucket, what string) error {
	if b.Layout != metapb.BucketLayout_OBJECT {
		return status.Errorf(codes.FailedPrecondition, "%s needs an OBJECT bucket; bucket %q in volume %q has layout %v", what, b.Name, b.Volume, b.Layout)
	}
	return nil
}

// ---------------------------------------------------------------- apply

func (t *tx) setKeyMeta(req *metapb.SetKeyMetaRequest) any {
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if err := objectBucket(b, "setting object attributes"); err != nil {
		return err
	}
	ki := &metapb.KeyInfo{}
	if !t.get(objKey(b.Id, req.Key), ki) {
		return noSuchKey(req.Bucket, req.Key)
	}
	if req.ExpectObjectId != 0 && ki.ObjectId != req.ExpectObjectId {
		return s3Error(codes.FailedPrecondition, ReasonVersionChanged, "key %q in bucket %q changed (object %d, expected %d)", req.Key, req.Bucket, ki.ObjectId, req.ExpectObjectId)
	}
	ki.Meta = req.Meta
	if req.Touch {
		ki.ModifiedUnixMs = t.now
	}
	t.put(objKey(b.Id, req.Key), ki)
	ki.Blocks = nil
	return ki
}

// partUpload checks a part reference (object bucket, part number, upload
// ID) and returns the upload it belongs to.
func (t *tx) partUpload(b *metapb.Bucket, bucket, key string, p *metapb.PartRef) (*metapb.MultipartUpload, error) {
	if err := objectBucket(b, "multipart upload"); err != nil {
		return nil, err
	}
	if p.PartNumber < 1 || p.PartNumber > MaxPartNumber {
		return nil, invalid("part number %d outside [1, %d]", p.PartNumber, MaxPartNumber)
	}
	if err := validateUploadID(p.UploadId); err != nil {
		return nil, err
	}
	u := &metapb.MultipartUpload{}
	if !t.get(uploadKey(b.Id, key, p.UploadId), u) {
		return nil, s3Error(codes.NotFound, ReasonNoSuchUpload, "upload %q of key %q not found in bucket %q (completed or aborted)", p.UploadId, key, bucket)
	}
	return u, nil
}

// commitPart records the blocks of an open key as part req.Part of an
// upload, replacing (and reclaiming) an earlier part of that number.
func (t *tx) commitPart(req *metapb.CommitKeyRequest, row *metapb.OpenKeyRow, b *metapb.Bucket) any {
	p := req.Part
	if err := noPartPrecondition(req.Precondition, p); err != nil {
		return err
	}
	if _, err := t.partUpload(b, row.Bucket, row.Key, p); err != nil {
		return err
	}
	allocated := map[[2]uint64]bool{}
	for _, id := range row.Blocks {
		allocated[[2]uint64{id.ContainerId, id.LocalId}] = true
	}
	used := map[[2]uint64]bool{}
	part := &metapb.PartInfo{PartNumber: p.PartNumber, Etag: p.Etag, ModifiedUnixMs: t.now, Blocks: req.Blocks,
		ChecksumType: row.ChecksumType, BytesPerChecksum: row.BytesPerChecksum}
	for _, kb := range req.Blocks {
		k := [2]uint64{kb.GetId().GetContainerId(), kb.GetId().GetLocalId()}
		if !allocated[k] || used[k] {
			return invalid("commit part %d of %q: block %d/%d not allocated to open key %d or listed twice", p.PartNumber, row.Key, k[0], k[1], req.OpenId)
		}
		used[k] = true
		part.Size += kb.Length
	}
	old := &metapb.PartInfo{}
	if t.get(partKey(p.UploadId, p.PartNumber), old) {
		t.release(partBlockIDs(old), fmt.Sprintf("part %d of upload %s replaced", p.PartNumber, p.UploadId))
	}
	t.put(partKey(p.UploadId, p.PartNumber), part)
	var unused []*metapb.BlockID
	for _, id := range row.Blocks {
		if !used[[2]uint64{id.ContainerId, id.LocalId}] {
			unused = append(unused, id)
		}
	}
	t.release(unused, "allocated but not committed: part of "+row.Key)
	t.del(u64Key(pfxOpen, req.OpenId))
	return &metapb.KeyInfo{Volume: row.Volume, Bucket: row.Bucket, Name: row.Key, Size: part.Size,
		Replication: row.Replication, ChecksumType: row.ChecksumType, BytesPerChecksum: row.BytesPerChecksum,
		CreatedUnixMs: t.now, ModifiedUnixMs: t.now, Meta: &metapb.ObjectMeta{Etag: p.Etag}}
}

func partBlockIDs(p *metapb.PartInfo) []*metapb.BlockID {
	out := make([]*metapb.BlockID, len(p.Blocks))
	for i, b := range p.Blocks {
		out[i] = b.Id
	}
	return out
}

func (t *tx) createMultipart(op *metapb.CreateMultipartUploadOp) any {
	req := op.Request
	if req == nil {
		return invalid("multipart upload: no request")
	}
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if err := objectBucket(b, "multipart upload"); err != nil {
		return err
	}
	if err := ValidateKey(req.Key); err != nil {
		return err
	}
	if err := validateMeta(req.Meta); err != nil {
		return err
	}
	repl := req.Replication
	if repl == metapb.Replication_REPLICATION_UNSPECIFIED {
		repl = b.Replication
	}
	u := &metapb.MultipartUpload{Volume: req.Volume, Bucket: req.Bucket, Key: req.Key,
		UploadId: fmt.Sprintf("%x-%s", t.id(), op.Nonce), CreatedUnixMs: t.now, Meta: req.Meta, Replication: repl}
	if err := validateUploadID(u.UploadId); err != nil {
		return err
	}
	t.put(uploadKey(b.Id, req.Key, u.UploadId), u)
	return u
}

// parts returns the part rows of an upload, in part-number order.
func scanParts(r pebble.Reader, uploadID string, after uint32, limit int, f func(*metapb.PartInfo) error) (truncated bool, err error) {
	pfx := partPrefix(uploadID)
	lower := partKey(uploadID, after+1)
	if after == ^uint32(0) {
		return false, nil
	}
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: store.PrefixEnd(pfx)})
	if err != nil {
		return false, err
	}
	defer it.Close()
	n := 0
	for it.First(); it.Valid(); it.Next() {
		if n == limit {
			return true, nil
		}
		p := &metapb.PartInfo{}
		if err := proto.Unmarshal(it.Value(), p); err != nil {
			return false, err
		}
		if err := f(p); err != nil {
			return false, err
		}
		n++
	}
	return false, it.Error()
}

// dropUpload removes an upload and its part rows. Parts in keep hand their
// block references to the completed key; the others release theirs.
func (t *tx) dropUpload(bucketID uint64, u *metapb.MultipartUpload, keep map[uint32]bool) {
	var blocks []*metapb.BlockID
	var keys [][]byte
	_, err := scanParts(t.b, u.UploadId, 0, MaxPartNumber+1, func(p *metapb.PartInfo) error {
		keys = append(keys, partKey(u.UploadId, p.PartNumber))
		if !keep[p.PartNumber] {
			blocks = append(blocks, partBlockIDs(p)...)
		}
		return nil
	})
	if err != nil {
		panic(err)
	}
	for _, k := range keys {
		t.del(k)
	}
	t.del(uploadKey(bucketID, u.Key, u.UploadId))
	t.release(blocks, "multipart upload "+u.UploadId+" of "+u.Key+" ended")
}

func (t *tx) upload(volume, bucket, key, uploadID string) (*metapb.Bucket, *metapb.MultipartUpload, error) {
	b, err := t.bucket(volume, bucket)
	if err != nil {
		return nil, nil, err
	}
	if err := validateUploadID(uploadID); err != nil {
		return nil, nil, err
	}
	u := &metapb.MultipartUpload{}
	if !t.get(uploadKey(b.Id, key, uploadID), u) {
		return nil, nil, s3Error(codes.NotFound, ReasonNoSuchUpload, "upload %q of key %q not found in bucket %q (completed or aborted)", uploadID, key, bucket)
	}
	return b, u, nil
}

func (t *tx) abortMultipart(req *metapb.AbortMultipartUploadRequest) any {
	b, u, err := t.upload(req.Volume, req.Bucket, req.Key, req.UploadId)
	if err != nil {
		return err
	}
	t.dropUpload(b.Id, u, nil)
	return nil
}

// completeMultipart makes the listed parts' blocks the object's blocks,
// in order: no data moves, and each listed part's block references pass to
// the object unchanged (a block shared by two listed parts stays held
// twice). The checks are S3's, in S3's order.
func (t *tx) completeMultipart(req *metapb.CompleteMultipartUploadRequest) any {
	b, u, err := t.upload(req.Volume, req.Bucket, req.Key, req.UploadId)
	if err != nil {
		return err
	}
	if len(req.Parts) == 0 {
		return invalid("complete upload %q of %q: no parts listed", req.UploadId, req.Key)
	}
	if len(req.Parts) > MaxPartNumber {
		return invalid("complete upload %q of %q: %d parts, at most %d", req.UploadId, req.Key, len(req.Parts), MaxPartNumber)
	}
	for i := 1; i < len(req.Parts); i++ {
		if req.Parts[i].PartNumber <= req.Parts[i-1].PartNumber {
			return s3Error(codes.InvalidArgument, ReasonInvalidPartOrder, "complete upload %q: part %d follows part %d; parts must be listed in ascending order", req.UploadId, req.Parts[i].PartNumber, req.Parts[i-1].PartNumber)
		}
	}
	minSize := req.MinPartSize
	if minSize == 0 {
		minSize = DefaultMinPartSize
	}
	parts := make([]*metapb.PartInfo, len(req.Parts))
	sum := md5.New()
	keep := map[uint32]bool{}
	nblocks := 0
	for i, cp := range req.Parts {
		p := &metapb.PartInfo{}
		etag := strings.Trim(cp.Etag, `"`)
		if !t.get(partKey(u.UploadId, cp.PartNumber), p) || !strings.EqualFold(p.Etag, etag) {
			return s3Error(codes.InvalidArgument, ReasonInvalidPart, "complete upload %q: part %d with ETag %q was not uploaded", req.UploadId, cp.PartNumber, etag)
		}
		if i > 0 && (p.ChecksumType != parts[0].ChecksumType || p.BytesPerChecksum != parts[0].BytesPerChecksum) {
			return invalid("complete upload %q: part %d has checksum %v/%d, part %d has %v/%d", req.UploadId, cp.PartNumber, p.ChecksumType, p.BytesPerChecksum, parts[0].PartNumber, parts[0].ChecksumType, parts[0].BytesPerChecksum)
		}
		bin, err := hex.DecodeString(p.Etag)
		if err != nil {
			return s3Error(codes.InvalidArgument, ReasonInvalidPart, "complete upload %q: part %d has ETag %q, not an MD5", req.UploadId, cp.PartNumber, p.Etag)
		}
		sum.Write(bin)
		parts[i] = p
		keep[cp.PartNumber] = true
		nblocks += len(p.Blocks)
	}
	// Sizes are checked once every part is known to exist, as S3 does.
	for i, p := range parts[:len(parts)-1] {
		if p.Size < minSize {
			return s3Error(codes.InvalidArgument, ReasonEntityTooSmall, "complete upload %q: part %d is %d bytes; every part but the last must be at least %d", req.UploadId, req.Parts[i].PartNumber, p.Size, minSize)
		}
	}
	if nblocks > MaxCompletedBlocks {
		return status.Errorf(codes.ResourceExhausted, "complete upload %q: the parts have %d blocks, an object may have at most %d", req.UploadId, nblocks, MaxCompletedBlocks)
	}
	// The new object's ACL is checked here as CommitKey checks it (Block
	// Public Access applies to an ACL given at Complete too).
	if err := validateAcls(req.Acls, "complete upload of "+u.Key); err != nil {
		return err
	}
	if err := blockedPublicAcl(b, req.Acls, "complete upload of "+u.Key); err != nil {
		return err
	}
	meta := proto.Clone(u.Meta).(*metapb.ObjectMeta)
	if meta == nil {
		meta = &metapb.ObjectMeta{}
	}
	meta.Etag = fmt.Sprintf("%x-%d", sum.Sum(nil), len(parts))
	meta.PartsCount = uint32(len(parts))
	ki := &metapb.KeyInfo{Volume: u.Volume, Bucket: u.Bucket, Name: u.Key, Replication: u.Replication,
		ChecksumType: parts[0].ChecksumType, BytesPerChecksum: parts[0].BytesPerChecksum,
		CreatedUnixMs: t.now, ModifiedUnixMs: t.now, Meta: meta, Acls: req.Acls}
	for _, p := range parts {
		ki.Blocks = append(ki.Blocks, p.Blocks...)
		ki.Size += p.Size
	}
	old := &metapb.KeyInfo{}
	if !t.get(objKey(b.Id, u.Key), old) {
		old = nil
	}
	if err := checkPrecondition(req.Precondition, u.Bucket, u.Key, old); err != nil {
		return err
	}
	if old != nil {
		t.release(keyBlockIDs(old), "overwritten: "+u.Key)
	}
	ki.ObjectId = t.id()
	t.put(objKey(b.Id, u.Key), ki)
	t.dropUpload(b.Id, u, keep)
	return ki
}

func (t *tx) createS3Secret(req *metapb.CreateS3SecretRequest) any {
	if err := validateAccessKeyID(req.AccessKeyId); err != nil {
		return err
	}
	if len(req.SecretAccessKey) < 16 || len(req.SecretAccessKey) > 256 {
		return invalid("secret for access key %q is %d characters; it must be 16 to 256", req.AccessKeyId, len(req.SecretAccessKey))
	}
	if len(req.Owner) > MaxOwnerBytes {
		return invalid("access key %q: owner is %d bytes, at most %d", req.AccessKeyId, len(req.Owner), MaxOwnerBytes)
	}
	if t.get(secretKey(req.AccessKeyId), &metapb.S3Secret{}) {
		return status.Errorf(codes.AlreadyExists, "access key %q already exists", req.AccessKeyId)
	}
	s := &metapb.S3Secret{AccessKeyId: req.AccessKeyId, SecretAccessKey: req.SecretAccessKey, Owner: req.Owner, CreatedUnixMs: t.now,
		Admin: req.Admin}
	t.put(secretKey(req.AccessKeyId), s)
	t.secretsChanged = true
	return s
}

func (t *tx) deleteS3Secret(req *metapb.DeleteS3SecretRequest) any {
	if !t.get(secretKey(req.AccessKeyId), &metapb.S3Secret{}) {
		return notFound("access key %q not found", req.AccessKeyId)
	}
	t.del(secretKey(req.AccessKeyId))
	t.secretsChanged = true
	return nil
}

// ---------------------------------------------------------------- reads

// S3SecretsGen changes after every applied creation or deletion of an S3
// key: what was read from GetS3Secret before it changed may be stale.
func (s *State) S3SecretsGen() uint64 { return s.s3Gen.Load() }

// GetS3Secret returns an access key's secret.
func (s *State) GetS3Secret(id string) (*metapb.S3Secret, error) {
	sec := &metapb.S3Secret{}
	err := s.view(func(r pebble.Reader) error {
		ok, err := get(r, secretKey(id), sec)
		if err == nil && !ok {
			err = notFound("access key %q not found", id)
		}
		return err
	})
	return sec, err
}

// ListParts returns one page of an upload's parts (without blocks).
func (s *State) ListParts(req *metapb.ListPartsRequest) (*metapb.ListPartsResponse, error) {
	resp := &metapb.ListPartsResponse{}
	err := s.view(func(r pebble.Reader) error {
		b, err := readBucket(r, req.Volume, req.Bucket)
		if err != nil {
			return err
		}
		if err := validateUploadID(req.UploadId); err != nil {
			return err
		}
		u := &metapb.MultipartUpload{}
		ok, err := get(r, uploadKey(b.Id, req.Key, req.UploadId), u)
		if err != nil {
			return err
		}
		if !ok {
			return s3Error(codes.NotFound, ReasonNoSuchUpload, "upload %q of key %q not found in bucket %q", req.UploadId, req.Key, req.Bucket)
		}
		resp.Upload = u
		resp.Truncated, err = scanParts(r, req.UploadId, req.PartNumberMarker, pageSize(req.MaxParts), func(p *metapb.PartInfo) error {
			p.Blocks = nil
			resp.Parts = append(resp.Parts, p)
			return nil
		})
		return err
	})
	return resp, err
}

// ListMultipartUploads returns one page of a bucket's uploads in progress,
// by key and then upload ID.
func (s *State) ListMultipartUploads(req *metapb.ListMultipartUploadsRequest) (*metapb.ListMultipartUploadsResponse, error) {
	resp := &metapb.ListMultipartUploadsResponse{}
	err := s.view(func(r pebble.Reader) error {
		b, err := readBucket(r, req.Volume, req.Bucket)
		if err != nil {
			return err
		}
		base := cat(pfxUpload, store.U64(b.Id))
		lower := cat(base, []byte(req.Prefix))
		if req.KeyMarker != "" {
			var m []byte
			if req.UploadIdMarker == "" {
				// Every upload of key_marker sorts before key_marker\x01.
				m = cat(base, []byte(req.KeyMarker), []byte{1})
			} else {
				m = cat(uploadKey(b.Id, req.KeyMarker, req.UploadIdMarker), []byte{0})
			}
			if bytes.Compare(m, lower) > 0 {
				lower = m
			}
		}
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: store.PrefixEnd(cat(base, []byte(req.Prefix)))})
		if err != nil {
			return err
		}
		defer it.Close()
		limit := pageSize(req.MaxUploads)
		for it.First(); it.Valid(); it.Next() {
			if len(resp.Uploads) == limit {
				resp.Truncated = true
				break
			}
			u := &metapb.MultipartUpload{}
			if err := proto.Unmarshal(it.Value(), u); err != nil {
				return err
			}
			resp.Uploads = append(resp.Uploads, u)
		}
		return it.Error()
	})
	return resp, err
}

// ---------------------------------------------------------------- service

// SetKeyMeta replaces a key's S3 attributes.
func (s *Service) SetKeyMeta(ctx context.Context, req *metapb.SetKeyMetaRequest) (*metapb.KeyInfo, error) {
	if err := validateMeta(req.Meta); err != nil {
		return nil, err
	}
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := checkKeyRef(req.Key); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Write(req.Volume, req.Bucket, req.Key, "set the metadata of"); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_SetKeyMeta{SetKeyMeta: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.KeyInfo), nil
}

func (s *Service) CreateMultipartUpload(ctx context.Context, req *metapb.CreateMultipartUploadRequest) (*metapb.MultipartUpload, error) {
	if err := ValidateKey(req.Key); err != nil {
		return nil, err
	}
	if err := validateMeta(req.Meta); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Write(req.Volume, req.Bucket, req.Key, "upload"); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CreateMultipart{CreateMultipart: &metapb.CreateMultipartUploadOp{Request: req, Nonce: randomToken(12)}}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.MultipartUpload), nil
}

func (s *Service) CompleteMultipartUpload(ctx context.Context, req *metapb.CompleteMultipartUploadRequest) (*metapb.KeyInfo, error) {
	if err := checkCompleteMultipart(req); err != nil {
		return nil, err
	}
	if err := validateAcls(req.Acls, "complete upload of "+req.Key); err != nil {
		return nil, err
	}
	if len(req.Acls) > 0 {
		if b, err := s.st.GetBucket(req.Volume, req.Bucket); err == nil {
			if err := blockedPublicAcl(b, req.Acls, "complete upload of "+req.Key); err != nil {
				return nil, err
			}
		}
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Write(req.Volume, req.Bucket, req.Key, "complete an upload of"); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CompleteMultipart{CompleteMultipart: req}})
	if err != nil {
		return nil, err
	}
	ki := r.(*metapb.KeyInfo)
	out := proto.Clone(ki).(*metapb.KeyInfo)
	out.Blocks = nil
	return out, nil
}

func (s *Service) AbortMultipartUpload(ctx context.Context, req *metapb.AbortMultipartUploadRequest) (*metapb.AbortMultipartUploadResponse, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := checkKeyRef(req.Key); err != nil {
		return nil, err
	}
	if err := validateUploadID(req.UploadId); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).AbortUpload(req.Volume, req.Bucket, req.Key); err != nil {
		return nil, err
	}
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_AbortMultipart{AbortMultipart: req}}); err != nil {
		return nil, err
	}
	return &metapb.AbortMultipartUploadResponse{}, nil
}

func (s *Service) ListParts(ctx context.Context, req *metapb.ListPartsRequest) (*metapb.ListPartsResponse, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).ListAs(req.Volume, req.Bucket, "", "s3:ListMultipartUploadParts", nil); err != nil {
		return nil, err
	}
	return s.st.ListParts(req)
}

func (s *Service) ListMultipartUploads(ctx context.Context, req *metapb.ListMultipartUploadsRequest) (*metapb.ListMultipartUploadsResponse, error) {
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).ListAs(req.Volume, req.Bucket, "", "s3:ListBucketMultipartUploads", nil); err != nil {
		return nil, err
	}
	return s.st.ListMultipartUploads(req)
}

// CreateS3Secret stores a new access key. The proposer picks the random
// parts so that every replica applies the same values.
func (s *Service) CreateS3Secret(ctx context.Context, req *metapb.CreateS3SecretRequest) (*metapb.S3Secret, error) {
	if err := s.authz(ctx).S3Secret(false); err != nil {
		return nil, err
	}
	req = proto.Clone(req).(*metapb.CreateS3SecretRequest)
	if req.AccessKeyId == "" {
		req.AccessKeyId = "BK" + strings.ToUpper(hex.EncodeToString(randomBytes(9)))
	}
	if err := validateAccessKeyID(req.AccessKeyId); err != nil {
		return nil, err
	}
	if req.SecretAccessKey == "" {
		req.SecretAccessKey = randomToken(30)
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CreateS3Secret{CreateS3Secret: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.S3Secret), nil
}

func (s *Service) GetS3Secret(ctx context.Context, req *metapb.GetS3SecretRequest) (*metapb.S3Secret, error) {
	if err := s.authz(ctx).S3Secret(true); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	return s.st.GetS3Secret(req.AccessKeyId)
}

func (s *Service) DeleteS3Secret(ctx context.Context, req *metapb.DeleteS3SecretRequest) (*metapb.DeleteS3SecretResponse, error) {
	if err := checkNameBound("access key ID", req.AccessKeyId, MaxAccessKeyIDBytes); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).S3Secret(false); err != nil {
		return nil, err
	}
	if _, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_DeleteS3Secret{DeleteS3Secret: req}}); err != nil {
		return nil, err
	}
	return &metapb.DeleteS3SecretResponse{}, nil
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return b
}

// randomToken returns n random bytes as URL-safe base64 (4n/3 characters).
func randomToken(n int) string { return base64.RawURLEncoding.EncodeToString(randomBytes(n)) }

// sortedParts is for tests and tools: part numbers of an upload.
func (s *State) sortedParts(uploadID string) []uint32 {
	var out []uint32
	_ = s.view(func(r pebble.Reader) error {
		_, err := scanParts(r, uploadID, 0, MaxPartNumber+1, func(p *metapb.PartInfo) error {
			out = append(out, p.PartNumber)
			return nil
		})
		return err
	})
	slices.Sort(out)
	return out
}
