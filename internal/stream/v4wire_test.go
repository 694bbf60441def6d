package stream

import (
	"bytes"
	"crypto/tls"
	"encoding/hex"
	"reflect"
	"testing"
)

// Protocol 4 is what the previous release (c47dba2, the last commit
// before version 5) speaks, and this release must keep speaking it to
// that binary's datanodes and clients. The "old peers" of
// version_test.go run this package's own v4 code, so a change to v4 on
// both sides would pass them and break the real old binary. The values
// below were produced by c47dba2's internal/stream (its encodeHeader,
// packetHeader.encode, ack.encode, recordConn and exporter labels, run
// unchanged in a scratch copy); they pin v4 on the wire independently of
// this package's code. Never regenerate them from this package.
const (
	// v4GoldenHeader: c47dba2's encodeHeader of v4GoldenHeaderValue().
	v4GoldenHeader = "425354520401008501020304050607080000000000000007112233445566778800000000000010000010000000020000000000000002000d31302e302e302e323a3938363600000000000000030010646e332e6578616d706c653a39383636000b746f6b656e2d627974657320a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a520d83425"
	// v4GoldenHeaderMin: a client's header (hop 0, no route, no token,
	// no payload key).
	v4GoldenHeaderMin = "4253545204000029000000000000000900000000000000010000000000000002000000000000000000010000000000000044c1d626"
	v4GoldenPacket    = "020000000001000000000000000000030000000000030000deadbeef93155676"
	v4GoldenClose     = "0300000000000000000000000000000400000000000400000000000072b30881"
	v4GoldenHeaderAck = "810000008427bb43000000000000000000000000000010000000000000000000"
	v4GoldenDataAck   = "82000000f94b4a05000000000000000300000000000400000000000000000000"
	// v4GoldenRefusal: the old datanode's error ack to a version 5
	// header (CodeBadHeader, naming datanode 2), what Refused recognises.
	v4GoldenRefusal = "ff010034248333180000000000000000000000000000000000000000000000026261642073747265616d206865616465723a2076657273696f6e20352c207468697320646174616e6f646520737065616b732034"
	// v4GoldenRecPacket, v4GoldenRecControl: with send key 16×01, receive
	// key 16×02 and payload key 16×03, a data packet (its header as a
	// control record, then the payload record) and then a close ack as
	// the next control record.
	v4GoldenRecPacket  = "0100000000000030f1345273269503389835fef307c4919d3e6e4a237a69cb7b5087952584a724ddddf1464faab86422d1b9a0233c21e13502000000000000211f400d1aeb65035a5a4101980e1a9bdbb433611064b52b8c149a115332b0b382b1"
	v4GoldenRecControl = "0100000000000030d72c6f1206ebb8aabee4f26dc1500fa999a2891a68518003b02a1ae5b260de383dc5ac02621067773242f2fb7bba4721"

	// The previous release's exporter labels (c47dba2 record.go), as
	// literals: a record key or payload key exported under any other
	// label does not interoperate with it.
	v4LabelOpenerToAcceptor = "EXPORTER-basalt-stream-v4 opener to acceptor"
	v4LabelAcceptorToOpener = "EXPORTER-basalt-stream-v4 acceptor to opener"
	v4LabelPayload          = "EXPORTER-basalt-stream-v4 payload"
)

func v4GoldenHeaderValue() *Header {
	return &Header{Hop: 1, Pipeline: 0x0102030405060708, Block: BlockID{7, 0x1122334455667788}, Offset: 4096, PacketSize: 1 << 20,
		Route: []Target{{ID: 2, Addr: "10.0.0.2:9866"}, {ID: 3, Addr: "dn3.example:9866"}},
		Token: []byte("token-bytes"), payloadKey: bytes.Repeat([]byte{0xa5}, 32)}
}

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestV4HeaderGolden: a version 4 header encodes byte for byte as the
// previous release's encodeHeader did, and its bytes decode to the same
// header, marked version 4.
func TestV4HeaderGolden(t *testing.T) {
	for _, c := range []struct {
		golden string
		h      *Header
	}{
		{v4GoldenHeader, v4GoldenHeaderValue()},
		{v4GoldenHeaderMin, &Header{Pipeline: 9, Block: BlockID{1, 2}, PacketSize: 65536}},
	} {
		want := unhex(t, c.golden)
		c.h.version = 4
		got, err := encodeHeader(nil, c.h)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("version 4 header\n got %x\nwant %x (c47dba2)", got, want)
		}
		for _, only := range []uint8{0, 4} {
			h, err := readHeaderOf(bytes.NewReader(want), only)
			if err != nil {
				t.Fatalf("the previous release's header refused (only %d): %v", only, err)
			}
			if h.Version() != 4 || !reflect.DeepEqual(h, c.h) {
				t.Fatalf("decoded %+v, want %+v", h, c.h)
			}
		}
	}
}

