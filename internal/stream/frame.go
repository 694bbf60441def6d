package stream

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"

	fastcrc "github.com/basalt-store/basalt/internal/crc32c"
)

// Wire constants. Every integer is big-endian.
const (
	headerMagic = 0x42535452 // "BSTR": first bytes of every stream
	// Version is the protocol version this package speaks; a header with
	// another version is refused (no negotiation: the datanodes of one
	// cluster run one version). Version 2 added a CRC32C to every frame:
	// the header's trailer, the packet header's last word (where version 1
	// had a magic number) and the ack's second word. Version 3 added the
	// block token after the route. Version 4: a secured stream switches
	// from TLS to records of its own after the header ack (record.go); a
	// version 3 peer would read them as TLS garbage, so it is refused at
	// the header instead. Version 5: a connection carries one stream
	// after another (doc.go, "Reuse"): each next header and its ack go as
	// control records, each stream's payload key is exported with its
	// number on the connection, and the exporter labels say v5.
	//
	// A datanode accepts both MinVersion and Version (rolling upgrades:
	// the previous release speaks 4) and serves a stream with the
	// semantics of the version its header carries: a version 4 stream
	// goes down the route at version 4 (v4 exporter labels, the payload
	// key exported without a context) and its connections close after
	// it (no reuse). An opener picks the version of a route (Options.Version).
	Version = 5
	// MinVersion is the oldest version a datanode still serves.
	MinVersion = 4

	headerPrefixLen = 8  // magic, version, hop, body length
	headerFixedLen  = 38 // body bytes before the route
	headerCRCLen    = 4  // CRC32C of prefix and body, after the body
	packetHeaderLen = 32
	ackLen          = 32

	// MaxRoute bounds the route a header may carry (replication factors
	// are 3; EC pipelines later are ≤ 16).
	MaxRoute = 16
	// maxAddrLen bounds one route entry's address.
	maxAddrLen = 255
	// MaxToken bounds the header's block token (package blocktoken's are
	// at most 204 bytes).
	MaxToken = 512
	// maxHeaderBody bounds what a datanode reads before it has validated
	// anything.
	maxHeaderBody = headerFixedLen + MaxRoute*(10+maxAddrLen) + 2 + MaxToken + 1 + 32
	// MaxPacketSize bounds one packet's payload, and so the buffer a
	// datanode must hold per packet in flight.
	MaxPacketSize = 16 << 20
	// DefaultPacketSize: large enough that per-packet costs (a header, a
	// syscall, an ack) vanish against the copy into the kernel, small
	// enough that a window of them is cheap to buffer.
	DefaultPacketSize = 1 << 20
	maxReason         = 1024
)

