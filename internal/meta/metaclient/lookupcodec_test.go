package metaclient

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

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
		[]byte{0x0a, 4, 0x10, 5, 0x22, 0},                                                     // an empty status (nil, as proto.Unmarshal leaves it)
		[]byte{0x0a, 7, 0x22, 1, 'x', 0x22, 0, 0x0a, 0},                                       // a status, then an empty one (last wins: nil)
	)
	return out
}

// codecSame checks lookupCodec against proto.Unmarshal on b: the same
// error or none, and the same message (unknown fields included, a
// status nil where proto.Unmarshal's is), unchanged when the receive
// buffer is overwritten after the decode (gRPC reuses it).
func codecSame(t *testing.T, b []byte, got, want proto.Message) {
	t.Helper()
	werr := proto.Unmarshal(b, want)
	buf := append([]byte{}, b...)
	gerr := lookupCodec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(buf)}, got)
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("% x: lookupCodec error %v, proto.Unmarshal %v", b, gerr, werr)
	}
	if werr != nil {
		return
	}
	for i := range buf {
		buf[i] = 0xAA
	}
	if !proto.Equal(got, want) || !bytes.Equal(got.ProtoReflect().GetUnknown(), want.ProtoReflect().GetUnknown()) {
		t.Fatalf("% x: lookupCodec\n got %v\nwant %v", b, got, want)
	}
	if g, ok := got.(*metapb.LookupKeysResponse); ok {
		for i, r := range want.(*metapb.LookupKeysResponse).Results {
			if (g.Results[i].Status == nil) != (r.Status == nil) {
				t.Fatalf("% x: result %d: lookupCodec's status %#v, proto.Unmarshal's %#v", b, i, g.Results[i].Status, r.Status)
			}
		}
	}
}

// keyInfoAnswers are encoded LookupKey answers: an S3 key, a plain
// one, an empty one, one of several blocks, and one with every field of
// KeyInfo set (proto.Unmarshal's path: a field added to KeyInfo later
// cannot go missing from lone lookups' answers).
func keyInfoAnswers() [][]byte {
	multi := s3Key("m")
	multi.Meta = nil
	multi.Blocks = append(multi.Blocks, &metapb.KeyBlock{Id: &metapb.BlockID{ContainerId: 3, LocalId: 4}, Length: 5}, &metapb.KeyBlock{})
	var out [][]byte
	for _, k := range []*metapb.KeyInfo{s3Key("c"), {Name: "p"}, {}, multi, everyField()} {
		b, _ := proto.Marshal(k)
		out = append(out, b)
	}
	return out
}

// everyField is a KeyInfo with every field set (by reflection, to the
// depth of its messages' own fields), each map and list of one entry.
func everyField() *metapb.KeyInfo {
	ki := &metapb.KeyInfo{}
	fill(ki.ProtoReflect(), 3)
	return ki
}

func fill(m protoreflect.Message, depth int) {
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if fd.ContainingOneof() != nil && m.WhichOneof(fd.ContainingOneof()) != nil {
			continue
		}
		scalar := func(fd protoreflect.FieldDescriptor) protoreflect.Value {
			switch fd.Kind() {
			case protoreflect.BoolKind:
				return protoreflect.ValueOfBool(true)
			case protoreflect.EnumKind:
				return protoreflect.ValueOfEnum(1)
			case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
				return protoreflect.ValueOfInt32(-7)
			case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
				return protoreflect.ValueOfInt64(-7)
			case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
				return protoreflect.ValueOfUint32(7)
			case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
				return protoreflect.ValueOfUint64(7)
			case protoreflect.FloatKind:
				return protoreflect.ValueOfFloat32(1.5)
			case protoreflect.DoubleKind:
				return protoreflect.ValueOfFloat64(1.5)
			case protoreflect.StringKind:
				return protoreflect.ValueOfString("s-" + string(fd.Name()))
			case protoreflect.BytesKind:
				return protoreflect.ValueOfBytes([]byte("b-" + string(fd.Name())))
			}
			return protoreflect.Value{}
		}
		switch {
		case fd.IsMap():
			mp := m.Mutable(fd).Map()
			v := protoreflect.Value{}
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				if depth == 0 {
					continue
				}
				v = mp.NewValue()
				fill(v.Message(), depth-1)
			} else {
				v = scalar(fd.MapValue())
			}
			mp.Set(scalar(fd.MapKey()).MapKey(), v)
		case fd.IsList():
			l := m.Mutable(fd).List()
			if fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind {
				if depth == 0 {
					continue
				}
				v := l.NewElement()
				fill(v.Message(), depth-1)
				l.Append(v)
			} else {
				l.Append(scalar(fd))
			}
		case fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind:
			if depth == 0 {
				continue
			}
			fill(m.Mutable(fd).Message(), depth-1)
		default:
			m.Set(fd, scalar(fd))
		}
	}
}

