package client

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// splitFrames cuts b into gRPC-like receive buffers of 16 KiB.
func splitFrames(b []byte) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		k := min(len(b), 16<<10)
		s = append(s, mem.SliceBuffer(b[:k]))
		b = b[k:]
	}
	return s
}

// TestReadSinkDecodesProto: readSink decodes what proto.Marshal encodes
// (first message with BlockData, data messages, unknown fields), rejects
// data at the wrong offset or longer than asked, and decodes a data message
// without allocating (the regression check of the one-copy receive).
func TestReadSinkDecodesProto(t *testing.T) {
	data := randBytes(3, 1<<20)
	first, _ := proto.Marshal(&datanodepb.ReadBlockResponse{Block: &datanodepb.BlockData{Length: 77, Chunks: []*datanodepb.ChunkInfo{{Offset: 0, Length: 77}}}})
	s := &readSink{base: 4096, dst: make([]byte, len(data))}
	if err := s.UnmarshalGRPC(splitFrames(first)); err != nil || s.block.GetLength() != 77 || s.n != 0 {
		t.Fatalf("first message: %v, %+v", err, s)
	}
	msg, _ := proto.Marshal(&datanodepb.ReadBlockResponse{Offset: 4096, Data: data})
	msg = append(msg, 0xf8, 0x07, 0x01) // unknown varint field 127 = 1
	if err := s.UnmarshalGRPC(splitFrames(msg)); err != nil || s.n != len(data) || !bytes.Equal(s.dst, data) {
		t.Fatalf("data message: %v, n %d", err, s.n)
	}
	bad := &readSink{base: 0, dst: make([]byte, len(data))}
	if err := bad.UnmarshalGRPC(splitFrames(msg)); err == nil {
		t.Fatal("data at 4096 accepted where 0 was asked for")
	}
	short := &readSink{base: 4096, dst: make([]byte, 100)}
	if err := short.UnmarshalGRPC(splitFrames(msg)); err == nil {
		t.Fatal("more data than asked for accepted")
	}
	if err := s.UnmarshalGRPC(splitFrames(msg[:len(msg)-10])); err == nil {
		t.Fatal("truncated message accepted")
	}
	frames := splitFrames(msg)
	if a := testing.AllocsPerRun(20, func() {
		if err := s.UnmarshalGRPC(frames); err != nil {
			t.Fatal(err)
		}
	}); a != 0 {
		t.Fatalf("decoding a 1 MiB data message allocates %v times, want 0", a)
	}
}

// BenchmarkReadSinkDecode: the client's receive of a 1 MiB ReadBlock data
// message from 16 KiB frames, against the proto path it replaced
// (materialize, proto.Unmarshal, copy out).
func BenchmarkReadSinkDecode(b *testing.B) {
	data := randBytes(3, 1<<20)
	msg, _ := proto.Marshal(&datanodepb.ReadBlockResponse{Offset: 1 << 20, Data: data})
	frames := splitFrames(msg)
	dst := make([]byte, len(data))
	b.Run("sink", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		s := &readSink{base: 1 << 20, dst: dst}
		for b.Loop() {
			if err := s.UnmarshalGRPC(frames); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("proto", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			m := &datanodepb.ReadBlockResponse{}
			if err := proto.Unmarshal(frames.Materialize(), m); err != nil {
				b.Fatal(err)
			}
			copy(dst, m.Data)
		}
	})
}
