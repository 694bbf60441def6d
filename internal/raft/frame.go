package raft

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"unsafe"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// MsgApp carries the bulk of the traffic (entries with their data kept out
// of the log travel here), so it has a framing of its own instead of a
// protobuf: the sender writes each large entry's bytes straight from the
// entry (writev, no marshal copy), padded so that the entry's data lands
// at a 4 KiB-aligned offset of the receiver's frame buffer; the receiver
// reads the frame into a fresh aligned buffer and lets the entries alias
// it (no unmarshal copy), so the state machine can write the data with
// O_DIRECT without a bounce buffer either.
//
//	itemApp: uvarint term, logTerm, index, commit, n; n × entry
//	entry:   uvarint term, index, type, len(data), pad; pad zero bytes; data
const (
	itemApp = 4

	// frameAlign is the alignment of a received frame buffer and of the
	// data of large entries in it.
	frameAlign = 4096
	// bigEntry: entries at least this large are written in place (writev)
	// and aligned; smaller ones are copied into the frame.
	bigEntry = 64 << 10
	// aliasFrame: frames at least this large are read into a fresh buffer
	// that the decoded entries keep; smaller frames reuse one buffer.
	aliasFrame = 256 << 10
)

var zeros [2 * frameAlign]byte

// A frame on a message connection is
//
//	uint32 length of body, uint32 CRC32C (Castagnoli) of body, body
//
// The checksum is verified before anything in the body is decoded, and the
// length is bounded before a buffer is allocated for it.
const frameHeaderLen = 8

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// frameReadStep is how much of a frame's announced length is allocated
// before its bytes arrive: a frame up to this size is read into one
// buffer; a larger one grows the buffer (doubling) as its bytes come in,
// so a header alone never costs more than this much memory.
const frameReadStep = maxBatchBytes + 1<<20

// frameWriter builds one frame as a list of segments: small parts are
// appended to a scratch buffer, large entry payloads are referenced.
type frameWriter struct {
	hdr     [frameHeaderLen]byte // length and checksum: their own segment, since scratch may move
	scratch []byte
	segs    [][]byte
	start   int // start of the current scratch segment
	body    int // bytes of frame body so far (after the length prefix)
}

func (f *frameWriter) reset() {
	f.scratch = f.scratch[:0]
	f.segs = append(f.segs[:0], f.hdr[:])
	f.start = 0
	f.body = 0
}

func (f *frameWriter) uvarint(v uint64) {
	n := len(f.scratch)
	f.scratch = binary.AppendUvarint(f.scratch, v)
	f.body += len(f.scratch) - n
}

func (f *frameWriter) bytes(b []byte) {
	f.scratch = append(f.scratch, b...)
	f.body += len(b)
}

// ref adds b as a segment of its own.
func (f *frameWriter) ref(b []byte) {
	if len(f.scratch) > f.start {
		f.segs = append(f.segs, f.scratch[f.start:])
	}
	f.segs = append(f.segs, b)
	f.start = len(f.scratch)
	f.body += len(b)
}

// finish patches the length and checksum and returns the segments and
// total size.
func (f *frameWriter) finish() ([][]byte, int) {
	if len(f.scratch) > f.start {
		f.segs = append(f.segs, f.scratch[f.start:])
	}
	var sum uint32
	for _, sg := range f.segs[1:] {
		sum = crc32.Update(sum, castagnoli, sg)
	}
	binary.BigEndian.PutUint32(f.hdr[:], uint32(f.body))
	binary.BigEndian.PutUint32(f.hdr[4:], sum)
	return f.segs, f.body + frameHeaderLen
}

// readFrame reads one frame's body from r into a buffer of its own (when
// alias, aligned, for the entries to keep) or into buf (reused). It checks
// the announced length against max before allocating and the checksum
// before returning.
func readFrame(r io.Reader, buf []byte, max int) (body, newBuf []byte, alias bool, err error) {
	var hdr [frameHeaderLen]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, buf, false, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if uint64(n) > uint64(max) {
		return nil, buf, false, &frameError{fmt.Sprintf("frame of %d bytes exceeds the limit of %d", n, max)}
	}
	alias = n >= aliasFrame
	switch {
	case !alias:
		if cap(buf) < int(n) {
			buf = make([]byte, n)
		}
		body = buf[:n]
		if _, err := io.ReadFull(r, body); err != nil {
			return nil, buf, false, err
		}
	case n <= frameReadStep:
		body = alignedBuf(int(n))
		if _, err := io.ReadFull(r, body); err != nil {
			return nil, buf, false, err
		}
	default:
		// Grow with what actually arrives.
		body = alignedBuf(frameReadStep)
		if _, err := io.ReadFull(r, body); err != nil {
			return nil, buf, false, err
		}
		for len(body) < int(n) {
			next := alignedBuf(min(2*len(body), int(n)))
			copy(next, body)
			if _, err := io.ReadFull(r, next[len(body):]); err != nil {
				return nil, buf, false, err
			}
			body = next
		}
	}
	if sum := crc32.Checksum(body, castagnoli); sum != binary.BigEndian.Uint32(hdr[4:]) {
		return nil, buf, false, &frameError{fmt.Sprintf("frame of %d bytes: checksum %08x, header says %08x", n, sum, binary.BigEndian.Uint32(hdr[4:]))}
	}
	return body, buf, alias, nil
}

