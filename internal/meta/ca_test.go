package meta

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/pki/enroll"
)

var testSealSecret = []byte("meta test CA key sealing secret, 32+ bytes")

// newCACluster is n meta nodes that import testCA() into Raft, its key
// sealed.
func newCACluster(t *testing.T, n int, tweak func(*Config)) *cluster {
	return newClusterWith(t, n, scm.Config{}, func(cfg *Config) {
		cfg.CA, cfg.CAKeySecret = testCA(), testSealSecret
		if tweak != nil {
			tweak(cfg)
		}
	})
}

func (c *cluster) caLeader() *Server {
	for _, s := range c.servers {
		if s.ca.group.IsLeader() {
			return s
		}
	}
	return nil
}

func waitCA(t *testing.T, c *cluster) {
	t.Helper()
	waitFor(t, 20*time.Second, "the CA recorded on every node", func() bool {
		for _, s := range c.servers {
			if ca, _, _ := s.ca.state.CA(); ca == nil {
				return false
			}
		}
		return true
	})
}

func newToken(t *testing.T, cl *metaclient.Client, req *metapb.CreateBootstrapTokenRequest) string {
	t.Helper()
	resp, err := cl.Ca.CreateBootstrapToken(context.Background(), req)
	if err != nil {
		t.Fatalf("CreateBootstrapToken: %v", err)
	}
	return resp.GetToken()
}

// credsClient is a meta client that authenticates with creds and does not
// retry (a refused handshake is the answer).
func credsClient(t *testing.T, addrs []string, creds *pki.Credentials) *metaclient.Client {
	t.Helper()
	mc, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 5 * time.Second, MaxAttempts: 1,
		DialOptions: []grpc.DialOption{creds.GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mc.Close() })
	return mc
}

func TestCARecordedOnceOnEveryNodeAndAfterFailover(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	for id, s := range c.servers {
		ca, der, err := s.ca.state.CA()
		if err != nil || !bytes.Equal(der, testCA().Cert.Raw) || !ca.Key.Equal(testCA().Key) {
			t.Fatalf("node %d: CA %v, err %v: not the imported one", id, ca != nil, err)
		}
		// The key is sealed in the store (and so in snapshots and the log).
		rec := &metapb.CaInitOp{}
		if err := s.ca.state.st.View(func(r pebble.Reader) error {
			v, closer, err := r.Get(caKeyCA)
			if err != nil {
				return err
			}
			defer closer.Close()
			return proto.Unmarshal(v, rec)
		}); err != nil {
			t.Fatal(err)
		}
		raw, _ := testCA().MarshalKey()
		if !rec.GetKeySealed() || bytes.Contains(rec.GetKey(), raw) {
			t.Fatalf("node %d: CA key stored in the clear", id)
		}
	}
	// A second CA proposed later changes nothing: the first one recorded
	// stays the cluster's.
	other, _ := pki.NewCA("other")
	l := c.caLeader()
	if l == nil {
		t.Fatal("no CA leader")
	}
	key, _ := other.MarshalKey()
	if _, err := l.ca.propose(context.Background(), &metapb.CaCommand{Op: &metapb.CaCommand_Init{Init: &metapb.CaInitOp{CertDer: other.Cert.Raw, Key: key}}}); err != nil {
		t.Fatal(err)
	}
	cl := c.client()
	tok := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{})

	// The CA group's leader goes away; the token and the CA are on the others.
	old := l.cfg.NodeID
	l.Close()
	delete(c.servers, old)
	waitFor(t, 20*time.Second, "a new CA leader", func() bool { return c.caLeader() != nil })
	for id, s := range c.servers {
		if _, der, _ := s.ca.state.CA(); !bytes.Equal(der, testCA().Cert.Raw) {
			t.Fatalf("node %d: the CA changed", id)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	creds, err := enroll.Bootstrap(ctx, c.addrs(), tok, pki.RoleDatanode)
	if err != nil {
		t.Fatalf("bootstrap after failover: %v", err)
	}
	if creds.Identity.Role != pki.RoleDatanode || len(creds.Identity.ID) != 32 {
		t.Fatalf("issued %s", creds.Identity)
	}
	if _, err := credsClient(t, c.addrs(), creds).Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); err != nil {
		t.Fatalf("the issued certificate is refused: %v", err)
	}
}

