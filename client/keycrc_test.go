package client

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	crcc "github.com/basalt-store/basalt/internal/crc32c"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestDataCRC32C: PutKey's DataCRC32C hook reports the CRC32C of the whole
// key, combined from the chunk checksums, on every write path (small file,
// V1 across blocks, V2 across blocks and segments, empty), and it equals
// the CRC32C of the bytes.
func TestDataCRC32C(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	rc := startReal(t, ctx, 3)
	c, err := New(Config{MetaAddrs: []string{rc.meta.GRPCAddr()}, Credentials: rc.creds, Logger: quiet,
		ChunkSize: 1 << 20, MaxBufferBytes: 3 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	for i, tc := range []struct {
		size int
		path Pipeline
	}{{0, PipelineAuto}, {100 << 10, PipelineAuto}, {2<<20 + 5, PipelineAuto}, {9<<20 + 123, PipelineV1}, {9<<20 + 123, PipelineV2}, {8 << 20, PipelineV2}} {
		data := randBytes(uint64(i+1), tc.size)
		calls := 0
		var got uint32
		key := fmt.Sprint("k", i)
		_, err := c.PutKey(ctx, "vol", "bkt", key, bytes.NewReader(data), PutOptions{Pipeline: tc.path,
			DataCRC32C: func(crc uint32) { calls++; got = crc }})
		if err != nil {
			t.Fatalf("size %d %v: %v", tc.size, tc.path, err)
		}
		if want := crcc.Checksum(data); calls != 1 || got != want {
			t.Fatalf("size %d %v: DataCRC32C called %d times with %08x, want once with %08x", tc.size, tc.path, calls, got, want)
		}
		if back := getAll(t, c, key); !bytes.Equal(back, data) {
			t.Fatalf("size %d %v: content differs", tc.size, tc.path)
		}
	}
}

// TestKeyCRC32CRefusesGaps: a chunk list that does not cover a block from
// 0 to its length exactly is an error, not a wrong CRC.
func TestKeyCRC32CRefusesGaps(t *testing.T) {
	sums := func(p []byte) *datanodepb.ChecksumData {
		return &datanodepb.ChecksumData{Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: 512,
			Sums: []byte{byte(crcc.Checksum(p) >> 24), byte(crcc.Checksum(p) >> 16), byte(crcc.Checksum(p) >> 8), byte(crcc.Checksum(p))}}
	}
	a, b := []byte("first chunk"), []byte("second")
	chunks := []*datanodepb.ChunkInfo{{Offset: 0, Length: uint64(len(a)), Checksum: sums(a)}, {Offset: uint64(len(a)), Length: uint64(len(b)), Checksum: sums(b)}}
	blk := &metapb.KeyBlock{Length: uint64(len(a) + len(b))}
	crc, err := keyCRC32C([]*metapb.KeyBlock{blk}, [][]*datanodepb.ChunkInfo{chunks})
	if err != nil || crc != crcc.Checksum(append(append([]byte{}, a...), b...)) {
		t.Fatalf("two chunks: %08x, %v", crc, err)
	}
	// Committed shorter than the chunks: only whole chunks up to it count.
	if crc, err := keyCRC32C([]*metapb.KeyBlock{{Length: uint64(len(a))}}, [][]*datanodepb.ChunkInfo{chunks}); err != nil || crc != crcc.Checksum(a) {
		t.Fatalf("block ended after the first chunk: %08x, %v", crc, err)
	}
	for name, tc := range map[string]struct {
		blk    *metapb.KeyBlock
		chunks []*datanodepb.ChunkInfo
	}{
		"gap":       {blk, []*datanodepb.ChunkInfo{chunks[1]}},
		"short":     {&metapb.KeyBlock{Length: blk.Length + 1}, chunks},
		"mid-chunk": {&metapb.KeyBlock{Length: 3}, chunks},
		"no sums":   {blk, []*datanodepb.ChunkInfo{{Offset: 0, Length: blk.Length}}},
		"sums short": {blk, []*datanodepb.ChunkInfo{{Offset: 0, Length: blk.Length, Checksum: &datanodepb.ChecksumData{
			Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: 4, Sums: sums(a).Sums}}}},
	} {
		if _, err := keyCRC32C([]*metapb.KeyBlock{tc.blk}, [][]*datanodepb.ChunkInfo{tc.chunks}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
