package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"
)

// Certificates issued by the metadata service (the cluster CA kept in
// Raft, internal/meta/ca.go): a node makes its own key and sends a
// certificate signing request (NewCSR); the CA signs it for the identity
// the service decides (SignCSR). The private key never leaves the node.

// MaxCSRBytes bounds a CSR (a P-256 CSR is about 300 bytes).
const MaxCSRBytes = 4096

// NewCSR makes a fresh P-256 key and a CSR for id; it returns the key
// (PEM) and the CSR (DER).
func NewCSR(id Identity) (keyPEM, csrDER []byte, err error) {
	if err := id.Validate(); err != nil {
		return nil, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	csrDER, err = x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: id.String(), Organization: []string{"basalt"}},
		URIs:    []*url.URL{id.URI()},
	}, key)
	if err != nil {
		return nil, nil, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), csrDER, nil
}

// ParseCSR parses and checks a CSR: bounded, self-signed correctly, a
// P-256 key. It returns the identity the CSR asks for (ok=false if it
// names none or an invalid one: the CA may choose one).
func ParseCSR(der []byte) (csr *x509.CertificateRequest, asked Identity, ok bool, err error) {
	if len(der) == 0 || len(der) > MaxCSRBytes {
		return nil, Identity{}, false, fmt.Errorf("pki: CSR of %d bytes: want 1 to %d", len(der), MaxCSRBytes)
	}
	if csr, err = x509.ParseCertificateRequest(der); err != nil {
		return nil, Identity{}, false, fmt.Errorf("pki: CSR: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, Identity{}, false, fmt.Errorf("pki: CSR signature: %w", err)
	}
	pub, isEC := csr.PublicKey.(*ecdsa.PublicKey)
	if !isEC || pub.Curve != elliptic.P256() {
		return nil, Identity{}, false, errors.New("pki: CSR key: want ECDSA P-256")
	}
	if len(csr.URIs) == 1 {
		if id, err := identityOfURI(csr.URIs[0]); err == nil {
			return csr, id, true, nil
		}
	}
	return csr, Identity{}, false, nil
}

// SignCSR issues a certificate for id with the CSR's public key. It
// returns the certificate (PEM) and its serial (SerialString).
func (ca *CA) SignCSR(csr *x509.CertificateRequest, id Identity, validity time.Duration) (certPEM []byte, serialHex string, notAfter time.Time, err error) {
	if err := id.Validate(); err != nil {
		return nil, "", time.Time{}, err
	}
	if validity <= 0 {
		validity = NodeValidity
	}
	now := time.Now()
	notAfter = now.Add(validity)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	sn := serial()
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{CommonName: id.String(), Organization: []string{"basalt"}},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{id.URI()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, csr.PublicKey, ca.Key)
	if err != nil {
		return nil, "", time.Time{}, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), SerialString(sn), notAfter, nil
}

// MarshalKey is the CA key in DER (SEC 1).
func (ca *CA) MarshalKey() ([]byte, error) { return x509.MarshalECPrivateKey(ca.Key) }

// CAFromDER rebuilds a CA from its certificate and key (DER), checking
// that they belong together.
func CAFromDER(certDER, keyDER []byte) (*CA, error) {
	cert, err := x509.ParseCertificate(certDER)
	if err != nil {
		return nil, fmt.Errorf("pki: CA certificate: %w", err)
	}
	if !cert.IsCA {
		return nil, errors.New("pki: the CA certificate is not a CA's")
	}
	key, err := x509.ParseECPrivateKey(keyDER)
	if err != nil {
		return nil, fmt.Errorf("pki: CA key: %w", err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, errors.New("pki: the CA key does not match the CA certificate")
	}
	return &CA{Cert: cert, Key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: certDER})}, nil
}

// Fingerprint is the SHA-256 of a certificate's DER, in hexadecimal (what
// a bootstrap token carries to authenticate the CA, as kubeadm's
// discovery-token-ca-cert-hash).
func Fingerprint(der []byte) string {
	h := sha256.Sum256(der)
	return hex.EncodeToString(h[:])
}

