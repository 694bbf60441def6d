package raft

import (
	"encoding/binary"
	"fmt"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// Layout of a normal entry's Data (and of a ConfChange's Context):
//
//	fmtPlain:  [1] host(8) seq(8) meta
//	fmtData:   [2] host(8) seq(8) uvarint(len meta) meta data
//	fmtElided: [3] host(8) seq(8) uvarint(len meta) meta uvarint(len data)
//
// host and seq identify the proposal so the proposing host can hand the
// state machine's result back to the caller. fmtData travels in memory and
// on the wire; fmtElided is what the log stores: the data went to the state
// machine (WriteData), and ReadData brings it back for a resend.
const (
	fmtPlain  = 1
	fmtData   = 2
	fmtElided = 3
	// fmtLost is fmtElided sent by a leader whose data was lost
	// (ReadData returned ErrDataLost).
	fmtLost = 4
	// fmtLocal is fmtElided on the proposing host, whose data waits in
	// Group.local until WriteData and the first sends: raft copies every
	// entry it appends (proto.Clone), so the bulk data stays beside the
	// entry instead of in it.
	fmtLocal = 5

	headerLen = 17
)

type proposalID struct {
	host, seq uint64
}

type decodedEntry struct {
	id      proposalID
	format  byte
	meta    []byte
	data    []byte // fmtData only
	dataLen uint64
}

func encodeProposal(id proposalID, meta, data []byte, hasData bool) []byte {
	if !hasData {
		b := make([]byte, headerLen+len(meta))
		b[0] = fmtPlain
		binary.BigEndian.PutUint64(b[1:], id.host)
		binary.BigEndian.PutUint64(b[9:], id.seq)
		copy(b[headerLen:], meta)
		return b
	}
	prefix := headerLen + uvarintLen(uint64(len(meta))) + len(meta)
	var b []byte
	if len(data) >= bigEntry {
		// Place the data at an aligned address: the leader's own WriteData
		// can then go to disk with O_DIRECT straight from it.
		raw := alignedBuf(prefix + len(data) + frameAlign)
		s := (frameAlign - prefix%frameAlign) % frameAlign
		b = raw[s : s+headerLen : s+prefix+len(data)]
	} else {
		b = make([]byte, headerLen, prefix+len(data))
	}
	b[0] = fmtData
	binary.BigEndian.PutUint64(b[1:], id.host)
	binary.BigEndian.PutUint64(b[9:], id.seq)
	b = binary.AppendUvarint(b, uint64(len(meta)))
	b = append(b, meta...)
	return append(b, data...)
}

func decodeEntryData(d []byte) (decodedEntry, error) {
	var e decodedEntry
	if len(d) < headerLen {
		return e, fmt.Errorf("raft: entry payload too short (%d bytes)", len(d))
	}
	e.format = d[0]
	e.id = proposalID{binary.BigEndian.Uint64(d[1:]), binary.BigEndian.Uint64(d[9:])}
	rest := d[headerLen:]
	switch e.format {
	case fmtPlain:
		e.meta = rest
		return e, nil
	case fmtData, fmtElided, fmtLost, fmtLocal:
		n, k := binary.Uvarint(rest)
		if k <= 0 || uint64(len(rest)-k) < n {
			return e, fmt.Errorf("raft: corrupt entry metadata length")
		}
		e.meta = rest[k : k+int(n)]
		rest = rest[k+int(n):]
		if e.format == fmtData {
			e.data = rest
			e.dataLen = uint64(len(rest))
			return e, nil
		}
		dl, k2 := binary.Uvarint(rest)
		if k2 <= 0 {
			return e, fmt.Errorf("raft: corrupt entry data length")
		}
		e.dataLen = dl
		return e, nil
	default:
		return e, fmt.Errorf("raft: unknown entry format %d", e.format)
	}
}

// elide turns a fmtData payload into its fmtElided form (metadata only).
func elide(d []byte, e decodedEntry) []byte {
	b := make([]byte, headerLen, headerLen+2*binary.MaxVarintLen64+len(e.meta))
	copy(b, d[:headerLen])
	b[0] = fmtElided
	b = binary.AppendUvarint(b, uint64(len(e.meta)))
	b = append(b, e.meta...)
	return binary.AppendUvarint(b, e.dataLen)
}

// encodeLocal is the payload of a proposal whose data stays beside it.
func encodeLocal(id proposalID, meta []byte, dataLen int) []byte {
	b := make([]byte, headerLen, headerLen+2*binary.MaxVarintLen64+len(meta))
	b[0] = fmtLocal
	binary.BigEndian.PutUint64(b[1:], id.host)
	binary.BigEndian.PutUint64(b[9:], id.seq)
	b = binary.AppendUvarint(b, uint64(len(meta)))
	b = append(b, meta...)
	return binary.AppendUvarint(b, uint64(dataLen))
}

// markLost turns a fmtElided payload into fmtLost.
func markLost(d []byte) []byte {
	b := append([]byte(nil), d...)
	b[0] = fmtLost
	return b
}

// hydratePrefix is the fmtData payload of an elided (or local) entry up to
// where its data begins; the data follows it on the wire.
func hydratePrefix(d []byte, e decodedEntry) []byte {
	b := make([]byte, headerLen, headerLen+binary.MaxVarintLen64+len(e.meta))
	copy(b, d[:headerLen])
	b[0] = fmtData
	b = binary.AppendUvarint(b, uint64(len(e.meta)))
	return append(b, e.meta...)
}

func isNormalWithPayload(e *pb.Entry) bool {
	return e.GetType() == pb.EntryNormal && len(e.GetData()) > 0
}

func cloneMessage(m *pb.Message) *pb.Message {
	return proto.Clone(m).(*pb.Message)
}

// hasElided reports whether m carries an entry whose data is not in it.
func hasElided(m *pb.Message) bool {
	for _, e := range m.GetEntries() {
		if isNormalWithPayload(e) && (e.GetData()[0] == fmtElided || e.GetData()[0] == fmtLocal) {
			return true
		}
	}
	return false
}