// Frame kinds.
const (
	kindData      = 2
	kindClose     = 3
	kindHeaderAck = 0x81
	kindDataAck   = 0x82
	kindCloseAck  = 0x83
	kindError     = 0xff
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crc32c is the checksum of payloads and frames (hardware accelerated on
// amd64/arm64).
func crc32c(p []byte) uint32 { return fastcrc.Checksum(p) }

// Every frame carries a CRC32C of itself: TCP's 16-bit checksum lets
// damaged segments through often enough at our volumes, and a flipped bit
// in a length, offset or sequence number would otherwise be acted upon
// (a short write at the wrong offset, an ack for data never stored)
// instead of failing the stream.

// BlockID names a block: its container and its local ID in it.
type BlockID struct {
	Container uint64
	Local     uint64
}

func (b BlockID) String() string { return fmt.Sprintf("%d/%d", b.Container, b.Local) }

// Target is one hop of a route: a datanode and its stream address.
type Target struct {
	ID   uint64
	Addr string
}

// Header opens a stream. Each datanode receives the route that remains
// after itself: the client sends [dn2, dn3] to dn1, dn1 sends [dn3] to dn2,
// dn2 sends [] to dn3.
type Header struct {
	Hop        uint8 // 0 when sent by a client, +1 per datanode
	Pipeline   uint64
	Block      BlockID
	Offset     uint64 // where the stream starts in the block
	PacketSize uint32 // the largest payload the sender will send
	Route      []Target
	// Token is the block token (package blocktoken) the client got with
	// the block's location; every datanode of the route checks it.
	Token []byte
	// version is the protocol version the header carries (MinVersion or
	// Version); 0 when encoding means Version. The whole route runs at
	// one version: a datanode forwards the header with the one it got.
	version uint8
	// payloadKey is a secured stream's payload key (record.go): the first
	// datanode exports it from its TLS session with the client and sends
	// it down the route, through TLS, in the header of every later hop.
	// Empty from a client and on plaintext streams.
	payloadKey []byte
}

// encodeHeader appends the header frame to dst.
func encodeHeader(dst []byte, h *Header) ([]byte, error) {
	if len(h.Route) > MaxRoute {
		return nil, fmt.Errorf("stream: route of %d hops > %d", len(h.Route), MaxRoute)
	}
	if len(h.Token) > MaxToken {
		return nil, fmt.Errorf("stream: block token of %d bytes > %d", len(h.Token), MaxToken)
	}
	if k := len(h.payloadKey); k != 0 && k != 16 && k != 32 {
		return nil, fmt.Errorf("stream: payload key of %d bytes", k)
	}
	body := headerFixedLen + 2 + len(h.Token) + 1 + len(h.payloadKey)
	for _, t := range h.Route {
		if len(t.Addr) == 0 || len(t.Addr) > maxAddrLen {
			return nil, fmt.Errorf("stream: route hop datanode %d has address %q (want 1..%d bytes)", t.ID, t.Addr, maxAddrLen)
		}
		body += 10 + len(t.Addr)
	}
	start := len(dst)
	dst = binary.BigEndian.AppendUint32(dst, headerMagic)
	v := h.version
	if v == 0 {
		v = Version
	}
	if v < MinVersion || v > Version {
		return nil, fmt.Errorf("stream: header version %d outside [%d, %d]", v, MinVersion, Version)
	}
	dst = append(dst, v, h.Hop)
	dst = binary.BigEndian.AppendUint16(dst, uint16(body))
	dst = binary.BigEndian.AppendUint64(dst, h.Pipeline)
	dst = binary.BigEndian.AppendUint64(dst, h.Block.Container)
	dst = binary.BigEndian.AppendUint64(dst, h.Block.Local)
	dst = binary.BigEndian.AppendUint64(dst, h.Offset)
	dst = binary.BigEndian.AppendUint32(dst, h.PacketSize)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(h.Route)))
	for _, t := range h.Route {
		dst = binary.BigEndian.AppendUint64(dst, t.ID)
		dst = binary.BigEndian.AppendUint16(dst, uint16(len(t.Addr)))
		dst = append(dst, t.Addr...)
	}
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(h.Token)))
	dst = append(dst, h.Token...)
	dst = append(dst, byte(len(h.payloadKey)))
	dst = append(dst, h.payloadKey...)
	return binary.BigEndian.AppendUint32(dst, crc32c(dst[start:])), nil
}

// errBadHeader wraps every header decoding failure.
var errBadHeader = errors.New("bad stream header")

// readHeader reads and validates a header frame of a version from
// MinVersion to Version. Errors wrap errBadHeader unless the connection
// itself failed.
func readHeader(r io.Reader) (*Header, error) { return readHeaderOf(r, 0) }

// readHeaderOf reads a header; only is the one version accepted (0: any of
// MinVersion..Version). A refused version is answered as a datanode that
// speaks only one version words it ("version 5, this datanode speaks 4":
// what a protocol 4 datanode says to a version 5 header, see Refused).
func readHeaderOf(r io.Reader, only uint8) (*Header, error) {
	var pre [headerPrefixLen]byte
	if _, err := io.ReadFull(r, pre[:]); err != nil {
		return nil, err
	}
	if m := binary.BigEndian.Uint32(pre[0:]); m != headerMagic {
		return nil, fmt.Errorf("%w: magic %#08x, want %#08x (not a stream client?)", errBadHeader, m, headerMagic)
	}
	v := pre[4]
	switch {
	case only != 0 && v != only:
		return nil, fmt.Errorf("%w: version %d, this datanode speaks %d", errBadHeader, v, only)
	case v < MinVersion || v > Version:
		return nil, fmt.Errorf("%w: version %d, this datanode speaks %d to %d", errBadHeader, v, MinVersion, Version)
	}
	n := int(binary.BigEndian.Uint16(pre[6:]))
	if n < headerFixedLen || n > maxHeaderBody {
		return nil, fmt.Errorf("%w: body of %d bytes outside [%d, %d]", errBadHeader, n, headerFixedLen, maxHeaderBody)
	}
	if hop := pre[5]; hop > MaxRoute {
		return nil, fmt.Errorf("%w: hop %d > %d", errBadHeader, hop, MaxRoute)
	}
	frame := make([]byte, headerPrefixLen+n+headerCRCLen)
	copy(frame, pre[:])
	if _, err := io.ReadFull(r, frame[headerPrefixLen:]); err != nil {
		return nil, err
	}
	body, sum := frame[headerPrefixLen:headerPrefixLen+n], binary.BigEndian.Uint32(frame[headerPrefixLen+n:])
	if got := crc32c(frame[:headerPrefixLen+n]); got != sum {
		return nil, fmt.Errorf("%w: CRC32C %08x of %d header bytes, frame says %08x (damaged in transit)", errBadHeader, got, headerPrefixLen+n, sum)
	}
	h, err := decodeHeaderBody(body)
	if err != nil {
		return nil, err
	}
	h.Hop, h.version = pre[5], v
	return h, nil
}

