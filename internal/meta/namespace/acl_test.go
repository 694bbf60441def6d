package namespace

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

func (e *nsEnv) as(user string, groups ...string) context.Context {
	return WithCaller(e.ctx, Caller{User: user, Groups: groups})
}

func (e *nsEnv) anon() context.Context {
	return WithCaller(e.ctx, Caller{Anonymous: true})
}

func user(name string, rights uint32) *metapb.Acl {
	return &metapb.Acl{Type: metapb.AclType_ACL_USER, Name: name, Rights: rights}
}

const (
	rR  = uint32(metapb.AclRight_ACL_READ)
	rW  = uint32(metapb.AclRight_ACL_WRITE)
	rC  = uint32(metapb.AclRight_ACL_CREATE)
	rL  = uint32(metapb.AclRight_ACL_LIST)
	rD  = uint32(metapb.AclRight_ACL_DELETE)
	rRA = uint32(metapb.AclRight_ACL_READ_ACL)
	rWA = uint32(metapb.AclRight_ACL_WRITE_ACL)
)

func ref(b, k string) *metapb.ObjectRef { return &metapb.ObjectRef{Volume: "vol", Bucket: b, Key: k} }

func (e *nsEnv) setAcl(t *testing.T, ctx context.Context, r *metapb.ObjectRef, op metapb.AclOp, acls ...*metapb.Acl) error {
	t.Helper()
	_, err := e.s.SetAcl(ctx, &metapb.SetAclRequest{Ref: r, Op: op, Acls: acls})
	return err
}

// reads reports LookupKey's and ListKeys' codes for ctx in obkt.
func (e *nsEnv) reads(ctx context.Context, bucket, key string) (codes.Code, codes.Code) {
	_, err1 := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: bucket, Key: key})
	_, err2 := e.s.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: bucket})
	return statusCode(err1), statusCode(err2)
}

func wantReads(t *testing.T, what string, e *nsEnv, ctx context.Context, bucket, key string, look, list codes.Code) {
	t.Helper()
	if a, b := e.reads(ctx, bucket, key); a != look || b != list {
		t.Fatalf("%s: lookup %v list %v, want %v %v", what, a, b, look, list)
	}
}

// TestAclUserGrantAndRemoval: bob is refused on alice's 0700 bucket,
// allowed to read and list after alice adds user:bob:rl, still not to
// write or read the ACL, and refused again after the removal.
func TestAclUserGrantAndRemoval(t *testing.T) {
	e := authzEnv(t)
	alice, bob := e.as("alice"), e.as("bob")
	wantReads(t, "bob before", e, bob, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	if err := e.setAcl(t, bob, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("bob", rR|rL)); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob grants himself: %v", err)
	}
	if err := e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("bob", rR|rL)); err != nil {
		t.Fatal(err)
	}
	wantReads(t, "bob with rl", e, bob, "obkt", "k", codes.OK, codes.OK)
	if _, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "new"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob writes with rl: %v", err)
	}
	if _, err := e.s.DeleteKey(bob, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob deletes with rl: %v", err)
	}
	if _, err := e.s.GetAcl(bob, &metapb.GetAclRequest{Ref: ref("obkt", "")}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob reads the ACL without READ_ACL: %v", err)
	}
	got, err := e.s.GetAcl(alice, &metapb.GetAclRequest{Ref: ref("obkt", "")})
	if err != nil || got.Owner != "alice" || len(got.Acls) != 1 || got.Acls[0].Rights != rR|rL {
		t.Fatalf("alice's GetAcl: %v %v", got, err)
	}
	// REMOVE of r leaves l; REMOVE of l drops the entry.
	if err := e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_REMOVE, user("bob", rR)); err != nil {
		t.Fatal(err)
	}
	wantReads(t, "bob with l", e, bob, "obkt", "k", codes.PermissionDenied, codes.OK)
	if err := e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_REMOVE, user("bob", rL)); err != nil {
		t.Fatal(err)
	}
	wantReads(t, "bob after removal", e, bob, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	if got, _ := e.s.GetAcl(alice, &metapb.GetAclRequest{Ref: ref("obkt", "")}); len(got.GetAcls()) != 0 {
		t.Fatalf("entry left with no rights kept: %v", got)
	}
}

