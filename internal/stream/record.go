package stream

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
)

// The record layer of a secured stream (see doc.go, "Records"). The
// connection is authenticated by a mutual TLS 1.3 handshake and carries
// the stream header and its ack through crypto/tls; then both ends switch
// to records of their own, sealed with keys exported from the TLS
// session, so that a payload is opened and sealed in the packet buffer it
// lives in (crypto/tls copies every 16 KiB record out of, and into, its
// own buffers, and writes each with a syscall of its own).

const (
	recHeaderLen = 8  // kind u8 | 0 u8 | 0 u16 | sealed length u32
	tagLen       = 16 // AES-GCM tag
	nonceLen     = 12

	recControl = 1 // a packet header, an ack: read through Read
	recPayload = 2 // a packet's payload: read through readPayload

	// maxControl bounds a control record's plaintext (an error ack is at
	// most ackLen+maxReason bytes); longer writes are split.
	maxControl = 2048
	// maxKeyBytes bounds what one key seals: far inside AES-GCM's limits
	// (RFC 8446 §5.5 allows 2^24.5 full TLS records, ~2^38.5 bytes, per
	// key) and far beyond one block's stream. Past it the connection dies.
	maxKeyBytes = 1 << 36

	// Exporter labels (RFC 8446 §7.5), one per direction: the two
	// directions never share a key, so their counters may coincide.
	labelOpenerToAcceptor = "EXPORTER-basalt-stream-v5 opener to acceptor"
	labelAcceptorToOpener = "EXPORTER-basalt-stream-v5 acceptor to opener"
	// labelPayload: a stream's payload key, exported from the session of
	// the client and the first datanode with the stream's number on that
	// connection (0, 1, … : a reused connection carries one stream after
	// another) as the context, so every stream has a key of its own; the
	// first datanode sends it on down the route in the header (through
	// TLS, or as a control record on a reused connection).
	labelPayload = "EXPORTER-basalt-stream-v5 payload"

	// The labels of a version 4 stream (MinVersion, no reuse): its
	// payload key is exported without a context (one stream per
	// connection).
	labelOpenerToAcceptorV4 = "EXPORTER-basalt-stream-v4 opener to acceptor"
	labelAcceptorToOpenerV4 = "EXPORTER-basalt-stream-v4 acceptor to opener"
	labelPayloadV4          = "EXPORTER-basalt-stream-v4 payload"
)

// errRecord wraps every refused record: damaged, forged, replayed, out of
// order, of the wrong kind or size. The stream fails with it and its
// connection is closed.
var errRecord = errors.New("stream record refused")

// aeadState is one direction's key and counter. The 96-bit nonce is four
// zero bytes and the record's 64-bit sequence number: each record of a
// direction has its own, and the receiver expects them in order, so a
// replayed, dropped or reordered record fails authentication.
type aeadState struct {
	aead  cipher.AEAD
	seq   uint64
	bytes uint64
	nonce [nonceLen]byte
}

func newAEADState(key []byte) (*aeadState, error) {
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	g, err := cipher.NewGCM(b)
	if err != nil {
		return nil, err
	}
	return &aeadState{aead: g}, nil
}

// next returns the nonce of the next record of n bytes, or an error once
// the key has done its work (the connection must then end: a nonce is
// never used twice).
func (s *aeadState) next(n int) ([]byte, error) {
	if s.seq == math.MaxUint64 || s.bytes+uint64(n) > maxKeyBytes {
		return nil, fmt.Errorf("%w: key exhausted after %d records, %d bytes", errRecord, s.seq, s.bytes)
	}
	binary.BigEndian.PutUint64(s.nonce[4:], s.seq)
	s.seq++
	s.bytes += uint64(n)
	return s.nonce[:], nil
}

func putRecHeader(b []byte, kind byte, sealed int) {
	b[0], b[1], b[2], b[3] = kind, 0, 0, 0
	binary.BigEndian.PutUint32(b[4:], uint32(sealed))
}

