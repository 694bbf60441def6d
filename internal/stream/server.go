package stream

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/basalt-store/basalt/internal/guard"
)

// Sink is where one stream's data goes on a datanode
// (storage.BlockStream): sequential writes, Close syncs, Abort discards
// everything the stream wrote.
type Sink interface {
	Write(p []byte) (int, error)
	Close() error
	Abort() error
}

// Backend validates a stream's header for this datanode and opens its
// sink. A refusal should be an *Error whose Code says why (the server fills
// in the datanode); any other error is reported as CodeIO.
type Backend interface {
	Open(h *Header) (Sink, error)
}

// ServerConfig configures a Server. Zero values take the defaults noted.
type ServerConfig struct {
	// ID is this datanode's ID; errors name it.
	ID      uint64
	Backend Backend
	// Timeout bounds every wait on a peer that should be making progress:
	// a payload being received, a downstream connect, a downstream ack, an
	// ack written upstream (default 10s). A datanode waiting on k hops
	// below it waits Timeout + (k-1)·Timeout/2, so the one next to a stall
	// reports it first and names the right datanode.
	Timeout time.Duration
	// IdleTimeout bounds the wait for the next packet from upstream: a
	// client may pause between writes (default 60s).
	IdleTimeout time.Duration
	// MaxStreams bounds concurrent streams (default 256).
	MaxStreams int
	// Queue is how many received packets may wait for the disk per stream
	// (default 4); with MaxStreams and the packet size it bounds memory.
	Queue  int
	Logger *slog.Logger
	// Guard recovers a panic in a stream's goroutines into a CodeInternal
	// failure of that stream, logged and counted (nil: a guard of the
	// server's own, logging to Logger, exported nowhere).
	Guard *guard.Guard
	// Security authenticates both ends of every connection and decides
	// who may open a stream and where it may be forwarded (nil:
	// plaintext, anyone may connect and route anywhere: for tests of this
	// package only).
	Security *Security
	// MaxHandshakes bounds the connections accepted but not yet through
	// the TLS handshake and the header (default 64); more are closed at
	// once.
	MaxHandshakes int
	// ReuseIdle bounds the wait for the next stream's header on a
	// connection whose stream closed cleanly (default 60s); a datanode at
	// hop k waits ReuseIdle + k·Timeout, so each waits longer than the one
	// above it, which keeps its connection down only while it waits
	// itself. Clients pool for less (DefaultPoolIdle).
	ReuseIdle time.Duration
	// MaxIdle bounds the connections waiting for a next header (default
	// 256); a connection whose stream closed cleanly beyond it is closed.
	MaxIdle int
	// MaxConnAge bounds how long a connection may carry streams after its
	// handshake (default 15 min; clients pool for less, DefaultPoolMaxAge);
	// no stream starts on it past its peer certificate's NotAfter either.
	// An accepted connection is closed then instead of waiting for a next
	// header; a connection to the next datanode is not reused past
	// MaxConnAge less a margin (the next datanode closes its end at
	// MaxConnAge) or past the next datanode's NotAfter.
	MaxConnAge time.Duration
	// OnlyVersion, for tests of rolling upgrades: a server that serves
	// only this protocol version and refuses any other header as a
	// datanode of that release did ("version 5, this datanode speaks 4");
	// with 4 it acts as a version 4 datanode on the wire (one stream per
	// connection, streams forwarded at version 4). 0 (production): any
	// version from MinVersion to Version, each stream with its own.
	OnlyVersion uint8
}

// Security is the stream port's authentication. Every connection is
// mutual TLS; a stream's opener must be allowed to open it (Upstream), and
// a route entry must name a datanode the cluster knows at the address it
// registered (Target), proven by that datanode's certificate (Verify),
// before this datanode connects to it: a header cannot make a datanode
// connect to an arbitrary host and port.
type Security struct {
	// Server is used for accepted connections (it must require a client
	// certificate), Client for the connection to the next datanode.
	Server, Client *tls.Config
	// Upstream checks the verified opener of a stream with header h
	// (e.g. a later hop must come from a datanode). Nil: any.
	Upstream func(cs *tls.ConnectionState, h *Header) error
	// Target checks a route entry before connecting to it; Verify checks
	// the certificate the target presented. Both are required.
	Target func(t Target) error
	Verify func(t Target, cs *tls.ConnectionState) error
	// Watch (optional) is told of every accepted, authenticated
	// connection and of every connection to the next datanode (its raw
	// TCP connection) and may close it later, e.g. when the peer's
	// certificate is revoked (pki.Credentials.Watch); stop is called when
	// the connection ends.
	Watch func(raw net.Conn, cs *tls.ConnectionState) (stop func())
}

// Stats are a server's counters since it started.
type Stats struct {
	// FirstHop and Downstream count the headers received from a client
	// (hop 0) and from another datanode: attempts, including a stream
	// then refused as busy (counted in Failed too; Reused likewise).
	FirstHop      uint64
	Downstream    uint64
	BytesReceived uint64 // payload bytes received
	Failed        uint64 // streams that ended in an error
	Refused       uint64 // connections refused: TLS, identity, route or too many handshakes
	Accepted      uint64 // connections accepted
	Reused        uint64 // streams opened on a connection that carried one before
	DownDials     uint64 // connections opened to a next datanode
	DownStale     uint64 // kept connections to a next datanode found closed or expired before a header (then dialed anew)
	// DownStaleHeaders counts streams failed with CodeStale: a kept
	// connection to the next datanode ended before it answered the header.
	DownStaleHeaders uint64
	// V4Streams counts streams served at protocol version 4 (by a client
	// or datanode of the previous release, or a client that found one on
	// the route): nonzero while a rolling upgrade is not finished. A
	// stream refused as busy is not counted.
	V4Streams uint64
	Active    int64 // streams open now
	Idle      int64 // connections waiting for a next header now
}

