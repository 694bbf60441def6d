package datanode

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// TestDataFrameZeroCopy: a data frame goes through the registered "proto"
// codec as the same bytes proto.Marshal makes, its data is the read buffer
// itself (no copy: the regression check of the copy-free send), and the
// read buffer is released only when the handler and every frame let go.
func TestDataFrameZeroCopy(t *testing.T) {
	codec := encoding.GetCodecV2("proto")
	pb := readBufs.Get().(*[]byte)
	buf := (*pb)[:3<<20]
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	rel := &bufRelease{buf: pb}
	rel.refs.Store(1 + 2)
	var sent [][]byte
	for _, f := range []*dataFrame{{offset: 0, data: buf[:1<<20], rel: rel}, {offset: 5 << 20, data: buf[1<<20 : 3<<20], rel: rel}} {
		bs, err := codec.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := proto.Marshal(&datanodepb.ReadBlockResponse{Offset: f.offset, Data: f.data})
		if got := bs.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("frame at %d: wire bytes differ from proto.Marshal", f.offset)
		}
		last := bs[len(bs)-1].ReadOnlyData()
		if &last[0] != &f.data[0] {
			t.Fatalf("frame at %d: data was copied", f.offset)
		}
		sent = append(sent, last)
		defer bs.Free()
	}
	if rel.refs.Load() != 3 {
		t.Fatalf("refs = %d before any release", rel.refs.Load())
	}
	rel.Put(nil) // the handler is done
	if rel.refs.Load() != 2 {
		t.Fatalf("refs = %d, want 2 (frames still held by gRPC)", rel.refs.Load())
	}
	// Other messages still go through gRPC's proto codec.
	bs, err := codec.Marshal(&datanodepb.ReadBlockResponse{Offset: 9, Data: []byte("x")})
	if err != nil || len(bs.Materialize()) == 0 {
		t.Fatalf("plain message: %v", err)
	}
	var m datanodepb.ReadBlockResponse
	if err := codec.Unmarshal(bs, &m); err != nil || m.Offset != 9 || string(m.Data) != "x" {
		t.Fatalf("plain message round trip: %v %+v", err, &m)
	}
	_ = sent
}

// BenchmarkReadBlockSend: encoding 1 MiB of ReadBlock data for gRPC, the
// copy-free frame against gRPC's proto codec marshal.
func BenchmarkReadBlockSend(b *testing.B) {
	codec := encoding.GetCodecV2("proto")
	data := make([]byte, 1<<20)
	b.Run("frame", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			rel := &bufRelease{buf: &data}
			rel.refs.Store(2)
			bs, err := codec.Marshal(&dataFrame{offset: 1 << 20, data: data, rel: rel})
			if err != nil {
				b.Fatal(err)
			}
			bs.Free()
		}
	})
	b.Run("proto", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			bs, err := codec.Marshal(&datanodepb.ReadBlockResponse{Offset: 1 << 20, Data: data})
			if err != nil {
				b.Fatal(err)
			}
			bs.Free()
		}
	})
}
