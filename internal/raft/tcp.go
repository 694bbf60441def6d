package raft

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// TCPConfig configures the TCP transport.
type TCPConfig struct {
	ID         uint64
	ListenAddr string
	// Listener, if set, is used instead of listening on ListenAddr.
	Listener net.Listener
	Resolve  func(id uint64) (string, error)
	Logger   *slog.Logger
	// QueueSize bounds the messages waiting for one peer (default 4096).
	QueueSize int
	// MaxFrameBytes bounds one inbound frame (default 128 MiB); a larger
	// announced length closes the connection. It must exceed the largest
	// proposal plus maxBatchBytes (the Host sets it from MaxProposalBytes).
	MaxFrameBytes int
	// DialTimeout (default 2s) and MaxBackoff between reconnects (default 2s).
	DialTimeout time.Duration
	MaxBackoff  time.Duration

	// Security authenticates both ends of every connection (nil:
	// plaintext, anyone may connect: for tests of this package only).
	Security *Security
	// MaxPendingConns bounds the accepted connections that have not yet
	// authenticated (TLS handshake and hello; default 64): more are closed
	// at once, so a flood of connections costs neither goroutines nor
	// memory beyond it.
	MaxPendingConns int
	// MaxConnsPerPeer bounds the authenticated inbound connections of one
	// peer, message and snapshot connections together (default 8).
	MaxConnsPerPeer int
	// MaxPeers bounds the peers the transport keeps a queue and a writer
	// for (default 4096); a message to a further peer is dropped.
	MaxPeers int

	// Metrics is set by the Host that owns the transport.
	Metrics *metrics
}

// Security is the transport's mutual authentication. Every connection is
// TLS, and the node ID a connection carries (the hello's sender) must be
// the one its certificate proves: Authenticate decides, since how a
// certificate's identity maps to a raft node ID is the owner's business
// (a meta node's certificate names its node ID, a datanode's the UUID SCM
// knows it by). Messages inside a connection whose From is not that node
// are dropped and counted: one peer can never speak for another.
type Security struct {
	// Server is used for accepted connections and must require and
	// verify a client certificate; Client for dialed ones and must verify
	// the server's (package pki makes both).
	Server, Client *tls.Config
	// Authenticate reports whether the verified certificate in cs belongs
	// to raft node id (an unknown node is an error too). It is called
	// once per connection, on both sides.
	Authenticate func(id uint64, cs *tls.ConnectionState) error
	// Watch (optional) is told of every authenticated connection (its
	// raw TCP connection) and may close it later, e.g. when the peer's
	// certificate is revoked (pki.Credentials.Watch); stop is called when
	// the transport is done with the connection.
	Watch func(raw net.Conn, cs *tls.ConnectionState) (stop func())
}

// TCPTransport keeps one TCP connection per pair of hosts and carries the
// messages of all groups on it. Each peer has a bounded queue and its own
// writer goroutine that drains the queue into one frame per write, so
// messages of many groups share a syscall, and heartbeats go in a compact
// form (group, term, commit) rather than as full protobufs: this is the
// per-pair coalescing CockroachDB does. A peer that is down only fills its
// own queue; sends to it are dropped (raft resends) without blocking.
//
// When both hosts dial at once, both keep the connection dialed by the
// host with the smaller ID, so a pair converges on one connection.
type TCPTransport struct {
	cfg TCPConfig
	ln  net.Listener
	h   Handler
	log *slog.Logger
	m   *metrics

	mu      sync.Mutex
	peers   map[uint64]*peer
	conns   map[net.Conn]func() // open connections → Security.Watch's stop (or nil)
	inbound map[uint64]int      // authenticated inbound connections per peer

	pending   chan struct{} // a slot per connection not yet authenticated
	lastWarnd atomic.Int64  // unix nanos of the last refusal logged

	stopc  chan struct{}
	wg     sync.WaitGroup
	closed atomic.Bool
}

const (
	magic          = "BSLT"
	connMessages   = 1
	connSnapshot   = 2
	maxBatchBytes  = 8 << 20
	maxBatchMsgs   = 4096
	itemRaft       = 0
	itemHeartbeat  = 1
	itemHeartbeatR = 2
	itemApplied    = 3
)

