// Package pki is the cluster's service identity: an ECDSA P-256 cluster
// CA, node certificates that name a role and an ID, and the TLS 1.3
// configurations with which every internal port (meta and datanode gRPC,
// the raft transports, the stream port) authenticates both ends.
//
// An identity is one URI SAN in the certificate:
//
//	basalt://meta/<node id>        a metadata service node (its raft ID)
//	basalt://datanode/<uuid>       a datanode (the UUID it registers with)
//	basalt://client/<name>         a client: CLI, S3 or WebHDFS gateway, program
//
// Host names and IP addresses are not checked: a peer is who its
// certificate says, wherever it connects from, so certificates hold no
// addresses and survive a move. What a role may do is decided by the
// server that sees it (a meta node lets only a datanode certificate
// register, and only under its own UUID; a raft transport takes the
// sender's node ID from the certificate).
//
// Files: a CA directory holds ca.pem and ca-key.pem (0600); a node's TLS
// directory holds ca.pem, cert.pem and key.pem (0600). `basalt admin ca
// init|issue` writes them; `basalt dev` provisions a whole cluster's.
package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Role is what a certificate's holder is.
type Role string

// The roles.
const (
	RoleMeta     Role = "meta"
	RoleDatanode Role = "datanode"
	RoleClient   Role = "client"
)

// Valid reports whether r is one of the roles.
func (r Role) Valid() bool { return r == RoleMeta || r == RoleDatanode || r == RoleClient }

// scheme of identity URIs.
const scheme = "basalt"

// maxIDLen bounds an identity's ID.
const maxIDLen = 128

// Identity is a certificate holder: its role and its ID within the role.
type Identity struct {
	Role Role
	ID   string
}

func (id Identity) String() string { return scheme + "://" + string(id.Role) + "/" + id.ID }

// URI is the identity as a certificate's URI SAN.
func (id Identity) URI() *url.URL {
	return &url.URL{Scheme: scheme, Host: string(id.Role), Path: "/" + id.ID}
}

// Validate checks the role and that the ID is a plain name (letters,
// digits, '-', '_', '.').
func (id Identity) Validate() error {
	if !id.Role.Valid() {
		return fmt.Errorf("pki: role %q: want meta, datanode or client", id.Role)
	}
	if id.ID == "" || len(id.ID) > maxIDLen {
		return fmt.Errorf("pki: identity ID %q: want 1 to %d characters", id.ID, maxIDLen)
	}
	for _, c := range id.ID {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("pki: identity ID %q: only letters, digits, '-', '_' and '.'", id.ID)
		}
	}
	return nil
}

// ParseIdentity parses "basalt://role/id".
func ParseIdentity(s string) (Identity, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Identity{}, fmt.Errorf("pki: identity %q: %w", s, err)
	}
	return identityOfURI(u)
}

func identityOfURI(u *url.URL) (Identity, error) {
	if u.Scheme != scheme || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return Identity{}, fmt.Errorf("pki: %q is not a basalt identity", u)
	}
	id := Identity{Role: Role(u.Host), ID: strings.TrimPrefix(u.Path, "/")}
	if err := id.Validate(); err != nil {
		return Identity{}, err
	}
	return id, nil
}

// IdentityOf is the identity a certificate names: its only basalt:// URI
// SAN.
func IdentityOf(cert *x509.Certificate) (Identity, error) {
	var found []Identity
	for _, u := range cert.URIs {
		if u.Scheme != scheme {
			continue
		}
		id, err := identityOfURI(u)
		if err != nil {
			return Identity{}, err
		}
		found = append(found, id)
	}
	if len(found) != 1 {
		return Identity{}, fmt.Errorf("pki: certificate %q names %d basalt identities, want 1", cert.Subject.CommonName, len(found))
	}
	return found[0], nil
}

// Validity defaults.
const (
	CAValidity   = 10 * 365 * 24 * time.Hour
	NodeValidity = 365 * 24 * time.Hour
)

// CA is the cluster certificate authority.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	pem  []byte
}

// NewCA makes a CA with a fresh P-256 key.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"basalt"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(CAValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail
	}
	return n
}

// CA directory file names, and a node's TLS directory's.
const (
	CACertFile = "ca.pem"
	CAKeyFile  = "ca-key.pem"
	CertFile   = "cert.pem"
	KeyFile    = "key.pem"
)

// CertPEM is the CA certificate, PEM-encoded.
func (ca *CA) CertPEM() []byte { return ca.pem }

