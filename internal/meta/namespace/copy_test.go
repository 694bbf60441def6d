package namespace

import (
	"crypto/md5"
	"encoding/hex"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// putBlocks commits key with one block per length and an MD5-like ETag.
func (e *nsEnv) putBlocks(t *testing.T, vol, bkt, key string, lengths ...uint64) *metapb.KeyInfo {
	t.Helper()
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: vol, Bucket: bkt, Key: key})
	if err != nil {
		t.Fatalf("open %s: %v", key, err)
	}
	ids := []*metapb.BlockID{o.Blocks[0].Id}
	for len(ids) < len(lengths) {
		a, err := e.s.AllocateBlock(e.ctx, &metapb.AllocateBlockRequest{OpenId: o.OpenId})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, a.Block.Id)
	}
	var kbs []*metapb.KeyBlock
	for i, n := range lengths {
		kbs = append(kbs, &metapb.KeyBlock{Id: ids[i], Length: n})
	}
	sum := md5.Sum([]byte(bkt + "/" + key))
	ki, err := e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: kbs,
		Meta: &metapb.ObjectMeta{Etag: hex.EncodeToString(sum[:]), ContentType: "text/plain", Checksums: map[string]string{"CRC32C": "AAAAAA=="}}})
	if err != nil {
		t.Fatalf("commit %s: %v", key, err)
	}
	return ki
}

func (e *nsEnv) lookup(t *testing.T, vol, bkt, key string) *metapb.KeyInfo {
	t.Helper()
	ki, err := e.s.LookupKey(e.ctx, &metapb.LookupKeyRequest{Volume: vol, Bucket: bkt, Key: key})
	if err != nil {
		t.Fatalf("lookup %s/%s: %v", bkt, key, err)
	}
	return ki
}

// freed counts, per local ID, how often a block was handed to SCM for
// deletion; drain runs the background services until nothing is pending
// and adds what they handed over to f.
type freed map[uint64]int

