package stream

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
)

type discardSink struct{}

func (discardSink) Write(p []byte) (int, error) { return len(p), nil }
func (discardSink) Close() error                { return nil }
func (discardSink) Abort() error                { return nil }

// BenchmarkPacketPath measures the datanode packet path: a client streams
// 1 MiB packets to datanode 1, which forwards each to datanode 2 (writev
// from the receive buffer) and writes it to its sink; datanode 2 writes
// it too; acks come back. One op is one MiB. allocs/op is per MiB for the
// whole process (client and both datanodes); copied-B/MiB counts payload
// bytes copied in user space by this package (the one read from the
// socket into the pooled buffer is not a copy: the kernel writes there);
// crc-B/MiB the bytes the Writer summed with CRC32C (1 MiB: once).
// "storage" writes real block files (O_DIRECT from the aligned buffers,
// no fsync until close); "discard" isolates network and CPU.
func BenchmarkPacketPath(b *testing.B) {
	for _, sink := range []string{"discard", "storage"} {
		b.Run(sink, func(b *testing.B) {
			var wrap func(Sink) Sink
			if sink == "discard" {
				wrap = func(Sink) Sink { return discardSink{} }
			}
			n1 := startNode(b, 1, 10*time.Second, wrap)
			n2 := startNode(b, 2, 10*time.Second, wrap)
			route := []Target{n1.target(), n2.target()}
			data := payload(1<<20, 1)
			const perBlock = 64 // MiB per block: blocks stay under the 256 MiB limit
			var w *Writer
			local := uint64(0)
			open := func() {
				local++
				var err error
				if w, err = Dial(context.Background(), route, 1, BlockID{1, local}, Options{}); err != nil {
					b.Fatal(err)
				}
			}
			finish := func() {
				if _, _, err := w.Close(); err != nil {
					b.Fatal(err)
				}
			}
			open()
			c0, s0 := CopiedBytes(), SummedBytes()
			b.SetBytes(1 << 20)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if i > 0 && i%perBlock == 0 {
					finish()
					open()
				}
				if _, err := w.Write(data); err != nil {
					b.Fatal(err)
				}
			}
			finish()
			b.StopTimer()
			b.ReportMetric(float64(CopiedBytes()-c0)/float64(b.N), "copied-B/MiB")
			b.ReportMetric(float64(SummedBytes()-s0)/float64(b.N), "crc-B/MiB")
		})
	}
}

// cpuTime is this process's user + system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkSecurePacketPath streams 1 MiB writes over mutual TLS through
// a chain of three datanodes writing real block files, as V2 does in a
// secured cluster. cpu-ms/GiB is the whole process's CPU (client and the
// three datanodes) per GiB sent: steadier than ns/op on a shared machine.
//
//	go test -run '^$' -bench SecurePacketPath -benchtime 512x ./internal/stream/
func BenchmarkSecurePacketPath(b *testing.B) {
	c := newSecureCluster(b, 3)
	cfg := c.issue(b, pki.RoleClient, "bench").ClientTLS(pki.RoleDatanode)
	route := c.route()
	data := payload(1<<20, 1)
	const perBlock = 64
	var w *Writer
	local := uint64(0)
	open := func() {
		local++
		var err error
		if w, err = Dial(context.Background(), route, 1, BlockID{1, local}, Options{TLS: cfg}); err != nil {
			b.Fatal(err)
		}
	}
	finish := func() {
		if _, _, err := w.Close(); err != nil {
			b.Fatal(err)
		}
	}
	open()
	b.SetBytes(1 << 20)
	b.ReportAllocs()
	cpu0 := cpuTime()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i > 0 && i%perBlock == 0 {
			finish()
			open()
		}
		if _, err := w.Write(data); err != nil {
			b.Fatal(err)
		}
	}
	finish()
	b.StopTimer()
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(time.Millisecond)/(float64(b.N)/1024), "cpu-ms/GiB")
}

// BenchmarkPlainPacketPath is BenchmarkSecurePacketPath without TLS: the
// same chain of three datanodes writing real block files, for the cost of
// TLS by difference.
func BenchmarkPlainPacketPath(b *testing.B) {
	route := []Target{startNode(b, 1, 10*time.Second, nil).target(), startNode(b, 2, 10*time.Second, nil).target(), startNode(b, 3, 10*time.Second, nil).target()}
	data := payload(1<<20, 1)
	const perBlock = 64
	var w *Writer
	local := uint64(0)
	open := func() {
		local++
		var err error
		if w, err = Dial(context.Background(), route, 1, BlockID{1, local}, Options{}); err != nil {
			b.Fatal(err)
		}
	}
	open()
	b.SetBytes(1 << 20)
	b.ReportAllocs()
	cpu0 := cpuTime()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i > 0 && i%perBlock == 0 {
			if _, _, err := w.Close(); err != nil {
				b.Fatal(err)
			}
			open()
		}
		if _, err := w.Write(data); err != nil {
			b.Fatal(err)
		}
	}
	if _, _, err := w.Close(); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(time.Millisecond)/(float64(b.N)/1024), "cpu-ms/GiB")
}

// BenchmarkCheckIdle: the peek at a kept connection before each next
// header (client and every forwarding hop, once per block).
func BenchmarkCheckIdle(b *testing.B) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer lis.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := lis.Accept()
		acc <- c
	}()
	c, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	peer := <-acc
	defer peer.Close()
	for b.Loop() {
		if err := checkIdle(c); err != nil {
			b.Fatal(err)
		}
	}
}
