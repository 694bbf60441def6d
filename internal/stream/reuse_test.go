package stream

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
)

// poolWrite streams data as block b through route with the pool and
// returns the Writer's record connection's payload key and control
// counter as they were at the close (nil key on plaintext).
func poolWrite(t *testing.T, route []Target, b BlockID, data []byte, cfg *tls.Config, p *ConnPool, token []byte) (length uint64, chunks []Chunk, key []byte, ctl uint64, err error) {
	t.Helper()
	w, err := Dial(context.Background(), route, 1, b, Options{TLS: cfg, Timeout: 5 * time.Second, Pool: p, Token: token})
	if err != nil {
		return 0, nil, nil, 0, err
	}
	if rc, ok := w.conn.(*recordConn); ok {
		key = append([]byte(nil), rc.payKey...)
		if rc.pay.seq != 0 {
			t.Errorf("stream %v starts its payload counter at %d", b, rc.pay.seq)
		}
		ctl = rc.out.seq
	}
	if _, err := w.Write(data); err != nil {
		w.Abort()
		return 0, nil, key, ctl, err
	}
	length, chunks, err = w.Close()
	return length, chunks, key, ctl, err
}

func sumStats(ns []*node) (s Stats) {
	for _, n := range ns {
		x := n.srv.Stats()
		s.Accepted += x.Accepted
		s.Reused += x.Reused
		s.DownDials += x.DownDials
		s.Failed += x.Failed
	}
	return s
}

// TestReuseSecureChain: blocks written one after another through the same
// route of three secured datanodes share one connection per hop: one
// client dial, one accepted connection per datanode, one downstream dial
// per forwarding datanode; every block is stored intact on every replica;
// every stream has a payload key of its own (payload counters from 0),
// while the control records' counter goes on.
func TestReuseSecureChain(t *testing.T) {
	c := newSecureCluster(t, 3)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	const k = 5
	keys := map[string]bool{}
	var lastCtl uint64
	for i := range k {
		b := BlockID{1, uint64(10 + i)}
		data := payload(1<<20+int(i)*4097, uint64(i))
		length, chunks, key, ctl, err := poolWrite(t, c.route(), b, data, cfg, p, nil)
		if err != nil {
			t.Fatalf("block %d: %v", i, err)
		}
		if len(key) == 0 || keys[string(key)] {
			t.Fatalf("block %d: payload key %x empty or used before", i, key)
		}
		keys[string(key)] = true
		if i > 0 && ctl <= lastCtl {
			t.Fatalf("block %d: control counter %d after %d: the record channel restarted", i, ctl, lastCtl)
		}
		lastCtl = ctl
		for _, n := range c.nodes {
			commitAndCheck(t, n.st, b, length, chunks, data)
		}
	}
	ps := p.Stats()
	if ps.Dials != 1 || ps.Reuses != k-1 || ps.Idle != 1 {
		t.Fatalf("pool: %+v, want 1 dial and %d reuses, 1 idle", ps, k-1)
	}
	for i, n := range c.nodes {
		st := n.srv.Stats()
		wantDown := uint64(1)
		if i == len(c.nodes)-1 {
			wantDown = 0
		}
		if st.Accepted != 1 || st.Reused != k-1 || st.DownDials != wantDown || st.Failed != 0 {
			t.Fatalf("datanode %d: %+v, want 1 connection accepted, %d streams reused, %d dials down", n.id, st, k-1, wantDown)
		}
	}
	p.Close()
	if ps := p.Stats(); ps.Idle != 0 {
		t.Fatalf("closed pool keeps %d connections", ps.Idle)
	}
	// The datanodes see the connection end and close theirs down.
	waitFor(t, 10*time.Second, "the chain's connections to close", func() bool {
		for _, n := range c.nodes {
			n.srv.mu.Lock()
			open := len(n.srv.conns)
			n.srv.mu.Unlock()
			if open != 0 {
				return false
			}
		}
		return true
	})
}

