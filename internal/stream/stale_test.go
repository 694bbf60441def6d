package stream

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
)

// closePeerOf closes, on srv, the accepted connection whose other end is
// kc (a kept connection, as a datanode closes one idle), then waits until
// kc's socket has the FIN: a header written into kc now crosses that
// close on the wire, deterministically (the peek before it saw the
// connection open).
func closePeerOf(t *testing.T, srv *Server, kc net.Conn) {
	raw := rawTCP(kc)
	srv.mu.Lock()
	var peer net.Conn
	for c := range srv.conns {
		if c.RemoteAddr().String() == raw.LocalAddr().String() {
			peer = c
		}
	}
	srv.mu.Unlock()
	if peer == nil {
		t.Errorf("no accepted connection of %v on the server", raw.LocalAddr())
		return
	}
	peer.Close()
	deadline := time.Now().Add(5 * time.Second)
	for peekClosed(raw) == nil {
		if time.Now().After(deadline) {
			t.Errorf("the server's close of %v never arrived", raw.LocalAddr())
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// The idle-close race, made deterministic: the datanode closes a kept
// connection right after the peek found it open and before the next
// header is written into it: on the client's connection to datanode 1,
// and on datanode 1's to datanode 2. The stream fails with CodeStale
// naming that datanode (not CodeConnLost: the client must not exclude a
// healthy datanode for it), stores nothing anywhere, is counted, and the
// next stream with Options.Fresh goes through on new connections.
func TestReuseStaleHeaderAbandoned(t *testing.T) {
	for _, who := range []string{"client", "datanode", "client plaintext"} {
		t.Run(who, func(t *testing.T) {
			var route []Target
			var nodes []*node
			var opts Options
			p := NewConnPool(0, 0)
			defer p.Close()
			if who == "client plaintext" {
				nodes, route = chain(t, 2, 5*time.Second)
			} else {
				c := newSecureCluster(t, 3)
				nodes, route = c.nodes, c.route()
				opts.TLS = c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
			}
			opts.Timeout, opts.Pool = 5*time.Second, p
			if _, _, _, _, err := poolWrite(t, route, BlockID{1, 200}, payload(10<<10, 1), opts.TLS, p, nil); err != nil {
				t.Fatal(err)
			}
			victim, closer := route[0], nodes[0].srv // the client's connection to datanode 1
			if who == "datanode" {
				victim, closer = route[1], nodes[1].srv // datanode 1's to datanode 2
			}
			var hits atomic.Int32
			f := func(kc net.Conn) {
				if rawTCP(kc).RemoteAddr().String() == victim.Addr {
					hits.Add(1)
					closePeerOf(t, closer, kc)
				}
			}
			testHookKept.Store(&f)
			t.Cleanup(func() { testHookKept.Store(nil) })
			b := BlockID{1, 201}
			_, err := Dial(context.Background(), route, 1, b, opts)
			testHookKept.Store(nil)
			var se *Error
			if !errors.As(err, &se) || se.Code != CodeStale || se.Datanode != victim.ID {
				t.Fatalf("stream into a connection closed as its header crossed: %v, want CodeStale naming datanode %d", err, victim.ID)
			}
			if hits.Load() != 1 {
				t.Fatalf("hook closed %d connections, want 1", hits.Load())
			}
			ps := p.Stats()
			if ps.StaleHeaders != 1 || ps.Stale != 0 || ps.Reuses != 1 || ps.Dials != 1 {
				t.Fatalf("pool %+v: want one stream abandoned as stale on a reused connection, no redial of the block", ps)
			}
			if who == "datanode" {
				if st := nodes[0].srv.Stats(); st.DownStaleHeaders != 1 {
					t.Fatalf("datanode 1 %+v: want one stale header down counted", st)
				}
			}
			for _, n := range nodes {
				if hasData(t, n, b) {
					t.Fatalf("datanode %d kept data of the abandoned stream", n.id)
				}
			}
			// The client writes the data again as a new block, on a new
			// connection (every hop then opens new ones).
			nb := BlockID{1, 202}
			data := payload(100<<10, 2)
			fo := opts
			fo.Fresh = true
			w, err := Dial(context.Background(), route, 1, nb, fo)
			if err != nil {
				t.Fatalf("fresh stream after the stale one: %v", err)
			}
			if _, err := w.Write(data); err != nil {
				t.Fatal(err)
			}
			length, chunks, err := w.Close()
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range nodes {
				commitAndCheck(t, n.st, nb, length, chunks, data)
			}
			if ps := p.Stats(); ps.Dials != 2 || ps.StaleHeaders != 1 || ps.Idle != 1 {
				t.Fatalf("pool %+v: want the fresh stream on a new connection, pooled after", ps)
			}
		})
	}
}

// Options.Fresh leaves the pooled connection of the route in the pool.
func TestFreshSkipsPool(t *testing.T) {
	_, route := chain(t, 1, 5*time.Second)
	p := NewConnPool(0, 0)
	defer p.Close()
	if _, _, _, _, err := poolWrite(t, route, BlockID{1, 210}, payload(1<<10, 1), nil, p, nil); err != nil {
		t.Fatal(err)
	}
	w, err := Dial(context.Background(), route, 1, BlockID{1, 211}, Options{Timeout: 5 * time.Second, Pool: p, Fresh: true})
	if err != nil {
		t.Fatal(err)
	}
	if ps := p.Stats(); ps.Dials != 2 || ps.Reuses != 0 || ps.Idle != 1 {
		t.Fatalf("pool %+v: want a new connection and the pooled one left idle", ps)
	}
	w.Abort()
}

// scriptedDN is a plaintext datanode of one hop that serves its
// connections' first stream as a datanode does (unless first says
// otherwise) and answers the header of the next by script: real failures
// after (or in answer to) a header must keep naming it, not CodeStale.
type scriptedDN struct {
	lis net.Listener
}

func startScripted(t *testing.T, first, next func(c net.Conn, h *Header)) *scriptedDN {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				h, err := readHeader(c)
				if err != nil {
					return
				}
				if first != nil {
					first(c, h)
					return
				}
				if !fakeServe(c, h) {
					return
				}
				if h, err = readHeader(c); err == nil {
					next(c, h)
				}
			}()
		}
	}()
	return &scriptedDN{lis: lis}
}