// Version returns the protocol version of the header (as read; 0 for a
// header built by a caller: Version).
func (h *Header) Version() uint8 { return h.version }

func decodeHeaderBody(b []byte) (*Header, error) {
	be := binary.BigEndian
	h := &Header{
		Pipeline:   be.Uint64(b[0:]),
		Block:      BlockID{be.Uint64(b[8:]), be.Uint64(b[16:])},
		Offset:     be.Uint64(b[24:]),
		PacketSize: be.Uint32(b[32:]),
	}
	nr := int(be.Uint16(b[36:]))
	switch {
	case h.Pipeline == 0:
		return nil, fmt.Errorf("%w: pipeline 0", errBadHeader)
	case h.Block.Container == 0 || h.Block.Local == 0:
		return nil, fmt.Errorf("%w: block %v: container and local ID must be nonzero", errBadHeader, h.Block)
	case h.PacketSize == 0 || h.PacketSize > MaxPacketSize:
		return nil, fmt.Errorf("%w: packet size %d outside [1, %d]", errBadHeader, h.PacketSize, MaxPacketSize)
	case nr > MaxRoute:
		return nil, fmt.Errorf("%w: route of %d hops > %d", errBadHeader, nr, MaxRoute)
	}
	p := b[headerFixedLen:]
	for i := 0; i < nr; i++ {
		if len(p) < 10 {
			return nil, fmt.Errorf("%w: route entry %d truncated", errBadHeader, i)
		}
		id, al := be.Uint64(p), int(be.Uint16(p[8:]))
		p = p[10:]
		if al == 0 || al > len(p) {
			return nil, fmt.Errorf("%w: route entry %d (datanode %d): address of %d bytes, %d left", errBadHeader, i, id, al, len(p))
		}
		h.Route = append(h.Route, Target{ID: id, Addr: string(p[:al])})
		p = p[al:]
	}
	if len(p) < 2 {
		return nil, fmt.Errorf("%w: block token length missing after the route", errBadHeader)
	}
	tl := int(be.Uint16(p))
	p = p[2:]
	if tl > MaxToken || tl > len(p) {
		return nil, fmt.Errorf("%w: block token of %d bytes (at most %d), %d left", errBadHeader, tl, MaxToken, len(p))
	}
	if tl > 0 {
		h.Token = append([]byte(nil), p[:tl]...)
	}
	p = p[tl:]
	if len(p) < 1 {
		return nil, fmt.Errorf("%w: payload key length missing after the block token", errBadHeader)
	}
	kl := int(p[0])
	p = p[1:]
	if (kl != 0 && kl != 16 && kl != 32) || kl > len(p) {
		return nil, fmt.Errorf("%w: payload key of %d bytes (0, 16 or 32), %d left", errBadHeader, kl, len(p))
	}
	if kl > 0 {
		h.payloadKey = append([]byte(nil), p[:kl]...)
	}
	p = p[kl:]
	if len(p) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes after the payload key", errBadHeader, len(p))
	}
	return h, nil
}

// packetHeader precedes every packet's payload.
type packetHeader struct {
	kind   uint8  // kindData or kindClose
	length uint32 // payload bytes; 0 for close
	seq    uint64 // 0, 1, 2, ...; a close carries the next seq
	offset uint64 // of the payload in the block; a close carries the final length
	crc    uint32 // CRC32C of the payload
}

func (p *packetHeader) encode(b *[packetHeaderLen]byte) {
	be := binary.BigEndian
	b[0], b[1] = p.kind, 0
	be.PutUint16(b[2:], 0)
	be.PutUint32(b[4:], p.length)
	be.PutUint64(b[8:], p.seq)
	be.PutUint64(b[16:], p.offset)
	be.PutUint32(b[24:], p.crc)
	be.PutUint32(b[28:], crc32c(b[:28]))
}