// Server accepts streams on its own TCP port, stores each through its
// Backend and forwards it along the route (see doc.go).
type Server struct {
	cfg ServerConfig
	log *slog.Logger

	mu      sync.Mutex
	lis     []net.Listener
	conns   map[net.Conn]func() // open connections → Security.Watch's stop (or nil)
	closing atomic.Bool
	wg      sync.WaitGroup

	handshakes chan struct{} // a slot per connection not yet through its header

	idle                                         atomic.Int64 // connections waiting for a next header
	firstHop, downstream, bytes, failed, refused atomic.Uint64
	accepted, reused, downDials, downStale       atomic.Uint64
	downStaleHeaders, v4Streams                  atomic.Uint64
	active                                       atomic.Int64
}

// NewServer returns a server; Serve starts it.
func NewServer(cfg ServerConfig) *Server {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 60 * time.Second
	}
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = 256
	}
	if cfg.Queue <= 0 {
		cfg.Queue = 4
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Guard == nil {
		cfg.Guard = guard.New(nil, cfg.Logger)
	}
	if cfg.MaxIdle <= 0 {
		cfg.MaxIdle = 256
	}
	if cfg.ReuseIdle <= 0 {
		cfg.ReuseIdle = 60 * time.Second
	}
	if cfg.MaxConnAge <= 0 {
		cfg.MaxConnAge = 15 * time.Minute
	}
	if cfg.MaxHandshakes <= 0 {
		cfg.MaxHandshakes = 64
	}
	if sec := cfg.Security; sec != nil && sec.Server != nil {
		// No TLS 1.3 session tickets: a ticket is a post-handshake message
		// that could arrive at the opener after the switch to records
		// (see switchToRecords), and a resumed session would skip the
		// certificate checks.
		c := *sec
		c.Server = sec.Server.Clone()
		c.Server.SessionTicketsDisabled = true
		cfg.Security = &c
	}
	return &Server{cfg: cfg, log: cfg.Logger, conns: map[net.Conn]func(){}, handshakes: make(chan struct{}, cfg.MaxHandshakes)}
}

// Stats returns the counters.
func (s *Server) Stats() Stats {
	return Stats{FirstHop: s.firstHop.Load(), Downstream: s.downstream.Load(), BytesReceived: s.bytes.Load(),
		Failed: s.failed.Load(), Refused: s.refused.Load(), Accepted: s.accepted.Load(), Reused: s.reused.Load(),
		DownDials: s.downDials.Load(), DownStale: s.downStale.Load(), DownStaleHeaders: s.downStaleHeaders.Load(),
		V4Streams: s.v4Streams.Load(),
		Active:    s.active.Load(), Idle: s.idle.Load()}
}

// Serve accepts streams on l until Close. It returns nil after Close.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		l.Close()
		return nil
	}
	s.lis = append(s.lis, l)
	s.mu.Unlock()
	backoff := 5 * time.Millisecond
	for {
		c, err := l.Accept()
		if err != nil {
			if s.closing.Load() {
				return nil
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() || errors.Is(err, os.ErrDeadlineExceeded) {
				continue
			}
			// Out of descriptors and the like: back off rather than spin.
			s.log.Warn("stream accept failed", "addr", l.Addr(), "err", err)
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		s.mu.Lock()
		if s.closing.Load() {
			s.mu.Unlock()
			c.Close()
			return nil
		}
		s.conns[c] = nil
		s.accepted.Add(1)
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(c)
	}
}

// Close stops accepting, breaks every open stream (their upstreams see the
// connection drop; each stream discards its data) and waits for them.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closing.Store(true)
	for _, l := range s.lis {
		l.Close()
	}
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// stream is one stream on this datanode.
type stream struct {
	s    *Server
	h    *Header
	up   net.Conn
	down net.Conn // nil at the end of the route; owned by the upConn
	next Target
	sink Sink

	once  sync.Once
	err   *Error
	abort chan struct{}

	hb   [packetHeaderLen]byte
	iov  [2][]byte   // header + payload, one writev downstream
	bufs net.Buffers // over iov; a field so WriteTo does not allocate
}

// upConn is one accepted connection across the streams it carries (doc.go,
// "Reuse"), and the connection to the next datanode it keeps while the
// next stream's route stays the same.
type upConn struct {
	// cs is the authenticated session (nil: plaintext): the opener is
	// checked against every header, and a client's stream number seq
	// keys that stream's payload.
	cs  *tls.ConnectionState
	hop uint8 // every header on the connection has the first's hop
	// version: every header on the connection has the first's; a
	// version 4 connection carries one stream.
	version uint8
	seq     uint64 // streams opened on it so far
	st      *stream
	// expires: no stream starts on the connection from then (MaxConnAge
	// after the handshake, or the opener's certificate's NotAfter).
	expires time.Time

	down        net.Conn  // a record connection (or plaintext) between streams
	downStop    func()    // Security.Watch's stop for down
	downRoute   []Target  // the route down carries: the next datanode first
	downExpires time.Time // down carries no header from then
}

// closeDown closes the connection to the next datanode, if any.
func (uc *upConn) closeDown() {
	if uc.down != nil {
		closeRaw(uc.down)
		uc.down = nil
	}
	if uc.downStop != nil {
		uc.downStop()
		uc.downStop = nil
	}
	uc.downRoute = nil
	uc.downExpires = time.Time{}
}

// packet is a received packet on its way to the disk; done its way to the
// ack.
type packet struct {
	close bool
	seq   uint64
	off   uint64
	crc   uint32
	buf   *[]byte
	n     int
}

type done struct {
	close bool
	seq   uint64
	end   uint64
}

// guardWhere labels the stream server's recovered panics.
const guardWhere = "stream"

// internalError is what a stream's upstream learns of a recovered panic:
// where, not the stack (that is in the log).
func (s *Server) internalError(pe *guard.PanicError) *Error {
	return &Error{Code: CodeInternal, Datanode: s.cfg.ID, Reason: fmt.Sprintf("datanode %d: %v", s.cfg.ID, pe)}
}

// handle serves one connection. A panic anywhere in it fails this stream
// only: the upstream gets a CodeInternal error (through the connection as
// the opener then reads it: plain, TLS or records; on a secured one
// before the handshake, nothing) and the stream's data is discarded; the
// datanode serves on.
func (s *Server) handle(up net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		stop := s.conns[up]
		delete(s.conns, up)
		s.mu.Unlock()
		if stop != nil {
			stop()
		}
		up.Close()
	}()
	uc := &upConn{}
	var live net.Conn // what the opener reads acks from
	if s.cfg.Security == nil {
		live = up
	}
	err := s.cfg.Guard.Run(guardWhere, func() error { s.serve(up, uc, &live); return nil })
	var pe *guard.PanicError
	if !errors.As(err, &pe) {
		uc.closeDown()
		return
	}
	s.failed.Add(1)
	if st := uc.st; st != nil {
		s.cfg.Guard.Run(guardWhere, func() error {
			st.fail(s.internalError(pe))
			st.abortSink()
			return nil
		})
	}
	uc.closeDown()
	if live != nil {
		s.refuse(live, s.internalError(pe))
	}
}