// NewTCPTransport listens on cfg.ListenAddr.
func NewTCPTransport(cfg TCPConfig) (*TCPTransport, error) {
	if cfg.QueueSize == 0 {
		cfg.QueueSize = 4096
	}
	if cfg.MaxFrameBytes == 0 {
		cfg.MaxFrameBytes = 128 << 20
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = 2 * time.Second
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 2 * time.Second
	}
	if cfg.MaxPendingConns <= 0 {
		cfg.MaxPendingConns = 64
	}
	if cfg.MaxConnsPerPeer <= 0 {
		cfg.MaxConnsPerPeer = 8
	}
	if cfg.MaxPeers <= 0 {
		cfg.MaxPeers = 4096
	}
	if sec := cfg.Security; sec != nil && (sec.Server == nil || sec.Client == nil || sec.Authenticate == nil) {
		return nil, errors.New("raft: transport Security needs Server, Client and Authenticate")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.ListenAddr == "" {
		cfg.ListenAddr = "127.0.0.1:0"
	}
	m := cfg.Metrics
	if m == nil {
		m = newMetrics(cfg.ID, nil)
	}
	ln := cfg.Listener
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", cfg.ListenAddr); err != nil {
			return nil, fmt.Errorf("raft: transport listen on %s: %w", cfg.ListenAddr, err)
		}
	}
	return &TCPTransport{cfg: cfg, ln: ln, log: cfg.Logger, m: m, peers: make(map[uint64]*peer), conns: make(map[net.Conn]func()),
		inbound: make(map[uint64]int), pending: make(chan struct{}, cfg.MaxPendingConns), stopc: make(chan struct{})}, nil
}

// Addr implements Transport.
func (t *TCPTransport) Addr() string { return t.ln.Addr().String() }

// Start implements Transport.
func (t *TCPTransport) Start(h Handler) error {
	t.h = h
	t.wg.Add(1)
	go t.acceptLoop()
	return nil
}

// Close implements Transport.
func (t *TCPTransport) Close() error {
	if !t.closed.CompareAndSwap(false, true) {
		return nil
	}
	close(t.stopc)
	err := t.ln.Close()
	t.mu.Lock()
	for c := range t.conns {
		c.Close()
	}
	t.mu.Unlock()
	t.wg.Wait()
	return err
}

func (t *TCPTransport) track(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		c.Close()
		return false
	}
	t.conns[c] = nil
	return true
}

func (t *TCPTransport) untrack(c net.Conn) {
	c = rawConn(c)
	t.mu.Lock()
	stop := t.conns[c]
	delete(t.conns, c)
	t.mu.Unlock()
	if stop != nil {
		stop()
	}
	c.Close()
}

// watch hands an authenticated connection to Security.Watch.
func (t *TCPTransport) watch(raw net.Conn, cs *tls.ConnectionState) {
	sec := t.cfg.Security
	if sec == nil || sec.Watch == nil {
		return
	}
	stop := sec.Watch(raw, cs)
	t.mu.Lock()
	if _, ok := t.conns[raw]; ok {
		t.conns[raw] = stop
		stop = nil
	}
	t.mu.Unlock()
	if stop != nil { // untracked meanwhile
		stop()
	}
}

// rawConn is the TCP connection under a TLS one. Connections are closed
// through it: tls.Conn.Close first sends close_notify, which waits for a
// write in progress on a stuck peer.
func rawConn(c net.Conn) net.Conn {
	if tc, ok := c.(*tls.Conn); ok {
		return tc.NetConn()
	}
	return c
}

// refused counts a refused connection and logs it, at most once a second.
func (t *TCPTransport) refused(reason string, c net.Conn, err error) {
	t.m.connsRefused.WithLabelValues(reason).Inc()
	now := time.Now().UnixNano()
	last := t.lastWarnd.Load()
	if now-last > int64(time.Second) && t.lastWarnd.CompareAndSwap(last, now) && !t.closed.Load() {
		t.log.Warn("raft transport refused a connection", "reason", reason, "remote", c.RemoteAddr(), "err", err)
	}
}

