package stream

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestHeaderRoundTrip(t *testing.T) {
	for _, h := range []*Header{
		{Pipeline: 7, Block: BlockID{3, 9}, PacketSize: 1 << 20, version: Version},
		{Hop: 2, Pipeline: 1<<63 + 5, Block: BlockID{1, 1}, Offset: 4 << 20, PacketSize: MaxPacketSize,
			Route: []Target{{ID: 2, Addr: "127.0.0.1:9855"}, {ID: 3, Addr: "[::1]:1"}}, Token: []byte("a block token"), version: Version},
		{Pipeline: 1, Block: BlockID{1, 2}, PacketSize: 1, Token: bytes.Repeat([]byte{0xff}, MaxToken), version: MinVersion},
	} {
		b, err := encodeHeader(nil, h)
		if err != nil {
			t.Fatal(err)
		}
		got, err := readHeader(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("decode %+v: %v", h, err)
		}
		if !reflect.DeepEqual(got, h) {
			t.Fatalf("round trip: got %+v, want %+v", got, h)
		}
	}
}

// TestBadHeaders: each malformed header is refused with errBadHeader and a
// message naming what is wrong.
func TestBadHeaders(t *testing.T) {
	good := &Header{Pipeline: 7, Block: BlockID{3, 9}, PacketSize: 1 << 20, Route: []Target{{ID: 2, Addr: "a:1"}}}
	enc := func(h Header) []byte {
		b, err := encodeHeader(nil, &h)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	base := enc(*good)
	base = base[:len(base)-headerCRCLen]
	// mut changes the frame and seals it with a valid CRC again, so the
	// decoder's own checks are what refuse it.
	mut := func(f func(b []byte) []byte) []byte {
		b := f(append([]byte(nil), base...))
		return binary.BigEndian.AppendUint32(b, crc32c(b))
	}
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"magic", mut(func(b []byte) []byte { b[0] = 'X'; return b }), "magic"},
		{"version", mut(func(b []byte) []byte { b[4] = 9; return b }), "version 9"},
		{"version 1", mut(func(b []byte) []byte { b[4] = 1; return b }), "version 1"},
		{"hop", mut(func(b []byte) []byte { b[5] = MaxRoute + 1; return b }), "hop 17"},
		{"crc", append(append([]byte(nil), base...), 0, 0, 0, 0), "CRC32C"},
		{"flipped bit", func() []byte { b := enc(*good); b[20] ^= 4; return b }(), "CRC32C"},
		{"short body", mut(func(b []byte) []byte { binary.BigEndian.PutUint16(b[6:], 3); return b }), "body of 3 bytes"},
		{"pipeline 0", enc(Header{Block: BlockID{3, 9}, PacketSize: 1}), "pipeline 0"},
		{"block 0", enc(Header{Pipeline: 1, Block: BlockID{0, 9}, PacketSize: 1}), "block 0/9"},
		{"packet size", enc(Header{Pipeline: 1, Block: BlockID{1, 9}, PacketSize: MaxPacketSize + 1}), "packet size"},
		{"route truncated", mut(func(b []byte) []byte {
			// The token length (2 bytes), the payload key length (1) and
			// the address's last byte.
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8-4))
			return b[:len(b)-4]
		}), "route entry 0"},
		{"token length missing", mut(func(b []byte) []byte {
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8-3))
			return b[:len(b)-3]
		}), "token length missing"},
		{"token truncated", mut(func(b []byte) []byte {
			b = b[:len(b)-1] // no payload key length
			binary.BigEndian.PutUint16(b[len(b)-2:], 5)
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8+4))
			return append(b, 1, 2, 3, 4)
		}), "block token of 5 bytes"},
		{"token too long", mut(func(b []byte) []byte {
			b = b[:len(b)-1]
			binary.BigEndian.PutUint16(b[len(b)-2:], MaxToken+1)
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8+MaxToken+1))
			return append(b, make([]byte, MaxToken+1)...)
		}), "block token of 513 bytes"},
		{"payload key length missing", mut(func(b []byte) []byte {
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8-1))
			return b[:len(b)-1]
		}), "payload key length missing"},
		{"payload key size", mut(func(b []byte) []byte {
			b[len(b)-1] = 7
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8+7))
			return append(b, make([]byte, 7)...)
		}), "payload key of 7 bytes"},
		{"payload key truncated", mut(func(b []byte) []byte {
			b[len(b)-1] = 16
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8+15))
			return append(b, make([]byte, 15)...)
		}), "payload key of 16 bytes"},
		{"trailing", mut(func(b []byte) []byte {
			binary.BigEndian.PutUint16(b[6:], uint16(len(b)-8+2))
			return append(b, 0, 0)
		}), "trailing"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := readHeader(bytes.NewReader(c.b))
			if !errors.Is(err, errBadHeader) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want a bad-header error mentioning %q", err, c.want)
			}
		})
	}
	if _, err := encodeHeader(nil, &Header{Route: []Target{{ID: 1}}}); err == nil {
		t.Fatal("encoded a route hop without an address")
	}
}

