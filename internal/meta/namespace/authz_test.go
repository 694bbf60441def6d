package namespace

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// authzEnv: volume "vol" of alice with an OBJECT bucket "obkt" and an FS
// bucket "fbkt" (0755) holding a/b/c (directories 0755) and the file
// a/b/c/f, written by the trusted in-process caller.
func authzEnv(t testing.TB) *nsEnv {
	e := newNS(t)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	for _, b := range []*metapb.CreateBucketRequest{{Volume: "vol", Name: "obkt", Owner: "alice"}, {Volume: "vol", Name: "fbkt", Owner: "alice", Layout: metapb.BucketLayout_FS}} {
		if _, err := e.s.CreateBucket(e.ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.s.CreateDirectory(e.ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fbkt", Path: "a/b/c"}); err != nil {
		t.Fatal(err)
	}
	e.put(t, "vol", "obkt", "k", 1)
	e.put(t, "vol", "fbkt", "a/b/c/f", 1)
	return e
}

// TestAuthorizerModes: the owner's bits for the owner, the other bits for
// everyone else, admins pass, and a WebHDFS file's hdfs-owner and
// hdfs-permission count.
func TestAuthorizerModes(t *testing.T) {
	e := authzEnv(t)
	az := func(user string, admin bool) *Authorizer {
		return e.s.authz(WithCaller(e.ctx, Caller{User: user, Admin: admin}))
	}
	alice, bob, root := az("alice", false), az("bob", false), az("root", true)
	for _, c := range []struct {
		name string
		err  error
		want codes.Code
	}{
		{"alice reads her object", alice.Read("vol", "obkt", "k"), codes.OK},
		{"bob reads alice's object (0700 bucket)", bob.Read("vol", "obkt", "k"), codes.PermissionDenied},
		{"root reads alice's object", root.Read("vol", "obkt", "k"), codes.OK},
		{"bob reads alice's 0644 file", bob.Read("vol", "fbkt", "a/b/c/f"), codes.OK},
		{"bob lists a 0755 directory", bob.List("vol", "fbkt", "a/b"), codes.OK},
		{"bob writes in a 0755 directory", bob.Write("vol", "fbkt", "a/b/c/g", "write"), codes.PermissionDenied},
		{"alice writes in her directory", alice.Write("vol", "fbkt", "a/b/c/g", "write"), codes.OK},
		{"bob mkdir -p below alice's tree", bob.Write("vol", "fbkt", "a/b/x/y/z", "create directory"), codes.PermissionDenied},
		{"bob deletes the volume", bob.Admin("delete volume"), codes.PermissionDenied},
		{"bob deletes alice's bucket", bob.DeleteBucket("vol", "fbkt"), codes.PermissionDenied},
		{"a missing bucket", bob.Read("vol", "nope", "k"), codes.NotFound},
	} {
		if got := statusCode(c.err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
		}
	}
	// A file WebHDFS wrote for bob with mode 600: only bob reads it.
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fbkt", Key: "a/b/c/bobs"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1}},
		Meta: &metapb.ObjectMeta{User: map[string]string{"hdfs-owner": "bob", "hdfs-permission": "600"}}}); err != nil {
		t.Fatal(err)
	}
	if err := bob.Read("vol", "fbkt", "a/b/c/bobs"); err != nil {
		t.Errorf("bob reads his 600 file: %v", err)
	}
	if err := alice.Read("vol", "fbkt", "a/b/c/bobs"); statusCode(err) != codes.PermissionDenied {
		t.Errorf("alice reads bob's 600 file: %v", err)
	}
}

func statusCode(err error) codes.Code { return status.Code(err) }

// BenchmarkAuthorize: the cost of the check a call pays before it runs.
//
//	go test -run '^$' -bench BenchmarkAuthorize ./internal/meta/namespace/
func BenchmarkAuthorize(b *testing.B) {
	e := authzEnv(b)
	alice := e.s.authz(WithCaller(e.ctx, Caller{User: "alice"}))
	b.Run("object-read", func(b *testing.B) {
		for b.Loop() {
			if err := alice.Read("vol", "obkt", "k"); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("fs-read-depth4", func(b *testing.B) {
		for b.Loop() {
			if err := alice.Read("vol", "fbkt", "a/b/c/f"); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkLookupFS is what the check in BenchmarkAuthorize/fs-read-depth4
// is added to: the lookup of the same file.
func BenchmarkLookupFS(b *testing.B) {
	e := authzEnv(b)
	for b.Loop() {
		if _, err := e.st.LookupKey("vol", "fbkt", "a/b/c/f"); err != nil {
			b.Fatal(err)
		}
	}
}
