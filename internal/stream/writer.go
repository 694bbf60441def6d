package stream

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	crcc "github.com/basalt-store/basalt/internal/crc32c"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// Options configure a Writer. Zero values take the defaults noted.
type Options struct {
	// PacketSize is the payload of one packet (default 1 MiB); a multiple
	// of BytesPerChecksum, at most MaxPacketSize.
	PacketSize int
	// Window is how many packets may be unacknowledged (default 16: 16 MiB
	// in flight covers the bandwidth-delay product of a 10 Gb/s link with
	// ~10 ms of disk latency per hop). The Writer itself buffers at most
	// one partial packet; the caller keeps what it needs for a retry.
	Window int
	// ChunkSize is the span of one ChunkInfo in the chunk list (default
	// 4 MiB); a multiple of PacketSize.
	ChunkSize int
	// BytesPerChecksum is the CRC32C window of the chunk list (default
	// 64 KiB).
	BytesPerChecksum int
	// Offset is where the stream starts in the block: 0 for a new block,
	// or its committed length to extend it.
	Offset uint64
	// Timeout is the stall timeout the datanodes use (default 10s); the
	// Writer waits Timeout + (hops-1)·Timeout/2 for an ack, so a datanode
	// in the chain reports a stall below it first, naming the right one.
	Timeout time.Duration
	// TLS authenticates the connection to the first datanode (the
	// client's certificate; the datanode's is verified). Nil: plaintext,
	// which a secured datanode refuses.
	TLS *tls.Config
	// Watch (optional, with TLS) is told of the connection to the first
	// datanode once authenticated (its raw TCP connection) and may close
	// it later, e.g. when that datanode's certificate is revoked
	// (pki.Credentials.Watch); stop is called when the Writer ends.
	Watch func(raw net.Conn, cs *tls.ConnectionState) (stop func())
	// Token is the block's token (package blocktoken), sent in the header.
	Token []byte
	// Pool (optional) keeps the connection after a clean close for the
	// next stream of the same route, and gives Dial one if it has it.
	Pool *ConnPool
	// Fresh makes Dial open a new connection even if Pool holds one for
	// the route (after a CodeStale failure: every hop then opens new
	// connections too); after a clean close it still goes to Pool.
	Fresh bool
	// Version is the protocol version the stream opens at, the same on
	// every hop. 0: Version, and if a datanode of the route refuses it as
	// a version 4 datanode does (Refused), once more at MinVersion on new
	// connections (the same block: every hop that opened it discarded it
	// before the refusal came back). MinVersion (4): a route with a
	// datanode of the previous release (DatanodeDetails.stream_version);
	// the connection is never pooled. Version: exactly it, no fallback.
	Version uint8
}

func (o *Options) setDefaults() error {
	if o.PacketSize == 0 {
		o.PacketSize = DefaultPacketSize
	}
	if o.Window == 0 {
		o.Window = 16
	}
	if o.BytesPerChecksum == 0 {
		o.BytesPerChecksum = 64 << 10
	}
	if o.ChunkSize == 0 {
		o.ChunkSize = max(4<<20, o.PacketSize)
	}
	if o.Timeout == 0 {
		o.Timeout = 10 * time.Second
	}
	switch {
	case o.Version != 0 && (o.Version < MinVersion || o.Version > Version):
		return fmt.Errorf("stream: protocol version %d outside [%d, %d]", o.Version, MinVersion, Version)
	case o.PacketSize < 0 || o.PacketSize > MaxPacketSize:
		return fmt.Errorf("stream: packet size %d outside (0, %d]", o.PacketSize, MaxPacketSize)
	case o.BytesPerChecksum < 512 || o.PacketSize%o.BytesPerChecksum != 0:
		return fmt.Errorf("stream: packet size %d is not a multiple of bytes per checksum %d (≥ 512)", o.PacketSize, o.BytesPerChecksum)
	case o.ChunkSize%o.PacketSize != 0:
		return fmt.Errorf("stream: chunk size %d is not a multiple of packet size %d", o.ChunkSize, o.PacketSize)
	case o.Window < 1 || o.Window > 1024:
		return fmt.Errorf("stream: window %d outside [1, 1024]", o.Window)
	}
	return nil
}

