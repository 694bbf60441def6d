package namespace

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// CopyKey: a copy is a new key (or multipart part) holding the source's
// blocks, so no data moves and the copy costs one Raft entry whatever the
// size. The blocks' holders are counted (refs.go); the source and the copy
// then live and die independently.

func notShareable(format string, args ...any) error {
	return s3Error(codes.FailedPrecondition, ReasonNotShareable, format, args...)
}

// readKey returns the committed key at key in b (either layout), blocks
// included.
func (t *tx) readKey(b *metapb.Bucket, key string) (*metapb.KeyInfo, error) {
	if b.Layout == metapb.BucketLayout_FS {
		parts, err := SplitPath(key, false)
		if err != nil {
			return nil, err
		}
		_, e, err := resolve(t.b, b, parts, key)
		if err != nil {
			return nil, err
		}
		if e == nil {
			return nil, notFound("key %q not found in bucket %q", key, b.Name)
		}
		if e.IsDir {
			return nil, status.Errorf(codes.FailedPrecondition, "key %q in bucket %q is a directory", key, b.Name)
		}
		return e.File, nil
	}
	if err := ValidateKey(key); err != nil {
		return nil, err
	}
	ki := &metapb.KeyInfo{}
	if !t.get(objKey(b.Id, key), ki) {
		return nil, notFound("key %q not found in bucket %q", key, b.Name)
	}
	return ki, nil
}

// copyKey applies CopyKey. Everything is validated before the first
// write; the destination's blocks are held before the key it replaces is
// released, so copying a key onto itself frees nothing.
func (t *tx) copyKey(req *metapb.CopyKeyRequest) any {
	sb, err := t.bucket(req.Volume, req.SrcBucket)
	if err != nil {
		return err
	}
	src, err := t.readKey(sb, req.SrcKey)
	if err != nil {
		return err
	}
	if req.ExpectObjectId != 0 && src.ObjectId != req.ExpectObjectId {
		return s3Error(codes.FailedPrecondition, ReasonVersionChanged, "copy source %q in bucket %q changed (object %d, expected %d)", req.SrcKey, req.SrcBucket, src.ObjectId, req.ExpectObjectId)
	}
	db, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if req.Part != nil {
		if err := noPartPrecondition(req.Precondition, req.Part); err != nil {
			return err
		}
		return t.copyPart(req, src, db)
	}
	if req.Offset != 0 || req.Length != 0 {
		return invalid("copy %q to %q: a source range applies to parts only", req.SrcKey, req.Key)
	}
	if err := validateKeyFor(db, req.Key); err != nil {
		return err
	}
	// A copy onto itself only changes attributes: the key keeps its
	// replication whatever the bucket's default.
	self := db.Id == sb.Id && req.Key == req.SrcKey
	if db.Replication != src.Replication && !self {
		return notShareable("copy %q to bucket %q: the source has replication %v, the bucket %v", req.SrcKey, req.Bucket, src.Replication, db.Replication)
	}
	meta := src.Meta
	if req.ReplaceMeta {
		meta = proto.Clone(req.Meta).(*metapb.ObjectMeta)
		if meta == nil {
			meta = &metapb.ObjectMeta{}
		}
		// What describes the bytes stays the source's.
		meta.Etag, meta.Checksums, meta.PartsCount = src.Meta.GetEtag(), src.Meta.GetChecksums(), src.Meta.GetPartsCount()
		if err := validateMeta(meta); err != nil {
			return err
		}
	}
	old, err := t.keySlot(db, req.Key, "copy to key")
	if err != nil {
		return err
	}
	if err := checkPrecondition(req.Precondition, req.Bucket, req.Key, old); err != nil {
		return err
	}
	ki := &metapb.KeyInfo{
		Volume: req.Volume, Bucket: req.Bucket, Name: req.Key, Size: src.Size, Replication: src.Replication,
		ChecksumType: src.ChecksumType, BytesPerChecksum: src.BytesPerChecksum,
		CreatedUnixMs: t.now, ModifiedUnixMs: t.now, Blocks: src.Blocks, Meta: meta,
	}
	t.hold(keyBlockIDs(src))
	t.writeKey(db, req.Key, ki)
	if old != nil {
		t.release(keyBlockIDs(old), "overwritten by a copy: "+req.Key)
	}
	return ki
}