// recordConn is a stream connection after the switch: the raw TCP
// connection (deadlines, Close) carrying sealed records. One goroutine
// reads (Read, readPayload) and one writes (Write, writePacket) at a
// time; writes are serialized anyway.
type recordConn struct {
	net.Conn // raw TCP: the TLS connection's, after the switch

	r io.Reader // = Conn; a field for the decoder's tests
	w io.Writer // = Conn

	wmu  sync.Mutex
	out  *aeadState
	werr error              // sticky: a record half written leaves the stream unusable
	wad  [recHeaderLen]byte // a control record's additional data (never dst's memory)
	wctl []byte
	whdr [2*recHeaderLen + packetHeaderLen + tagLen]byte
	iov  [2][]byte
	bufs net.Buffers

	// pay seals (the client) or opens (every datanode) payload records.
	// Its key is the stream's, the same on every hop: a datanode forwards
	// a payload record as it arrived and opens it in place for its disk,
	// so a payload is sealed once and opened once per datanode. Every hop
	// sees the same payload records in the same order, so the counters
	// agree down the route.
	pay    *aeadState
	payKey []byte                               // pay's key: the next stream's must differ
	wpad   [recHeaderLen + packetHeaderLen]byte // additional data of a payload record sealed
	rpad   [recHeaderLen + packetHeaderLen]byte // and of one opened

	in   *aeadState
	rerr error // sticky
	rh   [recHeaderLen]byte
	rctl []byte // control plaintext, opened in place
	pend []byte // its unread part
}

// newRecordConn returns a record connection over raw sealing control
// records with send, opening them with recv, and sealing or opening
// payload records with pay.
func newRecordConn(raw net.Conn, send, recv, pay []byte) (*recordConn, error) {
	out, err := newAEADState(send)
	if err != nil {
		return nil, err
	}
	in, err := newAEADState(recv)
	if err != nil {
		return nil, err
	}
	ps, err := newAEADState(pay)
	if err != nil {
		return nil, err
	}
	return &recordConn{Conn: raw, r: raw, w: raw, out: out, in: in, pay: ps, payKey: append([]byte(nil), pay...),
		wctl: make([]byte, 0, recHeaderLen+maxControl+tagLen), rctl: make([]byte, maxControl+tagLen)}, nil
}

// switchToRecords turns tc, through which the stream header and its ack
// passed, into a record connection. The acceptor calls it after reading
// the header and before sending the ack; the opener after reading the ack.
// tc must run over a tlsFramer (framedTLS), so that crypto/tls never read
// past the TLS record it last needed: whatever the peer sent after the
// exchange (the acceptor switches right after sending the ack and may
// send an error ack as a record at once) is still in the socket, for the
// records. crypto/tls must hold no input itself (plaintext past the
// exchange, or an unprocessed record): if it does, that input would be
// lost to the records, and the switch is refused. The session must be
// TLS 1.3 (its exporter is bound to the whole handshake transcript).
func switchToRecords(tc *tls.Conn, opener bool, payKey []byte) (*recordConn, error) {
	return switchToRecordsV(tc, opener, payKey, Version)
}

// switchToRecordsV is switchToRecords for a stream of protocol version v
// (its exporter labels).
func switchToRecordsV(tc *tls.Conn, opener bool, payKey []byte, v uint8) (*recordConn, error) {
	lo, la := labelOpenerToAcceptor, labelAcceptorToOpener
	if v == 4 {
		lo, la = labelOpenerToAcceptorV4, labelAcceptorToOpenerV4
	}
	cs := tc.ConnectionState()
	keyLen, err := recordKeyLen(&cs)
	if err != nil {
		return nil, err
	}
	f, ok := tc.NetConn().(*tlsFramer)
	if !ok {
		return nil, fmt.Errorf("stream: records need a framed TLS connection")
	}
	if err := tlsDrained(tc, f); err != nil {
		return nil, err
	}
	oa, err := cs.ExportKeyingMaterial(lo, nil, keyLen)
	if err != nil {
		return nil, fmt.Errorf("stream: exporting record keys: %w", err)
	}
	ao, err := cs.ExportKeyingMaterial(la, nil, keyLen)
	if err != nil {
		return nil, fmt.Errorf("stream: exporting record keys: %w", err)
	}
	send, recv := ao, oa
	if opener {
		send, recv = oa, ao
	}
	return newRecordConn(f.Conn, send, recv, payKey)
}

// tlsFramer is the connection under a secured stream's tls.Conn: it hands
// crypto/tls the bytes of one TLS record at a time (its 5-byte header,
// then at most the length the header announced), so crypto/tls, which
// reads ahead as far as one read returns, never holds bytes past the
// record it is reading. The handshake costs a few more reads; after the
// switch to records the raw connection is read directly.
type tlsFramer struct {
	net.Conn
	hdr   [5]byte
	hgot  int  // header bytes of the current TLS record passed on
	left  int  // its body bytes still to pass on (hgot == 5)
	probe bool // tlsDrained's read: time out at once, read nothing
}

// framedTLS returns raw framed for a tls.Conn.
func framedTLS(raw net.Conn) *tlsFramer { return &tlsFramer{Conn: raw} }