// TestV4FramesGolden: packet headers and acks, which versions 4 and 5
// share, are what the previous release sends and reads, and so is its
// refusal of a version 5 header, which Refused must recognise.
func TestV4FramesGolden(t *testing.T) {
	var pb [packetHeaderLen]byte
	for _, c := range []struct {
		golden string
		p      packetHeader
	}{
		{v4GoldenPacket, packetHeader{kind: kindData, length: 65536, seq: 3, offset: 3 * 65536, crc: 0xdeadbeef}},
		{v4GoldenClose, packetHeader{kind: kindClose, seq: 4, offset: 4 * 65536}},
	} {
		c.p.encode(&pb)
		if want := unhex(t, c.golden); !bytes.Equal(pb[:], want) {
			t.Fatalf("packet header %+v\n got %x\nwant %x (c47dba2)", c.p, pb, want)
		}
		var back packetHeader
		if err := back.decode(&pb); err != nil || back != c.p {
			t.Fatalf("packet header decoded as %+v, %v", back, err)
		}
	}
	var ab [ackLen]byte
	for _, c := range []struct {
		golden string
		a      ack
	}{
		{v4GoldenHeaderAck, ack{kind: kindHeaderAck, value: 4096}},
		{v4GoldenDataAck, ack{kind: kindDataAck, seq: 3, value: 4 * 65536}},
		{v4GoldenRefusal, ack{kind: kindError, code: CodeBadHeader, dn: 2, reason: "bad stream header: version 5, this datanode speaks 4"}},
	} {
		want := unhex(t, c.golden)
		if got := c.a.encode(nil); !bytes.Equal(got, want) {
			t.Fatalf("ack %+v\n got %x\nwant %x (c47dba2)", c.a, got, want)
		}
		var back ack
		if err := readAck(bytes.NewReader(want), &ab, &back); err != nil || back != c.a {
			t.Fatalf("the previous release's ack read as %+v, %v", back, err)
		}
		if c.a.kind == kindError {
			if err := ackError(&back, []Target{{ID: 2, Addr: "dn2:1"}}); !Refused(err) {
				t.Fatalf("the previous release's refusal of version 5 (%v) not recognised by Refused", err)
			}
		}
	}
}

// TestV4RecordsGolden: records sealed with given keys are byte for byte
// the previous release's (the record layer is shared by versions 4 and
// 5; only the keys differ), and open as they did.
func TestV4RecordsGolden(t *testing.T) {
	snd, wire, rcv := memRecords(t)
	p := []byte("basalt v4 payload")
	var hb [packetHeaderLen]byte
	(&packetHeader{kind: kindData, length: uint32(len(p)), crc: crc32c(p)}).encode(&hb)
	if err := snd.writePacket(hb[:], p, make([]byte, 0, len(p)+tagLen)); err != nil {
		t.Fatal(err)
	}
	if want := unhex(t, v4GoldenRecPacket); !bytes.Equal(wire.Bytes(), want) {
		t.Fatalf("data packet records\n got %x\nwant %x (c47dba2)", wire.Bytes(), want)
	}
	wire.Reset()
	ca := ack{kind: kindCloseAck, value: 17}
	if _, err := snd.Write(ca.encode(nil)); err != nil {
		t.Fatal(err)
	}
	if want := unhex(t, v4GoldenRecControl); !bytes.Equal(wire.Bytes(), want) {
		t.Fatalf("control record\n got %x\nwant %x (c47dba2)", wire.Bytes(), want)
	}
	r := rcv(append(unhex(t, v4GoldenRecPacket), unhex(t, v4GoldenRecControl)...))
	if got, err := readPacket(r, len(p)); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("the previous release's packet records read as %q, %v", got, err)
	}
	var ab [ackLen]byte
	var a ack
	if err := readAck(r, &ab, &a); err != nil || a != ca {
		t.Fatalf("the previous release's control record read as %+v, %v", a, err)
	}
}

