package raft

import (
	"bytes"
	"runtime"
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

// TestDecodeAppBytes: a frame carries the MsgApps of every group bound for
// a peer; decoding allocates about the frame's entry data once, not a copy
// buffer per message sized by the rest of the frame (40 messages of 4 KiB
// in one frame cost 3.8 MB per decode that way, 23 times the frame).
func TestDecodeAppBytes(t *testing.T) {
	typ, et := pb.MsgApp, pb.EntryNormal
	var out []Outgoing
	for g := range 40 {
		m := &pb.Message{Type: &typ, From: proto.Uint64(1), To: proto.Uint64(2), Term: proto.Uint64(3),
			LogTerm: proto.Uint64(3), Index: proto.Uint64(100), Commit: proto.Uint64(99)}
		m.Entries = append(m.Entries, &pb.Entry{Term: proto.Uint64(3), Index: proto.Uint64(101), Type: &et,
			Data: encodeProposal(proposalID{1, uint64(g)}, []byte("meta"), bytes.Repeat([]byte{byte(g)}, 4096), true)})
		out = append(out, Outgoing{Group: uint64(g + 1), Msg: m})
	}
	var fw frameWriter
	encodeBatch(&fw, out)
	segs, _ := fw.finish()
	var wire []byte
	for _, s := range segs {
		wire = append(wire, s...)
	}
	decode := func() {
		got, err := decodeFrame(wire, 1, 2, 1<<21)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 40 {
			t.Fatalf("decoded %d messages, want 40", len(got))
		}
		for i, o := range got {
			if !bytes.Equal(o.Msg.GetEntries()[0].GetData(), out[i].Msg.GetEntries()[0].GetData()) {
				t.Fatalf("message %d: entry data differs", i)
			}
		}
	}
	decode()
	var before, after runtime.MemStats
	const runs = 20
	runtime.ReadMemStats(&before)
	for range runs {
		decode()
	}
	runtime.ReadMemStats(&after)
	per := (after.TotalAlloc - before.TotalAlloc) / runs
	// readFrame's copy of the frame (dropped after the decode) plus one
	// copy of the entries' data and the entry structs: under 3 frames.
	if limit := uint64(3 * len(wire)); per > limit {
		t.Errorf("%d bytes allocated to decode a frame of %d bytes (40 MsgApps); want at most %d", per, len(wire), limit)
	} else {
		t.Logf("%d bytes allocated to decode a frame of %d bytes", per, len(wire))
	}
}
