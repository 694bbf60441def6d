package stream

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
)

// secureCluster is stream servers with datanode certificates and a
// registry of the datanodes the cluster knows (what SCM is to a real
// datanode): ID → address and certificate UUID.
type secureCluster struct {
	ca    *pki.CA
	mu    sync.Mutex
	known map[uint64]Target
	uuid  map[uint64]string
	nodes []*node
	// tweak (optional) edits each server's configuration before it starts.
	tweak func(*ServerConfig)
}

func newSecureCluster(t testing.TB, k int) *secureCluster {
	ca, err := pki.NewCA("stream test CA")
	if err != nil {
		t.Fatal(err)
	}
	c := &secureCluster{ca: ca, known: map[uint64]Target{}, uuid: map[uint64]string{}}
	for i := range k {
		c.start(t, uint64(i+1))
	}
	return c
}

func (c *secureCluster) issue(t testing.TB, role pki.Role, id string) *pki.Credentials {
	t.Helper()
	cr, err := c.ca.Issue(pki.Identity{Role: role, ID: id}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return cr
}

func (c *secureCluster) security(cr *pki.Credentials) *Security {
	return &Security{
		Server: cr.ServerTLS(pki.RoleClient, pki.RoleDatanode),
		Client: cr.ClientTLS(pki.RoleDatanode),
		Upstream: func(cs *tls.ConnectionState, h *Header) error {
			id, err := pki.PeerIdentity(cs)
			if err == nil && h.Hop > 0 && id.Role != pki.RoleDatanode {
				err = fmt.Errorf("%s may not open hop %d", id, h.Hop)
			}
			return err
		},
		Target: func(t Target) error {
			c.mu.Lock()
			defer c.mu.Unlock()
			if k, ok := c.known[t.ID]; !ok || k.Addr != t.Addr {
				return fmt.Errorf("route names %d at %s: not a datanode the cluster registered there", t.ID, t.Addr)
			}
			return nil
		},
		Verify: func(t Target, cs *tls.ConnectionState) error {
			id, err := pki.PeerIdentity(cs)
			c.mu.Lock()
			defer c.mu.Unlock()
			if err == nil && (id.Role != pki.RoleDatanode || id.ID != c.uuid[t.ID]) {
				err = fmt.Errorf("%s is not datanode %d", id, t.ID)
			}
			return err
		},
	}
}

func (c *secureCluster) start(t testing.TB, id uint64) { c.startWatched(t, id, false) }

// startWatched starts datanode id; with watch, its Security.Watch is its
// credentials' (returned), as a real datanode's.
func (c *secureCluster) startWatched(t testing.TB, id uint64, watch bool) *pki.Credentials {
	st, err := storage.Open(storage.Options{Volumes: []string{t.TempDir()}, ContainerSize: 4 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	uuid := fmt.Sprintf("dn-%d", id)
	cr := c.issue(t, pki.RoleDatanode, uuid)
	sec := c.security(cr)
	if watch {
		sec.Watch = cr.Watch
	}
	cfg := ServerConfig{ID: id, Backend: storeBackend{st: st}, Timeout: 5 * time.Second, Security: sec}
	if c.tweak != nil {
		c.tweak(&cfg)
	}
	n := &node{id: id, st: st, lis: lis, srv: NewServer(cfg)}
	go n.srv.Serve(lis)
	t.Cleanup(func() {
		n.srv.Close()
		st.Close()
	})
	c.mu.Lock()
	c.known[id], c.uuid[id] = n.target(), uuid
	c.nodes = append(c.nodes, n)
	c.mu.Unlock()
	return cr
}

func (c *secureCluster) route() []Target {
	var r []Target
	for _, n := range c.nodes {
		r = append(r, n.target())
	}
	return r
}

func writeBlock(ctx context.Context, route []Target, b BlockID, data []byte, cfg *tls.Config) (uint64, []Chunk, error) {
	w, err := Dial(ctx, route, 1, b, Options{TLS: cfg, Timeout: 5 * time.Second})
	if err != nil {
		return 0, nil, err
	}
	if _, err := w.Write(data); err != nil {
		w.Abort()
		return 0, nil, err
	}
	return w.Close()
}

func TestSecureChainWrite(t *testing.T) {
	c := newSecureCluster(t, 3)
	client := c.issue(t, pki.RoleClient, "app")
	data := payload(3<<20+17, 1)
	b := BlockID{1, 1}
	length, chunks, err := writeBlock(context.Background(), c.route(), b, data, client.ClientTLS(pki.RoleDatanode))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		commitAndCheck(t, n.st, b, length, chunks, data)
	}
}

func TestStreamRefusesUnauthenticated(t *testing.T) {
	c := newSecureCluster(t, 2)
	other, err := pki.NewCA("attacker")
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := other.Issue(pki.Identity{Role: pki.RoleClient, ID: "x"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	noCert := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	noCert.GetClientCertificate = nil // ClientTLS reads the current certificate at each handshake
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
	}{{"plaintext", nil}, {"no certificate", noCert}, {"wrong CA", stranger.ClientTLS()}} {
		t.Run(tc.name, func(t *testing.T) {
			before := c.nodes[0].srv.Stats().Refused
			_, _, err := writeBlock(context.Background(), c.route(), BlockID{1, 2}, payload(1000, 2), tc.cfg)
			if err == nil {
				t.Fatal("stream accepted")
			}
			waitFor(t, 10*time.Second, "the refusal counted", func() bool { return c.nodes[0].srv.Stats().Refused > before })
			if _, err := c.nodes[0].st.Container(1); err == nil {
				if _, err := c.nodes[0].st.ReadChunk(1, 2, 0, 1); err == nil {
					t.Fatal("data of a refused stream was stored")
				}
			}
		})
	}
}

// TestStreamRouteToNonMemberRefused: a route entry may name only a
// datanode the cluster registered, at its address, proven by its
// certificate; a datanode never connects to an arbitrary host and port.
func TestStreamRouteToNonMemberRefused(t *testing.T) {
	c := newSecureCluster(t, 2)
	client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	// The attacker's listener; any connection to it is the failure.
	evil, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer evil.Close()
	var dialed atomic.Int64
	go func() {
		for {
			cn, err := evil.Accept()
			if err != nil {
				return
			}
			dialed.Add(1)
			cn.Close()
		}
	}()
	first := c.nodes[0].target()
	for _, tc := range []struct {
		name string
		next Target
	}{
		{"unknown ID, arbitrary address", Target{ID: 99, Addr: evil.Addr().String()}},
		{"member ID, arbitrary address", Target{ID: 2, Addr: evil.Addr().String()}},
		{"member ID, another member's address", Target{ID: 2, Addr: first.Addr}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := writeBlock(context.Background(), []Target{first, tc.next}, BlockID{1, 3}, payload(1000, 3), client)
			var se *Error
			if !errors.As(err, &se) || se.Code != CodeBadHeader {
				t.Fatalf("got %v, want a CodeBadHeader refusal", err)
			}
		})
	}
	if n := dialed.Load(); n != 0 {
		t.Fatalf("a datanode connected to the attacker's address %d times", n)
	}
	// A registered address now served by a datanode whose certificate is
	// not that datanode's: the TLS check refuses it.
	c.mu.Lock()
	c.uuid[2] = "someone-else"
	c.mu.Unlock()
	_, _, err = writeBlock(context.Background(), c.route(), BlockID{1, 4}, payload(1000, 4), client)
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeUnreachable || se.Datanode != 2 {
		t.Fatalf("got %v, want datanode 2 unreachable (not authenticated)", err)
	}
}

// TestStreamLaterHopNeedsDatanode: a client cannot open a stream as a
// downstream hop (which skips the route checks of the hops before).
func TestStreamLaterHopNeedsDatanode(t *testing.T) {
	c := newSecureCluster(t, 1)
	client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	raw, err := net.DialTimeout("tcp", c.nodes[0].target().Addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	tc := tls.Client(raw, client)
	hb, err := encodeHeader(nil, &Header{Hop: 1, Pipeline: 1, Block: BlockID{1, 5}, PacketSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Write(hb); err != nil {
		t.Fatal(err)
	}
	var a ack
	var ab [ackLen]byte
	if err := readAck(tc, &ab, &a); err != nil {
		t.Fatal(err)
	}
	if a.kind != kindError {
		t.Fatalf("a client opened hop 1: ack kind %#x", a.kind)
	}
}

// TestRevokedOpenerStreamClosed: a stream opened before its opener's
// certificate was revoked is closed once the datanode learns of the
// revocation (Security.Watch → pki.Credentials.Watch), not when it ends
// or idles out. Fails on the old code: the revocation was checked only
// at the handshake, so the stream stayed open (here for its 30 s
// timeout).
func TestRevokedOpenerStreamClosed(t *testing.T) {
	c := newSecureCluster(t, 0)
	st, err := storage.Open(storage.Options{Volumes: []string{t.TempDir()}, ContainerSize: 4 << 30, KeepUncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := c.issue(t, pki.RoleDatanode, "dn-1")
	sec := c.security(server)
	sec.Watch = server.Watch
	srv := NewServer(ServerConfig{ID: 1, Backend: storeBackend{st: st}, Timeout: 30 * time.Second, IdleTimeout: time.Minute, Security: sec})
	go srv.Serve(lis)
	defer srv.Close()

	client := c.issue(t, pki.RoleClient, "alice")
	conn, err := tls.Dial("tcp", lis.Addr().String(), client.ClientTLS(pki.RoleDatanode))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hb, err := encodeHeader(nil, &Header{Pipeline: 1, Block: BlockID{Container: 1, Local: 1}, PacketSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(hb); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	var ack [ackLen]byte
	if _, err := io.ReadFull(conn, ack[:]); err != nil {
		t.Fatalf("no header ack: %v", err)
	}
	server.SetRevoked([]string{pki.SerialString(client.Leaf().SerialNumber)})
	revoked := time.Now()
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = conn.Read(ack[:])
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the revoked opener's stream is still open 10 s after the revocation")
	}
	if err == nil {
		t.Fatalf("read after the revocation: want the connection closed")
	}
	t.Logf("stream of the revoked opener closed %v after the revocation (%v)", time.Since(revoked), err)
	if n := server.Watched(); n != 0 {
		deadline := time.Now().Add(5 * time.Second)
		for server.Watched() != 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n = server.Watched(); n != 0 {
			t.Fatalf("%d connections still watched after the stream ended", n)
		}
	}
}

// TestRevokedDownstreamAndFirstHopClosed: the connections a stream dials
// are watched too: a datanode's connection to the next one closes when
// the next one's certificate is revoked (Security.Watch), and a Writer's
// connection to the first datanode when that one's is (Options.Watch); the
// stream fails instead of running on. Fails on the old code: only
// accepted connections were watched, so both writes completed.
func TestRevokedDownstreamAndFirstHopClosed(t *testing.T) {
	for _, which := range []string{"downstream", "first hop"} {
		t.Run(which, func(t *testing.T) {
			c := newSecureCluster(t, 0)
			dn1 := c.startWatched(t, 1, true)
			dn2 := c.startWatched(t, 2, true)
			client := c.issue(t, pki.RoleClient, "app")
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			w, err := Dial(ctx, c.route(), 1, BlockID{1, 1}, Options{TLS: client.ClientTLS(pki.RoleDatanode), Timeout: 5 * time.Second, Watch: client.Watch})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := w.Write(payload(256<<10, 1)); err != nil {
				t.Fatal(err)
			}
			if which == "downstream" {
				dn1.SetRevoked([]string{pki.SerialString(dn2.Leaf().SerialNumber)})
			} else {
				client.SetRevoked([]string{pki.SerialString(dn1.Leaf().SerialNumber)})
			}
			start := time.Now()
			_, werr := w.Write(payload(256<<10, 2))
			_, _, err = w.Close()
			if werr == nil && err == nil {
				t.Fatalf("the stream completed after the %s datanode's certificate was revoked", which)
			}
			t.Logf("stream failed %v after the revocation: %v / %v", time.Since(start), werr, err)
			deadline := time.Now().Add(10 * time.Second)
			for (dn1.Watched() != 0 || client.Watched() != 0) && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if n, m := dn1.Watched(), client.Watched(); n != 0 || m != 0 {
				t.Fatalf("still watched after the stream ended: datanode 1 %d, client %d", n, m)
			}
		})
	}
}
