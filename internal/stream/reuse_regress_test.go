package stream

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
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
