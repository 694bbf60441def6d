package pki

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// An identity in the revoked set refuses every certificate naming it,
// whatever its serial (a removed meta node's, also one the CA never
// recorded), and only those.
func TestRevokedIdentity(t *testing.T) {
	ca := mustCA(t)
	srv := mustIssue(t, ca, RoleMeta, "9")
	m1 := mustIssue(t, ca, RoleMeta, "1")
	m1b := mustIssue(t, ca, RoleMeta, "1") // another certificate of node 1
	m2 := mustIssue(t, ca, RoleMeta, "2")
	c1 := mustIssue(t, ca, RoleClient, "1") // same ID, other role
	srv.SetRevoked([]string{"1234", "basalt://meta/1"})
	for _, c := range []*Credentials{m1, m1b} {
		if serr, cerr, _ := handshake(t, srv.ServerTLS(), c.ClientTLS()); serr == nil || !strings.Contains(serr.Error(), "revoked") || cerr == nil {
			t.Fatalf("certificate %s of revoked identity %s: server %v, client %v", SerialString(c.Leaf().SerialNumber), c.Identity, serr, cerr)
		}
		if srv.IsRevokedSerial(SerialString(c.Leaf().SerialNumber)) {
			t.Fatal("the serial itself counts as revoked")
		}
		ctx := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{
			PeerCertificates: []*x509.Certificate{c.Leaf()}}}})
		if err := srv.RefuseRevoked(ctx, "m"); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("RefuseRevoked on an open connection of a revoked identity: %v", err)
		}
	}
	for _, c := range []*Credentials{m2, c1} {
		if serr, cerr, _ := handshake(t, srv.ServerTLS(), c.ClientTLS()); serr != nil || cerr != nil {
			t.Fatalf("%s: server %v, client %v", c.Identity, serr, cerr)
		}
	}
	// A client refuses a server of a revoked identity too.
	m2.SetRevoked([]string{"basalt://meta/9"})
	if _, cerr, _ := handshake(t, srv.ServerTLS(), m2.ClientTLS()); cerr == nil || !strings.Contains(cerr.Error(), "revoked") {
		t.Fatalf("client dialing a server of a revoked identity: %v", cerr)
	}
}

// Watch closes a connection whose peer's identity is revoked later.
func TestWatchClosesRevokedIdentity(t *testing.T) {
	ca := mustCA(t)
	srv := mustIssue(t, ca, RoleMeta, "9")
	m1, m2 := mustIssue(t, ca, RoleMeta, "1"), mustIssue(t, ca, RoleMeta, "2")
	a1, b1 := net.Pipe()
	a2, b2 := net.Pipe()
	defer b1.Close()
	defer b2.Close()
	stop1 := srv.Watch(a1, &tls.ConnectionState{PeerCertificates: []*x509.Certificate{m1.Leaf()}})
	defer stop1()
	stop2 := srv.Watch(a2, &tls.ConnectionState{PeerCertificates: []*x509.Certificate{m2.Leaf()}})
	defer stop2()
	if n := srv.WatchedOf("basalt://meta/1"); n != 1 {
		t.Fatalf("WatchedOf(meta/1) = %d", n)
	}
	srv.SetRevoked([]string{"basalt://meta/1"})
	a1.SetDeadline(time.Now().Add(time.Second))
	if _, err := a1.Write([]byte("x")); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("write on the revoked identity's connection: %v", err)
	}
	go b2.Read(make([]byte, 1))
	a2.SetDeadline(time.Now().Add(time.Second))
	if _, err := a2.Write([]byte("x")); err != nil {
		t.Fatalf("the other identity's connection: %v", err)
	}
}

// A gRPC server made with GRPCServerOption closes a client's open
// connection when its certificate is revoked (its calls were refused by
// RefuseRevoked, but the connection stayed).
func TestGRPCServerClosesRevokedConn(t *testing.T) {
	ca := mustCA(t)
	srvCreds := mustIssue(t, ca, RoleMeta, "9")
	cli := mustIssue(t, ca, RoleMeta, "1")
	for _, opt := range []grpc.ServerOption{srvCreds.GRPCServerOption(), srvCreds.GRPCServerOptionCertOptional()} {
		srvCreds.SetRevoked(nil)
		gs := grpc.NewServer(opt)
		healthpb.RegisterHealthServer(gs, health.NewServer())
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go gs.Serve(ln)
		conn, err := grpc.NewClient(ln.Addr().String(), cli.GRPCDialOption(RoleMeta))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
		cancel()
		if n := srvCreds.WatchedOf("basalt://meta/1"); n != 1 {
			t.Fatalf("server watches %d connections of the client, want 1", n)
		}
		srvCreds.SetRevoked([]string{SerialString(cli.Leaf().SerialNumber)})
		deadline := time.Now().Add(5 * time.Second)
		for conn.GetState() == connectivity.Ready || srvCreds.WatchedOf("basalt://meta/1") != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("the revoked client's connection is still open: state %v, watched %d", conn.GetState(), srvCreds.WatchedOf("basalt://meta/1"))
			}
			time.Sleep(10 * time.Millisecond)
		}
		conn.Close()
		gs.Stop()
	}
}

// With identities only in the revoked set (a cluster that removed meta
// nodes and revoked no serial), the per-RPC check allocates nothing and
// still refuses the identity; a revoked serial is still matched.
func TestRevokedIdentitiesOnlyNoSerialLookup(t *testing.T) {
	ca := mustCA(t)
	srv := mustIssue(t, ca, RoleMeta, "9")
	m1, c1 := mustIssue(t, ca, RoleMeta, "1"), mustIssue(t, ca, RoleClient, "x")
	ctxOf := func(c *Credentials) context.Context {
		return peer.NewContext(context.Background(), &peer.Peer{AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{
			PeerCertificates: []*x509.Certificate{c.Leaf()}}}})
	}
	srv.SetRevoked([]string{"basalt://meta/1", "basalt://meta/2"})
	ok := ctxOf(c1)
	if n := testing.AllocsPerRun(100, func() {
		if err := srv.RefuseRevoked(ok, "m"); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Fatalf("RefuseRevoked with identities only: %v allocations per call, want 0", n)
	}
	if err := srv.RefuseRevoked(ctxOf(m1), "m"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("revoked identity: %v", err)
	}
	srv.SetRevoked([]string{"basalt://meta/2", SerialString(c1.Leaf().SerialNumber)})
	if err := srv.RefuseRevoked(ok, "m"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("revoked serial beside an identity: %v", err)
	}
}
