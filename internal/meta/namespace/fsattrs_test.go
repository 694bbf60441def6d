package namespace

import (
	"testing"

	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func perm(p uint32) *uint32 { return &p }

// Owners, groups, permissions and times on files, directories, buckets
// and volumes: stored through Raft, returned by GetFileStatus/ListStatus,
// moved with a rename, and bounded.
func TestSetFileAttrs(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	if _, err := e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice",
		Attrs: &metapb.FileAttrs{Owner: "alice", Group: "staff", Permission: perm(0o711)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "fsb", Layout: metapb.BucketLayout_FS,
		Attrs: &metapb.FileAttrs{Owner: "bob", Permission: perm(0o750)}}); err != nil {
		t.Fatal(err)
	}
	// mkdir -p with attributes: the last directory gets them, the parents
	// created on the way get owner write+search too; an existing directory
	// keeps its own.
	st, err := e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "a/b/c",
		Attrs: &metapb.FileAttrs{Owner: "carol", Group: "eng", Permission: perm(0o500)}})
	if err != nil || st.Attrs.GetOwner() != "carol" || st.Attrs.GetPermission() != 0o500 {
		t.Fatalf("create directory: %v %v", st, err)
	}
	stat := func(p string) *metapb.FileStatus {
		t.Helper()
		st, err := e.s.GetFileStatus(ctx, &metapb.GetFileStatusRequest{Volume: "vol", Bucket: "fsb", Path: p})
		if err != nil {
			t.Fatalf("stat %q: %v", p, err)
		}
		return st
	}
	if a := stat("a").Attrs; a.GetPermission() != 0o700 || a.GetOwner() != "carol" || a.GetGroup() != "eng" {
		t.Fatalf("implicit parent attrs %v, want carol:eng 700", a)
	}
	if a := stat("a/b/c").Attrs; a.GetPermission() != 0o500 {
		t.Fatalf("a/b/c attrs %v", a)
	}
	if st, err := e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "a/b",
		Attrs: &metapb.FileAttrs{Owner: "mallory", Permission: perm(0o777)}}); err != nil || st.Attrs.GetOwner() != "carol" {
		t.Fatalf("mkdir of an existing directory changed it: %v %v", st, err)
	}
	if a := stat("").Attrs; a.GetOwner() != "bob" || a.GetPermission() != 0o750 {
		t.Fatalf("bucket root attrs %v", a)
	}

	set := func(bucket, path string, a *metapb.FileAttrs) (*metapb.FileAttrs, error) {
		r, err := e.s.SetFileAttrs(ctx, &metapb.SetFileAttrsRequest{Volume: "vol", Bucket: bucket, Path: path, Attrs: a})
		return r.GetAttrs(), err
	}
	// A directory: chmod keeps the owner; chown keeps the permission.
	if _, err := set("fsb", "a/b", &metapb.FileAttrs{Permission: perm(0o1777)}); err != nil {
		t.Fatal(err)
	}
	if a, err := set("fsb", "a/b", &metapb.FileAttrs{Owner: "dave", MtimeUnixMs: 1234, AtimeUnixMs: 5678}); err != nil ||
		!proto.Equal(a, &metapb.FileAttrs{Owner: "dave", Group: "eng", Permission: perm(0o1777), MtimeUnixMs: 1234, AtimeUnixMs: 5678}) {
		t.Fatalf("set attrs: %v %v", a, err)
	}
	l, err := e.s.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb", Path: "a"})
	if err != nil || len(l.Entries) != 1 || l.Entries[0].Attrs.GetOwner() != "dave" || l.Entries[0].Attrs.GetPermission() != 0o1777 {
		t.Fatalf("list status: %v %v", l, err)
	}
	// A file: in its KeyInfo, kept by a rename of its directory.
	e.put(t, "vol", "fsb", "a/b/f", 10)
	if _, err := set("fsb", "a/b/f", &metapb.FileAttrs{Owner: "erin", Permission: perm(0o600)}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a/b", NewKey: "moved"}); err != nil {
		t.Fatal(err)
	}
	if f := stat("moved/f"); f.File.Attrs.GetOwner() != "erin" || f.File.Attrs.GetPermission() != 0o600 || f.Attrs != nil {
		t.Fatalf("file after rename: %v", f)
	}
	if a := stat("moved").Attrs; a.GetOwner() != "dave" {
		t.Fatalf("directory after rename: %v", a)
	}
	// A bucket and a volume.
	if _, err := set("fsb", "", &metapb.FileAttrs{Group: "ops"}); err != nil {
		t.Fatal(err)
	}
	if b, _ := e.s.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol", Name: "fsb"}); b.Attrs.GetGroup() != "ops" || b.Attrs.GetOwner() != "bob" {
		t.Fatalf("bucket attrs %v", b.Attrs)
	}
	if _, err := set("", "", &metapb.FileAttrs{Owner: "frank", Permission: perm(0o755)}); err != nil {
		t.Fatal(err)
	}
	if v, _ := e.s.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "vol"}); v.Owner != "frank" || v.Attrs.GetGroup() != "staff" || v.Attrs.GetPermission() != 0o755 {
		t.Fatalf("volume %v", v)
	}
	// Errors.
	_, err = set("fsb", "nope", &metapb.FileAttrs{Owner: "x"})
	wantCode(t, err, codes.NotFound, `"nope"`)
	_, err = set("fsb", "moved/f/under", &metapb.FileAttrs{Owner: "x"})
	wantCode(t, err, codes.FailedPrecondition, "is a file")
	_, err = set("fsb", "moved", &metapb.FileAttrs{Permission: perm(0o2000)})
	wantCode(t, err, codes.InvalidArgument, "permission")
	_, err = set("fsb", "moved", &metapb.FileAttrs{Owner: string(make([]byte, MaxOwnerBytes+1))})
	wantCode(t, err, codes.InvalidArgument, "owner")
	_, err = set("fsb", "moved", nil)
	wantCode(t, err, codes.InvalidArgument, "no attributes")
	_, err = set("", "x", &metapb.FileAttrs{Owner: "x"})
	wantCode(t, err, codes.InvalidArgument, "needs a bucket")
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "obj"})
	e.put(t, "vol", "obj", "k", 1)
	_, err = set("obj", "k", &metapb.FileAttrs{Owner: "x"})
	wantCode(t, err, codes.FailedPrecondition, "FS bucket")
}

