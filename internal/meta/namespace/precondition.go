package namespace

import (
	"strings"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Write preconditions (KeyPrecondition): S3's conditional writes
// (If-None-Match: *, If-Match: "etag" on PutObject, CompleteMultipartUpload
// and CopyObject) and create-if-absent for file system clients. They are
// checked in Apply, against the key the write would replace, in the same
// batch as the write: of racing writers with expect_absent exactly one
// wins, whatever the gateways or clients involved.

// ReasonPreconditionFailed is the ErrorInfo reason of a failed
// KeyPrecondition (code FAILED_PRECONDITION).
const ReasonPreconditionFailed = metapb.ReasonPreconditionFailed

// checkPreconditionBounds refuses preconditions that can never hold.
func checkPreconditionBounds(p *metapb.KeyPrecondition) error {
	if p == nil {
		return nil
	}
	if len(p.ExpectEtag) > maxETagBytes {
		return invalid("precondition: ETag is %d bytes, at most %d", len(p.ExpectEtag), maxETagBytes)
	}
	if p.ExpectAbsent && p.ExpectEtag != "" {
		return invalid("precondition: a key cannot be both absent and have ETag %q", p.ExpectEtag)
	}
	return nil
}

// noPartPrecondition refuses a precondition on a write of a part: parts
// are no keys, and S3 has no conditional parts.
func noPartPrecondition(p *metapb.KeyPrecondition, part *metapb.PartRef) error {
	if p != nil && part != nil {
		return invalid("a precondition applies to keys, not to part %d of upload %q", part.PartNumber, part.UploadId)
	}
	return nil
}

// checkPrecondition checks p against old, the key a write at key in
// bucket replaces (nil: none).
func checkPrecondition(p *metapb.KeyPrecondition, bucket, key string, old *metapb.KeyInfo) error {
	if p == nil {
		return nil
	}
	if p.ExpectAbsent && old != nil {
		return s3Error(codes.FailedPrecondition, ReasonPreconditionFailed, "key %q exists in bucket %q (the write expected none)", key, bucket)
	}
	if want := strings.Trim(p.ExpectEtag, `"`); want != "" {
		if old == nil {
			return noSuchKey(bucket, key)
		}
		if have := old.GetMeta().GetEtag(); have != want {
			return s3Error(codes.FailedPrecondition, ReasonPreconditionFailed, "key %q in bucket %q has ETag %q (the write expected %q)", key, bucket, have, want)
		}
	}
	return nil
}
