package pki

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// GRPCServerOption makes a gRPC server require a client certificate from
// the cluster CA (any role: the services check roles per method). With
// insecure credentials it is a no-op.
func (c *Credentials) GRPCServerOption() grpc.ServerOption {
	if c.IsInsecure() {
		return grpc.EmptyServerOption{}
	}
	return grpc.Creds(&watchingCreds{TransportCredentials: credentials.NewTLS(c.ServerTLS()), c: c})
}

// watchingCreds are a gRPC server's TLS credentials that hand every
// authenticated connection to Watch: when its peer's certificate is
// revoked (SetRevoked), the connection is closed, so a client does not
// keep one open past the revocation (its calls would be refused by
// RefuseRevoked, but the connection, its streams and its resources
// would stay).
type watchingCreds struct {
	credentials.TransportCredentials
	c *Credentials
}

func (w *watchingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, ai, err := w.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, ai, err
	}
	ti, ok := ai.(credentials.TLSInfo)
	if !ok || len(ti.State.PeerCertificates) == 0 {
		return conn, ai, nil // no client certificate (a bootstrap call)
	}
	stop := w.c.Watch(raw, &ti.State)
	return &unwatchConn{Conn: conn, stop: stop}, ai, nil
}

func (w *watchingCreds) Clone() credentials.TransportCredentials {
	return &watchingCreds{TransportCredentials: w.TransportCredentials.Clone(), c: w.c}
}

// unwatchConn calls Watch's stop once when the connection is closed.
// Not covered: if gRPC fails to set up the HTTP/2 transport after the
// handshake, it closes the raw connection, not this one, and the Watch
// entry (a closed conn and its peer's serial and identity) is never
// removed (review of session 18, nit 4): practically unreachable on TCP
// (the failing writes are buffered), and only after an authenticated
// handshake.
type unwatchConn struct {
	net.Conn
	once sync.Once
	stop func()
}

func (u *unwatchConn) Close() error {
	u.once.Do(u.stop)
	return u.Conn.Close()
}

// GRPCDialOption makes a gRPC client present its certificate and accept
// only servers of the given roles. With insecure credentials it dials in
// plaintext.
func (c *Credentials) GRPCDialOption(roles ...Role) grpc.DialOption {
	if c.IsInsecure() {
		return grpc.WithTransportCredentials(insecure.NewCredentials())
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(c.ClientTLS(roles...)))
}

// ErrNoIdentity: the call did not come over a verified TLS connection.
var ErrNoIdentity = errors.New("pki: no verified peer certificate")

// FromContext is the identity of a gRPC call's peer (in a handler or
// interceptor of a server set up with GRPCServerOption).
func FromContext(ctx context.Context) (Identity, error) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return Identity{}, ErrNoIdentity
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 {
		return Identity{}, ErrNoIdentity
	}
	return PeerIdentity(&ti.State)
}

// RequireRole returns nil if the call's peer has one of roles, else a
// PermissionDenied (or Unauthenticated) status naming the method.
func RequireRole(ctx context.Context, method string, roles ...Role) (Identity, error) {
	id, err := FromContext(ctx)
	if err != nil {
		return Identity{}, status.Errorf(codes.Unauthenticated, "%s: %v", method, err)
	}
	for _, r := range roles {
		if id.Role == r {
			return id, nil
		}
	}
	return id, status.Errorf(codes.PermissionDenied, "%s: %s may not call it (roles allowed: %v)", method, id, roles)
}

// TLSState returns the connection state of a *tls.Conn, nil for any
// other connection.
func TLSState(c any) *tls.ConnectionState {
	if tc, ok := c.(*tls.Conn); ok {
		cs := tc.ConnectionState()
		return &cs
	}
	return nil
}

// GRPCServerOptionCertOptional is GRPCServerOption for a server where a
// client certificate is optional at the TLS level (ServerTLSCertOptional):
// calls without one have no identity, and RequireRole refuses them, so
// only handlers that check another credential themselves (a bootstrap
// token) serve such callers.
func (c *Credentials) GRPCServerOptionCertOptional() grpc.ServerOption {
	if c.IsInsecure() {
		return grpc.EmptyServerOption{}
	}
	return grpc.Creds(&watchingCreds{TransportCredentials: credentials.NewTLS(c.ServerTLSCertOptional()), c: c})
}

// CallIdentity is the identity of a gRPC call's peer; ok is false when
// the call came without a verified client certificate (a server made
// with GRPCServerOptionCertOptional lets such callers in; each handler
// then decides). err reports a certificate that is present but names no
// valid identity.
func CallIdentity(ctx context.Context) (id Identity, ok bool, err error) {
	id, err = FromContext(ctx)
	if errors.Is(err, ErrNoIdentity) {
		return Identity{}, false, nil
	}
	if err != nil {
		return Identity{}, false, err
	}
	return id, true, nil
}

// RefuseRevoked returns PermissionDenied if the call's peer certificate
// is in c's revoked set: a connection opened before the revocation stays
// open, but its calls are refused from then on.
func (c *Credentials) RefuseRevoked(ctx context.Context, method string) error {
	if c == nil {
		return nil
	}
	if c.revoked.Load().empty() {
		return nil // nothing revoked: no cost on the data path
	}
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return nil
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.PeerCertificates) == 0 {
		return nil
	}
	if cert := ti.State.PeerCertificates[0]; c.IsRevoked(cert) {
		return status.Errorf(codes.PermissionDenied, "%s: the certificate (serial %s) is revoked", method, SerialString(cert.SerialNumber))
	}
	return nil
}
