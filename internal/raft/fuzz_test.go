package raft

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// overflowApp is the body of a frame whose one MsgApp entry claims
// 2^64-1 bytes of padding and 1 byte of data: pad+l wraps to 0, which
// passed the old bounds check and panicked the reader (issue 11,
// scenario 5).
func overflowApp() []byte {
	b := []byte{1, 1, itemApp, 0, 0, 0, 0, 1} // 1 item, group 1, MsgApp, term..commit 0, 1 entry
	b = append(b, 1, 1, 0, 1)                 // term, index, type, len(data)=1
	b = binary.AppendUvarint(b, ^uint64(0))   // pad
	return append(b, 'x')
}

// wireFrame puts a body into a frame with a correct header.
func wireFrame(body []byte) []byte {
	var hdr [frameHeaderLen]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(body)))
	binary.BigEndian.PutUint32(hdr[4:], crc32.Checksum(body, castagnoli))
	return append(hdr[:], body...)
}

func TestDecodeAppOverflowIsAnError(t *testing.T) {
	body := overflowApp()
	if len(body)+4 > 30 { // with the old 4-byte header: the 30-byte frame of the issue
		t.Fatalf("body of %d bytes", len(body))
	}
	for _, alias := range []bool{false, true} {
		if _, err := decodeBatch(body, 1, 2, alias); err == nil {
			t.Fatal("decoded a MsgApp whose padding overflows")
		}
	}
	if _, err := decodeFrame(wireFrame(body), 1, 2, 1<<20); err == nil {
		t.Fatal("decoded the frame")
	}
}

// A count that the remaining bytes cannot hold must not size an allocation.
func TestDecodeCountsBoundedByBytes(t *testing.T) {
	body := []byte{1, 1, itemApp, 0, 0, 0, 0}
	body = binary.AppendUvarint(body, maxBatchMsgs*64)
	res := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			decodeBatch(body, 1, 2, false)
		}
	})
	if _, err := decodeBatch(body, 1, 2, false); err == nil {
		t.Fatal("decoded a MsgApp with more entries than bytes")
	}
	var big bytes.Buffer
	big.Write(binary.AppendUvarint(nil, maxBatchMsgs))
	if _, err := decodeBatch(big.Bytes(), 1, 2, false); err == nil {
		t.Fatal("decoded a batch with more items than bytes")
	}
	if per := res.AllocedBytesPerOp(); per > 4096 {
		t.Fatalf("%d bytes allocated decoding a lying count", per)
	}
}

func TestFrameChecksumAndLimit(t *testing.T) {
	var f frameWriter
	hb := pb.MsgHeartbeat
	encodeBatch(&f, []Outgoing{{Group: 3, Msg: &pb.Message{Type: &hb, Term: proto.Uint64(4), Commit: proto.Uint64(9)}}, {Group: 4, Applied: 7}})
	segs, _ := f.finish()
	var wire []byte
	for _, s := range segs {
		wire = append(wire, s...)
	}
	if out, err := decodeFrame(wire, 1, 2, 1<<20); err != nil || len(out) != 2 || out[0].Msg.GetCommit() != 9 || out[1].Applied != 7 {
		t.Fatalf("good frame: %v %v", out, err)
	}
	for i := frameHeaderLen; i < len(wire); i++ {
		bad := append([]byte(nil), wire...)
		bad[i] ^= 0x40
		var fe *frameError
		if _, err := decodeFrame(bad, 1, 2, 1<<20); !errors.As(err, &fe) {
			t.Fatalf("flipped bit in byte %d: err = %v, want a checksum error", i, err)
		}
	}
	if _, err := decodeFrame(wire, 1, 2, len(wire)-frameHeaderLen-1); err == nil {
		t.Fatal("frame over the limit accepted")
	}
}

// A header announcing a huge frame costs at most frameReadStep of memory
// until the bytes arrive.
func TestFrameHeaderAloneAllocatesLittle(t *testing.T) {
	var hdr [frameHeaderLen]byte
	binary.BigEndian.PutUint32(hdr[:], 100<<20)
	allocs := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			readFrame(&sliceReader{b: hdr[:]}, nil, 128<<20)
		}
	})
	if per := allocs.AllocedBytesPerOp(); per > 2*frameReadStep {
		t.Fatalf("%d bytes allocated for a header alone", per)
	}
}

