package stream

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
)

// Rolling upgrades: datanodes of the previous release (protocol 4) and of
// this one (5) on one route. A server with OnlyVersion 4 is what the old
// binary was on the wire (one stream per connection, v4 exporter labels,
// "version 5, this datanode speaks 4" to a version 5 header); an opener
// with Options.Version 4 is the old client.

// mixedNodes starts datanodes 1..len(only), node i+1 with OnlyVersion
// only[i] (0: this release, 4: the previous one), secured or plaintext.
// It returns the nodes, the route in that order and the client's TLS
// configuration (nil on plaintext).
func mixedNodes(t *testing.T, secure bool, only ...uint8) ([]*node, []Target, *tls.Config) {
	t.Helper()
	if secure {
		c := newSecureCluster(t, 0)
		c.tweak = func(cfg *ServerConfig) { cfg.OnlyVersion = only[cfg.ID-1] }
		for i := range only {
			c.start(t, uint64(i+1))
		}
		return c.nodes, c.route(), c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	}
	var ns []*node
	var route []Target
	for i, v := range only {
		st, err := storage.Open(storage.Options{Volumes: []string{t.TempDir()}, ContainerSize: 4 << 30, KeepUncommitted: true})
		if err != nil {
			t.Fatal(err)
		}
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		id := uint64(i + 1)
		n := &node{id: id, st: st, lis: lis, srv: NewServer(ServerConfig{ID: id, Backend: storeBackend{st: st}, Timeout: 5 * time.Second, OnlyVersion: v})}
		go n.srv.Serve(lis)
		t.Cleanup(func() {
			n.srv.Close()
			st.Close()
		})
		ns = append(ns, n)
		route = append(route, n.target())
	}
	return ns, route, nil
}

// versionWrite streams data as block b at opts.Version (Pool p) and
// commits and reads it back on every node; it returns the Writer's version
// and whether it was downgraded.
func versionWrite(t *testing.T, ns []*node, route []Target, b BlockID, data []byte, cfg *tls.Config, p *ConnPool, v uint8) (uint8, bool) {
	t.Helper()
	w, err := Dial(context.Background(), route, 1, b, Options{TLS: cfg, Timeout: 5 * time.Second, Pool: p, Version: v})
	if err != nil {
		t.Fatalf("block %v at version %d: %v", b, v, err)
	}
	if _, err := w.Write(data); err != nil {
		w.Abort()
		t.Fatalf("block %v: write: %v", b, err)
	}
	length, chunks, err := w.Close()
	if err != nil {
		t.Fatalf("block %v: close: %v", b, err)
	}
	for _, n := range ns {
		commitAndCheck(t, n.st, b, length, chunks, data)
	}
	return w.Version(), w.Downgraded()
}

func forBoth(t *testing.T, f func(t *testing.T, secure bool)) {
	t.Run("tls", func(t *testing.T) { f(t, true) })
	t.Run("plain", func(t *testing.T) { f(t, false) })
}

// TestV5ClientOldFirstHop: a client of this release opens a route whose
// first and last datanodes are of the previous release (v4 → v5 → v4):
// the first datanode refuses the version 5 header as the old binary did,
// the client opens the stream once more at version 4 (same block), every
// datanode stores it, the connection is not pooled, and each datanode
// counts a version 4 stream. A client that insists on 5 gets the refusal,
// recognised by Refused and naming the old datanode.
func TestV5ClientOldFirstHop(t *testing.T) {
	forBoth(t, func(t *testing.T, secure bool) {
		ns, route, cfg := mixedNodes(t, secure, 4, 0, 4)
		p := NewConnPool(0, 0)
		for i := range 2 {
			data := payload(3<<20+777, uint64(i))
			v, down := versionWrite(t, ns, route, BlockID{1, uint64(10 + i)}, data, cfg, p, 0)
			if v != 4 || !down {
				t.Fatalf("stream %d ran at version %d (downgraded %v), want 4 after the refusal", i, v, down)
			}
			if st := p.Stats(); st.Idle != 0 {
				t.Fatalf("a version 4 connection was pooled: %+v", st)
			}
		}
		for _, n := range ns {
			if st := n.srv.Stats(); st.V4Streams != 2 || st.Reused != 0 || st.Idle != 0 {
				t.Fatalf("datanode %d: %+v, want 2 version 4 streams, no reuse", n.id, st)
			}
		}
		_, err := Dial(context.Background(), route, 1, BlockID{1, 20}, Options{TLS: cfg, Timeout: 5 * time.Second, Version: Version})
		var se *Error
		if !Refused(err) || !errors.As(err, &se) || se.Datanode != 1 || !strings.Contains(se.Reason, "version 5, this datanode speaks 4") {
			t.Fatalf("version 5 exactly to an old datanode: %v, want its refusal", err)
		}
	})
}