func TestCAKeySealing(t *testing.T) {
	ca := testCA()
	key, _ := ca.MarshalKey()
	sealed, err := sealCAKey(sealKey(testSealSecret), key, ca.Cert.Raw)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := openSealed(sealKey(testSealSecret), sealed, ca.Cert.Raw); err != nil || !bytes.Equal(got, key) {
		t.Fatalf("unseal: %v", err)
	}
	if _, err := openSealed(sealKey([]byte("another secret")), sealed, ca.Cert.Raw); err == nil {
		t.Fatal("unsealed with the wrong secret")
	}
	other, _ := pki.NewCA("other")
	if _, err := openSealed(sealKey(testSealSecret), sealed, other.Cert.Raw); err == nil {
		t.Fatal("unsealed for another certificate")
	}
}

func TestBootstrapTokenRefusals(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	addrs := c.addrs()

	tok := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{Role: "datanode", TtlMs: time.Hour.Milliseconds()})
	if _, err := enroll.Bootstrap(ctx, addrs, tok, pki.RoleDatanode); err != nil {
		t.Fatal(err)
	}
	if _, err := enroll.Bootstrap(ctx, addrs, tok, pki.RoleDatanode); status.Code(errors.Unwrap(err)) != codes.PermissionDenied || !strings.Contains(err.Error(), "already used") {
		t.Fatalf("token used twice: %v", err)
	}

	// Racing: one token, eight requests at once (connections made first,
	// then released together), one certificate.
	tok = newToken(t, cl, &metapb.CreateBootstrapTokenRequest{})
	pool, _, err := pki.PoolWithFingerprint(testCA().CertPEM(), testCA().Fingerprint())
	if err != nil {
		t.Fatal(err)
	}
	var wins, denied atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 8 {
		anon, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 20 * time.Second,
			DialOptions: []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(pki.ServerVerifyingTLS(pool, nil)))}})
		if err != nil {
			t.Fatal(err)
		}
		defer anon.Close()
		if _, err := anon.Ca.GetCaCertificate(ctx, &metapb.GetCaCertificateRequest{}); err != nil {
			t.Fatal(err)
		}
		_, csr, _ := pki.NewCSR(pki.Identity{Role: pki.RoleDatanode, ID: "new"})
		req := &metapb.IssueCertificateRequest{Token: tok, CsrDer: csr}
		anon.Ca.IssueCertificate(ctx, &metapb.IssueCertificateRequest{}) // find the leader
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, err := anon.Ca.IssueCertificate(ctx, req)
			switch {
			case err == nil:
				wins.Add(1)
			case status.Code(err) == codes.PermissionDenied:
				denied.Add(1)
			default:
				t.Errorf("racing bootstrap: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if wins.Load() != 1 || denied.Load() != 7 {
		t.Fatalf("racing one token: %d certificates, %d refused; want 1 and 7", wins.Load(), denied.Load())
	}

	expired := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{TtlMs: 1})
	time.Sleep(20 * time.Millisecond)
	if _, err := enroll.Bootstrap(ctx, addrs, expired, pki.RoleDatanode); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("expired token: %v", err)
	}

	good, _ := pki.ParseBootstrapToken(newToken(t, cl, &metapb.CreateBootstrapTokenRequest{}))
	forged := good
	forged.Secret = strings.Repeat("0", 32)
	if _, err := enroll.Bootstrap(ctx, addrs, forged.String(), pki.RoleDatanode); err == nil || !strings.Contains(err.Error(), "PermissionDenied") {
		t.Fatalf("forged secret: %v", err)
	}
	made := pki.NewBootstrapToken(good.CAHash)
	if _, err := enroll.Bootstrap(ctx, addrs, made.String(), pki.RoleDatanode); err == nil || !strings.Contains(err.Error(), "PermissionDenied") {
		t.Fatalf("made-up token: %v", err)
	}
	// A token naming another CA: the node does not even send it.
	other, _ := pki.NewCA("other")
	wrongCA := good
	wrongCA.CAHash = other.Fingerprint()
	if _, err := enroll.Bootstrap(ctx, addrs, wrongCA.String(), pki.RoleDatanode); err == nil || !strings.Contains(err.Error(), "no CA certificate with SHA-256") {
		t.Fatalf("token of another CA: %v", err)
	}
	// The forged attempts did not burn the real token.
	if _, err := enroll.Bootstrap(ctx, addrs, good.String(), pki.RoleDatanode); err != nil {
		t.Fatalf("the real token after forged ones: %v", err)
	}

	// One meta address is enough, leader or not: followers forward the
	// token calls to the CA group's leader.
	for _, a := range addrs {
		one, err := metaclient.New(metaclient.Config{Addrs: []string{a}, CallTimeout: 20 * time.Second, DialOptions: clientDial()})
		if err != nil {
			t.Fatal(err)
		}
		defer one.Close()
		tk := newToken(t, one, &metapb.CreateBootstrapTokenRequest{})
		if _, err := enroll.Bootstrap(ctx, []string{a}, tk, pki.RoleDatanode); err != nil {
			t.Fatalf("bootstrap through %s alone: %v", a, err)
		}
	}

	// A datanode token does not make a client certificate, and a client
	// token names its client.
	if _, err := cl.Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{Role: "client"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("client token without an ID: %v", err)
	}
	ct := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{Role: "client", IdentityId: "alice"})
	alice, err := enroll.Bootstrap(ctx, addrs, ct, pki.RoleClient)
	if err != nil || alice.Identity != (pki.Identity{Role: pki.RoleClient, ID: "alice"}) {
		t.Fatalf("client bootstrap: %v %v", alice, err)
	}
	// alice is no admin: she may not make tokens or revoke.
	if _, err := credsClient(t, addrs, alice).Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("non-admin token: %v", err)
	}
	if _, err := credsClient(t, addrs, alice).Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: "1"}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("non-admin revoke: %v", err)
	}

	// Without a client certificate only the two bootstrap calls are served.
	anon, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 5 * time.Second, MaxAttempts: 3,
		DialOptions: []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(pki.ServerVerifyingTLS(pool, nil)))}})
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	if _, err := anon.Ca.GetCaCertificate(ctx, &metapb.GetCaCertificateRequest{}); err != nil {
		t.Fatalf("GetCaCertificate without a certificate: %v", err)
	}
	for name, call := range map[string]func() error{
		"ListVolumes": func() error { _, err := anon.Namespace.ListVolumes(ctx, &metapb.ListVolumesRequest{}); return err },
		"GetSafeMode": func() error { _, err := anon.Scm.GetSafeMode(ctx, &metapb.GetSafeModeRequest{}); return err },
		"CreateBootstrapToken": func() error {
			_, err := anon.Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{})
			return err
		},
		"RenewCertificate": func() error { _, err := anon.Ca.RenewCertificate(ctx, &metapb.RenewCertificateRequest{}); return err },
		"GetRevocations":   func() error { _, err := anon.Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); return err },
	} {
		if err := call(); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s without a client certificate: %v, want Unauthenticated", name, err)
		}
	}
}

