package stream

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
)

// Regression tests for the review of the reuse branch (session 15,
// /work/notes/rev15/streamreuse-review.md); the first four are the
// reviewer's repros, made strict.

// A panic while a datanode checks the NEXT header (here in
// Security.Target) must not abort the previous stream, cleanly closed and
// acked, nor leak the idle slot it waited in.
func TestReusePanicInNextHeaderKeepsAckedBlock(t *testing.T) {
	c := newSecureCluster(t, 0)
	var calls atomic.Int32
	c.tweak = func(cfg *ServerConfig) {
		if cfg.ID == 1 {
			orig := cfg.Security.Target
			cfg.Security.Target = func(tg Target) error {
				if calls.Add(1) == 2 {
					panic("test: a bug in a check of the next header")
				}
				return orig(tg)
			}
		}
	}
	c.start(t, 1)
	c.start(t, 2)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	a := BlockID{1, 95}
	data := payload(100<<10, 5)
	length, chunks, _, _, err := poolWrite(t, c.route(), a, data, cfg, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Block a's close was acked by every hop: durable on both replicas.
	_, _, _, _, err = poolWrite(t, c.route(), BlockID{1, 96}, payload(10<<10, 6), cfg, p, nil)
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeInternal {
		t.Fatalf("second stream: %v, want the recovered panic (CodeInternal)", err)
	}
	waitFor(t, 5*time.Second, "datanode 1 to end the connection", func() bool {
		c.nodes[0].srv.mu.Lock()
		defer c.nodes[0].srv.mu.Unlock()
		return len(c.nodes[0].srv.conns) == 0
	})
	for _, n := range c.nodes {
		commitAndCheck(t, n.st, a, length, chunks, data)
	}
	if n := c.nodes[0].srv.Stats().Idle; n != 0 {
		t.Fatalf("datanode 1 counts %d idle connections after the panic, want 0 (slot leaked)", n)
	}
}

// Datanode 2 over MaxIdle closes the connection from datanode 1 after a
// clean stream; datanode 1 must notice before sending the next header
// into it and dial anew, not fail the stream naming healthy datanode 2.
func TestReuseDownstreamOverMaxIdle(t *testing.T) {
	c := newSecureCluster(t, 0)
	c.tweak = func(cfg *ServerConfig) {
		if cfg.ID == 2 {
			cfg.MaxIdle = 1
		}
	}
	c.start(t, 1)
	c.start(t, 2)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	r := c.route()
	p1, p2 := NewConnPool(0, 0), NewConnPool(0, 0)
	defer p1.Close()
	defer p2.Close()
	// another client holds datanode 2's only idle slot
	if _, _, _, _, err := poolWrite(t, r[1:], BlockID{1, 90}, payload(10<<10, 1), cfg, p1, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, _, _, err := poolWrite(t, r, BlockID{1, 91}, payload(10<<10, 2), cfg, p2, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if _, _, _, _, err := poolWrite(t, r, BlockID{1, 92}, payload(10<<10, 3), cfg, p2, nil); err != nil {
		t.Fatalf("healthy chain failed on reuse: %v", err)
	}
	if st := c.nodes[0].srv.Stats(); st.DownDials != 2 || st.Reused != 1 || st.Failed != 0 {
		t.Fatalf("datanode 1 %+v: want the stream reused from the client and a new connection down", st)
	}
}

// Datanode 2 restarts on the same address between two blocks of a route:
// datanode 1's kept connection to it is dead, and the next block must
// still go through (datanode 1 dials anew).
func TestReuseDownstreamRestart(t *testing.T) {
	c := newSecureCluster(t, 0)
	var cfg2 ServerConfig
	c.tweak = func(cfg *ServerConfig) {
		if cfg.ID == 2 {
			cfg2 = *cfg
		}
	}
	c.start(t, 1)
	c.start(t, 2)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 97}, payload(10<<10, 7), cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	addr := c.nodes[1].lis.Addr().String()
	c.nodes[1].srv.Close()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(cfg2)
	go srv.Serve(lis)
	defer srv.Close()
	time.Sleep(200 * time.Millisecond)
	for i := range 2 {
		if _, _, _, _, err = poolWrite(t, c.route(), BlockID{1, uint64(98 + i)}, payload(10<<10, 8), cfg, p, nil); err != nil {
			t.Fatalf("block %d after datanode 2 restarted: %v", i, err)
		}
	}
	if ps := p.Stats(); ps.Dials != 1 {
		t.Fatalf("pool %+v: the client's connection to datanode 1 should have been reused", ps)
	}
}

// A client certificate that expires while its connection is pooled: no
// stream may be opened on that connection past the certificate's
// NotAfter (a new connection with it is refused by the handshake).
func TestReuseNotPastCertificateExpiry(t *testing.T) {
	c := newSecureCluster(t, 2)
	cr, err := c.ca.Issue(pki.Identity{Role: pki.RoleClient, ID: "app"}, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	cfg := cr.ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 110}, payload(10<<10, 1), cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(cr.Leaf().NotAfter) + 200*time.Millisecond)
	_, _, _, _, err = poolWrite(t, c.route(), BlockID{1, 111}, payload(10<<10, 1), cfg, p, nil)
	if err == nil {
		t.Fatalf("a stream opened with a certificate expired at %v (pool %+v)", cr.Leaf().NotAfter, p.Stats())
	}
	t.Logf("after expiry: %v (pool %+v)", err, p.Stats())
	for _, n := range c.nodes {
		if hasData(t, n, BlockID{1, 111}) {
			t.Fatalf("datanode %d stored data of the stream past expiry", n.id)
		}
	}
}

// Revocations while the connections are idle between streams: the next
// stream fails and stores nothing.
func TestReuseRevokedWhileIdle(t *testing.T) {
	for _, which := range []string{"client", "downstream", "first hop"} {
		t.Run(which, func(t *testing.T) {
			c := newSecureCluster(t, 0)
			dn1 := c.startWatched(t, 1, true)
			dn2 := c.startWatched(t, 2, true)
			client := c.issue(t, pki.RoleClient, "app")
			p := NewConnPool(0, 0)
			defer p.Close()
			ccfg := client.ClientTLS(pki.RoleDatanode)
			write := func(local uint64) error {
				w, err := Dial(context.Background(), c.route(), 1, BlockID{1, local}, Options{TLS: ccfg, Timeout: 5 * time.Second, Watch: client.Watch, Pool: p})
				if err != nil {
					return err
				}
				if _, err := w.Write(payload(64<<10, local)); err != nil {
					w.Abort()
					return err
				}
				_, _, err = w.Close()
				return err
			}
			if err := write(1); err != nil {
				t.Fatal(err)
			}
			switch which {
			case "client":
				dn1.SetRevoked([]string{pki.SerialString(client.Leaf().SerialNumber)})
			case "downstream":
				dn1.SetRevoked([]string{pki.SerialString(dn2.Leaf().SerialNumber)})
			default:
				client.SetRevoked([]string{pki.SerialString(dn1.Leaf().SerialNumber)})
			}
			time.Sleep(100 * time.Millisecond)
			err := write(2)
			t.Logf("%s revoked while idle: next stream err=%v pool=%+v dn1=%+v", which, err, p.Stats(), c.nodes[0].srv.Stats())
			if err == nil {
				t.Errorf("stream succeeded after %s revocation", which)
			}
			if hasData(t, c.nodes[0], BlockID{1, 2}) || hasData(t, c.nodes[1], BlockID{1, 2}) {
				t.Errorf("data stored")
			}
		})
	}
}

// rawTCP is the TCP connection under a stream connection.
func rawTCP(c net.Conn) *net.TCPConn {
	if rc, ok := c.(*recordConn); ok {
		c = rc.Conn
	}
	return c.(*net.TCPConn)
}

// A kept connection that looks open but whose header write fails (here:
// its write side shut on this end right after the peek) is retried once
// on a new connection, by the client and by a datanode: the peer cannot
// have read the header whole.
func TestReuseRetriesUnsentHeader(t *testing.T) {
	for _, who := range []string{"client", "datanode"} {
		t.Run(who, func(t *testing.T) {
			c := newSecureCluster(t, 3)
			cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
			p := NewConnPool(0, 0)
			defer p.Close()
			if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 130}, payload(10<<10, 1), cfg, p, nil); err != nil {
				t.Fatal(err)
			}
			victim := c.nodes[0].target().Addr // the client's connection to datanode 1
			if who == "datanode" {
				victim = c.nodes[1].target().Addr // datanode 1's to datanode 2
			}
			var shut atomic.Int32
			f := func(kc net.Conn) {
				if raw := rawTCP(kc); raw.RemoteAddr().String() == victim {
					shut.Add(1)
					raw.CloseWrite()
				}
			}
			testHookKept.Store(&f)
			t.Cleanup(func() { testHookKept.Store(nil) })
			b := BlockID{1, 131}
			data := payload(100<<10, 2)
			length, chunks, _, _, err := poolWrite(t, c.route(), b, data, cfg, p, nil)
			if err != nil {
				t.Fatalf("stream after an unsent header: %v", err)
			}
			testHookKept.Store(nil)
			if shut.Load() != 1 {
				t.Fatalf("hook shut %d connections, want 1", shut.Load())
			}
			for _, n := range c.nodes {
				commitAndCheck(t, n.st, b, length, chunks, data)
			}
			ps, st := p.Stats(), c.nodes[0].srv.Stats()
			switch who {
			case "client":
				if ps.Stale != 1 || ps.Dials != 2 {
					t.Fatalf("pool %+v: want the unsent header retried on a new connection", ps)
				}
			default:
				if ps.Stale != 0 || ps.Reuses != 1 || st.DownStale != 1 || st.DownDials != 2 || st.Failed != 0 {
					t.Fatalf("pool %+v, datanode 1 %+v: want datanode 1 to retry on a new connection down", ps, st)
				}
			}
		})
	}
}