func (e *nsEnv) drain(t *testing.T, f freed) {
	t.Helper()
	for range 100 {
		e.fb.mu.Lock()
		for id, n := range e.fb.freed {
			f[id] += n
		}
		clear(e.fb.freed)
		e.fb.mu.Unlock()
		rows, _ := e.st.DeletedRows(1)
		dirs, _ := e.st.PendingDirs(1)
		if len(rows) == 0 && len(dirs) == 0 {
			return
		}
		if err := e.s.RunOnce(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	t.Fatal("background services did not finish in 100 rounds")
}

func (e *nsEnv) wantHolders(t *testing.T, ki *metapb.KeyInfo, want uint64) {
	t.Helper()
	for _, b := range ki.Blocks {
		n, err := e.st.BlockHolders(b.Id)
		if err != nil || n != want {
			t.Fatalf("block %v of %s: %d holder rows (%v), want %d", b.Id, ki.Name, n, err, want)
		}
	}
}

func localIDs(ki *metapb.KeyInfo) []uint64 {
	var out []uint64
	for _, b := range ki.Blocks {
		out = append(out, b.Id.LocalId)
	}
	return out
}

func (e *nsEnv) copyKey(req *metapb.CopyKeyRequest) (*metapb.KeyInfo, error) {
	if req.Volume == "" {
		req.Volume = "vol"
	}
	return e.s.CopyKey(e.ctx, req)
}

func TestCopyKey(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	for _, b := range []*metapb.CreateBucketRequest{
		{Volume: "vol", Name: "bkt"}, {Volume: "vol", Name: "other"},
		{Volume: "vol", Name: "one", Replication: metapb.Replication_ONE},
		{Volume: "vol", Name: "fsb", Layout: metapb.BucketLayout_FS},
	} {
		if _, err := e.s.CreateBucket(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	f := freed{}
	src := e.putBlocks(t, "vol", "bkt", "src", 1<<20, 1<<20, 300)
	srcIDs := localIDs(src)

	// Errors: missing source, stale version, unshareable replication.
	_, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "nope", Bucket: "bkt", Key: "d"})
	wantCode(t, err, codes.NotFound, `"nope"`)
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "src", ExpectObjectId: src.ObjectId + 1, Bucket: "bkt", Key: "d"})
	wantReason(t, err, codes.FailedPrecondition, ReasonVersionChanged)
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "src", Bucket: "one", Key: "d"})
	wantReason(t, err, codes.FailedPrecondition, ReasonNotShareable)
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "src", Bucket: "bkt", Key: "d", Length: 5})
	wantCode(t, err, codes.InvalidArgument, "parts only")
	e.wantHolders(t, src, 0)

	// A copy shares the blocks, keeps the source's attributes (COPY) and
	// gets its own object ID.
	dst, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "src", ExpectObjectId: src.ObjectId, Bucket: "other", Key: "dst"})
	if err != nil {
		t.Fatal(err)
	}
	got := e.lookup(t, "vol", "other", "dst")
	if got.Size != src.Size || got.ObjectId == src.ObjectId || got.ObjectId != dst.ObjectId || !proto.Equal(got.Meta, src.Meta) ||
		!slices.Equal(localIDs(got), srcIDs) || got.ChecksumType != src.ChecksumType || got.BytesPerChecksum != src.BytesPerChecksum {
		t.Fatalf("copy %v, source %v", got, src)
	}
	e.wantHolders(t, src, 2)

	// Onto itself with REPLACE: new attributes, but the ETag and checksums
	// describe the same bytes; nothing is freed.
	self, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "other", SrcKey: "dst", Bucket: "other", Key: "dst", ReplaceMeta: true,
		Meta: &metapb.ObjectMeta{Etag: "bogus", ContentType: "image/png", User: map[string]string{"x": "y"}}})
	if err != nil {
		t.Fatal(err)
	}
	got = e.lookup(t, "vol", "other", "dst")
	if got.Meta.ContentType != "image/png" || got.Meta.User["x"] != "y" || got.Meta.Etag != src.Meta.Etag || got.Meta.Checksums["CRC32C"] != "AAAAAA==" ||
		got.ObjectId != self.ObjectId || got.ObjectId == dst.ObjectId || !slices.Equal(localIDs(got), srcIDs) {
		t.Fatalf("self copy %v", got)
	}
	e.wantHolders(t, src, 2)
	if rows, _ := e.st.DeletedRows(10); len(rows) != 0 {
		t.Fatalf("self copy freed blocks: %v", rows)
	}

	// A key whose replication differs from its bucket's may still be
	// copied onto itself (only its attributes change).
	o, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "one", Key: "three", Replication: metapb.Replication_THREE})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "one", SrcKey: "three", Bucket: "one", Key: "three", ReplaceMeta: true}); err != nil {
		t.Fatalf("self copy of a THREE key in a ONE bucket: %v", err)
	}
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "one", SrcKey: "three", Bucket: "one", Key: "three2"})
	wantReason(t, err, codes.FailedPrecondition, ReasonNotShareable)

	// Delete the source: the copy still holds the blocks.
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "src"}); err != nil {
		t.Fatal(err)
	}
	e.drain(t, f)
	if len(f) != 0 {
		t.Fatalf("deleting the source freed %v", f)
	}
	e.wantHolders(t, src, 0)

	// More copies, one overwritten by a new key, one by another copy.
	for _, k := range []string{"c2", "c3", "c4"} {
		if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "other", SrcKey: "dst", Bucket: "bkt", Key: k}); err != nil {
			t.Fatal(err)
		}
	}
	e.wantHolders(t, src, 4)
	e.put(t, "vol", "bkt", "c3", 10)
	other := e.putBlocks(t, "vol", "bkt", "unrelated", 5)
	if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "unrelated", Bucket: "bkt", Key: "c4"}); err != nil {
		t.Fatal(err)
	}
	e.wantHolders(t, src, 2)
	e.wantHolders(t, other, 2)
	e.drain(t, f)
	if len(f) != 0 {
		t.Fatalf("overwriting copies freed %v while other keys hold them", f)
	}

	// FS buckets: a copy creates parent directories; a directory is not a
	// valid destination; an fs file copies back to an object bucket.
	if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "c2", Bucket: "fsb", Key: "a/b/file"}); err != nil {
		t.Fatal(err)
	}
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "c2", Bucket: "fsb", Key: "a/b"})
	wantCode(t, err, codes.FailedPrecondition, "directory")
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "c2", Bucket: "fsb", Key: "a/b/file/x"})
	wantCode(t, err, codes.FailedPrecondition, "not a directory")
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "fsb", SrcKey: "a/b", Bucket: "bkt", Key: "x"})
	wantCode(t, err, codes.FailedPrecondition, "is a directory")
	if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "fsb", SrcKey: "a/b/file", Bucket: "bkt", Key: "from-fs"}); err != nil {
		t.Fatal(err)
	}
	if fsCopy := e.lookup(t, "vol", "fsb", "a/b/file"); !slices.Equal(localIDs(fsCopy), srcIDs) {
		t.Fatalf("fs copy blocks %v, want %v", localIDs(fsCopy), srcIDs)
	}
	e.wantHolders(t, src, 4) // other/dst, bkt/c2, fs/a/b/file, bkt/from-fs
	if rows, _ := e.st.DeletedRows(10); len(rows) != 0 {
		t.Fatalf("failed copies left deleted rows: %v", rows)
	}

	// Delete every holder (a recursive fs delete reclaims in the
	// background): each block is freed exactly once, after the last.
	for _, k := range [][2]string{{"other", "dst"}, {"bkt", "c2"}, {"bkt", "from-fs"}} {
		if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: k[0], Key: k[1]}); err != nil {
			t.Fatal(err)
		}
		e.drain(t, f)
		if len(f) != 0 {
			t.Fatalf("blocks freed after deleting %v while the fs copy holds them: %v", k, f)
		}
	}
	e.wantHolders(t, src, 0)
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a", Recursive: true}); err != nil {
		t.Fatal(err)
	}
	e.drain(t, f)
	for _, id := range srcIDs {
		if f[id] != 1 {
			t.Fatalf("block %d freed %d times, want once (freed: %v)", id, f[id], f)
		}
	}
	if len(f) != len(srcIDs) {
		t.Fatalf("freed %v, want only the source's blocks %v", f, srcIDs)
	}
}

