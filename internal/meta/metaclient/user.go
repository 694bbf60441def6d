package metaclient

import (
	"context"

	"google.golang.org/grpc/metadata"
)

// A gateway (S3, WebHDFS) calls the metadata service for the end user it
// authenticated: it sets these gRPC metadata keys on the calls it makes
// for a request (WithUser). The metadata service believes them only from
// a gateway certificate (pki.IsGateway); from any other caller they are
// ignored, and the call runs as the certificate's own user.
const (
	// OnBehalfOfHeader names the end user.
	OnBehalfOfHeader = "basalt-on-behalf-of"
	// OnBehalfOfAdminHeader ("true") says the gateway authenticated the end
	// user as an administrator (an S3 admin key).
	OnBehalfOfAdminHeader = "basalt-on-behalf-of-admin"
)

// WithUser returns ctx whose outgoing calls act for user (admin: as an
// administrator). It replaces any user ctx named before.
func WithUser(ctx context.Context, user string, admin bool) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Set(OnBehalfOfHeader, user)
	md.Delete(OnBehalfOfAdminHeader)
	if admin {
		md.Set(OnBehalfOfAdminHeader, "true")
	}
	return metadata.NewOutgoingContext(ctx, md)
}

// WithoutUser returns ctx whose outgoing calls act in the caller's own
// name (no end user, no user token) (a gateway's own work, such as creating its volume).
func WithoutUser(ctx context.Context) context.Context {
	md, ok := metadata.FromOutgoingContext(ctx)
	if !ok {
		return ctx
	}
	md = md.Copy()
	md.Delete(OnBehalfOfHeader)
	md.Delete(OnBehalfOfAdminHeader)
	md.Delete(UserTokenHeader)
	return metadata.NewOutgoingContext(ctx, md)
}