// serve runs the streams of connection up, one after another: the first
// header comes through TLS (or plaintext), each next one, after a clean
// close, as control records (see doc.go, "Reuse"). uc.st is set once a
// stream exists, so that handle can discard its data if serve panics, and
// *live is the connection the opener reads acks from (the TLS connection
// once authenticated, the record connection once the header ack is sent).
func (s *Server) serve(up net.Conn, uc *upConn, live *net.Conn) {
	select {
	case s.handshakes <- struct{}{}:
	default:
		s.refused.Add(1)
		return
	}
	h, up, err := s.open(up, uc, live)
	<-s.handshakes
	for err == nil {
		ok := s.runStream(uc, h, up, live)
		// The stream is over: cleanly (every hop acked its close, a promise
		// that its data is durable) or failed and discarded. Either way
		// nothing that follows may abort it (handle aborts uc.st after a
		// panic).
		uc.st = nil
		if !ok {
			return
		}
		uc.seq++
		up = *live
		if uc.version < 5 {
			return // version 4: one stream per connection, as its peers expect
		}
		if !time.Now().Before(uc.expires) {
			return // too old, or the opener's certificate expired
		}
		h, err = s.waitNext(uc, up)
	}
}

// waitNext takes one of the MaxIdle slots while it waits for the next
// header on up; the slot is given back however the wait ends, a panic
// included.
func (s *Server) waitNext(uc *upConn, up net.Conn) (*Header, error) {
	defer s.idle.Add(-1)
	if s.idle.Add(1) > int64(s.cfg.MaxIdle) {
		return nil, errTooManyIdle
	}
	return s.nextHeader(uc, up)
}

// errTooManyIdle ends a connection whose stream closed cleanly while
// MaxIdle others wait for their next header.
var errTooManyIdle = errors.New("stream: too many idle connections")

// runStream runs one stream whose header h arrived on up; it reports
// whether the stream closed cleanly (every hop synced and acked its
// close), so that the connection may carry the next.
func (s *Server) runStream(uc *upConn, h *Header, up net.Conn, live *net.Conn) bool {
	if h.Hop == 0 {
		s.firstHop.Add(1)
	} else {
		s.downstream.Add(1)
	}
	if uc.seq > 0 {
		s.reused.Add(1)
	}
	if n := s.active.Add(1); n > int64(s.cfg.MaxStreams) {
		s.active.Add(-1)
		s.failed.Add(1)
		s.refuse(up, &Error{Code: CodeBusy, Datanode: s.cfg.ID, Reason: fmt.Sprintf("%d streams open, limit %d", n-1, s.cfg.MaxStreams)})
		return false
	}
	if h.version == 4 {
		s.v4Streams.Add(1) // past the busy check: a stream that runs at v4
	}
	defer s.active.Add(-1)
	sink, err := s.cfg.Backend.Open(h)
	if err != nil {
		s.failed.Add(1)
		s.refuse(up, s.asError(err, CodeIO))
		return false
	}
	st := &stream{s: s, h: h, up: up, sink: sink, abort: make(chan struct{})}
	uc.st = st
	if e := st.downFor(uc); e != nil {
		uc.closeDown()
		s.failed.Add(1)
		st.abortSink()
		s.refuse(up, e)
		return false
	}
	// A secured connection switches to records (record.go) once the
	// header ack, the last frame through TLS, is sent; a reused one keys
	// the stream's payload records.
	var rc *recordConn
	switch c := up.(type) {
	case *tls.Conn:
		if rc, err = switchToRecordsV(c, false, h.payloadKey, h.version); err != nil {
			s.failed.Add(1)
			st.abortSink()
			s.refuse(up, &Error{Code: CodeProtocol, Datanode: s.cfg.ID, Reason: fmt.Sprintf("datanode %d: %v", s.cfg.ID, err)})
			return false
		}
	case *recordConn:
		if err := c.setPayloadKey(h.payloadKey); err != nil {
			s.failed.Add(1)
			st.abortSink()
			s.refuse(up, &Error{Code: CodeProtocol, Datanode: s.cfg.ID, Reason: fmt.Sprintf("datanode %d: %v", s.cfg.ID, err)})
			return false
		}
	}
	var b [ackLen]byte
	up.SetWriteDeadline(time.Now().Add(s.cfg.Timeout))
	if _, err := up.Write((&ack{kind: kindHeaderAck, value: h.Offset}).encode(b[:0])); err != nil {
		st.fail(st.upErr(err, "sending the header ack"))
	} else {
		if rc != nil {
			up, st.up, *live = rc, rc, rc
		}
		st.run()
	}
	if st.err != nil {
		s.failed.Add(1)
		st.abortSink()
		s.refuse(up, st.err)
		return false
	}
	if rc, ok := (*live).(*recordConn); ok && !rc.reusable() {
		return false
	}
	if d, ok := uc.down.(*recordConn); ok && !d.reusable() {
		uc.closeDown()
	}
	return true
}

