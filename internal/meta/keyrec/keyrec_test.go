package keyrec

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

var testNames = Names{"vol", "bkt", "data/key-1"}

// records are encoded KeyInfos of the shapes keyrec decodes itself
// (plain keys of 0, 1 and several blocks, odd blocks, fields repeated, S3
// attributes of every field, empty ones) and of those it leaves to
// proto.Unmarshal (an unknown field, a string not UTF-8, a block's id
// twice, upload ACLs, the attributes twice, a map entry's key twice).
func records() [][]byte {
	var recs [][]byte
	add := func(ki *metapb.KeyInfo) []byte {
		b, _ := proto.Marshal(ki)
		recs = append(recs, b)
		return b
	}
	plain := func(blocks int) *metapb.KeyInfo {
		ki := &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: "data/key-1", Size: 4096, Replication: metapb.Replication_THREE,
			ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 65536, CreatedUnixMs: 1700000000000, ModifiedUnixMs: -5, ObjectId: 99}
		for j := range blocks {
			ki.Blocks = append(ki.Blocks, &metapb.KeyBlock{Id: &metapb.BlockID{ContainerId: uint64(j + 1), LocalId: uint64(1000 + j)}, Length: uint64(j * 7)})
		}
		return ki
	}
	add(&metapb.KeyInfo{})
	add(plain(0))
	one := add(plain(1))
	add(plain(3))
	odd := plain(3)
	odd.Blocks[0].Id = nil
	odd.Blocks[1].Id = &metapb.BlockID{}
	odd.Blocks[2] = &metapb.KeyBlock{}
	add(odd)
	s3 := func() *metapb.KeyInfo {
		ki := plain(1)
		ki.Name = "other/name"
		ki.Meta = &metapb.ObjectMeta{Etag: "0123456789abcdef0123456789abcdef", ContentType: "application/octet-stream",
			Checksums: map[string]string{"CRC32C": "yZRlqg=="}}
		return ki
	}
	s3one := add(s3())
	all := s3()
	all.Meta = &metapb.ObjectMeta{Etag: "e", ContentType: "t", ContentEncoding: "gzip", ContentDisposition: "d", ContentLanguage: "fr",
		CacheControl: "no-cache", Expires: "Wed, 21 Oct 2015 07:28:00 GMT", User: map[string]string{"a": "1", "b": "", "": "x", "é": "ü"},
		Tags: map[string]string{"t1": "v1"}, Checksums: map[string]string{"SHA256": "abc="}, PartsCount: 3}
	add(all)
	empty := s3()
	empty.Meta = &metapb.ObjectMeta{}
	add(empty)
	acl := s3()
	acl.Meta.UploadAcls = []*metapb.Acl{{}}
	add(acl)
	meta, _ := proto.Marshal(s3().Meta)
	tagged := func(num byte, v []byte) []byte { return append([]byte{num<<3 | 2, byte(len(v))}, v...) }
	recs = append(recs,
		append(append([]byte{}, one...), one...),                        // every field twice: last wins, blocks add up
		append(append([]byte{}, one...), 0xf8, 0x7f, 1),                 // an unknown field
		append(append([]byte{}, one...), 0x1a, 2, 0xff, 0xfe),           // a name that is not UTF-8
		[]byte{0x52, 4, 0x0a, 0, 0x0a, 0},                               // a block whose id comes twice (merged)
		[]byte{0x52, 2, 0x10, 5, 0x52, 3, 0x0a, 1, 0x08},                // a block, then a truncated one
		append(append([]byte{}, s3one...), tagged(13, meta)...),         // the attributes twice (merged)
		tagged(13, tagged(8, []byte{0x0a, 1, 'k', 0x0a, 1, 'j'})),       // a map entry's key twice
		tagged(13, tagged(9, []byte{0x12, 1, 'v'})),                     // a map entry without a key
		tagged(13, tagged(10, []byte{0x0a, 1, 'k', 0x12, 1, 0xff})),     // a map value not UTF-8
		tagged(13, []byte{0x58, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1}), // parts_count over 32 bits
		tagged(13, []byte{0x08, 1}),                                     // a wrong wire type
	)
	return recs
}

// same checks Decode, DecodeOwn and DecodeOwnInto against
// proto.Unmarshal on b: the same error or none, the same message
// (unknown fields included), unchanged when b's bytes are overwritten
// after the decode (the lookup cache's arena and gRPC's receive buffers
// are reused); DecodeOwn and DecodeOwnInto agree on whether they decode
// b, and DecodeOwnInto leaves its target alone when they do not.
func same(t *testing.T, b []byte) {
	t.Helper()
	want := &metapb.KeyInfo{}
	werr := proto.Unmarshal(b, want)
	buf := append([]byte(nil), b...)
	got, gerr := Decode(buf, testNames)
	own, ok := DecodeOwn(buf, testNames)
	into := &metapb.KeyInfo{Name: "stale", Size: 9, Blocks: []*metapb.KeyBlock{{Length: 1}}}
	stale := proto.Clone(into)
	okInto := DecodeOwnInto(into, buf, testNames)
	for i := range buf {
		buf[i] = 0xAA
	}
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("% x: Decode error %v, proto.Unmarshal %v", b, gerr, werr)
	}
	if ok != okInto || ok && werr != nil {
		t.Fatalf("% x: DecodeOwn %v, DecodeOwnInto %v, proto.Unmarshal's error %v", b, ok, okInto, werr)
	}
	if !okInto && !proto.Equal(into, stale) {
		t.Fatalf("% x: DecodeOwnInto declined but changed its target to %v", b, into)
	}
	if werr != nil {
		return
	}
	msgs := []*metapb.KeyInfo{got}
	if ok {
		msgs = append(msgs, own, into)
	}
	for _, m := range msgs {
		if !proto.Equal(m, want) || !bytes.Equal(m.ProtoReflect().GetUnknown(), want.ProtoReflect().GetUnknown()) {
			t.Fatalf("% x: decoded\n got %v\nwant %v", b, m, want)
		}
	}
}

// TestDecodeMatchesUnmarshal: every record of records() and every
// truncation of it decodes as proto.Unmarshal decodes it, and the
// shapes keyrec claims are decoded by DecodeOwn itself.
func TestDecodeMatchesUnmarshal(t *testing.T) {
	recs := records()
	for _, r := range recs {
		for i := 0; i <= len(r); i++ {
			same(t, r[:i])
		}
	}
	for i := range 8 { // plain keys and S3 keys: keyrec's own path
		if _, ok := DecodeOwn(recs[i], testNames); !ok {
			t.Fatalf("record %d (% x) is not decoded by DecodeOwn", i, recs[i])
		}
	}
	if _, ok := DecodeOwn(recs[8], testNames); ok {
		t.Fatal("a record with upload ACLs is decoded by DecodeOwn")
	}
}

// FuzzDecode: keyrec never panics and agrees with proto.Unmarshal on any
// input (same).
func FuzzDecode(f *testing.F) {
	for _, r := range records() {
		f.Add(r)
	}
	f.Fuzz(func(t *testing.T, b []byte) { same(t, b) })
}
