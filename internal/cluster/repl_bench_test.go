package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
)

// The re-replication benchmark (docs/BENCHMARKS.md, "Re-replication and
// decommission"). Off by default; run with
//
//	BASALT_BENCH_REPL=1 BASALT_BENCH_REPL_MIB=512 go test -run TestBenchReplication -v -timeout 30m ./internal/cluster/
//
// drain: 4 datanodes; the 4th is down while the data is written, so every
// container is on datanodes 1-3; it comes back, and datanode 1 is
// decommissioned: each of its containers can only go to datanode 4, the
// one target; nothing else runs. lose: 5 datanodes, the one holding the
// most is killed while a foreground writer runs; time until every block
// has 3 replicas again (6 s dead interval included) and the writer's
// throughput meanwhile, against its throughput before the kill.
// lose-throttled: the same with one copy in flight per target instead of
// two, capped at 32 MiB/s (CopyBandwidthPerTarget). drain-throttled: the
// drain with that cap.
func TestBenchReplication(t *testing.T) {
	if os.Getenv("BASALT_BENCH_REPL") == "" {
		t.Skip("set BASALT_BENCH_REPL=1 to run the re-replication benchmark")
	}
	mib := 512
	if v, err := strconv.Atoi(os.Getenv("BASALT_BENCH_REPL_MIB")); err == nil && v > 0 {
		mib = v
	}
	t.Run("drain", func(t *testing.T) { benchDrain(t, mib, false) })
	t.Run("drain-throttled", func(t *testing.T) { benchDrain(t, mib, true) })
	t.Run("lose", func(t *testing.T) { benchLose(t, mib, false) })
	t.Run("lose-throttled", func(t *testing.T) { benchLose(t, mib, true) })
}

const benchKey = 16 << 20

// restartMetaWith is restartMeta with a changed SCM configuration.
func restartMetaWith(t *testing.T, c *cluster.Cluster, dir string, change func(*scm.Config)) {
	t.Helper()
	grpcAddr, raftAddr := c.Meta.GRPCAddr(), c.Meta.RaftAddr()
	if err := c.Meta.Close(); err != nil {
		t.Fatal(err)
	}
	cfg := scm.Config{HeartbeatInterval: 200 * time.Millisecond, StaleInterval: 2 * time.Second, DeadInterval: 6 * time.Second,
		SafeModeMinDatanodes: 3, LoopInterval: 200 * time.Millisecond, ContainerSize: 512 << 20, BlockSize: 4 << 20}
	change(&cfg)
	creds, err := c.Credentials(pki.Identity{Role: pki.RoleMeta, ID: "1"})
	if err != nil {
		t.Fatal(err)
	}
	ms, err := meta.New(meta.Config{TLS: creds, Admins: cluster.Admins, NodeID: 1, DataDir: filepath.Join(dir, "meta"), RaftAddr: raftAddr, GRPCAddr: grpcAddr, TickInterval: 50 * time.Millisecond, SCM: cfg})
	if err != nil {
		t.Fatal(err)
	}
	if err := ms.Start(); err != nil {
		ms.Close()
		t.Fatal(err)
	}
	c.Meta = ms
}

// writeFor writes 16 MiB keys until stop closes (or n keys, if n > 0) and
// returns the bytes written and the time it took.
func writeFor(t *testing.T, cl *client.Client, prefix string, n int, stop <-chan struct{}) (int64, time.Duration, []string) {
	data := randData(1, benchKey)
	start := time.Now()
	var total int64
	var keys []string
	for i := 0; n == 0 || i < n; i++ {
		if stop != nil {
			select {
			case <-stop:
				return total, time.Since(start), keys
			default:
			}
		}
		k := fmt.Sprintf("%s%05d", prefix, i)
		if _, err := cl.PutKey(context.Background(), "vol", "bkt", k, onlyReader{bytes.NewReader(data)}, client.PutOptions{}); err != nil {
			t.Logf("put %s: %v", k, err)
			continue
		}
		total += benchKey
		keys = append(keys, k)
	}
	return total, time.Since(start), keys
}

func mibps(b int64, d time.Duration) float64 { return float64(b) / (1 << 20) / d.Seconds() }