// TestReusePlain: a plaintext chain reuses its connections the same way.
func TestReusePlain(t *testing.T) {
	ns, route := chain(t, 3, 5*time.Second)
	p := NewConnPool(0, 0)
	defer p.Close()
	for i := range 3 {
		b := BlockID{1, uint64(20 + i)}
		data := payload(300<<10+i, uint64(i))
		length, chunks, _, _, err := poolWrite(t, route, b, data, nil, p, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range ns {
			commitAndCheck(t, n.st, b, length, chunks, data)
		}
	}
	if ps, st := p.Stats(), sumStats(ns); ps.Dials != 1 || ps.Reuses != 2 || st.Accepted != 3 || st.DownDials != 2 {
		t.Fatalf("pool %+v, datanodes %+v: want 1 dial, 2 reuses, 3 connections accepted, 2 dials down", ps, st)
	}
}

// TestReuseNotAfterFailure: a stream that fails in any way (here the last
// datanode's disk, then a Writer aborted by its client) leaves no
// connection behind on any hop: the next stream dials anew everywhere.
func TestReuseNotAfterFailure(t *testing.T) {
	c := newSecureCluster(t, 3)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	ok := func(local uint64) {
		t.Helper()
		if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, local}, payload(100<<10, local), cfg, p, nil); err != nil {
			t.Fatal(err)
		}
	}
	ok(30)
	// Abort: the client drops the stream.
	w, err := Dial(context.Background(), c.route(), 1, BlockID{1, 31}, Options{TLS: cfg, Timeout: 5 * time.Second, Pool: p})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(payload(64<<10, 3)); err != nil {
		t.Fatal(err)
	}
	w.Abort()
	if ps := p.Stats(); ps.Idle != 0 || ps.Reuses != 1 {
		t.Fatalf("after an abort: pool %+v", ps)
	}
	ok(32)
	if ps, st := p.Stats(), sumStats(c.nodes); ps.Dials != 2 || ps.Reuses != 1 || st.Accepted != 6 || st.DownDials != 4 {
		t.Fatalf("after an aborted stream: pool %+v, datanodes %+v: want 2 client dials, 6 accepted, 4 dials down", ps, st)
	}
	// A failure the first datanode finds: a packet out of order.
	w, err = Dial(context.Background(), c.route(), 1, BlockID{1, 33}, Options{TLS: cfg, Timeout: 5 * time.Second, Pool: p})
	if err != nil {
		t.Fatal(err)
	}
	w.seq = 7 // a sequence number the datanodes do not expect
	_, err = w.Write(payload(1<<20, 4))
	if err == nil {
		_, _, err = w.Close()
	} else {
		w.Abort()
	}
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeProtocol {
		t.Fatalf("out-of-order packet: %v", err)
	}
	if ps := p.Stats(); ps.Idle != 0 {
		t.Fatalf("a failed stream's connection was pooled: %+v", ps)
	}
	ok(34)
	if ps, st := p.Stats(), sumStats(c.nodes); ps.Dials != 3 || st.Accepted != 9 || st.DownDials != 6 {
		t.Fatalf("after a failed stream: pool %+v, datanodes %+v: want 3 client dials, 9 accepted, 6 dials down", ps, st)
	}
}

// tokenBackend admits a stream only with the token of its block (what
// the datanode's blocktoken check does); none while deny is set.
type tokenBackend struct {
	Backend
	deny *atomic.Bool
}

func tokenFor(b BlockID) []byte { return []byte(fmt.Sprintf("token for %v", b)) }

func (tb tokenBackend) Open(h *Header) (Sink, error) {
	if tb.deny.Load() {
		return nil, &Error{Code: CodeBadHeader, Reason: "refused by the test"}
	}
	if !bytes.Equal(h.Token, tokenFor(h.Block)) {
		return nil, &Error{Code: CodeBadHeader, Reason: fmt.Sprintf("token %q is not for block %v", h.Token, h.Block)}
	}
	return tb.Backend.Open(h)
}