func TestRenewalSwapsCertificateInPlace(t *testing.T) {
	// Certificates live 10 s (plus the 5 min back-dating): due at once.
	c := newCACluster(t, 1, func(cfg *Config) { cfg.CertValidity = 10 * time.Second })
	waitCA(t, c)
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	creds, err := enroll.Bootstrap(ctx, c.addrs(), newToken(t, cl, &metapb.CreateBootstrapTokenRequest{}), pki.RoleDatanode)
	if err != nil {
		t.Fatal(err)
	}
	oldSerial := pki.SerialString(creds.Leaf().SerialNumber)
	mc := credsClient(t, c.addrs(), creds)
	if _, err := mc.Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); err != nil {
		t.Fatal(err)
	}
	var saved atomic.Int32
	a := &enroll.Agent{Creds: creds, Addrs: c.addrs(), Interval: 50 * time.Millisecond, Logger: quiet,
		Save: func(*pki.Credentials) error { saved.Add(1); return nil }}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	actx, acancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { a.Run(actx); close(done) }()
	waitFor(t, 20*time.Second, "a renewal", func() bool { return a.Renewals.Load() > 0 })
	acancel()
	<-done
	if s := pki.SerialString(creds.Leaf().SerialNumber); s == oldSerial || creds.Identity.Role != pki.RoleDatanode || saved.Load() == 0 {
		t.Fatalf("after renewal: serial %s (was %s), saved %d", s, oldSerial, saved.Load())
	}
	// The connection made with the old certificate still serves.
	if _, err := mc.Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); err != nil {
		t.Fatalf("old connection after the swap: %v", err)
	}
	// The old serial revoked: new connections present the new certificate
	// and are let in.
	if _, err := cl.Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: oldSerial}); err != nil {
		t.Fatal(err)
	}
	if _, err := credsClient(t, c.addrs(), creds).Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); err != nil {
		t.Fatalf("new connection with the renewed certificate: %v", err)
	}
	// Only one's own identity is renewed. (A new client: the gRPC server
	// closes the connections made with the revoked old certificate.)
	_, csr, _ := pki.NewCSR(pki.Identity{Role: pki.RoleDatanode, ID: "someone-else"})
	if _, err := credsClient(t, c.addrs(), creds).Ca.RenewCertificate(ctx, &metapb.RenewCertificateRequest{CsrDer: csr}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("renewing another identity: %v", err)
	}
}

