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
	setUser(md, user, admin)
	return metadata.NewOutgoingContext(ctx, md)
}

func setUser(md metadata.MD, user string, admin bool) {
	md.Set(OnBehalfOfHeader, user)
	md.Delete(OnBehalfOfAdminHeader)
	md.Delete(AnonymousHeader)
	if admin {
		md.Set(OnBehalfOfAdminHeader, "true")
	}
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
	md.Delete(AnonymousHeader)
	md.Delete(UserTokenHeader)
	return metadata.NewOutgoingContext(ctx, md)
}

// Anonymous requests and request attributes. Like the on-behalf-of
// headers, the metadata service believes these only from a gateway
// certificate.
const (
	// AnonymousHeader ("true") says the gateway acts for an
	// unauthenticated requester (an anonymous S3 request).
	AnonymousHeader = "basalt-anonymous"
	// Request attributes for bucket policy conditions (aws:SourceIp,
	// aws:SecureTransport, aws:UserAgent, aws:Referer).
	SourceIPHeader        = "basalt-source-ip"
	SecureTransportHeader = "basalt-secure-transport"
	UserAgentHeader       = "basalt-user-agent"
	RefererHeader         = "basalt-referer"
)

// MaxRequestInfoBytes bounds each RequestInfo field; the metadata service
// refuses longer ones.
const MaxRequestInfoBytes = 1024

// WithAnonymous returns ctx whose outgoing calls act for an anonymous
// requester: only ACL entries of type ANONYMOUS and bucket policies that
// grant to "*" allow them anything. It replaces any user ctx named.
func WithAnonymous(ctx context.Context) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	setAnonymous(md)
	return metadata.NewOutgoingContext(ctx, md)
}

func setAnonymous(md metadata.MD) {
	md.Delete(OnBehalfOfHeader)
	md.Delete(OnBehalfOfAdminHeader)
	md.Set(AnonymousHeader, "true")
}

// RequestInfo is what a gateway knows of the request it serves, for the
// conditions of bucket policies.
type RequestInfo struct {
	SourceIP        string // the requester's address (IPv4 or IPv6, no port)
	SecureTransport bool   // the request came over TLS
	UserAgent       string
	Referer         string
}

// WithRequestInfo returns ctx whose outgoing calls carry ri (fields cut
// to MaxRequestInfoBytes). It replaces any ctx carried before.
func WithRequestInfo(ctx context.Context, ri RequestInfo) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	setRequestInfo(md, ri)
	return metadata.NewOutgoingContext(ctx, md)
}

func setRequestInfo(md metadata.MD, ri RequestInfo) {
	vals := make([]string, 4) // the four values share one array
	i := 0
	set := func(k, v string) {
		if len(v) > MaxRequestInfoBytes {
			v = v[:MaxRequestInfoBytes]
		}
		if v == "" {
			md.Delete(k)
			return
		}
		vals[i] = v
		md[k] = vals[i : i+1 : i+1] // k is lower case, as md.Set would make it
		i++
	}
	secure := "false"
	if ri.SecureTransport {
		secure = "true"
	}
	set(SourceIPHeader, ri.SourceIP)
	set(SecureTransportHeader, secure)
	set(UserAgentHeader, ri.UserAgent)
	set(RefererHeader, ri.Referer)
}

// WithRequester is WithUser (or WithAnonymous when anonymous) followed
// by WithRequestInfo, with one copy of the metadata instead of two: a
// gateway calls it once per request (issue 15: CPU per S3 HEAD).
func WithRequester(ctx context.Context, anonymous bool, user string, admin bool, ri RequestInfo) context.Context {
	old, _ := metadata.FromOutgoingContext(ctx)
	md := make(metadata.MD, len(old)+6)
	for k, v := range old {
		md[k] = v // values are replaced below, never appended to
	}
	if anonymous {
		setAnonymous(md)
	} else {
		setUser(md, user, admin)
	}
	setRequestInfo(md, ri)
	return metadata.NewOutgoingContext(ctx, md)
}
