package datanode_test

import (
	"context"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/stream"
	"github.com/basalt-store/basalt/internal/vfs"
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

// BenchmarkStreamCommitSlowDisk streams 16 MiB blocks (one S3 part's
// worth) to datanodes whose data volume is a modelled HDD (vfs.LatencyFS:
// 8 ms per flush plus the bytes written since the last one at 200 MB/s;
// the Raft logs stay on the host's disk) and commits each with PutBlock
// wait_all: the per-block tail after the last Write. close-ms is
// Writer.Close (the chain finishing the data in flight, then every
// replica's sync of the block), putblock-ms the PutBlock, tail-ms both.
// (Session 14 measured a close that only starts the sync, overlapping it
// with the PutBlock: docs/BENCHMARKS.md.)
func BenchmarkStreamCommitSlowDisk(b *testing.B) {
	const size = 16 << 20
	e := startEnvWith(b, func(c *cluster.Config) {
		c.DatanodeConfig = func(i int, dc *datanode.Config) {
			if len(dc.Volumes) == 0 {
				dc.Volumes = []string{filepath.Join(dc.DataDir, "data")}
			}
			fs := vfs.NewLatencyFS(vfs.Default, map[string]vfs.DiskProfile{dc.Volumes[0]: {
				SyncLatency: 8 * time.Millisecond, WriteBytesPerSec: 200e6}}, uint64(i+1))
			dc.FS = fs
		}
	})
	ctx := context.Background()
	data := randBytes(4<<20, 1)
	var closeTime, commitTime time.Duration
	b.SetBytes(size)
	b.ResetTimer()
	t0 := time.Now()
	for i := 0; i < b.N; i++ {
		blk := e.block()
		route, err := stream.Route(blk.GetDatanodes(), clientLoc)
		if err != nil {
			b.Fatal(err)
		}
		w, err := stream.Dial(ctx, route, blk.GetPipelineId(), bid(blk), stream.Options{TLS: streamTLS, Token: blk.GetToken()})
		if err != nil {
			b.Fatal(err)
		}
		for off := 0; off < size; off += len(data) {
			if _, err := w.Write(data); err != nil {
				b.Fatal(err)
			}
		}
		c0 := time.Now()
		length, chunks, err := w.Close()
		if err != nil {
			b.Fatal(err)
		}
		c1 := time.Now()
		closeTime += c1.Sub(c0)
		e.putBlock(blk, stream.BlockData(bid(blk), length, chunks), false)
		commitTime += time.Since(c1)
	}
	wall := time.Since(t0)
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(n*size/(1<<20)/wall.Seconds(), "MiB/s")
	b.ReportMetric(float64(closeTime.Microseconds())/1000/n, "close-ms")
	b.ReportMetric(float64(commitTime.Microseconds())/1000/n, "putblock-ms")
	b.ReportMetric(float64((closeTime+commitTime).Microseconds())/1000/n, "tail-ms")
}