// Save writes ca.pem and ca-key.pem (0600) into dir; it refuses to
// replace an existing CA.
func (ca *CA) Save(dir string) error {
	if _, err := os.Stat(filepath.Join(dir, CAKeyFile)); err == nil {
		return fmt.Errorf("pki: %s already holds a CA key; not replacing it", dir)
	}
	kb, err := x509.MarshalECPrivateKey(ca.Key)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(dir, CAKeyFile), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, CACertFile), ca.pem, 0o644)
}

// LoadCA reads a CA saved by Save.
func LoadCA(dir string) (*CA, error) {
	cb, err := os.ReadFile(filepath.Join(dir, CACertFile))
	if err != nil {
		return nil, fmt.Errorf("pki: CA certificate: %w", err)
	}
	kb, err := os.ReadFile(filepath.Join(dir, CAKeyFile))
	if err != nil {
		return nil, fmt.Errorf("pki: CA key: %w", err)
	}
	cert, err := parseCert(cb)
	if err != nil {
		return nil, fmt.Errorf("pki: %s: %w", filepath.Join(dir, CACertFile), err)
	}
	kblk, _ := pem.Decode(kb)
	if kblk == nil {
		return nil, fmt.Errorf("pki: %s: no PEM block", filepath.Join(dir, CAKeyFile))
	}
	key, err := x509.ParseECPrivateKey(kblk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("pki: %s: %w", filepath.Join(dir, CAKeyFile), err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("pki: %s does not hold the key of %s", CAKeyFile, CACertFile)
	}
	return &CA{Cert: cert, Key: key, pem: cb}, nil
}

func parseCert(b []byte) (*x509.Certificate, error) {
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != "CERTIFICATE" {
		return nil, errors.New("no PEM certificate")
	}
	return x509.ParseCertificate(blk.Bytes)
}

// Issue makes credentials for id, signed by the CA: a fresh P-256 key and
// a certificate usable for both ends of a connection (a node serves and
// dials).
func (ca *CA) Issue(id Identity, validity time.Duration) (*Credentials, error) {
	if err := id.Validate(); err != nil {
		return nil, err
	}
	if validity <= 0 {
		validity = NodeValidity
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	notAfter := now.Add(validity)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: id.String(), Organization: []string{"basalt"}},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{id.URI()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return newCredentials(ca.pem, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}))
}

// Credentials are one holder's certificate and key and the cluster CA it
// trusts. The zero value is not usable; see Load, CA.Issue and Insecure.
//
// The certificate can be replaced while the credentials are in use
// (Swap, after a renewal): every TLS configuration made from them reads
// the current one at each handshake, so open connections stay and new
// ones present the new certificate. Peers whose certificate serial is in
// the revoked set (SetRevoked) are refused at every handshake, in both
// directions.
type Credentials struct {
	Identity Identity
	// NotAfter is the expiry of the certificate the credentials were made
	// with; Leaf().NotAfter is the current one's.
	NotAfter time.Time

	pool     *x509.CertPool
	caPEM    []byte
	insecure bool

	mu      sync.Mutex // certPEM, keyPEM, serializes Swap
	certPEM []byte
	keyPEM  []byte
	cert    atomic.Pointer[tls.Certificate]
	revoked atomic.Pointer[revokedSet]

	watchMu sync.Mutex
	watched map[string]map[net.Conn]string // peer serial → open connections (Watch) → the peer's identity
}

// revokedSet is the revoked serials and identities (SetRevoked).
type revokedSet struct {
	m       map[string]bool   // serials, and identities in Identity.String form
	ids     map[Identity]bool // the identities (nil: none)
	serials int               // entries of m that are not identities (0: no serial lookup)
}

func (r *revokedSet) empty() bool { return r == nil || len(r.m) == 0 }

// hasIdentity: cert names a revoked identity. Any basalt URI counts (a
// certificate with more than one is refused at the handshake anyway);
// no allocation: RefuseRevoked runs on every RPC.
func (r *revokedSet) hasIdentity(cert *x509.Certificate) bool {
	if r == nil || r.ids == nil {
		return false
	}
	for _, u := range cert.URIs {
		if u.Scheme == scheme && r.ids[Identity{Role: Role(u.Host), ID: strings.TrimPrefix(u.Path, "/")}] {
			return true
		}
	}
	return false
}

func newCredentials(caPEM, certPEM, keyPEM []byte) (*Credentials, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("pki: no CA certificate in the CA file")
	}
	c := &Credentials{pool: pool, caPEM: caPEM}
	cert, id, err := c.parseKeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	c.Identity, c.NotAfter, c.certPEM, c.keyPEM = id, cert.Leaf.NotAfter, certPEM, keyPEM
	c.cert.Store(cert)
	return c, nil
}

