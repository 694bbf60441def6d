package raft

import (
	"bytes"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// TestDecodeAppAllocs bounds a follower's allocations per MsgApp: the
// entries, their numbers and types are three slabs, not five allocations
// per entry (issue 15: every small write's entry is decoded on two
// followers) and small frames copy their entries' data into one buffer.
// 32 entries of 4 KiB: 16 allocations (before: 140).
func TestDecodeAppAllocs(t *testing.T) {
	typ, et := pb.MsgApp, pb.EntryNormal
	m := &pb.Message{Type: &typ, From: proto.Uint64(1), To: proto.Uint64(2), Term: proto.Uint64(3),
		LogTerm: proto.Uint64(3), Index: proto.Uint64(100), Commit: proto.Uint64(99)}
	for i := range 32 {
		m.Entries = append(m.Entries, &pb.Entry{Term: proto.Uint64(3), Index: proto.Uint64(uint64(101 + i)), Type: &et,
			Data: encodeProposal(proposalID{1, uint64(i)}, []byte("meta"), bytes.Repeat([]byte{byte(i)}, 4096), true)})
	}
	var fw frameWriter
	encodeBatch(&fw, []Outgoing{{Group: 7, Msg: m}})
	segs, _ := fw.finish()
	var wire []byte
	for _, s := range segs {
		wire = append(wire, s...)
	}
	var got []Outgoing
	decode := func() {
		var err error
		if got, err = decodeFrame(wire, 1, 2, 1<<21); err != nil {
			t.Fatal(err)
		}
	}
	decode()
	if len(got) != 1 || len(got[0].Msg.GetEntries()) != 32 {
		t.Fatalf("decoded %+v", got)
	}
	for i, e := range got[0].Msg.GetEntries() {
		if e.GetIndex() != uint64(101+i) || e.GetTerm() != 3 || e.GetType() != pb.EntryNormal || !bytes.Equal(e.GetData(), m.Entries[i].GetData()) {
			t.Fatalf("entry %d decoded as %v/%v/%v, %d bytes", i, e.GetIndex(), e.GetTerm(), e.GetType(), len(e.GetData()))
		}
	}
	const most = 18
	if n := testing.AllocsPerRun(50, decode); n > most {
		t.Errorf("%.0f allocations to decode a MsgApp of 32 entries; want at most %d", n, most)
	} else {
		t.Logf("%.0f allocations to decode a MsgApp of 32 entries", n)
	}
}