// fakeServe acks h and the stream's packets up to its close.
func fakeServe(c net.Conn, h *Header) bool {
	if _, err := c.Write((&ack{kind: kindHeaderAck, value: h.Offset}).encode(nil)); err != nil {
		return false
	}
	var hb [packetHeaderLen]byte
	for {
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return false
		}
		var ph packetHeader
		if ph.decode(&hb) != nil {
			return false
		}
		if ph.kind == kindClose {
			_, err := c.Write((&ack{kind: kindCloseAck, seq: ph.seq, value: ph.offset}).encode(nil))
			return err == nil
		}
		if _, err := io.CopyN(io.Discard, c, int64(ph.length)); err != nil {
			return false
		}
		if _, err := c.Write((&ack{kind: kindDataAck, seq: ph.seq, value: ph.offset + uint64(ph.length)}).encode(nil)); err != nil {
			return false
		}
	}
}

// Failures of a reused connection that are not the idle-close race stay
// the datanode's (CodeStale only for a connection that ended before any
// byte of the answer), and CodeStale is honoured only in answer to a
// header on a kept connection.
func TestStaleOnlyForUnansweredKeptHeader(t *testing.T) {
	const id = 7
	headerAck := func(c net.Conn, h *Header) {
		c.Write((&ack{kind: kindHeaderAck, value: h.Offset}).encode(nil))
	}
	cases := []struct {
		name        string
		first, next func(c net.Conn, h *Header)
		dialCode    Code // 0: the Dial succeeds
		streamCode  Code // the Writer's failure after an open
	}{
		{name: "closed unanswered (the race)", next: func(net.Conn, *Header) {}, dialCode: CodeStale},
		{name: "reset unanswered (the race)", next: func(c net.Conn, _ *Header) { c.(*net.TCPConn).SetLinger(0) }, dialCode: CodeStale},
		{name: "partial answer then closed", next: func(c net.Conn, h *Header) {
			c.Write((&ack{kind: kindHeaderAck, value: h.Offset}).encode(nil)[:5])
		}, dialCode: CodeConnLost},
		{name: "error answer", next: func(c net.Conn, _ *Header) {
			c.Write(errorAck(&Error{Code: CodeIO, Datanode: id, Reason: "disk"}).encode(nil))
		}, dialCode: CodeIO},
		{name: "held open unanswered", next: func(c net.Conn, _ *Header) { time.Sleep(3 * time.Second) }, dialCode: CodeTimeout},
		{name: "answered then closed", next: headerAck, streamCode: CodeConnLost},
		{name: "stale said after the header ack", next: func(c net.Conn, h *Header) {
			headerAck(c, h)
			c.Write(errorAck(&Error{Code: CodeStale, Datanode: id}).encode(nil))
		}, streamCode: CodeConnLost},
		{name: "stale said on a new connection", first: func(c net.Conn, _ *Header) {
			c.Write(errorAck(&Error{Code: CodeStale, Datanode: id}).encode(nil))
		}, dialCode: CodeConnLost},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dn := startScripted(t, tc.first, tc.next)
			route := []Target{{ID: id, Addr: dn.lis.Addr().String()}}
			p := NewConnPool(0, 0)
			defer p.Close()
			opts := Options{Timeout: 500 * time.Millisecond, Pool: p}
			if tc.first == nil {
				if _, _, _, _, err := poolWrite(t, route, BlockID{1, 220}, payload(10<<10, 1), nil, p, nil); err != nil {
					t.Fatal(err)
				}
			}
			w, err := Dial(context.Background(), route, 1, BlockID{1, 221}, opts)
			var se *Error
			switch {
			case tc.dialCode != 0:
				if !errors.As(err, &se) || se.Code != tc.dialCode || se.Datanode != id {
					t.Fatalf("dial: %v, want %v naming datanode %d", err, tc.dialCode, id)
				}
			case err != nil:
				t.Fatalf("dial: %v", err)
			default:
				_, werr := w.Write(payload(10<<10, 2))
				if werr == nil {
					_, _, werr = w.Close()
				} else {
					w.Abort()
				}
				if !errors.As(werr, &se) || se.Code != tc.streamCode || se.Datanode != id {
					t.Fatalf("stream: %v, want %v naming datanode %d", werr, tc.streamCode, id)
				}
			}
			want := uint64(0)
			if tc.dialCode == CodeStale {
				want = 1
			}
			if ps := p.Stats(); ps.StaleHeaders != want {
				t.Fatalf("pool %+v: want %d stale headers", ps, want)
			}
		})
	}
}

