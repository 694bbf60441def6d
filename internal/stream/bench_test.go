package stream

import (
	"context"
	"testing"
	"time"
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