func waitState(t *testing.T, cl *client.Client, dn uint64, bound time.Duration, ok func(*metapb.DatanodeStatus) bool) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		d, err := opStatus(context.Background(), cl, dn)
		if err == nil && ok(d) {
			return time.Since(start)
		}
		if time.Since(start) > bound {
			t.Fatalf("datanode %d: %v %v after %v", dn, d, err, bound)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// benchCluster starts a cluster as start does; with BASALT_BENCH_REPL_LOG
// set, with an info log (meta and datanodes) in that file, to see where
// the time goes.
func benchCluster(t *testing.T, dir string, n int) *cluster.Cluster {
	p := os.Getenv("BASALT_BENCH_REPL_LOG")
	if p == "" {
		return start(t, dir, n, 4<<20)
	}
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: n, HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20, Logger: slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// throttle is the throttled runs' setting.
func throttle(cfg *scm.Config) {
	cfg.MaxCopiesPerTarget = 1
	cfg.CopyBandwidthPerTarget = 32 << 20
}

func benchDrain(t *testing.T, mib int, throttled bool) {
	dir := t.TempDir()
	c := benchCluster(t, dir, 4)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	target := c.Datanode(3).ID()
	c.StopDatanode(3)
	waitState(t, cl, target, time.Minute, func(d *metapb.DatanodeStatus) bool { return d.State == metapb.NodeState_DEAD })
	time.Sleep(time.Second) // its pipelines close
	n, took, _ := writeFor(t, cl, "data", mib*(1<<20)/benchKey, nil)
	t.Logf("wrote %d MiB on datanodes 1-3 at %.1f MiB/s (no repair running)", n>>20, mibps(n, took))
	if err := c.RestartDatanode(context.Background(), 3); err != nil {
		t.Fatal(err)
	}
	if throttled {
		restartMetaWith(t, c, dir, throttle)
	}
	waitState(t, cl, target, time.Minute, func(d *metapb.DatanodeStatus) bool {
		return d.State == metapb.NodeState_HEALTHY && d.LastHeartbeatUnixMs > 0
	})
	victim := c.Datanode(0).ID()
	cpu0 := cpuTime()
	began := time.Now()
	if _, err := cl.Scm().SetDatanodeOpState(context.Background(), &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING}); err != nil {
		t.Fatal(err)
	}
	var firstCopy time.Duration
	var bytes uint64
	for {
		d, err := opStatus(context.Background(), cl, victim)
		if err == nil {
			bytes = max(bytes, d.DrainBytesLeft)
			if d.OpState == metapb.NodeOpState_DECOMMISSIONED {
				break
			}
		}
		if firstCopy == 0 {
			if h, err := cl.Scm().GetContainerHealth(context.Background(), &metapb.GetContainerHealthRequest{}); err == nil && len(h.Copies) > 0 {
				firstCopy = time.Since(began)
			}
		}
		if time.Since(began) > 20*time.Minute {
			t.Fatal("drain did not finish")
		}
		time.Sleep(100 * time.Millisecond)
	}
	total := time.Since(began)
	cpu := cpuTime() - cpu0
	t.Logf("CPU (the whole test process: meta, 4 datanodes) during the drain: %.1f s in %.1f s, %.1f CPU-s per GiB", cpu.Seconds(), total.Seconds(), cpu.Seconds()/(float64(bytes)/(1<<30)))
	h, _ := cl.Scm().GetContainerHealth(context.Background(), &metapb.GetContainerHealthRequest{})
	copyTime := total - firstCopy
	t.Logf("throttled=%v: drained %.2f GiB into datanode %d in %v (first copy %v after the start): %.2f GiB/min over the copies, %.2f GiB/min end to end; SCM rate %.1f MiB/s; copies done %d",
		throttled, float64(bytes)/(1<<30), target, total.Round(time.Millisecond), firstCopy.Round(time.Millisecond),
		float64(bytes)/(1<<30)/copyTime.Minutes(), float64(bytes)/(1<<30)/total.Minutes(), h.GetRateBytesPerSec()/(1<<20), h.GetCopiesDone())
}

func benchLose(t *testing.T, mib int, throttled bool) {
	dir := t.TempDir()
	c := benchCluster(t, dir, 5)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	n, took, keys := writeFor(t, cl, "data", mib*(1<<20)/benchKey, nil)
	t.Logf("wrote %d MiB at %.1f MiB/s", n>>20, mibps(n, took))
	if throttled {
		restartMetaWith(t, c, dir, throttle)
		if err := c.WaitWritable(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	bn, btook, _ := writeFor(t, cl, "base", 8, nil)
	t.Logf("throttled=%v: foreground writes before the kill: %.1f MiB/s", throttled, mibps(bn, btook))
	vi, victim := mostLoaded(t, c, cl, keys, 5)
	locs, err := blockLocations(context.Background(), cl, keys)
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for _, l := range locs {
		for _, id := range l {
			if id == victim {
				held++
			}
		}
	}
	stop := make(chan struct{})
	var fg, fgTook atomic.Int64
	var wg sync.WaitGroup
	killed := time.Now()
	c.StopDatanode(vi)
	// The writer runs during the repair only: from DEAD (the repair
	// starts; the pipelines with the datanode were replaced when it went
	// STALE) to full redundancy.
	waitState(t, cl, victim, time.Minute, func(d *metapb.DatanodeStatus) bool { return d.State == metapb.NodeState_DEAD })
	dead := time.Since(killed)
	wg.Add(1)
	go func() {
		defer wg.Done()
		b, d, _ := writeFor(t, cl, "fg", 0, stop)
		fg.Store(b)
		fgTook.Store(int64(d))
	}()
	for {
		locs, err := blockLocations(context.Background(), cl, keys)
		done := err == nil
		for _, l := range locs {
			if len(l) != 3 {
				done = false
				break
			}
			for _, id := range l {
				if id == victim {
					done = false
				}
			}
		}
		if done {
			break
		}
		if time.Since(killed) > 20*time.Minute {
			t.Fatal("not back to full redundancy")
		}
		time.Sleep(250 * time.Millisecond)
	}
	d := time.Since(killed)
	close(stop)
	wg.Wait()
	h, _ := cl.Scm().GetContainerHealth(context.Background(), &metapb.GetContainerHealthRequest{})
	t.Logf("throttled=%v: foreground writes from DEAD (%v after the kill) to full redundancy: %.1f MiB/s (%d MiB); copies done %d, SCM rate %.1f MiB/s",
		throttled, dead.Round(time.Millisecond), mibps(fg.Load(), time.Duration(fgTook.Load())), fg.Load()>>20, h.GetCopiesDone(), h.GetRateBytesPerSec()/(1<<20))
	an, atook, _ := writeFor(t, cl, "after", 8, nil)
	t.Logf("throttled=%v: foreground writes after the repair: %.1f MiB/s", throttled, mibps(an, atook))
	t.Logf("lost datanode %d holding %d block replicas (%.2f GiB): every block back to 3 replicas %v after the kill (dead interval 6 s included; %v after it)",
		victim, held, float64(held)*4/1024, d.Round(time.Millisecond), (d - 6*time.Second).Round(time.Millisecond))
}
