package meta

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
)

// userClient is a meta client with a client certificate of user id (and
// the service token, so that the token is never why a call fails).
func (c *cluster) userClient(id string) *metaclient.Client {
	c.t.Helper()
	cl, err := metaclient.New(metaclient.Config{Addrs: c.addrs(), CallTimeout: 20 * time.Second, ServiceToken: c.servers[1].ServiceToken(),
		DialOptions: []grpc.DialOption{testCreds(pki.RoleClient, id).GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

func wantDenied(t *testing.T, what string, err error) {
	t.Helper()
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("%s: %v, want PermissionDenied", what, err)
	}
}

func mustOK(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// TestUserIsolation: a second user (bob) can neither change nor read
// what the first (alice) owns, through any namespace RPC; gateways act
// for the user they name, other callers cannot name one; admin RPCs are
// refused to non-admins. Every check here fails without the Authorizer
// (bob's calls all succeeded).
func TestUserIsolation(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	admin := c.client() // "test", an admin
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	ids := registerDatanodes(t, admin, 3)
	waitFor(t, 10*time.Second, "pipelines and containers", func() bool {
		r, err := admin.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) >= 3
	})
	alice, bob := c.userClient("alice"), c.userClient("bob")
	gw := c.userClient(pki.GatewayPrefix + "test")
	ns := func(cl *metaclient.Client) metapb.NamespaceClient { return cl.Namespace }

	// Volumes: admins only; bucket creation: the volume's owner.
	_, err := alice.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "mine"})
	wantDenied(t, "alice creates a volume", err)
	_, err = admin.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"})
	mustOK(t, "admin creates alice's volume", err)
	b, err := alice.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "abkt"})
	mustOK(t, "alice creates a bucket", err)
	if b.Owner != "alice" {
		t.Fatalf("bucket owner %q, want alice", b.Owner)
	}
	_, err = bob.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bbkt"})
	wantDenied(t, "bob creates a bucket in alice's volume", err)
	_, err = alice.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "forbob", Owner: "bob"})
	wantDenied(t, "alice creates a bucket for bob", err)

	// alice writes a key; bob cannot read, list, overwrite, copy or delete it.
	writeKey := func(cl *metaclient.Client, bucket, key string) (*metapb.OpenKeyResponse, error) {
		o, err := cl.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: bucket, Key: key})
		if err != nil {
			return nil, err
		}
		_, err = cl.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 7}}})
		return o, err
	}
	_, err = writeKey(alice, "abkt", "k")
	mustOK(t, "alice writes", err)
	_, err = bob.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	wantDenied(t, "bob reads alice's key", err)
	_, err = bob.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k", NoLocations: true})
	wantDenied(t, "bob stats alice's key", err)
	_, err = bob.Namespace.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "abkt"})
	wantDenied(t, "bob lists alice's bucket", err)
	_, err = bob.Namespace.ListMultipartUploads(ctx, &metapb.ListMultipartUploadsRequest{Volume: "vol", Bucket: "abkt"})
	wantDenied(t, "bob lists alice's uploads", err)
	_, err = writeKey(bob, "abkt", "k")
	wantDenied(t, "bob overwrites alice's key", err)
	_, err = bob.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	wantDenied(t, "bob deletes alice's key", err)
	_, err = bob.Namespace.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k", NewKey: "k2"})
	wantDenied(t, "bob renames alice's key", err)
	_, err = bob.Namespace.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: "vol", Bucket: "abkt", Key: "k", Meta: &metapb.ObjectMeta{}})
	wantDenied(t, "bob sets alice's key's metadata", err)
	_, err = bob.Namespace.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "vol", Bucket: "abkt", Key: "m"})
	wantDenied(t, "bob uploads into alice's bucket", err)
	_, err = bob.Namespace.CopyKey(ctx, &metapb.CopyKeyRequest{Volume: "vol", SrcBucket: "abkt", SrcKey: "k", Bucket: "abkt", Key: "copy"})
	wantDenied(t, "bob copies alice's key", err)
	// An open key of alice's: bob cannot add blocks to it or commit it.
	o, err := alice.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: "open"})
	mustOK(t, "alice opens a key", err)
	_, err = bob.Namespace.AllocateBlock(ctx, &metapb.AllocateBlockRequest{OpenId: o.OpenId})
	wantDenied(t, "bob allocates into alice's open key", err)
	_, err = bob.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1}}})
	wantDenied(t, "bob commits alice's open key", err)
	_, err = bob.Namespace.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "abkt"})
	wantDenied(t, "bob deletes alice's bucket", err)
	_, err = bob.Namespace.DeleteVolume(ctx, &metapb.DeleteVolumeRequest{Name: "vol"})
	wantDenied(t, "bob deletes alice's volume", err)
	_, err = alice.Namespace.DeleteVolume(ctx, &metapb.DeleteVolumeRequest{Name: "vol"})
	wantDenied(t, "alice deletes her volume (admins only)", err)
	mode := uint32(0o777)
	_, err = bob.Namespace.SetFileAttrs(ctx, &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "abkt", Attrs: &metapb.FileAttrs{Permission: &mode}})
	wantDenied(t, "bob opens alice's bucket to all", err)
	_, err = alice.Namespace.SetFileAttrs(ctx, &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "abkt", Attrs: &metapb.FileAttrs{Owner: "bob"}})
	wantDenied(t, "alice gives her bucket away (admins only)", err)

	// The on-behalf-of metadata: from a gateway it is the user; from
	// anyone else it is ignored (bob stays bob).
	asAlice := func(ctx context.Context) context.Context { return metaclient.WithUser(ctx, "alice", false) }
	_, err = bob.Namespace.LookupKey(asAlice(ctx), &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	wantDenied(t, "bob claims to be alice", err)
	_, err = bob.Namespace.DeleteVolume(metaclient.WithUser(ctx, "test", true), &metapb.DeleteVolumeRequest{Name: "vol"})
	wantDenied(t, "bob claims to be an admin", err)
	_, err = gw.Namespace.LookupKey(asAlice(ctx), &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	mustOK(t, "a gateway reads for alice", err)
	_, err = gw.Namespace.LookupKey(metaclient.WithUser(ctx, "bob", false), &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	wantDenied(t, "a gateway reads for bob", err)
	_, err = gw.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	wantDenied(t, "a gateway reads in its own name", err)

	// S3 secrets: admins manage them; gateways (own name) read them.
	_, err = bob.Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{Owner: "bob", Admin: true})
	wantDenied(t, "bob makes himself an S3 admin key", err)
	sec, err := c.userClient("test").Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{Owner: "alice"})
	mustOK(t, "admin creates alice's S3 key", err)
	_, err = bob.Namespace.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: sec.AccessKeyId})
	wantDenied(t, "bob reads alice's S3 secret", err)
	_, err = gw.Namespace.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: sec.AccessKeyId})
	mustOK(t, "a gateway reads an S3 secret", err)
	_, err = gw.Namespace.GetS3Secret(asAlice(ctx), &metapb.GetS3SecretRequest{AccessKeyId: sec.AccessKeyId})
	wantDenied(t, "a gateway reads an S3 secret for alice", err)
	_, err = bob.Namespace.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: sec.AccessKeyId})
	wantDenied(t, "bob deletes alice's S3 key", err)

	// SCM admin RPCs.
	_, err = bob.Scm.SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[0], State: metapb.NodeOpState_DECOMMISSIONING})
	wantDenied(t, "bob decommissions a datanode", err)
	_, err = gw.Scm.SetDatanodeOpState(asAlice(ctx), &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[0], State: metapb.NodeOpState_ENTERING_MAINTENANCE})
	wantDenied(t, "a gateway for alice puts a datanode in maintenance", err)
	_, err = bob.Scm.AddCachePool(ctx, &metapb.CachePool{Name: "bobs"})
	wantDenied(t, "bob adds a cache pool", err)
	// (cache directives: by pool ownership, TestCachePoolOwnership)
	_, err = bob.Scm.RemoveCachePool(ctx, &metapb.RemoveCachePoolRequest{})
	wantDenied(t, "bob removes a cache pool", err)
	_, err = admin.Scm.SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: ids[0], State: metapb.NodeOpState_IN_SERVICE})
	if status.Code(err) == codes.PermissionDenied {
		t.Fatalf("admin recommissions: %v", err)
	}

	// Replica records (GetContainerReplicas: the datanodes' unhealthy
	// reasons; ListCorruptReplicas: the stored reports): admins only, as
	// their reasons may name datanode-local paths. A datanode's
	// certificate is refused by its role. The health summary stays open.
	lc, err := admin.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
	mustOK(t, "admin lists containers", err)
	cid := lc.Containers[0].GetId()
	dn := dnScm(t, admin, ids[1])
	for _, q := range []*metapb.GetContainerReplicasRequest{{ContainerId: cid}, {}} {
		_, err = bob.Scm.GetContainerReplicas(ctx, q)
		wantDenied(t, fmt.Sprintf("bob reads replica records (container %d)", q.ContainerId), err)
		_, err = gw.Scm.GetContainerReplicas(asAlice(ctx), q)
		wantDenied(t, fmt.Sprintf("a gateway for alice reads replica records (container %d)", q.ContainerId), err)
		_, err = dn.GetContainerReplicas(ctx, q)
		wantDenied(t, fmt.Sprintf("a datanode reads replica records (container %d)", q.ContainerId), err)
		r, err := admin.Scm.GetContainerReplicas(ctx, q)
		mustOK(t, fmt.Sprintf("admin reads replica records (container %d)", q.ContainerId), err)
		if q.ContainerId != 0 && (len(r.Containers) != 1 || r.Containers[0].GetContainer().GetId() != cid) {
			t.Fatalf("admin reads container %d's replica records: %v", cid, r)
		}
	}
	_, err = bob.Scm.ListCorruptReplicas(ctx, &metapb.ListCorruptReplicasRequest{})
	wantDenied(t, "bob lists corrupt replica reports", err)
	_, err = dn.ListCorruptReplicas(ctx, &metapb.ListCorruptReplicasRequest{})
	wantDenied(t, "a datanode lists corrupt replica reports", err)
	_, err = admin.Scm.ListCorruptReplicas(ctx, &metapb.ListCorruptReplicasRequest{})
	mustOK(t, "admin lists corrupt replica reports", err)
	_, err = bob.Scm.GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
	mustOK(t, "bob reads the replication health summary", err)

	// Record reads stay open to every user: names, owners, modes.
	_, err = bob.Namespace.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol", Name: "abkt"})
	mustOK(t, "bob reads the bucket record", err)

	// alice manages her own; the admin removes the volume.
	_, err = alice.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "abkt", Key: "k"})
	mustOK(t, "alice deletes her key", err)
	_, err = ns(alice).DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "abkt"})
	mustOK(t, "alice deletes her bucket", err)
	_, err = admin.Namespace.DeleteVolume(ctx, &metapb.DeleteVolumeRequest{Name: "vol"})
	mustOK(t, "admin deletes the volume", err)
}