// nextHeader waits (ReuseIdle, longer further down the route) for the
// next stream's header on a connection whose last stream closed cleanly,
// and checks it as open checks a first one. Any error ends the
// connection.
func (s *Server) nextHeader(uc *upConn, up net.Conn) (*Header, error) {
	dl := time.Now().Add(s.cfg.ReuseIdle + time.Duration(uc.hop)*s.cfg.Timeout)
	if !uc.expires.IsZero() && uc.expires.Before(dl) {
		dl = uc.expires
	}
	up.SetReadDeadline(dl)
	// Once the header's first byte is in, the rest gets Timeout, as a
	// first header does.
	fb := &firstByte{c: up, d: s.cfg.Timeout}
	var h *Header
	var err error
	if rc, ok := up.(*recordConn); ok {
		fb.r = rc.r
		rc.r = fb
		h, err = readHeaderOf(up, uc.version)
		rc.r = fb.r
	} else {
		fb.r = up
		h, err = readHeaderOf(fb, uc.version)
	}
	if err != nil {
		if errors.Is(err, errBadHeader) || errors.Is(err, errRecord) {
			s.failed.Add(1)
			s.refuse(up, &Error{Code: CodeBadHeader, Datanode: s.cfg.ID, Reason: err.Error()})
		}
		return nil, err // or the opener closed the idle connection
	}
	up.SetDeadline(time.Now().Add(s.cfg.Timeout))
	if h.Hop != uc.hop {
		err = fmt.Errorf("hop %d header on a connection of hop %d", h.Hop, uc.hop)
	} else {
		err = s.checkHeader(uc, h)
	}
	if err != nil {
		s.refused.Add(1)
		s.refuse(up, &Error{Code: CodeBadHeader, Datanode: s.cfg.ID, Reason: fmt.Sprintf("datanode %d: %v", s.cfg.ID, err)})
		return nil, err
	}
	return h, nil
}

// open authenticates a new connection and reads its header: the opener's
// certificate (when secured) must allow it to open this stream, and the
// route may name only datanodes the cluster knows, at their addresses.
// *live is set to the TLS connection once authenticated.
func (s *Server) open(raw net.Conn, uc *upConn, live *net.Conn) (*Header, net.Conn, error) {
	raw.SetDeadline(time.Now().Add(s.cfg.Timeout))
	up := raw
	sec := s.cfg.Security
	if sec != nil {
		tc := tls.Server(framedTLS(raw), sec.Server)
		if err := tc.Handshake(); err != nil {
			s.refused.Add(1)
			s.log.Debug("stream: TLS handshake refused", "remote", raw.RemoteAddr(), "err", err)
			return nil, nil, err
		}
		st := tc.ConnectionState()
		uc.cs, up, *live = &st, tc, tc
		if sec.Watch != nil {
			stop := sec.Watch(raw, uc.cs)
			s.mu.Lock()
			s.conns[raw] = stop // handle's deferred clean-up calls it
			s.mu.Unlock()
		}
	}
	raw.SetWriteDeadline(time.Time{})
	uc.expires = expiry(time.Now(), s.cfg.MaxConnAge, uc.cs)
	h, err := readHeaderOf(up, s.cfg.OnlyVersion)
	if err != nil {
		if errors.Is(err, errBadHeader) {
			s.failed.Add(1)
			s.refuse(up, &Error{Code: CodeBadHeader, Datanode: s.cfg.ID, Reason: err.Error()})
		}
		return nil, nil, err // or the peer went away before sending a header: nothing to say
	}
	uc.hop, uc.version = h.Hop, h.version
	if err := s.checkHeader(uc, h); err != nil {
		if sec != nil {
			s.refused.Add(1)
		} else {
			s.failed.Add(1)
		}
		s.refuse(up, &Error{Code: CodeBadHeader, Datanode: s.cfg.ID, Reason: fmt.Sprintf("datanode %d: %v", s.cfg.ID, err)})
		return nil, nil, err
	}
	return h, up, nil
}

