package namespace

import (
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Typed NotFound errors: the ErrorInfo reason names the missing resource
// (metapb.ReasonNoSuch*) and its metadata the names, so that the client
// and the S3 gateway tell NoSuchBucket from NoSuchKey without reading the
// message.

func noSuch(reason string, md map[string]string, format string, args ...any) error {
	st, err := status.Newf(codes.NotFound, format, args...).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: md})
	if err != nil {
		panic(err) // an ErrorInfo always marshals
	}
	return st.Err()
}

func noSuchVolume(volume string) error {
	return noSuch(metapb.ReasonNoSuchVolume, map[string]string{"volume": volume}, "volume %q not found", volume)
}

func noSuchBucket(volume, bucket string) error {
	return noSuch(metapb.ReasonNoSuchBucket, map[string]string{"volume": volume, "bucket": bucket}, "bucket %q not found in volume %q", bucket, volume)
}

func noSuchKey(bucket, key string) error {
	return noSuch(metapb.ReasonNoSuchKey, map[string]string{"bucket": bucket, "key": key}, "key %q not found in bucket %q", key, bucket)
}