func TestRevokedCertificateRefusedByMeta(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	addrs := c.addrs()
	x, err := enroll.Bootstrap(ctx, addrs, newToken(t, cl, &metapb.CreateBootstrapTokenRequest{}), pki.RoleDatanode)
	if err != nil {
		t.Fatal(err)
	}
	y, err := enroll.Bootstrap(ctx, addrs, newToken(t, cl, &metapb.CreateBootstrapTokenRequest{}), pki.RoleDatanode)
	if err != nil {
		t.Fatal(err)
	}
	accepted := func(creds *pki.Credentials, addr string) error {
		_, err := credsClient(t, []string{addr}, creds).Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{})
		return err
	}
	for _, a := range addrs {
		if err := accepted(x, a); err != nil {
			t.Fatalf("before revocation, %s refused: %v", a, err)
		}
	}
	// A connection made before the revocation.
	pre := credsClient(t, addrs[:1], x)
	if _, err := pre.Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); err != nil {
		t.Fatal(err)
	}
	r, err := cl.Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: strings.ToUpper(pki.SerialString(x.Leaf().SerialNumber))})
	if err != nil || len(r.GetSerials()) != 1 {
		t.Fatalf("revoke: %v %v", r, err)
	}
	r, err = cl.Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Identity: y.Identity.String()})
	if err != nil || len(r.GetSerials()) != 1 || r.GetSerials()[0] != pki.SerialString(y.Leaf().SerialNumber) {
		t.Fatalf("revoke by identity: %v %v", r, err)
	}
	for _, a := range addrs {
		for _, creds := range []*pki.Credentials{x, y} {
			waitFor(t, 20*time.Second, "meta "+a+" to refuse "+creds.Identity.String(), func() bool { return accepted(creds, a) != nil })
		}
		// Others still get in.
		if err := accepted(testCreds(pki.RoleClient, "test"), a); err != nil {
			t.Fatalf("%s refuses an unrevoked certificate: %v", a, err)
		}
	}
	// The connection opened before is closed (the gRPC server watches
	// its connections: pki.Credentials.Watch), and a new one is refused;
	// were it still open, its calls would be refused (RefuseRevoked).
	_, err = pre.Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{})
	code := status.Code(err)
	if code == codes.Unknown && strings.Contains(err.Error(), "code = Unavailable") {
		code = codes.Unavailable // metaclient: "outcome unknown" around a connection error
	}
	switch code {
	case codes.PermissionDenied: // still open: the call refused
		if !strings.Contains(err.Error(), "revoked") {
			t.Fatalf("a call on a connection opened before the revocation: %v, want refused as revoked", err)
		}
	case codes.Unavailable: // closed, and the new handshake refused
		for _, s := range c.servers {
			if s.GRPCAddr() == addrs[0] {
				if n := s.cfg.TLS.WatchedOf(x.Identity.String()); n != 0 {
					t.Fatalf("Unavailable, but node %d still watches %d connection(s) of %s", s.cfg.NodeID, n, x.Identity)
				}
			}
		}
	default:
		t.Fatalf("a call on a connection opened before the revocation: %v, want Unavailable (closed) or PermissionDenied (revoked)", err)
	}
	// The handshake itself fails: a raw TLS connection is refused.
	conn, err := tls.Dial("tcp", addrs[0], x.ClientTLS(pki.RoleMeta))
	if err == nil {
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("raw TLS with a revoked certificate: %v", err)
	}
}

