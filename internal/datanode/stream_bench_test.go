package datanode_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/stream"
)

func cpuSeconds() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// BenchmarkStreamCluster128MiB streams 128 MiB blocks through a 3-datanode
// chain of an in-process cluster on loopback (real sockets, real block
// files, fsync at close), then commits each with one PutBlock wait_all.
// cpu-s/GiB is the process's user+system CPU (client and all three
// datanodes, which share the process) per GiB of client data.
func BenchmarkStreamCluster128MiB(b *testing.B) {
	const size = 128 << 20
	e := startEnv(b)
	ctx := context.Background()
	data := randBytes(4<<20, 1)
	var streamTime, commitTime time.Duration
	b.SetBytes(size)
	b.ResetTimer()
	cpu0, t0 := cpuSeconds(), time.Now()
	for i := 0; i < b.N; i++ {
		blk := e.block()
		route, err := stream.Route(blk.GetDatanodes(), clientLoc)
		if err != nil {
			b.Fatal(err)
		}
		s0 := time.Now()
		w, err := stream.Dial(ctx, route, blk.GetPipelineId(), bid(blk), stream.Options{TLS: streamTLS})
		if err != nil {
			b.Fatal(err)
		}
		for off := 0; off < size; off += len(data) {
			if _, err := w.Write(data); err != nil {
				b.Fatal(err)
			}
		}
		length, chunks, err := w.Close()
		if err != nil {
			b.Fatal(err)
		}
		c0 := time.Now()
		streamTime += c0.Sub(s0)
		e.putBlock(blk, stream.BlockData(bid(blk), length, chunks), false)
		commitTime += time.Since(c0)
	}
	wall, cpu := time.Since(t0), cpuSeconds()-cpu0
	b.StopTimer()
	gib := float64(b.N) * size / (1 << 30)
	b.ReportMetric(float64(b.N)*size/(1<<20)/wall.Seconds(), "MiB/s")
	b.ReportMetric(cpu/gib, "cpu-s/GiB")
	b.ReportMetric(float64(commitTime.Milliseconds())/float64(b.N), "putblock-ms/op")
	b.ReportMetric(float64(b.N)*size/(1<<20)/streamTime.Seconds(), "stream-MiB/s")
}
