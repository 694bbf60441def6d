package s3_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// copied returns basalt_s3_copy_bytes_total{how}.
func (e *env) copied(how string) float64 {
	mfs, _ := e.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "basalt_s3_copy_bytes_total" {
			continue
		}
		for _, m := range mf.Metric {
			for _, l := range m.Label {
				if l.GetName() == "how" && l.GetValue() == how {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// dataWrites counts what the datanodes received: chunks written (V1) and
// streams opened (V2). A copy that shares blocks changes neither.
func (e *env) dataWrites() uint64 {
	var n uint64
	for _, dn := range e.cluster.Datanodes {
		ss := dn.StreamStats()
		n += dn.ChunksWritten() + ss.FirstHop + ss.Downstream
	}
	return n
}

// blockStored reports whether any datanode still stores the block.
func (e *env) blockStored(b client.BlockInfo) bool {
	for _, dn := range e.cluster.Datanodes {
		if _, err := dn.Store().GetBlock(storage.ContainerID(b.ContainerID), storage.LocalID(b.LocalID)); err == nil {
			return true
		}
	}
	return false
}

// waitGone waits until no datanode stores any of blocks.
func (e *env) waitGone(t *testing.T, what string, blocks []client.BlockInfo) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		left := 0
		for _, b := range blocks {
			if e.blockStored(b) {
				left++
			}
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d of %d blocks still on datanodes after 30s", what, left, len(blocks))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func blockIDs(ki client.KeyInfo) [][2]uint64 {
	var out [][2]uint64
	for _, b := range ki.Blocks {
		out = append(out, [2]uint64{b.ContainerID, b.LocalID})
	}
	return out
}

func (e *env) testCopy(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "cpsrc")
	e.mkBucket(t, "cpdst")
	data := randBytes(11, 9<<20+12345) // three blocks of the test cluster's 4 MiB
	put, err := e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("cpsrc"), Key: aws.String("obj"), Body: bytes.NewReader(data),
		ContentType: aws.String("application/x-src"), Metadata: map[string]string{"color": "red"}})
	if err != nil {
		t.Fatal(err)
	}
	src, err := e.cl.StatKey(ctx, "s3v", "cpsrc", "obj")
	if err != nil || len(src.Blocks) != 3 {
		t.Fatalf("source has %d blocks (%v); the test needs 3", len(src.Blocks), err)
	}

	// CopyObject across buckets: the same bytes, the source's ETag and
	// attributes, the source's blocks, and nothing written or streamed.
	shared0, streamed0, writes0 := e.copied("shared"), e.copied("streamed"), e.dataWrites()
	cp, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("cpdst"), Key: aws.String("copy"), CopySource: aws.String("cpsrc/obj")})
	if err != nil || *cp.CopyObjectResult.ETag != *put.ETag {
		t.Fatalf("copy %+v %v", cp, err)
	}
	cp2, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("cpdst"), Key: aws.String("copy2"), CopySource: aws.String("cpsrc/obj"),
		MetadataDirective: types.MetadataDirectiveReplace, ContentType: aws.String("text/x-new"), Metadata: map[string]string{"shape": "round"}})
	if err != nil || *cp2.CopyObjectResult.ETag != *put.ETag {
		t.Fatalf("copy with REPLACE %+v %v", cp2, err)
	}
	if w := e.dataWrites(); w != writes0 {
		t.Fatalf("copies wrote to datanodes (%d chunks/streams)", w-writes0)
	}
	if got := e.copied("shared") - shared0; got != float64(2*len(data)) || e.copied("streamed") != streamed0 {
		t.Fatalf("copy bytes: shared %v (want %d), streamed %v", got, 2*len(data), e.copied("streamed")-streamed0)
	}
	for _, k := range []string{"copy", "copy2"} {
		ki, _ := e.cl.StatKey(ctx, "s3v", "cpdst", k)
		if !slices.Equal(blockIDs(ki), blockIDs(src)) || ki.ObjectID == src.ObjectID {
			t.Fatalf("%s: blocks %v object %d, source %v object %d", k, blockIDs(ki), ki.ObjectID, blockIDs(src), src.ObjectID)
		}
	}
	h, err := e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("cpdst"), Key: aws.String("copy")})
	if err != nil || *h.ContentType != "application/x-src" || h.Metadata["color"] != "red" || *h.ETag != *put.ETag {
		t.Fatalf("COPY attributes %+v %v", h, err)
	}
	h, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("cpdst"), Key: aws.String("copy2")})
	if err != nil || *h.ContentType != "text/x-new" || h.Metadata["color"] != "" || h.Metadata["shape"] != "round" || *h.ETag != *put.ETag {
		t.Fatalf("REPLACE attributes %+v %v", h, err)
	}

	// A bucket of another replication cannot share: the copy streams.
	if _, err := e.cl.Namespace().CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "s3v", Name: "cpone", Replication: metapb.Replication_ONE, Owner: "tester"}); err != nil {
		t.Fatal(err)
	}
	streamed0 = e.copied("streamed")
	if _, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String("cpone"), Key: aws.String("one"), CopySource: aws.String("cpsrc/obj")}); err != nil {
		t.Fatal(err)
	}
	if got := e.copied("streamed") - streamed0; got != float64(len(data)) {
		t.Fatalf("copy to a ONE bucket streamed %v bytes, want %d", got, len(data))
	}
	if one, _ := e.cl.StatKey(ctx, "s3v", "cpone", "one"); one.Replication != client.ReplicationOne || !bytes.Equal(e.get(t, "cpone", "one"), data) {
		t.Fatalf("streamed copy %+v", one)
	}

	// Delete the source: the copies still read, and the blocks stay on the
	// datanodes while an unrelated deleted object's blocks go (so the
	// deletion pipeline did run).
	if _, err := e.s3.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String("cpsrc"), Key: aws.String("obj")}); err != nil {
		t.Fatal(err)
	}
	e.put(t, "cpsrc", "victim", randBytes(12, 1000))
	victim, _ := e.cl.StatKey(ctx, "s3v", "cpsrc", "victim")
	if _, err := e.s3.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String("cpsrc"), Key: aws.String("victim")}); err != nil {
		t.Fatal(err)
	}
	e.waitGone(t, "deleted unrelated object", victim.Blocks)
	for _, b := range src.Blocks {
		if !e.blockStored(b) {
			t.Fatalf("block %d/%d of the deleted source was freed while copies hold it", b.ContainerID, b.LocalID)
		}
	}
	for _, k := range []string{"copy", "copy2"} {
		if !bytes.Equal(e.get(t, "cpdst", k), data) {
			t.Fatalf("%s differs from the source after the source was deleted", k)
		}
	}

	// UploadPartCopy from the copy: part 1 from offset 0 into block 2
	// (ending inside a checksum window) and part 3 the whole last block
	// share; part 2 starts off a block boundary and streams.
	cr, err := e.s3.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String("cpdst"), Key: aws.String("mp")})
	if err != nil {
		t.Fatal(err)
	}
	last := src.Blocks[2]
	ranges := [][2]int64{{0, 5<<20 + 777}, {1000, 1000 + 5<<20}, {int64(last.Offset), int64(len(data))}}
	shared0, streamed0, writes0 = e.copied("shared"), e.copied("streamed"), e.dataWrites()
	var parts []types.CompletedPart
	var want []byte
	for i, r := range ranges {
		out, err := e.s3.UploadPartCopy(ctx, &s3.UploadPartCopyInput{Bucket: aws.String("cpdst"), Key: aws.String("mp"), UploadId: cr.UploadId,
			PartNumber: aws.Int32(int32(i + 1)), CopySource: aws.String("cpdst/copy"), CopySourceRange: aws.String(fmt.Sprintf("bytes=%d-%d", r[0], r[1]-1))})
		if err != nil {
			t.Fatalf("part copy %d: %v", i+1, err)
		}
		etag := *out.CopyPartResult.ETag
		if len(etag) != 34 {
			t.Fatalf("part %d ETag %s is not a quoted MD5", i+1, etag)
		}
		if i == 1 && etag != `"`+md5hex(data[r[0]:r[1]])+`"` {
			t.Fatalf("streamed part ETag %s, want the MD5 of its bytes", etag)
		}
		parts = append(parts, types.CompletedPart{PartNumber: aws.Int32(int32(i + 1)), ETag: aws.String(etag)})
		want = append(want, data[r[0]:r[1]]...)
	}
	wantShared := float64(ranges[0][1] - ranges[0][0] + ranges[2][1] - ranges[2][0])
	if got := e.copied("shared") - shared0; got != wantShared {
		t.Fatalf("part copies shared %v bytes, want %v", got, wantShared)
	}
	if got := e.copied("streamed") - streamed0; got != float64(ranges[1][1]-ranges[1][0]) {
		t.Fatalf("part copies streamed %v bytes, want %d", got, ranges[1][1]-ranges[1][0])
	}
	if e.dataWrites() == writes0 {
		t.Fatal("the unaligned part copy wrote nothing to datanodes")
	}
	if _, err := e.s3.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: aws.String("cpdst"), Key: aws.String("mp"), UploadId: cr.UploadId,
		MultipartUpload: &types.CompletedMultipartUpload{Parts: parts}}); err != nil {
		t.Fatal(err)
	}
	if got := e.get(t, "cpdst", "mp"); !bytes.Equal(got, want) {
		t.Fatalf("completed object differs: %d bytes, want %d", len(got), len(want))
	}
	// A range across the shortened block at the end of part 1.
	end1 := ranges[0][1]
	rg, err := e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("cpdst"), Key: aws.String("mp"), Range: aws.String(fmt.Sprintf("bytes=%d-%d", end1-5000, end1+5000))})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rg.Body)
	rg.Body.Close()
	if !bytes.Equal(b, want[end1-5000:end1+5001]) {
		t.Fatal("range across the shortened block differs")
	}

	// An aborted upload with a shared part frees nothing.
	cr2, _ := e.s3.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String("cpdst"), Key: aws.String("mp2")})
	if _, err := e.s3.UploadPartCopy(ctx, &s3.UploadPartCopyInput{Bucket: aws.String("cpdst"), Key: aws.String("mp2"), UploadId: cr2.UploadId,
		PartNumber: aws.Int32(1), CopySource: aws.String("cpdst/copy")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s3.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: aws.String("cpdst"), Key: aws.String("mp2"), UploadId: cr2.UploadId}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.UploadPartCopy(ctx, &s3.UploadPartCopyInput{Bucket: aws.String("cpdst"), Key: aws.String("mp2"), UploadId: cr2.UploadId,
		PartNumber: aws.Int32(1), CopySource: aws.String("cpdst/copy")})
	wantCode(t, err, "NoSuchUpload", 404)

	// Delete every holder: the shared blocks go from the datanodes.
	for _, k := range []string{"copy", "copy2", "mp"} {
		if _, err := e.s3.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String("cpdst"), Key: aws.String(k)}); err != nil {
			t.Fatal(err)
		}
	}
	e.waitGone(t, "blocks of the source and its copies", src.Blocks)
	_, err = e.s3.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("cpdst"), Key: aws.String("copy")})
	var nsk *types.NoSuchKey
	if !errors.As(err, &nsk) {
		t.Fatalf("deleted copy: %v", err)
	}
}