// TestV5ClientOldMiddleHop: v5 → v4 → v5 → v4 (first hop of this
// release): the old second datanode refuses the version 5 header its
// upstream forwards; the refusal travels up unchanged (every hop above
// discards the block first), the client reopens the same block at version
// 4, and the whole route runs at 4 (the new hops forward at 4).
func TestV5ClientOldMiddleHop(t *testing.T) {
	forBoth(t, func(t *testing.T, secure bool) {
		ns, route, cfg := mixedNodes(t, secure, 0, 4, 0, 4)
		data := payload(2<<20+5, 7)
		if v, down := versionWrite(t, ns, route, BlockID{1, 30}, data, cfg, NewConnPool(0, 0), 0); v != 4 || !down {
			t.Fatalf("ran at version %d (downgraded %v)", v, down)
		}
		if st := ns[0].srv.Stats(); st.Failed != 1 || st.V4Streams != 1 {
			t.Fatalf("first datanode: %+v, want the refused version 5 stream failed and one version 4 stream", st)
		}
	})
}

// TestV4ClientNewHops: a client of the previous release (version 4)
// writes through datanodes of this release: each serves the stream at 4,
// forwards it at 4, and closes its connections after it (a second stream
// dials every hop anew; nothing waits for a next header).
func TestV4ClientNewHops(t *testing.T) {
	forBoth(t, func(t *testing.T, secure bool) {
		ns, route, cfg := mixedNodes(t, secure, 0, 0, 0)
		p := NewConnPool(0, 0)
		for i := range 2 {
			data := payload(1<<20+3, uint64(40+i))
			if v, down := versionWrite(t, ns, route, BlockID{1, uint64(40 + i)}, data, cfg, p, 4); v != 4 || down {
				t.Fatalf("ran at version %d (downgraded %v)", v, down)
			}
		}
		if st := p.Stats(); st.Idle != 0 || st.Dials != 0 {
			t.Fatalf("version 4 streams used the pool: %+v", st)
		}
		for _, n := range ns {
			waitFor(t, 5*time.Second, "version 4 connections closed", func() bool { return n.srv.Stats().Idle == 0 })
			st := n.srv.Stats()
			if st.V4Streams != 2 || st.Accepted != 2 || st.Reused != 0 {
				t.Fatalf("datanode %d: %+v, want 2 version 4 streams on 2 connections", n.id, st)
			}
			if n.id < 3 && st.DownDials != 2 {
				t.Fatalf("datanode %d dialed down %d times for 2 version 4 streams", n.id, st.DownDials)
			}
		}
		// And a version 5 stream after them still reuses as before.
		for i := range 2 {
			if v, _ := versionWrite(t, ns, route, BlockID{1, uint64(50 + i)}, payload(4096, 9), cfg, p, 0); v != 5 {
				t.Fatalf("version %d on an all-new route", v)
			}
		}
		if st := p.Stats(); st.Reuses != 1 {
			t.Fatalf("version 5 streams after version 4 ones: %+v, want one reuse", st)
		}
	})
}