// TestCAStateSurvivesRestart: the CA, tokens and revocations come back
// from the CA store after a restart, with no CA given to the node.
func TestCAStateSurvivesRestart(t *testing.T) {
	importCA := true
	c := newClusterWith(t, 1, scm.Config{}, func(cfg *Config) {
		cfg.CAKeySecret = testSealSecret
		if importCA {
			cfg.CA = testCA()
		}
	})
	waitCA(t, c)
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	used := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{})
	x, err := enroll.Bootstrap(ctx, c.addrs(), used, pki.RoleDatanode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: pki.SerialString(x.Leaf().SerialNumber)}); err != nil {
		t.Fatal(err)
	}
	unused := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{})

	importCA = false
	c.servers[1].Close()
	c.servers[1] = c.newServer(1)
	c.wire()
	if err := c.servers[1].Start(); err != nil {
		t.Fatal(err)
	}
	if ca, _, err := c.servers[1].ca.state.CA(); ca == nil || err != nil || !ca.Key.Equal(testCA().Key) {
		t.Fatalf("CA after restart: %v %v", ca != nil, err)
	}
	if _, err := credsClient(t, c.addrs(), x).Ca.GetRevocations(ctx, &metapb.GetRevocationsRequest{}); err == nil {
		t.Fatal("a revoked certificate accepted after the restart")
	}
	if _, err := enroll.Bootstrap(ctx, c.addrs(), used, pki.RoleDatanode); err == nil || !strings.Contains(err.Error(), "already used") {
		t.Fatalf("a used token after the restart: %v", err)
	}
	if _, err := enroll.Bootstrap(ctx, c.addrs(), unused, pki.RoleDatanode); err != nil {
		t.Fatalf("an unused token after the restart: %v", err)
	}
}

// TestMetaRenewsItsOwnCertificate: a meta node whose certificate is near
// its end signs itself a new one from the CA in Raft and swaps it in; the
// raft group and clients go on.
func TestMetaRenewsItsOwnCertificate(t *testing.T) {
	defer func(d time.Duration) { caRenewCheckInterval = d }(caRenewCheckInterval)
	caRenewCheckInterval = 50 * time.Millisecond
	var renewed atomic.Int32
	c := newCACluster(t, 3, func(cfg *Config) {
		short, err := testCA().Issue(pki.Identity{Role: pki.RoleMeta, ID: fmt.Sprint(cfg.NodeID)}, 2*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		cfg.TLS = short
		cfg.CertRenewed = func(*pki.Credentials) { renewed.Add(1) }
	})
	waitCA(t, c)
	waitFor(t, 20*time.Second, "every meta node renewed", func() bool { return renewed.Load() >= 3 })
	for id, s := range c.servers {
		if left := time.Until(s.cfg.TLS.Leaf().NotAfter); left < time.Hour {
			t.Fatalf("node %d: certificate still ends in %v", id, left)
		}
	}
	// Every renewed certificate, followers' too, is recorded in the CA
	// state (so a revocation by identity covers it).
	for id, s := range c.servers {
		serial := pki.SerialString(s.cfg.TLS.Leaf().SerialNumber)
		waitFor(t, 20*time.Second, fmt.Sprintf("node %d's renewed certificate recorded", id), func() bool {
			for _, o := range c.servers {
				if ic, err := o.ca.state.issued(serial); err != nil || ic == nil || ic.Identity != fmt.Sprintf("basalt://meta/%d", id) {
					return false
				}
			}
			return true
		})
	}
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Raft between the renewed nodes still commits; clients get in.
	if _, err := cl.Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "after-renewal"}); err != nil {
		t.Fatal(err)
	}
}

