package metaclient

import (
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func s3Key(name string) *metapb.KeyInfo {
	return &metapb.KeyInfo{Volume: "s3v", Bucket: "warp-stat", Name: name, Size: 4096, Replication: metapb.Replication_THREE,
		ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 65536, CreatedUnixMs: 1700000000000, ModifiedUnixMs: 1700000000001, ObjectId: 7,
		Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: 2}, Length: 4096}},
		Meta: &metapb.ObjectMeta{Etag: "0123456789abcdef0123456789abcdef", ContentType: "application/octet-stream",
			User: map[string]string{"a": "1"}, Checksums: map[string]string{"CRC32C": "yZRlqg=="}}}
}

// lookupAnswers are encoded answers of every shape lookupCodec must
// decode as proto.Unmarshal does: its own (plain and S3 keys, errors with
// status details, RetryAlone) and those it leaves to proto.Unmarshal
// (a key with locations, a field it does not know, a key twice).
func lookupAnswers(t testing.TB) [][]byte {
	withLoc := s3Key("loc")
	withLoc.Locations = []*metapb.BlockLocation{{Offset: 1, Length: 2}}
	resps := []*metapb.LookupKeysResponse{
		{},
		{Results: []*metapb.LookupKeyResult{{Key: s3Key("a")}, {Key: &metapb.KeyInfo{Name: "plain", Size: 1}},
			{Code: 5, Message: "key not found", Status: []byte{8, 5, 0x12, 1, 'x'}}, {Code: 8, RetryAlone: true, Message: "too big"}, {}}},
		{Results: []*metapb.LookupKeyResult{{Key: s3Key("a")}, {Key: withLoc}}},
		{Results: []*metapb.LookupKeyResult{{Key: &metapb.KeyInfo{Meta: &metapb.ObjectMeta{UploadAcls: []*metapb.Acl{{}}}}}}},
	}
	var out [][]byte
	for _, r := range resps {
		b, err := proto.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b)
	}
	one, _ := proto.Marshal(resps[1])
	key, _ := proto.Marshal(s3Key("b"))
	res := append([]byte{0x0a, byte(len(key))}, key...)
	out = append(out,
		append(append([]byte{}, one...), 0xf8, 0x7f, 1),                                       // an unknown field
		append([]byte{0x0a, byte(2 * len(res))}, append(append([]byte{}, res...), res...)...), // a result's key twice (merged)
		[]byte{0x0a, 2, 0x1a, 0x80},                                                           // a message not UTF-8
		[]byte{0x0a, 4, 0x10, 0x80, 0x80, 0x80},                                               // a truncated code
	)
	return out
}

// TestLookupCodecMatchesUnmarshal: lookupCodec decodes LookupKeys and
// LookupKey answers (and every truncation of them) as proto.Unmarshal
// does, the same error or none and the same message.
func TestLookupCodecMatchesUnmarshal(t *testing.T) {
	check := func(b []byte, got, want proto.Message) {
		t.Helper()
		werr := proto.Unmarshal(b, want)
		gerr := lookupCodec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(append([]byte{}, b...))}, got)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("% x: lookupCodec error %v, proto.Unmarshal %v", b, gerr, werr)
		}
		if werr == nil && !proto.Equal(got, want) {
			t.Fatalf("% x: lookupCodec\n got %v\nwant %v", b, got, want)
		}
	}
	for _, b := range lookupAnswers(t) {
		for i := 0; i <= len(b); i++ {
			check(b[:i], &metapb.LookupKeysResponse{}, &metapb.LookupKeysResponse{})
			// Into a message that held an answer already (a retried call).
			stale := &metapb.LookupKeysResponse{Results: []*metapb.LookupKeyResult{{Code: 3}}}
			check(b[:i], stale, &metapb.LookupKeysResponse{})
		}
	}
	for _, k := range []*metapb.KeyInfo{s3Key("c"), {Name: "p"}, {}} {
		b, _ := proto.Marshal(k)
		for i := 0; i <= len(b); i++ {
			check(b[:i], &metapb.KeyInfo{Name: "stale", Size: 9}, &metapb.KeyInfo{})
		}
	}
	// The decoded strings are copies: the receive buffer is reused.
	b, _ := proto.Marshal(&metapb.LookupKeysResponse{Results: []*metapb.LookupKeyResult{{Key: s3Key("d")}}})
	buf := append([]byte{}, b...)
	got := &metapb.LookupKeysResponse{}
	if err := (lookupCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(buf)}, got); err != nil {
		t.Fatal(err)
	}
	clear(buf)
	if k := got.Results[0].Key; k.Name != "d" || k.Meta.Etag != s3Key("d").Meta.Etag || k.Meta.Checksums["CRC32C"] != "yZRlqg==" {
		t.Fatalf("decoded key changed with the buffer: %v", k)
	}
}

// TestLookupCodecAllocs: a LookupKeys answer of 16 S3 keys decodes in
// fewer than half of proto.Unmarshal's allocations (issue 15:
// allocations per S3 HEAD).
func TestLookupCodecAllocs(t *testing.T) {
	resp := &metapb.LookupKeysResponse{}
	for range 16 {
		resp.Results = append(resp.Results, &metapb.LookupKeyResult{Key: s3Key("data/object-1")})
	}
	b, _ := proto.Marshal(resp)
	data := mem.BufferSlice{mem.SliceBuffer(b)}
	n := testing.AllocsPerRun(50, func() { lookupCodec{}.Unmarshal(data, &metapb.LookupKeysResponse{}) }) / 16
	u := testing.AllocsPerRun(50, func() { proto.Unmarshal(b, &metapb.LookupKeysResponse{}) }) / 16
	t.Logf("allocations per key: lookupCodec %.1f, proto.Unmarshal %.1f", n, u)
	if n > u/2 {
		t.Fatalf("lookupCodec allocates %.1f times per key, proto.Unmarshal %.1f", n, u)
	}
}