// Chunk is one entry of the chunk list the client commits with PutBlock:
// a span of the block and the CRC32C of each BytesPerChecksum window of
// it, computed by the Writer from the bytes it sent.
type Chunk struct {
	Offset, Length   uint64
	BytesPerChecksum uint32
	Sums             []byte // 4 bytes (big-endian CRC32C) per window
}

// Proto converts the chunk for a PutBlock.
func (c Chunk) Proto() *datanodepb.ChunkInfo {
	return &datanodepb.ChunkInfo{Offset: c.Offset, Length: c.Length, Checksum: &datanodepb.ChecksumData{
		Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: c.BytesPerChecksum, Sums: c.Sums}}
}

// BlockData is the PutBlock payload for a block written by one stream
// from offset 0. (A stream that extends a committed block appends its
// chunks to the committed list.)
func BlockData(b BlockID, length uint64, chunks []Chunk) *datanodepb.BlockData {
	bd := &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: b.Container, LocalId: b.Local}, Length: length}
	for _, c := range chunks {
		bd.Chunks = append(bd.Chunks, c.Proto())
	}
	return bd
}

// Writer streams one block through a chain of datanodes. Write and Close
// are for one goroutine; acks are read by another.
type Writer struct {
	opts  Options
	route []Target
	block BlockID
	conn  net.Conn
	wait  time.Duration // for an ack

	buf *[]byte // a partial packet
	n   int
	// sealBuf receives each payload record of a secured stream: the
	// caller's bytes are sealed from where they are, never in place.
	sealBuf *[]byte

	seq, off uint64
	chunks   []Chunk
	shift    crcc.Shift // combines a full window's CRC32C
	hdr      [packetHeaderLen]byte
	iov      [2][]byte
	bufs     net.Buffers // over iov; a field so WriteTo does not allocate
	timer    *time.Timer

	slots    chan struct{} // one per unacknowledged data packet
	inflight chan expect   // what the next acks must say, in order
	ackDone  chan struct{} // closed when the ack reader ends
	err      error         // why it ended (nil after a clean close); read after ackDone
	final    uint64        // the close ack's length
	closed   bool
	// pc is the connection and what its next stream needs; after a clean
	// close it goes back to Options.Pool (version 5 only).
	pc *pooledConn
	// downgraded: Options.Version was 0 and a datanode of the route
	// refused version 5, so the stream runs at version 4.
	downgraded bool
	refusedBy  uint64 // the datanode whose refusal downgraded it
	// imu orders Interrupt against Close handing the connection to the
	// pool: once released, Interrupt leaves it alone; once interrupted,
	// it is never pooled.
	imu         sync.Mutex
	released    bool
	interrupted bool
}

type expect struct {
	close bool
	seq   uint64
	end   uint64
}

// Dial opens a stream for block of pipeline through route, nearest
// datanode first (the order the client wants the data to travel; see
// OrderRoute). It returns once every datanode of the route has accepted
// the stream, or an *Error naming the datanode that refused or could not
// be reached. With Options.Pool it takes an idle connection of the same
// route from the pool if there is one (see ConnPool).
//
// With Options.Version 0 a route with a version 4 datanode on it (whose
// advertisement was missing or stale) costs one refused header, then the
// stream opens at version 4 (Writer.Downgraded); nothing is blamed for
// the refusal.
func Dial(ctx context.Context, route []Target, pipeline uint64, block BlockID, opts Options) (*Writer, error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	if len(route) == 0 || len(route) > MaxRoute {
		return nil, fmt.Errorf("stream: route of %d datanodes for block %v (want 1..%d)", len(route), block, MaxRoute)
	}
	auto := opts.Version == 0
	if auto {
		opts.Version = Version
	}
	w, err := dialAt(ctx, route, pipeline, block, opts)
	if err != nil && auto && Refused(err) && ctx.Err() == nil {
		// A datanode of the previous release on the route refused the
		// version 5 header (before anything of the stream was stored:
		// each hop above it discarded the block before passing the
		// refusal up). Once, at version 4, on new connections.
		var se *Error
		errors.As(err, &se)
		opts.Version = MinVersion
		if w, err = dialAt(ctx, route, pipeline, block, opts); w != nil {
			w.downgraded = true
			// The refusal names its datanode; remembered (RefusedBy)
			// only if that is one of the route's: any datanode of it
			// could name another ID.
			for _, t := range route {
				if t.ID == se.Datanode {
					w.refusedBy = se.Datanode
				}
			}
		}
	}
	return w, err
}