func (p *packetHeader) decode(b *[packetHeaderLen]byte) error {
	be := binary.BigEndian
	if got, sum := crc32c(b[:28]), be.Uint32(b[28:]); got != sum {
		return fmt.Errorf("packet header CRC32C %08x, header says %08x (damaged in transit, or stream out of sync)", got, sum)
	}
	if b[1] != 0 || be.Uint16(b[2:]) != 0 {
		return fmt.Errorf("packet header reserved bytes %#x %#x are not zero", b[1], be.Uint16(b[2:]))
	}
	*p = packetHeader{kind: b[0], length: be.Uint32(b[4:]), seq: be.Uint64(b[8:]), offset: be.Uint64(b[16:]), crc: be.Uint32(b[24:])}
	switch p.kind {
	case kindData:
		if p.length == 0 {
			return fmt.Errorf("packet %d: empty data packet", p.seq)
		}
		if p.length > MaxPacketSize {
			return fmt.Errorf("packet %d: %d bytes > %d", p.seq, p.length, MaxPacketSize)
		}
		if p.offset+uint64(p.length) < p.offset {
			return fmt.Errorf("packet %d: %d bytes at offset %d overflow", p.seq, p.length, p.offset)
		}
	case kindClose:
		if p.length != 0 {
			return fmt.Errorf("close packet %d carries %d bytes", p.seq, p.length)
		}
	default:
		return fmt.Errorf("packet %d: unknown kind %#x", p.seq, p.kind)
	}
	return nil
}

// ack flows upstream: one per header, per packet and per close, or one
// error that ends the stream.
type ack struct {
	kind  uint8
	code  Code   // kindError only
	seq   uint64 // kindDataAck: the packet acked
	value uint64 // header: start offset; data: end of the packet; close: final length
	dn    uint64 // kindError: the datanode at fault
	// reason (kindError) is what failed, with its inputs.
	reason string
}

func (a *ack) encode(dst []byte) []byte {
	r := a.reason
	if len(r) > maxReason {
		r = r[:maxReason]
	}
	be := binary.BigEndian
	start := len(dst)
	dst = append(dst, a.kind, byte(a.code))
	dst = be.AppendUint16(dst, uint16(len(r)))
	dst = be.AppendUint32(dst, 0) // the CRC, below
	dst = be.AppendUint64(dst, a.seq)
	dst = be.AppendUint64(dst, a.value)
	dst = be.AppendUint64(dst, a.dn)
	dst = append(dst, r...)
	be.PutUint32(dst[start+4:], ackCRC(dst[start:start+ackLen], dst[start+ackLen:]))
	return dst
}

// ackCRC is the CRC32C of an ack: its fixed part with the CRC word read
// as zero, then its reason.
func ackCRC(fixed []byte, reason []byte) uint32 {
	var zero [4]byte
	c := crc32.Update(0, castagnoli, fixed[:4])
	c = crc32.Update(c, castagnoli, zero[:])
	c = crc32.Update(c, castagnoli, fixed[8:ackLen])
	return crc32.Update(c, castagnoli, reason)
}

// errBadAck wraps malformed acks (as opposed to a broken connection).
var errBadAck = errors.New("bad ack")

// readAck reads one ack into a (reusing b for the fixed part).
func readAck(r io.Reader, b *[ackLen]byte, a *ack) error {
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return err
	}
	be := binary.BigEndian
	*a = ack{kind: b[0], code: Code(b[1]), seq: be.Uint64(b[8:]), value: be.Uint64(b[16:]), dn: be.Uint64(b[24:])}
	n := int(be.Uint16(b[2:]))
	var reason []byte
	switch a.kind {
	case kindHeaderAck, kindDataAck, kindCloseAck:
		if n != 0 || a.code != 0 {
			return fmt.Errorf("%w: kind %#x with code %d and %d reason bytes", errBadAck, a.kind, a.code, n)
		}
	case kindError:
		// Bounded before anything is allocated for it.
		if n > maxReason {
			return fmt.Errorf("%w: error ack with %d reason bytes > %d", errBadAck, n, maxReason)
		}
		reason = make([]byte, n)
		if _, err := io.ReadFull(r, reason); err != nil {
			return err
		}
	default:
		return fmt.Errorf("%w: unknown kind %#x", errBadAck, a.kind)
	}
	if got, sum := ackCRC(b[:], reason), be.Uint32(b[4:]); got != sum {
		return fmt.Errorf("%w: kind %#x: CRC32C %08x, ack says %08x (damaged in transit)", errBadAck, a.kind, got, sum)
	}
	a.reason = string(reason)
	return nil
}

