package raft

import (
	"bytes"
	"encoding/binary"
	"math/rand"
	"testing"
	"unsafe"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

func TestFrameMsgAppRoundTripAligned(t *testing.T) {
	rnd := rand.New(rand.NewSource(1))
	for _, sizes := range [][]int{{10}, {bigEntry}, {5, 4 << 20, 7, 1 << 20, 100000}, {3 << 20, 3<<20 + 1}} {
		var ents []*pb.Entry
		var datas [][]byte
		for i, n := range sizes {
			data := make([]byte, n)
			rnd.Read(data)
			meta := make([]byte, rnd.Intn(300))
			rnd.Read(meta)
			typ := pb.EntryNormal
			ents = append(ents, &pb.Entry{Term: proto.Uint64(3), Index: proto.Uint64(uint64(10 + i)), Type: &typ,
				Data: encodeProposal(proposalID{1, uint64(i)}, meta, data, true)})
			datas = append(datas, data)
		}
		typ := pb.MsgApp
		m := &pb.Message{Type: &typ, To: proto.Uint64(2), From: proto.Uint64(1), Term: proto.Uint64(3),
			LogTerm: proto.Uint64(2), Index: proto.Uint64(9), Commit: proto.Uint64(8), Entries: ents}
		var f frameWriter
		encodeBatch(&f, []Outgoing{{Group: 7, Msg: m}, {Group: 8, Applied: 99}})
		segs, size := f.finish()
		var wire []byte
		for _, s := range segs {
			wire = append(wire, s...)
		}
		if len(wire) != size || int(binary.BigEndian.Uint32(wire)) != size-frameHeaderLen {
			t.Fatalf("frame size %d, segments hold %d, length prefix says %d", size, len(wire), binary.BigEndian.Uint32(wire))
		}
		body := alignedBuf(size - frameHeaderLen)
		copy(body, wire[frameHeaderLen:])
		out, err := decodeBatch(body, 1, 2, true)
		if err != nil {
			t.Fatal(err)
		}
		if len(out) != 2 || out[0].Group != 7 || out[1].Applied != 99 {
			t.Fatalf("decoded %+v", out)
		}
		got := out[0].Msg
		if got.GetTerm() != 3 || got.GetLogTerm() != 2 || got.GetIndex() != 9 || got.GetCommit() != 8 || len(got.GetEntries()) != len(ents) {
			t.Fatalf("decoded message %v", got)
		}
		for i, e := range got.GetEntries() {
			if !bytes.Equal(e.GetData(), ents[i].GetData()) || e.GetIndex() != ents[i].GetIndex() {
				t.Fatalf("entry %d differs", i)
			}
			d, err := decodeEntryData(e.GetData())
			if err != nil || !bytes.Equal(d.data, datas[i]) {
				t.Fatalf("entry %d payload: %v", i, err)
			}
			if len(d.data) >= bigEntry && uintptr(unsafe.Pointer(&d.data[0]))%frameAlign != 0 {
				t.Fatalf("entry %d: data of %d bytes not aligned after decode", i, len(d.data))
			}
		}
	}
}

func TestPadFor(t *testing.T) {
	for body := 0; body < 3*frameAlign; body += 7 {
		for _, off := range []int{18, 300, 5000} {
			p := padFor(body, off)
			if (body+uvarintLen(uint64(p))+p+off)%frameAlign != 0 || p < 0 || p >= 2*frameAlign {
				t.Fatalf("padFor(%d, %d) = %d", body, off, p)
			}
		}
	}
}

func TestFrameTailsAreJoinedAndAligned(t *testing.T) {
	rnd := rand.New(rand.NewSource(2))
	var ents []*pb.Entry
	var tails [][]byte
	var want [][]byte
	for i, n := range []int{100, 4 << 20, 70 << 10, 1} {
		meta := make([]byte, 1+rnd.Intn(200))
		data := make([]byte, n)
		rnd.Read(data)
		full := encodeProposal(proposalID{1, uint64(i)}, meta, data, true)
		d, _ := decodeEntryData(full)
		typ := pb.EntryNormal
		ents = append(ents, &pb.Entry{Term: proto.Uint64(1), Index: proto.Uint64(uint64(i + 1)), Type: &typ, Data: hydratePrefix(full, d)})
		tails = append(tails, data)
		want = append(want, full)
	}
	typ := pb.MsgApp
	m := &pb.Message{Type: &typ, Term: proto.Uint64(1), Entries: ents}
	var f frameWriter
	encodeBatch(&f, []Outgoing{{Group: 1, Msg: m, tails: tails}})
	segs, size := f.finish()
	body := alignedBuf(size - frameHeaderLen)
	n := 0
	for _, s := range segs {
		n += len(s)
	}
	var wire []byte
	for _, s := range segs {
		wire = append(wire, s...)
	}
	copy(body, wire[frameHeaderLen:])
	out, err := decodeBatch(body, 1, 2, true)
	if err != nil || n != size {
		t.Fatal(err, n, size)
	}
	for i, e := range out[0].Msg.GetEntries() {
		if !bytes.Equal(e.GetData(), want[i]) {
			t.Fatalf("entry %d: wire form differs from the full payload", i)
		}
		d, _ := decodeEntryData(e.GetData())
		if len(d.data) >= bigEntry && uintptr(unsafe.Pointer(&d.data[0]))%frameAlign != 0 {
			t.Fatalf("entry %d data not aligned", i)
		}
	}
}
