package stream

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// The stream protocol is a trust boundary: a datanode reads headers and
// packets from any client that connects, and clients and datanodes read
// acks from datanodes. These targets feed those decoders arbitrary bytes.
// Their seed corpora (testdata/fuzz/<Target>) run as regression cases in
// every plain `go test`.
//
//	go test -run '^$' -fuzz '^FuzzReadHeader$' -fuzztime 75s ./internal/stream
//	go test -run '^$' -fuzz '^FuzzPacketHeader$' -fuzztime 75s ./internal/stream
//	go test -run '^$' -fuzz '^FuzzReadAck$' -fuzztime 75s ./internal/stream
//	go test -run '^$' -fuzz '^FuzzServerConn$' -fuzztime 75s ./internal/stream

func mustHeader(tb testing.TB, h *Header) []byte {
	b, err := encodeHeader(nil, h)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

func packetBytes(kind uint8, seq, off uint64, payload []byte) []byte {
	var b [packetHeaderLen]byte
	(&packetHeader{kind: kind, length: uint32(len(payload)), seq: seq, offset: off, crc: crc32c(payload)}).encode(&b)
	return append(b[:], payload...)
}

// Every frame carries a CRC32C, which a fuzzer almost never gets right by
// mutation: left alone, it would test little but the CRC check. So each
// target takes a seal argument: when set, the harness recomputes the
// frame checksums of the (mutated) input first, and the fuzzer reaches the
// field checks behind them.

// sealHeader recomputes the CRC of the header frame at the start of b, if
// b holds one; it returns the frame's length (0 if b is too short).
func sealHeader(b []byte) int {
	if len(b) < headerPrefixLen {
		return 0
	}
	n := headerPrefixLen + int(binary.BigEndian.Uint16(b[6:]))
	if len(b) < n+headerCRCLen {
		return 0
	}
	binary.BigEndian.PutUint32(b[n:], crc32c(b[:n]))
	return n + headerCRCLen
}

func sealPacket(b []byte) {
	binary.BigEndian.PutUint32(b[28:], crc32c(b[:28]))
}

func sealAck(b []byte) {
	if len(b) < ackLen {
		return
	}
	n := int(binary.BigEndian.Uint16(b[2:]))
	if b[0] != kindError {
		n = 0
	}
	if len(b) < ackLen+n {
		return
	}
	binary.BigEndian.PutUint32(b[4:], ackCRC(b[:ackLen], b[ackLen:ackLen+n]))
}

// sealConn seals a whole client connection: the header, then each packet
// header in turn (skipping its payload as its length says), and with
// payloads, each payload's CRC too; after a CLOSE, the next stream's
// header (a reused connection) and its packets the same way.
func sealConn(b []byte, payloads bool) {
	off := 0
	for {
		n := sealHeader(b[off:])
		if n == 0 {
			return
		}
		off += n
		for off+packetHeaderLen <= len(b) {
			p := b[off : off+packetHeaderLen]
			n := 0
			if p[0] == kindData {
				n = int(binary.BigEndian.Uint32(p[4:]))
			}
			end := off + packetHeaderLen + n
			if payloads && end <= len(b) {
				binary.BigEndian.PutUint32(p[24:], crc32c(b[off+packetHeaderLen:end]))
			}
			sealPacket(p)
			if n > len(b) {
				return
			}
			off = end
			if p[0] == kindClose {
				break
			}
		}
		if off+packetHeaderLen > len(b) {
			return
		}
	}
}

// sentPayloads is the payload each stream's data packets carry on a
// connection, in order, up to the first packet that is not a whole data
// packet; after a whole CLOSE packet the next stream's header follows
// (a reused connection). Whatever a server stores from the connection's
// stream i must be a prefix of element i.
func sentPayloads(b []byte) [][]byte {
	var out [][]byte
	off := 0
	for off+headerPrefixLen <= len(b) {
		off += headerPrefixLen + int(binary.BigEndian.Uint16(b[off+6:])) + headerCRCLen
		var sent []byte
		for off+packetHeaderLen <= len(b) && b[off] == kindData {
			n := int(binary.BigEndian.Uint32(b[off+4:]))
			if n > len(b)-off-packetHeaderLen {
				break
			}
			sent = append(sent, b[off+packetHeaderLen:off+packetHeaderLen+n]...)
			off += packetHeaderLen + n
		}
		out = append(out, sent)
		if off+packetHeaderLen > len(b) || b[off] != kindClose {
			break
		}
		off += packetHeaderLen
	}
	return out
}

// isConnErr tells the errors of a reader that ran out of bytes.
func isConnErr(err error) bool { return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) }