// TestV4ConnectionCarriesOneStream: a version 4 connection to a datanode
// of this release ends after its stream: a second header on it is never
// read (the old client never sends one; one that did would get EOF).
func TestV4ConnectionCarriesOneStream(t *testing.T) {
	ns, route, _ := mixedNodes(t, false, 0)
	raw, err := net.Dial("tcp", route[0].Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	h := &Header{Pipeline: 1, Block: BlockID{1, 60}, PacketSize: 1 << 20, version: 4}
	hb, err := encodeHeader(nil, h)
	if err != nil {
		t.Fatal(err)
	}
	var a ack
	var ab [ackLen]byte
	if _, err := raw.Write(hb); err != nil {
		t.Fatal(err)
	}
	if err := readAck(raw, &ab, &a); err != nil || a.kind != kindHeaderAck {
		t.Fatalf("header ack: %v %+v", err, a)
	}
	var pb [packetHeaderLen]byte
	(&packetHeader{kind: kindClose}).encode(&pb)
	if _, err := raw.Write(pb[:]); err != nil {
		t.Fatal(err)
	}
	if err := readAck(raw, &ab, &a); err != nil || a.kind != kindCloseAck {
		t.Fatalf("close ack: %v %+v", err, a)
	}
	// The datanode closes at once: EOF, well within the deadline (a
	// timeout here is the connection kept open for a next header).
	raw.SetReadDeadline(time.Now().Add(3 * time.Second))
	var one [1]byte
	if n, err := raw.Read(one[:]); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after a version 4 stream the connection stays open (read %d, %v), want EOF", n, err)
	}
	if st := ns[0].srv.Stats(); st.V4Streams != 1 || st.Idle != 0 {
		t.Fatalf("%+v", st)
	}
}

// TestV4BusyNotCounted: a version 4 stream refused as busy (MaxStreams)
// never ran at version 4 and is not counted as one; the one that runs is.
func TestV4BusyNotCounted(t *testing.T) {
	st, err := storage.Open(storage.Options{Volumes: []string{t.TempDir()}, ContainerSize: 4 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(ServerConfig{ID: 1, Backend: storeBackend{st: st}, Timeout: 5 * time.Second, MaxStreams: 1})
	go srv.Serve(lis)
	t.Cleanup(func() {
		srv.Close()
		st.Close()
	})
	open := func(local uint64) *ack {
		raw, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { raw.Close() })
		raw.SetDeadline(time.Now().Add(10 * time.Second))
		hb, err := encodeHeader(nil, &Header{Pipeline: 1, Block: BlockID{1, local}, PacketSize: 1 << 20, version: 4})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := raw.Write(hb); err != nil {
			t.Fatal(err)
		}
		var a ack
		var ab [ackLen]byte
		if err := readAck(raw, &ab, &a); err != nil {
			t.Fatal(err)
		}
		return &a
	}
	if a := open(70); a.kind != kindHeaderAck {
		t.Fatalf("first stream: %+v", a)
	}
	if a := open(71); a.kind != kindError || a.code != CodeBusy {
		t.Fatalf("second stream with MaxStreams 1: %+v, want busy", a)
	}
	if st := srv.Stats(); st.V4Streams != 1 || st.FirstHop != 2 || st.Failed != 1 {
		t.Fatalf("%+v, want 1 version 4 stream of 2 headers, 1 failed", st)
	}
}

// TestRefusedByOnRouteOnly: the refusal's datanode ID comes from the
// wire; Writer.RefusedBy (which the client remembers for a minute) takes
// it only if it is a datanode of the route. Here the old datanode (ID 1)
// is on the route under another ID, as a datanode that names an
// arbitrary ID would be.
func TestRefusedByOnRouteOnly(t *testing.T) {
	ns, route, _ := mixedNodes(t, false, 4)
	for _, c := range []struct {
		id, want uint64
	}{{1, 1}, {9, 0}} {
		r := []Target{{ID: c.id, Addr: route[0].Addr}}
		w, err := Dial(context.Background(), r, 1, BlockID{1, 80 + c.id}, Options{Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		data := payload(64<<10+3, c.id)
		if _, err := w.Write(data); err != nil {
			t.Fatal(err)
		}
		length, chunks, err := w.Close()
		if err != nil {
			t.Fatal(err)
		}
		commitAndCheck(t, ns[0].st, BlockID{1, 80 + c.id}, length, chunks, data)
		if !w.Downgraded() || w.RefusedBy() != c.want {
			t.Fatalf("route datanode ID %d: downgraded %v, refused by %d, want %d", c.id, w.Downgraded(), w.RefusedBy(), c.want)
		}
	}
}
