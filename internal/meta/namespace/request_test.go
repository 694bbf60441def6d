package namespace

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// countingRaft counts proposals.
type countingRaft struct {
	*fakeRaft
	n atomic.Int64
}

func (c *countingRaft) Propose(ctx context.Context, cmd []byte) (any, error) {
	c.n.Add(1)
	return c.fakeRaft.Propose(ctx, cmd)
}

// Issue 11: requests are validated before they enter a log. Each of these
// can only fail, so it must fail with InvalidArgument without proposing
// anything.
func TestInvalidRequestsAreNotProposed(t *testing.T) {
	e := newNS(t)
	cr := &countingRaft{fakeRaft: &fakeRaft{st: e.st}}
	e.s.raft = cr
	ctx := e.ctx
	if _, err := e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol1"}); err != nil {
		t.Fatal(err)
	}
	for _, b := range []*metapb.CreateBucketRequest{{Volume: "vol1", Name: "bkt1"}, {Volume: "vol1", Name: "fs1", Layout: metapb.BucketLayout_FS}} {
		if _, err := e.s.CreateBucket(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	o, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol1", Bucket: "bkt1", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("x", MaxKeyBytes+1)
	blk := func(n int, length uint64) []*metapb.KeyBlock {
		out := make([]*metapb.KeyBlock, n)
		for i := range out {
			out[i] = &metapb.KeyBlock{Id: o.Blocks[0].Id, Length: length}
		}
		return out
	}
	openKey := func(f func(*metapb.OpenKeyRequest)) func() error {
		return func() error {
			r := &metapb.OpenKeyRequest{Volume: "vol1", Bucket: "bkt1", Key: "new"}
			f(r)
			_, err := e.s.OpenKey(ctx, r)
			return err
		}
	}
	commit := func(r *metapb.CommitKeyRequest) func() error {
		return func() error { r.OpenId = o.OpenId; _, err := e.s.CommitKey(ctx, r); return err }
	}
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"open/bytes-per-checksum-1", openKey(func(r *metapb.OpenKeyRequest) { r.BytesPerChecksum = 1 })},
		{"open/bytes-per-checksum-1GiB", openKey(func(r *metapb.OpenKeyRequest) { r.BytesPerChecksum = 1 << 30 })},
		{"open/checksum-type", openKey(func(r *metapb.OpenKeyRequest) { r.ChecksumType = 99 })},
		{"open/replication", openKey(func(r *metapb.OpenKeyRequest) { r.Replication = 2 })},
		{"open/location", openKey(func(r *metapb.OpenKeyRequest) { r.ClientLocation = strings.Repeat("/r", 1000) })},
		{"open/exclude", openKey(func(r *metapb.OpenKeyRequest) { r.Exclude = &metapb.ExcludeList{Datanodes: make([]uint64, 2000)} })},
		{"open/long-key", openKey(func(r *metapb.OpenKeyRequest) { r.Key = long })},
		{"commit/too-many-blocks", commit(&metapb.CommitKeyRequest{Blocks: blk(MaxBlocksPerKey+1, 1)})},
		{"commit/no-block-id", commit(&metapb.CommitKeyRequest{Blocks: []*metapb.KeyBlock{{Length: 1}}})},
		{"commit/size-overflow", commit(&metapb.CommitKeyRequest{Blocks: blk(2, 1<<63)})},
		{"commit/part-0", commit(&metapb.CommitKeyRequest{Part: &metapb.PartRef{UploadId: "u", PartNumber: 0}})},
		{"commit/part-10001", commit(&metapb.CommitKeyRequest{Part: &metapb.PartRef{UploadId: "u", PartNumber: MaxPartNumber + 1}})},
		{"commit/meta", commit(&metapb.CommitKeyRequest{Meta: &metapb.ObjectMeta{ContentType: strings.Repeat("x", maxMetaBytes+1)}})},
		{"rename/empty-new-key", func() error {
			_, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol1", Bucket: "bkt1", Key: "k", NewKey: ""})
			return err
		}},
		{"rename/long-new-key", func() error {
			_, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol1", Bucket: "bkt1", Key: "k", NewKey: long})
			return err
		}},
		{"delete-key/long", func() error {
			_, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol1", Bucket: "bkt1", Key: long})
			return err
		}},
		{"mkdir/double-slash", func() error {
			_, err := e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol1", Bucket: "fs1", Path: "a//b"})
			return err
		}},
		{"create-bucket/replication", func() error {
			_, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bkt2", Replication: 2})
			return err
		}},
		{"create-bucket/layout", func() error {
			_, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bkt2", Layout: 9})
			return err
		}},
		{"delete-volume/long", func() error {
			_, err := e.s.DeleteVolume(ctx, &metapb.DeleteVolumeRequest{Name: strings.Repeat("v", 64)})
			return err
		}},
		{"delete-bucket/empty", func() error {
			_, err := e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol1", Name: ""})
			return err
		}},
		{"complete/no-parts", func() error {
			_, err := e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "vol1", Bucket: "bkt1", Key: "k", UploadId: "u"})
			return err
		}},
		{"complete/part-number", func() error {
			_, err := e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "vol1", Bucket: "bkt1", Key: "k", UploadId: "u",
				Parts: []*metapb.CompletedPart{{PartNumber: MaxPartNumber + 1}}})
			return err
		}},
		{"abort/empty-upload-id", func() error {
			_, err := e.s.AbortMultipartUpload(ctx, &metapb.AbortMultipartUploadRequest{Volume: "vol1", Bucket: "bkt1", Key: "k"})
			return err
		}},
		{"copy/empty-destination", func() error {
			_, err := e.s.CopyKey(ctx, &metapb.CopyKeyRequest{Volume: "vol1", SrcBucket: "bkt1", SrcKey: "k", Bucket: "bkt1", Key: ""})
			return err
		}},
		{"delete-secret/long-id", func() error {
			_, err := e.s.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: strings.Repeat("a", MaxAccessKeyIDBytes+1)})
			return err
		}},
		{"set-meta/empty-key", func() error {
			_, err := e.s.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: "vol1", Bucket: "bkt1"})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := cr.n.Load()
			err := tc.call()
			want := codes.InvalidArgument
			if strings.Contains(tc.name, "upload-id") {
				want = codes.NotFound // S3's NoSuchUpload, as Apply answers
			}
			if status.Code(err) != want {
				t.Errorf("got %v, want %v", err, want)
			}
			if n := cr.n.Load() - before; n != 0 {
				t.Errorf("%d proposals for a request that can only fail", n)
			}
		})
	}
	// A valid request still goes through.
	before := cr.n.Load()
	if _, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: blk(1, 10)}); err != nil {
		t.Fatal(err)
	}
	if cr.n.Load() != before+1 {
		t.Fatal("a valid commit was not proposed")
	}
}