// RenameKey with overwrite replaces the destination in the same apply: a
// file by a file (its blocks released), an empty directory by a
// directory; anything else fails and changes nothing.
func TestRenameOverwrite(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "fsb", Layout: metapb.BucketLayout_FS})
	rename := func(src, dst string, overwrite bool) error {
		_, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "fsb", Key: src, NewKey: dst, Overwrite: overwrite})
		return err
	}
	src := e.put(t, "vol", "fsb", "d/src", 5)
	old := e.put(t, "vol", "fsb", "d/dst", 7)
	wantCode(t, rename("d/src", "d/dst", false), codes.AlreadyExists, "exists")
	if err := rename("d/src", "d/dst", true); err != nil {
		t.Fatal(err)
	}
	got, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "fsb", Key: "d/dst"})
	if err != nil || got.ObjectId != src.ObjectId || got.Size != 5 {
		t.Fatalf("after overwrite: %v %v", got, err)
	}
	if _, err := e.s.GetFileStatus(ctx, &metapb.GetFileStatusRequest{Volume: "vol", Bucket: "fsb", Path: "d/src"}); grpcstatus.Code(err) != codes.NotFound {
		t.Fatalf("source still there: %v", err)
	}
	for range 3 {
		if err := e.s.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !e.fb.deleted[old.Blocks[0].Id.LocalId] || e.fb.deleted[src.Blocks[0].Id.LocalId] {
		t.Fatalf("blocks handed to SCM %v: want the replaced file's (%d) only", e.fb.deleted, old.Blocks[0].Id.LocalId)
	}
	// Directories: an empty one is replaced, a non-empty one is not.
	e.put(t, "vol", "fsb", "x/child", 1)
	e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "empty"})
	e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "full/sub"})
	wantCode(t, rename("x", "full", true), codes.FailedPrecondition, "not empty")
	wantCode(t, rename("x", "d/dst", true), codes.FailedPrecondition, "must both be directories")
	wantCode(t, rename("d/dst", "empty", true), codes.FailedPrecondition, "must both be files")
	if err := rename("x", "empty", true); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "fsb", Key: "empty/child"}); err != nil {
		t.Fatalf("child after directory overwrite: %v", err)
	}
	// Object buckets: the replaced key's blocks are released too.
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "obj"})
	e.put(t, "vol", "obj", "a", 1)
	ob := e.put(t, "vol", "obj", "b", 2)
	if _, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "obj", Key: "a", NewKey: "b", Overwrite: true}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		e.s.RunOnce(ctx)
	}
	if !e.fb.deleted[ob.Blocks[0].Id.LocalId] {
		t.Fatalf("object key replaced by rename kept its blocks")
	}
}