// errProbe is a tlsFramer's answer during tlsDrained's read: a timeout
// (which crypto/tls does not make sticky), without touching the socket.
var errProbe = probeError{}

type probeError struct{}

func (probeError) Error() string   { return "stream: TLS input probe" }
func (probeError) Timeout() bool   { return true }
func (probeError) Temporary() bool { return true }

func (f *tlsFramer) Read(p []byte) (int, error) {
	if f.probe {
		return 0, errProbe
	}
	if len(p) == 0 {
		return 0, nil
	}
	if f.hgot < len(f.hdr) {
		n, err := f.Conn.Read(p[:min(len(p), len(f.hdr)-f.hgot)])
		copy(f.hdr[f.hgot:], p[:n])
		if f.hgot += n; f.hgot == len(f.hdr) {
			f.left = int(binary.BigEndian.Uint16(f.hdr[3:]))
			if f.left == 0 {
				f.hgot = 0
			}
		}
		return n, err
	}
	n, err := f.Conn.Read(p[:min(len(p), f.left)])
	if f.left -= n; f.left == 0 {
		f.hgot = 0
	}
	return n, err
}

// recordKeyLen is the AES key size for records of session cs: 128 bits
// if the session itself uses AES-128-GCM, else 256. Only TLS 1.3.
func recordKeyLen(cs *tls.ConnectionState) (int, error) {
	if !cs.HandshakeComplete || cs.Version != tls.VersionTLS13 {
		return 0, fmt.Errorf("stream: records need a completed TLS 1.3 session, have version %#04x", cs.Version)
	}
	if cs.CipherSuite == tls.TLS_AES_128_GCM_SHA256 {
		return 16, nil // as strong as the session's own records
	}
	return 32, nil
}

// payloadKey exports the payload key of stream number seq (0 for the
// first) of the connection of a client and its first datanode, session cs.
func payloadKey(cs *tls.ConnectionState, seq uint64) ([]byte, error) {
	return payloadKeyV(cs, seq, Version)
}

// payloadKeyV is payloadKey for a stream of protocol version v: version 4
// (one stream per connection) exports it with its own label and no
// context, as its datanodes and clients do.
func payloadKeyV(cs *tls.ConnectionState, seq uint64, v uint8) ([]byte, error) {
	n, err := recordKeyLen(cs)
	if err != nil {
		return nil, err
	}
	var ctx [8]byte
	binary.BigEndian.PutUint64(ctx[:], seq)
	label, context := labelPayload, ctx[:]
	if v == 4 {
		if seq != 0 {
			return nil, fmt.Errorf("stream: a version 4 connection carries one stream, not stream %d", seq)
		}
		label, context = labelPayloadV4, nil
	}
	k, err := cs.ExportKeyingMaterial(label, context, n)
	if err != nil {
		return nil, fmt.Errorf("stream: exporting the payload key: %w", err)
	}
	return k, nil
}

// setPayloadKey starts the payload records of the next stream on a reused
// connection: a key of its own (never the last one's), its counter from 0.
// Both ends call it after the header exchange, between streams, when no
// payload record is in flight.
func (c *recordConn) setPayloadKey(key []byte) error {
	if c.pay != nil && c.payKey != nil && subtle.ConstantTimeCompare(c.payKey, key) == 1 {
		return fmt.Errorf("%w: the next stream's payload key is the last one's", errRecord)
	}
	ps, err := newAEADState(key)
	if err != nil {
		return err
	}
	c.pay, c.payKey = ps, append([]byte(nil), key...)
	return nil
}

// reusable reports whether c is between two streams in a clean state:
// nothing failed, nothing unread.
func (c *recordConn) reusable() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.werr == nil && c.rerr == nil && len(c.pend) == 0
}

// tlsDrained checks that tc, over f, holds no input: f is at a TLS record
// boundary, and a read of tc that may not touch the socket (f answers it
// with a timeout) returns only that timeout. It consumes post-handshake
// messages (a session ticket) that arrived, and fails if any application
// data or alert did.
func tlsDrained(tc *tls.Conn, f *tlsFramer) error {
	if f.hgot != 0 {
		return fmt.Errorf("stream: %w: TLS connection holds part of a record past the stream header exchange", errRecord)
	}
	f.probe = true
	var b [1]byte
	n, err := tc.Read(b[:])
	f.probe = false
	switch {
	case n > 0:
		return fmt.Errorf("stream: %w: TLS connection holds data past the stream header exchange", errRecord)
	case err == nil:
		return fmt.Errorf("stream: %w: TLS connection not drained", errRecord)
	case errors.Is(err, errProbe) && f.hgot == 0:
		return nil
	}
	return fmt.Errorf("stream: TLS connection failed at the switch to records: %w", err)
}