// parseKeyPair parses and checks a certificate and its key against the
// credentials' CA.
func (c *Credentials) parseKeyPair(certPEM, keyPEM []byte) (*tls.Certificate, Identity, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, Identity{}, fmt.Errorf("pki: certificate and key: %w", err)
	}
	leaf := cert.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, Identity{}, err
		}
		cert.Leaf = leaf
	}
	id, err := IdentityOf(leaf)
	if err != nil {
		return nil, Identity{}, err
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: c.pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		return nil, Identity{}, fmt.Errorf("pki: certificate of %s does not verify against the CA file: %w", id, err)
	}
	return &cert, id, nil
}

// New makes credentials from PEM: the CA certificate(s) to trust, a
// certificate and its key.
func New(caPEM, certPEM, keyPEM []byte) (*Credentials, error) {
	return newCredentials(caPEM, certPEM, keyPEM)
}

// Swap replaces the certificate and key (a renewed certificate): they
// must name the same identity and verify against the same CA. New
// handshakes use them; open connections are not touched.
func (c *Credentials) Swap(certPEM, keyPEM []byte) error {
	if c.IsInsecure() {
		return errors.New("pki: insecure credentials have no certificate")
	}
	cert, id, err := c.parseKeyPair(certPEM, keyPEM)
	if err != nil {
		return err
	}
	if id != c.Identity {
		return fmt.Errorf("pki: the new certificate is %s, these credentials are %s", id, c.Identity)
	}
	c.mu.Lock()
	c.certPEM, c.keyPEM = certPEM, keyPEM
	c.cert.Store(cert)
	c.mu.Unlock()
	return nil
}

// Leaf is the current certificate (nil for insecure credentials).
func (c *Credentials) Leaf() *x509.Certificate {
	if c.IsInsecure() {
		return nil
	}
	return c.cert.Load().Leaf
}

// CAPEM is the trusted CA certificate(s), PEM-encoded.
func (c *Credentials) CAPEM() []byte { return c.caPEM }

// SetRevoked replaces the set of revoked certificate serials (SerialString
// form): a peer presenting one of them is refused at the handshake. An
// entry that is an identity (basalt://meta/3, Identity.String) revokes
// every certificate naming it, whatever its serial: a removed meta node's
// ID, which never comes back, including certificates the CA never
// recorded (made offline with basalt admin ca issue).
//
// Connections registered with Watch whose peer presented one of them are
// closed: a connection opened before the revocation does not outlive it.
func (c *Credentials) SetRevoked(serials []string) {
	r := &revokedSet{m: make(map[string]bool, len(serials))}
	for _, s := range serials {
		r.m[s] = true
		if !strings.HasPrefix(s, scheme+"://") {
			r.serials++
			continue
		}
		if id, err := ParseIdentity(s); err != nil {
			r.serials++ // not an identity: looked up as a serial, as before
		} else {
			if r.ids == nil {
				r.ids = map[Identity]bool{}
			}
			r.ids[id] = true
			r.m[id.String()] = true // what Watch records
		}
	}
	c.revoked.Store(r)
	var doomed []net.Conn
	c.watchMu.Lock()
	for serial, conns := range c.watched {
		for conn, id := range conns {
			if r.m[serial] || (r.ids != nil && id != "" && r.m[id]) {
				doomed = append(doomed, conn)
			}
		}
	}
	c.watchMu.Unlock()
	for _, conn := range doomed {
		conn.Close()
	}
}

// Watch registers an authenticated connection (its raw TCP connection,
// so that closing never waits on a TLS write) under its peer
// certificate's serial until stop is called: if that serial is revoked
// (SetRevoked), now or later, the connection is closed. Connections
// without a peer certificate are not watched. stop must be called when
// the connection is done with.
func (c *Credentials) Watch(conn net.Conn, cs *tls.ConnectionState) (stop func()) {
	if c.IsInsecure() || cs == nil || len(cs.PeerCertificates) == 0 {
		return func() {}
	}
	serial := SerialString(cs.PeerCertificates[0].SerialNumber)
	var ident string
	if id, err := IdentityOf(cs.PeerCertificates[0]); err == nil {
		ident = id.String()
	}
	c.watchMu.Lock()
	if c.watched == nil {
		c.watched = map[string]map[net.Conn]string{}
	}
	conns := c.watched[serial]
	if conns == nil {
		conns = map[net.Conn]string{}
		c.watched[serial] = conns
	}
	conns[conn] = ident
	c.watchMu.Unlock()
	// After registering: a SetRevoked that ran before saw no entry, but
	// its set is visible here.
	if c.IsRevoked(cs.PeerCertificates[0]) {
		conn.Close()
	}
	return func() {
		c.watchMu.Lock()
		if conns := c.watched[serial]; conns != nil {
			delete(conns, conn)
			if len(conns) == 0 {
				delete(c.watched, serial)
			}
		}
		c.watchMu.Unlock()
	}
}