// cutProxy forwards TCP to a datanode; armed, it forwards the next bytes
// a client sends on any connection (a header), then closes that
// connection to the client and drops whatever the datanode answers: a
// connection lost after the header reached the datanode.
type cutProxy struct {
	lis   net.Listener
	armed atomic.Bool
}

func startCutProxy(t *testing.T, to string) *cutProxy {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{lis: lis}
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			d, err := net.Dial("tcp", to)
			if err != nil {
				c.Close()
				continue
			}
			var cut atomic.Bool
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if p.armed.CompareAndSwap(true, false) {
							cut.Store(true)
						}
						d.Write(buf[:n])
						if cut.Load() {
							c.Close()
							return
						}
					}
					if err != nil {
						d.(*net.TCPConn).CloseWrite()
						return
					}
				}
			}()
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := d.Read(buf)
					if n > 0 && !cut.Load() {
						c.Write(buf[:n])
					}
					if err != nil {
						c.Close()
						return
					}
				}
			}()
		}
	}()
	return p
}

// A pooled connection lost after the header was written (the datanode
// may have opened the stream) is the stream's failure: the client must
// not open the same block again on a new connection (review finding 4).
func TestReuseNoRetryAfterHeaderSent(t *testing.T) {
	ns, route := chain(t, 2, 5*time.Second)
	px := startCutProxy(t, route[0].Addr)
	route[0].Addr = px.lis.Addr().String()
	p := NewConnPool(0, 0)
	defer p.Close()
	if _, _, _, _, err := poolWrite(t, route, BlockID{1, 140}, payload(10<<10, 1), nil, p, nil); err != nil {
		t.Fatal(err)
	}
	px.armed.Store(true)
	_, _, _, _, err := poolWrite(t, route, BlockID{1, 141}, payload(10<<10, 2), nil, p, nil)
	if err == nil {
		t.Fatalf("stream succeeded: the client opened the block again on a new connection (pool %+v)", p.Stats())
	}
	if ps := p.Stats(); ps.Stale != 0 || ps.Dials != 1 {
		t.Fatalf("pool %+v: a failure after the header was sent counted stale and retried", ps)
	}
	// Unanswered: the client's caller may write the data again, but as a
	// new block (session 16, CodeStale).
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeStale || p.Stats().StaleHeaders != 1 {
		t.Fatalf("%v (pool %+v): want CodeStale, counted", err, p.Stats())
	}
	_ = ns
}