// copyPart records a range of src as a part of an upload. The range must
// start where one of src's blocks does; the part's last block may be a
// prefix of a source block (a KeyBlock shorter than the stored block;
// readers verify whole checksum windows of the stored block).
func (t *tx) copyPart(req *metapb.CopyKeyRequest, src *metapb.KeyInfo, b *metapb.Bucket) any {
	p := req.Part
	u, err := t.partUpload(b, req.Bucket, req.Key, p)
	if err != nil {
		return err
	}
	if u.Replication != src.Replication {
		return notShareable("copy %q to upload %q: the source has replication %v, the upload %v", req.SrcKey, p.UploadId, src.Replication, u.Replication)
	}
	blocks, err := shareRange(src, req.Offset, req.Length)
	if err != nil {
		return err
	}
	part := &metapb.PartInfo{PartNumber: p.PartNumber, ModifiedUnixMs: t.now, Blocks: blocks,
		ChecksumType: src.ChecksumType, BytesPerChecksum: src.BytesPerChecksum}
	for _, kb := range blocks {
		part.Size += kb.Length
	}
	part.Etag = copyPartEtag(src, req.Offset, part.Size)
	old := &metapb.PartInfo{}
	replaced := t.get(partKey(p.UploadId, p.PartNumber), old)
	ids := make([]*metapb.BlockID, len(blocks))
	for i, kb := range blocks {
		ids[i] = kb.Id
	}
	t.hold(ids)
	t.put(partKey(p.UploadId, p.PartNumber), part)
	if replaced {
		t.release(partBlockIDs(old), fmt.Sprintf("part %d of upload %s replaced by a copy", p.PartNumber, p.UploadId))
	}
	return &metapb.KeyInfo{Volume: req.Volume, Bucket: req.Bucket, Name: req.Key, Size: part.Size,
		Replication: src.Replication, ChecksumType: src.ChecksumType, BytesPerChecksum: src.BytesPerChecksum,
		CreatedUnixMs: t.now, ModifiedUnixMs: t.now, Meta: &metapb.ObjectMeta{Etag: part.Etag}}
}

// shareRange returns src's blocks covering [off, off+length) (length 0:
// to the end), the last one shortened to end with the range.
func shareRange(src *metapb.KeyInfo, off, length uint64) ([]*metapb.KeyBlock, error) {
	if off > src.Size || (length > 0 && length > src.Size-off) {
		return nil, invalid("range [%d, %d+%d) is outside the source of %d bytes", off, off, length, src.Size)
	}
	if length == 0 {
		length = src.Size - off
	}
	end := off + length
	var out []*metapb.KeyBlock
	pos := uint64(0)
	for _, kb := range src.Blocks {
		if pos >= end {
			break
		}
		bEnd := pos + kb.Length
		if bEnd <= off {
			pos = bEnd
			continue
		}
		if pos < off {
			return nil, notShareable("range starts at %d, inside block %d/%d (bytes [%d, %d) of the source)", off, kb.GetId().GetContainerId(), kb.GetId().GetLocalId(), pos, bEnd)
		}
		if n := min(kb.Length, end-pos); n > 0 {
			out = append(out, &metapb.KeyBlock{Id: kb.Id, Length: n})
		}
		pos = bEnd
	}
	if len(out) > MaxBlocksPerKey {
		// A part is written with at most MaxBlocksPerKey blocks; a copied
		// one may not have more (Complete bounds the sum of them).
		return nil, notShareable("range [%d, %d) spans %d blocks; a part may have at most %d", off, end, len(out), MaxBlocksPerKey)
	}
	return out, nil
}

// copyPartEtag is the ETag of a part copied from src: src's own when the
// part is all of a single-part source (the MD5 of the same bytes);
// otherwise an MD5 derived from the source's ETag and the range, which
// identifies the bytes without reading them (S3 would return the MD5 of
// the part's bytes; no client can check it without the data). Sources
// without an ETag are identified by their object ID.
func copyPartEtag(src *metapb.KeyInfo, off, length uint64) string {
	etag := src.Meta.GetEtag()
	if off == 0 && length == src.Size && isMD5Hex(etag) {
		return etag
	}
	id := etag
	if id == "" {
		id = fmt.Sprintf("object %d", src.ObjectId)
	}
	sum := md5.Sum(fmt.Appendf(nil, "basalt part copy\x00%s\x00%d\x00%d", id, off, length))
	return hex.EncodeToString(sum[:])
}

func isMD5Hex(s string) bool {
	if len(s) != 2*md5.Size {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// CopyKey copies a key, or a range of it into a multipart part, by
// sharing its blocks.
func (s *Service) CopyKey(ctx context.Context, req *metapb.CopyKeyRequest) (*metapb.KeyInfo, error) {
	if err := checkCopyKey(req); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	az := s.authz(ctx)
	if err := az.Read(req.Volume, req.SrcBucket, req.SrcKey); err != nil {
		return nil, err
	}
	if err := az.Write(req.Volume, req.Bucket, req.Key, "copy onto"); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CopyKey{CopyKey: req}})
	if err != nil {
		return nil, err
	}
	out := proto.Clone(r.(*metapb.KeyInfo)).(*metapb.KeyInfo)
	out.Blocks = nil
	return out, nil
}
