package pki

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// TestSwapKeepsConnections: a renewed certificate swapped into credentials
// in use leaves an open connection working, and the next handshake
// presents the new certificate.
func TestSwapKeepsConnections(t *testing.T) {
	ca := mustCA(t)
	srv := mustIssue(t, ca, RoleMeta, "1")
	dn := mustIssue(t, ca, RoleDatanode, "d1")
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srv.ServerTLS())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	serials := make(chan string, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				tc := c.(*tls.Conn)
				tc.SetDeadline(time.Now().Add(20 * time.Second))
				if tc.Handshake() != nil {
					return
				}
				serials <- SerialString(tc.ConnectionState().PeerCertificates[0].SerialNumber)
				io.Copy(tc, tc) // echo
			}()
		}
	}()
	dial := func() *tls.Conn {
		cfg := dn.ClientTLS(RoleMeta)
		cfg.ClientSessionCache = nil // a full handshake each time
		c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(20 * time.Second))
		return c
	}
	echo := func(c *tls.Conn) error {
		if _, err := c.Write([]byte("x")); err != nil {
			return err
		}
		_, err := io.ReadFull(c, make([]byte, 1))
		return err
	}
	c1 := dial()
	defer c1.Close()
	if err := echo(c1); err != nil {
		t.Fatal(err)
	}
	first := <-serials

	keyPEM, csrDER, err := NewCSR(dn.Identity)
	if err != nil {
		t.Fatal(err)
	}
	csr, asked, ok, err := ParseCSR(csrDER)
	if err != nil || !ok || asked != dn.Identity {
		t.Fatalf("CSR: %v %v %v", asked, ok, err)
	}
	certPEM, serial, _, err := ca.SignCSR(csr, dn.Identity, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := dn.Swap(certPEM, keyPEM); err != nil {
		t.Fatal(err)
	}
	if err := echo(c1); err != nil {
		t.Fatalf("the open connection after the swap: %v", err)
	}
	c2 := dial()
	defer c2.Close()
	if err := echo(c2); err != nil {
		t.Fatal(err)
	}
	if second := <-serials; second != serial || second == first {
		t.Fatalf("new handshake presented serial %s, want the new %s (old %s)", second, serial, first)
	}
	// A certificate of another identity, or from another CA, is not swapped in.
	other := mustIssue(t, ca, RoleDatanode, "d2")
	if err := dn.Swap(other.certPEM, other.keyPEM); err == nil {
		t.Fatal("swapped in another identity's certificate")
	}
	stranger := mustIssue(t, mustCA(t), RoleDatanode, "d1")
	if err := dn.Swap(stranger.certPEM, stranger.keyPEM); err == nil {
		t.Fatal("swapped in another CA's certificate")
	}
}

// TestRevokedRefusedBothWays: a revoked serial is refused by a server and
// by a client.
func TestRevokedRefusedBothWays(t *testing.T) {
	ca := mustCA(t)
	srv := mustIssue(t, ca, RoleDatanode, "d1")
	bad := mustIssue(t, ca, RoleDatanode, "d2")
	good := mustIssue(t, ca, RoleDatanode, "d3")
	srv.SetRevoked([]string{SerialString(bad.Leaf().SerialNumber)})
	if serr, cerr, _ := handshake(t, srv.ServerTLS(), bad.ClientTLS()); serr == nil || !strings.Contains(serr.Error(), "revoked") || cerr == nil {
		t.Fatalf("revoked client: server %v, client %v", serr, cerr)
	}
	if serr, cerr, _ := handshake(t, srv.ServerTLS(), good.ClientTLS()); serr != nil || cerr != nil {
		t.Fatalf("good client: server %v, client %v", serr, cerr)
	}
	good.SetRevoked([]string{SerialString(srv.Leaf().SerialNumber)})
	if _, cerr, _ := handshake(t, srv.ServerTLS(), good.ClientTLS()); cerr == nil || !strings.Contains(cerr.Error(), "revoked") {
		t.Fatalf("client dialing a revoked server: %v", cerr)
	}
	// Cert-optional servers: no certificate is let in without identity, a
	// revoked one is refused.
	noCert := &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}
	if serr, cerr, _ := handshake(t, srv.ServerTLSCertOptional(), noCert); cerr != nil || serr == nil || !strings.Contains(serr.Error(), "no certificate") {
		t.Fatalf("cert-less client on a cert-optional server: server %v, client %v", serr, cerr)
	}
	if serr, _, _ := handshake(t, srv.ServerTLSCertOptional(), bad.ClientTLS()); serr == nil || !strings.Contains(serr.Error(), "revoked") {
		t.Fatalf("revoked client on a cert-optional server: %v", serr)
	}
}

func TestBootstrapTokenText(t *testing.T) {
	ca := mustCA(t)
	tok := NewBootstrapToken(ca.Fingerprint())
	got, err := ParseBootstrapToken(tok.String())
	if err != nil || got != tok {
		t.Fatalf("round trip: %v %v", got, err)
	}
	if !got.SecretMatches(tok.SecretHash()) || (BootstrapToken{Secret: "x"}).SecretMatches(tok.SecretHash()) {
		t.Fatal("secret check")
	}
	for _, s := range []string{"", "bt1", "bt2." + tok.ID + "." + tok.Secret, "bt1." + tok.ID + ".zz" + tok.Secret[2:], "bt1." + tok.ID + "." + tok.Secret + ".abc",
		strings.Repeat("bt1.", 1000)} {
		if _, err := ParseBootstrapToken(s); err == nil {
			t.Errorf("parsed %q", s)
		}
	}
	if _, _, err := PoolWithFingerprint(ca.CertPEM(), mustCA(t).Fingerprint()); err == nil {
		t.Fatal("pool with another CA's fingerprint")
	}
	for in, want := range map[string]string{"0x0A1b": "a1b", "0A:1B": "a1b", " ff ": "ff"} {
		if got, err := ParseSerial(in); err != nil || got != want {
			t.Errorf("ParseSerial(%q) = %q, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "0", "xyz", strings.Repeat("f", 65)} {
		if _, err := ParseSerial(in); err == nil {
			t.Errorf("ParseSerial(%q) accepted", in)
		}
	}
	if _, _, _, err := ParseCSR(make([]byte, MaxCSRBytes+1)); err == nil {
		t.Fatal("oversized CSR accepted")
	}
}

// BenchmarkRefuseRevoked is what the meta node adds to every RPC.
func BenchmarkRefuseRevoked(b *testing.B) {
	ca, _ := NewCA("bench")
	c, _ := ca.Issue(Identity{Role: RoleMeta, ID: "1"}, time.Hour)
	peerCreds, _ := ca.Issue(Identity{Role: RoleClient, ID: "x"}, time.Hour)
	serials := make([]string, 1000)
	for i := range serials {
		serials[i] = SerialString(serial())
	}
	ctx := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{
		PeerCertificates: []*x509.Certificate{peerCreds.Leaf()}}}})
	run := func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := c.RefuseRevoked(ctx, "m"); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("none-revoked", run)
	// Only removed meta nodes' identities, no serial: the common case
	// once a meta node was removed (the serial is not looked up).
	c.SetRevoked([]string{"basalt://meta/7", "basalt://meta/8"})
	b.Run("identities-only", run)
	c.SetRevoked(serials)
	b.Run("1000-revoked", run)
	// Removed meta nodes' identities in the set (members_revoke.go):
	// every call then also looks up the caller's identity.
	c.SetRevoked(append(serials, "basalt://meta/7", "basalt://meta/8"))
	b.Run("1000-revoked+identities", run)
}