// TestBootstrapLatency: 20 nodes join one after the other, each with its
// own token (CA fetch, TLS, CSR, signing, one Raft apply), on a 3-node
// cluster; every one gets a distinct identity. Logs the latencies.
func TestBootstrapLatency(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var lat []time.Duration
	seen := map[pki.Identity]bool{}
	for range 20 {
		tok := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{})
		start := time.Now()
		creds, err := enroll.Bootstrap(ctx, c.addrs(), tok, pki.RoleDatanode)
		if err != nil {
			t.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		if seen[creds.Identity] {
			t.Fatalf("identity %s issued twice", creds.Identity)
		}
		seen[creds.Identity] = true
	}
	slices.Sort(lat)
	t.Logf("bootstrap (3 meta nodes, loopback): median %v, max %v over %d", lat[len(lat)/2], lat[len(lat)-1], len(lat))
}

type ctxStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s ctxStream) Context() context.Context { return s.ctx }

// TestStreamsNeedACertificate: the port admits TLS clients without a
// certificate (for the bootstrap calls); a streaming RPC, should one be
// added, is refused to them.
func TestStreamsNeedACertificate(t *testing.T) {
	c := newCACluster(t, 1, nil)
	s := c.servers[1]
	called := false
	err := s.streamAuth(nil, ctxStream{ctx: context.Background()}, &grpc.StreamServerInfo{FullMethod: "/basalt.meta.v1.Namespace/Future"},
		func(any, grpc.ServerStream) error { called = true; return nil })
	if status.Code(err) != codes.Unauthenticated || called {
		t.Fatalf("a cert-less stream: %v (handler called: %v)", err, called)
	}
}

