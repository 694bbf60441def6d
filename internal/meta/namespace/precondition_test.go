package namespace

import (
	"sync"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// commitWith opens key and commits it with meta's ETag under precondition p.
func (e *nsEnv) commitWith(t *testing.T, bucket, key, etag string, p *metapb.KeyPrecondition) (*metapb.KeyInfo, error) {
	t.Helper()
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "s3v", Bucket: bucket, Key: key})
	if err != nil {
		t.Fatalf("open %s: %v", key, err)
	}
	return e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 10}},
		Meta: &metapb.ObjectMeta{Etag: etag}, Precondition: p})
}

func lookupEtag(t *testing.T, e *nsEnv, bucket, key string) string {
	t.Helper()
	ki, err := e.s.LookupKey(e.ctx, &metapb.LookupKeyRequest{Volume: "s3v", Bucket: bucket, Key: key, NoLocations: true})
	if err != nil {
		t.Fatalf("lookup %s: %v", key, err)
	}
	return ki.Meta.GetEtag()
}

// TestKeyPreconditions: expect_absent and expect_etag are decided in the
// apply, for commits, completed uploads and copies, on both layouts.
func TestKeyPreconditions(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "s3v"})
	for _, b := range []*metapb.CreateBucketRequest{{Volume: "s3v", Name: "bk1"}, {Volume: "s3v", Name: "fs1", Layout: metapb.BucketLayout_FS}} {
		if _, err := e.s.CreateBucket(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	absent := &metapb.KeyPrecondition{ExpectAbsent: true}
	etag := func(s string) *metapb.KeyPrecondition { return &metapb.KeyPrecondition{ExpectEtag: s} }

	// Racing creators: exactly one wins, the others fail the precondition.
	const n = 12
	var wg sync.WaitGroup
	errs := make([]error, n)
	opens := make([]*metapb.OpenKeyResponse, n)
	for i := range n {
		o, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "s3v", Bucket: "bk1", Key: "race"})
		if err != nil {
			t.Fatal(err)
		}
		opens[i] = o
	}
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: opens[i].OpenId, Blocks: []*metapb.KeyBlock{{Id: opens[i].Blocks[0].Id, Length: 1}},
				Meta: &metapb.ObjectMeta{Etag: string(rune('a' + i))}, Precondition: absent})
		}()
	}
	wg.Wait()
	winner := -1
	for i, err := range errs {
		if err == nil {
			if winner >= 0 {
				t.Fatalf("writers %d and %d both created the key", winner, i)
			}
			winner = i
			continue
		}
		wantReason(t, err, codes.FailedPrecondition, ReasonPreconditionFailed)
	}
	if winner < 0 {
		t.Fatal("no writer won")
	}
	if got := lookupEtag(t, e, "bk1", "race"); got != string(rune('a'+winner)) {
		t.Fatalf("key has ETag %q, the winner wrote %q", got, string(rune('a'+winner)))
	}

	// If-Match: only the current ETag replaces; a missing key is NotFound.
	_, err := e.commitWith(t, "bk1", "race", "new", etag("nope"))
	wantReason(t, err, codes.FailedPrecondition, ReasonPreconditionFailed)
	if _, err := e.commitWith(t, "bk1", "race", "new", etag(`"`+string(rune('a'+winner))+`"`)); err != nil {
		t.Fatal(err)
	}
	if got := lookupEtag(t, e, "bk1", "race"); got != "new" {
		t.Fatalf("ETag %q after a matching If-Match", got)
	}
	_, err = e.commitWith(t, "bk1", "missing", "x", etag("new"))
	wantReason(t, err, codes.NotFound, metapb.ReasonNoSuchKey)
	_, err = e.commitWith(t, "bk1", "x", "x", &metapb.KeyPrecondition{ExpectAbsent: true, ExpectEtag: "y"})
	wantCode(t, err, codes.InvalidArgument, "both absent")

	// Parts take no precondition.
	u0, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "pp"})
	if err != nil {
		t.Fatal(err)
	}
	o, _ := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "s3v", Bucket: "bk1", Key: "pp"})
	_, err = e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1}},
		Part: &metapb.PartRef{UploadId: u0.UploadId, PartNumber: 1, Etag: "ab"}, Precondition: absent})
	wantCode(t, err, codes.InvalidArgument, "not to part")

	// CompleteMultipartUpload: a failed precondition leaves the upload.
	u, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "race"})
	if err != nil {
		t.Fatal(err)
	}
	p1, err := e.putPart(t, "race", u.UploadId, 1, 100)
	if err != nil {
		t.Fatal(err)
	}
	complete := func(p *metapb.KeyPrecondition) error {
		_, err := e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "race", UploadId: u.UploadId,
			Parts: []*metapb.CompletedPart{{PartNumber: 1, Etag: p1.Meta.Etag}}, Precondition: p})
		return err
	}
	wantReason(t, complete(absent), codes.FailedPrecondition, ReasonPreconditionFailed)
	wantReason(t, complete(etag("old")), codes.FailedPrecondition, ReasonPreconditionFailed)
	if lp, err := e.s.ListParts(ctx, &metapb.ListPartsRequest{Volume: "s3v", Bucket: "bk1", Key: "race", UploadId: u.UploadId}); err != nil || len(lp.Parts) != 1 {
		t.Fatalf("upload after a failed conditional complete: %v %v", lp, err)
	}
	if err := complete(etag("new")); err != nil {
		t.Fatal(err)
	}

	// CopyKey onto an existing destination with expect_absent fails; onto
	// a new one it succeeds.
	cp := func(dst string, p *metapb.KeyPrecondition) error {
		_, err := e.s.CopyKey(ctx, &metapb.CopyKeyRequest{Volume: "s3v", SrcBucket: "bk1", SrcKey: "race", Bucket: "bk1", Key: dst, Precondition: p})
		return err
	}
	e.commitWith(t, "bk1", "dst", "d", nil)
	wantReason(t, cp("dst", absent), codes.FailedPrecondition, ReasonPreconditionFailed)
	if got := lookupEtag(t, e, "bk1", "dst"); got != "d" {
		t.Fatalf("destination overwritten by a refused copy: ETag %q", got)
	}
	if err := cp("dst", etag("d")); err != nil {
		t.Fatal(err)
	}
	if err := cp("dst2", absent); err != nil {
		t.Fatal(err)
	}

	// fs buckets: create-if-absent (WebHDFS CREATE without overwrite).
	if _, err := e.commitWith(t, "fs1", "a/b/file", "f1", absent); err != nil {
		t.Fatal(err)
	}
	_, err = e.commitWith(t, "fs1", "a/b/file", "f2", absent)
	wantReason(t, err, codes.FailedPrecondition, ReasonPreconditionFailed)
	if got := lookupEtag(t, e, "fs1", "a/b/file"); got != "f1" {
		t.Fatalf("fs file overwritten: ETag %q", got)
	}
}

