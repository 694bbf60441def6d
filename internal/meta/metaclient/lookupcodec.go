package metaclient

import (
	"bytes"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/keyrec"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// lookupCodec is gRPC's "proto" codec for Lookup's calls, decoding their
// answers (a LookupKeys response, a LookupKey's KeyInfo) with
// keyrec.Decode instead of proto.Unmarshal's reflection (issue 15: the
// client's unmarshal of an S3 object's attributes, a map through
// reflect.New per entry, was ~13 of the ~72 allocations of a HEAD).
// Requests are marshalled by the registered codec; nothing changes on the
// wire. An answer of any shape keyrec does not decode itself goes
// through proto.Unmarshal whole.
type lookupCodec struct{}

// lookupCallOpt makes a call use lookupCodec.
var lookupCallOpt = grpc.ForceCodecV2(lookupCodec{})

func (lookupCodec) Name() string { return "proto" }

func (lookupCodec) Marshal(v any) (mem.BufferSlice, error) {
	return encoding.GetCodecV2("proto").Marshal(v)
}

func (lookupCodec) Unmarshal(data mem.BufferSlice, v any) error {
	var dec func([]byte) bool
	switch m := v.(type) {
	case *metapb.LookupKeysResponse:
		dec = func(b []byte) bool { return decodeLookupKeys(b, m) }
	case *metapb.KeyInfo:
		dec = func(b []byte) bool { return decodeKeyInfo(b, m) }
	default:
		return encoding.GetCodecV2("proto").Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	b := buf.ReadOnlyData()
	if dec(b) {
		return nil
	}
	return proto.Unmarshal(b, v.(proto.Message))
}

// decodeKeyInfo decodes a KeyInfo into ki (reset first) if keyrec
// decodes its shape itself; the decoded strings do not alias b.
func decodeKeyInfo(b []byte, ki *metapb.KeyInfo) bool {
	nb, ok := keyrec.Scan(b)
	if !ok {
		return false
	}
	d := keyrec.DecodePlain(b, nb, keyrec.Names{})
	proto.Reset(ki)
	ki.Volume, ki.Bucket, ki.Name, ki.Size, ki.Replication = d.Volume, d.Bucket, d.Name, d.Size, d.Replication
	ki.ChecksumType, ki.BytesPerChecksum, ki.CreatedUnixMs, ki.ModifiedUnixMs = d.ChecksumType, d.BytesPerChecksum, d.CreatedUnixMs, d.ModifiedUnixMs
	ki.Blocks, ki.ObjectId, ki.Meta = d.Blocks, d.ObjectId, d.Meta
	return true
}

// decodeLookupKeys decodes a LookupKeysResponse into resp (reset first)
// when it holds only results of the fields LookupKeyResult has, each
// result's key (once at most) of a shape keyrec decodes itself: then
// every field as proto.Unmarshal would set it, strings and bytes copied
// out of b. Otherwise it returns false and resp is to be unmarshalled.
func decodeLookupKeys(b []byte, resp *metapb.LookupKeysResponse) bool {
	n := 0
	for p := b; len(p) > 0; n++ {
		num, typ, k := protowire.ConsumeTag(p)
		if k < 0 || num != 1 || typ != protowire.BytesType {
			return false
		}
		v, m := protowire.ConsumeBytes(p[k:])
		if m < 0 || !scanLookupResult(v) {
			return false
		}
		p = p[k+m:]
	}
	res := make([]metapb.LookupKeyResult, n) // one allocation for all results
	out := make([]*metapb.LookupKeyResult, n)
	// A batch's keys share their volume and bucket: each key's are the
	// previous key's strings when equal, not copies.
	var names keyrec.Names
	for i, p := 0, b; len(p) > 0; i++ {
		_, _, k := protowire.ConsumeTag(p)
		v, m := protowire.ConsumeBytes(p[k:])
		p = p[k+m:]
		r := &res[i]
		out[i] = r
		for len(v) > 0 {
			num, _, k := protowire.ConsumeTag(v)
			v = v[k:]
			switch num {
			case 2, 5:
				x, m := protowire.ConsumeVarint(v)
				v = v[m:]
				if num == 2 {
					r.Code = uint32(x)
				} else {
					r.RetryAlone = x != 0
				}
				continue
			}
			f, m := protowire.ConsumeBytes(v)
			v = v[m:]
			switch num {
			case 1:
				nb, _ := keyrec.Scan(f)
				r.Key = keyrec.DecodePlain(f, nb, names)
				names.Volume, names.Bucket = r.Key.Volume, r.Key.Bucket
			case 3:
				r.Message = string(f)
			case 4:
				r.Status = bytes.Clone(f)
			}
		}
	}
	proto.Reset(resp)
	resp.Results = out
	return true
}

// scanLookupResult checks a LookupKeyResult for decodeLookupKeys: a key
// keyrec decodes itself (once at most: a second would be merged), a code
// and retry_alone (varints), a message (UTF-8) and a status (bytes).
func scanLookupResult(b []byte) bool {
	key := false
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case (num == 2 || num == 5) && typ == protowire.VarintType:
			_, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
		case (num == 1 || num == 3 || num == 4) && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			switch num {
			case 1:
				if _, ok := keyrec.Scan(v); !ok || key {
					return false
				}
				key = true
			case 3:
				if !utf8.Valid(v) {
					return false
				}
			}
			b = b[n:]
		default:
			return false
		}
	}
	return true
}