// FuzzReadHeader: readHeader refuses with errBadHeader or a short read,
// and what it accepts re-encodes to the very bytes it read.
func FuzzReadHeader(f *testing.F) {
	for _, seal := range []bool{false, true} {
		f.Add(seal, mustHeader(f, &Header{Pipeline: 7, Block: BlockID{3, 9}, PacketSize: 1 << 20}))
		f.Add(seal, mustHeader(f, &Header{Hop: 1, Pipeline: 1, Block: BlockID{1, 1}, Offset: 4 << 20, PacketSize: MaxPacketSize,
			Route: []Target{{ID: 2, Addr: "127.0.0.1:9855"}, {ID: 3, Addr: "[::1]:1"}}}))
	}
	f.Add(false, []byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, seal bool, data []byte) {
		if seal {
			data = bytes.Clone(data)
			sealHeader(data)
		}
		h, err := readHeader(bytes.NewReader(data))
		if err != nil {
			if !errors.Is(err, errBadHeader) && !isConnErr(err) {
				t.Fatalf("error neither a bad header nor a short read: %v", err)
			}
			return
		}
		if len(h.Route) > MaxRoute || h.PacketSize == 0 || h.PacketSize > MaxPacketSize || h.Hop > MaxRoute {
			t.Fatalf("accepted an out-of-bounds header %+v", h)
		}
		enc, err := encodeHeader(nil, h)
		if err != nil {
			t.Fatalf("accepted header %+v does not encode: %v", h, err)
		}
		if !bytes.Equal(enc, data[:len(enc)]) {
			t.Fatalf("accepted %x, re-encodes as %x", data[:len(enc)], enc)
		}
	})
}

// FuzzNextHeader: the header of the next stream on a reused secured
// connection comes as control records (sealed with the connection's keys,
// counters going on from the last stream's). readHeader over the record
// decoder refuses with errBadHeader, a refused record or the input's end;
// what it accepts is what was sealed and re-encodes to it. With mode bit
// 1 the header's CRC is fixed first; bit 2 feeds the bytes as the raw
// wire (records the fuzzer forges); the rest sets how the sender splits
// the header into control records. Records of an earlier stream go first,
// so the counters are mid-connection.
func FuzzNextHeader(f *testing.F) {
	for _, mode := range []uint8{1, 1 | 4<<2, 1 | 63<<2} {
		f.Add(mode, mustHeader(f, &Header{Pipeline: 7, Block: BlockID{3, 9}, PacketSize: 1 << 20, Token: []byte("tok")}))
		f.Add(mode, mustHeader(f, &Header{Hop: 1, Pipeline: 1, Block: BlockID{1, 1}, Offset: 4 << 20, PacketSize: MaxPacketSize,
			Route: []Target{{ID: 2, Addr: "127.0.0.1:9855"}, {ID: 3, Addr: "[::1]:1"}}, Token: bytes.Repeat([]byte{9}, MaxToken),
			payloadKey: bytes.Repeat([]byte{5}, 32)}))
	}
	f.Add(uint8(2), []byte{1, 0, 0, 0, 0, 0, 0, 40})
	f.Fuzz(func(t *testing.T, mode uint8, data []byte) {
		snd, wire, rcv := memRecords(t)
		// An earlier stream's close ack, then its CLOSE the other way:
		// the receiver's counter is past 0.
		earlier := packetBytes(kindClose, 3, 99, nil)
		if _, err := snd.Write(earlier); err != nil {
			t.Fatal(err)
		}
		if mode&1 != 0 {
			data = bytes.Clone(data)
			sealHeader(data)
		}
		if mode&2 != 0 {
			wire.Write(data)
		} else {
			split := max(1, int(mode>>2)*37)
			for p := data; len(p) > 0; {
				k := min(split, len(p))
				if _, err := snd.Write(p[:k]); err != nil {
					t.Fatal(err)
				}
				p = p[k:]
			}
		}
		r := rcv(wire.Bytes())
		var got [packetHeaderLen]byte
		if _, err := io.ReadFull(r, got[:]); err != nil || !bytes.Equal(got[:], earlier) {
			t.Fatalf("the earlier stream's record: %v", err)
		}
		h, err := readHeader(r)
		if err != nil {
			if !errors.Is(err, errBadHeader) && !errors.Is(err, errRecord) && !isConnErr(err) {
				t.Fatalf("error neither a bad header, a refused record nor a short read: %v", err)
			}
			return
		}
		if mode&2 != 0 {
			t.Fatalf("a header from forged records accepted: %+v", h)
		}
		if len(h.Route) > MaxRoute || h.PacketSize == 0 || h.PacketSize > MaxPacketSize || h.Hop > MaxRoute || len(h.Token) > MaxToken {
			t.Fatalf("accepted an out-of-bounds header %+v", h)
		}
		enc, err := encodeHeader(nil, h)
		if err != nil {
			t.Fatalf("accepted header %+v does not encode: %v", h, err)
		}
		if !bytes.Equal(enc, data[:len(enc)]) {
			t.Fatalf("accepted %x, re-encodes as %x", data[:len(enc)], enc)
		}
	})
}