// Watched is the number of connections Watch tracks now.
func (c *Credentials) Watched() int {
	c.watchMu.Lock()
	defer c.watchMu.Unlock()
	n := 0
	for _, conns := range c.watched {
		n += len(conns)
	}
	return n
}

// WatchedOf is the number of connections Watch tracks now whose peer is
// identity (Identity.String).
func (c *Credentials) WatchedOf(identity string) int {
	c.watchMu.Lock()
	defer c.watchMu.Unlock()
	n := 0
	for _, conns := range c.watched {
		for _, id := range conns {
			if id == identity {
				n++
			}
		}
	}
	return n
}

// IsRevoked reports whether cert's serial, or the identity it names, is
// in the revoked set.
func (c *Credentials) IsRevoked(cert *x509.Certificate) bool {
	if c == nil {
		return false
	}
	r := c.revoked.Load()
	if r.empty() {
		return false
	}
	// The identity first: it allocates nothing. The serial's string form
	// allocates, so it is made only when a serial is revoked (a cluster
	// that only removed meta nodes has identities alone).
	if r.hasIdentity(cert) {
		return true
	}
	return r.serials > 0 && r.m[SerialString(cert.SerialNumber)]
}

// IsRevokedSerial reports whether serial (SerialString form) is in the
// revoked set (false for nil credentials).
func (c *Credentials) IsRevokedSerial(serial string) bool {
	if c == nil {
		return false
	}
	r := c.revoked.Load()
	return !r.empty() && r.m[serial]
}

// SerialString is a certificate serial as Basalt prints and records it:
// lower-case hexadecimal without leading zeros.
func SerialString(n *big.Int) string { return n.Text(16) }

// ParseSerial normalizes a serial given in hexadecimal (openssl's
// upper-case, colon-separated or 0x-prefixed forms too) to SerialString.
func ParseSerial(s string) (string, error) {
	t := strings.ToLower(strings.ReplaceAll(strings.TrimPrefix(strings.TrimSpace(s), "0x"), ":", ""))
	n, ok := new(big.Int).SetString(t, 16)
	if !ok || t == "" || len(t) > 64 || n.Sign() <= 0 {
		return "", fmt.Errorf("pki: serial %q: want a positive hexadecimal number", s)
	}
	return SerialString(n), nil
}

// Load reads ca.pem, cert.pem and key.pem from a TLS directory.
func Load(dir string) (*Credentials, error) {
	read := func(name string) ([]byte, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, fmt.Errorf("pki: %w (a TLS directory holds %s, %s and %s: see `basalt admin ca issue`)", err, CACertFile, CertFile, KeyFile)
		}
		return b, nil
	}
	ca, err := read(CACertFile)
	if err != nil {
		return nil, err
	}
	cert, err := read(CertFile)
	if err != nil {
		return nil, err
	}
	key, err := read(KeyFile)
	if err != nil {
		return nil, err
	}
	c, err := newCredentials(ca, cert, key)
	if err != nil {
		return nil, fmt.Errorf("%w (in %s)", err, dir)
	}
	return c, nil
}

// Save writes ca.pem, cert.pem and key.pem (0600) into dir.
func (c *Credentials) Save(dir string) error {
	if c.insecure {
		return errors.New("pki: insecure credentials have nothing to save")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	c.mu.Lock()
	certPEM, keyPEM := c.certPEM, c.keyPEM
	c.mu.Unlock()
	if err := writeFile(filepath.Join(dir, KeyFile), keyPEM, 0o600); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(dir, CertFile), certPEM, 0o644); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, CACertFile), c.caPEM, 0o644)
}

// writeFile writes aside, syncs and renames, so a crash leaves the old
// file or the whole new one.
func writeFile(path string, b []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("pki: writing %s: %w", path, err)
	}
	return nil
}

// Insecure returns credentials that switch authentication off: servers
// accept plaintext connections from anyone and clients dial in plaintext.
// Only for measuring what TLS costs; every caller must say so loudly.
func Insecure() *Credentials { return &Credentials{insecure: true} }

// IsInsecure reports whether c switches authentication off.
func (c *Credentials) IsInsecure() bool { return c == nil || c.insecure }

