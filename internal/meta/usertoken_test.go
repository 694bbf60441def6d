package meta

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
)

// newUTCluster is newCluster with user-token settings.
func newUTCluster(t *testing.T, n int, ut UserTokenConfig) *cluster {
	c := &cluster{t: t, dir: t.TempDir(), n: n, servers: map[uint64]*Server{}}
	for id := uint64(1); id <= uint64(n); id++ {
		peers := map[uint64]Peer{}
		for p := uint64(1); p <= uint64(n); p++ {
			peers[p] = Peer{}
		}
		s, err := New(Config{
			NodeID: id, DataDir: filepath.Join(c.dir, fmt.Sprint(id)), Peers: peers, TLS: nodeCreds(id), Admins: testAdmins,
			TickInterval: 20 * time.Millisecond, ElectionTicks: 10, UserTokens: ut,
			SCM: scm.Config{LoopInterval: 20 * time.Millisecond}, Namespace: namespace.Config{ServiceInterval: 50 * time.Millisecond}, Logger: quiet,
		})
		if err != nil {
			t.Fatal(err)
		}
		c.servers[id] = s
	}
	c.wire()
	for _, s := range c.servers {
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, s := range c.servers {
			s.Close()
		}
	})
	return c
}

// caOnlyDial is TLS that checks the meta nodes' certificates and
// presents none.
func caOnlyDial(t *testing.T) grpc.DialOption {
	tc, err := pki.CAOnlyClientTLS(testCA().CertPEM(), pki.RoleMeta)
	if err != nil {
		t.Fatal(err)
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(tc))
}

// keyClient is a client without a certificate that authenticates with an
// S3 key ("" : none at all).
func (c *cluster) keyClient(ak, sk string, addrs ...string) *metaclient.Client {
	c.t.Helper()
	if len(addrs) == 0 {
		addrs = c.addrs()
	}
	cl, err := metaclient.New(metaclient.Config{Addrs: addrs, CallTimeout: 20 * time.Second, AccessKey: ak, SecretKey: sk,
		DialOptions: []grpc.DialOption{caOnlyDial(c.t)}, MaxAttempts: 20})
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

func (c *cluster) utLeader() uint64 {
	for id, s := range c.servers {
		if s.utGroup.IsLeader() {
			return id
		}
	}
	return 0
}

func wantUnauth(t *testing.T, what string, err error) {
	t.Helper()
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("%s: %v, want Unauthenticated", what, err)
	}
}

// s3Key makes an S3 key for owner.
func s3Key(t *testing.T, c *cluster, owner string) *metapb.S3Secret {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sec, err := c.userClient("test").Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{Owner: owner})
	if err != nil {
		t.Fatal(err)
	}
	return sec
}