// TestLookupCodecMatchesUnmarshal: lookupCodec decodes LookupKeys and
// LookupKey answers (and every truncation of them) as proto.Unmarshal
// does, the same error or none and the same message, which outlives the
// receive buffer.
func TestLookupCodecMatchesUnmarshal(t *testing.T) {
	check := func(b []byte, got, want proto.Message) {
		t.Helper()
		codecSame(t, b, got, want)
	}
	for _, b := range lookupAnswers(t) {
		for i := 0; i <= len(b); i++ {
			check(b[:i], &metapb.LookupKeysResponse{}, &metapb.LookupKeysResponse{})
			// Into a message that held an answer already (a retried call).
			stale := &metapb.LookupKeysResponse{Results: []*metapb.LookupKeyResult{{Code: 3}}}
			check(b[:i], stale, &metapb.LookupKeysResponse{})
		}
	}
	for _, b := range keyInfoAnswers() {
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

// FuzzLookupKeys: lookupCodec decodes any LookupKeys answer as
// proto.Unmarshal does (codecSame), into a message that held an answer
// already, and never panics.
func FuzzLookupKeys(f *testing.F) {
	for _, b := range lookupAnswers(f) {
		f.Add(b)
	}
	key, _ := proto.Marshal(s3Key("f"))
	f.Add(key)
	f.Fuzz(func(t *testing.T, b []byte) {
		codecSame(t, b, &metapb.LookupKeysResponse{Results: []*metapb.LookupKeyResult{{Code: 3}}}, &metapb.LookupKeysResponse{})
	})
}

// FuzzKeyInfo: lookupCodec decodes any LookupKey answer as
// proto.Unmarshal does (codecSame), into a message that held a key
// already, and never panics.
func FuzzKeyInfo(f *testing.F) {
	for _, b := range keyInfoAnswers() {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		codecSame(t, b, &metapb.KeyInfo{Name: "stale", Size: 9, Blocks: []*metapb.KeyBlock{{Length: 1}}}, &metapb.KeyInfo{})
	})
}

// BenchmarkLookupCodec: lookupCodec's decode of a LookupKeys answer of
// 16 S3 keys (the gateway's HEAD batches), per answer.
func BenchmarkLookupCodec(b *testing.B) {
	resp := &metapb.LookupKeysResponse{}
	for range 16 {
		resp.Results = append(resp.Results, &metapb.LookupKeyResult{Key: s3Key("data/object-1")})
	}
	enc, _ := proto.Marshal(resp)
	data := mem.BufferSlice{mem.SliceBuffer(enc)}
	b.ReportAllocs()
	for b.Loop() {
		if err := (lookupCodec{}).Unmarshal(data, &metapb.LookupKeysResponse{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLookupCodecKeyInfo: lookupCodec's decode of a lone
// LookupKey's answer (an S3 key) into the caller's message.
func BenchmarkLookupCodecKeyInfo(b *testing.B) {
	enc, _ := proto.Marshal(s3Key("data/object-1"))
	data := mem.BufferSlice{mem.SliceBuffer(enc)}
	b.ReportAllocs()
	for b.Loop() {
		if err := (lookupCodec{}).Unmarshal(data, &metapb.KeyInfo{}); err != nil {
			b.Fatal(err)
		}
	}
}