// TestFSPermissions: in an FS bucket the POSIX modes of directories
// decide: alice's 0700 directory refuses bob's create, list and delete,
// her 0777 one takes them.
func TestFSPermissions(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	admin := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	registerDatanodes(t, admin, 3)
	waitFor(t, 10*time.Second, "pipelines and containers", func() bool {
		r, err := admin.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) >= 3
	})
	alice, bob := c.userClient("alice"), c.userClient("bob")
	_, err := admin.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"})
	mustOK(t, "create volume", err)
	_, err = alice.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "fsb", Layout: metapb.BucketLayout_FS})
	mustOK(t, "create fs bucket", err)
	perm := func(m uint32) *uint32 { return &m }
	_, err = alice.Namespace.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "private/inner", Attrs: &metapb.FileAttrs{Permission: perm(0o700)}})
	mustOK(t, "alice mkdir private", err)
	_, err = alice.Namespace.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "shared", Attrs: &metapb.FileAttrs{Permission: perm(0o777)}})
	mustOK(t, "alice mkdir shared", err)
	st, err := alice.Namespace.GetFileStatus(ctx, &metapb.GetFileStatusRequest{Volume: "vol", Bucket: "fsb", Path: "shared"})
	mustOK(t, "stat shared", err)
	if st.GetAttrs().GetOwner() != "alice" {
		t.Fatalf("shared's owner %q, want alice (the creator)", st.GetAttrs().GetOwner())
	}

	_, err = bob.Namespace.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "private/x"})
	wantDenied(t, "bob mkdir in alice's 0700 dir", err)
	_, err = bob.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fsb", Key: "private/f"})
	wantDenied(t, "bob creates a file in alice's 0700 dir", err)
	_, err = bob.Namespace.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb", Path: "private"})
	wantDenied(t, "bob lists alice's 0700 dir", err)
	_, err = bob.Namespace.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb", Path: "private/inner"})
	wantDenied(t, "bob lists below alice's 0700 dir (no search permission)", err)
	_, err = bob.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "private/inner", Recursive: true})
	wantDenied(t, "bob deletes in alice's 0700 dir", err)
	_, err = bob.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "private", Recursive: true})
	wantDenied(t, "bob deletes alice's dir from her 0755 bucket root", err)
	_, err = bob.Namespace.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "fsb", Key: "private/inner", NewKey: "shared/stolen"})
	wantDenied(t, "bob renames out of alice's 0700 dir", err)
	_, err = bob.Namespace.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "private/x", Attrs: &metapb.FileAttrs{Owner: "alice"}})
	wantDenied(t, "bob creates a directory owned by alice", err)

	// The shared (0777) directory takes bob's entries, owned by bob.
	_, err = bob.Namespace.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "shared/bobs"})
	mustOK(t, "bob mkdir in the shared dir", err)
	st, err = bob.Namespace.GetFileStatus(ctx, &metapb.GetFileStatusRequest{Volume: "vol", Bucket: "fsb", Path: "shared/bobs"})
	mustOK(t, "bob stats his dir", err)
	if st.GetAttrs().GetOwner() != "bob" {
		t.Fatalf("bob's directory is owned by %q", st.GetAttrs().GetOwner())
	}
	o, err := bob.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fsb", Key: "shared/bobs/f"})
	mustOK(t, "bob creates a file in his dir", err)
	_, err = bob.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 3}}})
	mustOK(t, "bob commits", err)
	_, err = bob.Namespace.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb", Path: "shared"})
	mustOK(t, "bob lists the shared dir", err)
	// bob's directory (0755 by default): alice may list it, not write in it.
	_, err = alice.Namespace.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb", Path: "shared/bobs"})
	mustOK(t, "alice lists bob's dir", err)
	_, err = alice.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "shared/bobs/f"})
	wantDenied(t, "alice deletes in bob's 0755 dir", err)
	// Making the private directory world-writable lets bob in.
	_, err = bob.Namespace.SetFileAttrs(ctx, &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "fsb", Path: "private", Attrs: &metapb.FileAttrs{Permission: perm(0o777)}})
	wantDenied(t, "bob chmods alice's dir", err)
	_, err = alice.Namespace.SetFileAttrs(ctx, &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: "fsb", Path: "private", Attrs: &metapb.FileAttrs{Permission: perm(0o777)}})
	mustOK(t, "alice chmods her dir", err)
	_, err = bob.Namespace.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "private/x"})
	mustOK(t, "bob mkdir in the now open dir", err)
}

// TestAdminMethodsRefuseDatanodes: authorize checks admins only for
// callers other than datanodes, so a method in adminMethods must not let
// datanode certificates in by role (it would be open to every datanode).
func TestAdminMethodsRefuseDatanodes(t *testing.T) {
	for m := range adminMethods {
		roles, ok := methodRoles[m]
		if !ok {
			roles = clientsAndMeta
		}
		if slices.Contains(roles, pki.RoleDatanode) {
			t.Errorf("%s: admins only, but methodRoles lets datanodes call it (no admin check for them)", m)
		}
	}
}