// TestUserTokenAuthenticates: a client with only an S3 key and the CA
// creates a bucket and works in it as the key's owner; without a
// certificate or a token nothing is served; another user's token does
// not reach alice's bucket; a token never makes its holder a gateway.
// Fails on the old code: the gRPC port refused connections without a
// client certificate, so every call here failed.
func TestUserTokenAuthenticates(t *testing.T) {
	c := newUTCluster(t, 3, UserTokenConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin := c.client()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	_, err := admin.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"})
	mustOK(t, "admin creates alice's volume", err)
	ak, bk := s3Key(t, c, "alice"), s3Key(t, c, "bob")

	alice := c.keyClient(ak.AccessKeyId, ak.SecretAccessKey)
	b, err := alice.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "abkt"})
	mustOK(t, "alice (S3 key only) creates a bucket", err)
	if b.Owner != "alice" {
		t.Fatalf("bucket owner %q, want alice", b.Owner)
	}
	_, err = alice.Namespace.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol", Name: "abkt"})
	mustOK(t, "alice reads her bucket", err)
	_, err = alice.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "mine"})
	wantDenied(t, "alice (not an admin) creates a volume", err)
	_, err = alice.Scm.SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{})
	wantDenied(t, "alice calls an admin SCM RPC", err)
	_, err = alice.Scm.RegisterDatanode(ctx, &metapb.RegisterDatanodeRequest{})
	wantDenied(t, "a token caller registers a datanode", err)

	bob := c.keyClient(bk.AccessKeyId, bk.SecretAccessKey)
	_, err = bob.Namespace.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "abkt"})
	wantDenied(t, "bob lists alice's bucket", err)
	_, err = bob.Namespace.ListKeys(metaclient.WithUser(ctx, "alice", true), &metapb.ListKeysRequest{Volume: "vol", Bucket: "abkt"})
	wantDenied(t, "bob names alice as his end user", err)

	// A key whose owner looks like a gateway's name is still no gateway.
	gk := s3Key(t, c, pki.GatewayPrefix+"evil")
	gw := c.keyClient(gk.AccessKeyId, gk.SecretAccessKey)
	_, err = gw.Namespace.ListKeys(metaclient.WithUser(ctx, "alice", false), &metapb.ListKeysRequest{Volume: "vol", Bucket: "abkt"})
	wantDenied(t, "a token user named gateway-* acts for alice", err)

	// An admin S3 key's token is an admin's.
	adm, err := c.userClient("test").Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{Owner: "dora", Admin: true})
	mustOK(t, "an admin key", err)
	_, err = c.keyClient(adm.AccessKeyId, adm.SecretAccessKey).Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "doras"})
	mustOK(t, "dora (admin key) creates a volume", err)
	// ...but it mints and revokes no node identities: those CA calls need
	// a certificate (an S3 key must not become a datanode).
	_, err = c.keyClient(adm.AccessKeyId, adm.SecretAccessKey).Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{})
	wantDenied(t, "dora (admin key, token) creates a bootstrap token", err)
	_, err = c.keyClient(adm.AccessKeyId, adm.SecretAccessKey).Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: "0a"})
	wantDenied(t, "dora (admin key, token) revokes a certificate", err)

	// No certificate and no token: refused as before, whatever the call.
	none := c.keyClient("", "")
	_, err = none.Namespace.ListVolumes(ctx, &metapb.ListVolumesRequest{})
	wantUnauth(t, "no certificate, no token", err)
	_, err = none.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
	wantUnauth(t, "no certificate, no token (SCM)", err)
	_, err = none.UserToken.GetUserToken(ctx, &metapb.GetUserTokenRequest{})
	wantUnauth(t, "GetUserToken without a proof", err)

	// A token does not beget a token.
	tok, err := alice.Token(ctx)
	mustOK(t, "alice's token", err)
	req, _ := metaclient.NewUserTokenRequest(ak.AccessKeyId, ak.SecretAccessKey, "", time.Now())
	_, err = none.UserToken.GetUserToken(metaclient.WithUserToken(ctx, tok), req)
	wantDenied(t, "GetUserToken with a token", err)

	// A client certificate may get a token for its own user.
	r, err := c.userClient("carol").UserToken.GetUserToken(ctx, &metapb.GetUserTokenRequest{})
	mustOK(t, "carol (certificate) gets a token", err)
	if r.User != "carol" || r.Renewer != "carol" || r.ExpiryUnixMs-r.IssueUnixMs != time.Hour.Milliseconds() || r.MaxUnixMs-r.IssueUnixMs != 7*24*time.Hour.Milliseconds() {
		t.Fatalf("carol's token: %+v", r)
	}
	_, err = none.Namespace.ListKeys(metaclient.WithUserToken(ctx, r.Token), &metapb.ListKeysRequest{Volume: "vol", Bucket: "abkt"})
	wantDenied(t, "carol (token) lists alice's bucket", err)
}

// getToken asks for a token with a signed request made at when.
func getToken(ctx context.Context, cl *metaclient.Client, sec *metapb.S3Secret, secret string, when time.Time) (*metapb.UserTokenResponse, error) {
	req, err := metaclient.NewUserTokenRequest(sec.AccessKeyId, secret, "", when)
	if err != nil {
		return nil, err
	}
	return cl.UserToken.GetUserToken(ctx, req)
}