// TestAclWriteCreateDelete: CREATE on the bucket lets bob add keys but
// not overwrite alice's; WRITE on one key lets him overwrite that one;
// DELETE on a key lets him delete it; READ on a key reads only it.
func TestAclWriteCreateDelete(t *testing.T) {
	e := authzEnv(t)
	alice, bob := e.as("alice"), e.as("bob")
	e.put(t, "vol", "obkt", "k2", 1)
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("bob", rC)))
	if _, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "bobs"}); err != nil {
		t.Fatalf("bob creates with CREATE: %v", err)
	}
	if _, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob overwrites with CREATE only: %v", err)
	}
	must(t, e.setAcl(t, alice, ref("obkt", "k"), metapb.AclOp_ACL_REPLACE, user("bob", rW|rR|rD)))
	if _, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); err != nil {
		t.Fatalf("bob overwrites k with WRITE on it: %v", err)
	}
	wantReads(t, "bob reads k", e, bob, "obkt", "k", codes.OK, codes.PermissionDenied)
	wantReads(t, "bob reads k2", e, bob, "obkt", "k2", codes.PermissionDenied, codes.PermissionDenied)
	if _, err := e.s.DeleteKey(bob, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k2"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob deletes k2: %v", err)
	}
	if _, err := e.s.DeleteKey(bob, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); err != nil {
		t.Fatalf("bob deletes k with DELETE on it: %v", err)
	}
	// A new version replaces the key's ACL (as an S3 PUT does).
	ki := e.put(t, "vol", "obkt", "k2", 1)
	if len(ki.Acls) != 0 {
		t.Fatalf("new version kept an ACL: %v", ki.Acls)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestAclGroupWorldAnonymous: GROUP entries match the caller's groups,
// WORLD any authenticated user but not anonymous ones, ANONYMOUS only
// anonymous ones; modes never grant anonymous callers anything.
func TestAclGroupWorldAnonymous(t *testing.T) {
	e := authzEnv(t)
	alice := e.as("alice")
	carol, dave, anon := e.as("carol", "etl"), e.as("dave", "analysts"), e.anon()
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, &metapb.Acl{Type: metapb.AclType_ACL_GROUP, Name: "etl", Rights: rR}))
	wantReads(t, "carol in etl", e, carol, "obkt", "k", codes.OK, codes.PermissionDenied)
	wantReads(t, "dave not in etl", e, dave, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, &metapb.Acl{Type: metapb.AclType_ACL_WORLD, Rights: rL}))
	wantReads(t, "dave with world:l", e, dave, "obkt", "k", codes.PermissionDenied, codes.OK)
	wantReads(t, "anonymous with world:l", e, anon, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	// The FS bucket is 0755 (others may read): not anonymous callers.
	if _, err := e.s.LookupKey(anon, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "fbkt", Key: "a/b/c/f"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("anonymous reads through the other bits: %v", err)
	}
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, &metapb.Acl{Type: metapb.AclType_ACL_ANONYMOUS, Rights: rR}))
	wantReads(t, "anonymous with anonymous:r", e, anon, "obkt", "k", codes.OK, codes.PermissionDenied)
	if _, err := e.s.CreateBucket(anon, &metapb.CreateBucketRequest{Volume: "vol", Name: "anonb"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("anonymous creates a bucket: %v", err)
	}
	if _, err := e.s.SetFileAttrs(anon, &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "obkt", Attrs: &metapb.FileAttrs{Group: "x"}}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("anonymous changes attributes: %v", err)
	}
}