// checkHeader checks header h, the stream number uc.seq of connection uc,
// against its opener and the cluster, and sets its payload key.
func (s *Server) checkHeader(uc *upConn, h *Header) error {
	sec := s.cfg.Security
	if sec == nil {
		if len(h.payloadKey) != 0 {
			return fmt.Errorf("a payload key on a plaintext stream")
		}
		return nil
	}
	if sec.Upstream != nil {
		if err := sec.Upstream(uc.cs, h); err != nil {
			return err
		}
	}
	for _, t := range h.Route {
		if err := sec.Target(t); err != nil {
			return err
		}
	}
	// The stream's payload key (record.go): exported from this session
	// (with the stream's number on it) when a client opened it, else from
	// the header.
	var err error
	switch {
	case h.Hop == 0 && len(h.payloadKey) != 0:
		return fmt.Errorf("a client's header may not carry a payload key")
	case h.Hop == 0:
		h.payloadKey, err = payloadKeyV(uc.cs, uc.seq, h.version)
	case len(h.payloadKey) == 0:
		err = fmt.Errorf("hop %d header carries no payload key", h.Hop)
	}
	return err
}

// asError names this datanode in a backend's refusal.
func (s *Server) asError(err error, def Code) *Error {
	var e *Error
	if errors.As(err, &e) {
		c := *e
		if c.Datanode == 0 {
			c.Datanode = s.cfg.ID
		}
		return &c
	}
	return &Error{Code: def, Datanode: s.cfg.ID, Reason: err.Error()}
}

// refuse sends an error upstream and closes our side gently: the peer may
// still be writing packets, and closing a socket with unread data sends a
// reset that can destroy the error before the peer reads it. So: write,
// half-close, drain briefly.
func (s *Server) refuse(up net.Conn, e *Error) {
	if s.closing.Load() {
		return // Close broke the connection already
	}
	up.SetDeadline(time.Now().Add(time.Second))
	if _, err := up.Write(errorAck(e).encode(nil)); err != nil {
		return
	}
	drain := io.Reader(up)
	switch tc := up.(type) {
	case *net.TCPConn:
		tc.CloseWrite()
	case *tls.Conn:
		tc.CloseWrite()
	case *recordConn:
		// The peer's records are discarded unopened.
		if raw, ok := tc.Conn.(*net.TCPConn); ok {
			raw.CloseWrite()
		}
		drain = tc.Conn
	}
	up.SetReadDeadline(time.Now().Add(2 * time.Second))
	io.Copy(io.Discard, io.LimitReader(drain, 64<<20))
}

// ackTimeout is how long a datanode with k hops below it waits for an ack.
func ackTimeout(base time.Duration, k int) time.Duration {
	return base + time.Duration(max(k-1, 0))*base/2
}

// downFor gives the stream its connection to the next datanode: the one
// the last stream of this connection used, if the route below is the
// same (the next header goes as control records), else a new one.
func (st *stream) downFor(uc *upConn) *Error {
	h := st.h
	if len(h.Route) == 0 {
		uc.closeDown()
		return nil
	}
	st.next = h.Route[0]
	if uc.down != nil && h.version >= 5 && slices.Equal(uc.downRoute, h.Route) {
		err := errConnExpired
		if time.Now().Before(uc.downExpires) {
			err = checkIdle(uc.down)
		}
		if err == nil {
			hookKept(uc.down)
			e, unsent := st.sendHeaderDown(uc.down, true)
			if e == nil {
				st.down = uc.down
				return nil
			}
			if !unsent {
				// The next datanode may have read the header and opened
				// the stream: opening it again on another connection
				// could run two streams of one block there. CodeStale
				// (the kept connection ended before any answer) goes up
				// as it is: the client abandons the block and writes a
				// new one on new connections, blaming nobody.
				return e
			}
			// The header never left whole (the write failed), so the
			// next datanode cannot have opened the stream: a new
			// connection is as safe as a first one.
			err = fmt.Errorf("%v", e)
		}
		st.s.downStale.Add(1)
		st.s.log.Debug("stream: kept connection down unusable; dialing anew", "next", st.next.ID, "err", err)
	}
	uc.closeDown()
	c, stop, cs, e := st.dialDown()
	if e != nil {
		return e
	}
	uc.down, uc.downStop = c, stop
	if e, _ := st.sendHeaderDown(c, false); e != nil {
		return e
	}
	// The next datanode closes its end at MaxConnAge (with this
	// configuration); stop reusing it a margin before.
	age := st.s.cfg.MaxConnAge
	age -= min(st.s.cfg.Timeout, age/4)
	uc.down, uc.downRoute, uc.downExpires = st.down, slices.Clone(h.Route), expiry(time.Now(), age, cs)
	if h.version < 5 {
		uc.downRoute = nil // a version 4 stream's connection down carries only it
	}
	return nil
}

// dialDown connects to the next datanode and authenticates it.
func (st *stream) dialDown() (net.Conn, func(), *tls.ConnectionState, *Error) {
	s := st.s
	s.downDials.Add(1)
	d := net.Dialer{Timeout: s.cfg.Timeout}
	c, err := d.Dial("tcp", st.next.Addr)
	if err != nil {
		return nil, nil, nil, &Error{Code: CodeUnreachable, Datanode: st.next.ID, Addr: st.next.Addr,
			Reason: fmt.Sprintf("datanode %d cannot connect to it: %v", s.cfg.ID, err)}
	}
	if tc, ok := c.(*net.TCPConn); ok {
		// Packets are large; acks are tiny and must not wait for Nagle.
		tc.SetNoDelay(true)
	}
	var stop func()
	var ccs *tls.ConnectionState
	if sec := s.cfg.Security; sec != nil {
		tc := tls.Client(framedTLS(c), sec.Client)
		tc.SetDeadline(time.Now().Add(s.cfg.Timeout))
		err := tc.Handshake()
		if err == nil {
			cs := tc.ConnectionState()
			ccs = &cs
			err = sec.Verify(st.next, &cs)
		}
		if err != nil {
			c.Close()
			return nil, nil, nil, &Error{Code: CodeUnreachable, Datanode: st.next.ID, Addr: st.next.Addr,
				Reason: fmt.Sprintf("datanode %d cannot authenticate it: %v", s.cfg.ID, err)}
		}
		if sec.Watch != nil {
			// The next datanode's certificate revoked: the connection
			// closes, and the stream fails naming it.
			cs := tc.ConnectionState()
			stop = sec.Watch(c, &cs)
		}
		c = tc
	}
	return c, stop, ccs, nil
}

