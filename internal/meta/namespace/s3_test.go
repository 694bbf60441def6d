package namespace

import (
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func (e *nsEnv) putPart(t *testing.T, key, upload string, n uint32, size uint64) (*metapb.KeyInfo, error) {
	t.Helper()
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "s3v", Bucket: "bk1", Key: key})
	if err != nil {
		t.Fatalf("open part: %v", err)
	}
	etag := fmt.Sprintf("%x", md5.Sum(fmt.Appendf(nil, "%s/%d/%d", upload, n, size)))
	return e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: size}},
		Part: &metapb.PartRef{UploadId: upload, PartNumber: n, Etag: etag}})
}

func wantReason(t *testing.T, err error, c codes.Code, reason string) {
	t.Helper()
	wantCode(t, err, c, "")
	if got := Reason(err); got != reason {
		t.Fatalf("reason %q, want %q (err %v)", got, reason, err)
	}
}

func TestMultipartUpload(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "s3v"})
	if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "bk1"}); err != nil {
		t.Fatal(err)
	}
	meta := &metapb.ObjectMeta{ContentType: "text/plain", User: map[string]string{"a": "1"}}
	u, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", Meta: meta})
	if err != nil {
		t.Fatal(err)
	}
	u2, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "obj"})
	if err != nil || u2.UploadId == u.UploadId {
		t.Fatalf("second upload %v %v", u2, err)
	}
	// Parts 1..3; part 2 uploaded twice (the first one's block is reclaimed).
	var etags []string
	for _, p := range []struct {
		n    uint32
		size uint64
	}{{1, 6 << 20}, {2, 1 << 20}, {2, 5 << 20}, {3, 100}} {
		ki, err := e.putPart(t, "obj", u.UploadId, p.n, p.size)
		if err != nil {
			t.Fatal(err)
		}
		if int(p.n) > len(etags) {
			etags = append(etags, ki.Meta.Etag)
		} else {
			etags[p.n-1] = ki.Meta.Etag
		}
	}
	if _, err := e.putPart(t, "obj", "nope-1", 1, 10); err == nil {
		t.Fatal("part of an unknown upload committed")
	} else {
		wantReason(t, err, codes.NotFound, ReasonNoSuchUpload)
	}
	if _, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "s3v", Bucket: "bk1", Key: "obj"}); err == nil {
		t.Fatal("parts are visible as a key")
	}
	lp, err := e.s.ListParts(ctx, &metapb.ListPartsRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", UploadId: u.UploadId, MaxParts: 2})
	if err != nil || len(lp.Parts) != 2 || !lp.Truncated || lp.Parts[1].Size != 5<<20 || lp.Parts[1].Blocks != nil {
		t.Fatalf("list parts %v %v", lp, err)
	}
	lp, _ = e.s.ListParts(ctx, &metapb.ListPartsRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", UploadId: u.UploadId, PartNumberMarker: 2})
	if len(lp.Parts) != 1 || lp.Parts[0].PartNumber != 3 || lp.Truncated {
		t.Fatalf("list parts after 2: %v", lp)
	}
	lu, err := e.s.ListMultipartUploads(ctx, &metapb.ListMultipartUploadsRequest{Volume: "s3v", Bucket: "bk1"})
	if err != nil || len(lu.Uploads) != 2 {
		t.Fatalf("list uploads %v %v", lu, err)
	}
	lu, _ = e.s.ListMultipartUploads(ctx, &metapb.ListMultipartUploadsRequest{Volume: "s3v", Bucket: "bk1", KeyMarker: "obj", UploadIdMarker: lu.Uploads[0].UploadId})
	if len(lu.Uploads) != 1 {
		t.Fatalf("list uploads after the first: %v", lu)
	}
	lu, _ = e.s.ListMultipartUploads(ctx, &metapb.ListMultipartUploadsRequest{Volume: "s3v", Bucket: "bk1", KeyMarker: "obj"})
	if len(lu.Uploads) != 0 {
		t.Fatalf("list uploads after key obj: %v", lu)
	}
	_, err = e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "s3v", Name: "bk1"})
	wantCode(t, err, codes.FailedPrecondition, "multipart uploads in progress")

	cp := func(n uint32, etag string) *metapb.CompletedPart {
		return &metapb.CompletedPart{PartNumber: n, Etag: etag}
	}
	complete := func(parts ...*metapb.CompletedPart) (*metapb.KeyInfo, error) {
		return e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", UploadId: u.UploadId, Parts: parts})
	}
	_, err = complete(cp(2, etags[1]), cp(1, etags[0]))
	wantReason(t, err, codes.InvalidArgument, ReasonInvalidPartOrder)
	_, err = complete(cp(1, etags[1]))
	wantReason(t, err, codes.InvalidArgument, ReasonInvalidPart)
	_, err = complete(cp(1, etags[0]), cp(4, etags[2]))
	wantReason(t, err, codes.InvalidArgument, ReasonInvalidPart)
	_, err = complete(cp(1, etags[0]), cp(3, etags[2]), cp(2, etags[1]))
	wantReason(t, err, codes.InvalidArgument, ReasonInvalidPartOrder)
	// Part 3 (100 bytes) may be last but not in the middle.
	ki, err := complete(cp(1, etags[0]), cp(3, `"`+etags[2]+`"`))
	if err != nil {
		t.Fatal(err)
	}
	// S3's multipart ETag: MD5 of the binary part MD5s, "-" part count.
	h := md5.New()
	for _, s := range []string{etags[0], etags[2]} {
		b, _ := hex.DecodeString(s)
		h.Write(b)
	}
	if want := fmt.Sprintf("%x-2", h.Sum(nil)); ki.Meta.Etag != want || ki.Size != 6<<20+100 || ki.Meta.ContentType != "text/plain" || ki.Meta.User["a"] != "1" || ki.Meta.PartsCount != 2 {
		t.Fatalf("completed %v, want etag %s", ki, want)
	}
	got, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "s3v", Bucket: "bk1", Key: "obj"})
	if err != nil || len(got.Locations) != 2 || got.Locations[1].Offset != 6<<20 {
		t.Fatalf("lookup completed %v %v", got, err)
	}
	if ps := e.st.sortedParts(u.UploadId); len(ps) != 0 {
		t.Fatalf("parts left after complete: %v", ps)
	}
	_, err = complete(cp(1, etags[0]))
	wantReason(t, err, codes.NotFound, ReasonNoSuchUpload)

	// The replaced part 2 and the unlisted part 2 are reclaimed; the
	// object's blocks are not.
	for {
		rows, _ := e.st.DeletedRows(1000)
		if len(rows) == 0 {
			break
		}
		if err := e.s.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, l := range got.Locations {
		if e.fb.deleted[l.Id.LocalId] {
			t.Fatalf("block %v of the completed object was deleted", l.Id)
		}
	}
	if len(e.fb.deleted) != 2 {
		t.Fatalf("deleted blocks %v, want the two part-2 blocks", e.fb.deleted)
	}

	// Too small a part in the middle; then abort reclaims every part.
	e1, _ := e.putPart(t, "obj", u2.UploadId, 1, 10)
	e2, _ := e.putPart(t, "obj", u2.UploadId, 2, 10)
	_, err = e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", UploadId: u2.UploadId,
		Parts: []*metapb.CompletedPart{cp(1, e1.Meta.Etag), cp(2, e2.Meta.Etag)}})
	wantReason(t, err, codes.InvalidArgument, ReasonEntityTooSmall)
	if _, err := e.s.AbortMultipartUpload(ctx, &metapb.AbortMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", UploadId: u2.UploadId}); err != nil {
		t.Fatal(err)
	}
	rows, _ := e.st.DeletedRows(1000)
	if len(rows) != 1 || len(rows[0].Blocks) != 2 {
		t.Fatalf("deleted rows after abort: %v", rows)
	}
	_, err = e.s.AbortMultipartUpload(ctx, &metapb.AbortMultipartUploadRequest{Volume: "s3v", Bucket: "bk1", Key: "obj", UploadId: u2.UploadId})
	wantReason(t, err, codes.NotFound, ReasonNoSuchUpload)
}

