package namespace

import (
	"strconv"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Checks made by the Service before it proposes a request, so that a
// request that can only fail never takes a Raft log entry on every
// replica, and nothing unbounded (a 16 MiB "key", a million parts) enters
// the log at all. Apply keeps its own checks, and stays the authority: it
// must decide entries already in logs the way it always has, so these
// only refuse what Apply would refuse too, or what can never name a stored
// object (a name longer than any that can be created).
//
// Names that are looked up, not created (the key of a delete, a volume
// to delete), are only bounded: an invalid one finds nothing, as before.

// Checksum settings a datanode accepts (storage.MaxBytesPerChecksum and its
// minimum); a key written with others could never be stored or read.
const (
	MinBytesPerChecksum = 512
	MaxBytesPerChecksum = 16 << 20
	// Bounds of what a request may carry beside its names.
	maxLocationBytes = 1024
	maxExcludeIDs    = 1024
	maxETagBytes     = 256
	maxKeySize       = 1 << 62 // sum of a key's block lengths
)

func checkNameBound(kind, name string, maxLen int) error {
	if name == "" {
		return invalid("%s name is empty", kind)
	}
	if len(name) > maxLen {
		return invalid("%s name %.64q... is %d bytes; at most %d", kind, name, len(name), maxLen)
	}
	return nil
}

// checkBucketRef bounds a volume and bucket name that are looked up.
func checkBucketRef(volume, bucket string) error {
	if err := checkNameBound("volume", volume, 63); err != nil {
		return err
	}
	return checkNameBound("bucket", bucket, 63)
}

func checkKeyRef(key string) error { return checkNameBound("key", key, MaxKeyBytes) }

func checkPartRef(p *metapb.PartRef) error {
	if p == nil {
		return nil
	}
	if p.PartNumber < 1 || p.PartNumber > MaxPartNumber {
		return invalid("part number %d outside [1, %d]", p.PartNumber, MaxPartNumber)
	}
	if len(p.Etag) > maxETagBytes {
		return invalid("part %d: ETag is %d bytes, at most %d", p.PartNumber, len(p.Etag), maxETagBytes)
	}
	return validateUploadID(p.UploadId)
}

func checkCreateBucket(req *metapb.CreateBucketRequest) error {
	if err := checkNameBound("volume", req.Volume, 63); err != nil {
		return err
	}
	if len(req.Owner) > MaxOwnerBytes {
		return invalid("bucket %q: owner is %d bytes, at most %d", req.Name, len(req.Owner), MaxOwnerBytes)
	}
	switch req.Layout {
	case metapb.BucketLayout_BUCKET_LAYOUT_UNSPECIFIED, metapb.BucketLayout_OBJECT, metapb.BucketLayout_FS:
	default:
		return invalid("bucket %q: layout %v, want OBJECT or FS", req.Name, req.Layout)
	}
	switch req.Replication {
	case metapb.Replication_REPLICATION_UNSPECIFIED, metapb.Replication_ONE, metapb.Replication_THREE:
	default:
		return invalid("bucket %q: replication %v, want ONE or THREE", req.Name, req.Replication)
	}
	return nil
}

func checkOpenKey(req *metapb.OpenKeyRequest) error {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return err
	}
	if err := ValidateKey(req.Key); err != nil {
		return err
	}
	return checkWriteParams("open key", req.Key, req.Replication, req.ChecksumType, req.BytesPerChecksum,
		req.ClientLocation, req.Exclude)
}

// checkWriteParams checks what a new open key is written with: OpenKey's
// and ReserveBlocks' requests (what and key name the request in errors).
func checkWriteParams(what, key string, repl metapb.Replication, ct metapb.ChecksumType, bpc uint32, loc string, ex *metapb.ExcludeList) error {
	label := func() string { // (on an error only)
		if key == "" {
			return what
		}
		return what + " " + strconv.Quote(key)
	}
	switch repl {
	case metapb.Replication_REPLICATION_UNSPECIFIED, metapb.Replication_ONE, metapb.Replication_THREE:
	default:
		return invalid("%s: replication %v, want ONE or THREE", label(), repl)
	}
	switch ct {
	case metapb.ChecksumType_CHECKSUM_TYPE_UNSPECIFIED, metapb.ChecksumType_CHECKSUM_NONE, metapb.ChecksumType_CRC32C:
	default:
		return invalid("%s: checksum type %v, want CHECKSUM_NONE or CRC32C", label(), ct)
	}
	if bpc != 0 && (bpc < MinBytesPerChecksum || bpc > MaxBytesPerChecksum) {
		return invalid("%s: bytes per checksum %d outside [%d, %d]", label(), bpc, MinBytesPerChecksum, MaxBytesPerChecksum)
	}
	if len(loc) > maxLocationBytes {
		return invalid("%s: client location is %d bytes, at most %d", label(), len(loc), maxLocationBytes)
	}
	return checkExclude(ex)
}