// frameError is a frame that is not well formed (as opposed to a
// connection that failed).
type frameError struct{ msg string }

func (e *frameError) Error() string { return "raft: bad frame: " + e.msg }

// decodeFrame checks and decodes one whole frame as it is on the wire
// (header and body). The reader uses readFrame and decodeBatch; this is
// the same path over a byte slice, for tests and fuzzing.
func decodeFrame(wire []byte, from, to uint64, max int) ([]Outgoing, error) {
	r := &sliceReader{b: wire}
	body, _, alias, err := readFrame(r, nil, max)
	if err != nil {
		return nil, err
	}
	if len(r.b) != 0 {
		return nil, &frameError{fmt.Sprintf("%d bytes after the frame", len(r.b))}
	}
	return decodeBatch(body, from, to, alias)
}

type sliceReader struct{ b []byte }

func (r *sliceReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// dataOffset is where the out-of-log data starts inside an entry payload
// (0 if it has none worth aligning).
func dataOffset(e *pb.Entry) int {
	d := e.GetData()
	if e.GetType() != pb.EntryNormal || len(d) < bigEntry || d[0] != fmtData {
		return 0
	}
	rest := d[headerLen:]
	n, k := binary.Uvarint(rest)
	if k <= 0 || uint64(len(rest)-k) < n {
		return 0
	}
	return headerLen + k + int(n)
}

func (f *frameWriter) app(m *pb.Message, tails [][]byte) {
	f.scratch = append(f.scratch, itemApp)
	f.body++
	f.uvarint(m.GetTerm())
	f.uvarint(m.GetLogTerm())
	f.uvarint(m.GetIndex())
	f.uvarint(m.GetCommit())
	f.uvarint(uint64(len(m.GetEntries())))
	for i, e := range m.GetEntries() {
		d := e.GetData()
		f.uvarint(e.GetTerm())
		f.uvarint(e.GetIndex())
		f.uvarint(uint64(e.GetType()))
		if tails != nil && tails[i] != nil {
			// Prefix in the frame, data referenced: aligned on arrival.
			tail := tails[i]
			f.uvarint(uint64(len(d) + len(tail)))
			pad := padFor(f.body, len(d))
			f.uvarint(uint64(pad))
			f.bytes(zeros[:pad])
			f.bytes(d)
			if len(tail) < bigEntry {
				f.bytes(tail)
			} else {
				f.ref(tail)
			}
			continue
		}
		f.uvarint(uint64(len(d)))
		if len(d) < bigEntry {
			f.uvarint(0)
			f.bytes(d)
			continue
		}
		// Pad so that the data starts at a multiple of frameAlign in the
		// body: body + len(varint(pad)) + pad + off ≡ 0.
		off := dataOffset(e)
		pad := 0
		if off > 0 {
			pad = padFor(f.body, off)
		}
		f.uvarint(uint64(pad))
		f.bytes(zeros[:pad])
		f.ref(d)
	}
}

// padFor returns the padding p such that body + len(varint(p)) + p + off is
// a multiple of frameAlign.
func padFor(body, off int) int {
	for l := 1; l <= 2; l++ {
		p := ((frameAlign-(body+l+off)%frameAlign)%frameAlign + frameAlign) % frameAlign
		for uvarintLen(uint64(p)) < l {
			p += frameAlign
		}
		if uvarintLen(uint64(p)) == l {
			return p
		}
	}
	panic("unreachable")
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// decodeApp decodes an itemApp. When alias is set the entries keep
// slices of b; otherwise they get copies.
func decodeApp(b []byte, from, to uint64, alias bool) (*pb.Message, []byte, error) {
	var err error
	uv := func() uint64 {
		if err != nil {
			return 0
		}
		v, k := binary.Uvarint(b)
		if k <= 0 {
			err = fmt.Errorf("truncated MsgApp")
			return 0
		}
		b = b[k:]
		return v
	}
	typ := pb.MsgApp
	m := &pb.Message{Type: &typ, From: proto.Uint64(from), To: proto.Uint64(to)}
	m.Term = proto.Uint64(uv())
	m.LogTerm = proto.Uint64(uv())
	m.Index = proto.Uint64(uv())
	m.Commit = proto.Uint64(uv())
	n := uv()
	if err != nil {
		return nil, nil, err
	}
	// Every entry takes at least minEntryBytes: a count the remaining bytes
	// cannot hold is a lie, and must not size an allocation.
	const minEntryBytes = 5
	if n > maxBatchMsgs*64 || n > uint64(len(b))/minEntryBytes {
		return nil, nil, fmt.Errorf("MsgApp with %d entries in %d bytes", n, len(b))
	}
	m.Entries = make([]*pb.Entry, 0, n)
	// One allocation each for the entries, their numbers and their types
	// instead of five per entry (a follower decodes every entry of every
	// write here). The entries are never copied by value.
	ents := make([]pb.Entry, n)
	nums := make([]uint64, 2*n)
	types := make([]pb.EntryType, n)
	var slab []byte
	if !alias {
		// One copy buffer for this message's entries, sized exactly: a
		// frame carries the messages of every group bound for the peer,
		// and a buffer sized by the rest of the frame would be allocated
		// (and kept alive by the entries' data) once per message.
		total, ok := appDataBytes(b, n)
		if !ok {
			return nil, nil, fmt.Errorf("truncated MsgApp")
		}
		slab = make([]byte, 0, total)
	}
	for i := uint64(0); i < n; i++ {
		term, index, et, l, pad := uv(), uv(), uv(), uv(), uv()
		if err != nil {
			return nil, nil, err
		}
		// pad+l may overflow: compare each with what is left.
		if pad > uint64(len(b)) || l > uint64(len(b))-pad {
			return nil, nil, fmt.Errorf("truncated MsgApp entry %d: %d bytes of padding and %d of data, %d left", i, pad, l, len(b))
		}
		if et > uint64(pb.EntryConfChangeV2) {
			return nil, nil, fmt.Errorf("MsgApp entry %d: unknown entry type %d", i, et)
		}
		b = b[pad:]
		if pb.EntryType(et) == pb.EntryNormal && l > 0 && (b[0] == fmtLocal || b[0] == fmtElided) {
			// These forms stay on the host that made them: a sender puts
			// the data back (fmtData) or marks it lost (fmtLost).
			return nil, nil, fmt.Errorf("MsgApp entry %d: payload format %d never travels", i, b[0])
		}
		var d []byte
		if l > 0 {
			if alias {
				d = b[:l:l]
			} else {
				// The copy buffer sized by appDataBytes (a frame read
				// into a reused buffer is below aliasFrame).
				if cap(slab)-len(slab) < int(l) {
					return nil, nil, fmt.Errorf("MsgApp entry %d: %d bytes past the message's data", i, l)
				}
				at := len(slab)
				slab = append(slab, b[:l]...)
				d = slab[at:len(slab):len(slab)]
			}
		}
		b = b[l:]
		e := &ents[i]
		nums[2*i], nums[2*i+1], types[i] = term, index, pb.EntryType(et)
		e.Term, e.Index, e.Type, e.Data = &nums[2*i], &nums[2*i+1], &types[i], d
		m.Entries = append(m.Entries, e)
	}
	return m, b, nil
}

// appDataBytes adds up the data lengths of the n entries of a MsgApp
// whose entries start at b (the decoder's checks come after: it only
// reads varints and bounds each step by what is left). ok is false if b
// ends first.
func appDataBytes(b []byte, n uint64) (total int, ok bool) {
	for i := uint64(0); i < n; i++ {
		var f [5]uint64 // term, index, type, length, padding
		for j := range f {
			v, k := binary.Uvarint(b)
			if k <= 0 {
				return 0, false
			}
			f[j], b = v, b[k:]
		}
		l, pad := f[3], f[4]
		if pad > uint64(len(b)) || l > uint64(len(b))-pad {
			return 0, false
		}
		b = b[pad+l:]
		total += int(l)
	}
	return total, true
}

// alignedBuf returns n bytes starting at a frameAlign boundary.
func alignedBuf(n int) []byte {
	b := make([]byte, n+frameAlign)
	off := int(uintptr(unsafe.Pointer(&b[0])) & (frameAlign - 1))
	if off != 0 {
		off = frameAlign - off
	}
	return b[off : off+n : off+n]
}