func TestKeyMetaAndSecrets(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "s3v"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "bk1"})
	o, _ := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "s3v", Bucket: "bk1", Key: "k"})
	meta := &metapb.ObjectMeta{Etag: "abc", ContentType: "image/png", User: map[string]string{"x": "y"}}
	ki, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 3}}, Meta: meta})
	if err != nil || ki.Meta.GetEtag() != "abc" {
		t.Fatalf("commit with meta: %v %v", ki, err)
	}
	l, _ := e.s.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "s3v", Bucket: "bk1"})
	if len(l.Keys) != 1 || l.Keys[0].Meta.GetEtag() != "abc" {
		t.Fatalf("listing lost the ETag: %v", l)
	}
	_, err = e.s.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: "s3v", Bucket: "bk1", Key: "k", Meta: &metapb.ObjectMeta{Etag: "abc"}, ExpectObjectId: ki.ObjectId + 1})
	wantReason(t, err, codes.FailedPrecondition, ReasonVersionChanged)
	e.now = e.now.Add(time.Second)
	got, err := e.s.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: "s3v", Bucket: "bk1", Key: "k", Meta: &metapb.ObjectMeta{Etag: "abc", Tags: map[string]string{"t": "1"}}, ExpectObjectId: ki.ObjectId, Touch: true})
	if err != nil || got.Meta.Tags["t"] != "1" || got.Meta.ContentType != "" || got.ModifiedUnixMs == ki.ModifiedUnixMs || got.Size != 3 {
		t.Fatalf("set meta %v %v", got, err)
	}
	_, err = e.s.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: "s3v", Bucket: "bk1", Key: "nope"})
	wantCode(t, err, codes.NotFound, `"nope"`)
	big := &metapb.ObjectMeta{User: map[string]string{"v": string(make([]byte, maxMetaBytes))}}
	_, err = e.s.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: "s3v", Bucket: "bk1", Key: "k", Meta: big})
	wantCode(t, err, codes.InvalidArgument, "attributes")

	s, err := e.s.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{Owner: "alice"})
	if err != nil || len(s.AccessKeyId) < 16 || len(s.SecretAccessKey) != 40 {
		t.Fatalf("create secret %v %v", s, err)
	}
	g, err := e.s.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: s.AccessKeyId})
	if err != nil || g.SecretAccessKey != s.SecretAccessKey || g.Owner != "alice" {
		t.Fatalf("get secret %v %v", g, err)
	}
	_, err = e.s.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: s.AccessKeyId})
	wantCode(t, err, codes.AlreadyExists, s.AccessKeyId)
	_, err = e.s.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "bad key"})
	wantCode(t, err, codes.InvalidArgument, "bad key")
	fixed, err := e.s.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "AKIDEXAMPLE", SecretAccessKey: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"})
	if err != nil || fixed.SecretAccessKey != "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY" {
		t.Fatalf("import secret %v %v", fixed, err)
	}
	if _, err := e.s.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: s.AccessKeyId}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: s.AccessKeyId})
	wantCode(t, err, codes.NotFound, s.AccessKeyId)
	_, err = e.s.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: s.AccessKeyId})
	wantCode(t, err, codes.NotFound, s.AccessKeyId)
}