// checkReserveBlocks checks a ReserveBlocks request as OpenKey's is
// checked (all but the key, which the commit names).
func checkReserveBlocks(req *metapb.ReserveBlocksRequest) error {
	if req.Count == 0 || req.Count > MaxReserveBlocks {
		return invalid("reserve blocks: count %d, want 1..%d", req.Count, MaxReserveBlocks)
	}
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return err
	}
	return checkWriteParams("reserve blocks", "", req.Replication, req.ChecksumType, req.BytesPerChecksum, req.ClientLocation, req.Exclude)
}

func checkExclude(ex *metapb.ExcludeList) error {
	if n := len(ex.GetDatanodes()) + len(ex.GetPipelines()) + len(ex.GetContainers()); n > maxExcludeIDs {
		return invalid("exclude list has %d entries, at most %d", n, maxExcludeIDs)
	}
	return nil
}

func checkCommitKey(req *metapb.CommitKeyRequest) error {
	if len(req.Blocks) > MaxBlocksPerKey {
		return invalid("commit key (open key %d): %d blocks, at most %d", req.OpenId, len(req.Blocks), MaxBlocksPerKey)
	}
	var size uint64
	for i, kb := range req.Blocks {
		if kb.GetId() == nil {
			return invalid("commit key (open key %d): block %d has no ID", req.OpenId, i)
		}
		if kb.Length > maxKeySize-size {
			return invalid("commit key (open key %d): block lengths add up to more than %d bytes", req.OpenId, uint64(maxKeySize))
		}
		size += kb.Length
	}
	if err := checkPartRef(req.Part); err != nil {
		return err
	}
	// The key, volume and bucket a commit names (a reserved open key's;
	// checked against the open key itself in Service.checkCommitRow).
	if req.Volume != "" || req.Bucket != "" {
		if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
			return err
		}
	}
	if req.Key != "" {
		if err := ValidateKey(req.Key); err != nil {
			return err
		}
	}
	if err := checkPreconditionBounds(req.Precondition); err != nil {
		return err
	}
	if err := noPartPrecondition(req.Precondition, req.Part); err != nil {
		return err
	}
	return validateMeta(req.Meta)
}

func checkCompleteMultipart(req *metapb.CompleteMultipartUploadRequest) error {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return err
	}
	if err := ValidateKey(req.Key); err != nil {
		return err
	}
	if err := validateUploadID(req.UploadId); err != nil {
		return err
	}
	if len(req.Parts) == 0 || len(req.Parts) > MaxPartNumber {
		return invalid("complete upload %q of %q: %d parts, want 1 to %d", req.UploadId, req.Key, len(req.Parts), MaxPartNumber)
	}
	for _, p := range req.Parts {
		if p.PartNumber < 1 || p.PartNumber > MaxPartNumber || len(p.Etag) > maxETagBytes {
			return invalid("complete upload %q of %q: part %d (ETag of %d bytes) outside [1, %d] or ETag over %d bytes",
				req.UploadId, req.Key, p.PartNumber, len(p.Etag), MaxPartNumber, maxETagBytes)
		}
	}
	return checkPreconditionBounds(req.Precondition)
}

func checkCopyKey(req *metapb.CopyKeyRequest) error {
	if err := checkBucketRef(req.Volume, req.SrcBucket); err != nil {
		return err
	}
	if err := checkNameBound("bucket", req.Bucket, 63); err != nil {
		return err
	}
	if err := checkKeyRef(req.SrcKey); err != nil {
		return err
	}
	if err := ValidateKey(req.Key); err != nil {
		return err
	}
	if err := checkPartRef(req.Part); err != nil {
		return err
	}
	if err := checkPreconditionBounds(req.Precondition); err != nil {
		return err
	}
	if err := noPartPrecondition(req.Precondition, req.Part); err != nil {
		return err
	}
	if req.ReplaceMeta {
		return validateMeta(req.Meta)
	}
	return nil
}
