package datanodepb

import (
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
)

// RawMarshaler is a message that encodes itself into gRPC buffers, so a
// large byte field can be sent from the caller's memory instead of being
// copied into a marshaled buffer (ReadBlock's data).
type RawMarshaler interface {
	MarshalGRPC() (mem.BufferSlice, error)
}

// RawUnmarshaler is a message that decodes itself from gRPC's receive
// buffers, so a large byte field can be copied once, straight to where the
// caller wants it (ReadBlock's data into the reader's buffer), instead of
// being gathered into one buffer, copied into a message and copied again.
// The buffers are only valid during the call.
type RawUnmarshaler interface {
	UnmarshalGRPC(mem.BufferSlice) error
}

// rawCodec is gRPC's "proto" codec, with the two hooks above for types
// that implement them; every other message goes to gRPC's own codec, so
// nothing changes on the wire or for other messages.
type rawCodec struct{ base encoding.CodecV2 }

func (c rawCodec) Name() string { return "proto" }

func (c rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	if m, ok := v.(RawMarshaler); ok {
		return m.MarshalGRPC()
	}
	return c.base.Marshal(v)
}

func (c rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if m, ok := v.(RawUnmarshaler); ok {
		return m.UnmarshalGRPC(data)
	}
	return c.base.Unmarshal(data, v)
}

func init() {
	base := encoding.GetCodecV2("proto")
	if base == nil {
		panic("datanodepb: gRPC's proto codec is not registered")
	}
	if _, ok := base.(rawCodec); !ok {
		encoding.RegisterCodecV2(rawCodec{base: base})
	}
}
