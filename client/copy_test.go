package client

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// A copy shares blocks: reading it after the source is gone returns the
// source's bytes, and no datanode write happens for it.
func TestCopyKeySharesBlocks(t *testing.T) {
	fc := newFakeCluster(t, 3, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	ctx := context.Background()
	data := randBytes(7, 2*tBlock+12345)
	src, err := c.PutKey(ctx, "vol", "bkt", "src", bytes.NewReader(data), PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	written := fc.committedBytes()
	_, err = c.CopyKey(ctx, "vol", "bkt", "src", "bkt", "dst", CopyOptions{ExpectObjectID: src.ObjectID + 1000})
	if !errors.Is(err, ErrPrecondition) {
		t.Fatalf("copy of a changed source: %v, want ErrPrecondition", err)
	}
	dst, err := c.CopyKey(ctx, "vol", "bkt", "src", "bkt", "dst", CopyOptions{ExpectObjectID: src.ObjectID})
	if err != nil {
		t.Fatal(err)
	}
	if dst.Size != src.Size || dst.ObjectID == src.ObjectID {
		t.Fatalf("copy %+v of %+v", dst, src)
	}
	if err := c.DeleteKey(ctx, "vol", "bkt", "src", false); err != nil {
		t.Fatal(err)
	}
	if got := getAll(t, c, "dst"); !bytes.Equal(got, data) {
		t.Fatalf("copy read %d bytes, not the source's %d", len(got), len(data))
	}
	if n := fc.committedBytes(); n != written {
		t.Fatalf("the copy wrote %d bytes to datanodes", n-written)
	}
}

// A part copied from a block-aligned range ends with a prefix of a source
// block whose last checksum window runs past the prefix; the reader must
// verify that window against the stored block and return only the prefix.
func TestReadShortenedBlock(t *testing.T) {
	fc := newFakeCluster(t, 3, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	ctx := context.Background()
	data := randBytes(8, 3*tBlock-999)
	if _, err := c.PutKey(ctx, "vol", "bkt", "src", bytes.NewReader(data), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	ns := c.Namespace()
	u, err := ns.CreateMultipartUpload(ctx, &metapb.CreateMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "obj"})
	if err != nil {
		t.Fatal(err)
	}
	// Part 1: bytes [tBlock, 2*tBlock+tBPC+77): block 2 whole and a prefix
	// of block 3 ending inside a checksum window. Part 2: a prefix of
	// block 1 ending inside a window.
	ranges := [][2]uint64{{tBlock, tBlock + tBPC + 77}, {0, 5*tBPC + 1}}
	var want []byte
	var parts []*metapb.CompletedPart
	for i, r := range ranges {
		p, err := ns.CopyKey(ctx, &metapb.CopyKeyRequest{Volume: "vol", SrcBucket: "bkt", SrcKey: "src", Bucket: "bkt", Key: "obj",
			Part: &metapb.PartRef{UploadId: u.UploadId, PartNumber: uint32(i + 1)}, Offset: r[0], Length: r[1]})
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, &metapb.CompletedPart{PartNumber: uint32(i + 1), Etag: p.Meta.Etag})
		want = append(want, data[r[0]:r[0]+r[1]]...)
	}
	if _, err := ns.CompleteMultipartUpload(ctx, &metapb.CompleteMultipartUploadRequest{Volume: "vol", Bucket: "bkt", Key: "obj",
		UploadId: u.UploadId, Parts: parts, MinPartSize: 1}); err != nil {
		t.Fatal(err)
	}
	if got := getAll(t, c, "obj"); !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes, want %d (equal prefix: %d)", len(got), len(want), commonPrefix(got, want))
	}
	// Small reads at the ends of the shortened blocks, each with a fresh
	// reader (no cached layout).
	for _, off := range []int64{tBlock + tBPC + 70, int64(len(want)) - 9, int64(len(want)) - 1} {
		r, err := c.GetKey(ctx, "vol", "bkt", "obj")
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 16)
		n, err := r.ReadAt(buf, off)
		if err != nil && err != io.EOF {
			t.Fatalf("read at %d: %v", off, err)
		}
		if !bytes.Equal(buf[:n], want[off:min(off+16, int64(len(want)))]) {
			t.Fatalf("read at %d: wrong bytes", off)
		}
		r.Close()
	}
}

func commonPrefix(a, b []byte) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}