// secureDialed authenticates a dialed connection as node id (TLS with the
// server's certificate proving it is id); without Security it returns c.
func (t *TCPTransport) secureDialed(ctx context.Context, c net.Conn, id uint64) (net.Conn, error) {
	sec := t.cfg.Security
	if sec == nil {
		return c, nil
	}
	tc := tls.Client(c, sec.Client)
	if err := tc.HandshakeContext(ctx); err != nil {
		t.m.connsRefused.WithLabelValues("tls").Inc()
		return nil, fmt.Errorf("TLS handshake: %w", err)
	}
	cs := tc.ConnectionState()
	if err := sec.Authenticate(id, &cs); err != nil {
		t.m.connsRefused.WithLabelValues("identity").Inc()
		return nil, fmt.Errorf("not node %d: %w", id, err)
	}
	t.watch(c, &cs)
	return tc, nil
}

// inboundSlot reserves one of from's inbound connections; release gives
// it back.
func (t *TCPTransport) inboundSlot(from uint64) (release func(), ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.inbound[from] >= t.cfg.MaxConnsPerPeer {
		return nil, false
	}
	t.inbound[from]++
	return func() {
		t.mu.Lock()
		if t.inbound[from]--; t.inbound[from] <= 0 {
			delete(t.inbound, from)
		}
		t.mu.Unlock()
	}, true
}

// peer returns id's peer, creating it (with its queue and writer) unless
// MaxPeers are kept already; then nil.
func (t *TCPTransport) peer(id uint64) *peer {
	t.mu.Lock()
	defer t.mu.Unlock()
	p, ok := t.peers[id]
	if !ok {
		if len(t.peers) >= t.cfg.MaxPeers {
			return nil
		}
		p = &peer{t: t, id: id, queue: make(chan Outgoing, t.cfg.QueueSize), installed: make(chan struct{}, 1)}
		t.peers[id] = p
		t.wg.Add(1)
		go p.writeLoop()
	}
	return p
}

// Send implements Transport.
func (t *TCPTransport) Send(to uint64, msgs []Outgoing) {
	if t.closed.Load() {
		return
	}
	p := t.peer(to)
	if p == nil {
		t.m.peerDropped.WithLabelValues("overflow").Add(float64(len(msgs)))
		return
	}
	dropped := 0
	for _, m := range msgs {
		select {
		case p.queue <- m:
		default:
			dropped++
		}
	}
	if dropped > 0 {
		t.m.peerDropped.WithLabelValues(fmt.Sprint(to)).Add(float64(dropped))
		p.reportUnreachable()
	}
}

type peer struct {
	t     *TCPTransport
	id    uint64
	queue chan Outgoing

	mu        sync.Mutex
	conn      *peerConn
	installed chan struct{}

	lastUnreachable atomic.Int64
}

type peerConn struct {
	c          net.Conn
	dialedByUs bool
	w          *bufio.Writer
}

// reportUnreachable tells the groups, at most every 100ms per peer.
func (p *peer) reportUnreachable() {
	now := time.Now().UnixNano()
	last := p.lastUnreachable.Load()
	if now-last < int64(100*time.Millisecond) || !p.lastUnreachable.CompareAndSwap(last, now) {
		return
	}
	go p.t.h.Unreachable(p.id)
}

// install makes c the pair's connection, applying the tie-break when one
// already exists. It reports whether c was kept.
func (p *peer) install(pc *peerConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if old := p.conn; old != nil {
		// Keep the connection dialed by the smaller ID.
		keepNew := (pc.dialedByUs && p.t.cfg.ID < p.id) || (!pc.dialedByUs && p.id < p.t.cfg.ID)
		if !keepNew {
			return false
		}
		rawConn(old.c).Close()
	}
	p.conn = pc
	select {
	case p.installed <- struct{}{}:
	default:
	}
	return true
}

func (p *peer) current() *peerConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conn
}

func (p *peer) drop(pc *peerConn) {
	p.mu.Lock()
	if p.conn == pc {
		p.conn = nil
	}
	p.mu.Unlock()
	rawConn(pc.c).Close()
}