func TestPacketAndAckRoundTrip(t *testing.T) {
	var b [packetHeaderLen]byte
	for _, p := range []packetHeader{
		{kind: kindData, length: 1 << 20, seq: 5, offset: 5 << 20, crc: 0xdeadbeef},
		{kind: kindClose, seq: 6, offset: 6<<20 + 1},
	} {
		p.encode(&b)
		var got packetHeader
		if err := got.decode(&b); err != nil || got != p {
			t.Fatalf("got %+v, %v; want %+v", got, err, p)
		}
	}
	bad := packetHeader{kind: kindData, seq: 1}
	bad.encode(&b)
	var got packetHeader
	if err := got.decode(&b); err == nil || !strings.Contains(err.Error(), "empty data packet") {
		t.Fatalf("empty data packet: %v", err)
	}
	b[28] = 0
	if err := got.decode(&b); err == nil || !strings.Contains(err.Error(), "out of sync") {
		t.Fatalf("bad header CRC: %v", err)
	}

	var ab [ackLen]byte
	for _, a := range []ack{
		{kind: kindDataAck, seq: 3, value: 4 << 20},
		{kind: kindError, code: CodeTimeout, dn: 3, reason: "no ack for packet 3"},
	} {
		enc := a.encode(nil)
		var got ack
		if err := readAck(bytes.NewReader(enc), &ab, &got); err != nil || got != a {
			t.Fatalf("got %+v, %v; want %+v", got, err, a)
		}
	}
	if err := readAck(bytes.NewReader(make([]byte, ackLen)), &ab, &ack{}); !errors.Is(err, errBadAck) {
		t.Fatalf("zero ack: %v", err)
	}
}

func TestErrorNamesDatanode(t *testing.T) {
	e := ackError(&ack{kind: kindError, code: CodeConnLost, dn: 3, reason: "EOF"}, []Target{{2, "a:1"}, {3, "b:2"}})
	if e.Datanode != 3 || e.Addr != "b:2" || !strings.Contains(e.Error(), "datanode 3 (b:2): connection lost: EOF") {
		t.Fatalf("%+v: %v", e, e)
	}
	if !errors.Is(e, &Error{Code: CodeConnLost}) || errors.Is(e, &Error{Code: CodeTimeout}) || errors.Is(e, &Error{Code: CodeConnLost, Datanode: 2}) {
		t.Fatal("Error.Is")
	}
}

func TestBufferPoolAligned(t *testing.T) {
	for _, n := range []int{1, 64 << 10, 1<<20 - 1, 1 << 20, 1<<20 + 1, MaxPacketSize} {
		bp := getBuf(n)
		if len(*bp) < n || !aligned(*bp) {
			t.Fatalf("getBuf(%d): %d bytes, aligned %v", n, len(*bp), aligned(*bp))
		}
		putBuf(bp)
	}
}

