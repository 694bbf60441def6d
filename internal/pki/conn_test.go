package pki

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

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

// TestRecordBatching checks that the batching BenchmarkBatchedTLS and
// BenchmarkGRPCServe measure does what it says: a 1 MiB write of a TLS
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
	if max := float64(1<<20)/float64(batchBytes) + 1; batched > max {
		t.Fatalf("batched TLS made %.1f socket writes per MiB, want <= %.0f", batched, max)
	}
	if plain < 32 {
		t.Fatalf("crypto/tls made only %.1f socket writes per MiB: the control no longer shows what batching saves", plain)
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

// BenchmarkBatchedTLS: 1 MiB writes over loopback through crypto/tls and
// through Conn: throughput, CPU per GiB (both ends) and socket writes.
func BenchmarkBatchedTLS(b *testing.B) {
	sc, cc := testCreds(b)
	for _, mode := range []string{"crypto-tls", "batched-64k", "batched-256k", "batched-1m"} {
		b.Run(mode, func(b *testing.B) {
			if size, ok := map[string]int{"batched-64k": 64 << 10, "batched-256k": 256 << 10, "batched-1m": 1 << 20}[mode]; ok {
				oldSize, oldNew := batchBytes, batchPool.New
				defer func() { batchBytes = oldSize; batchPool = sync.Pool{New: oldNew} }()
				batchBytes = size
				batchPool = sync.Pool{New: func() any { b := make([]byte, 0, size+recordMax); return &b }}
			}
			ws := func(c net.Conn) net.Conn { return tls.Server(c, sc.ServerTLS()) }
			wc := func(c net.Conn) net.Conn { return tls.Client(c, cc.ClientTLS()) }
			if mode != "crypto-tls" {
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
			// The sender's CPU alone (what a datanode pays to serve a
			// read): its goroutine keeps one thread, whose CPU time
			// counts the encryption, the copies and the send system calls.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			b.ResetTimer()
			cpu0, tcpu0 := cpuTime(), threadCPU()
			for range b.N {
				if _, err := cli.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			tcpu := threadCPU() - tcpu0
			cli.Close()
			<-done
			b.ReportMetric((cpuTime()-cpu0).Seconds()/(float64(b.N)/1024), "cpu-s/GiB")
			b.ReportMetric(tcpu.Seconds()/(float64(b.N)/1024), "sender-cpu-s/GiB")
			b.ReportMetric(float64(cliRaw.writes.Load()-w0)/float64(b.N), "writes/MiB")
		})
	}
}

// threadCPU is the calling thread's user and system CPU time.
func threadCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(1, &ru) // RUSAGE_THREAD
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
