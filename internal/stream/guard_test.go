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

// panicSink panics on Write while armed: a bug in the storage layer.
type panicSink struct {
	Sink
	armed *atomic.Bool
}

func (p panicSink) Write(b []byte) (int, error) {
	if p.armed.Load() {
		var m map[int]int
		m[0] = 1
	}
	return p.Sink.Write(b)
}

// TestPanicFailsOnlyThatStream: a panic on a datanode's stream goroutine
// fails that stream with CodeInternal naming the datanode, discards its
// data on every hop, is counted, and the datanode serves the next stream.
// Before the guard, the panic killed the datanode process.
func TestPanicFailsOnlyThatStream(t *testing.T) {
	var armed atomic.Bool
	n1 := startNode(t, 1, 2*time.Second, nil)
	n2 := startNode(t, 2, 2*time.Second, func(s Sink) Sink { return panicSink{s, &armed} })
	route := []Target{n1.target(), n2.target()}
	ctx := context.Background()

	armed.Store(true)
	b := BlockID{1, 66}
	w, err := Dial(ctx, route, 1, b, Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = w.Write(payload(64<<10, 1))
	if err == nil {
		_, _, err = w.Close()
	}
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeInternal || se.Datanode != 2 {
		t.Fatalf("stream through a panicking sink: %v, want an internal error naming datanode 2", err)
	}
	if got := n2.srv.cfg.Guard.Recovered(guardWhere); got != 1 {
		t.Fatalf("datanode 2 recovered %d panics, want 1", got)
	}
	for _, n := range []*node{n1, n2} {
		waitFor(t, 5*time.Second, "failed stream discarded", func() bool { return n.srv.Stats().Active == 0 && !hasData(t, n, b) })
	}

	armed.Store(false)
	b = BlockID{1, 67}
	data := payload(3<<20+5, 2)
	w, err = Dial(ctx, route, 1, b, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	length, chunks, err := w.Close()
	if err != nil {
		t.Fatalf("the stream after the panic: %v", err)
	}
	for _, n := range []*node{n1, n2} {
		commitAndCheck(t, n.st, b, length, chunks, data)
	}
}

// panicBackend panics opening block local ID 13.
type panicBackend struct{}

func (panicBackend) Open(h *Header) (Sink, error) {
	if h.Block.Local == 13 {
		panic("backend bug")
	}
	return discardSink{}, nil
}

func TestPanicInBackendOpen(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(ServerConfig{ID: 5, Backend: panicBackend{}, Timeout: time.Second})
	go srv.Serve(lis)
	defer srv.Close()
	route := []Target{{ID: 5, Addr: lis.Addr().String()}}
	_, err = Dial(context.Background(), route, 1, BlockID{1, 13}, Options{})
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeInternal || se.Datanode != 5 {
		t.Fatalf("dial into a panicking backend: %v", err)
	}
	w, err := Dial(context.Background(), route, 1, BlockID{1, 14}, Options{})
	if err != nil {
		t.Fatalf("dial after the panic: %v", err)
	}
	w.Write([]byte("x"))
	if _, _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// The server counts the stream done just after it sends the close
	// ack, so the client can see the ack first: wait for it (bounded).
	waitFor(t, 5*time.Second, "closed stream counted done", func() bool { return srv.Stats().Active == 0 })
	if s := srv.Stats(); s.Active != 0 || s.Failed != 1 || srv.cfg.Guard.Recovered(guardWhere) != 1 {
		t.Fatalf("stats %+v, recovered %d", s, srv.cfg.Guard.Recovered(guardWhere))
	}
}

// TestPanicInBackendOpenSecured: on a secured stream port the internal
// error of a recovered panic reaches the client through TLS, the way it
// awaits the header ack. Before the fix it was written in plaintext on
// the raw socket under TLS: the client's TLS failed on it instead.
func TestPanicInBackendOpenSecured(t *testing.T) {
	c := newSecureCluster(t, 0)
	client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(ServerConfig{ID: 5, Backend: panicBackend{}, Timeout: 5 * time.Second,
		Security: c.security(c.issue(t, pki.RoleDatanode, "dn-5"))})
	go srv.Serve(lis)
	defer srv.Close()
	route := []Target{{ID: 5, Addr: lis.Addr().String()}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = Dial(ctx, route, 1, BlockID{1, 13}, Options{TLS: client, Timeout: 5 * time.Second})
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeInternal || se.Datanode != 5 {
		t.Fatalf("dial into a panicking backend over TLS: %v, want an internal error of datanode 5", err)
	}
	if _, _, err := writeBlock(ctx, route, BlockID{1, 14}, []byte("x"), client); err != nil {
		t.Fatalf("stream after the panic: %v", err)
	}
}