// TestUserTokenRefusals: a wrong secret, a skewed clock, a replayed
// signature, a forged or altered token and a cancelled one are all
// refused; a cancelled token stays refused on every node and after a
// failover, while a good token keeps working there. (Expiry:
// TestUserTokenExpiry.)
func TestUserTokenRefusals(t *testing.T) {
	c := newUTCluster(t, 3, UserTokenConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	ak := s3Key(t, c, "alice")
	cl := c.keyClient("", "")
	use := func(tok string) error {
		_, err := cl.Namespace.ListBuckets(metaclient.WithUserToken(ctx, tok), &metapb.ListBucketsRequest{Volume: "nope"})
		if status.Code(err) == codes.NotFound {
			return nil // authenticated: the volume just does not exist
		}
		return err
	}

	_, err := getToken(ctx, cl, ak, "not the secret", time.Now())
	wantUnauth(t, "wrong secret", err)
	_, err = getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now().Add(-6*time.Minute))
	wantUnauth(t, "timestamp 6 minutes old", err)
	_, err = getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now().Add(6*time.Minute))
	wantUnauth(t, "timestamp 6 minutes ahead", err)
	_, err = getToken(ctx, cl, &metapb.S3Secret{AccessKeyId: "NOSUCHKEY"}, ak.SecretAccessKey, time.Now())
	wantUnauth(t, "unknown access key", err)
	req, _ := metaclient.NewUserTokenRequest(ak.AccessKeyId, ak.SecretAccessKey, "", time.Now())
	r, err := cl.UserToken.GetUserToken(ctx, req)
	mustOK(t, "a signed request", err)
	_, err = cl.UserToken.GetUserToken(ctx, req)
	wantUnauth(t, "the same signed request again (replay)", err)
	req.Renewer = "mallory"
	_, err = cl.UserToken.GetUserToken(ctx, req)
	wantUnauth(t, "the signed request with another renewer", err)
	mustOK(t, "the token works", use(r.Token))

	// Forged and altered tokens.
	parts, err := metaclient.DecodeTokenURL(r.Token)
	mustOK(t, "decode", err)
	bad := parts
	bad.Password = append([]byte(nil), parts.Password...)
	bad.Password[0] ^= 1
	wantUnauth(t, "a token with a flipped MAC bit", use(metaclient.EncodeTokenURL(bad)))
	ut, err := parseUserToken(parts.Identifier)
	mustOK(t, "parse", err)
	alt := ut
	alt.User, alt.Admin = "test", true
	bad = parts
	bad.Identifier = alt.marshal()
	wantUnauth(t, "alice's token renamed to the admin", use(metaclient.EncodeTokenURL(bad)))
	forged := signUserToken(&metapb.SecretKey{Id: ut.KeyID, Secret: make([]byte, 32)}, ut)
	wantUnauth(t, "a token signed with a made-up secret", use(forged))
	forged = signUserToken(&metapb.SecretKey{Id: 999, Secret: make([]byte, 32)}, ut)
	wantUnauth(t, "a token of an unknown key", use(forged))
	wantUnauth(t, "garbage", use("!!!"))

	_, err = c.userClient("bob").UserToken.RenewUserToken(ctx, &metapb.RenewUserTokenRequest{Token: r.Token})
	wantDenied(t, "bob renews alice's token", err)

	// Cancellation: refused by every node, also after a failover.
	good, err := getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now())
	mustOK(t, "a second token", err)
	gone, err := getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now())
	mustOK(t, "a third token", err)
	_, err = c.userClient("bob").UserToken.CancelUserToken(ctx, &metapb.CancelUserTokenRequest{Token: gone.Token})
	wantDenied(t, "bob cancels alice's token", err)
	_, err = cl.UserToken.CancelUserToken(metaclient.WithUserToken(ctx, gone.Token), &metapb.CancelUserTokenRequest{Token: gone.Token})
	mustOK(t, "alice cancels it", err)
	wantUnauth(t, "a cancelled token", use(gone.Token))
	for id, s := range c.servers {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d refuses the cancelled token", id), func() bool {
			_, err := s.verifyUserToken(context.Background(), gone.Token, time.Now())
			return status.Code(err) == codes.Unauthenticated
		})
		if _, err := s.verifyUserToken(context.Background(), good.Token, time.Now()); err != nil {
			t.Fatalf("node %d refuses the good token: %v", id, err)
		}
	}
	old := c.utLeader()
	c.servers[old].Close()
	delete(c.servers, old)
	waitFor(t, 20*time.Second, "a new user-token leader", func() bool { return c.utLeader() != 0 && c.nsLeader() != 0 })
	var rest []string
	for _, s := range c.servers {
		rest = append(rest, s.GRPCAddr())
	}
	cl2 := c.keyClient("", "", rest...)
	_, err = cl2.Namespace.ListBuckets(metaclient.WithUserToken(ctx, gone.Token), &metapb.ListBucketsRequest{Volume: "nope"})
	wantUnauth(t, "the cancelled token after the failover", err)
	_, err = cl2.Namespace.ListBuckets(metaclient.WithUserToken(ctx, good.Token), &metapb.ListBucketsRequest{Volume: "nope"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("the good token after the failover: %v, want NotFound (authenticated)", err)
	}
	// The new leader issues tokens (its keys came through Raft).
	_, err = getToken(ctx, cl2, ak, ak.SecretAccessKey, time.Now())
	mustOK(t, "a token from the new leader", err)
	_, err = cl2.UserToken.GetUserToken(ctx, req)
	wantUnauth(t, "the first request replayed to the new leader", err)
}