// FuzzPacketHeader: decode accepts only sound packet headers, which
// re-encode to the same bytes.
func FuzzPacketHeader(f *testing.F) {
	for _, seal := range []bool{false, true} {
		f.Add(seal, packetBytes(kindData, 0, 0, make([]byte, 1)))
		f.Add(seal, packetBytes(kindClose, 3, 3<<20, nil))
		f.Add(seal, make([]byte, packetHeaderLen))
	}
	f.Fuzz(func(t *testing.T, seal bool, data []byte) {
		if len(data) < packetHeaderLen {
			return
		}
		var b [packetHeaderLen]byte
		copy(b[:], data)
		if seal {
			sealPacket(b[:])
		}
		var p packetHeader
		if err := p.decode(&b); err != nil {
			return
		}
		switch {
		case p.kind == kindData && (p.length == 0 || p.length > MaxPacketSize || p.offset+uint64(p.length) < p.offset):
			t.Fatalf("accepted data packet %+v", p)
		case p.kind == kindClose && p.length != 0:
			t.Fatalf("accepted close packet %+v", p)
		case p.kind != kindData && p.kind != kindClose:
			t.Fatalf("accepted packet kind %#x", p.kind)
		}
		var re [packetHeaderLen]byte
		p.encode(&re)
		if re != b {
			t.Fatalf("accepted %x, re-encodes as %x", b, re)
		}
	})
}

// FuzzReadAck: readAck refuses with errBadAck or a short read, bounds the
// reason, and what it accepts re-encodes to the bytes it read.
func FuzzReadAck(f *testing.F) {
	for _, seal := range []bool{false, true} {
		f.Add(seal, (&ack{kind: kindHeaderAck, value: 1 << 20}).encode(nil))
		f.Add(seal, (&ack{kind: kindDataAck, seq: 3, value: 4 << 20}).encode(nil))
		f.Add(seal, (&ack{kind: kindError, code: CodeTimeout, dn: 3, reason: "no ack for packet 3"}).encode(nil))
	}
	f.Fuzz(func(t *testing.T, seal bool, data []byte) {
		if seal {
			data = bytes.Clone(data)
			sealAck(data)
		}
		var b [ackLen]byte
		var a ack
		if err := readAck(bytes.NewReader(data), &b, &a); err != nil {
			if !errors.Is(err, errBadAck) && !isConnErr(err) {
				t.Fatalf("error neither a bad ack nor a short read: %v", err)
			}
			return
		}
		if len(a.reason) > maxReason {
			t.Fatalf("accepted a reason of %d bytes", len(a.reason))
		}
		enc := a.encode(nil)
		if !bytes.Equal(enc, data[:len(enc)]) {
			t.Fatalf("accepted %x, re-encodes as %x", data[:len(enc)], enc)
		}
	})
}

// memSink keeps a stream's data in memory.
type memSink struct {
	mu             sync.Mutex
	data           []byte
	closed, abortd bool
}

