// Package enroll is the node side of the cluster CA kept by the metadata
// service (internal/meta/ca.go): getting a first certificate with a
// one-time bootstrap token, renewing it before it expires, and learning
// the revoked serials so that a node refuses revoked peers too.
package enroll

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// Bootstrap gets credentials for a new node of role from the metadata
// service at addrs with a one-time token (pki.BootstrapToken's text form,
// which carries the CA's fingerprint): it fetches the CA certificate
// without authentication and keeps it only if its SHA-256 is the token's,
// then, over TLS that verifies the meta node against that CA, sends a CSR
// for a key made here and the token. The key never leaves this process.
func Bootstrap(ctx context.Context, addrs []string, token string, role pki.Role) (*pki.Credentials, error) {
	tok, err := pki.ParseBootstrapToken(token)
	if err != nil {
		return nil, err
	}
	if tok.CAHash == "" {
		return nil, errors.New("enroll: the token carries no CA fingerprint (bt1.<id>.<secret>.<CA sha256>): the meta service could not be authenticated")
	}
	caPEM, err := fetchCA(ctx, addrs)
	if err != nil {
		return nil, err
	}
	pool, _, err := pki.PoolWithFingerprint(caPEM, tok.CAHash)
	if err != nil {
		return nil, err
	}
	verified := pki.ServerVerifyingTLS(pool, func(cs tls.ConnectionState) error {
		id, err := pki.PeerIdentity(&cs)
		if err == nil && id.Role != pki.RoleMeta {
			err = fmt.Errorf("enroll: the server is %s, not a meta node", id)
		}
		return err
	})
	mc, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 30 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(verified))}})
	if err != nil {
		return nil, err
	}
	defer mc.Close()
	keyPEM, csr, err := pki.NewCSR(pki.Identity{Role: role, ID: "new"})
	if err != nil {
		return nil, err
	}
	resp, err := mc.Ca.IssueCertificate(ctx, &metapb.IssueCertificateRequest{Token: token, CsrDer: csr})
	if err != nil {
		return nil, fmt.Errorf("enroll: %w", err)
	}
	creds, err := pki.New(resp.GetCaPem(), resp.GetCertPem(), keyPEM)
	if err != nil {
		return nil, fmt.Errorf("enroll: the issued certificate: %w", err)
	}
	if creds.Identity.Role != role {
		return nil, fmt.Errorf("enroll: issued %s, wanted role %s (the token is for another role)", creds.Identity, role)
	}
	if _, _, err := pki.PoolWithFingerprint(creds.CAPEM(), tok.CAHash); err != nil {
		return nil, err
	}
	return creds, nil
}

// fetchCA asks the meta nodes for their CA certificates without
// authenticating them (the caller checks the fingerprint).
func fetchCA(ctx context.Context, addrs []string) ([]byte, error) {
	unverified := &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}
	mc, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 30 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(unverified))}})
	if err != nil {
		return nil, err
	}
	defer mc.Close()
	resp, err := mc.Ca.GetCaCertificate(ctx, &metapb.GetCaCertificateRequest{})
	if err != nil {
		return nil, fmt.Errorf("enroll: fetching the CA certificate: %w", err)
	}
	return resp.GetCaPem(), nil
}

// Agent keeps a node's credentials current: it renews the certificate
// when less than RenewBefore of its life is left (over the node's own mTLS
// connection to the metadata service; the new certificate is swapped in,
// connections stay) and polls the revoked serials so that the node's
// servers and clients refuse them.
type Agent struct {
	Creds *pki.Credentials
	Addrs []string
	// Save, if set, is called with the credentials after a renewal (to
	// write them to the node's TLS directory).
	Save func(*pki.Credentials) error
	// Interval between polls (default 5s, jittered).
	Interval time.Duration
	// RenewBefore is the fraction of the certificate's life left at which
	// it is renewed (default 1/3).
	RenewBefore float64
	Logger      *slog.Logger

	mc       *metaclient.Client
	version  atomic.Uint64
	Renewals atomic.Uint64
}

// Start connects; call Run (or SyncOnce and Renew) after.
func (a *Agent) Start() error {
	if a.Interval <= 0 {
		a.Interval = 5 * time.Second
	}
	if a.RenewBefore <= 0 || a.RenewBefore >= 1 {
		a.RenewBefore = 1.0 / 3
	}
	if a.Logger == nil {
		a.Logger = slog.Default()
	}
	mc, err := metaclient.New(metaclient.Config{Addrs: a.Addrs, CallTimeout: 20 * time.Second,
		DialOptions: []grpc.DialOption{a.Creds.GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		return err
	}
	a.mc = mc
	return nil
}

// Close closes the agent's connections.
func (a *Agent) Close() error {
	if a.mc == nil {
		return nil
	}
	return a.mc.Close()
}

// Run polls until ctx ends.
func (a *Agent) Run(ctx context.Context) {
	for {
		if err := a.SyncOnce(ctx); err != nil && ctx.Err() == nil {
			a.Logger.Warn("enroll: revocation list", "err", err)
		}
		if a.due() {
			if err := a.Renew(ctx); err != nil && ctx.Err() == nil {
				a.Logger.Warn("enroll: renewing the certificate", "err", err, "not_after", a.Creds.Leaf().NotAfter)
			}
		}
		d := a.Interval/2 + rand.N(a.Interval)
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}

// due reports whether the certificate is within RenewBefore of its expiry.
func (a *Agent) due() bool {
	l := a.Creds.Leaf()
	life := l.NotAfter.Sub(l.NotBefore)
	return time.Until(l.NotAfter) < time.Duration(float64(life)*a.RenewBefore)
}

// SyncOnce fetches the revoked serials and installs them.
func (a *Agent) SyncOnce(ctx context.Context) error {
	resp, err := a.mc.Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{})
	if err != nil {
		return err
	}
	if v := resp.GetVersion(); v != a.version.Load() || v == 0 {
		a.Creds.SetRevoked(resp.GetSerials())
		a.version.Store(v)
	}
	return nil
}

// Renew asks for a new certificate for the same identity and swaps it in.
func (a *Agent) Renew(ctx context.Context) error {
	keyPEM, csr, err := pki.NewCSR(a.Creds.Identity)
	if err != nil {
		return err
	}
	resp, err := a.mc.Ca.RenewCertificate(ctx, &metapb.RenewCertificateRequest{CsrDer: csr})
	if err != nil {
		return err
	}
	if err := a.Creds.Swap(resp.GetCertPem(), keyPEM); err != nil {
		return err
	}
	a.Renewals.Add(1)
	a.Logger.Info("enroll: certificate renewed", "identity", a.Creds.Identity, "serial", resp.GetSerial(), "not_after", time.UnixMilli(resp.GetNotAfterUnixMs()))
	if a.Save != nil {
		return a.Save(a.Creds)
	}
	return nil
}