// TestTokenURLRoundTrip: Hadoop's Writable vint and URL string encoding,
// with lengths at the encoding's boundaries.
func TestTokenURLRoundTrip(t *testing.T) {
	for _, n := range []int{0, 1, 127, 128, 255, 256, 600} {
		p := metaclient.TokenParts{Identifier: make([]byte, n), Password: []byte("pw"), Kind: metaclient.WebHDFSTokenKind, Service: "127.0.0.1:9870"}
		for i := range p.Identifier {
			p.Identifier[i] = byte(i)
		}
		got, err := metaclient.DecodeTokenURL(metaclient.EncodeTokenURL(p))
		if err != nil || string(got.Identifier) != string(p.Identifier) || string(got.Password) != "pw" || got.Kind != p.Kind || got.Service != p.Service {
			t.Fatalf("n=%d: %+v, %v", n, got, err)
		}
	}
	// Hadoop's own encoding of a token with identifier "id", password
	// "pw", kind "K", service "S" (WritableUtils: one byte per length).
	if s := metaclient.EncodeTokenURL(metaclient.TokenParts{Identifier: []byte("id"), Password: []byte("pw"), Kind: "K", Service: "S"}); s != "AmlkAnB3AUsBUw" {
		t.Fatalf("encoding %q", s)
	}
	for _, bad := range []string{"", "AmlkAnB3AUsBU", "_w", "AmlkAnB3AUsBUwA", "j4_____"} {
		if _, err := metaclient.DecodeTokenURL(bad); err == nil {
			t.Fatalf("%q decoded", bad)
		}
	}
}