// TestReuseChecksTokenEveryHop: on a reused connection every datanode
// still checks each stream's block token; a token for another block is
// refused (by the first datanode here, by the last one below) and the
// connection is not reused after it.
func TestReuseChecksTokenEveryHop(t *testing.T) {
	c := newSecureCluster(t, 0)
	deny := map[uint64]*atomic.Bool{}
	c.tweak = func(cfg *ServerConfig) {
		deny[cfg.ID] = new(atomic.Bool)
		cfg.Backend = tokenBackend{cfg.Backend, deny[cfg.ID]}
	}
	for i := range 3 {
		c.start(t, uint64(i+1))
	}
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	write := func(local uint64, token []byte) error {
		_, _, _, _, err := poolWrite(t, c.route(), BlockID{1, local}, payload(10<<10, local), cfg, p, token)
		return err
	}
	if err := write(40, tokenFor(BlockID{1, 40})); err != nil {
		t.Fatal(err)
	}
	err := write(41, tokenFor(BlockID{1, 40}))
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeBadHeader || se.Datanode != 1 {
		t.Fatalf("token for another block on a reused connection: %v", err)
	}
	if hasData(t, c.nodes[0], BlockID{1, 41}) {
		t.Fatal("data stored for a refused token")
	}
	if ps := p.Stats(); ps.Reuses != 1 || ps.Idle != 0 {
		t.Fatalf("pool after the refusal: %+v", ps)
	}
	// A datanode down the route refuses too: its backend sees the token
	// the first datanode forwarded on the kept connection.
	if err := write(42, tokenFor(BlockID{1, 42})); err != nil {
		t.Fatal(err)
	}
	deny[3].Store(true)
	err = write(43, tokenFor(BlockID{1, 43}))
	if !errors.As(err, &se) || se.Code != CodeBadHeader || se.Datanode != 3 {
		t.Fatalf("refusal on the last hop of a reused chain: %v", err)
	}
	if ps := p.Stats(); ps.Dials != 2 || ps.Reuses != 2 || ps.Idle != 0 {
		t.Fatalf("pool after the refusal: %+v", ps)
	}
	// And the middle one (review nit 7).
	deny[3].Store(false)
	if err := write(44, tokenFor(BlockID{1, 44})); err != nil {
		t.Fatal(err)
	}
	deny[2].Store(true)
	err = write(45, tokenFor(BlockID{1, 45}))
	if !errors.As(err, &se) || se.Code != CodeBadHeader || se.Datanode != 2 {
		t.Fatalf("refusal on the middle hop of a reused chain: %v", err)
	}
	for _, n := range c.nodes {
		if hasData(t, n, BlockID{1, 45}) {
			t.Fatalf("datanode %d stored data of a stream the middle hop refused", n.id)
		}
	}
	if ps := p.Stats(); ps.Dials != 3 || ps.Reuses != 3 || ps.Idle != 0 {
		t.Fatalf("pool after the refusal: %+v", ps)
	}
}

// TestReuseIdleTimeout: a datanode closes a connection no next header came
// on within ReuseIdle; the pool finds it closed, dials anew and the stream
// succeeds. The pool closes what it kept past its own bound.
func TestReuseIdleTimeout(t *testing.T) {
	c := newSecureCluster(t, 0)
	c.tweak = func(cfg *ServerConfig) { cfg.ReuseIdle = 200 * time.Millisecond; cfg.Timeout = time.Second }
	for i := range 2 {
		c.start(t, uint64(i+1))
	}
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, time.Minute)
	defer p.Close()
	write := func(local uint64) {
		t.Helper()
		if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, local}, payload(10<<10, local), cfg, p, nil); err != nil {
			t.Fatal(err)
		}
	}
	write(50)
	waitFor(t, 10*time.Second, "the datanodes to close the idle connections", func() bool {
		for _, n := range c.nodes {
			n.srv.mu.Lock()
			open := len(n.srv.conns)
			n.srv.mu.Unlock()
			if open != 0 {
				return false
			}
		}
		return true
	})
	write(51)
	if ps := p.Stats(); ps.Dials != 2 || ps.Stale != 1 || ps.Reuses != 0 {
		t.Fatalf("pool %+v: want the stale connection dropped and a new one dialed", ps)
	}
	short := NewConnPool(0, 100*time.Millisecond)
	defer short.Close()
	if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, 52}, payload(10<<10, 52), cfg, short, nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the pool to close its idle connection", func() bool { return short.Stats().Idle == 0 })
}