func (p *peer) writeLoop() {
	t := p.t
	defer t.wg.Done()
	backoff := 50 * time.Millisecond
	batch := make([]Outgoing, 0, 256)
	var fw frameWriter
	for {
		var first Outgoing
		select {
		case <-t.stopc:
			return
		case first = <-p.queue:
		}
		pc := p.current()
		if pc == nil {
			var err error
			pc, err = p.dial()
			if err != nil {
				// Drop what is queued: raft will resend, and stale
				// messages are worthless after a backoff anyway.
				n := 1 + len(p.queue)
				for len(p.queue) > 0 {
					<-p.queue
				}
				t.m.peerDropped.WithLabelValues(fmt.Sprint(p.id)).Add(float64(n))
				p.reportUnreachable()
				select {
				case <-t.stopc:
					return
				case <-time.After(backoff):
				}
				backoff = min(backoff*2, t.cfg.MaxBackoff)
				continue
			}
		}
		backoff = 50 * time.Millisecond
		batch = append(batch[:0], first)
		size := 0
	drain:
		for len(batch) < maxBatchMsgs && size < maxBatchBytes {
			select {
			case m := <-p.queue:
				batch = append(batch, m)
				if m.tails != nil {
					// Data kept beside the message (a MsgApp with its data put
					// back) counts as a full hydrated message, as it did when
					// hydration happened here: a frame then carries about one
					// such message, and the receiver works on it while the
					// next one is on the wire.
					size += maxHydratedBytes
				} else if m.Msg != nil {
					size += len(m.Msg.GetEntries()) * 64
					for _, e := range m.Msg.GetEntries() {
						size += len(e.GetData())
					}
				}
			default:
				break drain
			}
		}
		hb := encodeBatch(&fw, batch)
		t.m.heartbeatsCoalesced.Add(float64(hb))
		segs, size := fw.finish()
		pc.c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if err := pc.writeSegments(segs); err != nil {
			p.fail(pc, err)
			continue
		}
		label := fmt.Sprint(p.id)
		t.m.peerBytesSent.WithLabelValues(label).Add(float64(size))
		t.m.peerMsgsSent.WithLabelValues(label).Add(float64(len(batch)))
		clear(fw.segs) // do not pin entry data until the next batch
		if cap(fw.scratch) > 4*maxBatchBytes {
			fw.scratch = nil // nor a huge buffer after a burst
		}
	}
}

// writeSegments writes one frame: small segments through the buffered
// writer, large ones with writev straight from the entries.
func (pc *peerConn) writeSegments(segs [][]byte) error {
	for i, sg := range segs {
		if len(sg) < bigEntry {
			if _, err := pc.w.Write(sg); err != nil {
				return err
			}
			continue
		}
		// A run of segments from here on goes out in one writev.
		if err := pc.w.Flush(); err != nil {
			return err
		}
		bufs := net.Buffers(append([][]byte(nil), segs[i:]...))
		_, err := bufs.WriteTo(pc.c)
		return err
	}
	return pc.w.Flush()
}

func (p *peer) fail(pc *peerConn, err error) {
	if !p.t.closed.Load() {
		p.t.log.Debug("send to peer failed", "peer", p.id, "err", err)
	}
	p.drop(pc)
	p.reportUnreachable()
}

func (p *peer) dial() (*peerConn, error) {
	t := p.t
	addr, err := t.cfg.Resolve(p.id)
	if err != nil {
		return nil, fmt.Errorf("resolve host %d: %w", p.id, err)
	}
	raw, err := net.DialTimeout("tcp", addr, t.cfg.DialTimeout)
	if err != nil {
		return nil, err
	}
	if !t.track(raw) {
		return nil, ErrStopped
	}
	raw.SetDeadline(time.Now().Add(t.cfg.DialTimeout))
	c, err := t.secureDialed(context.Background(), raw, p.id)
	if err != nil {
		t.untrack(raw)
		return nil, fmt.Errorf("host %d at %s: %w", p.id, addr, err)
	}
	if err := writeHello(c, connMessages, t.cfg.ID, p.id); err != nil {
		t.untrack(c)
		return nil, err
	}
	var ack [12]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil || string(ack[:4]) != magic || binary.BigEndian.Uint64(ack[4:]) != p.id {
		t.untrack(c)
		return nil, fmt.Errorf("handshake with host %d at %s failed: %v", p.id, addr, err)
	}
	c.SetDeadline(time.Time{})
	pc := &peerConn{c: c, dialedByUs: true, w: bufio.NewWriterSize(c, 256<<10)}
	if !p.install(pc) {
		t.untrack(c)
		if cur := p.current(); cur != nil {
			return cur, nil
		}
		return nil, errors.New("lost connection race")
	}
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		t.readLoop(p, pc, true, bufio.NewReaderSize(c, 256<<10))
	}()
	return pc, nil
}

