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
// keyrec instead of proto.Unmarshal's reflection (issue 15: the
// client's unmarshal of an S3 object's attributes, a map through
// reflect.New per entry, was ~13 of the ~72 allocations of a HEAD).
// Requests are marshalled by the registered codec: the message bytes are
// unchanged, but grpc.ForceCodecV2 names the codec in the call's
// content-type, application/grpc+proto instead of application/grpc
// (grpc-go servers take either). An answer of any shape keyrec does not decode itself goes
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

// decodeKeyInfo decodes a KeyInfo straight into ki (reset first) if
// keyrec decodes its shape itself (ki untouched otherwise); the decoded
// strings do not alias b.
func decodeKeyInfo(b []byte, ki *metapb.KeyInfo) bool {
	return keyrec.DecodeOwnInto(ki, b, keyrec.Names{})
}

// decodeLookupKeys decodes a LookupKeysResponse into resp (reset first)
// when it holds only results of the fields LookupKeyResult has, each
// result's key (once at most) of a shape keyrec decodes itself: then
// every field as proto.Unmarshal would set it, strings and bytes copied
// out of b. Otherwise it returns false, resp untouched, to be
// unmarshalled. Each result is scanned and decoded in one pass (a key by
// keyrec.DecodeOwn); a result that turns out not to be of these shapes
// abandons what was decoded so far.
func decodeLookupKeys(b []byte, resp *metapb.LookupKeysResponse) bool {
	n := 0
	for p := b; len(p) > 0; n++ {
		num, typ, k := protowire.ConsumeTag(p)
		if k < 0 || num != 1 || typ != protowire.BytesType {
			return false
		}
		_, m := protowire.ConsumeBytes(p[k:])
		if m < 0 {
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
		out[i] = &res[i]
		if !decodeLookupResult(v, &res[i], &names) {
			return false
		}
	}
	proto.Reset(resp)
	resp.Results = out
	return true
}

// decodeLookupResult decodes a LookupKeyResult into r (a zero message)
// if it holds a key keyrec decodes itself (once at most: a second would
// be merged), a code and retry_alone (varints), a message (UTF-8) and a
// status (bytes: nil when empty, as proto.Unmarshal leaves it); names
// become the key's volume and bucket.
func decodeLookupResult(b []byte, r *metapb.LookupKeyResult, names *keyrec.Names) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case (num == 2 || num == 5) && typ == protowire.VarintType:
			x, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			if num == 2 {
				r.Code = uint32(x)
			} else {
				r.RetryAlone = x != 0
			}
		case (num == 1 || num == 3 || num == 4) && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 1:
				if r.Key != nil {
					return false
				}
				key, ok := keyrec.DecodeOwn(v, *names)
				if !ok {
					return false
				}
				r.Key = key
				names.Volume, names.Bucket = key.Volume, key.Bucket
			case 3:
				if !utf8.Valid(v) {
					return false
				}
				r.Message = string(v)
			case 4:
				r.Status = nil
				if len(v) > 0 {
					r.Status = bytes.Clone(v)
				}
			}
		default:
			return false
		}
	}
	return true
}