// sendHeaderDown sends the stream's header to the next datanode on c (a
// new TLS or plaintext connection, or a record connection between
// streams) and waits for its ack; then st.down is the connection the
// stream's packets go down (records, on a secured one). unsent: it failed
// writing the header, so the next datanode cannot have read it whole.
// kept: c carried a stream before; if it ends before any byte of the
// answer arrived, the error is CodeStale (staleEnd) naming the next
// datanode.
func (st *stream) sendHeaderDown(c net.Conn, kept bool) (_ *Error, unsent bool) {
	s, h := st.s, st.h
	fwd := *h
	fwd.Hop++
	fwd.Route = h.Route[1:]
	b, err := encodeHeader(nil, &fwd)
	if err != nil {
		return &Error{Code: CodeBadHeader, Datanode: s.cfg.ID, Reason: err.Error()}, false
	}
	// The next datanode connects further down before it answers.
	c.SetDeadline(time.Now().Add(ackTimeout(s.cfg.Timeout, len(h.Route)) + time.Duration(len(h.Route)-1)*s.cfg.Timeout))
	var a ack
	var ab [ackLen]byte
	if _, err = c.Write(b); err != nil {
		return st.downErr(err, "opening the stream"), true
	}
	got, err := readAnswer(c, &ab, &a)
	if err != nil {
		if kept && staleEnd(err, got) && !s.closing.Load() {
			// Counted here only: a CodeStale relayed from further down
			// is another hop's event.
			s.downStaleHeaders.Add(1)
			return &Error{Code: CodeStale, Datanode: st.next.ID, Addr: st.next.Addr,
				Reason: fmt.Sprintf("datanode %d: block %v: kept connection to it ended before the header was answered: %v", s.cfg.ID, h.Block, err)}, false
		}
		return st.downErr(err, "opening the stream"), false
	}
	if a.kind == kindError {
		e := ackError(&a, h.Route)
		if e.Code == CodeStale && !kept {
			// A new connection down: no hop below has a kept connection
			// for this stream (each keeps one per connection it accepted
			// that carried a stream), so "stale" from there is the next
			// datanode's failure like any other, as in dialOn. A hop
			// passes CodeStale up only for its own kept connection (or
			// one relayed over it).
			e.Code = CodeConnLost
		}
		return e, false
	}
	if a.kind != kindHeaderAck || a.value != h.Offset {
		return &Error{Code: CodeProtocol, Datanode: st.next.ID, Addr: st.next.Addr,
			Reason: fmt.Sprintf("answered the header with ack kind %#x value %d, want header ack at %d", a.kind, a.value, h.Offset)}, false
	}
	switch tc := c.(type) {
	case *tls.Conn:
		rc, err := switchToRecordsV(tc, true, h.payloadKey, h.version)
		if err != nil {
			return &Error{Code: CodeProtocol, Datanode: st.next.ID, Addr: st.next.Addr,
				Reason: fmt.Sprintf("datanode %d cannot switch its connection to records: %v", s.cfg.ID, err)}, false
		}
		c = rc
	case *recordConn:
		if err := tc.setPayloadKey(h.payloadKey); err != nil {
			return &Error{Code: CodeProtocol, Datanode: s.cfg.ID, Reason: fmt.Sprintf("datanode %d: %v", s.cfg.ID, err)}, false
		}
	}
	c.SetDeadline(time.Time{})
	st.down = c
	return nil, false
}

// fail records the first error and unblocks every goroutine of the
// stream: reads and writes on the upstream connection time out at once,
// the downstream connection closes.
func (st *stream) fail(e *Error) {
	st.once.Do(func() {
		st.err = e
		close(st.abort)
		st.up.SetDeadline(time.Unix(1, 0))
		if st.down != nil {
			closeRaw(st.down)
		}
	})
}

func (st *stream) aborted() bool {
	select {
	case <-st.abort:
		return true
	default:
		return false
	}
}

