package datanode

import (
	"sync/atomic"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// dataFrame is a ReadBlockResponse carrying data (fields 2 offset and 3
// data), encoded without copying the data (datanodepb.RawMarshaler): gRPC
// frames it straight from the read buffer. gRPC's proto codec copied
// every byte into a marshaled buffer first (protowire.AppendBytes was the
// largest memmove of a read).
type dataFrame struct {
	offset uint64
	data   []byte
	rel    *bufRelease
}

func (f *dataFrame) MarshalGRPC() (mem.BufferSlice, error) {
	hdr := make([]byte, 0, 2*binaryVarintMax+2)
	if f.offset != 0 {
		hdr = protowire.AppendTag(hdr, 2, protowire.VarintType)
		hdr = protowire.AppendVarint(hdr, f.offset)
	}
	hdr = protowire.AppendTag(hdr, 3, protowire.BytesType)
	hdr = protowire.AppendVarint(hdr, uint64(len(f.data)))
	if mem.IsBelowBufferPoolingThreshold(len(f.data)) {
		// gRPC would not hand a small buffer back; send a copy and
		// release this frame's hold on the read buffer now.
		d := append([]byte(nil), f.data...)
		f.rel.Put(nil)
		return mem.BufferSlice{mem.SliceBuffer(hdr), mem.SliceBuffer(d)}, nil
	}
	d := f.data
	return mem.BufferSlice{mem.SliceBuffer(hdr), mem.NewBuffer(&d, f.rel)}, nil
}

const binaryVarintMax = 10

// bufRelease returns a ReadBlock read buffer to readBufs when gRPC has
// written every frame sent from it and the handler is done with it (one
// reference each). A frame gRPC never frees (a failed stream) keeps the
// buffer out of the pool for good; the garbage collector takes it then.
type bufRelease struct {
	refs atomic.Int32
	buf  *[]byte
}

// Get is never called: the release only takes buffers back (mem.BufferPool).
func (r *bufRelease) Get(int) *[]byte { panic("bufRelease.Get") }

// Put drops one reference.
func (r *bufRelease) Put(*[]byte) {
	if r.refs.Add(-1) == 0 {
		readBufs.Put(r.buf)
	}
}
