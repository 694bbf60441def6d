package raft

import (
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/pki"
)

// secureEnv is a 3-host TCP cluster whose transports authenticate with
// certificates basalt://meta/<id> from one CA, running one group.
type secureEnv struct {
	c     *tcpCluster
	ca    *pki.CA
	creds map[uint64]*pki.Credentials
}

func newSecureEnv(t *testing.T) *secureEnv {
	ca, err := pki.NewCA("raft test CA")
	if err != nil {
		t.Fatal(err)
	}
	e := &secureEnv{ca: ca, creds: map[uint64]*pki.Credentials{}}
	for id := uint64(1); id <= 3; id++ {
		e.creds[id] = e.issue(t, ca, pki.RoleMeta, fmt.Sprint(id))
	}
	e.c = newTCPClusterWith(t, 3, 20*time.Millisecond, securityOf(e.creds))
	for _, h := range e.c.hosts {
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &kvSM{}}); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.c.proposeAll(1, []uint64{1, 2, 3}, "first", 30*time.Second); n != 1 {
		t.Fatal("the authenticated cluster did not commit")
	}
	return e
}

// securityOf authenticates hosts 1..len(creds) as meta nodes with creds.
func securityOf(creds map[uint64]*pki.Credentials) func(id uint64) *Security {
	members := func(id uint64) bool { return creds[id] != nil }
	return func(id uint64) *Security {
		cr := creds[id]
		return &Security{Server: cr.ServerTLS(pki.RoleMeta), Client: cr.ClientTLS(pki.RoleMeta),
			Authenticate: pki.AuthenticateNodeID(pki.RoleMeta, members)}
	}
}

