package stream

import (
	"errors"
	"net"
	"testing"
	"time"
	"unsafe"

	"github.com/basalt-store/basalt/internal/storage"
)

func aligned(p []byte) bool { return uintptr(unsafe.Pointer(&p[0]))%4096 == 0 }

// storeBackend admits every stream into a real storage.Store, creating
// the container on first use (what the datanode backend does, minus the
// pipeline checks).
type storeBackend struct {
	st   *storage.Store
	wrap func(Sink) Sink // optional: fault injection
}

func (b storeBackend) Open(h *Header) (Sink, error) {
	cid := storage.ContainerID(h.Block.Container)
	if _, err := b.st.Container(cid); errors.Is(err, storage.ErrContainerNotFound) {
		if _, err := b.st.CreateContainer(cid, storage.CreateOptions{}); err != nil && !errors.Is(err, storage.ErrContainerExists) {
			return nil, err
		}
	}
	var s Sink = b.st.OpenStream(cid, storage.LocalID(h.Block.Local), int64(h.Offset))
	if b.wrap != nil {
		s = b.wrap(s)
	}
	return s, nil
}

// node is one in-process datanode of the stream layer: a server over a
// real store on its own loopback port.
type node struct {
	id  uint64
	st  *storage.Store
	srv *Server
	lis net.Listener
}

func (n *node) target() Target { return Target{ID: n.id, Addr: n.lis.Addr().String()} }

func startNode(t testing.TB, id uint64, timeout time.Duration, wrap func(Sink) Sink) *node {
	t.Helper()
	st, err := storage.Open(storage.Options{Volumes: []string{t.TempDir()}, ContainerSize: 4 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &node{id: id, st: st, lis: lis,
		srv: NewServer(ServerConfig{ID: id, Backend: storeBackend{st: st, wrap: wrap}, Timeout: timeout})}
	go n.srv.Serve(lis)
	t.Cleanup(func() {
		n.srv.Close()
		st.Close()
	})
	return n
}

func chain(t testing.TB, k int, timeout time.Duration) ([]*node, []Target) {
	var ns []*node
	var route []Target
	for i := range k {
		n := startNode(t, uint64(i+1), timeout, nil)
		ns = append(ns, n)
		route = append(route, n.target())
	}
	return ns, route
}

// waitFor polls cond (a condition other goroutines make true) for up to d.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