// sealControl appends p sealed as a control record (header and sealed
// body) to dst.
func (c *recordConn) sealControl(dst, p []byte) ([]byte, error) {
	nonce, err := c.out.next(len(p))
	if err != nil {
		return nil, err
	}
	putRecHeader(c.wad[:], recControl, len(p)+tagLen)
	dst = append(dst, c.wad[:]...)
	return c.out.aead.Seal(dst, nonce, p, c.wad[:]), nil
}

// Write seals p as control records (split at maxControl) and writes them.
func (c *recordConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	done := 0
	for done < len(p) {
		if c.werr != nil {
			return done, c.werr
		}
		k := min(len(p)-done, maxControl)
		b, err := c.sealControl(c.wctl[:0], p[done:done+k])
		if err != nil {
			c.werr = err
			return done, err
		}
		if _, err := c.w.Write(b); err != nil {
			c.werr = err
			return done, err
		}
		done += k
	}
	return done, nil
}

// writePacket writes a packet: its header as a control record and its
// payload (if any) as a payload record sealed into dst (capacity ≥
// len(payload)+tagLen; it may be payload itself), with one writev.
func (c *recordConn) writePacket(hdr []byte, payload, dst []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.werr != nil {
		return c.werr
	}
	if len(hdr) != packetHeaderLen || cap(dst) < len(payload)+tagLen {
		return fmt.Errorf("stream: writePacket: header of %d bytes, %d bytes of room for %d", len(hdr), cap(dst), len(payload)+tagLen)
	}
	h, err := c.sealControl(c.whdr[:0], hdr)
	if err != nil {
		c.werr = err
		return err
	}
	c.iov[0] = h
	c.bufs = c.iov[:1]
	if payload != nil {
		nonce, err := c.pay.next(len(payload))
		if err != nil {
			c.werr = err
			return err
		}
		ph := c.whdr[len(h) : len(h)+recHeaderLen]
		putRecHeader(ph, recPayload, len(payload)+tagLen)
		copy(c.wpad[:], ph)
		copy(c.wpad[recHeaderLen:], hdr)
		c.iov[0] = c.whdr[:len(h)+recHeaderLen]
		c.iov[1] = c.pay.aead.Seal(dst[:0], nonce, payload, c.wpad[:])
		c.bufs = c.iov[:]
	}
	if _, err := c.bufs.WriteTo(c.w); err != nil {
		c.werr = err
		return err
	}
	return nil
}

// forwardPacket writes a packet whose payload record, sealed with the
// stream's payload key, arrived from upstream: its header as a control
// record of this connection, the payload record as it is (sealed holds
// the payload's ciphertext and tag), with one writev. A packet without
// a payload (sealed nil: the CLOSE) is its header's control record only,
// as writePacket sends it: a stray payload record header would be left
// unread in the next datanode's socket, whose close then sends a reset
// that can destroy its close ack in flight.
func (c *recordConn) forwardPacket(hdr []byte, sealed []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.werr != nil {
		return c.werr
	}
	if len(hdr) != packetHeaderLen || (sealed != nil && len(sealed) < tagLen) {
		return fmt.Errorf("stream: forwardPacket: header of %d bytes, sealed payload of %d", len(hdr), len(sealed))
	}
	h, err := c.sealControl(c.whdr[:0], hdr)
	if err != nil {
		c.werr = err
		return err
	}
	c.iov[0] = h
	c.bufs = c.iov[:1]
	if sealed != nil {
		putRecHeader(c.whdr[len(h):len(h)+recHeaderLen], recPayload, len(sealed))
		c.iov[0], c.iov[1] = c.whdr[:len(h)+recHeaderLen], sealed
		c.bufs = c.iov[:]
	}
	if _, err := c.bufs.WriteTo(c.w); err != nil {
		c.werr = err
		return err
	}
	return nil
}

// Read returns the plaintext of control records. A payload record where
// a control record is due is refused. After a failure it returns only
// that failure (not what was left of the last control record).
func (c *recordConn) Read(p []byte) (int, error) {
	if c.rerr != nil {
		return 0, c.rerr
	}
	if len(c.pend) == 0 {
		n, err := c.readRecHeader(recControl, 1, maxControl)
		if err != nil {
			return 0, err
		}
		rec := c.rctl[:n+tagLen]
		if err := c.readOpen(rec); err != nil {
			return 0, err
		}
		c.pend = rec[:n]
	}
	n := copy(p, c.pend)
	c.pend = c.pend[n:]
	return n, nil
}

