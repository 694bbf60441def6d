package meta

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
)

// testGroups is the test servers' group mapping (Config.Groups).
var testGroups = map[string][]string{"carol": {"etl"}}

// TestAclOverGRPC: through real meta nodes and client certificates: a
// user ACL entry, a group entry from the servers' mapping, an anonymous
// gateway call allowed only by a public policy whose aws:SourceIp
// condition the gateway's request attributes decide (and nobody but a
// gateway can claim to be anonymous or set them); the ACL and policy
// survive the loss of the namespace leader.
func TestAclOverGRPC(t *testing.T) {
	c := newCluster(t, 3, scm.Config{LoopInterval: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	admin := c.client()
	alice, bob, carol := c.userClient("alice"), c.userClient("bob"), c.userClient("carol")
	gw := c.userClient(pki.GatewayPrefix + "test")
	_, err := admin.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"})
	mustOK(t, "admin creates alice's volume", err)
	_, err = alice.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "abkt"})
	mustOK(t, "alice creates a bucket", err)
	list := func(cl *metaclient.Client, ctx context.Context) error {
		_, err := cl.Namespace.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "abkt"})
		return err
	}
	setAcl := func(op metapb.AclOp, e *metapb.Acl) {
		t.Helper()
		_, err := alice.Namespace.SetAcl(ctx, &metapb.SetAclRequest{Ref: &metapb.ObjectRef{Volume: "vol", Bucket: "abkt"}, Op: op, Acls: []*metapb.Acl{e}})
		mustOK(t, "alice sets her bucket's ACL", err)
	}
	l := uint32(metapb.AclRight_ACL_LIST)

	wantDenied(t, "bob lists alice's bucket", list(bob, ctx))
	setAcl(metapb.AclOp_ACL_ADD, &metapb.Acl{Type: metapb.AclType_ACL_USER, Name: "bob", Rights: l})
	mustOK(t, "bob lists with user:bob:l", list(bob, ctx))
	wantDenied(t, "carol lists alice's bucket", list(carol, ctx))
	setAcl(metapb.AclOp_ACL_ADD, &metapb.Acl{Type: metapb.AclType_ACL_GROUP, Name: "etl", Rights: l})
	mustOK(t, "carol (etl) lists with group:etl:l", list(carol, ctx))
	_, err = bob.Namespace.SetAcl(ctx, &metapb.SetAclRequest{Ref: &metapb.ObjectRef{Volume: "vol", Bucket: "abkt"}, Op: metapb.AclOp_ACL_REMOVE,
		Acls: []*metapb.Acl{{Type: metapb.AclType_ACL_GROUP, Name: "etl", Rights: l}}})
	wantDenied(t, "bob changes alice's ACL", err)

	// Anonymous: nothing until a policy grants "*"; the condition sees the
	// gateway's source address.
	anon := func(ip string) context.Context {
		return metaclient.WithRequestInfo(metaclient.WithAnonymous(ctx), metaclient.RequestInfo{SourceIP: ip, SecureTransport: true})
	}
	wantDenied(t, "anonymous lists", list(gw, anon("10.1.2.3")))
	_, err = alice.Namespace.SetBucketPolicy(ctx, &metapb.BucketPolicy{Volume: "vol", Bucket: "abkt", Policy: `{"Version":"2012-10-17","Statement":[
	 {"Effect":"Allow","Principal":"*","Action":"s3:ListBucket","Resource":"arn:aws:s3:::abkt","Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"}}},
	 {"Effect":"Deny","Principal":{"AWS":"bob"},"Action":"s3:ListBucket","Resource":"arn:aws:s3:::abkt","Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"}}}]}`})
	mustOK(t, "alice sets a policy", err)
	mustOK(t, "anonymous from 10/8 lists", list(gw, anon("10.1.2.3")))
	wantDenied(t, "anonymous from elsewhere lists", list(gw, anon("192.168.1.1")))
	// dave, not a gateway, claims to be anonymous from 10/8: both are
	// ignored (he is dave, from 127.0.0.1).
	wantDenied(t, "dave claims to be anonymous from 10/8", list(c.userClient("dave"), anon("10.1.2.3")))
	// bob's own connection comes from 127.0.0.1: his claimed 10.x address
	// is ignored, so the Deny (for 10/8) does not apply to him.
	mustOK(t, "bob claims a 10/8 address", list(bob, metaclient.WithRequestInfo(ctx, metaclient.RequestInfo{SourceIP: "10.1.2.3"})))
	wantDenied(t, "a gateway for bob from 10/8", list(gw, metaclient.WithRequestInfo(metaclient.WithUser(ctx, "bob", false), metaclient.RequestInfo{SourceIP: "10.1.2.3"})))

	// Lose the namespace leader: the new one has the ACL and the policy.
	old := c.nsLeader()
	c.servers[old].Close()
	delete(c.servers, old)
	waitFor(t, 15*time.Second, "a new namespace leader", func() bool { return c.nsLeader() != 0 })
	waitFor(t, 30*time.Second, "bob lists after the failover", func() bool { return list(bob, ctx) == nil })
	mustOK(t, "carol lists after the failover", list(carol, ctx))
	mustOK(t, "anonymous from 10/8 after the failover", list(gw, anon("10.9.9.9")))
	got, err := alice.Namespace.GetAcl(ctx, &metapb.GetAclRequest{Ref: &metapb.ObjectRef{Volume: "vol", Bucket: "abkt"}})
	mustOK(t, "alice reads her ACL", err)
	if got.Owner != "alice" || len(got.Acls) != 2 {
		t.Fatalf("ACL after failover: %v", got)
	}
	st, err := alice.Namespace.GetBucketPolicyStatus(ctx, &metapb.BucketRef{Volume: "vol", Bucket: "abkt"})
	mustOK(t, "policy status", err)
	if st.IsPublic {
		t.Fatalf("a policy narrowed to 10/8 reported public")
	}
}