// Connections have a maximum age: the pool's (a connection older is not
// used) and the datanodes' (an accepted one is closed, a kept one down is
// not reused past MaxConnAge less a margin).
func TestReuseMaxConnAge(t *testing.T) {
	c := newSecureCluster(t, 0)
	c.tweak = func(cfg *ServerConfig) { cfg.MaxConnAge = 4 * time.Second }
	c.start(t, 1)
	c.start(t, 2)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)

	// The pool's own bound.
	p := NewConnPool(0, 0)
	p.maxAge = 200 * time.Millisecond
	for i := range 2 {
		if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, uint64(150 + i)}, payload(10<<10, 1), cfg, p, nil); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
	}
	if ps := p.Stats(); ps.Dials != 2 || ps.Reuses != 0 || ps.Stale != 0 {
		t.Fatalf("pool %+v: want the connection past the pool's max age closed, not reused", ps)
	}
	p.Close()

	// The datanodes' (4 s; datanode 1 reuses its connection down for 3 s).
	p = NewConnPool(0, 0)
	defer p.Close()
	start := time.Now()
	if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 160}, payload(10<<10, 1), cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	dd := c.nodes[0].srv.Stats().DownDials
	time.Sleep(time.Until(start.Add(3400 * time.Millisecond)))
	if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 161}, payload(10<<10, 1), cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	if ps, st := p.Stats(), c.nodes[0].srv.Stats(); ps.Reuses != 1 || st.DownStale != 1 || st.DownDials != dd+1 {
		t.Fatalf("pool %+v, datanode 1 %+v: want the client's connection reused and datanode 1's down replaced", ps, st)
	}
	time.Sleep(time.Until(start.Add(4300 * time.Millisecond)))
	if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 162}, payload(10<<10, 1), cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	if ps := p.Stats(); ps.Stale != 1 || ps.Dials != 2 {
		t.Fatalf("pool %+v: want datanode 1 to have closed the connection at its max age", ps)
	}
}

