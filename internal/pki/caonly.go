package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"

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
	return ServerVerifyingTLS(pool, func(cs tls.ConnectionState) error {
		id, err := PeerIdentity(&cs)
		if err != nil {
			return err
		}
		if len(roles) > 0 && !slices.Contains(roles, id.Role) {
			return fmt.Errorf("pki: server %s has role %s, want %v", id, id.Role, roles)
		}
		return nil
	}), nil
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

// CertOptionalServerTLS is ServerTLSCertOptional: a port that also
// serves callers without a certificate (they prove themselves otherwise:
// a user token, a block token).
func (c *Credentials) CertOptionalServerTLS(roles ...Role) *tls.Config {
	return c.ServerTLSCertOptional(roles...)
}
