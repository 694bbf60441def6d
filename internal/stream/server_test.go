package stream

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/storage"
)

func payload(n int, seed uint64) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, 1))
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	return p
}

// commit does what the client's PutBlock does on every replica: commit
// the Writer's chunk list, then read back and compare.
func commitAndCheck(t *testing.T, st *storage.Store, b BlockID, length uint64, chunks []Chunk, want []byte) {
	t.Helper()
	bd := storage.BlockData{LocalID: storage.LocalID(b.Local), Length: int64(length), BCSID: 1}
	for _, c := range chunks {
		bd.Chunks = append(bd.Chunks, storage.ChunkInfo{Offset: int64(c.Offset), Length: int64(c.Length),
			Checksum: storage.ChecksumData{Type: storage.ChecksumCRC32C, BytesPerChecksum: c.BytesPerChecksum, Sums: c.Sums}})
	}
	if err := st.PutBlock(storage.ContainerID(b.Container), bd); err != nil {
		t.Fatalf("PutBlock %v: %v", b, err)
	}
	got, err := st.ReadChunk(storage.ContainerID(b.Container), storage.LocalID(b.Local), 0, int64(length))
	if err != nil {
		t.Fatalf("read %v: %v", b, err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("block %v: read back differs from what was streamed", b)
	}
}

// TestChainWrite streams blocks of awkward sizes through three real
// servers, in writes that do not match packets, commits the Writer's chunk
// list on every replica and reads each back (verifying the checksums).
func TestChainWrite(t *testing.T) {
	ns, route := chain(t, 3, 5*time.Second)
	ctx := context.Background()
	summed0 := SummedBytes()
	for i, size := range []int{1, 1<<20 - 1, 1<<20 + 1, 5<<20 + 123} {
		data := payload(size, uint64(i))
		b := BlockID{1, uint64(10 + i)}
		w, err := Dial(ctx, route, 1, b, Options{Window: 4})
		if err != nil {
			t.Fatal(err)
		}
		for off := 0; off < size; {
			k := min(size-off, 1+int(rand.Uint32N(3<<20)))
			if _, err := w.Write(data[off : off+k]); err != nil {
				t.Fatalf("size %d: write at %d: %v", size, off, err)
			}
			off += k
		}
		length, chunks, err := w.Close()
		if err != nil {
			t.Fatalf("size %d: close: %v", size, err)
		}
		if length != uint64(size) {
			t.Fatalf("length %d, want %d", length, size)
		}
		for _, n := range ns {
			commitAndCheck(t, n.st, b, length, chunks, data)
		}
	}
	if s := ns[0].srv.Stats(); s.FirstHop != 4 || s.Downstream != 0 {
		t.Fatalf("first hop stats %+v", s)
	}
	// The Writer sums each byte once: the packet CRC the datanodes verified
	// is combined from the chunk list's window sums, not computed again.
	if got, want := SummedBytes()-summed0, uint64(1+1<<20-1+1<<20+1+5<<20+123); got != want {
		t.Fatalf("the Writer summed %d bytes with CRC32C for %d sent", got, want)
	}
	for _, n := range ns[1:] {
		if s := n.srv.Stats(); s.FirstHop != 0 || s.Downstream != 4 || s.BytesReceived != uint64(1+1<<20-1+1<<20+1+5<<20+123) {
			t.Fatalf("datanode %d stats %+v", n.id, s)
		}
	}
}

// hasData reports whether a store still holds data for the block (the
// posix backend's file: <volume>/basalt/containers/<cid>/<lid>.block).
func hasData(t *testing.T, n *node, b BlockID) bool {
	_, err := os.Stat(filepath.Join(n.st.Volumes()[0].Path, "basalt", "containers",
		strconv.FormatUint(b.Container, 10), strconv.FormatUint(b.Local, 10)+".block"))
	return err == nil
}

// TestFailureAtEachPosition stops the datanode at each position of the
// chain mid-stream: the Writer's error names it, and the survivors discard
// the block's data.
func TestFailureAtEachPosition(t *testing.T) {
	for pos := range 3 {
		t.Run([]string{"first", "middle", "last"}[pos], func(t *testing.T) {
			ns, route := chain(t, 3, 5*time.Second)
			b := BlockID{1, 7}
			w, err := Dial(context.Background(), route, 1, b, Options{Window: 4})
			if err != nil {
				t.Fatal(err)
			}
			data := payload(1<<20, 1)
			for range 3 {
				if _, err := w.Write(data); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, 5*time.Second, "data on every datanode", func() bool {
				for _, n := range ns {
					if !hasData(t, n, b) {
						return false
					}
				}
				return true
			})
			ns[pos].srv.Close()
			var werr error
			for i := 0; i < 64 && werr == nil; i++ {
				_, werr = w.Write(data)
			}
			if werr == nil {
				_, _, werr = w.Close()
			} else {
				w.Abort()
			}
			var se *Error
			if !errors.As(werr, &se) || se.Datanode != ns[pos].id {
				t.Fatalf("error %v, want one naming datanode %d", werr, ns[pos].id)
			}
			t.Logf("writer error: %v", werr)
			for i, n := range ns {
				if i == pos {
					continue
				}
				waitFor(t, 5*time.Second, "survivor to discard the block", func() bool { return !hasData(t, n, b) })
				waitFor(t, 5*time.Second, "survivor's stream to end", func() bool { return n.srv.Stats().Active == 0 })
				if n.srv.Stats().Failed == 0 {
					t.Fatalf("datanode %d did not count the failed stream", n.id)
				}
			}
		})
	}
}

// stallSink blocks writes until released: a hung disk.
type stallSink struct {
	Sink
	after   int
	release chan struct{}
	mu      sync.Mutex
}

func (s *stallSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	s.after--
	stall := s.after < 0
	s.mu.Unlock()
	if stall {
		<-s.release
	}
	return s.Sink.Write(p)
}

// TestStallTimesOut: the last datanode's disk hangs; the middle one times
// out waiting for its ack and names it, before anyone upstream gives up.
func TestStallTimesOut(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	const timeout = 300 * time.Millisecond
	n1 := startNode(t, 1, timeout, nil)
	n2 := startNode(t, 2, timeout, nil)
	n3 := startNode(t, 3, timeout, func(s Sink) Sink { return &stallSink{Sink: s, after: 2, release: release} })
	w, err := Dial(context.Background(), []Target{n1.target(), n2.target(), n3.target()}, 1, BlockID{1, 1}, Options{Window: 4, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	data := payload(1<<20, 2)
	var werr error
	for i := 0; i < 32 && werr == nil; i++ {
		_, werr = w.Write(data)
	}
	if werr == nil {
		_, _, werr = w.Close()
	}
	var se *Error
	if !errors.As(werr, &se) || se.Datanode != 3 || se.Code != CodeTimeout {
		t.Fatalf("error %v, want a timeout naming datanode 3", werr)
	}
	if el := time.Since(start); el > 5*timeout {
		t.Fatalf("took %s to notice a stall with timeout %s", el, timeout)
	}
	t.Logf("after %s: %v", time.Since(start), werr)
}

// TestRefusals: what a datanode refuses, it says why and who it is.
func TestRefusals(t *testing.T) {
	ns, route := chain(t, 2, time.Second)
	ctx := context.Background()

	// Downstream unreachable: a route through a port nobody listens on.
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := Target{ID: 9, Addr: l.Addr().String()}
	l.Close()
	_, err := Dial(ctx, []Target{route[0], route[1], dead}, 1, BlockID{1, 1}, Options{})
	var se *Error
	if !errors.As(err, &se) || se.Code != CodeUnreachable || se.Datanode != 9 || se.Addr != dead.Addr {
		t.Fatalf("unreachable third hop: %v", err)
	}
	// The first hop itself unreachable.
	if _, err := Dial(ctx, []Target{dead}, 1, BlockID{1, 1}, Options{}); !errors.As(err, &se) || se.Code != CodeUnreachable || se.Datanode != 9 {
		t.Fatalf("unreachable first hop: %v", err)
	}

	// A garbage header gets a bad-header error back, not a hang.
	c, err := net.Dial("tcp", route[0].Addr)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var a ack
	var ab [ackLen]byte
	if err := readAck(c, &ab, &a); err != nil || a.kind != kindError || a.code != CodeBadHeader || a.dn != 1 || !strings.Contains(a.reason, "magic") {
		t.Fatalf("garbage header: ack %+v, err %v", a, err)
	}
	c.Close()

	// A corrupted packet is refused by the datanode that sees it first.
	c, err = net.Dial("tcp", route[1].Addr)
	if err != nil {
		t.Fatal(err)
	}
	hb, _ := encodeHeader(nil, &Header{Pipeline: 1, Block: BlockID{1, 2}, PacketSize: 1 << 20})
	c.Write(hb)
	if err := readAck(c, &ab, &a); err != nil || a.kind != kindHeaderAck {
		t.Fatalf("header ack: %+v, %v", a, err)
	}
	data := payload(8192, 3)
	ph := packetHeader{kind: kindData, length: 8192, crc: crc32c(data) ^ 1}
	var pb [packetHeaderLen]byte
	ph.encode(&pb)
	c.Write(append(pb[:], data...))
	if err := readAck(c, &ab, &a); err != nil || a.code != CodeChecksumMismatch || a.dn != 2 || !strings.Contains(a.reason, "packet 0 at offset 0") {
		t.Fatalf("corrupt packet: ack %+v, err %v", a, err)
	}
	c.Close()
	waitFor(t, 5*time.Second, "corrupt stream discarded", func() bool { return !hasData(t, ns[1], BlockID{1, 2}) })

	// Out-of-sequence packets.
	c, _ = net.Dial("tcp", route[1].Addr)
	hb, _ = encodeHeader(nil, &Header{Pipeline: 1, Block: BlockID{1, 3}, PacketSize: 1 << 20})
	c.Write(hb)
	readAck(c, &ab, &a)
	ph = packetHeader{kind: kindData, length: 8192, seq: 1, offset: 8192, crc: crc32c(data)}
	ph.encode(&pb)
	c.Write(append(pb[:], data...))
	if err := readAck(c, &ab, &a); err != nil || a.code != CodeProtocol || !strings.Contains(a.reason, "want packet 0 at offset 0") {
		t.Fatalf("out of sequence: ack %+v, err %v", a, err)
	}
	c.Close()
}

// TestWriterAbort: a client that goes away without CLOSE leaves nothing.
func TestWriterAbort(t *testing.T) {
	ns, route := chain(t, 3, time.Second)
	b := BlockID{1, 4}
	w, err := Dial(context.Background(), route, 1, b, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(payload(3<<20, 4)); err != nil {
		t.Fatal(err)
	}
	w.Abort()
	for _, n := range ns {
		waitFor(t, 5*time.Second, "aborted stream discarded", func() bool { return n.srv.Stats().Active == 0 && !hasData(t, n, b) })
	}
	if _, err := w.Write([]byte{1}); err == nil {
		t.Fatal("write after abort succeeded")
	}
}

// TestInterruptEndsBlockedWrite: a Write waiting for a window slot on a
// stalled chain (its last datanode's disk hangs; timeouts of 30 s) ends
// within a second of Interrupt from another goroutine, with an error,
// and Abort then returns; without Interrupt it would wait for the stall
// timeout.
func TestInterruptEndsBlockedWrite(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	const timeout = 30 * time.Second
	n1 := startNode(t, 1, timeout, nil)
	n2 := startNode(t, 2, timeout, func(s Sink) Sink { return &stallSink{Sink: s, after: 1, release: release} })
	w, err := Dial(context.Background(), []Target{n1.target(), n2.target()}, 1, BlockID{1, 1}, Options{Window: 2, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	data := payload(1<<20, 3)
	errc := make(chan error, 1)
	go func() {
		var werr error
		for i := 0; i < 16 && werr == nil; i++ {
			_, werr = w.Write(data)
		}
		errc <- werr
	}()
	// The writer blocks once the window is full of unacked packets.
	select {
	case err := <-errc:
		t.Fatalf("writes ended before the interrupt: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	start := time.Now()
	w.Interrupt()
	select {
	case err := <-errc:
		if err == nil {
			t.Fatal("write after Interrupt succeeded")
		}
		t.Logf("write ended %v after Interrupt: %v", time.Since(start), err)
	case <-time.After(10 * time.Second):
		t.Fatal("write still blocked 10 s after Interrupt")
	}
	done := make(chan struct{})
	go func() { w.Abort(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Abort blocked after Interrupt")
	}
}

// TestDialEndsWithContext: a Dial waiting for the header's answer (here a
// first hop that accepted the connection and never answers, as a hung
// datanode or a slow chain behind it) returns as soon as its context
// ends, not at its deadline (Timeout per hop plus the ack wait: over 20 s
// here). The client's halt cancels the dial of a segment whose body
// failed through this.
func TestDialEndsWithContext(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var conns []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c) // held open, never answered
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	}()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	w, err := Dial(ctx, []Target{{ID: 9, Addr: ln.Addr().String()}}, 1, BlockID{1, 1}, Options{Timeout: 10 * time.Second})
	took := time.Since(start)
	if err == nil {
		w.Abort()
		t.Fatal("Dial to a first hop that never answers succeeded")
	}
	if took > 5*time.Second {
		t.Fatalf("Dial returned %v after its context ended (at 200ms): %v", took, err)
	}
	t.Logf("Dial returned after %v: %v", took, err)
}