// ServerTLS is the configuration of a server that requires a client
// certificate from the cluster CA whose role is one of roles (none: any
// role). TLS 1.3 only.
func (c *Credentials) ServerTLS(roles ...Role) *tls.Config {
	return &tls.Config{
		MinVersion:     tls.VersionTLS13,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return c.cert.Load(), nil },
		ClientAuth:     tls.RequireAndVerifyClientCert,
		ClientCAs:      c.pool,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := c.checkPeer(cs, roles)
			return err
		},
	}
}

// ServerTLSCertOptional is ServerTLS for a server some of whose calls
// need no client certificate (the metadata service's, where a new node
// presents a bootstrap token to get its first certificate): a client
// certificate, if given, must verify as with ServerTLS; without one the
// connection has no identity (CallIdentity reports none) and every call
// that needs one is refused by RequireRole.
func (c *Credentials) ServerTLSCertOptional(roles ...Role) *tls.Config {
	cfg := c.ServerTLS(roles...)
	cfg.ClientAuth = tls.VerifyClientCertIfGiven
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return nil
		}
		_, err := c.checkPeer(cs, roles)
		return err
	}
	return cfg
}

// ClientTLS is the configuration of a client that presents its
// certificate and accepts a server whose certificate is from the cluster
// CA with a role among roles (none: any role). Host names are not checked
// (certificates name identities, not addresses): callers that know which
// node they dial check its identity in the connection state.
func (c *Credentials) ClientTLS(roles ...Role) *tls.Config {
	cfg := ServerVerifyingTLS(c.pool, func(cs tls.ConnectionState) error {
		_, err := c.checkPeer(cs, roles)
		return err
	})
	cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return c.cert.Load(), nil }
	return cfg
}

// ServerVerifyingTLS is a client configuration that presents no
// certificate and accepts a server whose certificate verifies against
// pool (without a host name), then runs check (nil: none).
func ServerVerifyingTLS(pool *x509.CertPool, check func(tls.ConnectionState) error) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The chain is verified in VerifyConnection, against the cluster
		// CA and without a host name.
		InsecureSkipVerify: true,
		// Resumed sessions skip the signatures of a full handshake (a V2
		// stream is a new connection per block).
		ClientSessionCache: tls.NewLRUClientSessionCache(256),
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
			if check != nil {
				return check(cs)
			}
			return nil
		},
	}
}

// checkPeer checks a verified peer: one identity, a role among roles,
// and a serial that is not revoked.
func (c *Credentials) checkPeer(cs tls.ConnectionState, roles []Role) (Identity, error) {
	id, err := PeerIdentity(&cs)
	if err != nil {
		return Identity{}, err
	}
	if len(roles) > 0 && !slices.Contains(roles, id.Role) {
		return Identity{}, fmt.Errorf("pki: peer %s has role %s, want %v", id, id.Role, roles)
	}
	if c.IsRevoked(cs.PeerCertificates[0]) {
		return Identity{}, fmt.Errorf("pki: the certificate of %s (serial %s) is revoked", id, SerialString(cs.PeerCertificates[0].SerialNumber))
	}
	return id, nil
}

// PeerIdentity is the identity in a verified connection's peer
// certificate.
func PeerIdentity(cs *tls.ConnectionState) (Identity, error) {
	if cs == nil || len(cs.PeerCertificates) == 0 {
		return Identity{}, errors.New("pki: the peer presented no certificate")
	}
	return IdentityOf(cs.PeerCertificates[0])
}

// AuthenticateNodeID is the raft transport's check for nodes whose
// certificate ID is their raft node ID (meta nodes): the verified peer
// certificate must have role and ID id, and known(id) must hold (so a
// certificate of a node that is not a member opens nothing).
func AuthenticateNodeID(role Role, known func(id uint64) bool) func(id uint64, cs *tls.ConnectionState) error {
	return func(id uint64, cs *tls.ConnectionState) error {
		pid, err := PeerIdentity(cs)
		if err != nil {
			return err
		}
		if pid.Role != role || pid.ID != strconv.FormatUint(id, 10) {
			return fmt.Errorf("pki: certificate of %s, not of %s node %d", pid, role, id)
		}
		if !known(id) {
			return fmt.Errorf("pki: %s node %d is not a member", role, id)
		}
		return nil
	}
}

// GatewayPrefix marks a gateway's certificate: a client identity whose ID
// starts with it (basalt://client/gateway-s3). A gateway authenticates
// its own end users (S3 signatures, WebHDFS user.name) and the metadata
// service lets it act for them; so client IDs with this prefix must be
// issued to gateways only, and a gateway is as trusted as an admin.
const GatewayPrefix = "gateway-"

// IsGateway reports whether id is a gateway's.
func (id Identity) IsGateway() bool {
	return id.Role == RoleClient && strings.HasPrefix(id.ID, GatewayPrefix)
}