// TestV4KeysOnTLS13: on a real TLS 1.3 session, a version 4 stream's
// payload key is what the previous release exported (its label, no
// context), distinct from version 5's key of stream 0, and its record
// keys are exported under its labels in its directions: records of a
// connection switched at version 4 open with keys derived as the old
// code derived them, both ways.
func TestV4KeysOnTLS13(t *testing.T) {
	ctc, stc := tlsPair(t, nil)
	ccs, scs := ctc.ConnectionState(), stc.ConnectionState()
	n, err := recordKeyLen(&ccs)
	if err != nil {
		t.Fatal(err)
	}
	export := func(cs *tls.ConnectionState, label string) []byte {
		k, err := cs.ExportKeyingMaterial(label, nil, n)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	old := export(&ccs, v4LabelPayload)
	for _, cs := range []*tls.ConnectionState{&ccs, &scs} {
		k, err := payloadKeyV(cs, 0, 4)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(k, old) {
			t.Fatalf("version 4 payload key %x, the previous release exports %x", k, old)
		}
	}
	if v5, _ := payloadKey(&ccs, 0); bytes.Equal(v5, old) {
		t.Fatal("version 5's first payload key equals version 4's")
	}
	if _, err := payloadKeyV(&ccs, 1, 4); err == nil {
		t.Fatal("a version 4 payload key for a second stream")
	}

	// Both ends switch at version 4 as this package does; their peers
	// are built from keys exported under the old labels directly.
	oa, ao := export(&scs, v4LabelOpenerToAcceptor), export(&scs, v4LabelAcceptorToOpener)
	opener, err := switchToRecordsV(ctc, true, old, 4)
	if err != nil {
		t.Fatal(err)
	}
	acceptor, err := switchToRecordsV(stc, false, old, 4)
	if err != nil {
		t.Fatal(err)
	}
	oldAcceptor, err := newRecordConn(nil, ao, oa, old)
	if err != nil {
		t.Fatal(err)
	}
	oldOpener, err := newRecordConn(nil, oa, ao, old)
	if err != nil {
		t.Fatal(err)
	}
	// Payload goes opener to acceptor, acks the other way.
	p := []byte("payload to an old datanode")
	var hb [packetHeaderLen]byte
	(&packetHeader{kind: kindData, length: uint32(len(p)), crc: crc32c(p)}).encode(&hb)
	for _, c := range []struct {
		name     string
		snd, rcv *recordConn
	}{
		{"opener to old acceptor", opener, oldAcceptor},
		{"old opener to acceptor", oldOpener, acceptor},
	} {
		var wire bytes.Buffer
		c.snd.w = &wire
		if err := c.snd.writePacket(hb[:], p, make([]byte, 0, len(p)+tagLen)); err != nil {
			t.Fatal(err)
		}
		c.rcv.r = bytes.NewReader(wire.Bytes())
		if got, err := readPacket(c.rcv, len(p)); err != nil || !bytes.Equal(got, p) {
			t.Fatalf("%s: %q, %v", c.name, got, err)
		}
	}
	da := ack{kind: kindDataAck, value: uint64(len(p))}
	for _, c := range []struct {
		name     string
		snd, rcv *recordConn
	}{
		{"acceptor to old opener", acceptor, oldOpener},
		{"old acceptor to opener", oldAcceptor, opener},
	} {
		var wire bytes.Buffer
		c.snd.w = &wire
		if _, err := c.snd.Write(da.encode(nil)); err != nil {
			t.Fatal(err)
		}
		c.rcv.r = bytes.NewReader(wire.Bytes())
		var ab [ackLen]byte
		var a ack
		if err := readAck(c.rcv, &ab, &a); err != nil || a != da {
			t.Fatalf("%s: %+v, %v", c.name, a, err)
		}
	}
}