// Refused reports whether err is a datanode's refusal of a version 5
// header as a datanode that speaks only version 4 words it (the previous
// release: "bad stream header: version 5, this datanode speaks 4", an
// error ack through TLS, relayed unchanged by the hops above it).
func Refused(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == CodeBadHeader &&
		strings.HasSuffix(e.Reason, fmt.Sprintf("version %d, this datanode speaks %d", Version, MinVersion))
}

// dialAt is Dial at opts.Version exactly.
func dialAt(ctx context.Context, route []Target, pipeline uint64, block BlockID, opts Options) (*Writer, error) {
	h := Header{Pipeline: pipeline, Block: block, Offset: opts.Offset, PacketSize: uint32(opts.PacketSize), Route: route[1:], Token: opts.Token, version: opts.Version}
	hb, err := encodeHeader(nil, &h)
	if err != nil {
		return nil, err
	}
	if opts.Version < 5 {
		opts.Pool = nil // a version 4 connection carries one stream
	}
	var key poolKey
	if p := opts.Pool; p != nil {
		key = keyFor(route, opts.TLS)
		for pc := p.take(key, opts.Fresh); pc != nil; pc = p.take(key, false) {
			// A datanode closes an idle connection (its ReuseIdle or
			// MaxConnAge ran out, beyond its MaxIdle, on restart): seen
			// here, before the header is written, nothing of this stream
			// reached it and another connection is as safe as a first.
			if err := checkIdle(pc.conn); err != nil {
				p.stale.Add(1)
				pc.close()
				continue
			}
			hookKept(pc.conn)
			w, unsent, err := dialOn(ctx, pc, route, block, hb, opts)
			if !unsent {
				// Opened, refused, or failed after the header went out:
				// the datanode may have opened the stream, so a failure
				// is the stream's (the caller retries with a new block).
				// CodeStale: the connection (or one down the route) ended
				// before the header was answered, most likely closed
				// idle as the header crossed; still the stream's, but
				// the caller need not blame the datanode (doc.go).
				p.reuses.Add(1)
				var se *Error
				if errors.As(err, &se) && se.Code == CodeStale {
					p.staleHeaders.Add(1)
				}
				return w, err
			}
			// The header's write failed: the datanode cannot have read
			// it whole.
			p.stale.Add(1)
		}
		p.dials.Add(1)
	}
	pc, err := connect(ctx, route[0], opts)
	if err != nil {
		return nil, err
	}
	pc.key, pc.born = key, time.Now()
	w, _, err := dialOn(ctx, pc, route, block, hb, opts)
	return w, err
}

// connect opens a new connection to the first datanode and authenticates
// it.
func connect(ctx context.Context, first Target, opts Options) (*pooledConn, error) {
	d := net.Dialer{Timeout: opts.Timeout}
	conn, err := d.DialContext(ctx, "tcp", first.Addr)
	if err != nil {
		return nil, &Error{Code: CodeUnreachable, Datanode: first.ID, Addr: first.Addr, Reason: fmt.Sprintf("client cannot connect: %v", err)}
	}
	pc := &pooledConn{conn: conn}
	if opts.TLS != nil {
		tc := tls.Client(framedTLS(conn), opts.TLS)
		conn.SetDeadline(time.Now().Add(opts.Timeout))
		if err := tc.HandshakeContext(ctx); err != nil {
			conn.Close()
			return nil, &Error{Code: CodeUnreachable, Datanode: first.ID, Addr: first.Addr, Reason: fmt.Sprintf("client cannot connect: TLS: %v", err)}
		}
		cs := tc.ConnectionState()
		if opts.Watch != nil {
			pc.unwatch = opts.Watch(conn, &cs)
		}
		pc.conn, pc.cs = tc, &cs
	}
	return pc, nil
}