// Code says why a stream failed.
type Code uint8

const (
	CodeOK Code = iota
	// CodeBadHeader: the header is malformed, or names a route or offset
	// that cannot be right.
	CodeBadHeader
	// CodeNotInPipeline: the datanode is not a member of the pipeline
	// (unknown or closed pipeline).
	CodeNotInPipeline
	// CodeContainerNotOpen: the container is closed (or unhealthy).
	CodeContainerNotOpen
	// CodeNoSuchContainer: the container does not exist and cannot be
	// created here.
	CodeNoSuchContainer
	// CodeBlockCommitted: the block is already committed at another length.
	CodeBlockCommitted
	// CodeUnreachable: the next datanode could not be connected to.
	CodeUnreachable
	// CodeTimeout: a datanode stopped answering (no ack, or no progress on
	// a write) within the stall timeout.
	CodeTimeout
	// CodeConnLost: a datanode's connection broke (it died or closed it).
	CodeConnLost
	// CodeChecksumMismatch: a packet arrived damaged.
	CodeChecksumMismatch
	// CodeIO: the datanode could not store the data (disk error, full).
	CodeIO
	// CodeProtocol: a packet or ack out of sequence or malformed.
	CodeProtocol
	// CodeShutdown: the datanode is stopping.
	CodeShutdown
	// CodeBusy: the datanode has too many streams open.
	CodeBusy
	// CodeInternal: a bug on the datanode (a recovered panic) failed the
	// stream; the datanode carries on serving others.
	CodeInternal
	// CodePermissionDenied: the header's block token is missing, forged,
	// expired or for another block.
	CodePermissionDenied
	// CodeStale: a kept connection (the client's to the first datanode,
	// or a datanode's to the next) ended before any byte of the answer to
	// a next stream's header arrived (end of file or a reset): what a
	// peer that closed the idle connection as the header crossed looks
	// like, though a peer that died does the same. Datanode names that
	// peer. The stream is abandoned (no header ack: nothing of it can be
	// committed); the client writes the data again as a new block on a
	// new connection, at most once per segment and once per datanode per
	// key, without blaming the datanode (a real failure shows on the new
	// connection). Meaningful only in answer to a header on a kept
	// connection: the Writer, and a hop for an error ack over a new
	// connection down, turn it into CodeConnLost anywhere else. A peer that does not know the code
	// (protocol 5 as of session 15) treats it as any other failure naming
	// the datanode.
	CodeStale
)

var codeNames = [...]string{"ok", "bad header", "not in pipeline", "container not open", "no such container",
	"block already committed", "downstream unreachable", "timeout", "connection lost", "checksum mismatch",
	"I/O error", "protocol error", "shutting down", "busy", "internal error", "permission denied", "stale connection"}

func (c Code) String() string {
	if int(c) < len(codeNames) {
		return codeNames[c]
	}
	return fmt.Sprintf("code %d", uint8(c))
}

// Error is a failed stream: which datanode failed (or refused), why, and
// the kind of failure the client acts on (exclude the datanode, pick
// another container, ...). Every failure a Writer returns is an *Error.
type Error struct {
	Code Code
	// Datanode is the datanode at fault: the one that refused the stream,
	// or the one that could not be reached, stopped answering or died.
	// 0 if unknown.
	Datanode uint64
	Addr     string // its stream address, when known
	Reason   string
}

func (e *Error) Error() string {
	who := "datanode ?"
	if e.Datanode != 0 {
		who = fmt.Sprintf("datanode %d", e.Datanode)
	}
	if e.Addr != "" {
		who += " (" + e.Addr + ")"
	}
	return fmt.Sprintf("stream: %s: %s: %s", who, e.Code, e.Reason)
}

// Is lets callers test the kind: errors.Is(err, &stream.Error{Code: stream.CodeTimeout}).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && (t.Datanode == 0 || t.Datanode == e.Datanode)
}

func errorAck(e *Error) *ack {
	return &ack{kind: kindError, code: e.Code, dn: e.Datanode, reason: e.Reason}
}

func ackError(a *ack, route []Target) *Error {
	e := &Error{Code: a.code, Datanode: a.dn, Reason: a.reason}
	for _, t := range route {
		if t.ID == a.dn {
			e.Addr = t.Addr
		}
	}
	if e.Code == CodeOK {
		e.Code = CodeProtocol
	}
	return e
}