// TestBufferPoolReusesLatest: the free list hands out the buffer returned
// last (still in cache), not the one that waited longest.
func TestBufferPoolReusesLatest(t *testing.T) {
	const n = 2 << 20
	a, b, c := getBuf(n), getBuf(n), getBuf(n)
	putBuf(a)
	putBuf(b)
	putBuf(c)
	for i, want := range []*[]byte{c, b, a} {
		if got := getBuf(n); got != want {
			t.Fatalf("getBuf #%d after returning a, b, c: buffer %p, want %p (a %p b %p c %p)", i, got, want, a, b, c)
		}
	}
	putBuf(a)
	putBuf(b)
	putBuf(c)
}

// TestFrameBitFlips: a single flipped bit anywhere in a header, packet
// header or ack is refused, never acted upon. Version 1 frames carried no
// checksum: a flipped length, offset or sequence bit was taken as sent.
func TestFrameBitFlips(t *testing.T) {
	hb, err := encodeHeader(nil, &Header{Pipeline: 7, Block: BlockID{3, 9}, PacketSize: 1 << 20, Route: []Target{{ID: 2, Addr: "a:1"}}})
	if err != nil {
		t.Fatal(err)
	}
	for bit := 0; bit < 8*len(hb); bit++ {
		b := append([]byte(nil), hb...)
		b[bit/8] ^= 1 << (bit % 8)
		if _, err := readHeader(bytes.NewReader(b)); err == nil {
			t.Fatalf("header with bit %d flipped accepted", bit)
		}
	}
	var pb [packetHeaderLen]byte
	(&packetHeader{kind: kindData, length: 4096, seq: 2, offset: 8192, crc: 0x12345678}).encode(&pb)
	for bit := 0; bit < 8*packetHeaderLen; bit++ {
		b := pb
		b[bit/8] ^= 1 << (bit % 8)
		var ph packetHeader
		if err := ph.decode(&b); err == nil {
			t.Fatalf("packet header with bit %d flipped accepted as %+v", bit, ph)
		}
	}
	for _, a := range []ack{{kind: kindDataAck, seq: 3, value: 4 << 20}, {kind: kindError, code: CodeIO, dn: 2, reason: "disk full"}} {
		enc := a.encode(nil)
		for bit := 0; bit < 8*len(enc); bit++ {
			b := append([]byte(nil), enc...)
			b[bit/8] ^= 1 << (bit % 8)
			var ab [ackLen]byte
			var got ack
			if err := readAck(bytes.NewReader(b), &ab, &got); err == nil {
				t.Fatalf("ack %+v with bit %d flipped accepted as %+v", a, bit, got)
			}
		}
	}
}

// TestBadPacketHeaders: sound checksums, unsound fields.
func TestBadPacketHeaders(t *testing.T) {
	for _, c := range []struct {
		name string
		p    packetHeader
		mut  func(b *[packetHeaderLen]byte)
		want string
	}{
		{"too long", packetHeader{kind: kindData, length: MaxPacketSize + 1}, nil, "bytes >"},
		{"offset overflow", packetHeader{kind: kindData, length: 2, offset: 1<<64 - 1}, nil, "overflow"},
		{"close with data", packetHeader{kind: kindClose, length: 1}, nil, "carries 1 bytes"},
		{"unknown kind", packetHeader{kind: 9}, nil, "unknown kind"},
		{"reserved", packetHeader{kind: kindClose}, func(b *[packetHeaderLen]byte) { b[2] = 1 }, "reserved"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var b [packetHeaderLen]byte
			c.p.encode(&b)
			if c.mut != nil {
				c.mut(&b)
				binary.BigEndian.PutUint32(b[28:], crc32c(b[:28]))
			}
			var got packetHeader
			if err := got.decode(&b); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error mentioning %q", err, c.want)
			}
		})
	}
}
