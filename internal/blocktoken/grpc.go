package blocktoken

import (
	"context"

	"google.golang.org/grpc/metadata"
)

// MetadataKey carries a block token with a datanode data call (a binary
// gRPC header: gRPC base64-encodes it on the wire). A header rather than
// a request field: the token is a credential like an authorization
// header, and every call that names a block (V1 writes, reads, GetBlock)
// carries it the same way.
const MetadataKey = "basalt-block-token-bin"

// WithToken returns ctx with tok attached to outgoing gRPC calls (nil:
// ctx unchanged).
func WithToken(ctx context.Context, tok []byte) context.Context {
	if len(tok) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, MetadataKey, string(tok))
}

// FromIncoming returns the token a gRPC call carried (nil if none). A
// value longer than MaxTokenSize is cut to MaxTokenSize+1 bytes, which
// Verify refuses, so nothing larger is copied.
func FromIncoming(ctx context.Context) []byte {
	v := metadata.ValueFromIncomingContext(ctx, MetadataKey) // no copy of the whole map
	if len(v) == 0 {
		return nil
	}
	s := v[0]
	if len(s) > MaxTokenSize {
		s = s[:MaxTokenSize+1]
	}
	return []byte(s)
}