// TestCAStateAppliedIndexIsDurable: raft compacts a group's log up to its
// state machine's AppliedIndex, so the CA state must report only what a
// WAL sync covered. Reporting the applied-but-unsynced index let a crash
// lose a revocation or a consumed bootstrap token whose log entries were
// already compacted away.
func TestCAStateAppliedIndexIsDurable(t *testing.T) {
	st, err := openCaState(t.TempDir(), store.Options{SyncInterval: time.Hour}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cmd, err := proto.Marshal(&metapb.CaCommand{NowUnixMs: time.Now().UnixMilli(),
		Op: &metapb.CaCommand_Revoke{Revoke: &metapb.RevokeCertificateRequest{Serial: "0a"}}})
	if err != nil {
		t.Fatal(err)
	}
	st.Apply([]store.Entry{{Index: 1, Cmd: cmd}})
	if got := st.AppliedIndex(); got != 0 {
		t.Fatalf("AppliedIndex %d before any sync, want 0 (only durable entries count)", got)
	}
	if err := st.st.Sync(); err != nil {
		t.Fatal(err)
	}
	if got := st.AppliedIndex(); got != 1 {
		t.Fatalf("AppliedIndex %d after a sync, want 1", got)
	}
}

// TestRenewalOfRevokedCertificateRefusedInApply: a renewal checks the
// caller's certificate when the call starts; a revocation applied between
// that check and the renewal's record must still win, or the holder would
// keep a live successor certificate. The record names the serial renewed
// from, and the apply refuses it if that serial is revoked by then.
func TestRenewalOfRevokedCertificateRefusedInApply(t *testing.T) {
	st, err := openCaState(t.TempDir(), store.Options{}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	enc := func(c *metapb.CaCommand) []byte {
		c.NowUnixMs = time.Now().UnixMilli()
		b, err := proto.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	res := st.Apply([]store.Entry{
		{Index: 1, Cmd: enc(&metapb.CaCommand{Op: &metapb.CaCommand_Revoke{Revoke: &metapb.RevokeCertificateRequest{Serial: "0b"}}})},
		{Index: 2, Cmd: enc(&metapb.CaCommand{Op: &metapb.CaCommand_RecordIssued{RecordIssued: &metapb.CaIssuedCert{Serial: "0c", Identity: "basalt://datanode/x", RenewedFrom: "0b"}}})},
		{Index: 3, Cmd: enc(&metapb.CaCommand{Op: &metapb.CaCommand_RecordIssued{RecordIssued: &metapb.CaIssuedCert{Serial: "0e", Identity: "basalt://datanode/y", RenewedFrom: "0d"}}})},
	})
	if err, _ := res[1].(error); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("renewal from a revoked serial recorded: %v", res[1])
	}
	if res[2] != nil {
		t.Fatalf("renewal from a live serial refused: %v", res[2])
	}
}

// TestRevokeAtTheLimitIsAllOrNothing: revoking an identity whose serials
// would pass the revocation limit revokes none of them (and says so);
// the limit counts revocations earlier in the same apply batch. Fails on
// the old code: it recorded serials up to the limit, then returned an
// error with part of the set committed.
func TestRevokeAtTheLimitIsAllOrNothing(t *testing.T) {
	old := maxRevocations
	maxRevocations = 3
	defer func() { maxRevocations = old }()
	st, err := openCaState(t.TempDir(), store.Options{}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	idx := uint64(0)
	apply := func(ops ...*metapb.CaCommand) []any {
		var ents []store.Entry
		for _, c := range ops {
			c.NowUnixMs = time.Now().UnixMilli()
			b, err := proto.Marshal(c)
			if err != nil {
				t.Fatal(err)
			}
			idx++
			ents = append(ents, store.Entry{Index: idx, Cmd: b})
		}
		return st.Apply(ents)
	}
	revoke := func(r *metapb.RevokeCertificateRequest) *metapb.CaCommand {
		return &metapb.CaCommand{Op: &metapb.CaCommand_Revoke{Revoke: r}}
	}
	for _, sn := range []string{"1a", "1b"} {
		apply(&metapb.CaCommand{Op: &metapb.CaCommand_RecordIssued{RecordIssued: &metapb.CaIssuedCert{Serial: sn, Identity: "basalt://datanode/x"}}})
	}
	apply(revoke(&metapb.RevokeCertificateRequest{Serial: "0f"}), revoke(&metapb.RevokeCertificateRequest{Serial: "0e"}))
	res := apply(revoke(&metapb.RevokeCertificateRequest{Identity: "basalt://datanode/x"}))
	if err, _ := res[0].(error); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("revoking 2 serials with room for 1: %v, want ResourceExhausted", res[0])
	}
	if serials, _ := st.Revocations(); len(serials) != 2 {
		t.Fatalf("revoked %v after a refused revocation, want only 0e and 0f", serials)
	}
	// The limit counts the batch: the second of two in one batch is refused.
	res = apply(revoke(&metapb.RevokeCertificateRequest{Serial: "1a"}), revoke(&metapb.RevokeCertificateRequest{Serial: "1b"}))
	if err, _ := res[1].(error); res[0] == nil || status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("two revocations in one batch with room for one: %v", res)
	}
	if serials, _ := st.Revocations(); len(serials) != 3 {
		t.Fatalf("revoked %v, want 3", serials)
	}
}

// TestMetaBootstrapToken: an admin (with a client certificate) makes a
// meta token for a node ID; spent through the meta nodes it gives that
// node's certificate (basalt meta --bootstrap-token). A meta token must
// name a node ID. Fails on the old code: tokens were for datanodes and
// clients only.
func TestMetaBootstrapToken(t *testing.T) {
	c := newCACluster(t, 3, nil)
	waitCA(t, c)
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, id := range []string{"", "x", "04", "0"} {
		_, err := cl.Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{Role: "meta", IdentityId: id, TtlMs: time.Hour.Milliseconds()})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("meta token for ID %q: %v, want InvalidArgument", id, err)
		}
	}
	tok := newToken(t, cl, &metapb.CreateBootstrapTokenRequest{Role: "meta", IdentityId: "4", TtlMs: time.Hour.Milliseconds()})
	creds, err := enroll.Bootstrap(ctx, c.addrs(), tok, pki.RoleMeta)
	if err != nil {
		t.Fatal(err)
	}
	if want := (pki.Identity{Role: pki.RoleMeta, ID: "4"}); creds.Identity != want {
		t.Fatalf("certificate of %s, want %s", creds.Identity, want)
	}
	if _, err := enroll.Bootstrap(ctx, c.addrs(), tok, pki.RoleMeta); err == nil {
		t.Fatal("a meta token used twice")
	}
}