// metaSecurity makes a CA and certificates for hosts 1..n.
func metaSecurity(t *testing.T, n uint64) func(id uint64) *Security {
	ca, err := pki.NewCA("raft test CA")
	if err != nil {
		t.Fatal(err)
	}
	creds := map[uint64]*pki.Credentials{}
	for id := uint64(1); id <= n; id++ {
		if creds[id], err = ca.Issue(pki.Identity{Role: pki.RoleMeta, ID: fmt.Sprint(id)}, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	return securityOf(creds)
}

func (e *secureEnv) issue(t *testing.T, ca *pki.CA, role pki.Role, id string) *pki.Credentials {
	t.Helper()
	c, err := ca.Issue(pki.Identity{Role: role, ID: id}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (e *secureEnv) transport(id uint64) *TCPTransport {
	return e.c.hosts[id].transport.(*TCPTransport)
}

// attack connects to host 1 (TLS with cfg, or plaintext if nil), sends a
// hello claiming node from and then frame; it returns once host 1 closed
// the connection or after a short wait.
func (e *secureEnv) attack(t *testing.T, cfg *tls.Config, from uint64, frame []byte) (closed bool) {
	t.Helper()
	raw, err := net.DialTimeout("tcp", e.c.hosts[1].Addr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	var c net.Conn = raw
	if cfg != nil {
		tc := tls.Client(raw, cfg)
		if err := tc.Handshake(); err != nil {
			return true
		}
		c = tc
	}
	writeHello(c, connMessages, from, 1)
	c.Write(frame)
	// The server acks an accepted hello; a refused connection is closed.
	var ack [12]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		return true
	}
	c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	_, err = c.Read(ack[:1])
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return false
	}
	return true
}

// forgedHeartbeat is a frame with one full (not compact) heartbeat for
// group 1 from node `from` at a term and commit index far beyond the
// group's: stepped, it makes etcd raft panic (tocommit out of range).
func forgedHeartbeat(from uint64) []byte {
	ty := pb.MsgHeartbeat
	m, _ := proto.Marshal(&pb.Message{Type: &ty, From: proto.Uint64(from), To: proto.Uint64(1), Term: proto.Uint64(1 << 20), Commit: proto.Uint64(1 << 40)})
	var body []byte
	body = binary.AppendUvarint(body, 1)
	body = binary.AppendUvarint(body, 1) // group
	body = append(body, itemRaft)
	body = binary.AppendUvarint(body, uint64(len(m)))
	body = append(body, m...)
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	frame = binary.BigEndian.AppendUint32(frame, crc32.Checksum(body, castagnoli))
	return append(frame, body...)
}

func (e *secureEnv) healthy(t *testing.T, term uint64) {
	t.Helper()
	for id, h := range e.c.hosts {
		g, err := h.Group(1)
		if err != nil {
			t.Fatalf("host %d lost its group: %v", id, err)
		}
		if st := g.Status(); st.Term != term {
			t.Fatalf("host %d is at term %d, was %d: a forged message was stepped", id, st.Term, term)
		}
	}
	if n := e.c.proposeAll(1, []uint64{1, 2, 3}, "after", 30*time.Second); n != 1 {
		t.Fatal("the group no longer commits")
	}
}

func TestTransportRefusesUnauthenticated(t *testing.T) {
	e := newSecureEnv(t)
	g, _ := e.c.hosts[1].Group(1)
	term := g.Status().Term
	other, err := pki.NewCA("attacker CA")
	if err != nil {
		t.Fatal(err)
	}
	noCert := e.creds[2].ClientTLS(pki.RoleMeta)
	noCert.GetClientCertificate = nil // ClientTLS reads the current certificate at each handshake
	cases := []struct {
		name   string
		cfg    *tls.Config
		from   uint64
		reason string
	}{
		{"plaintext", nil, 2, "tls"},
		{"no certificate", noCert, 2, "tls"},
		{"wrong CA", e.issue(t, other, pki.RoleMeta, "2").ClientTLS(), 2, "tls"},
		{"datanode role", e.issue(t, e.ca, pki.RoleDatanode, "2").ClientTLS(), 2, "tls"},
		{"certificate of another node", e.creds[3].ClientTLS(pki.RoleMeta), 2, "identity"},
		{"not a member", e.issue(t, e.ca, pki.RoleMeta, "9").ClientTLS(pki.RoleMeta), 9, "identity"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := testCounter(e.transport(1).m.connsRefused.WithLabelValues(tc.reason))
			if !e.attack(t, tc.cfg, tc.from, forgedHeartbeat(tc.from)) {
				t.Fatal("host 1 kept the connection open")
			}
			deadline := time.Now().Add(10 * time.Second)
			for testCounter(e.transport(1).m.connsRefused.WithLabelValues(tc.reason)) == before {
				if time.Now().After(deadline) {
					t.Fatalf("no refusal counted for reason %q", tc.reason)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
	e.healthy(t, term)
}

func TestTransportDropsForgedFrom(t *testing.T) {
	e := newSecureEnv(t)
	g, _ := e.c.hosts[1].Group(1)
	term := g.Status().Term
	// Node 2's own certificate, but messages in node 3's name.
	if e.attack(t, e.creds[2].ClientTLS(pki.RoleMeta), 2, forgedHeartbeat(3)) {
		t.Fatal("host 1 refused node 2's authenticated connection")
	}
	if n := testCounter(e.transport(1).m.forgedMessages); n != 1 {
		t.Fatalf("forged messages counted: %v, want 1", n)
	}
	if n := testCounter(e.transport(1).m.stepPanics); n != 0 {
		t.Fatalf("a forged message reached etcd raft (%v step panics)", n)
	}
	e.healthy(t, term)
}

func TestMadeUpNodeIDsCostNothing(t *testing.T) {
	e := newSecureEnv(t)
	tr := e.transport(1)
	tr.mu.Lock()
	peers := len(tr.peers)
	tr.mu.Unlock()
	base := runtime.NumGoroutine()
	// Each connection claims another node ID: with a member's certificate,
	// with a certificate of its own, in plaintext.
	dn := e.issue(t, e.ca, pki.RoleMeta, "77").ClientTLS(pki.RoleMeta)
	for i := uint64(0); i < 60; i++ {
		cfg := []*tls.Config{e.creds[2].ClientTLS(pki.RoleMeta), dn, nil}[i%3]
		if !e.attack(t, cfg, 1000+i, forgedHeartbeat(1000+i)) {
			t.Fatalf("connection claiming node %d kept open", 1000+i)
		}
	}
	tr.mu.Lock()
	after := len(tr.peers)
	tr.mu.Unlock()
	if after != peers {
		t.Fatalf("peers kept: %d, was %d", after, peers)
	}
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > base+5 {
		if time.Now().After(deadline) {
			t.Fatalf("goroutines: %d, were %d before 60 made-up node IDs", runtime.NumGoroutine(), base)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestTransportBoundsPendingConnections(t *testing.T) {
	e := newSecureEnv(t)
	tr := e.transport(1)
	limit := tr.cfg.MaxPendingConns
	// Connections that never start a handshake hold the pending slots.
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	for i := 0; i < limit+20; i++ {
		c, err := net.DialTimeout("tcp", e.c.hosts[1].Addr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	deadline := time.Now().Add(10 * time.Second)
	for testCounter(tr.m.connsRefused.WithLabelValues("busy")) < 20 {
		if time.Now().After(deadline) {
			t.Fatalf("refused as busy: %v, want 20", testCounter(tr.m.connsRefused.WithLabelValues("busy")))
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, c := range idle {
		c.Close()
	}
	idle = nil
	// The members' own connections are up already and unaffected.
	if n := e.c.proposeAll(1, []uint64{1, 2, 3}, "x", 30*time.Second); n != 1 {
		t.Fatal("the group no longer commits")
	}
}

// TestRevokedPeerConnectionsClosed: connections authenticated before a
// peer's certificate was revoked are closed once the revocation is known
// (Security.Watch → pki.Credentials.Watch), in both directions, within a
// bounded time; the remaining members keep committing. Fails on the old
// code: the revocation was checked only at the handshake, so the open
// connections of node 3 stayed up.
func TestRevokedPeerConnectionsClosed(t *testing.T) {
	ca, err := pki.NewCA("raft test CA")
	if err != nil {
		t.Fatal(err)
	}
	creds := map[uint64]*pki.Credentials{}
	for id := uint64(1); id <= 3; id++ {
		if creds[id], err = ca.Issue(pki.Identity{Role: pki.RoleMeta, ID: fmt.Sprint(id)}, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	c := newTCPClusterWith(t, 3, 20*time.Millisecond, func(id uint64) *Security {
		s := securityOf(creds)(id)
		s.Watch = creds[id].Watch
		return s
	})
	for _, h := range c.hosts {
		if _, err := h.AddGroup(GroupConfig{ID: 1, Peers: []uint64{1, 2, 3}, StateMachine: &kvSM{}}); err != nil {
			t.Fatal(err)
		}
	}
	if n := c.proposeAll(1, []uint64{1, 2, 3}, "first", 30*time.Second); n != 1 {
		t.Fatal("the cluster did not commit")
	}
	// The connections hosts 1 and 2 have with node 3 (the leader's at
	// least: followers need not talk).
	ofThree := map[uint64][]net.Conn{}
	deadline := time.Now().Add(20 * time.Second)
	for len(ofThree[1])+len(ofThree[2]) == 0 {
		for _, id := range []uint64{1, 2} {
			if p := c.hosts[id].transport.(*TCPTransport).peer(3); p != nil {
				if pc := p.current(); pc != nil {
					ofThree[id] = append(ofThree[id], rawConn(pc.c))
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("hosts 1 and 2 have no connection with node 3, want some")
		}
		time.Sleep(10 * time.Millisecond)
	}
	open := func(id uint64) (n int) {
		tr := c.hosts[id].transport.(*TCPTransport)
		tr.mu.Lock()
		defer tr.mu.Unlock()
		for _, conn := range ofThree[id] {
			if _, ok := tr.conns[conn]; ok {
				n++
			}
		}
		return n
	}
	serial := pki.SerialString(creds[3].Leaf().SerialNumber)
	creds[1].SetRevoked([]string{serial})
	creds[2].SetRevoked([]string{serial})
	revoked := time.Now()
	for open(1)+open(2) > 0 {
		if time.Since(revoked) > 10*time.Second {
			t.Fatalf("10 s after the revocation hosts 1 and 2 still have %d and %d connections with node 3", open(1), open(2))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("connections of the revoked node closed %v after the revocation", time.Since(revoked))
	// Node 3 gets no new connection (refused at the handshake), and the
	// others still commit.
	if n := c.proposeAll(1, []uint64{1, 2}, "after", 30*time.Second); n != 1 {
		t.Fatal("hosts 1 and 2 no longer commit")
	}
	for _, id := range []uint64{1, 2} {
		if p := c.hosts[id].transport.(*TCPTransport).peer(3); p != nil && p.current() != nil {
			t.Fatalf("host %d has a new connection with the revoked node", id)
		}
	}
}