func seedFrames() [][]byte {
	var out [][]byte
	add := func(msgs []Outgoing) {
		var f frameWriter
		encodeBatch(&f, msgs)
		segs, _ := f.finish()
		var wire []byte
		for _, s := range segs {
			wire = append(wire, s...)
		}
		out = append(out, wire)
	}
	hb, hbr, app, vote := pb.MsgHeartbeat, pb.MsgHeartbeatResp, pb.MsgApp, pb.MsgVote
	typ := pb.EntryNormal
	ents := []*pb.Entry{
		{Term: proto.Uint64(2), Index: proto.Uint64(5), Type: &typ, Data: encodeProposal(proposalID{1, 2}, []byte("meta"), []byte("data"), true)},
		{Term: proto.Uint64(2), Index: proto.Uint64(6), Type: &typ, Data: encodeProposal(proposalID{1, 3}, []byte("m"), nil, false)},
		{Term: proto.Uint64(2), Index: proto.Uint64(7), Type: &typ},
	}
	add([]Outgoing{{Group: 1, Msg: &pb.Message{Type: &hb, Term: proto.Uint64(3), Commit: proto.Uint64(4), Context: []byte("c")}}})
	add([]Outgoing{{Group: 1, Msg: &pb.Message{Type: &hbr, Term: proto.Uint64(3)}}, {Group: 2, Applied: 10}})
	add([]Outgoing{{Group: 9, Msg: &pb.Message{Type: &app, Term: proto.Uint64(2), LogTerm: proto.Uint64(2), Index: proto.Uint64(4), Commit: proto.Uint64(4), Entries: ents}}})
	add([]Outgoing{{Group: 9, Msg: &pb.Message{Type: &vote, To: proto.Uint64(2), From: proto.Uint64(1), Term: proto.Uint64(5), LogTerm: proto.Uint64(4), Index: proto.Uint64(9)}}})
	out = append(out, wireFrame(overflowApp()))
	return out
}

func FuzzDecodeFrame(f *testing.F) {
	for _, s := range seedFrames() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, wire []byte) {
		msgs, err := decodeFrame(wire, 1, 2, 1<<20)
		if err != nil {
			return
		}
		// What decodes re-encodes into a frame that decodes the same way.
		var fw frameWriter
		encodeBatch(&fw, msgs)
		segs, _ := fw.finish()
		var again []byte
		for _, s := range segs {
			again = append(again, s...)
		}
		msgs2, err := decodeFrame(again, 1, 2, 1<<21)
		if err != nil || len(msgs2) != len(msgs) {
			t.Fatalf("re-encoded frame: %d messages, err %v (first decode: %d)", len(msgs2), err, len(msgs))
		}
	})
}

func FuzzDecodeApp(f *testing.F) {
	for _, s := range seedFrames() {
		// The MsgApp item starts after count, group and kind.
		if len(s) > frameHeaderLen+3 && s[frameHeaderLen+2] == itemApp {
			f.Add(s[frameHeaderLen+3:], true)
			f.Add(s[frameHeaderLen+3:], false)
		}
	}
	f.Add(overflowApp()[3:], false)
	f.Fuzz(func(t *testing.T, b []byte, alias bool) {
		m, rest, err := decodeApp(b, 1, 2, alias)
		if err != nil {
			return
		}
		if len(rest) > len(b) || m.GetType() != pb.MsgApp {
			t.Fatalf("rest %d of %d bytes, type %v", len(rest), len(b), m.GetType())
		}
		for _, e := range m.GetEntries() {
			if len(e.GetData()) > len(b) {
				t.Fatalf("entry of %d bytes from %d", len(e.GetData()), len(b))
			}
		}
	})
}