// TestBucketOwners: buckets record their owner; ListBuckets filters by it.
func TestBucketOwners(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "s3v"})
	for _, b := range []struct{ name, owner string }{{"aa1", "alice"}, {"bb1", "bob"}, {"aa2", "alice"}, {"old", ""}} {
		if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: b.name, Owner: b.owner}); err != nil {
			t.Fatal(err)
		}
	}
	if b, err := e.s.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "s3v", Name: "bb1"}); err != nil || b.Owner != "bob" {
		t.Fatalf("bucket bb1: %v %v", b, err)
	}
	names := func(req *metapb.ListBucketsRequest) (out []string, truncated bool) {
		resp, err := e.s.ListBuckets(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range resp.Buckets {
			out = append(out, b.Name)
		}
		return out, resp.Truncated
	}
	if got, _ := names(&metapb.ListBucketsRequest{Volume: "s3v", Owner: "alice"}); len(got) != 2 || got[0] != "aa1" || got[1] != "aa2" {
		t.Fatalf("alice's buckets: %v", got)
	}
	if got, tr := names(&metapb.ListBucketsRequest{Volume: "s3v", Owner: "alice", PageSize: 1}); len(got) != 1 || !tr {
		t.Fatalf("alice's first page: %v truncated %v", got, tr)
	}
	if got, tr := names(&metapb.ListBucketsRequest{Volume: "s3v", Owner: "alice", StartAfter: "aa1", PageSize: 1}); len(got) != 1 || got[0] != "aa2" || tr {
		t.Fatalf("alice's second page: %v truncated %v", got, tr)
	}
	if got, _ := names(&metapb.ListBucketsRequest{Volume: "s3v"}); len(got) != 4 {
		t.Fatalf("all buckets: %v", got)
	}
	_, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "big", Owner: string(make([]byte, MaxOwnerBytes+1))})
	wantCode(t, err, codes.InvalidArgument, "owner")
}
