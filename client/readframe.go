package client

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// readSink receives one ReadBlockResponse (datanodepb.RawUnmarshaler): its
// data goes from gRPC's receive buffers straight into dst, the one copy on
// the client, instead of being gathered into one buffer, copied into a
// message and copied again into the caller's buffer. The data must start
// at block offset base and fit in dst.
type readSink struct {
	base uint64
	dst  []byte

	block  *datanodepb.BlockData
	offset uint64
	n      int
}

// maxBlockDataBytes bounds the BlockData a reply may carry (a block of
// 256 MiB with 16 KiB windows of SHA-256 sums is 512 KiB).
const maxBlockDataBytes = 16 << 20

var errFrame = errors.New("malformed ReadBlock reply")

// UnmarshalGRPC decodes the wire form of ReadBlockResponse (fields 1
// block, 2 offset, 3 data), skipping unknown fields.
func (s *readSink) UnmarshalGRPC(data mem.BufferSlice) error {
	s.block, s.offset, s.n = nil, 0, 0
	c := frameCursor{bufs: data}
	sawData := false
	for c.more() {
		tag, err := c.varint()
		if err != nil {
			return err
		}
		num, typ := protowire.Number(tag>>3), protowire.Type(tag&7)
		switch {
		case num == 1 && typ == protowire.BytesType:
			n, err := c.varint()
			if err != nil {
				return err
			}
			if n > maxBlockDataBytes || n > uint64(c.left) {
				return fmt.Errorf("%w: BlockData of %d bytes", errFrame, n)
			}
			b := make([]byte, n)
			c.read(b)
			s.block = &datanodepb.BlockData{}
			if err := proto.Unmarshal(b, s.block); err != nil {
				return fmt.Errorf("%w: BlockData: %v", errFrame, err)
			}
		case num == 2 && typ == protowire.VarintType:
			if sawData {
				return fmt.Errorf("%w: offset after data", errFrame)
			}
			if s.offset, err = c.varint(); err != nil {
				return err
			}
		case num == 3 && typ == protowire.BytesType:
			n, err := c.varint()
			if err != nil {
				return err
			}
			if n > uint64(c.left) {
				return fmt.Errorf("%w: data of %d bytes in %d", errFrame, n, c.left)
			}
			if n == 0 {
				continue
			}
			if sawData {
				return fmt.Errorf("%w: data twice", errFrame)
			}
			sawData = true
			if s.offset != s.base {
				return fmt.Errorf("ReadBlock sent data at %d, want %d", s.offset, s.base)
			}
			if n > uint64(len(s.dst)) {
				return fmt.Errorf("ReadBlock sent more than the %d bytes asked for", len(s.dst))
			}
			c.read(s.dst[:n])
			s.n = int(n)
		default:
			// Unknown field: skip it.
			var k uint64
			switch typ {
			case protowire.VarintType:
				_, err = c.varint()
			case protowire.Fixed64Type:
				k = 8
			case protowire.Fixed32Type:
				k = 4
			case protowire.BytesType:
				k, err = c.varint()
			default:
				return fmt.Errorf("%w: wire type %d", errFrame, typ)
			}
			if err != nil {
				return err
			}
			if k > uint64(c.left) {
				return fmt.Errorf("%w: field of %d bytes in %d", errFrame, k, c.left)
			}
			c.skip(int(k))
		}
	}
	return nil
}

// frameCursor reads across the buffers of a mem.BufferSlice.
type frameCursor struct {
	bufs mem.BufferSlice
	i    int
	cur  []byte
	left int
	init bool
}

func (c *frameCursor) more() bool {
	if !c.init {
		c.init, c.left = true, c.bufs.Len()
	}
	return c.left > 0
}

// next makes c.cur non-empty (c.left > 0).
func (c *frameCursor) next() {
	for len(c.cur) == 0 {
		c.cur = c.bufs[c.i].ReadOnlyData()
		c.i++
	}
}

func (c *frameCursor) varint() (uint64, error) {
	var v uint64
	for shift := uint(0); shift < 64; shift += 7 {
		if !c.more() {
			return 0, fmt.Errorf("%w: truncated varint", errFrame)
		}
		c.next()
		b := c.cur[0]
		c.cur, c.left = c.cur[1:], c.left-1
		v |= uint64(b&0x7f) << shift
		if b < 0x80 {
			return v, nil
		}
	}
	return 0, fmt.Errorf("%w: varint too long", errFrame)
}

// read fills p; the caller checked len(p) <= c.left.
func (c *frameCursor) read(p []byte) {
	for len(p) > 0 {
		c.next()
		k := copy(p, c.cur)
		p, c.cur, c.left = p[k:], c.cur[k:], c.left-k
	}
}

// skip drops n bytes; the caller checked n <= c.left.
func (c *frameCursor) skip(n int) {
	for n > 0 {
		c.next()
		k := min(n, len(c.cur))
		n, c.cur, c.left = n-k, c.cur[k:], c.left-k
	}
}