// TestClientRenewsToken: the Go client renews its token before it
// expires (the first token keeps working past its first expiry) and gets
// a new one once renewal cannot extend it (the max date); no call fails
// meanwhile.
func TestClientRenewsToken(t *testing.T) {
	c := newUTCluster(t, 1, UserTokenConfig{Lifetime: 2 * time.Second, MaxLifetime: 5 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	ak := s3Key(t, c, "alice")
	cl := c.keyClient(ak.AccessKeyId, ak.SecretAccessKey)
	first, err := cl.Token(ctx)
	mustOK(t, "first token", err)
	start := time.Now()
	renewedPastExpiry, replaced := false, false
	for time.Since(start) < 8*time.Second {
		_, err := cl.Namespace.ListBuckets(ctx, &metapb.ListBucketsRequest{Volume: "nope"})
		if status.Code(err) != codes.NotFound {
			t.Fatalf("after %v: %v, want NotFound (authenticated)", time.Since(start), err)
		}
		tok, err := cl.Token(ctx)
		mustOK(t, "token", err)
		if tok == first && time.Since(start) > 2500*time.Millisecond {
			renewedPastExpiry = true
		}
		if tok != first {
			replaced = true
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !renewedPastExpiry || !replaced {
		t.Fatalf("renewed past the first expiry: %v; replaced after the max date: %v", renewedPastExpiry, replaced)
	}
}

// TestUserTokenExpiry: a token expires after its lifetime unless its
// renewer renews it; renewal extends it, never past its max date.
func TestUserTokenExpiry(t *testing.T) {
	c := newUTCluster(t, 1, UserTokenConfig{Lifetime: 4 * time.Second, MaxLifetime: 5 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	ak := s3Key(t, c, "alice")
	cl := c.keyClient("", "")
	use := func(tok string) error {
		_, err := cl.Namespace.ListBuckets(metaclient.WithUserToken(ctx, tok), &metapb.ListBucketsRequest{Volume: "nope"})
		if status.Code(err) == codes.NotFound {
			return nil
		}
		return err
	}
	r, err := getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now())
	mustOK(t, "a token", err)
	other, err := getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now())
	mustOK(t, "another token", err)
	time.Sleep(time.Second)
	rr, err := cl.UserToken.RenewUserToken(metaclient.WithUserToken(ctx, r.Token), &metapb.RenewUserTokenRequest{Token: r.Token})
	mustOK(t, "alice renews her token", err)
	if rr.ExpiryUnixMs <= r.ExpiryUnixMs || rr.ExpiryUnixMs > r.MaxUnixMs {
		t.Fatalf("renewed expiry %d, want in (%d, %d]", rr.ExpiryUnixMs, r.ExpiryUnixMs, r.MaxUnixMs)
	}
	waitFor(t, 10*time.Second, "past the first expiry", func() bool { return time.Now().UnixMilli() > other.ExpiryUnixMs+100 })
	wantUnauth(t, "the token nobody renewed, past its expiry", use(other.Token))
	if time.Now().UnixMilli() < rr.ExpiryUnixMs-50 {
		mustOK(t, "the renewed token past its first expiry", use(r.Token))
	}
	waitFor(t, 10*time.Second, "past the renewed expiry", func() bool { return time.Now().UnixMilli() > rr.ExpiryUnixMs+100 })
	wantUnauth(t, "the renewed token past its max date", use(r.Token))
	_, err = cl.UserToken.RenewUserToken(ctx, &metapb.RenewUserTokenRequest{Token: r.Token})
	wantUnauth(t, "renewing an expired token", err)
}

// TestDeletedS3KeyEndsItsTokens: a token names the S3 key it was issued
// against; once the key is deleted every node refuses the token and its
// renewal, and a key re-created under the same ID (without the admin
// flag) does not bring the old admin token back. Fails on the old code:
// the token did not name the key and stayed good (and renewable) for up
// to its 7-day max date.
func TestDeletedS3KeyEndsItsTokens(t *testing.T) {
	c := newUTCluster(t, 3, UserTokenConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	admin := c.userClient("test")
	ak := s3Key(t, c, "alice")
	cl := c.keyClient("", "")
	use := func(tok string) error {
		_, err := cl.Namespace.ListBuckets(metaclient.WithUserToken(ctx, tok), &metapb.ListBucketsRequest{Volume: "nope"})
		if status.Code(err) == codes.NotFound {
			return nil // authenticated: the volume just does not exist
		}
		return err
	}
	r, err := getToken(ctx, cl, ak, ak.SecretAccessKey, time.Now())
	mustOK(t, "token", err)
	mustOK(t, "the token works", use(r.Token))
	_, err = cl.UserToken.RenewUserToken(metaclient.WithUserToken(ctx, r.Token), &metapb.RenewUserTokenRequest{Token: r.Token})
	mustOK(t, "renewal before the deletion", err)

	_, err = admin.Namespace.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: ak.AccessKeyId})
	mustOK(t, "delete the key", err)
	for id, s := range c.servers {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d refuses the deleted key's token", id), func() bool {
			_, err := s.verifyUserToken(context.Background(), r.Token, time.Now())
			return status.Code(err) == codes.Unauthenticated
		})
	}
	wantUnauth(t, "a call with the deleted key's token", use(r.Token))
	_, err = cl.UserToken.RenewUserToken(metaclient.WithUserToken(ctx, r.Token), &metapb.RenewUserTokenRequest{Token: r.Token})
	wantUnauth(t, "renewal after the deletion", err)

	// An admin key, deleted and re-created under the same ID without the
	// admin flag: the admin token stays dead, a new token is no admin's.
	adm, err := admin.Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "ADMINKEY1", Owner: "root", Admin: true})
	mustOK(t, "admin key", err)
	ra, err := getToken(ctx, cl, adm, adm.SecretAccessKey, time.Now())
	mustOK(t, "admin token", err)
	if !ra.Admin {
		t.Fatalf("token of an admin key is not an admin's")
	}
	mustOK(t, "the admin token works", use(ra.Token))
	_, err = admin.Namespace.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: adm.AccessKeyId})
	mustOK(t, "delete the admin key", err)
	plain, err := admin.Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "ADMINKEY1", Owner: "root",
		SecretAccessKey: adm.SecretAccessKey})
	mustOK(t, "re-create it without the admin flag", err)
	for id, s := range c.servers {
		waitFor(t, 10*time.Second, fmt.Sprintf("node %d refuses the old admin token", id), func() bool {
			_, err := s.verifyUserToken(context.Background(), ra.Token, time.Now())
			return status.Code(err) == codes.Unauthenticated
		})
	}
	rp, err := getToken(ctx, cl, plain, plain.SecretAccessKey, time.Now())
	mustOK(t, "token of the re-created key", err)
	if rp.Admin {
		t.Fatalf("token of the re-created key (no admin flag) is an admin's")
	}
	mustOK(t, "the new token works", use(rp.Token))
}