func TestCopyPart(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	f := freed{}
	src := e.putBlocks(t, "vol", "bkt", "src", 1<<20, 1<<20, 300)
	b := localIDs(src)
	u, err := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "obj"})
	if err != nil {
		t.Fatal(err)
	}
	part := func(n uint32, off, length uint64) (*metapb.KeyInfo, error) {
		return e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "src", Bucket: "bkt", Key: "obj",
			Part: &metapb.PartRef{UploadId: u.UploadId, PartNumber: n}, Offset: off, Length: length})
	}
	// Whole source: its ETag. A range from a block boundary: the blocks,
	// the last one shortened, and an ETag of its own.
	p1, err := part(1, 0, 0)
	if err != nil || p1.Meta.Etag != src.Meta.Etag || p1.Size != src.Size {
		t.Fatalf("part 1: %v %v", p1, err)
	}
	p2, err := part(2, 1<<20, 1<<20+100)
	if err != nil || p2.Size != 1<<20+100 || !isMD5Hex(p2.Meta.Etag) || p2.Meta.Etag == src.Meta.Etag {
		t.Fatalf("part 2: %v %v", p2, err)
	}
	_, err = part(3, 100, 10)
	wantReason(t, err, codes.FailedPrecondition, ReasonNotShareable)
	_, err = part(3, 1<<20, 2<<20)
	wantCode(t, err, codes.InvalidArgument, "outside the source")
	_, err = e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "src", Bucket: "bkt", Key: "obj", Part: &metapb.PartRef{UploadId: "nope-1", PartNumber: 1}})
	wantReason(t, err, codes.NotFound, ReasonNoSuchUpload)
	for id, want := range map[uint64]uint64{b[0]: 2, b[1]: 3, b[2]: 3} {
		if n, _ := e.st.BlockHolders(&metapb.BlockID{ContainerId: 7, LocalId: id}); n != want {
			t.Fatalf("block %d: %d holders, want %d", id, n, want)
		}
	}
	// Part 3 is the whole source too, then replaced by a written part.
	if _, err := part(3, 0, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := e.putPart3(t, u.UploadId); err != nil {
		t.Fatal(err)
	}
	e.drain(t, f)
	if len(f) != 0 {
		t.Fatalf("replacing a copied part freed %v", f)
	}

	// Complete with parts 1 and 2 (part 3 is discarded and its block
	// freed); the object lists b[1] and b[2] twice.
	ki, err := e.s.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "obj", UploadId: u.UploadId, MinPartSize: 1,
		Parts: []*metapb.CompletedPart{{PartNumber: 1, Etag: p1.Meta.Etag}, {PartNumber: 2, Etag: p2.Meta.Etag}}})
	if err != nil {
		t.Fatal(err)
	}
	obj := e.lookup(t, "vol", "bkt", "obj")
	if want := []uint64{b[0], b[1], b[2], b[1], b[2]}; !slices.Equal(localIDs(obj), want) || obj.Size != src.Size+1<<20+100 || ki.Size != obj.Size {
		t.Fatalf("completed blocks %v size %d, want %v", localIDs(obj), obj.Size, want)
	}
	if l := obj.Locations[4]; l.Length != 100 || l.Offset != src.Size+1<<20 {
		t.Fatalf("shortened last block %v", l)
	}
	e.drain(t, f)
	if len(f) != 1 {
		t.Fatalf("complete freed %v, want only the discarded written part 3", f)
	}
	clear(f)

	// An aborted upload releases its copied parts without freeing them.
	u2, _ := e.s.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "obj2"})
	if _, err := e.copyKey(&metapb.CopyKeyRequest{SrcBucket: "bkt", SrcKey: "obj", Bucket: "bkt", Key: "obj2", Part: &metapb.PartRef{UploadId: u2.UploadId, PartNumber: 1}}); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.st.BlockHolders(&metapb.BlockID{ContainerId: 7, LocalId: b[2]}); n != 5 {
		t.Fatalf("b[2]: %d holders, want 5 (source, object twice, aborted part twice)", n)
	}
	if _, err := e.s.AbortMultipartUpload(ctx, &metapb.AbortMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "obj2", UploadId: u2.UploadId}); err != nil {
		t.Fatal(err)
	}
	e.drain(t, f)
	if len(f) != 0 {
		t.Fatalf("abort freed %v", f)
	}

	// Delete the source, then the object: every block freed exactly once.
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "src"}); err != nil {
		t.Fatal(err)
	}
	e.drain(t, f)
	if len(f) != 0 {
		t.Fatalf("deleting the source freed %v while the object holds its blocks", f)
	}
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "obj"}); err != nil {
		t.Fatal(err)
	}
	e.drain(t, f)
	for _, id := range b {
		if f[id] != 1 {
			t.Fatalf("block %d freed %d times, want once (%v)", id, f[id], f)
		}
		if n, _ := e.st.BlockHolders(&metapb.BlockID{ContainerId: 7, LocalId: id}); n != 0 {
			t.Fatalf("block %d: reference row of %d left", id, n)
		}
	}
	if len(f) != len(b) {
		t.Fatalf("freed %v, want %v", f, b)
	}
}

// putPart3 writes part 3 of upload in bucket bkt of volume vol.
func (e *nsEnv) putPart3(t *testing.T, upload string) (*metapb.KeyInfo, error) {
	t.Helper()
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "obj"})
	if err != nil {
		t.Fatal(err)
	}
	return e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 10}},
		Part: &metapb.PartRef{UploadId: upload, PartNumber: 3, Etag: "0123456789abcdef0123456789abcdef"}})
}