// A hop passes CodeStale up only for its own kept connection down (or
// one relayed over it): an error ack saying "stale" over a NEW connection
// down is the next datanode's failure (CodeConnLost naming it), as the
// client's dialOn treats one on a new connection; and only the hop whose
// kept connection ended counts DownStaleHeaders, not the hops relaying it.
func TestHopStaleOnlyForItsKeptConnection(t *testing.T) {
	const id = 7
	t.Run("stale said on a new connection down", func(t *testing.T) {
		// The client's connection to datanode 1 is kept; datanode 1's to
		// the scripted datanode 7 was closed by 7 after the first stream,
		// so datanode 1 dials it anew, and 7 answers that header "stale".
		dn1 := startNode(t, 1, 5*time.Second, nil)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { lis.Close() })
		firstClosed := make(chan struct{})
		go func() {
			for n := 0; ; n++ {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				go func(n int) {
					defer c.Close()
					h, err := readHeader(c)
					if err != nil {
						return
					}
					if n == 0 {
						fakeServe(c, h)
						c.Close()
						close(firstClosed)
						return
					}
					c.Write(errorAck(&Error{Code: CodeStale, Datanode: id, Reason: "lying"}).encode(nil))
				}(n)
			}
		}()
		route := []Target{dn1.target(), {ID: id, Addr: lis.Addr().String()}}
		p := NewConnPool(0, 0)
		defer p.Close()
		if _, _, _, _, err := poolWrite(t, route, BlockID{1, 230}, payload(10<<10, 1), nil, p, nil); err != nil {
			t.Fatal(err)
		}
		<-firstClosed
		time.Sleep(100 * time.Millisecond) // the FIN reaches datanode 1's socket (loopback)
		_, err = Dial(context.Background(), route, 1, BlockID{1, 231}, Options{Timeout: 5 * time.Second, Pool: p})
		var se *Error
		if !errors.As(err, &se) || se.Code != CodeConnLost || se.Datanode != id {
			t.Fatalf("dial: %v, want CodeConnLost naming datanode %d", err, id)
		}
		if ps := p.Stats(); ps.Reuses != 1 || ps.StaleHeaders != 0 {
			t.Fatalf("pool %+v: want the client's kept connection used, no stale header", ps)
		}
		if st := dn1.srv.Stats(); st.DownStale != 1 || st.DownDials != 2 || st.DownStaleHeaders != 0 {
			t.Fatalf("datanode 1 %+v: want its kept connection down found closed, a new one dialed, no stale header", st)
		}
	})
	t.Run("relayed stale counted once", func(t *testing.T) {
		// Every connection kept; the scripted datanode 7 (third hop)
		// closes its kept connection after reading the next header:
		// datanode 2 counts it and says CodeStale, datanode 1 relays it.
		ns, route := chain(t, 2, 5*time.Second)
		dn := startScripted(t, nil, func(net.Conn, *Header) {})
		route = append(route, Target{ID: id, Addr: dn.lis.Addr().String()})
		p := NewConnPool(0, 0)
		defer p.Close()
		if _, _, _, _, err := poolWrite(t, route, BlockID{1, 240}, payload(10<<10, 1), nil, p, nil); err != nil {
			t.Fatal(err)
		}
		_, err := Dial(context.Background(), route, 1, BlockID{1, 241}, Options{Timeout: 5 * time.Second, Pool: p})
		var se *Error
		if !errors.As(err, &se) || se.Code != CodeStale || se.Datanode != id {
			t.Fatalf("dial: %v, want CodeStale naming datanode %d", err, id)
		}
		if got := [2]uint64{ns[0].srv.Stats().DownStaleHeaders, ns[1].srv.Stats().DownStaleHeaders}; got != [2]uint64{0, 1} {
			t.Fatalf("DownStaleHeaders of datanodes 1, 2: %v, want [0 1] (counted where the kept connection ended)", got)
		}
	})
}