// TestAclFSBucket: a bucket ACL grants into an fs bucket's tree beside
// the modes; a directory's own ACL counts for entries named by it.
func TestAclFSBucket(t *testing.T) {
	e := authzEnv(t)
	alice, bob := e.as("alice"), e.as("bob")
	if _, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fbkt", Key: "a/b/c/g"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob writes in alice's 0755 directory: %v", err)
	}
	must(t, e.setAcl(t, alice, ref("fbkt", "a/b/c"), metapb.AclOp_ACL_ADD, user("bob", rL)))
	if _, err := e.s.ListStatus(bob, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fbkt", Path: "a/b/c"}); err != nil {
		t.Fatalf("bob lists with LIST on the directory: %v", err)
	}
	must(t, e.setAcl(t, alice, ref("fbkt", ""), metapb.AclOp_ACL_ADD, user("bob", rW|rC)))
	if _, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fbkt", Key: "a/b/c/g"}); err != nil {
		t.Fatalf("bob writes with the bucket's WRITE: %v", err)
	}
	got, err := e.s.GetAcl(alice, &metapb.GetAclRequest{Ref: ref("fbkt", "a/b/c")})
	if err != nil || len(got.Acls) != 1 {
		t.Fatalf("directory ACL: %v %v", got, err)
	}
}

func setPolicy(t *testing.T, e *nsEnv, ctx context.Context, bucket, doc string) error {
	t.Helper()
	_, err := e.s.SetBucketPolicy(ctx, &metapb.BucketPolicy{Volume: "vol", Bucket: bucket, Policy: doc})
	return err
}

const policyPublicRead = `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::obkt/*"}]}`