// TestUTLimiter: a bucket allows its burst, then its rate; names are
// independent; the map stays bounded (idle names make room, busy ones
// do not).
func TestUTLimiter(t *testing.T) {
	var l utLimiter
	now := time.Unix(1_800_000_000, 0)
	for i := range 5 {
		if !l.allow("10.0.0.1", now, 1, 5) {
			t.Fatalf("attempt %d of a burst of 5 refused", i+1)
		}
	}
	if l.allow("10.0.0.1", now, 1, 5) {
		t.Fatal("attempt 6 of a burst of 5 allowed")
	}
	if !l.allow("10.0.0.2", now, 1, 5) {
		t.Fatal("another name refused")
	}
	if !l.allow("10.0.0.1", now.Add(1100*time.Millisecond), 1, 5) {
		t.Fatal("refused after a second at 1/s")
	}
	var m utLimiter
	for i := range utLimiterMax {
		for range 5 {
			m.allow(fmt.Sprint(i), now, 1, 5)
		}
	}
	if m.allow("new", now, 1, 5) || len(m.m) > utLimiterMax {
		t.Fatalf("a new name allowed with %d busy names (%d kept)", utLimiterMax, len(m.m))
	}
	if !m.allow("new", now.Add(10*time.Second), 1, 5) || len(m.m) > utLimiterMax {
		t.Fatalf("a new name refused once the others idled (%d kept)", len(m.m))
	}
}

// TestGetUserTokenAttemptsLimited: unauthenticated GetUserToken attempts
// beyond the limit are refused with ResourceExhausted and a clear reason;
// an unknown access key is answered at once, on the leader and on a
// follower (which sends the caller to the leader before any work). Fails
// on the old code: every attempt cost a read barrier and an HMAC, without
// limit, and a follower polled up to 2 s for an unknown key.
func TestGetUserTokenAttemptsLimited(t *testing.T) {
	c := newUTCluster(t, 3, UserTokenConfig{AttemptsPerSecond: 0.5, AttemptBurst: 5})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 20*time.Second, "leaders", func() bool { return c.nsLeader() != 0 && c.utLeader() != 0 })
	waitFor(t, 20*time.Second, "user-token leadership on the namespace leader", func() bool { return c.utLeader() == c.nsLeader() })
	ak := s3Key(t, c, "alice")
	direct := func(id uint64) metapb.UserTokenClient {
		conn, err := grpc.NewClient(c.servers[id].GRPCAddr(), caOnlyDial(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return metapb.NewUserTokenClient(conn)
	}
	leader := c.utLeader()
	var follower uint64
	for id := range c.servers {
		if id != leader {
			follower = id
		}
	}
	for _, id := range []uint64{follower, leader} {
		req, _ := metaclient.NewUserTokenRequest("NOSUCHKEY", ak.SecretAccessKey, "", time.Now())
		start := time.Now()
		_, err := direct(id).GetUserToken(ctx, req)
		if took := time.Since(start); took > 1900*time.Millisecond || err == nil { // the old follower polled 2 s
			t.Fatalf("node %d (leader %d): unknown access key answered in %v: %v", id, leader, took, err)
		}
	}
	cl := direct(leader)
	var exhausted error
	for i := range 20 {
		req, _ := metaclient.NewUserTokenRequest(ak.AccessKeyId, "not the secret", "", time.Now())
		_, err := cl.GetUserToken(ctx, req)
		if status.Code(err) == codes.ResourceExhausted {
			exhausted = err
			if i < 3 {
				t.Fatalf("refused after %d attempts, burst is 5", i)
			}
			break
		}
		wantUnauth(t, "a wrong secret", err)
	}
	if exhausted == nil || !strings.Contains(exhausted.Error(), "too many token requests") {
		t.Fatalf("20 quick attempts with a wrong secret: last %v, want ResourceExhausted (too many token requests)", exhausted)
	}
	t.Logf("refused: %v", exhausted)
}