// Fingerprint is the CA certificate's.
func (ca *CA) Fingerprint() string { return Fingerprint(ca.Cert.Raw) }

// BootstrapToken is a one-time credential with which a new node gets its
// first certificate: an ID (how the metadata service finds it), a secret
// (stored there only as its SHA-256) and the fingerprint of the cluster
// CA (with which the node authenticates the metadata service before it
// sends the secret). Its text form is
//
//	bt1.<id: 16 hex>.<secret: 32 hex>.<CA SHA-256: 64 hex>
type BootstrapToken struct {
	ID, Secret, CAHash string
}

const tokenPrefix = "bt1"

// NewBootstrapToken makes a token with a random ID and secret for the CA
// with fingerprint caHash.
func NewBootstrapToken(caHash string) BootstrapToken {
	var id [8]byte
	var sec [16]byte
	rand.Read(id[:])
	rand.Read(sec[:])
	return BootstrapToken{ID: hex.EncodeToString(id[:]), Secret: hex.EncodeToString(sec[:]), CAHash: caHash}
}

func (t BootstrapToken) String() string {
	return tokenPrefix + "." + t.ID + "." + t.Secret + "." + t.CAHash
}

// SecretHash is what the metadata service stores of the secret.
func (t BootstrapToken) SecretHash() []byte {
	h := sha256.Sum256([]byte(t.Secret))
	return h[:]
}

// SecretMatches compares the secret's hash with hash in constant time.
func (t BootstrapToken) SecretMatches(hash []byte) bool {
	return subtle.ConstantTimeCompare(t.SecretHash(), hash) == 1
}

// ParseBootstrapToken parses the text form (the CA hash may be absent
// when only the ID and secret travel: "bt1.<id>.<secret>").
func ParseBootstrapToken(s string) (BootstrapToken, error) {
	if len(s) > 256 {
		return BootstrapToken{}, fmt.Errorf("pki: bootstrap token of %d bytes: too long", len(s))
	}
	parts := strings.Split(strings.TrimSpace(s), ".")
	if (len(parts) != 4 && len(parts) != 3) || parts[0] != tokenPrefix {
		return BootstrapToken{}, errors.New("pki: bootstrap token: want bt1.<id>.<secret>.<CA sha256>")
	}
	t := BootstrapToken{ID: parts[1], Secret: parts[2]}
	if len(parts) == 4 {
		t.CAHash = parts[3]
	}
	if !isHex(t.ID, 16) || !isHex(t.Secret, 32) || (t.CAHash != "" && !isHex(t.CAHash, 64)) {
		return BootstrapToken{}, errors.New("pki: bootstrap token: malformed (want bt1.<16 hex>.<32 hex>.<64 hex>)")
	}
	return t, nil
}

func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// PoolWithFingerprint parses PEM certificates and returns a pool of the
// one whose fingerprint is hash, with its PEM; an error if none has it.
func PoolWithFingerprint(caPEM []byte, hash string) (*x509.CertPool, []byte, error) {
	rest := caPEM
	for {
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			return nil, nil, fmt.Errorf("pki: no CA certificate with SHA-256 %s (the token's): the service is not the cluster's, or the token is not for this cluster", hash)
		}
		if blk.Type != "CERTIFICATE" || subtle.ConstantTimeCompare([]byte(Fingerprint(blk.Bytes)), []byte(hash)) != 1 {
			continue
		}
		cert, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, nil, err
		}
		pool := x509.NewCertPool()
		pool.AddCert(cert)
		return pool, pem.EncodeToMemory(blk), nil
	}
}

// SecretHashesEqual compares two stored secret hashes in constant time.
func SecretHashesEqual(a, b []byte) bool {
	return len(a) == sha256.Size && subtle.ConstantTimeCompare(a, b) == 1
}
