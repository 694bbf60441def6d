package pki

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
)

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int64
	bytes  atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	c.bytes.Add(int64(len(p)))
	return c.Conn.Write(p)
}

// pair connects a client and a server over loopback TCP; wrap makes the
// TLS connection of either side from the raw (counted) connection.
func pair(t testing.TB, wrapSrv, wrapCli func(net.Conn) net.Conn) (srv, cli net.Conn, srvRaw, cliRaw *countingConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	c, err := net.DialTimeout("tcp", ln.Addr().String(), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	s := <-accepted
	if s == nil {
		t.Fatal("accept failed")
	}
	srvRaw, cliRaw = &countingConn{Conn: s}, &countingConn{Conn: c}
	srv, cli = wrapSrv(srvRaw), wrapCli(cliRaw)
	srv.SetDeadline(time.Now().Add(60 * time.Second))
	cli.SetDeadline(time.Now().Add(60 * time.Second))
	t.Cleanup(func() { srv.Close(); cli.Close() })
	return
}

func testCreds(t testing.TB) (srv, cli *Credentials) {
	ca, err := NewCA("conn test")
	if err != nil {
		t.Fatal(err)
	}
	srv, err = ca.Issue(Identity{Role: RoleDatanode, ID: "7"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cli, err = ca.Issue(Identity{Role: RoleClient, ID: "c"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return srv, cli
}

// TestBatchedConnRoundTrip: data of every size arrives intact both ways,
// with the handshake started by a Write on one side and a Read on the
// other, from concurrent writers, and the close_notify reaches the peer
// (its Read ends with io.EOF, not a reset).
func TestBatchedConnRoundTrip(t *testing.T) {
	sc, cc := testCreds(t)
	srv, cli, _, _ := pair(t,
		func(c net.Conn) net.Conn { return Server(c, sc.ServerTLS()) },
		func(c net.Conn) net.Conn { return Client(c, cc.ClientTLS(RoleDatanode)) })

	// The client writes first: its Write must run the handshake unbatched.
	sizes := []int{1, 9, 16 << 10, 16<<10 + 1, 100 << 10, batchBytes, batchBytes + 1, 3<<20 + 7}
	var want bytes.Buffer
	var wmu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, n := range sizes {
				p := make([]byte, n)
				rand.Read(p)
				p[0] = byte(g)
				// Whole writes are atomic on a tls.Conn: log them in the
				// order they are written.
				wmu.Lock()
				want.Write(p)
				_, err := cli.Write(p)
				wmu.Unlock()
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	got := make(chan []byte, 1)
	go func() {
		b, err := io.ReadAll(srv)
		if err != nil {
			errs <- fmt.Errorf("server read: %w", err)
		}
		got <- b
	}()
	wg.Wait()
	if err := cli.(*Conn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	b := <-got
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	if !bytes.Equal(b, want.Bytes()) {
		t.Fatalf("server read %d bytes, want %d (or content differs)", len(b), want.Len())
	}

	// And back: the server answers, then closes (close_notify).
	reply := make([]byte, 2<<20)
	rand.Read(reply)
	go func() {
		srv.Write(reply)
		srv.Close()
	}()
	back, err := io.ReadAll(cli)
	if err != nil {
		t.Fatalf("client read: %v (close_notify lost?)", err)
	}
	if !bytes.Equal(back, reply) {
		t.Fatalf("client read %d bytes, want %d", len(back), len(reply))
	}
	if cs := cli.(*Conn).ConnectionState(); !cs.HandshakeComplete || cs.Version != tls.VersionTLS13 {
		t.Fatalf("connection state %+v", cs)
	}
}

// writesPerMiB sends 8 MiB in 1 MiB writes through cli and returns the
// socket writes per MiB after the handshake.
func writesPerMiB(t testing.TB, srv, cli net.Conn, cliRaw *countingConn) float64 {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := io.CopyN(io.Discard, srv, 8<<20)
		done <- err
	}()
	if err := cli.(interface{ Handshake() error }).Handshake(); err != nil {
		t.Fatal(err)
	}
	w0 := cliRaw.writes.Load()
	buf := make([]byte, 1<<20)
	for range 8 {
		if _, err := cli.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return float64(cliRaw.writes.Load()-w0) / 8
}

// TestRecordBatching is the regression check: a 1 MiB write of a TLS
// connection reaches the socket in at most 1 MiB / batchBytes + 1 writes
// (plain crypto/tls, measured alongside, takes 64: one per record).
func TestRecordBatching(t *testing.T) {
	sc, cc := testCreds(t)
	srv, cli, _, cliRaw := pair(t,
		func(c net.Conn) net.Conn { return Server(c, sc.ServerTLS()) },
		func(c net.Conn) net.Conn { return Client(c, cc.ClientTLS(RoleDatanode)) })
	batched := writesPerMiB(t, srv, cli, cliRaw)

	srv, cli, _, cliRaw = pair(t,
		func(c net.Conn) net.Conn { return tls.Server(c, sc.ServerTLS()) },
		func(c net.Conn) net.Conn { return tls.Client(c, cc.ClientTLS(RoleDatanode)) })
	plain := writesPerMiB(t, srv, cli, cliRaw)
	t.Logf("socket writes per MiB: batched %.1f, crypto/tls %.1f", batched, plain)
	if max := float64(1<<20)/batchBytes + 1; batched > max {
		t.Fatalf("batched TLS made %.1f socket writes per MiB, want <= %.0f", batched, max)
	}
	if plain < 32 {
		t.Fatalf("crypto/tls made only %.1f socket writes per MiB: the control no longer shows what batching saves", plain)
	}
}

// TestBatchedWriteError: a write that fails at the socket fails the Write
// (the records were taken into the batch, but never sent), and every
// later Write fails too.
func TestBatchedWriteError(t *testing.T) {
	sc, cc := testCreds(t)
	srv, cli, _, cliRaw := pair(t,
		func(c net.Conn) net.Conn { return Server(c, sc.ServerTLS()) },
		func(c net.Conn) net.Conn { return Client(c, cc.ClientTLS(RoleDatanode)) })
	go io.Copy(io.Discard, srv)
	if _, err := cli.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	cliRaw.Conn.Close() // under the batching: the next flush fails
	if _, err := cli.Write(make([]byte, 64<<10)); err == nil {
		t.Fatal("write on a closed socket succeeded")
	}
	if _, err := cli.Write([]byte("x")); err == nil {
		t.Fatal("write after a failed write succeeded")
	}
}

// bytesCodec passes []byte messages through gRPC as they are.
type bytesCodec struct{}

func (bytesCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (bytesCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (bytesCodec) Name() string { return "pki-test-bytes" }

func init() { encoding.RegisterCodec(bytesCodec{}) }

// countingListener counts the socket writes of every accepted connection.
type countingListener struct {
	net.Listener
	mu    sync.Mutex
	conns []*countingConn
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Accept0()
	if err != nil {
		return nil, err
	}
	cc := &countingConn{Conn: c}
	l.mu.Lock()
	l.conns = append(l.conns, cc)
	l.mu.Unlock()
	return cc, nil
}

func (l *countingListener) Accept0() (net.Conn, error) { return l.Listener.Accept() }

func (l *countingListener) writes() (n, b int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		n += c.writes.Load()
		b += c.bytes.Load()
	}
	return
}

// TestGRPCBatchedTLS: a gRPC server and client with the package's options
// stream 16 MiB of 1 MiB messages, the server sees the client's verified
// identity, and the server's socket writes stay few (one per 16 KiB record
// before batching).
func TestGRPCBatchedTLS(t *testing.T) {
	sc, cc := testCreds(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := &countingListener{Listener: ln}
	const msgs, size = 16, 1 << 20
	var seen atomic.Value
	desc := grpc.ServiceDesc{
		ServiceName: "pkitest.Blob",
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{StreamName: "Get", ServerStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
			id, err := FromContext(ss.Context())
			if err != nil {
				return err
			}
			seen.Store(id)
			var req []byte
			if err := ss.RecvMsg(&req); err != nil {
				return err
			}
			msg := bytes.Repeat([]byte{req[0]}, size)
			for range msgs {
				if err := ss.SendMsg(&msg); err != nil {
					return err
				}
			}
			return nil
		}}},
	}
	s := grpc.NewServer(append(GRPCServerBuffers(), sc.GRPCServerOption(), grpc.ForceServerCodec(bytesCodec{}))...)
	s.RegisterService(&desc, nil)
	go s.Serve(cl)
	defer s.Stop()

	conn, err := grpc.NewClient(ln.Addr().String(), cc.GRPCDialOption(RoleDatanode),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(bytesCodec{}), grpc.MaxCallRecvMsgSize(4<<20)),
		grpc.WithInitialWindowSize(16<<20), grpc.WithInitialConnWindowSize(64<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := conn.NewStream(ctx, &desc.Streams[0], "/pkitest.Blob/Get")
	if err != nil {
		t.Fatal(err)
	}
	req := []byte{42}
	if err := st.SendMsg(&req); err != nil {
		t.Fatal(err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	w0, _ := cl.writes()
	total := 0
	for {
		var m []byte
		err := st.RecvMsg(&m)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(m) != size || m[0] != 42 || m[size-1] != 42 {
			t.Fatalf("message of %d bytes, first %d", len(m), m[0])
		}
		total += len(m)
	}
	if total != msgs*size {
		t.Fatalf("got %d bytes, want %d", total, msgs*size)
	}
	if id, _ := seen.Load().(Identity); id.Role != RoleClient || id.ID != "c" {
		t.Fatalf("server saw %v", seen.Load())
	}
	w1, _ := cl.writes()
	perMiB := float64(w1-w0) / float64(total>>20)
	t.Logf("server socket writes per MiB: %.1f", perMiB)
	// Unbatched: 64 or more. Window updates and flow control make a few
	// more than the ideal 4.
	if perMiB > 16 {
		t.Fatalf("server made %.1f socket writes per MiB, want <= 16", perMiB)
	}
}

// BenchmarkBatchedTLS: 1 MiB writes over loopback through crypto/tls and
// through Conn: throughput, CPU per GiB (both ends) and socket writes.
func BenchmarkBatchedTLS(b *testing.B) {
	sc, cc := testCreds(b)
	for _, mode := range []string{"crypto-tls", "batched"} {
		b.Run(mode, func(b *testing.B) {
			ws := func(c net.Conn) net.Conn { return tls.Server(c, sc.ServerTLS()) }
			wc := func(c net.Conn) net.Conn { return tls.Client(c, cc.ClientTLS()) }
			if mode == "batched" {
				ws = func(c net.Conn) net.Conn { return Server(c, sc.ServerTLS()) }
				wc = func(c net.Conn) net.Conn { return Client(c, cc.ClientTLS()) }
			}
			srv, cli, _, cliRaw := pair(b, ws, wc)
			srv.SetDeadline(time.Time{})
			cli.SetDeadline(time.Time{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				io.Copy(io.Discard, srv)
			}()
			if err := cli.(interface{ Handshake() error }).Handshake(); err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, 1<<20)
			b.SetBytes(int64(len(buf)))
			w0 := cliRaw.writes.Load()
			b.ResetTimer()
			cpu0 := cpuTime()
			for range b.N {
				if _, err := cli.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			cli.Close()
			<-done
			b.ReportMetric((cpuTime()-cpu0).Seconds()/(float64(b.N)/1024), "cpu-s/GiB")
			b.ReportMetric(float64(cliRaw.writes.Load()-w0)/float64(b.N), "writes/MiB")
		})
	}
}