// dialOn opens the stream on pc: a new connection (its header and ack go
// through TLS, then records) or a pooled one (a record connection, or
// plaintext, between streams). unsent: pc was pooled and writing the
// header failed, so the datanode cannot have read it whole (a failure
// after the write is ambiguous: the datanode may have opened the stream).
// On any error pc is closed.
func dialOn(ctx context.Context, pc *pooledConn, route []Target, block BlockID, hb []byte, opts Options) (_ *Writer, unsent bool, rerr error) {
	first := route[0]
	defer func() {
		if rerr != nil {
			pc.close()
		}
	}()
	conn := pc.conn
	w := &Writer{opts: opts, route: route, block: block, conn: conn, off: opts.Offset, pc: pc,
		wait:  ackTimeout(opts.Timeout, len(route)),
		slots: make(chan struct{}, opts.Window), inflight: make(chan expect, opts.Window+1), ackDone: make(chan struct{})}
	// Each datanode connects to the next before answering.
	dl := time.Now().Add(w.wait + time.Duration(len(route))*opts.Timeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(dl) {
		dl = cd
	}
	conn.SetDeadline(dl)
	// The dial and handshake above end with ctx themselves; so does the
	// header's exchange (each hop connects to the next before answering):
	// ctx's end moves the deadline to the past.
	hc := conn
	stop := context.AfterFunc(ctx, func() { hc.SetDeadline(time.Unix(1, 0)) })
	var a ack
	var ab [ackLen]byte
	var got int64 // bytes of the answer received
	_, err := conn.Write(hb)
	werr := err != nil
	if err == nil {
		got, err = readAnswer(conn, &ab, &a)
	}
	if !stop() {
		return nil, false, &Error{Code: CodeConnLost, Datanode: first.ID, Addr: first.Addr, Reason: fmt.Sprintf("opening the stream: %v", context.Cause(ctx))}
	}
	kept := pc.seq > 0
	switch {
	case err != nil && kept && !werr && staleEnd(err, got):
		// The kept connection ended before any of the answer arrived:
		// the datanode most likely closed it idle as the header crossed
		// (or died: then a new connection fails and names it). It may
		// have read the header: the stream is abandoned, never opened
		// again on another connection (doc.go, "Reuse").
		return nil, false, &Error{Code: CodeStale, Datanode: first.ID, Addr: first.Addr,
			Reason: fmt.Sprintf("block %v: kept connection ended before the header was answered: %v", block, err)}
	case err != nil:
		return nil, kept && werr, w.connErr(err, "opening the stream")
	case a.kind == kindError:
		e := ackError(&a, route)
		if e.Code == CodeStale && !kept {
			// No hop of a new connection has a kept connection down.
			e.Code = CodeConnLost
		}
		return nil, false, e
	case a.kind != kindHeaderAck || a.value != opts.Offset:
		return nil, false, &Error{Code: CodeProtocol, Datanode: first.ID, Addr: first.Addr,
			Reason: fmt.Sprintf("answered the header with ack kind %#x value %d", a.kind, a.value)}
	}
	switch c := conn.(type) {
	case *tls.Conn:
		// The header ack was the last frame through TLS: records from here
		// (record.go).
		pk, err := payloadKeyV(pc.cs, 0, opts.Version)
		var rc *recordConn
		if err == nil {
			rc, err = switchToRecordsV(c, true, pk, opts.Version)
		}
		if err != nil {
			return nil, false, &Error{Code: CodeProtocol, Datanode: first.ID, Addr: first.Addr, Reason: fmt.Sprintf("client cannot switch the connection to records: %v", err)}
		}
		w.conn, pc.conn = rc, rc
	case *recordConn:
		// The next stream on a reused connection: a payload key of its own.
		pk, err := payloadKey(pc.cs, pc.seq)
		if err == nil {
			err = c.setPayloadKey(pk)
		}
		if err != nil {
			return nil, false, &Error{Code: CodeProtocol, Datanode: first.ID, Addr: first.Addr, Reason: fmt.Sprintf("client cannot key the stream: %v", err)}
		}
	}
	if _, ok := w.conn.(*recordConn); ok {
		w.sealBuf = getBuf(opts.PacketSize)
	}
	pc.seq++
	w.conn.SetDeadline(time.Time{})
	w.buf = getBuf(opts.PacketSize)
	w.timer = time.NewTimer(time.Hour)
	w.timer.Stop()
	go w.readAcks()
	return w, false, nil
}

// connErr describes a failure of the connection to the first datanode.
func (w *Writer) connErr(err error, doing string) *Error {
	code := CodeConnLost
	if isTimeout(err) {
		code = CodeTimeout
	}
	return &Error{Code: code, Datanode: w.route[0].ID, Addr: w.route[0].Addr,
		Reason: fmt.Sprintf("block %v: connection lost %s: %v", w.block, doing, err)}
}

func (w *Writer) readAcks() {
	defer close(w.ackDone)
	var b [ackLen]byte
	for {
		var a ack
		if err := readAck(w.conn, &b, &a); err != nil {
			if errors.Is(err, errBadAck) || errors.Is(err, errRecord) {
				w.err = &Error{Code: CodeProtocol, Datanode: w.route[0].ID, Addr: w.route[0].Addr, Reason: err.Error()}
			} else {
				w.err = w.connErr(err, "waiting for acks")
			}
			return
		}
		if a.kind == kindError {
			e := ackError(&a, w.route)
			if e.Code == CodeStale {
				// Only the answer to a header may say stale.
				e.Code = CodeConnLost
			}
			w.err = e
			return
		}
		var e expect
		select {
		case e = <-w.inflight:
		default:
			w.err = &Error{Code: CodeProtocol, Datanode: w.route[0].ID, Addr: w.route[0].Addr, Reason: fmt.Sprintf("ack kind %#x seq %d for nothing sent", a.kind, a.seq)}
			return
		}
		if e.close {
			if a.kind != kindCloseAck || a.value != e.end {
				w.err = &Error{Code: CodeProtocol, Datanode: w.route[0].ID, Addr: w.route[0].Addr,
					Reason: fmt.Sprintf("close answered by ack kind %#x value %d, want close ack at %d", a.kind, a.value, e.end)}
			}
			w.final = a.value
			return
		}
		if a.kind != kindDataAck || a.seq != e.seq || a.value != e.end {
			w.err = &Error{Code: CodeProtocol, Datanode: w.route[0].ID, Addr: w.route[0].Addr,
				Reason: fmt.Sprintf("ack kind %#x seq %d value %d, want data ack %d at %d", a.kind, a.seq, a.value, e.seq, e.end)}
			return
		}
		<-w.slots
	}
}

// failed returns the stream's error once the ack reader ended.
func (w *Writer) failed() error {
	select {
	case <-w.ackDone:
		if w.err == nil {
			return &Error{Code: CodeProtocol, Datanode: w.route[0].ID, Reason: "stream already closed"}
		}
		return w.err
	default:
		return nil
	}
}

// Write sends p, in packets of PacketSize. It returns once the packets
// are handed to the kernel, with at most Window of them unacknowledged;
// it blocks while the window is full. A full packet's worth of p is sent
// straight from p; smaller writes are gathered in one packet buffer. On a
// broken chain it returns an *Error naming the datanode that failed;
// the stream is then dead (call Abort) and the caller resends from its
// own buffer on a new block.
func (w *Writer) Write(p []byte) (int, error) {
	if w.closed {
		return 0, errors.New("stream: write after close")
	}
	done := 0
	ps := w.opts.PacketSize
	for done < len(p) {
		if err := w.failed(); err != nil {
			return done, err
		}
		if w.n == 0 && len(p)-done >= ps {
			if err := w.send(p[done : done+ps]); err != nil {
				return done, err
			}
			done += ps
			continue
		}
		k := copy((*w.buf)[w.n:ps], p[done:])
		copied.Add(uint64(k))
		w.n += k
		done += k
		if w.n == ps {
			if err := w.send((*w.buf)[:ps]); err != nil {
				return done, err
			}
			w.n = 0
		}
	}
	return done, nil
}

// send sends one data packet, waiting for a window slot.
func (w *Writer) send(payload []byte) error {
	select {
	case w.slots <- struct{}{}:
	default:
		w.timer.Reset(w.wait)
		select {
		case w.slots <- struct{}{}:
			w.timer.Stop()
		case <-w.ackDone:
			w.timer.Stop()
			return w.failed()
		case <-w.timer.C:
			return w.stall()
		}
	}
	crc := w.addSums(payload)
	ph := packetHeader{kind: kindData, length: uint32(len(payload)), seq: w.seq, offset: w.off, crc: crc}
	end := w.off + uint64(len(payload))
	w.inflight <- expect{seq: w.seq, end: end}
	if err := w.writePacket(&ph, payload); err != nil {
		return err
	}
	w.seq++
	w.off = end
	return nil
}

func (w *Writer) stall() error {
	closeRaw(w.conn)
	<-w.ackDone
	return &Error{Code: CodeTimeout, Datanode: w.route[0].ID, Addr: w.route[0].Addr,
		Reason: fmt.Sprintf("block %v: no ack from the chain within %s (%d packets in flight)", w.block, w.wait, len(w.slots))}
}

func (w *Writer) writePacket(ph *packetHeader, payload []byte) error {
	ph.encode(&w.hdr)
	w.conn.SetWriteDeadline(time.Now().Add(w.wait))
	var err error
	if rc, ok := w.conn.(*recordConn); ok {
		err = rc.writePacket(w.hdr[:], payload, *w.sealBuf)
	} else {
		w.iov[0], w.iov[1] = w.hdr[:], payload
		w.bufs = w.iov[:]
		if payload == nil {
			w.bufs = w.bufs[:1]
		}
		_, err = w.bufs.WriteTo(w.conn)
	}
	if err != nil {
		// The chain most likely sent an error ack saying which datanode
		// failed; the ack reader will have it, or see the connection end.
		w.timer.Reset(w.wait)
		select {
		case <-w.ackDone:
			w.timer.Stop()
			if e := w.failed(); e != nil {
				return e
			}
		case <-w.timer.C:
			closeRaw(w.conn)
			<-w.ackDone
		}
		return w.connErr(err, fmt.Sprintf("sending packet %d", ph.seq))
	}
	return nil
}

// addSums extends the chunk list with the CRC32C windows of payload, which
// starts at w.off, a multiple of PacketSize from the stream's start, and
// returns the CRC32C of the whole payload for the packet header, combined
// from the windows' (one pass over the data, not two).
func (w *Writer) addSums(payload []byte) uint32 {
	bpc := w.opts.BytesPerChecksum
	if len(w.chunks) == 0 || w.chunks[len(w.chunks)-1].Length == uint64(w.opts.ChunkSize) {
		w.chunks = append(w.chunks, Chunk{Offset: w.off, BytesPerChecksum: uint32(bpc),
			Sums: make([]byte, 0, 4*(w.opts.ChunkSize/bpc))})
	}
	if w.shift == 0 {
		w.shift = crcc.ShiftFor(int64(bpc))
	}
	c := &w.chunks[len(w.chunks)-1]
	var crc uint32
	for i := 0; i < len(payload); i += bpc {
		win := payload[i:min(i+bpc, len(payload))]
		s := crcc.Checksum(win)
		summed.Add(uint64(len(win)))
		c.Sums = binary.BigEndian.AppendUint32(c.Sums, s)
		if len(win) == bpc {
			crc = w.shift.Combine(crc, s)
		} else {
			crc = crcc.Combine(crc, s, int64(len(win)))
		}
	}
	c.Length += uint64(len(payload))
	return crc
}

// Close sends what is buffered and the CLOSE frame, and waits until every
// datanode of the route synced the block. It returns the block's length
// (Offset + bytes written) and the chunk list for PutBlock (spans from
// Offset). The block is not committed: the caller sends PutBlock
// (wait_all) through the pipeline's Raft group. On error the stream is
// aborted and every datanode discards what it stored.
func (w *Writer) Close() (uint64, []Chunk, error) {
	if w.closed {
		return 0, nil, errors.New("stream: close after close")
	}
	err := w.close()
	w.closed = true
	w.release(err == nil)
	w.putBufs()
	if err != nil {
		return 0, nil, err
	}
	return w.off, w.chunks, nil
}

// Version is the protocol version the stream runs at, on every hop.
func (w *Writer) Version() uint8 { return w.opts.Version }

// Downgraded reports whether the stream runs at version 4 because a
// datanode of the route refused version 5 (Options.Version 0).
func (w *Writer) Downgraded() bool { return w.downgraded }

// RefusedBy is the datanode whose refusal of version 5 downgraded the
// stream (0: none, or it named a datanode not on the route).
func (w *Writer) RefusedBy() uint64 { return w.refusedBy }

// release ends the Writer's use of its connection: back to the pool after
// a clean close (the ack reader ended on the close ack, nothing is
// unread), closed otherwise.
func (w *Writer) release(clean bool) {
	w.imu.Lock()
	defer w.imu.Unlock()
	if w.released {
		return
	}
	w.released = true
	if clean && !w.interrupted && w.opts.Pool != nil {
		if rc, ok := w.conn.(*recordConn); !ok || rc.reusable() {
			w.opts.Pool.put(w.pc)
			return
		}
	}
	w.pc.close()
}

func (w *Writer) close() error {
	if err := w.failed(); err != nil {
		return err
	}
	if w.n > 0 {
		if err := w.send((*w.buf)[:w.n]); err != nil {
			return err
		}
		w.n = 0
	}
	w.inflight <- expect{close: true, seq: w.seq, end: w.off}
	ph := packetHeader{kind: kindClose, seq: w.seq, offset: w.off}
	if err := w.writePacket(&ph, nil); err != nil {
		return err
	}
	// Every datanode syncs before it acks the close; allow for a slow
	// fsync of a whole block on top of the stall timeout.
	w.timer.Reset(w.wait)
	select {
	case <-w.ackDone:
		w.timer.Stop()
	case <-w.timer.C:
		return w.stall()
	}
	if w.err != nil {
		return w.err
	}
	if w.final != w.off {
		return &Error{Code: CodeProtocol, Datanode: w.route[0].ID, Reason: fmt.Sprintf("closed at length %d, sent %d", w.final, w.off)}
	}
	return nil
}

// Abort drops the stream: the datanodes see the connection end without a
// CLOSE and discard what they stored. Safe after Close or an error.
func (w *Writer) Abort() {
	if w.closed {
		return
	}
	w.closed = true
	w.Interrupt()
	w.release(false)
	<-w.ackDone
	w.putBufs()
}

// Interrupt ends the stream's connection, so that a Write or Close under
// way on another goroutine that waits for acks (or for room in the
// window) returns with an error instead of waiting up to its timeout. A
// Write that only copies into the packet buffer may still succeed after
// Interrupt; the next send, or Close, fails. Safe to call concurrently
// with Write and Close; the owner still calls Abort once they returned.
func (w *Writer) Interrupt() {
	w.imu.Lock()
	defer w.imu.Unlock()
	if !w.released {
		w.interrupted = true
		closeRaw(w.conn)
	}
}

func (w *Writer) putBufs() {
	putBuf(w.buf)
	if w.sealBuf != nil {
		putBuf(w.sealBuf)
	}
}

// Offset is where the next byte written goes in the block (bytes sent so
// far plus the start offset; buffered bytes not included).
func (w *Writer) Offset() uint64 { return w.off }

var _ io.Writer = (*Writer)(nil)