// TestReuseRouteChange: a connection whose next stream has another route
// below its first datanode makes that datanode close its connection down
// and dial the new next hop; the data lands on the new route's replicas.
// (The pool keys connections by their whole route; the test hands a
// connection to a stream of another route to reach the datanode's case.)
func TestReuseRouteChange(t *testing.T) {
	c := newSecureCluster(t, 3)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	r := c.route()
	a, b := r, []Target{r[0], r[2], r[1]}
	if _, _, _, _, err := poolWrite(t, a, BlockID{1, 60}, payload(10<<10, 60), cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	// A different route is a different connection for the pool.
	data := payload(200<<10, 61)
	if _, _, _, _, err := poolWrite(t, b, BlockID{1, 61}, data, cfg, p, nil); err != nil {
		t.Fatal(err)
	}
	if ps := p.Stats(); ps.Dials != 2 || ps.Reuses != 0 || ps.Idle != 2 {
		t.Fatalf("pool %+v: want a connection per route", ps)
	}
	// Route a's connection, for a stream of route b.
	ka, kb := keyFor(a, cfg), keyFor(b, cfg)
	p.mu.Lock()
	pc := p.conns[ka][0]
	pc.key = kb
	p.conns[kb] = append(p.conns[kb], pc)
	delete(p.conns, ka)
	p.mu.Unlock()
	before := c.nodes[0].srv.Stats().DownDials
	length, chunks, _, _, err := poolWrite(t, b, BlockID{1, 62}, data, cfg, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.nodes[0].srv.Stats().DownDials; got != before+1 {
		t.Fatalf("datanode 1 dialed down %d times for a new route below it, want 1", got-before)
	}
	for _, n := range c.nodes {
		commitAndCheck(t, n.st, BlockID{1, 62}, length, chunks, data)
	}
}

// TestPayloadKeysPerStream: the payload key of each stream number of a
// session differs from every other's and from the control keys; a record
// connection refuses to key the next stream with the last one's key.
func TestPayloadKeysPerStream(t *testing.T) {
	ctc, stc := tlsPair(t, nil)
	ccs, scs := ctc.ConnectionState(), stc.ConnectionState()
	seen := map[string]bool{}
	for _, label := range []string{labelOpenerToAcceptor, labelAcceptorToOpener} {
		k, err := ccs.ExportKeyingMaterial(label, nil, 32)
		if err != nil {
			t.Fatal(err)
		}
		seen[string(k)] = true
	}
	for n := range uint64(100) {
		ck, err := payloadKey(&ccs, n)
		if err != nil {
			t.Fatal(err)
		}
		sk, err := payloadKey(&scs, n)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(ck, sk) {
			t.Fatalf("stream %d: the ends export different payload keys", n)
		}
		if seen[string(ck)] {
			t.Fatalf("stream %d: payload key %x used before", n, ck)
		}
		seen[string(ck)] = true
	}
	k0, _ := payloadKey(&ccs, 0)
	rc, err := newRecordConn(nil, make([]byte, 16), make([]byte, 16), k0)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.setPayloadKey(k0); !errors.Is(err, errRecord) {
		t.Fatalf("the last stream's payload key accepted again: %v", err)
	}
	k1, _ := payloadKey(&ccs, 1)
	rc.pay.seq = 9
	if err := rc.setPayloadKey(k1); err != nil || rc.pay.seq != 0 {
		t.Fatalf("next key: %v, counter %d", err, rc.pay.seq)
	}
}

// TestReuseMaxIdle: a datanode keeps at most MaxIdle connections waiting
// for a next header; one beyond is closed after its stream, and the
// client's next stream on it finds it closed and dials anew.
func TestReuseMaxIdle(t *testing.T) {
	c := newSecureCluster(t, 0)
	c.tweak = func(cfg *ServerConfig) { cfg.MaxIdle = 1 }
	c.start(t, 1)
	cfg := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p1, p2 := NewConnPool(0, 0), NewConnPool(0, 0)
	defer p1.Close()
	defer p2.Close()
	for i, p := range []*ConnPool{p1, p2, p2} {
		if _, _, _, _, err := poolWrite(t, c.route(), BlockID{1, uint64(70 + i)}, payload(10<<10, 70), cfg, p, nil); err != nil {
			t.Fatal(err)
		}
		if i == 1 {
			waitFor(t, 10*time.Second, "the datanode to close the connection beyond MaxIdle", func() bool {
				c.nodes[0].srv.mu.Lock()
				defer c.nodes[0].srv.mu.Unlock()
				return len(c.nodes[0].srv.conns) == 1
			})
			// The datanode forgets the connection before its close
			// reaches the client's socket: wait until the pooled one
			// reads as closed, else the next header crosses the close
			// (then CodeStale, which the client library retries; this
			// test checks the peek before the header).
			waitFor(t, 10*time.Second, "the client's pooled connection to read as closed", func() bool {
				p2.mu.Lock()
				defer p2.mu.Unlock()
				for _, cs := range p2.conns {
					for _, pc := range cs {
						if checkIdle(pc.conn) == nil {
							return false
						}
					}
				}
				return true
			})
		}
	}
	if ps := p2.Stats(); ps.Dials != 2 || ps.Stale != 1 {
		t.Fatalf("pool %+v: want the connection beyond MaxIdle found closed and a new one dialed", ps)
	}
	if st := c.nodes[0].srv.Stats(); st.Accepted != 3 || st.Failed != 0 {
		t.Fatalf("datanode %+v", st)
	}
}