// readPayload reads the payload record of a packet whose header (hdr,
// as received) said it carries len(buf) bytes and opens it in place:
// buf's capacity must hold the tag too (getBuf's do).
func (c *recordConn) readPayload(hdr, buf []byte) error {
	if err := c.readSealed(buf); err != nil {
		return err
	}
	return c.openPayload(hdr, buf)
}

// readSealed reads the payload record of a packet of len(buf) bytes into
// buf[:len(buf)+tagLen], unopened (for forwarding before openPayload).
func (c *recordConn) readSealed(buf []byte) error {
	if c.rerr != nil {
		return c.rerr
	}
	if len(c.pend) != 0 {
		return c.refuse(fmt.Errorf("%w: %d bytes of a control record unread before a payload", errRecord, len(c.pend)))
	}
	if cap(buf) < len(buf)+tagLen {
		return fmt.Errorf("stream: payload buffer of %d bytes has no room for the tag", cap(buf))
	}
	if _, err := c.readRecHeader(recPayload, len(buf), len(buf)); err != nil {
		return err
	}
	if _, err := io.ReadFull(c.r, buf[:len(buf)+tagLen]); err != nil {
		c.rerr = err
		return err
	}
	copy(c.rpad[:], c.rh[:])
	return nil
}

// openPayload opens the payload record readSealed read into buf, in
// place, bound to its packet header hdr.
func (c *recordConn) openPayload(hdr, buf []byte) error {
	if len(hdr) != packetHeaderLen {
		return fmt.Errorf("stream: openPayload: header of %d bytes", len(hdr))
	}
	copy(c.rpad[recHeaderLen:], hdr)
	nonce, err := c.pay.next(len(buf))
	if err != nil {
		return c.refuse(err)
	}
	if _, err := c.pay.aead.Open(buf[:0], nonce, buf[:len(buf)+tagLen], c.rpad[:]); err != nil {
		return c.refuse(fmt.Errorf("%w: payload record %d (%d bytes) fails authentication (damaged, forged, replayed or out of order)", errRecord, c.pay.seq-1, len(buf)))
	}
	return nil
}

// readRecHeader reads a record header and checks its kind and that its
// plaintext length is within [lo, hi] before anything is read for it.
func (c *recordConn) readRecHeader(kind byte, lo, hi int) (int, error) {
	if _, err := io.ReadFull(c.r, c.rh[:]); err != nil {
		c.rerr = err
		return 0, err
	}
	k, sealed := c.rh[0], int64(binary.BigEndian.Uint32(c.rh[4:]))
	switch {
	case c.rh[1] != 0 || c.rh[2] != 0 || c.rh[3] != 0:
		return 0, c.refuse(fmt.Errorf("%w: reserved bytes %x of a record header are not zero", errRecord, c.rh[1:4]))
	case k != kind:
		return 0, c.refuse(fmt.Errorf("%w: record kind %d, want %d", errRecord, k, kind))
	case sealed-tagLen < int64(lo) || sealed-tagLen > int64(hi):
		return 0, c.refuse(fmt.Errorf("%w: record of kind %d with %d sealed bytes, want %d..%d plus the tag", errRecord, k, sealed, lo, hi))
	}
	return int(sealed - tagLen), nil
}

// readOpen reads the sealed body of the record whose header is in c.rh
// into rec and opens it in place.
func (c *recordConn) readOpen(rec []byte) error {
	if _, err := io.ReadFull(c.r, rec); err != nil {
		c.rerr = err
		return err
	}
	nonce, err := c.in.next(len(rec) - tagLen)
	if err != nil {
		return c.refuse(err)
	}
	if _, err := c.in.aead.Open(rec[:0], nonce, rec, c.rh[:]); err != nil {
		return c.refuse(fmt.Errorf("%w: record %d of kind %d (%d bytes) fails authentication (damaged, forged, replayed or out of order)", errRecord, c.in.seq-1, c.rh[0], len(rec)))
	}
	return nil
}

// refuse makes err sticky: after a refused record nothing more can be
// read from the connection. Its owner fails the stream, sends at most an
// error ack (the other direction, under its own key, is intact) and
// closes the connection.
func (c *recordConn) refuse(err error) error {
	c.rerr = err
	return err
}

// readPayload reads a packet's payload of len(buf) bytes from c: opened
// in place from a record connection (hdr is the packet's header), straight
// from the socket otherwise.
func readPayload(c net.Conn, hdr, buf []byte) error {
	if rc, ok := c.(*recordConn); ok {
		return rc.readPayload(hdr, buf)
	}
	_, err := io.ReadFull(c, buf)
	return err
}