func (m *memSink) Write(p []byte) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.data = append(m.data, p...)
	return len(p), nil
}
func (m *memSink) Close() error { m.mu.Lock(); m.closed = true; m.mu.Unlock(); return nil }
func (m *memSink) Abort() error { m.mu.Lock(); m.abortd = true; m.mu.Unlock(); return nil }

// memBackend admits streams at the end of a route only (so that fuzzed
// routes never make the server dial out) and remembers the sinks (and
// headers) it opened, in order.
type memBackend struct {
	mu    sync.Mutex
	sinks []*memSink
	hdrs  []*Header
}

func (b *memBackend) Open(h *Header) (Sink, error) {
	if len(h.Route) > 0 {
		return nil, &Error{Code: CodeNotInPipeline, Reason: "fuzz backend: no forwarding"}
	}
	s := &memSink{}
	b.mu.Lock()
	b.sinks, b.hdrs = append(b.sinks, s), append(b.hdrs, h)
	b.mu.Unlock()
	return s, nil
}

// FuzzServerConn feeds a whole client connection to a stream server:
// header, packets, close, in any order and any state of damage, and after
// a close the next stream's header and packets (a reused connection). The
// server must answer with well-formed acks and end each stream; the data
// it acknowledges is exactly what it stored; data it stored for a stream
// that failed is discarded; a close ack means the sink was synced; no
// stream follows one that failed.
func FuzzServerConn(f *testing.F) {
	hdr := mustHeader(f, &Header{Pipeline: 1, Block: BlockID{1, 2}, Offset: 100, PacketSize: 64})
	p0, p1 := bytes.Repeat([]byte{'a'}, 64), []byte("tail")
	good := append(append(append(append([]byte(nil), hdr...), packetBytes(kindData, 0, 100, p0)...), packetBytes(kindData, 1, 164, p1)...), packetBytes(kindClose, 2, 168, nil)...)
	bad := append([]byte(nil), good...)
	bad[len(hdr)+packetHeaderLen+5] ^= 1 // payload damaged: checksum mismatch
	hdr2 := mustHeader(f, &Header{Pipeline: 1, Block: BlockID{1, 3}, PacketSize: 64})
	second := append(append(append([]byte(nil), hdr2...), packetBytes(kindData, 0, 0, p1)...), packetBytes(kindClose, 1, 4, nil)...)
	for _, seal := range []uint8{0, 1, 3} {
		f.Add(seal, good)
		f.Add(seal, append(append([]byte(nil), good...), second...))
		f.Add(seal, append(append(append([]byte(nil), good...), second...), bad...))
		f.Add(seal, append(append([]byte(nil), good...), mustHeader(f, &Header{Pipeline: 1, Block: BlockID{1, 4}, PacketSize: 64, Route: []Target{{ID: 9, Addr: "x:1"}}})...))
		f.Add(seal, append(append([]byte(nil), hdr...), packetBytes(kindClose, 0, 100, nil)...))
		f.Add(seal, bad)
		f.Add(seal, append(append([]byte(nil), hdr...), packetBytes(kindData, 0, 100, make([]byte, 65))...)) // over the packet size
		f.Add(seal, mustHeader(f, &Header{Pipeline: 1, Block: BlockID{1, 2}, PacketSize: 64, Route: []Target{{ID: 9, Addr: "x:1"}}}))
	}

	be := &memBackend{}
	srv := NewServer(ServerConfig{ID: 1, Backend: be, Timeout: 2 * time.Second, IdleTimeout: 2 * time.Second})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	go srv.Serve(lis)
	f.Cleanup(func() { srv.Close() })

	f.Fuzz(func(t *testing.T, seal uint8, data []byte) {
		if seal&1 != 0 {
			data = bytes.Clone(data)
			sealConn(data, seal&2 != 0)
		}
		be.mu.Lock()
		be.sinks, be.hdrs = nil, nil
		be.mu.Unlock()
		c, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		go func() {
			c.Write(data)
			c.(*net.TCPConn).CloseWrite()
		}()
		var acks []ack
		for {
			var b [ackLen]byte
			var a ack
			err := readAck(c, &b, &a)
			if err != nil {
				if errors.Is(err, errBadAck) {
					t.Fatalf("server sent a malformed ack after %d acks: %v", len(acks), err)
				}
				if !isConnErr(err) && !errors.Is(err, net.ErrClosed) && !isReset(err) {
					t.Fatalf("reading acks: %v (a stalled server?)", err)
				}
				break
			}
			acks = append(acks, a)
			if a.kind == kindError {
				break
			}
		}
		be.mu.Lock()
		sinks, hdrs := be.sinks, be.hdrs
		be.mu.Unlock()
		// The acks of stream i: those after the close ack of stream i-1.
		var groups [][]ack
		for i, a := range acks {
			if i == 0 || acks[i-1].kind == kindCloseAck {
				groups = append(groups, nil)
			}
			groups[len(groups)-1] = append(groups[len(groups)-1], a)
		}
		if len(groups) > len(sinks)+1 || len(sinks) > len(groups) {
			t.Fatalf("%d streams opened, acks for %d", len(sinks), len(groups))
		}
		sent := sentPayloads(data)
		for i, g := range groups {
			if i == len(sinks) {
				// A stream the backend never opened: refused.
				for _, a := range g {
					if a.kind != kindError {
						t.Fatalf("ack %+v for a stream the backend never opened", a)
					}
				}
				continue
			}
			if i < len(groups)-1 && g[len(g)-1].kind != kindCloseAck {
				t.Fatalf("stream %d ended with ack %+v, yet another followed", i, g[len(g)-1])
			}
			s, h := sinks[i], hdrs[i]
			s.mu.Lock()
			if i >= len(sent) || !bytes.HasPrefix(sent[i], s.data) {
				t.Fatalf("stream %d stored %q, but the client sent %q", i, s.data, sent)
			}
			for j, a := range g {
				switch a.kind {
				case kindHeaderAck:
					if j != 0 || a.value != h.Offset {
						t.Fatalf("stream %d: header ack %+v at %d", i, a, j)
					}
				case kindDataAck:
					if a.value < h.Offset || a.value-h.Offset > uint64(len(s.data)) {
						t.Fatalf("stream %d: data ack up to %d, but %d bytes from %d stored", i, a.value, len(s.data), h.Offset)
					}
				case kindCloseAck:
					if !s.closed || s.abortd || a.value != h.Offset+uint64(len(s.data)) {
						t.Fatalf("stream %d: close ack at %d with sink closed %v aborted %v holding %d bytes from %d", i, a.value, s.closed, s.abortd, len(s.data), h.Offset)
					}
				case kindError:
					if !s.abortd {
						t.Fatalf("stream %d failed (%s: %s) but its data was kept", i, a.code, a.reason)
					}
				}
			}
			s.mu.Unlock()
		}
		if len(sinks) > len(groups) {
			t.Fatalf("stream %d opened without an ack", len(groups))
		}
	})
}