// The pool keeps the TLS configuration a pooled connection was opened
// with alive (it is the key): a configuration collected while its
// connection is pooled could see its address reused by another one,
// which would then be handed that connection (review finding 5).
func TestPoolKeepsTLSConfigAlive(t *testing.T) {
	c := newSecureCluster(t, 1)
	cr := c.issue(t, pki.RoleClient, "app")
	p := NewConnPool(0, 0)
	defer p.Close()
	wp := func() weak.Pointer[tls.Config] {
		cfg := cr.ClientTLS(pki.RoleDatanode)
		if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 170}, payload(10<<10, 1), cfg, p, nil); err != nil {
			t.Fatal(err)
		}
		return weak.Make(cfg)
	}()
	for range 3 {
		runtime.GC()
	}
	if wp.Value() == nil {
		t.Fatal("the TLS configuration of a pooled connection was collected")
	}
	if ps := p.Stats(); ps.Idle != 1 {
		t.Fatalf("pool %+v", ps)
	}
}

// Once the first byte of a next header has arrived, the rest must come
// within Timeout, not ReuseIdle (review nit 10).
func TestNextHeaderTimeoutAfterFirstByte(t *testing.T) {
	st, err := storage.Open(storage.Options{Volumes: []string{t.TempDir()}, ContainerSize: 4 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &node{id: 1, st: st, lis: lis, srv: NewServer(ServerConfig{ID: 1, Backend: storeBackend{st: st}, Timeout: 300 * time.Millisecond, ReuseIdle: 10 * time.Second})}
	go n.srv.Serve(lis)
	defer n.srv.Close()
	p := NewConnPool(0, 0)
	defer p.Close()
	route := []Target{n.target()}
	if _, _, _, _, err := poolWrite(t, route, BlockID{1, 180}, payload(10<<10, 1), nil, p, nil); err != nil {
		t.Fatal(err)
	}
	pc := p.get(keyFor(route, nil))
	if pc == nil {
		t.Fatal("nothing pooled")
	}
	defer pc.close()
	if _, err := pc.conn.Write([]byte{0x42}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	pc.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = io.Copy(io.Discard, pc.conn)
	if took := time.Since(start); err != nil || took > 3*time.Second {
		t.Fatalf("datanode closed the connection after %v (err %v); want about its Timeout (300ms) after a partial header", took, err)
	}
}