func (st *stream) abortSink() {
	if err := st.sink.Abort(); err != nil {
		st.s.log.Warn("stream: cannot discard the data of a failed stream", "block", st.h.Block, "err", err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// upErr describes a failure of the upstream connection.
func (st *stream) upErr(err error, doing string) *Error {
	s := st.s
	switch {
	case s.closing.Load():
		return &Error{Code: CodeShutdown, Datanode: s.cfg.ID, Reason: "datanode stopping"}
	case isTimeout(err):
		return &Error{Code: CodeTimeout, Reason: fmt.Sprintf("datanode %d: upstream stalled %s of block %v: %v", s.cfg.ID, doing, st.h.Block, err)}
	}
	return &Error{Code: CodeConnLost, Reason: fmt.Sprintf("datanode %d: upstream connection lost %s of block %v: %v", s.cfg.ID, doing, st.h.Block, err)}
}

// recordErr describes a failure reading a record from upstream: a
// refused record is a protocol error of this datanode's upstream link.
func (st *stream) recordErr(err error, doing string) *Error {
	if errors.Is(err, errRecord) && !st.s.closing.Load() {
		return &Error{Code: CodeProtocol, Datanode: st.s.cfg.ID,
			Reason: fmt.Sprintf("datanode %d: %s of block %v: %v", st.s.cfg.ID, doing, st.h.Block, err)}
	}
	return st.upErr(err, doing)
}

// downErr describes a failure of the downstream connection: it names the
// next datanode.
func (st *stream) downErr(err error, doing string) *Error {
	s := st.s
	if s.closing.Load() {
		return &Error{Code: CodeShutdown, Datanode: s.cfg.ID, Reason: "datanode stopping"}
	}
	code := CodeConnLost
	if isTimeout(err) {
		code = CodeTimeout
	}
	return &Error{Code: code, Datanode: st.next.ID, Addr: st.next.Addr,
		Reason: fmt.Sprintf("datanode %d lost it %s of block %v: %v", s.cfg.ID, doing, st.h.Block, err)}
}

// run moves packets: this goroutine reads from upstream and forwards, one
// goroutine writes to disk, one reads downstream acks, one acks upstream.
func (st *stream) run() {
	queue := st.s.cfg.Queue
	writeQ := make(chan packet, queue)
	doneQ := make(chan done, queue+1)
	downAcks := make(chan ack, queue+1)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); st.guarded(func() { st.writeLoop(writeQ, doneQ) }) }()
	go func() { defer wg.Done(); st.guarded(func() { st.ackLoop(doneQ, downAcks) }) }()
	if st.down != nil {
		wg.Add(1)
		go func() { defer wg.Done(); st.guarded(func() { st.downAckLoop(downAcks) }) }()
	}
	st.guarded(func() { st.readLoop(writeQ) })
	close(writeQ)
	wg.Wait()
}

// guarded runs one of the stream's loops; a panic in it fails the stream
// (which stops the other loops) instead of the datanode.
func (st *stream) guarded(fn func()) {
	err := st.s.cfg.Guard.Run(guardWhere, func() error { fn(); return nil })
	var pe *guard.PanicError
	if errors.As(err, &pe) {
		st.fail(st.s.internalError(pe))
	}
}

func (st *stream) readLoop(writeQ chan<- packet) {
	s, h := st.s, st.h
	seq, off := uint64(0), h.Offset
	for {
		st.up.SetReadDeadline(time.Now().Add(s.cfg.IdleTimeout))
		if _, err := io.ReadFull(st.up, st.hb[:]); err != nil {
			st.fail(st.upErr(err, fmt.Sprintf("waiting for packet %d", seq)))
			return
		}
		var ph packetHeader
		if err := ph.decode(&st.hb); err != nil {
			st.fail(&Error{Code: CodeProtocol, Datanode: s.cfg.ID, Reason: fmt.Sprintf("block %v: %v", h.Block, err)})
			return
		}
		if ph.seq != seq || ph.offset != off {
			st.fail(&Error{Code: CodeProtocol, Datanode: s.cfg.ID,
				Reason: fmt.Sprintf("block %v: packet %d at offset %d, want packet %d at offset %d", h.Block, ph.seq, ph.offset, seq, off)})
			return
		}
		if ph.kind == kindClose {
			// Forward the close before syncing: the datanodes sync in
			// parallel, and each still acks only after its own sync and
			// its downstream's close ack.
			if !st.forward(st.hb[:], nil, seq) {
				return
			}
			select {
			case writeQ <- packet{close: true, seq: seq, off: off}:
			case <-st.abort:
			}
			return
		}
		if ph.length > h.PacketSize {
			st.fail(&Error{Code: CodeProtocol, Datanode: s.cfg.ID,
				Reason: fmt.Sprintf("block %v: packet %d of %d bytes > the header's packet size %d", h.Block, seq, ph.length, h.PacketSize)})
			return
		}
		bp := getBuf(int(ph.length))
		buf := (*bp)[:ph.length]
		st.up.SetReadDeadline(time.Now().Add(s.cfg.Timeout))
		if rc, ok := st.up.(*recordConn); ok {
			// Forwarded sealed as it came, then opened in place for the
			// disk: the payload key is the stream's, on every hop.
			err := rc.readSealed(buf)
			if err == nil {
				s.bytes.Add(uint64(ph.length))
				if !st.forward(st.hb[:], buf[:len(buf)+tagLen], seq) {
					putBuf(bp)
					return
				}
				err = rc.openPayload(st.hb[:], buf)
			}
			if err != nil {
				putBuf(bp)
				st.fail(st.recordErr(err, fmt.Sprintf("receiving packet %d", seq)))
				return
			}
		} else {
			if err := readPayload(st.up, nil, buf); err != nil {
				putBuf(bp)
				st.fail(st.upErr(err, fmt.Sprintf("receiving packet %d", seq)))
				return
			}
			s.bytes.Add(uint64(ph.length))
			if !st.forward(st.hb[:], buf, seq) {
				putBuf(bp)
				return
			}
		}
		select {
		case writeQ <- packet{seq: seq, off: off, crc: ph.crc, buf: bp, n: int(ph.length)}:
		case <-st.abort:
			putBuf(bp)
			return
		}
		seq++
		off += uint64(ph.length)
	}
}

// forward sends a packet downstream from the buffer it was received into:
// one writev of header and payload, no copy.
func (st *stream) forward(hdr, payload []byte, seq uint64) bool {
	if st.down == nil {
		return true
	}
	st.down.SetWriteDeadline(time.Now().Add(st.s.cfg.Timeout))
	var err error
	if rc, ok := st.down.(*recordConn); ok {
		// payload is the sealed record (ciphertext and tag) as received.
		err = rc.forwardPacket(hdr, payload)
	} else {
		st.iov[0], st.iov[1] = hdr, payload
		st.bufs = st.iov[:]
		if payload == nil {
			st.bufs = st.bufs[:1]
		}
		_, err = st.bufs.WriteTo(st.down)
	}
	if err != nil {
		// The downstream datanode probably sent an error ack before it
		// closed: give the ack reader a moment to report that instead.
		select {
		case <-st.abort:
		case <-time.After(time.Second):
			st.fail(st.downErr(err, fmt.Sprintf("forwarding packet %d", seq)))
		}
		return false
	}
	return true
}

func (st *stream) writeLoop(writeQ <-chan packet, doneQ chan<- done) {
	defer close(doneQ)
	s, h := st.s, st.h
	for p := range writeQ {
		if st.aborted() {
			if p.buf != nil {
				putBuf(p.buf)
			}
			continue
		}
		var d done
		if p.close {
			if err := st.sink.Close(); err != nil {
				st.fail(s.asError(fmt.Errorf("block %v: syncing %d bytes: %w", h.Block, p.off, err), CodeIO))
				continue
			}
			d = done{close: true, seq: p.seq, end: p.off}
		} else {
			buf := (*p.buf)[:p.n]
			if got := crc32c(buf); got != p.crc {
				putBuf(p.buf)
				st.fail(&Error{Code: CodeChecksumMismatch, Datanode: s.cfg.ID,
					Reason: fmt.Sprintf("block %v packet %d at offset %d: CRC32C %08x, header says %08x", h.Block, p.seq, p.off, got, p.crc)})
				continue
			}
			_, err := st.sink.Write(buf)
			putBuf(p.buf)
			if err != nil {
				st.fail(s.asError(fmt.Errorf("block %v: writing packet %d at offset %d: %w", h.Block, p.seq, p.off, err), CodeIO))
				continue
			}
			d = done{seq: p.seq, end: p.off + uint64(p.n)}
		}
		select {
		case doneQ <- d:
		case <-st.abort:
		}
	}
}

// downAckLoop reads the downstream datanode's acks as they come, so an
// error ack is seen at once.
func (st *stream) downAckLoop(downAcks chan<- ack) {
	var b [ackLen]byte
	for {
		var a ack
		if err := readAck(st.down, &b, &a); err != nil {
			if st.aborted() {
				return
			}
			if errors.Is(err, errBadAck) || errors.Is(err, errRecord) {
				st.fail(&Error{Code: CodeProtocol, Datanode: st.next.ID, Addr: st.next.Addr, Reason: err.Error()})
			} else {
				st.fail(st.downErr(err, "waiting for acks"))
			}
			return
		}
		if a.kind == kindError {
			st.fail(ackError(&a, st.h.Route))
			return
		}
		select {
		case downAcks <- a:
		case <-st.abort:
			return
		}
		if a.kind == kindCloseAck {
			return
		}
	}
}

// ackLoop acks packet i upstream once this datanode wrote it and the
// downstream datanode acked it.
func (st *stream) ackLoop(doneQ <-chan done, downAcks <-chan ack) {
	s, h := st.s, st.h
	wait := ackTimeout(s.cfg.Timeout, len(h.Route))
	timer := time.NewTimer(wait)
	timer.Stop()
	defer timer.Stop()
	var b [ackLen]byte
	for d := range doneQ {
		if st.down != nil {
			timer.Reset(wait)
			select {
			case a := <-downAcks:
				ok := (d.close && a.kind == kindCloseAck && a.value == d.end) || (!d.close && a.kind == kindDataAck && a.seq == d.seq && a.value == d.end)
				if !ok {
					st.fail(&Error{Code: CodeProtocol, Datanode: st.next.ID, Addr: st.next.Addr,
						Reason: fmt.Sprintf("block %v: ack kind %#x seq %d value %d, want seq %d at %d (close %v)", h.Block, a.kind, a.seq, a.value, d.seq, d.end, d.close)})
					return
				}
			case <-timer.C:
				st.fail(&Error{Code: CodeTimeout, Datanode: st.next.ID, Addr: st.next.Addr,
					Reason: fmt.Sprintf("datanode %d got no ack for packet %d of block %v (offset %d) within %s", s.cfg.ID, d.seq, h.Block, d.end, wait)})
				return
			case <-st.abort:
				return
			}
			timer.Stop()
		}
		a := ack{kind: kindDataAck, seq: d.seq, value: d.end}
		if d.close {
			a = ack{kind: kindCloseAck, seq: d.seq, value: d.end}
		}
		st.up.SetWriteDeadline(time.Now().Add(s.cfg.Timeout))
		if _, err := st.up.Write(a.encode(b[:0])); err != nil {
			st.fail(st.upErr(err, fmt.Sprintf("acking packet %d", d.seq)))
			return
		}
	}
}

// closeRaw closes c, or the TCP connection under it if it is TLS:
// tls.Conn.Close first sends close_notify, which waits behind a write in
// progress to a stalled peer.
func closeRaw(c net.Conn) error {
	switch tc := c.(type) {
	case *tls.Conn:
		return tc.NetConn().Close()
	case *recordConn:
		return tc.Conn.Close()
	}
	return c.Close()
}

// firstByte reads r; once a byte has arrived it gives c's read Timeout d
// from then (the rest of a header that started arriving).
type firstByte struct {
	r   io.Reader
	c   net.Conn
	d   time.Duration
	got bool
}

func (f *firstByte) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if n > 0 && !f.got {
		f.got = true
		f.c.SetReadDeadline(time.Now().Add(f.d))
	}
	return n, err
}
