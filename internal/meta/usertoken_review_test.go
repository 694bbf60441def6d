package meta

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// TestUserTokenOfRevokedCertificate: a token issued to a client
// certificate is refused by every node (calls and renewal) once that
// certificate is revoked.
func TestUserTokenOfRevokedCertificate(t *testing.T) {
	c := newUTCluster(t, 3, UserTokenConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	creds := testCreds(pki.RoleClient, "carol")
	carol, err := metaclient.New(metaclient.Config{Addrs: c.addrs(), CallTimeout: 20 * time.Second, ServiceToken: c.servers[1].ServiceToken(),
		DialOptions: []grpc.DialOption{creds.GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		t.Fatal(err)
	}
	defer carol.Close()
	r, err := carol.UserToken.GetUserToken(ctx, &metapb.GetUserTokenRequest{})
	mustOK(t, "carol token", err)
	serial := pki.SerialString(creds.Leaf().SerialNumber)
	none := c.keyClient("", "")
	_, err = none.Namespace.ListBuckets(metaclient.WithUserToken(ctx, r.Token), &metapb.ListBucketsRequest{Volume: "nope"})
	if status.Code(err) == codes.Unauthenticated {
		t.Fatalf("the token before the revocation: %v", err)
	}
	_, err = c.userClient("test").Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: serial})
	mustOK(t, "revoke", err)
	for id, s := range c.servers {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d knows the revocation", id), func() bool { return s.cfg.TLS.IsRevoked(creds.Leaf()) })
	}
	for id, s := range c.servers {
		if _, err := s.verifyUserToken(ctx, r.Token, time.Now()); status.Code(err) != codes.Unauthenticated {
			t.Errorf("node %d, token of revoked certificate %s: %v (want Unauthenticated)", id, serial, err)
		}
	}
	_, err = none.Namespace.ListBuckets(metaclient.WithUserToken(ctx, r.Token), &metapb.ListBucketsRequest{Volume: "nope"})
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("call with the revoked certificate's token: %v (want Unauthenticated)", err)
	}
	_, err = c.userClient("carol").UserToken.RenewUserToken(ctx, &metapb.RenewUserTokenRequest{Token: r.Token})
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("renewal of the revoked certificate's token: %v (want Unauthenticated)", err)
	}
}

// TestUserTokenKeyLimiterNoLockout: wrong guesses at an access key from
// one address do not lock the key's owner (another address) out, while
// the guessing address is refused even with the right secret.
func TestUserTokenKeyLimiterNoLockout(t *testing.T) {
	c := newUTCluster(t, 3, UserTokenConfig{AttemptsPerSecond: 0.01, AttemptBurst: 5})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	ak := s3Key(t, c, "alice")
	waitFor(t, 20*time.Second, "a user-token key at the user-token leader, which leads the namespace", func() bool {
		l := c.utLeader()
		return l != 0 && l == c.nsLeader() && c.servers[l].ut.signingKey(time.Now().UnixMilli()) != nil
	})
	leader := c.utLeader()
	dialFrom := func(src string) metapb.UserTokenClient {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		conn, err := grpc.NewClient(c.servers[leader].GRPCAddr(), caOnlyDial(t),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return metapb.NewUserTokenClient(conn)
	}
	attacker := dialFrom("127.0.0.2")
	for i := range 6 {
		req, _ := metaclient.NewUserTokenRequest(ak.AccessKeyId, "guess", "", time.Now())
		_, err := attacker.GetUserToken(ctx, req)
		if want := map[bool]codes.Code{true: codes.Unauthenticated, false: codes.ResourceExhausted}[i < 5]; status.Code(err) != want {
			t.Fatalf("guess %d: %v (want %v)", i, err, want)
		}
	}
	// The key's failure bucket is empty now: a third address that guesses
	// once is heard (and fails), then refused even with the right secret.
	third := dialFrom("127.0.0.3")
	req, _ := metaclient.NewUserTokenRequest(ak.AccessKeyId, "guess", "", time.Now())
	if _, err := third.GetUserToken(ctx, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("a clean address's guess: %v (want Unauthenticated)", err)
	}
	req, _ = metaclient.NewUserTokenRequest(ak.AccessKeyId, ak.SecretAccessKey, "", time.Now())
	if _, err := third.GetUserToken(ctx, req); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("the right secret from an address that guessed: %v (want ResourceExhausted)", err)
	}
	for i := range 3 {
		req, _ = metaclient.NewUserTokenRequest(ak.AccessKeyId, ak.SecretAccessKey, "", time.Now())
		if _, err := dialFrom("127.0.0.1").GetUserToken(ctx, req); err != nil {
			t.Errorf("alice (right secret, own address), request %d: %v", i, err)
		}
	}
}

func TestSourcePrefix(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1":              "127.0.0.1",
		"2001:db8:1:2:3:4:5:6":   "2001:db8:1:2::/64",
		"2001:db8:1:2:ffff::1":   "2001:db8:1:2::/64",
		"::ffff:10.0.0.1":        "::ffff:10.0.0.1",
		"not an address":         "not an address",
		"fe80::1234:5678:9abc:1": "fe80::/64",
	} {
		if got := sourcePrefix(in); got != want {
			t.Errorf("sourcePrefix(%q) = %q, want %q", in, got, want)
		}
	}
}
