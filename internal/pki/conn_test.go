package pki

import (
	"crypto/tls"
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