func isReset(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe)
}

// FuzzRecords feeds a secured datanode's record decoder (record.go)
// arbitrary bytes: packet headers through control records, payloads
// through payload records opened in place, lengths bounded before
// anything is read for them. Random bytes never authenticate, so with
// seal set the harness reads the input as plaintext chunks (kind u8 |
// length u16 | bytes) and seals each into a record with the receiver's
// keys and counters first (a 32-byte control chunk gets its packet
// header CRC fixed): the fuzzer then reaches the checks behind the
// authentication (kinds, lengths, header binding, the packet decoder).
//
// It checks, besides not panicking: what the decoder accepts (headers and
// opened payloads, in order) is a prefix of what was sealed (with seal
// unset: of the seeds' stream, the only records that authenticate under
// its keys); every failure is a refused record (errRecord) or the input's
// end, and sticks; and each accepted packet, forwarded as a datanode
// does (forwardPacket: the payload record as it came, a CLOSE as its
// header alone), decodes downstream to the same packet, with nothing on
// the wire after the CLOSE.
//
//	go test -run '^$' -fuzz '^FuzzRecords$' -fuzztime 2m ./internal/stream
func FuzzRecords(f *testing.F) {
	seedPlain := recordPlain(recordSeedPackets)
	for _, seal := range []bool{false, true} {
		f.Add(seal, recordSeed(f, seal, recordSeedPackets))
		f.Add(seal, recordSeed(f, seal, recordSeedPackets)[:40])
	}
	f.Fuzz(func(t *testing.T, seal bool, data []byte) {
		wire, want := data, seedPlain
		if seal {
			wire, want = sealChunks(t, data)
		}
		_, _, rcv := memRecords(t)
		r := rcv(wire)
		fwd, fwire, frcv := memRecords(t)
		type pkt struct{ hdr, payload []byte }
		var got []byte
		var pkts []pkt
		closed := false
		refused := func(err error) {
			if !errors.Is(err, errRecord) && err != io.EOF && err != io.ErrUnexpectedEOF {
				t.Fatalf("decoder failed with %v (%T): neither a refused record nor the input's end", err, err)
			}
			if _, err2 := r.Read(make([]byte, 1)); err2 == nil {
				t.Fatalf("a read after the failure %v succeeded", err)
			}
		}
		for range 64 {
			var hb [packetHeaderLen]byte
			if _, err := io.ReadFull(r, hb[:]); err != nil {
				refused(err)
				break
			}
			got = append(got, hb[:]...)
			var ph packetHeader
			if err := ph.decode(&hb); err != nil || (ph.kind != kindData && ph.kind != kindClose) || ph.length > 64<<10 {
				break // what readLoop refuses before reading a payload
			}
			if ph.kind == kindClose {
				if err := fwd.forwardPacket(hb[:], nil); err != nil {
					t.Fatal(err)
				}
				pkts = append(pkts, pkt{hdr: hb[:]})
				closed = true
				break
			}
			buf := make([]byte, ph.length, int(ph.length)+tagLen)
			if err := r.readSealed(buf); err != nil {
				refused(err)
				break
			}
			sealed := append([]byte(nil), buf[:len(buf)+tagLen]...)
			if err := r.openPayload(hb[:], buf); err != nil {
				refused(err)
				break
			}
			got = append(got, buf...)
			if err := fwd.forwardPacket(hb[:], sealed); err != nil {
				t.Fatal(err)
			}
			pkts = append(pkts, pkt{hb[:], append([]byte(nil), buf...)})
			if seal && crc32c(buf) != ph.crc {
				break
			}
		}
		if !bytes.HasPrefix(want, got) {
			t.Fatalf("the decoder accepted %d bytes that were not sealed so (sealed %d)", len(got), len(want))
		}
		// Downstream of the forwarding hop: the same packets, then nothing.
		fw := bytes.NewReader(fwire.Bytes())
		d := frcv(nil)
		d.r = fw
		for i, p := range pkts {
			var hb [packetHeaderLen]byte
			if _, err := io.ReadFull(d, hb[:]); err != nil || !bytes.Equal(hb[:], p.hdr) {
				t.Fatalf("forwarded packet %d header: %v", i, err)
			}
			if p.payload == nil {
				continue
			}
			buf := make([]byte, len(p.payload), len(p.payload)+tagLen)
			if err := d.readPayload(hb[:], buf); err != nil || !bytes.Equal(buf, p.payload) {
				t.Fatalf("forwarded packet %d payload: %v", i, err)
			}
		}
		if closed && fw.Len() != 0 {
			t.Fatalf("%d bytes on the wire after the forwarded CLOSE", fw.Len())
		}
	})
}

