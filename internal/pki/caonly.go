package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// CAOnlyClientTLS is the configuration of a client that has no
// certificate of its own (it authenticates otherwise: a user token) and
// accepts only servers whose certificate is from the CA in caPEM, with a
// role among roles (none: any). As ClientTLS, host names are not checked.
func CAOnlyClientTLS(caPEM []byte, roles ...Role) (*tls.Config, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("pki: no CA certificate in the CA file")
	}
	return &tls.Config{
		MinVersion:         tls.VersionTLS13,
		InsecureSkipVerify: true, // verified below, against the CA, without a host name
		ClientSessionCache: tls.NewLRUClientSessionCache(64),
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("pki: the server sent no certificate")
			}
			inter := x509.NewCertPool()
			for _, ic := range cs.PeerCertificates[1:] {
				inter.AddCert(ic)
			}
			if _, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
				return fmt.Errorf("pki: server certificate: %w", err)
			}
			_, err := checkPeer(cs, roles)
			return err
		},
	}, nil
}

// LoadCAOnlyDialOption reads a CA certificate file and returns the gRPC
// dial option of a client without a certificate (CAOnlyClientTLS).
func LoadCAOnlyDialOption(caFile string, roles ...Role) (grpc.DialOption, error) {
	b, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	c, err := CAOnlyClientTLS(b, roles...)
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, caFile)
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(c)), nil
}

// CertOptionalServerTLS is ServerTLS for a port that also serves callers
// without a certificate (they prove themselves otherwise: a user token, a
// block token). A presented certificate is verified and checked as
// ServerTLS does; handlers see no identity for the others
// (FromContext: ErrNoIdentity).
func (c *Credentials) CertOptionalServerTLS(roles ...Role) *tls.Config {
	t := c.ServerTLS(roles...)
	t.ClientAuth = tls.VerifyClientCertIfGiven
	v := t.VerifyConnection
	t.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return nil
		}
		return v(cs)
	}
	return t
}