// TestPolicyDenyBeatsOwnerAndAllowGrants: a Deny refuses even the owner
// (not an admin; the owner may still change the policy); an Allow to "*"
// lets anonymous callers read; a condition on aws:SourceIp.
func TestPolicyDenyBeatsOwnerAndAllowGrants(t *testing.T) {
	e := authzEnv(t)
	alice, anon, root := e.as("alice"), e.anon(), WithCaller(e.ctx, Caller{User: "root", Admin: true})
	wantReads(t, "anonymous before", e, anon, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	must(t, setPolicy(t, e, alice, "obkt", policyPublicRead))
	wantReads(t, "anonymous with a public policy", e, anon, "obkt", "k", codes.OK, codes.PermissionDenied)
	st, err := e.s.GetBucketPolicyStatus(alice, &metapb.BucketRef{Volume: "vol", Bucket: "obkt"})
	if err != nil || !st.IsPublic {
		t.Fatalf("policy status: %v %v", st, err)
	}
	must(t, setPolicy(t, e, alice, "obkt", `{"Version":"2012-10-17","Statement":[{"Effect":"Deny","Principal":{"AWS":"alice"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::obkt/*"}]}`))
	_, err = e.s.LookupKey(alice, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"})
	wantCode(t, err, codes.PermissionDenied, "explicitly denied by the policy")
	if _, err := e.s.LookupKey(root, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); err != nil {
		t.Fatalf("admin refused by a policy: %v", err)
	}
	if _, err := e.s.ListKeys(alice, &metapb.ListKeysRequest{Volume: "vol", Bucket: "obkt"}); err != nil {
		t.Fatalf("alice lists (not denied): %v", err)
	}
	// The owner can always repair the policy.
	must(t, setPolicy(t, e, alice, "obkt", ""))
	wantReads(t, "alice after deleting the policy", e, alice, "obkt", "k", codes.OK, codes.OK)

	// aws:SourceIp: bob may read from 10/8 only.
	must(t, setPolicy(t, e, alice, "obkt", `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"AWS":["arn:aws:iam::000000000000:user/bob"]},"Action":["s3:Get*","s3:ListBucket"],"Resource":["arn:aws:s3:::obkt","arn:aws:s3:::obkt/*"],"Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"}}}]}`))
	in := WithCaller(e.ctx, Caller{User: "bob", Request: &RequestInfo{SourceIP: "10.9.8.7", SecureTransport: true}})
	out := WithCaller(e.ctx, Caller{User: "bob", Request: &RequestInfo{SourceIP: "192.168.0.7", SecureTransport: true}})
	wantReads(t, "bob from 10/8", e, in, "obkt", "k", codes.OK, codes.OK)
	wantReads(t, "bob from 192.168/16", e, out, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	// s3:prefix on listings.
	must(t, setPolicy(t, e, alice, "obkt", `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"Basalt":"group:etl"},"Action":"s3:ListBucket","Resource":"arn:aws:s3:::obkt","Condition":{"StringLike":{"s3:prefix":"logs/*"}}}]}`))
	carol := e.as("carol", "etl")
	if _, err := e.s.ListKeys(carol, &metapb.ListKeysRequest{Volume: "vol", Bucket: "obkt", Prefix: "logs/2026"}); err != nil {
		t.Fatalf("etl lists logs/: %v", err)
	}
	if _, err := e.s.ListKeys(carol, &metapb.ListKeysRequest{Volume: "vol", Bucket: "obkt"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("etl lists everything: %v", err)
	}
	// Non-owners may not read or change the policy unless it allows them.
	if _, err := e.s.GetBucketPolicy(carol, &metapb.BucketRef{Volume: "vol", Bucket: "obkt"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("carol reads the policy: %v", err)
	}
	if err := setPolicy(t, e, carol, "obkt", ""); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("carol deletes the policy: %v", err)
	}
	// GetBucket and ListBuckets leave the policy out.
	b, err := e.s.GetBucket(alice, &metapb.GetBucketRequest{Volume: "vol", Name: "obkt"})
	if err != nil || b.Policy != "" {
		t.Fatalf("GetBucket carries the policy: %q %v", b.GetPolicy(), err)
	}
	lb, err := e.s.ListBuckets(alice, &metapb.ListBucketsRequest{Volume: "vol"})
	if err != nil || len(lb.Buckets) == 0 || lb.Buckets[0].Policy != "" {
		t.Fatalf("ListBuckets carries the policy: %v", err)
	}
}

// TestPublicAccessBlock: each of the four settings.
func TestPublicAccessBlock(t *testing.T) {
	e := authzEnv(t)
	alice, bob, anon := e.as("alice"), e.as("bob"), e.anon()
	world := &metapb.Acl{Type: metapb.AclType_ACL_WORLD, Rights: rR}
	anonR := &metapb.Acl{Type: metapb.AclType_ACL_ANONYMOUS, Rights: rR}
	pab := func(c *metapb.PublicAccessBlock) {
		t.Helper()
		if _, err := e.s.SetPublicAccessBlock(alice, &metapb.PublicAccessBlockConfig{Volume: "vol", Bucket: "obkt", Config: c}); err != nil {
			t.Fatal(err)
		}
	}
	// IgnorePublicAcls: the public entries stay but grant nothing.
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, world, anonR))
	wantReads(t, "bob with world:r", e, bob, "obkt", "k", codes.OK, codes.PermissionDenied)
	pab(&metapb.PublicAccessBlock{IgnorePublicAcls: true})
	wantReads(t, "bob with world:r ignored", e, bob, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	wantReads(t, "anonymous with anonymous:r ignored", e, anon, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	// BlockPublicAcls: new public entries are refused, removals are not.
	pab(&metapb.PublicAccessBlock{BlockPublicAcls: true})
	wantCode(t, e.setAcl(t, alice, ref("obkt", "k"), metapb.AclOp_ACL_ADD, world), codes.PermissionDenied, "BlockPublicAcls")
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_REMOVE, world, anonR))
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("bob", rR)))
	o, err := e.s.OpenKey(alice, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "pub"})
	must(t, err)
	_, err = e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1}}, Acls: []*metapb.Acl{anonR}})
	wantCode(t, err, codes.PermissionDenied, "BlockPublicAcls")
	_, err = e.s.CreateBucket(alice, &metapb.CreateBucketRequest{Volume: "vol", Name: "pubb", Acls: []*metapb.Acl{world}, PublicAccessBlock: &metapb.PublicAccessBlock{BlockPublicAcls: true}})
	wantCode(t, err, codes.PermissionDenied, "block public ACLs")
	// BlockPublicPolicy: a public policy is refused, a narrowed one is not.
	pab(&metapb.PublicAccessBlock{BlockPublicPolicy: true})
	wantCode(t, setPolicy(t, e, alice, "obkt", policyPublicRead), codes.PermissionDenied, "BlockPublicPolicy")
	must(t, setPolicy(t, e, alice, "obkt", `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::obkt/*","Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"}}}]}`))
	// RestrictPublicBuckets: a public policy grants nobody but the owner.
	pab(nil)
	must(t, setPolicy(t, e, alice, "obkt", policyPublicRead))
	wantReads(t, "anonymous, public policy", e, anon, "obkt", "k", codes.OK, codes.PermissionDenied)
	pab(&metapb.PublicAccessBlock{RestrictPublicBuckets: true})
	wantReads(t, "anonymous, public policy restricted", e, anon, "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	got, err := e.s.GetPublicAccessBlock(alice, &metapb.BucketRef{Volume: "vol", Bucket: "obkt"})
	if err != nil || !got.Config.GetRestrictPublicBuckets() || got.Config.GetBlockPublicAcls() {
		t.Fatalf("GetPublicAccessBlock: %v %v", got, err)
	}
	if _, err := e.s.SetPublicAccessBlock(bob, &metapb.PublicAccessBlockConfig{Volume: "vol", Bucket: "obkt"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob removes alice's settings: %v", err)
	}
}

// TestAclAndPolicyValidation: what never enters the log.
func TestAclAndPolicyValidation(t *testing.T) {
	e := authzEnv(t)
	alice := e.as("alice")
	many := make([]*metapb.Acl, MaxAclEntries+1)
	for i := range many {
		many[i] = user(fmt.Sprintf("u%d", i), rR)
	}
	for _, c := range []struct {
		acls []*metapb.Acl
		want string
	}{
		{[]*metapb.Acl{user("bob", 0)}, "rights"},
		{[]*metapb.Acl{user("bob", 128)}, "rights"},
		{[]*metapb.Acl{user("", rR)}, "user name"},
		{[]*metapb.Acl{user("a:b", rR)}, "user name"},
		{[]*metapb.Acl{{Type: metapb.AclType_ACL_WORLD, Name: "x", Rights: rR}}, "take no name"},
		{[]*metapb.Acl{{Type: 9, Name: "x", Rights: rR}}, "unknown type"},
		{many, "at most 64"},
	} {
		wantCode(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_REPLACE, c.acls...), codes.InvalidArgument, c.want)
	}
	// ADD past the bound is refused in Apply.
	must(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_REPLACE, many[:MaxAclEntries]...))
	wantCode(t, e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("one-more", rR)), codes.InvalidArgument, "at most 64")
	_, err := e.s.SetAcl(alice, &metapb.SetAclRequest{Ref: ref("obkt", ""), Op: 7})
	wantCode(t, err, codes.InvalidArgument, "unknown operation")
	wantCode(t, e.setAcl(t, alice, ref("obkt", "missing"), metapb.AclOp_ACL_ADD, user("bob", rR)), codes.NotFound, "missing")
	for _, c := range []struct{ doc, want string }{
		{`{`, "not a JSON object"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::other/*"}]}`, `not in bucket "obkt"`},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:Teleport","Resource":"arn:aws:s3:::obkt/*"}]}`, "matches no S3 action"},
		{strings.Repeat(" ", 20<<10+1), "at most 20480"},
	} {
		wantCode(t, setPolicy(t, e, alice, "obkt", c.doc), codes.InvalidArgument, c.want)
	}
	if p, err := e.s.GetBucketPolicy(alice, &metapb.BucketRef{Volume: "vol", Bucket: "obkt"}); err != nil || p.Policy != "" {
		t.Fatalf("a refused policy was stored: %v %v", p, err)
	}
}

// TestAclSurvivesRestart: ACLs, the policy and the settings are in the
// state: a reopened State (and a snapshot restored elsewhere) has them.
func TestAclSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	st, err := Open(dir, store.Options{})
	must(t, err)
	e := &nsEnv{st: st, fb: &fakeBlocks{}, ctx: context.Background()}
	e.s = NewService(Config{}, st, &fakeRaft{st: st}, e.fb)
	_, err = e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"})
	must(t, err)
	_, err = e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "obkt", Owner: "alice"})
	must(t, err)
	e.put(t, "vol", "obkt", "k", 1)
	must(t, e.setAcl(t, e.ctx, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("bob", rR|rL)))
	must(t, e.setAcl(t, e.ctx, &metapb.ObjectRef{Volume: "vol"}, metapb.AclOp_ACL_ADD, user("bob", rC)))
	must(t, setPolicy(t, e, e.ctx, "obkt", policyPublicRead))
	_, err = e.s.SetPublicAccessBlock(e.ctx, &metapb.PublicAccessBlockConfig{Volume: "vol", Bucket: "obkt", Config: &metapb.PublicAccessBlock{IgnorePublicAcls: true}})
	must(t, err)
	idx, snap, err := st.Snapshot()
	must(t, err)
	st2, err := Open(t.TempDir(), store.Options{})
	must(t, err)
	defer st2.Close()
	must(t, st2.Restore(idx, snap))
	snap.Close()
	st.Close()
	st, err = Open(dir, store.Options{})
	must(t, err)
	defer st.Close()
	for name, s := range map[string]*State{"reopened": st, "restored": st2} {
		e := &nsEnv{st: s, fb: &fakeBlocks{}, ctx: context.Background()}
		e.s = NewService(Config{}, s, &fakeRaft{st: s, idx: idx}, e.fb)
		wantReads(t, name+": bob", e, e.as("bob"), "obkt", "k", codes.OK, codes.OK)
		wantReads(t, name+": anonymous", e, e.anon(), "obkt", "k", codes.OK, codes.PermissionDenied)
		if _, err := e.s.CreateBucket(e.as("bob"), &metapb.CreateBucketRequest{Volume: "vol", Name: "bobs"}); err != nil {
			t.Fatalf("%s: bob creates a bucket with CREATE on the volume: %v", name, err)
		}
		pab, err := e.s.GetPublicAccessBlock(e.ctx, &metapb.BucketRef{Volume: "vol", Bucket: "obkt"})
		if err != nil || !proto.Equal(pab.Config, &metapb.PublicAccessBlock{IgnorePublicAcls: true}) {
			t.Fatalf("%s: settings %v %v", name, pab, err)
		}
	}
}

// BenchmarkAuthorizeACL: the cost of the checks this file adds, beside
// BenchmarkAuthorize's owner paths: a grant by the bucket's ACL, by the
// key's own ACL (one more Pebble read), and by a bucket policy with a
// condition (evaluated per call; parsed once).
//
//	go test -run '^$' -bench 'BenchmarkAuthorize' ./internal/meta/namespace/
func BenchmarkAuthorizeACL(b *testing.B) {
	e := authzEnv(b)
	must := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	_, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "pbkt", Owner: "alice"})
	must(err)
	e.put(b, "vol", "pbkt", "k", 1)
	_, err = e.s.SetAcl(e.ctx, &metapb.SetAclRequest{Ref: ref("obkt", ""), Acls: []*metapb.Acl{user("x", rR), {Type: metapb.AclType_ACL_GROUP, Name: "g", Rights: rR}, user("bob", rR)}})
	must(err)
	_, err = e.s.SetAcl(e.ctx, &metapb.SetAclRequest{Ref: ref("obkt", "k"), Acls: []*metapb.Acl{user("carol", rR)}})
	must(err)
	_, err = e.s.SetBucketPolicy(e.ctx, &metapb.BucketPolicy{Volume: "vol", Bucket: "pbkt", Policy: `{"Version":"2012-10-17","Statement":[
	 {"Effect":"Deny","Principal":"*","Action":"s3:*","Resource":"arn:aws:s3:::pbkt/*","Condition":{"Bool":{"aws:SecureTransport":"false"}}},
	 {"Effect":"Allow","Principal":{"AWS":"dave"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::pbkt/*","Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"}}}]}`})
	must(err)
	for _, c := range []struct {
		name   string
		c      Caller
		bucket string
	}{
		{"bucket-acl", Caller{User: "bob"}, "obkt"},
		{"key-acl", Caller{User: "carol"}, "obkt"},
		{"policy", Caller{User: "dave", Request: &RequestInfo{SourceIP: "10.1.2.3", SecureTransport: true}}, "pbkt"},
		{"owner-with-policy", Caller{User: "alice", Request: &RequestInfo{SourceIP: "10.1.2.3", SecureTransport: true}}, "pbkt"},
	} {
		az := e.s.authz(WithCaller(e.ctx, c.c))
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				if err := az.Read("vol", c.bucket, "k"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestModeGroupBits: with a group mapping the group bits of a mode apply
// to the entry's group's members (they granted nothing before).
func TestModeGroupBits(t *testing.T) {
	e := authzEnv(t)
	mode := uint32(0o775)
	_, err := e.s.SetFileAttrs(e.as("alice"), &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "fbkt", Path: "a/b/c", Attrs: &metapb.FileAttrs{Group: "etl", Permission: &mode}})
	must(t, err)
	if _, err := e.s.CreateDirectory(e.as("bob", "etl"), &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fbkt", Path: "a/b/c/bobs"}); err != nil {
		t.Fatalf("bob (etl) creates in a 0775 etl directory: %v", err)
	}
	if _, err := e.s.CreateDirectory(e.as("dave", "analysts"), &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fbkt", Path: "a/b/c/daves"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("dave (not etl) creates in a 0775 etl directory: %v", err)
	}
	// OBJECT bucket: 0750 with group etl lets etl read, not write.
	mode = 0o750
	_, err = e.s.SetFileAttrs(e.as("alice"), &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "obkt", Attrs: &metapb.FileAttrs{Group: "etl", Permission: &mode}})
	must(t, err)
	wantReads(t, "carol (etl) in a 0750 etl bucket", e, e.as("carol", "etl"), "obkt", "k", codes.OK, codes.OK)
	wantReads(t, "dave in a 0750 etl bucket", e, e.as("dave"), "obkt", "k", codes.PermissionDenied, codes.PermissionDenied)
	if _, err := e.s.OpenKey(e.as("carol", "etl"), &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "x"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("carol writes with r-x group bits: %v", err)
	}
}

// TestRecordsHideAclsFromOthers: volume and bucket records are readable
// by every user, but the ACL in them only by whoever may read it (the
// owner, READ_ACL): GetBucket and ListBuckets used to hand any user, and
// anonymous requests through a gateway, the names an ACL grants to.
func TestRecordsHideAclsFromOthers(t *testing.T) {
	e := authzEnv(t)
	alice, bob := e.as("alice"), e.as("bob")
	if err := e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("secretpartner", rR)); err != nil {
		t.Fatal(err)
	}
	if b, err := e.s.GetBucket(alice, &metapb.GetBucketRequest{Volume: "vol", Name: "obkt"}); err != nil || len(b.Acls) != 1 {
		t.Fatalf("owner's GetBucket: acls %v, err %v", b.GetAcls(), err)
	}
	if b, err := e.s.GetBucket(bob, &metapb.GetBucketRequest{Volume: "vol", Name: "obkt"}); err != nil || len(b.Acls) != 0 {
		t.Fatalf("bob's GetBucket shows the ACL: %v, err %v", b.GetAcls(), err)
	}
	l, err := e.s.ListBuckets(bob, &metapb.ListBucketsRequest{Volume: "vol"})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range l.Buckets {
		if len(b.Acls) != 0 {
			t.Fatalf("bob's ListBuckets shows %s's ACL: %v", b.Name, b.Acls)
		}
	}
	if err := e.setAcl(t, alice, ref("obkt", ""), metapb.AclOp_ACL_ADD, user("bob", rRA)); err != nil {
		t.Fatal(err)
	}
	if b, err := e.s.GetBucket(bob, &metapb.GetBucketRequest{Volume: "vol", Name: "obkt"}); err != nil || len(b.Acls) != 2 {
		t.Fatalf("bob with READ_ACL: acls %v, err %v", b.GetAcls(), err)
	}
}

// TestBlockPublicAclsAtComplete: an ACL given when a multipart upload
// completes (an S3 upload created with x-amz-acl: public-read) is checked
// against Block Public Access as a CommitKey's is; it used to be stored
// unchecked, so the object became public in a bucket that blocks that.
func TestBlockPublicAclsAtComplete(t *testing.T) {
	e := authzEnv(t)
	alice := e.as("alice")
	if _, err := e.s.SetPublicAccessBlock(alice, &metapb.PublicAccessBlockConfig{Volume: "vol", Bucket: "obkt", Config: &metapb.PublicAccessBlock{BlockPublicAcls: true}}); err != nil {
		t.Fatal(err)
	}
	u, err := e.s.CreateMultipartUpload(alice, &metapb.CreateMultipartUploadRequest{Volume: "vol", Bucket: "obkt", Key: "mp"})
	must(t, err)
	o, err := e.s.OpenKey(alice, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "obkt", Key: "mp"})
	must(t, err)
	etag := "0123456789abcdef0123456789abcdef"
	_, err = e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1}},
		Part: &metapb.PartRef{UploadId: u.UploadId, PartNumber: 1, Etag: etag}})
	must(t, err)
	anonR := &metapb.Acl{Type: metapb.AclType_ACL_ANONYMOUS, Rights: rR}
	complete := func(acls ...*metapb.Acl) error {
		_, err := e.s.CompleteMultipartUpload(alice, &metapb.CompleteMultipartUploadRequest{Volume: "vol", Bucket: "obkt", Key: "mp", UploadId: u.UploadId,
			MinPartSize: 1, Parts: []*metapb.CompletedPart{{PartNumber: 1, Etag: etag}}, Acls: acls})
		return err
	}
	wantCode(t, complete(anonR), codes.PermissionDenied, "BlockPublicAcls")
	must(t, complete(user("bob", rR)))
}

// TestIgnorePublicAclsCoversVolumeAcl: a public entry of the volume's ACL
// (world:delete) does not let others delete a bucket whose Block Public
// Access ignores public ACLs; a named user's entry still does. Fails on
// the old code: the volume's ACL was checked without IgnorePublicAcls.
func TestIgnorePublicAclsCoversVolumeAcl(t *testing.T) {
	e := authzEnv(t)
	alice, bob := e.as("alice"), e.as("bob")
	for _, name := range []string{"guarded", "open"} {
		if _, err := e.s.CreateBucket(alice, &metapb.CreateBucketRequest{Volume: "vol", Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.s.SetPublicAccessBlock(alice, &metapb.PublicAccessBlockConfig{Volume: "vol", Bucket: "guarded",
		Config: &metapb.PublicAccessBlock{IgnorePublicAcls: true}}); err != nil {
		t.Fatal(err)
	}
	must(t, e.setAcl(t, alice, ref("", ""), metapb.AclOp_ACL_ADD, &metapb.Acl{Type: metapb.AclType_ACL_WORLD, Rights: rD}))
	_, err := e.s.DeleteBucket(bob, &metapb.DeleteBucketRequest{Volume: "vol", Name: "guarded"})
	wantCode(t, err, codes.PermissionDenied, "")
	_, err = e.s.DeleteBucket(bob, &metapb.DeleteBucketRequest{Volume: "vol", Name: "open"})
	must(t, err) // no Block Public Access there: the public entry grants
	must(t, e.setAcl(t, alice, ref("", ""), metapb.AclOp_ACL_ADD, user("bob", rD)))
	_, err = e.s.DeleteBucket(bob, &metapb.DeleteBucketRequest{Volume: "vol", Name: "guarded"})
	must(t, err) // a named grant is not public
}