// recordSeedPackets is how many data packets the seeds carry before
// their CLOSE.
const recordSeedPackets = 3

// recordSeedPacket is data packet i of the seeds' stream (or, i == n,
// its CLOSE): header and payload.
func recordSeedPacket(i, n int) (hdr, p []byte) {
	// (The offsets are not the payloads' sums: the records stay those of
	// the first seeds, which the fuzz cache's inputs were made from.)
	if i == n {
		var b [packetHeaderLen]byte
		(&packetHeader{kind: kindClose, seq: uint64(n), offset: uint64(n * 100)}).encode(&b)
		return b[:], nil
	}
	p = bytes.Repeat([]byte{byte('a' + i)}, 100+i)
	return packetBytes(kindData, uint64(i), uint64(i*100), p)[:packetHeaderLen], p
}

// recordPlain is the plaintext of the seeds' stream of n data packets and
// a CLOSE, in record order.
func recordPlain(n int) []byte {
	var out []byte
	for i := range n + 1 {
		h, p := recordSeedPacket(i, n)
		out = append(append(out, h...), p...)
	}
	return out
}

// recordSeed is n data packets and a CLOSE of a secured stream, on the
// wire (seal false) or as the plaintext chunks sealChunks takes (seal
// true).
func recordSeed(tb testing.TB, seal bool, n int) []byte {
	var out []byte
	chunk := func(kind byte, p []byte) {
		out = append(out, kind)
		out = binary.BigEndian.AppendUint16(out, uint16(len(p)))
		out = append(out, p...)
	}
	var wire bytes.Buffer
	k1, k2, kp := bytes.Repeat([]byte{1}, 16), bytes.Repeat([]byte{2}, 16), bytes.Repeat([]byte{3}, 16)
	snd, err := newRecordConn(nil, k1, k2, kp)
	if err != nil {
		tb.Fatal(err)
	}
	snd.w = &wire
	for i := range n + 1 {
		h, p := recordSeedPacket(i, n)
		if seal {
			chunk(recControl, h)
			if p != nil {
				chunk(recPayload, p)
			}
		} else if err := snd.writePacket(h, p, make([]byte, 0, len(p)+tagLen)); err != nil {
			tb.Fatal(err)
		}
	}
	if seal {
		return out
	}
	return wire.Bytes()
}

