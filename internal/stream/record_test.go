package stream

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
)

// tlsPair is a mutual TLS connection over loopback TCP, both ends through
// the handshake. cfg, if set, edits both configurations.
func tlsPair(t *testing.T, cfg func(client, server *tls.Config)) (client, server *tls.Conn) {
	t.Helper()
	c := newSecureCluster(t, 0)
	cc := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	sc := c.issue(t, pki.RoleDatanode, "dn-1").ServerTLS(pki.RoleClient, pki.RoleDatanode)
	sc.SessionTicketsDisabled = true
	if cfg != nil {
		cfg(cc, sc)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	type res struct {
		c   *tls.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		raw, err := lis.Accept()
		if err != nil {
			ch <- res{nil, err}
			return
		}
		raw.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Server(framedTLS(raw), sc)
		ch <- res{tc, tc.Handshake()}
	}()
	raw, err := net.DialTimeout("tcp", lis.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	client = tls.Client(framedTLS(raw), cc)
	cerr := client.Handshake()
	r := <-ch
	if r.c != nil {
		t.Cleanup(func() { r.c.NetConn().Close() })
	}
	t.Cleanup(func() { raw.Close() })
	if cerr != nil || r.err != nil {
		t.Fatalf("handshake: client %v, server %v", cerr, r.err)
	}
	return client, r.c
}

// switchPair switches both ends of a TLS pair to records, as Dial and the
// server do (no header exchange: nothing is in flight).
func switchPair(t *testing.T, client, server *tls.Conn) (*recordConn, *recordConn) {
	t.Helper()
	ccs, scs := client.ConnectionState(), server.ConnectionState()
	ck, err := payloadKey(&ccs, 0)
	if err != nil {
		t.Fatal(err)
	}
	sk, err := payloadKey(&scs, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ck, sk) {
		t.Fatal("the two ends exported different payload keys")
	}
	rc, err := switchToRecords(client, true, ck)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := switchToRecords(server, false, sk)
	if err != nil {
		t.Fatal(err)
	}
	return rc, rs
}

func testPacketHeader(seq uint64, n int) []byte {
	var b [packetHeaderLen]byte
	(&packetHeader{kind: kindData, length: uint32(n), seq: seq, offset: seq * uint64(n), crc: 7}).encode(&b)
	return b[:]
}

// TestRecordRoundTrip: packets and acks cross a switched TLS connection
// intact, in both directions, the payload opened in place in a pooled
// buffer.
func TestRecordRoundTrip(t *testing.T) {
	ctc, stc := tlsPair(t, nil)
	cs := ctc.ConnectionState()
	if cs.Version != tls.VersionTLS13 {
		t.Fatalf("version %#x", cs.Version)
	}
	n, _ := recordKeyLen(&cs)
	t.Logf("session %s: records with %d-bit AES-GCM keys", tls.CipherSuiteName(cs.CipherSuite), 8*n)
	rc, rs := switchPair(t, ctc, stc)
	seal := getBuf(1 << 20)
	defer putBuf(seal)
	var wg sync.WaitGroup
	wg.Add(1)
	var werr error
	sent := [][]byte{payload(1<<20, 1), payload(100, 2), payload(65536+3, 3)}
	go func() {
		defer wg.Done()
		for i, p := range sent {
			if werr = rc.writePacket(testPacketHeader(uint64(i), len(p)), p, *seal); werr != nil {
				return
			}
		}
		// A close: header only.
		if werr = rc.writePacket(testPacketHeader(9, 0), nil, *seal); werr != nil {
			return
		}
	}()
	for i, want := range sent {
		var hb [packetHeaderLen]byte
		if _, err := io.ReadFull(rs, hb[:]); err != nil {
			t.Fatalf("packet %d header: %v", i, err)
		}
		if !bytes.Equal(hb[:], testPacketHeader(uint64(i), len(want))) {
			t.Fatalf("packet %d header differs", i)
		}
		bp := getBuf(len(want))
		buf := (*bp)[:len(want)]
		if err := readPayload(rs, hb[:], buf); err != nil {
			t.Fatalf("packet %d payload: %v", i, err)
		}
		if !bytes.Equal(buf, want) || !aligned(buf) {
			t.Fatalf("packet %d payload differs (or moved out of the aligned buffer)", i)
		}
		putBuf(bp)
	}
	var hb [packetHeaderLen]byte
	if _, err := io.ReadFull(rs, hb[:]); err != nil || !bytes.Equal(hb[:], testPacketHeader(9, 0)) {
		t.Fatalf("close header: %v", err)
	}
	wg.Wait()
	if werr != nil {
		t.Fatal(werr)
	}
	// Acks upstream, one of them longer than a control record.
	long := bytes.Repeat([]byte("r"), 3*maxControl+5)
	go func() {
		rs.Write([]byte("ack-1"))
		rs.Write(long)
	}()
	got := make([]byte, 5+len(long))
	if _, err := io.ReadFull(rc, got); err != nil {
		t.Fatal(err)
	}
	if string(got[:5]) != "ack-1" || !bytes.Equal(got[5:], long) {
		t.Fatal("acks differ")
	}
}

// memRecords is a sender writing into a buffer and a way to make
// receivers reading a given byte string, with the keys of one direction.
func memRecords(t *testing.T) (*recordConn, *bytes.Buffer, func([]byte) *recordConn) {
	t.Helper()
	k1, k2, kp := bytes.Repeat([]byte{1}, 16), bytes.Repeat([]byte{2}, 16), bytes.Repeat([]byte{3}, 16)
	snd, err := newRecordConn(nil, k1, k2, kp)
	if err != nil {
		t.Fatal(err)
	}
	var wire bytes.Buffer
	snd.w = &wire
	return snd, &wire, func(b []byte) *recordConn {
		rcv, err := newRecordConn(nil, k2, k1, kp)
		if err != nil {
			t.Fatal(err)
		}
		rcv.r = bytes.NewReader(b)
		return rcv
	}
}

// readPacket reads one packet of n payload bytes as a datanode does.
func readPacket(rc *recordConn, n int) ([]byte, error) {
	var hb [packetHeaderLen]byte
	if _, err := io.ReadFull(rc, hb[:]); err != nil {
		return nil, err
	}
	buf := make([]byte, n, n+tagLen)
	if err := rc.readPayload(hb[:], buf); err != nil {
		return nil, err
	}
	return buf, nil
}

// TestRecordTamperRefused: any change to a record on the wire (its kind,
// reserved bytes, length, ciphertext or tag, in the packet header's
// record or the payload's) is refused, and nothing of the damaged record
// is returned. The payload's bytes never appear on the wire.
func TestRecordTamperRefused(t *testing.T) {
	snd, wire, rcv := memRecords(t)
	p := bytes.Repeat([]byte("secret payload "), 100)
	dst := make([]byte, 0, len(p)+tagLen)
	if err := snd.writePacket(testPacketHeader(0, len(p)), p, dst); err != nil {
		t.Fatal(err)
	}
	good := bytes.Clone(wire.Bytes())
	if bytes.Contains(good, []byte("secret")) {
		t.Fatal("the payload is on the wire in the clear")
	}
	if got, err := readPacket(rcv(good), len(p)); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("untampered packet: %v", err)
	}
	ctl := recHeaderLen + packetHeaderLen + tagLen // the header's record
	for _, at := range []int{0, 1, 3, 4, 7, 8, 20, ctl - 1, ctl, ctl + 2, ctl + 5, ctl + 7, ctl + 8, ctl + 500, len(good) - tagLen, len(good) - 1} {
		bad := bytes.Clone(good)
		bad[at] ^= 0x10
		got, err := readPacket(rcv(bad), len(p))
		if err == nil {
			t.Fatalf("byte %d flipped: packet accepted (%d bytes)", at, len(got))
		}
		// A length made larger runs out of input here (a real peer would
		// time out); every other change is refused as such.
		lengthField := (at >= 4 && at < 8) || (at >= ctl+4 && at < ctl+8)
		if !lengthField && !errors.Is(err, errRecord) {
			t.Fatalf("byte %d flipped: %v, want a refused record", at, err)
		}
	}
	// A length past the limit is refused before anything is read for it.
	bad := bytes.Clone(good)
	bad[4] = 0x7f
	if _, err := readPacket(rcv(bad), len(p)); !errors.Is(err, errRecord) {
		t.Fatalf("huge control record: %v", err)
	}
	// A payload record where a control record is due, and the reverse.
	bad = bytes.Clone(good[ctl:])
	if _, err := readPacket(rcv(bad), len(p)); !errors.Is(err, errRecord) {
		t.Fatalf("payload record read as control: %v", err)
	}
	r := rcv(append(bytes.Clone(good[:ctl]), good[:ctl]...))
	var hb [packetHeaderLen]byte
	io.ReadFull(r, hb[:])
	if err := r.readPayload(hb[:], make([]byte, len(p), len(p)+tagLen)); !errors.Is(err, errRecord) {
		t.Fatalf("control record read as payload: %v", err)
	}
	// A payload of another length than the header said.
	if err := rcv(good).readPayload(hb[:], make([]byte, len(p)-1, len(p)+tagLen)); err == nil {
		t.Fatal("payload of the wrong length accepted")
	}
}

// TestRecordReplayReorderRefused: records carry a counter in their nonce:
// a replayed, dropped or reordered record fails authentication.
func TestRecordReplayReorderRefused(t *testing.T) {
	snd, wire, rcv := memRecords(t)
	var pk [][]byte
	for i := range 3 {
		p := payload(4096, uint64(i))
		if err := snd.writePacket(testPacketHeader(uint64(i), len(p)), p, make([]byte, 0, len(p)+tagLen)); err != nil {
			t.Fatal(err)
		}
		pk = append(pk, bytes.Clone(wire.Bytes()))
		wire.Reset()
	}
	cat := func(i ...int) []byte {
		var b []byte
		for _, k := range i {
			b = append(b, pk[k]...)
		}
		return b
	}
	ok := rcv(cat(0, 1, 2))
	for i := range 3 {
		if _, err := readPacket(ok, 4096); err != nil {
			t.Fatalf("in order, packet %d: %v", i, err)
		}
	}
	for name, b := range map[string][]byte{"replayed": cat(0, 0), "reordered": cat(1, 0), "dropped": cat(0, 2)} {
		r := rcv(b)
		var err error
		for i := 0; i < 2 && err == nil; i++ {
			_, err = readPacket(r, 4096)
		}
		if !errors.Is(err, errRecord) {
			t.Fatalf("%s: %v, want refused", name, err)
		}
	}
	// A payload record moved behind another packet's header (whose
	// control record is in sequence) fails too: the header is its
	// additional data.
	ctl := recHeaderLen + packetHeaderLen + tagLen
	snd2, wire2, rcv2 := memRecords(t)
	a, b := payload(4096, 7), payload(4096, 8)
	snd2.writePacket(testPacketHeader(0, 4096), a, make([]byte, 0, 4096+tagLen))
	first := bytes.Clone(wire2.Bytes())
	wire2.Reset()
	snd2.pay.seq = 0 // same payload nonce, another header
	snd2.writePacket(testPacketHeader(5, 4096), b, make([]byte, 0, 4096+tagLen))
	swapped := append(bytes.Clone(first[:ctl]), wire2.Bytes()[ctl:]...)
	if _, err := readPacket(rcv2(swapped), 4096); !errors.Is(err, errRecord) {
		t.Fatalf("payload under another header: %v", err)
	}
}

// TestRecordKeyExhausted: a direction whose counter is spent refuses to
// seal (never a nonce twice); so does one past its byte budget.
func TestRecordKeyExhausted(t *testing.T) {
	snd, _, _ := memRecords(t)
	snd.out.seq = math.MaxUint64
	if _, err := snd.Write([]byte("x")); !errors.Is(err, errRecord) {
		t.Fatalf("write at the last counter: %v", err)
	}
	snd2, _, _ := memRecords(t)
	snd2.pay.bytes = maxKeyBytes
	if err := snd2.writePacket(testPacketHeader(0, 1), []byte{1}, make([]byte, 0, 1+tagLen)); !errors.Is(err, errRecord) {
		t.Fatalf("payload past the key's budget: %v", err)
	}
}

// TestRecordSwitchRefusesBufferedTLS: if crypto/tls has read input past
// the stream header exchange, the switch is refused (that input would be
// lost to the records); with nothing buffered it succeeds.
func TestRecordSwitchRefusesBufferedTLS(t *testing.T) {
	ctc, stc := tlsPair(t, nil)
	if _, err := ctc.Write([]byte("header" + "and more")); err != nil {
		t.Fatal(err)
	}
	var b [6]byte
	if _, err := io.ReadFull(stc, b[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := switchToRecords(stc, false, make([]byte, 16)); !errors.Is(err, errRecord) {
		t.Fatalf("switch with buffered TLS input: %v, want refused", err)
	}

	ctc, stc = tlsPair(t, nil)
	if _, err := ctc.Write([]byte("header")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(stc, b[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := switchToRecords(stc, false, make([]byte, 16)); err != nil {
		t.Fatalf("switch after an exact read: %v", err)
	}

	// More TLS past the exchange, in a record of its own: crypto/tls
	// has not read it (tlsFramer), so the switch succeeds, and the
	// record layer refuses it as a record.
	ctc, stc = tlsPair(t, nil)
	if _, err := ctc.Write([]byte("header")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(stc, b[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := ctc.Write([]byte("and more")); err != nil {
		t.Fatal(err)
	}
	rs, err := switchToRecords(stc, false, make([]byte, 16))
	if err != nil {
		t.Fatalf("switch with a TLS record unread in the socket: %v", err)
	}
	rs.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := rs.Read(b[:]); !errors.Is(err, errRecord) {
		t.Fatalf("a TLS record read as a stream record: %v, want refused", err)
	}
}

// TestRecordSwitchNeedsTLS13: a TLS 1.2 session (whose exporter is not
// bound to the whole transcript the same way) is not switched.
func TestRecordSwitchNeedsTLS13(t *testing.T) {
	ctc, stc := tlsPair(t, func(c, s *tls.Config) {
		c.MinVersion, c.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
		s.MinVersion = tls.VersionTLS12
	})
	if _, err := switchToRecords(ctc, true, make([]byte, 16)); err == nil {
		t.Fatal("switched a TLS 1.2 session")
	}
	cs := stc.ConnectionState()
	if _, err := payloadKey(&cs, 0); err == nil {
		t.Fatal("exported a payload key from a TLS 1.2 session")
	}
}

// proxy relays one connection to addr; the bytes going downstream pass
// through edit (offset of the chunk in the stream, the chunk).
func proxy(t *testing.T, addr string, edit func(off int, b []byte)) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			in, err := lis.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", addr)
			if err != nil {
				in.Close()
				return
			}
			go func() {
				io.Copy(in, out)
				in.Close()
			}()
			go func() {
				buf := make([]byte, 32<<10)
				off := 0
				for {
					n, err := in.Read(buf)
					if n > 0 {
						edit(off, buf[:n])
						off += n
						if _, werr := out.Write(buf[:n]); werr != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				out.Close()
			}()
		}
	}()
	return lis.Addr().String()
}

// TestSecureChainTamperedOnWire: a bit flipped in a payload on the wire,
// between the client and the first datanode or between two datanodes,
// fails the stream (nothing is stored as if it were the client's); and
// the payload is never on the wire in the clear.
func TestSecureChainTamperedOnWire(t *testing.T) {
	data := bytes.Repeat([]byte("plaintext marker "), (1<<20)/17)
	for _, hop := range []int{0, 1} {
		t.Run([]string{"client to datanode 1", "datanode 1 to datanode 2"}[hop], func(t *testing.T) {
			c := newSecureCluster(t, 3)
			client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
			var mu sync.Mutex
			clear := false
			flip := -1
			edit := func(off int, b []byte) {
				mu.Lock()
				defer mu.Unlock()
				if bytes.Contains(b, []byte("plaintext marker")) {
					clear = true
				}
				if flip >= off && flip < off+len(b) {
					b[flip-off] ^= 1
				}
			}
			route := c.route()
			p := proxy(t, route[hop].Addr, edit)
			route[hop].Addr = p
			if hop > 0 {
				c.mu.Lock()
				c.known[route[hop].ID] = route[hop]
				c.mu.Unlock()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			// Untampered first: the relay itself is sound.
			if _, _, err := writeBlock(ctx, route, BlockID{1, 1}, data, client); err != nil {
				t.Fatalf("untampered: %v", err)
			}
			mu.Lock()
			flip = 300 << 10 // well inside the first payload of the next stream
			mu.Unlock()
			_, _, err := writeBlock(ctx, route, BlockID{1, 2}, data, client)
			if err == nil {
				t.Fatal("a stream with a flipped bit on the wire succeeded")
			}
			t.Logf("tampered stream failed: %v", err)
			mu.Lock()
			defer mu.Unlock()
			if clear {
				t.Fatal("payload seen on the wire in the clear")
			}
		})
	}
}

// TestOldVersionRefusedClearly: a version 3 opener (which would keep
// talking TLS after the header ack) gets an error ack naming the versions,
// through TLS, instead of records it cannot read; so does a header of a
// later version (6), in the format a later release's opener will parse.
// (Version 4, the previous release, is served: version_test.go.)
func TestOldVersionRefusedClearly(t *testing.T) {
	c := newSecureCluster(t, 1)
	client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	for _, v := range []byte{3, 6} {
		raw, err := net.DialTimeout("tcp", c.nodes[0].target().Addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		raw.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Client(raw, client)
		hb := mustHeader(t, &Header{Pipeline: 1, Block: BlockID{1, 5}, PacketSize: 1 << 20})
		hb[4] = v
		if v == 3 {
			hb = hb[:len(hb)-1-headerCRCLen] // a version 3 header has no payload key length
			binary.BigEndian.PutUint16(hb[6:], uint16(len(hb)-headerPrefixLen))
		} else {
			hb = hb[:len(hb)-headerCRCLen]
		}
		hb = binary.BigEndian.AppendUint32(hb, crc32c(hb))
		if _, err := tc.Write(hb); err != nil {
			t.Fatal(err)
		}
		var a ack
		var ab [ackLen]byte
		if err := readAck(tc, &ab, &a); err != nil {
			t.Fatal(err)
		}
		// The suffix is a parsed format (doc.go, "Versions"): exact.
		if want := fmt.Sprintf("bad stream header: version %d, this datanode speaks 4 to 5", v); a.kind != kindError || a.code != CodeBadHeader || !strings.HasSuffix(a.reason, want) {
			t.Fatalf("version %d header answered with kind %#x code %v %q", v, a.kind, a.code, a.reason)
		}
	}
}

// TestServerRefusesBytesPastHeader: an opener that sends bytes after the
// header before the ack (here in the same TLS record, so crypto/tls has
// them buffered when the datanode switches) is refused through TLS; the
// datanode never reads them as records, and the stream stores nothing.
func TestServerRefusesBytesPastHeader(t *testing.T) {
	c := newSecureCluster(t, 1)
	client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	raw, err := net.DialTimeout("tcp", c.nodes[0].target().Addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	tc := tls.Client(raw, client)
	hb := mustHeader(t, &Header{Pipeline: 1, Block: BlockID{1, 6}, PacketSize: 1 << 20})
	if _, err := tc.Write(append(hb, "early bytes"...)); err != nil {
		t.Fatal(err)
	}
	var a ack
	var ab [ackLen]byte
	if err := readAck(tc, &ab, &a); err != nil {
		t.Fatal(err)
	}
	if a.kind != kindError || a.code != CodeProtocol || !strings.Contains(a.reason, "past the stream header") {
		t.Fatalf("early bytes answered with kind %#x code %v %q", a.kind, a.code, a.reason)
	}
	if s := c.nodes[0].srv.Stats(); s.Failed == 0 {
		t.Fatalf("stats %+v: the refused stream is not counted as failed", s)
	}
}

// TestRecordForwardCloseLeavesNothing: a datanode forwards a data packet
// (its payload record as it arrived) and the CLOSE (header only); after
// the close record the next datanode's socket holds nothing more: the
// connection below reads EOF. Before the fix forwardPacket sent a payload
// record header after the CLOSE too (8 bytes never read: closing with
// them unread makes Linux send a reset instead of a FIN).
func TestRecordForwardCloseLeavesNothing(t *testing.T) {
	ctc, stc := tlsPair(t, nil)
	rc, rs := switchPair(t, ctc, stc)
	// The payload record as the upstream hop received it, sealed by a
	// sender with the stream's payload key (the client's, on the route).
	up, err := newRecordConn(nil, make([]byte, 16), make([]byte, 16), payloadKeyOf(t, ctc))
	if err != nil {
		t.Fatal(err)
	}
	var wire bytes.Buffer
	up.w = &wire
	p := payload(5000, 4)
	hdr := testPacketHeader(0, len(p))
	if err := up.writePacket(hdr, p, make([]byte, 0, len(p)+tagLen)); err != nil {
		t.Fatal(err)
	}
	sealed := wire.Bytes()[recHeaderLen+packetHeaderLen+tagLen+recHeaderLen:]
	if len(sealed) != len(p)+tagLen {
		t.Fatalf("sealed payload record of %d bytes", len(sealed))
	}
	var close [packetHeaderLen]byte
	(&packetHeader{kind: kindClose, seq: 1, offset: uint64(len(p))}).encode(&close)
	go func() {
		rc.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if err := rc.forwardPacket(hdr, sealed); err != nil {
			t.Error(err)
		}
		if err := rc.forwardPacket(close[:], nil); err != nil {
			t.Error(err)
		}
		rc.Conn.(*net.TCPConn).CloseWrite()
	}()
	rs.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := readPacket(rs, len(p))
	if err != nil || !bytes.Equal(got, p) {
		t.Fatalf("forwarded packet: %v (payload equal %v)", err, bytes.Equal(got, p))
	}
	var hb [packetHeaderLen]byte
	if _, err := io.ReadFull(rs, hb[:]); err != nil || hb != close {
		t.Fatalf("forwarded close: %v, header %x", err, hb)
	}
	rest, err := io.ReadAll(rs.Conn)
	if err != nil || len(rest) != 0 {
		t.Fatalf("after the close record the connection holds %d more bytes (%x), err %v; want EOF", len(rest), rest, err)
	}
}

func payloadKeyOf(t *testing.T, tc *tls.Conn) []byte {
	t.Helper()
	cs := tc.ConnectionState()
	k, err := payloadKey(&cs, 0)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// holdConn collects what is written while hold is set and sends it with
// one write on flush: a TLS record and the records behind it arrive in
// one segment, as they can from a datanode that fails right after its
// header ack.
type holdConn struct {
	net.Conn
	hold bool
	buf  []byte
}

func (h *holdConn) Write(p []byte) (int, error) {
	if h.hold {
		h.buf = append(h.buf, p...)
		return len(p), nil
	}
	return h.Conn.Write(p)
}

func (h *holdConn) flush() error {
	h.hold = false
	_, err := h.Conn.Write(h.buf)
	return err
}

// TestRecordSwitchAfterAckWithRecordBehind: the acceptor sends the header
// ack through TLS and, right behind it in the same segment, an error ack
// as a record. The opener's crypto/tls reads only the ack's TLS record
// (tlsFramer), the switch succeeds, and the error ack is read as the
// record it is. Before tlsFramer, crypto/tls read both and the switch was
// refused: Dial blamed datanode 1 with a protocol error instead.
func TestRecordSwitchAfterAckWithRecordBehind(t *testing.T) {
	ctc, stc := tlsPair(t, nil)
	ctc.SetDeadline(time.Now().Add(10 * time.Second))
	stc.SetDeadline(time.Now().Add(10 * time.Second))
	// The acceptor's writes, held and then sent in one segment.
	f := stc.NetConn().(*tlsFramer)
	hc := &holdConn{Conn: f.Conn, hold: true}
	f.Conn = hc
	var b [ackLen]byte
	if _, err := stc.Write((&ack{kind: kindHeaderAck, value: 7}).encode(b[:0])); err != nil {
		t.Fatal(err)
	}
	pk := payloadKeyOf(t, stc)
	rs, err := switchToRecords(stc, false, pk)
	if err != nil {
		t.Fatal(err)
	}
	want := &Error{Code: CodeIO, Datanode: 2, Reason: "datanode 2: disk gone"}
	if _, err := rs.Write(errorAck(want).encode(nil)); err != nil {
		t.Fatal(err)
	}
	if err := hc.flush(); err != nil {
		t.Fatal(err)
	}
	var a ack
	if err := readAck(ctc, &b, &a); err != nil || a.kind != kindHeaderAck || a.value != 7 {
		t.Fatalf("header ack: %v, kind %#x value %d", err, a.kind, a.value)
	}
	rc, err := switchToRecords(ctc, true, pk)
	if err != nil {
		t.Fatalf("switch with a record behind the ack: %v", err)
	}
	if err := readAck(rc, &b, &a); err != nil || a.kind != kindError || a.code != want.Code || a.dn != 2 || a.reason != want.Reason {
		t.Fatalf("error ack behind the header ack: %v, kind %#x code %v datanode %d %q", err, a.kind, a.code, a.dn, a.reason)
	}
}

// TestDialReportsErrorBehindAck: a first datanode that sends its header
// ack and at once (same segment) an error ack naming datanode 2: the
// client reports datanode 2's error, not a protocol error of datanode 1.
func TestDialReportsErrorBehindAck(t *testing.T) {
	c := newSecureCluster(t, 0)
	client := c.issue(t, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	sc := c.issue(t, pki.RoleDatanode, "dn-1").ServerTLS(pki.RoleClient, pki.RoleDatanode)
	sc.SessionTicketsDisabled = true
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	want := &Error{Code: CodeIO, Datanode: 2, Reason: "datanode 2: disk gone"}
	served := make(chan error, 1)
	go func() {
		served <- func() error {
			raw, err := lis.Accept()
			if err != nil {
				return err
			}
			defer raw.Close()
			raw.SetDeadline(time.Now().Add(10 * time.Second))
			hc := &holdConn{Conn: raw}
			tc := tls.Server(framedTLS(hc), sc)
			if err := tc.Handshake(); err != nil {
				return err
			}
			h, err := readHeader(tc)
			if err != nil {
				return err
			}
			cs := tc.ConnectionState()
			pk, err := payloadKey(&cs, 0)
			if err != nil {
				return err
			}
			rs, err := switchToRecords(tc, false, pk)
			if err != nil {
				return err
			}
			hc.hold = true
			var b [ackLen]byte
			if _, err := tc.Write((&ack{kind: kindHeaderAck, value: h.Offset}).encode(b[:0])); err != nil {
				return err
			}
			if _, err := rs.Write(errorAck(want).encode(nil)); err != nil {
				return err
			}
			if err := hc.flush(); err != nil {
				return err
			}
			raw.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, raw)
			return nil
		}()
	}()
	route := []Target{{ID: 1, Addr: lis.Addr().String()}, {ID: 2, Addr: "127.0.0.1:1"}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, _, err = writeBlock(ctx, route, BlockID{1, 9}, payload(1000, 1), client)
	var se *Error
	if !errors.As(err, &se) || se.Code != want.Code || se.Datanode != 2 || !strings.Contains(se.Reason, "disk gone") {
		t.Fatalf("stream whose first datanode reported datanode 2's error behind the header ack: %v, want %v", err, want)
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}