func writeHello(w io.Writer, kind byte, from, to uint64) error {
	var b [21]byte
	copy(b[:], magic)
	b[4] = kind
	binary.BigEndian.PutUint64(b[5:], from)
	binary.BigEndian.PutUint64(b[13:], to)
	_, err := w.Write(b[:])
	return err
}

func (t *TCPTransport) acceptLoop() {
	defer t.wg.Done()
	for {
		c, err := t.ln.Accept()
		if err != nil {
			if t.closed.Load() {
				return
			}
			t.log.Warn("accept failed", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if !t.track(c) {
			return
		}
		t.wg.Add(1)
		go t.serveConn(c)
	}
}

// authenticate runs an accepted connection's TLS handshake and reads its
// hello, holding one of the MaxPendingConns slots meanwhile. The sender
// named in the hello must be the node the certificate proves.
func (t *TCPTransport) authenticate(raw net.Conn) (c net.Conn, kind byte, from uint64, err error) {
	select {
	case t.pending <- struct{}{}:
		defer func() { <-t.pending }()
	default:
		t.refused("busy", raw, fmt.Errorf("%d connections are authenticating", t.cfg.MaxPendingConns))
		return nil, 0, 0, errors.New("busy")
	}
	raw.SetDeadline(time.Now().Add(max(t.cfg.DialTimeout, 5*time.Second)))
	c = raw
	var tc *tls.Conn
	if sec := t.cfg.Security; sec != nil {
		tc = tls.Server(raw, sec.Server)
		if err := tc.Handshake(); err != nil {
			t.refused("tls", raw, err)
			return nil, 0, 0, err
		}
		c = tc
	}
	var hello [21]byte
	if _, err := io.ReadFull(c, hello[:]); err != nil || string(hello[:4]) != magic {
		t.refused("hello", raw, err)
		return nil, 0, 0, errors.New("bad hello")
	}
	from = binary.BigEndian.Uint64(hello[5:])
	if to := binary.BigEndian.Uint64(hello[13:]); to != t.cfg.ID {
		t.refused("hello", raw, fmt.Errorf("connection from %d for host %d", from, to))
		return nil, 0, 0, errors.New("wrong host")
	}
	if tc != nil {
		cs := tc.ConnectionState()
		if err := t.cfg.Security.Authenticate(from, &cs); err != nil {
			t.refused("identity", raw, fmt.Errorf("claims node %d: %w", from, err))
			return nil, 0, 0, err
		}
		t.watch(raw, &cs)
	}
	raw.SetDeadline(time.Time{})
	return c, hello[4], from, nil
}

func (t *TCPTransport) serveConn(raw net.Conn) {
	defer t.wg.Done()
	c, kind, from, err := t.authenticate(raw)
	if err != nil {
		t.untrack(raw)
		return
	}
	release, ok := t.inboundSlot(from)
	if !ok {
		t.refused("busy", raw, fmt.Errorf("node %d has %d connections open", from, t.cfg.MaxConnsPerPeer))
		t.untrack(raw)
		return
	}
	defer release()
	switch kind {
	case connMessages:
		var ack [12]byte
		copy(ack[:], magic)
		binary.BigEndian.PutUint64(ack[4:], t.cfg.ID)
		if _, err := c.Write(ack[:]); err != nil {
			t.untrack(c)
			return
		}
		p := t.peer(from)
		if p == nil {
			t.refused("busy", raw, fmt.Errorf("%d peers kept", t.cfg.MaxPeers))
			t.untrack(c)
			return
		}
		pc := &peerConn{c: c, w: bufio.NewWriterSize(c, 256<<10)}
		// Read even if the tie-break discards the connection for sending:
		// the other side may already have written to it.
		if !p.install(pc) {
			t.readLoop(p, pc, false, bufio.NewReaderSize(c, 256<<10))
			return
		}
		t.readLoop(p, pc, true, bufio.NewReaderSize(c, 256<<10))
	case connSnapshot:
		t.serveSnapshot(from, c)
	default:
		t.untrack(c)
	}
}

// readLoop decodes frames until the connection fails. A connection that
// lost the tie-break (installed false) is still read until the other side
// closes it: it may have written to it before it learned.
func (t *TCPTransport) readLoop(p *peer, pc *peerConn, installed bool, r *bufio.Reader) {
	defer func() {
		if installed {
			p.drop(pc)
		}
		t.untrack(pc.c)
	}()
	from := p.id
	label := fmt.Sprint(from)
	defer func() {
		// A bug in decoding must cost this connection, not the process.
		if r := recover(); r != nil {
			t.m.readerPanics.Inc()
			t.log.Error("panic reading from peer; closing connection", "peer", from, "panic", r, "stack", string(debug.Stack()))
		}
	}()
	var buf []byte
	for {
		frame, nb, alias, err := readFrame(r, buf, t.cfg.MaxFrameBytes)
		buf = nb
		if err != nil {
			var fe *frameError
			if errors.As(err, &fe) {
				t.m.badFrames.Inc()
				t.log.Error("bad frame; closing connection", "peer", from, "err", err)
			}
			return
		}
		msgs, err := decodeBatch(frame, from, t.cfg.ID, alias)
		if err != nil {
			t.m.badFrames.Inc()
			t.log.Error("bad frame; closing connection", "peer", from, "err", err)
			return
		}
		t.m.peerBytesRecv.WithLabelValues(label).Add(float64(len(frame) + frameHeaderLen))
		t.m.peerMsgsRecv.WithLabelValues(label).Add(float64(len(msgs)))
		if msgs = t.dropForged(from, msgs); len(msgs) > 0 {
			t.h.HandleMessages(from, msgs)
		}
	}
}

// dropForged removes the messages that do not come from the connection's
// node or are not for this host: a peer speaks only for itself.
func (t *TCPTransport) dropForged(from uint64, msgs []Outgoing) []Outgoing {
	out := msgs[:0]
	for _, o := range msgs {
		if m := o.Msg; m != nil && (m.GetFrom() != from || m.GetTo() != t.cfg.ID) {
			t.m.forgedMessages.Inc()
			if now, last := time.Now().UnixNano(), t.lastWarnd.Load(); now-last > int64(time.Second) && t.lastWarnd.CompareAndSwap(last, now) {
				t.log.Warn("dropped a raft message a peer sent in another node's name", "peer", from, "from", m.GetFrom(), "to", m.GetTo(), "type", m.GetType())
			}
			continue
		}
		out = append(out, o)
	}
	return out
}

// encodeBatch builds one frame holding msgs. Returns the number of
// heartbeats sent in compact form.
func encodeBatch(f *frameWriter, msgs []Outgoing) int {
	f.reset()
	f.uvarint(uint64(len(msgs)))
	hb := 0
	for _, o := range msgs {
		f.uvarint(o.Group)
		m := o.Msg
		switch {
		case m == nil:
			f.bytes([]byte{itemApplied})
			f.uvarint(o.Applied)
		case m.GetType() == pb.MsgHeartbeat:
			hb++
			f.bytes([]byte{itemHeartbeat})
			f.uvarint(m.GetTerm())
			f.uvarint(m.GetCommit())
			f.uvarint(uint64(len(m.GetContext())))
			f.bytes(m.GetContext())
		case m.GetType() == pb.MsgHeartbeatResp:
			hb++
			f.bytes([]byte{itemHeartbeatR})
			f.uvarint(m.GetTerm())
			f.uvarint(uint64(len(m.GetContext())))
			f.bytes(m.GetContext())
		case m.GetType() == pb.MsgApp:
			f.app(m, o.tails)
		default:
			f.bytes([]byte{itemRaft})
			size := proto.Size(m)
			f.uvarint(uint64(size))
			n := len(f.scratch)
			var err error
			f.scratch, err = proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(f.scratch, m)
			if err != nil {
				panic(fmt.Sprintf("raft: marshal message: %v", err))
			}
			f.body += len(f.scratch) - n
		}
	}
	return hb
}

func decodeBatch(b []byte, from, to uint64, alias bool) ([]Outgoing, error) {
	n, k := binary.Uvarint(b)
	// Each item takes at least 2 bytes (group, kind).
	if k <= 0 || n > maxBatchMsgs || n > uint64(len(b)-k)/2 {
		return nil, fmt.Errorf("bad message count %d for %d bytes", n, len(b))
	}
	b = b[k:]
	out := make([]Outgoing, 0, n)
	uv := func() (uint64, error) {
		v, k := binary.Uvarint(b)
		if k <= 0 {
			return 0, fmt.Errorf("truncated frame")
		}
		b = b[k:]
		return v, nil
	}
	bytesN := func(n uint64) ([]byte, error) {
		if uint64(len(b)) < n {
			return nil, fmt.Errorf("truncated frame")
		}
		v := b[:n:n]
		b = b[n:]
		return v, nil
	}
	for i := uint64(0); i < n; i++ {
		group, err := uv()
		if err != nil {
			return nil, err
		}
		if len(b) == 0 {
			return nil, fmt.Errorf("truncated frame")
		}
		kind := b[0]
		b = b[1:]
		o := Outgoing{Group: group}
		switch kind {
		case itemApplied:
			if o.Applied, err = uv(); err != nil {
				return nil, err
			}
		case itemHeartbeat, itemHeartbeatR:
			term, err := uv()
			if err != nil {
				return nil, err
			}
			m := &pb.Message{From: proto.Uint64(from), To: proto.Uint64(to), Term: proto.Uint64(term)}
			if kind == itemHeartbeat {
				t := pb.MsgHeartbeat
				m.Type = &t
				commit, err := uv()
				if err != nil {
					return nil, err
				}
				m.Commit = proto.Uint64(commit)
			} else {
				t := pb.MsgHeartbeatResp
				m.Type = &t
			}
			cl, err := uv()
			if err != nil {
				return nil, err
			}
			ctx, err := bytesN(cl)
			if err != nil {
				return nil, err
			}
			if len(ctx) > 0 {
				m.Context = append([]byte(nil), ctx...)
			}
			o.Msg = m
		case itemApp:
			m, rest, err := decodeApp(b, from, to, alias)
			if err != nil {
				return nil, err
			}
			b = rest
			o.Msg = m
		case itemRaft:
			l, err := uv()
			if err != nil {
				return nil, err
			}
			raw, err := bytesN(l)
			if err != nil {
				return nil, err
			}
			m := &pb.Message{}
			// The frame buffer is reused: entries must own their bytes.
			if err := proto.Unmarshal(raw, m); err != nil {
				return nil, fmt.Errorf("bad raft message: %w", err)
			}
			o.Msg = m
		default:
			return nil, fmt.Errorf("unknown item kind %d", kind)
		}
		out = append(out, o)
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%d trailing bytes in frame", len(b))
	}
	return out, nil
}

// SendSnapshot implements Transport: a dedicated connection per snapshot,
// so a large snapshot never delays the heartbeats on the shared one.
func (t *TCPTransport) SendSnapshot(ctx context.Context, to, group uint64, m *pb.Message, body io.Reader) error {
	addr, err := t.cfg.Resolve(to)
	if err != nil {
		return err
	}
	d := net.Dialer{Timeout: t.cfg.DialTimeout}
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	if !t.track(raw) {
		return ErrStopped
	}
	defer t.untrack(raw)
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	raw.SetDeadline(time.Now().Add(max(t.cfg.DialTimeout, 5*time.Second)))
	c, err := t.secureDialed(ctx, raw, to)
	if err != nil {
		return fmt.Errorf("snapshot to host %d at %s: %w", to, addr, err)
	}
	raw.SetDeadline(time.Time{})
	w := bufio.NewWriterSize(c, 1<<20)
	if err := writeHello(w, connSnapshot, t.cfg.ID, to); err != nil {
		return err
	}
	mb, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	var hdr []byte
	hdr = binary.AppendUvarint(hdr, group)
	hdr = binary.AppendUvarint(hdr, uint64(len(mb)))
	w.Write(hdr)
	w.Write(mb)
	chunk := make([]byte, 1<<20)
	var lenb [4]byte
	for {
		n, rerr := body.Read(chunk)
		if n > 0 {
			binary.BigEndian.PutUint32(lenb[:], uint32(n))
			w.Write(lenb[:])
			if _, err := w.Write(chunk[:n]); err != nil {
				return err
			}
			binary.BigEndian.PutUint32(lenb[:], crc32.Checksum(chunk[:n], castagnoli))
			w.Write(lenb[:])
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return fmt.Errorf("reading snapshot: %w", rerr)
		}
	}
	binary.BigEndian.PutUint32(lenb[:], 0)
	w.Write(lenb[:])
	if err := w.Flush(); err != nil {
		return err
	}
	// Status: 0 ok, else 1 + uvarint-length message.
	r := bufio.NewReader(c)
	st, err := r.ReadByte()
	if err != nil {
		return fmt.Errorf("snapshot to host %d: no reply: %w", to, err)
	}
	if st == 0 {
		return nil
	}
	l, err := binary.ReadUvarint(r)
	if err != nil || l > 4096 {
		return fmt.Errorf("snapshot to host %d failed", to)
	}
	msg := make([]byte, l)
	io.ReadFull(r, msg)
	return fmt.Errorf("snapshot to host %d failed: %s", to, msg)
}

func (t *TCPTransport) serveSnapshot(from uint64, c net.Conn) {
	defer t.untrack(c)
	r := bufio.NewReaderSize(c, 1<<20)
	group, err := binary.ReadUvarint(r)
	if err != nil {
		return
	}
	l, err := binary.ReadUvarint(r)
	if err != nil || l > maxSnapshotHeader {
		t.log.Error("bad snapshot header; closing connection", "peer", from, "bytes", l, "err", err)
		return
	}
	mb := make([]byte, l)
	if _, err := io.ReadFull(r, mb); err != nil {
		return
	}
	m := &pb.Message{}
	if err := proto.Unmarshal(mb, m); err != nil || m.GetType() != pb.MsgSnap {
		return
	}
	if m.GetFrom() != from || m.GetTo() != t.cfg.ID {
		t.dropForged(from, []Outgoing{{Group: group, Msg: m}})
		return
	}
	body := &chunkReader{r: r}
	err = t.h.HandleSnapshot(from, group, m, body)
	if err == nil {
		// The state machine may not read to the end; the stream must be
		// consumed to check it was complete.
		if _, derr := io.Copy(io.Discard, body); derr != nil {
			err = derr
		}
	}
	if err == nil {
		c.Write([]byte{0})
		return
	}
	msg := err.Error()
	if len(msg) > 4096 {
		msg = msg[:4096]
	}
	out := append([]byte{1}, binary.AppendUvarint(nil, uint64(len(msg)))...)
	c.Write(append(out, msg...))
}

// maxSnapshotHeader bounds the MsgSnap (metadata only) ahead of a
// snapshot stream; maxSnapshotChunk bounds one chunk (the sender writes
// 1 MiB).
const (
	maxSnapshotHeader = 1 << 20
	maxSnapshotChunk  = 16 << 20
)

// chunkReader reads the chunks of a snapshot stream, each
//
//	uint32 length, data, uint32 CRC32C of data
//
// ended by a zero length. A stream cut short or a checksum mismatch is an
// error (Restore must then fail and keep the old state), never a silent EOF.
type chunkReader struct {
	r    *bufio.Reader
	left uint32
	sum  uint32
	done bool
}

func (c *chunkReader) endChunk() error {
	var lb [4]byte
	if _, err := io.ReadFull(c.r, lb[:]); err != nil {
		return fmt.Errorf("snapshot stream cut short: %w", io.ErrUnexpectedEOF)
	}
	if want := binary.BigEndian.Uint32(lb[:]); want != c.sum {
		return fmt.Errorf("snapshot chunk checksum %08x, stream says %08x", c.sum, want)
	}
	c.sum = 0
	return nil
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if c.done {
		return 0, io.EOF
	}
	for c.left == 0 {
		var lb [4]byte
		if _, err := io.ReadFull(c.r, lb[:]); err != nil {
			return 0, fmt.Errorf("snapshot stream cut short: %w", io.ErrUnexpectedEOF)
		}
		c.left = binary.BigEndian.Uint32(lb[:])
		if c.left == 0 {
			c.done = true
			return 0, io.EOF
		}
		if c.left > maxSnapshotChunk {
			return 0, fmt.Errorf("snapshot chunk of %d bytes exceeds %d", c.left, maxSnapshotChunk)
		}
	}
	if uint32(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= uint32(n)
	c.sum = crc32.Update(c.sum, castagnoli, p[:n])
	if err == io.EOF {
		err = fmt.Errorf("snapshot stream cut short: %w", io.ErrUnexpectedEOF)
	}
	if err == nil && c.left == 0 {
		err = c.endChunk()
	}
	return n, err
}