// sealChunks seals plaintext chunks (kind u8 | length u16 | bytes) into
// the records memRecords' receivers expect: control records under the
// control key and counter (a 32-byte one with its packet header CRC
// fixed), anything else under the payload key and counter, bound to the
// last control chunk (as a packet header) and keeping the chunk's kind
// byte, even an invalid one. It returns the records and the plaintext
// sealed, in order.
func sealChunks(t *testing.T, data []byte) (wire, plain []byte) {
	snd, _, _ := memRecords(t)
	var out, last []byte
	for len(data) >= 3 {
		kind, n := data[0], int(binary.BigEndian.Uint16(data[1:]))
		data = data[3:]
		n = min(n, len(data))
		p := data[:n]
		data = data[n:]
		var h [recHeaderLen]byte
		putRecHeader(h[:], kind, n+tagLen)
		if kind == recControl {
			if n == packetHeaderLen {
				p = append([]byte(nil), p...)
				sealPacket(p)
			}
			nonce, err := snd.out.next(n)
			if err != nil {
				return out, plain
			}
			out = append(out, h[:]...)
			out = snd.out.aead.Seal(out, nonce, p, h[:])
			plain = append(plain, p...)
			last = append(last[:0], p...)
			continue
		}
		nonce, err := snd.pay.next(n)
		if err != nil {
			return out, plain
		}
		ad := append(h[:], make([]byte, packetHeaderLen)...)
		copy(ad[recHeaderLen:], last)
		out = append(out, h[:]...)
		out = snd.pay.aead.Seal(out, nonce, p, ad)
		plain = append(plain, p...)
	}
	return out, plain
}

// TestRecordSeeds: FuzzRecords' seeds decode in full, both ways, so the
// fuzzer starts from inputs that reach the end of the decoder (the
// CLOSE). With BASALT_WRITE_SEEDS=1 it also (re)writes them to
// testdata/fuzz.
func TestRecordSeeds(t *testing.T) {
	for i, seal := range []bool{false, true} {
		wire := recordSeed(t, seal, recordSeedPackets)
		var plain []byte
		if seal {
			wire, plain = sealChunks(t, wire)
			if !bytes.Equal(plain, recordPlain(recordSeedPackets)) {
				t.Fatalf("seed %d: sealChunks' plaintext differs from the stream's", i)
			}
		}
		_, _, rcv := memRecords(t)
		r := rcv(wire)
		for k := range recordSeedPackets {
			if _, err := readPacket(r, 100+k); err != nil {
				t.Fatalf("seed %d (seal %v), packet %d: %v", i, seal, k, err)
			}
		}
		var hb [packetHeaderLen]byte
		var ph packetHeader
		if _, err := io.ReadFull(r, hb[:]); err != nil || ph.decode(&hb) != nil || ph.kind != kindClose {
			t.Fatalf("seed %d (seal %v): no CLOSE at the end: %v", i, seal, err)
		}
		if os.Getenv("BASALT_WRITE_SEEDS") == "1" {
			body := fmt.Sprintf("go test fuzz v1\nbool(%v)\n[]byte(%q)\n", seal, recordSeed(t, seal, recordSeedPackets))
			if err := os.WriteFile(filepath.Join("testdata", "fuzz", "FuzzRecords", fmt.Sprintf("seed-%d", i)), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}
