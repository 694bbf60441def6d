package namespace

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Incomplete multipart uploads older than UploadExpiry are aborted by the
// background service and their parts' blocks go to SCM; younger ones stay.
func TestMultipartUploadExpiry(t *testing.T) {
	e := newNS(t)
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: 24 * time.Hour, UploadExpiry: time.Hour},
		e.st, &fakeRaft{st: e.st}, e.fb)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "s3v"})
	if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "bk1"}); err != nil {
		t.Fatal(err)
	}
	create := func(key string) *metapb.MultipartUpload {
		u, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	partBlocks := func(key string, u *metapb.MultipartUpload, n uint32) uint64 {
		if _, err := e.putPart(t, key, u.UploadId, n, 100); err != nil {
			t.Fatal(err)
		}
		return e.fb.next // the block the part's open key was given
	}
	old := create("old")
	oldBlocks := []uint64{partBlocks("old", old, 1), partBlocks("old", old, 2)}
	e.now = e.now.Add(30 * time.Minute)
	young := create("young")
	youngBlock := partBlocks("young", young, 1)

	// 70 and 40 minutes old: only the first has expired.
	e.now = e.now.Add(40 * time.Minute)
	if err := e.s.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	_, err := e.s.ListParts(ctx, &metapb.ListPartsRequest{Volume: "s3v", Bucket: "bk1", Key: "old", UploadId: old.UploadId})
	wantReason(t, err, codes.NotFound, ReasonNoSuchUpload)
	if ps := e.st.sortedParts(old.UploadId); len(ps) != 0 {
		t.Fatalf("parts of the expired upload left: %v", ps)
	}
	lu, err := e.s.ListMultipartUploads(ctx, &metapb.ListMultipartUploadsRequest{Volume: "s3v", Bucket: "bk1"})
	if err != nil || len(lu.Uploads) != 1 || lu.Uploads[0].UploadId != young.UploadId {
		t.Fatalf("uploads after expiry: %v %v", lu, err)
	}
	for _, b := range oldBlocks {
		if !e.fb.deleted[b] {
			t.Fatalf("block %d of the expired upload not handed to SCM (deleted %v)", b, e.fb.deleted)
		}
	}
	if e.fb.deleted[youngBlock] {
		t.Fatal("the young upload's block was deleted")
	}
	// Its part can still be used: complete it.
	if _, err := e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "young",
		UploadId: young.UploadId, Parts: []*metapb.CompletedPart{{PartNumber: 1, Etag: e.partEtag(t, young, 1)}}}); err != nil {
		t.Fatal(err)
	}
	// Once all are gone, the bucket may be deleted.
	u3 := create("third")
	e.now = e.now.Add(2 * time.Hour)
	if err := e.s.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.AbortMultipartUpload(ctx, &metapb.AbortMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "third", UploadId: u3.UploadId}); err == nil {
		t.Fatal("the third upload did not expire")
	}
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "s3v", Bucket: "bk1", Key: "young"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "s3v", Name: "bk1"}); err != nil {
		t.Fatalf("delete bucket after expiry: %v", err)
	}
}

func (e *nsEnv) partEtag(t *testing.T, u *metapb.MultipartUpload, n uint32) string {
	t.Helper()
	lp, err := e.s.ListParts(e.ctx, &metapb.ListPartsRequest{Volume: u.Volume, Bucket: u.Bucket, Key: u.Key, UploadId: u.UploadId})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range lp.Parts {
		if p.PartNumber == n {
			return p.Etag
		}
	}
	t.Fatalf("no part %d", n)
	return ""
}

// The expiry walks the uploads a bounded number of rows at a time and
// resumes where it stopped.
func TestExpiredUploadsCursor(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "s3v"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "bk1"})
	want := map[string]bool{}
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		u, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: k})
		if err != nil {
			t.Fatal(err)
		}
		// c is made a minute later than the others: not expired.
		switch k {
		case "b":
			e.now = e.now.Add(time.Minute)
		case "c":
			e.now = e.now.Add(-time.Minute)
		}
		if k != "c" {
			want[u.UploadId] = true
		}
	}
	var cursor []byte
	got := map[string]bool{}
	rounds := 0
	for {
		ups, next, err := e.st.ExpiredUploads(e.now.Add(time.Second).UnixMilli(), cursor, 2, 100)
		if err != nil {
			t.Fatal(err)
		}
		rounds++
		for _, u := range ups {
			if got[u.UploadId] {
				t.Fatalf("upload %s returned twice", u.Key)
			}
			got[u.UploadId] = true
		}
		if next == nil {
			break
		}
		cursor = next
		if rounds > 10 {
			t.Fatal("the walk does not end")
		}
	}
	if len(got) != len(want) || rounds != 3 {
		t.Fatalf("walk found %d uploads in %d rounds, want %d in 3", len(got), rounds, len(want))
	}
	for id := range want {
		if !got[id] {
			t.Fatalf("upload %s not found", id)
		}
	}
	// limit bounds the uploads returned.
	ups, next, _ := e.st.ExpiredUploads(e.now.Add(time.Second).UnixMilli(), nil, 100, 1)
	if len(ups) != 1 || next == nil {
		t.Fatalf("limit 1: %d uploads, next %q", len(ups), next)
	}
}