func FuzzDecodeEntryData(f *testing.F) {
	f.Add(encodeProposal(proposalID{1, 2}, []byte("meta"), []byte("data"), true))
	f.Add(encodeProposal(proposalID{1, 2}, []byte("meta"), nil, false))
	f.Add(encodeLocal(proposalID{3, 4}, []byte("m"), 1<<20))
	full := encodeProposal(proposalID{5, 6}, []byte("mm"), []byte("dd"), true)
	d, _ := decodeEntryData(full)
	f.Add(elide(full, d))
	f.Add(markLost(elide(full, d)))
	f.Add([]byte{fmtData})
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeEntryData(b)
		if err != nil {
			return
		}
		if len(e.meta) > len(b) || (e.format == fmtData && uint64(len(e.data)) != e.dataLen) {
			t.Fatalf("decoded meta %d / data %d (dataLen %d) from %d bytes", len(e.meta), len(e.data), e.dataLen, len(b))
		}
		if e.format != fmtData {
			return
		}
		// The forms derived from it decode to the same metadata and length.
		el, err := decodeEntryData(elide(b, e))
		if err != nil || el.format != fmtElided || !bytes.Equal(el.meta, e.meta) || el.dataLen != e.dataLen || el.id != e.id {
			t.Fatalf("elided form: %+v, %v", el, err)
		}
		hp := append(hydratePrefix(b, e), e.data...)
		hd, err := decodeEntryData(hp)
		if err != nil || !bytes.Equal(hd.data, e.data) || !bytes.Equal(hd.meta, e.meta) {
			t.Fatalf("hydrated form: %+v, %v", hd, err)
		}
	})
}

type panicHandler struct{}

func (panicHandler) HandleMessages(from uint64, msgs []Outgoing) { panic("test: handler bug") }
func (panicHandler) HandleSnapshot(from, group uint64, m *pb.Message, body io.Reader) error {
	return nil
}
func (panicHandler) Unreachable(id uint64) {}

type nopHandler struct{}

func (nopHandler) HandleMessages(from uint64, msgs []Outgoing) {}
func (nopHandler) HandleSnapshot(from, group uint64, m *pb.Message, body io.Reader) error {
	return nil
}
func (nopHandler) Unreachable(id uint64) {}

// A panic on a transport's reader goroutine closes that connection, is
// logged and counted, and does not take the process down.
func TestTCPReaderRecoversPanic(t *testing.T) {
	mb := newMetrics(2, nil)
	b, err := NewTCPTransport(TCPConfig{ID: 2, Resolve: func(uint64) (string, error) { return "", errors.New("no") }, Logger: testLogger(), Metrics: mb})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	b.Start(panicHandler{})
	a, err := NewTCPTransport(TCPConfig{ID: 1, Resolve: func(uint64) (string, error) { return b.Addr(), nil }, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	a.Start(nopHandler{})
	a.Send(2, []Outgoing{{Group: 1, Applied: 5}})
	waitFor(t, "the reader's panic to be recovered", func() bool { return testCounter(mb.readerPanics) == 1 })
}

// Snapshot chunks carry a CRC32C too: a corrupted chunk fails the read
// (so Restore fails and keeps the old state) instead of restoring garbage.
func TestSnapshotChunkChecksum(t *testing.T) {
	data := []byte("snapshot state")
	stream := func(flip bool) []byte {
		var b []byte
		b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
		d := append([]byte(nil), data...)
		sum := crc32.Checksum(d, castagnoli)
		if flip {
			d[3] ^= 1
		}
		b = append(b, d...)
		b = binary.BigEndian.AppendUint32(b, sum)
		return binary.BigEndian.AppendUint32(b, 0)
	}
	got, err := io.ReadAll(&chunkReader{r: bufio.NewReader(bytes.NewReader(stream(false)))})
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("good stream: %q, %v", got, err)
	}
	if _, err := io.ReadAll(&chunkReader{r: bufio.NewReader(bytes.NewReader(stream(true)))}); err == nil {
		t.Fatal("corrupted chunk read without error")
	}
}

// Entry payload forms that never leave their host are refused on arrival
// (a follower given fmtLocal would stop its group).
func TestDecodeAppRefusesLocalForms(t *testing.T) {
	for _, payload := range [][]byte{
		encodeLocal(proposalID{1, 1}, []byte("m"), 5),
		elide(encodeProposal(proposalID{1, 1}, []byte("m"), []byte("data"), true), decodedEntry{meta: []byte("m"), dataLen: 4}),
	} {
		b := []byte{0, 0, 0, 0, 1, 1, 1, 0}
		b = binary.AppendUvarint(b, uint64(len(payload)))
		b = append(b, 0)
		b = append(b, payload...)
		if _, _, err := decodeApp(b, 1, 2, false); err == nil {
			t.Fatalf("accepted an entry in format %d", payload[0])
		}
	}
}
