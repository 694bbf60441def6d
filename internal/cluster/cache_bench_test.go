package cluster_test

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestCacheReadBenchmark measures reads of uncached against cached blocks
// in one cluster (docs/BENCHMARKS.md, "Cache"). Off by default:
//
//	BASALT_CACHE_BENCH=1 [BASALT_CACHE_BENCH_MB=512] [BASALT_CACHE_ROOT=/dev/shm/x] \
//	  go test -count=1 -v -run TestCacheReadBenchmark ./internal/cluster/
//
// Before every uncached and cached phase the page cache is dropped
// (echo 3 > /proc/sys/vm/drop_caches, as root), so uncached reads come
// from the data disk. The cache directories are on tmpfs (/dev/shm) by
// default, standing in for a DAX-mounted pmem file system.
func TestCacheReadBenchmark(t *testing.T) {
	if os.Getenv("BASALT_CACHE_BENCH") == "" {
		t.Skip("set BASALT_CACHE_BENCH=1 to run")
	}
	totalMB := 512
	if v, err := strconv.Atoi(os.Getenv("BASALT_CACHE_BENCH_MB")); err == nil && v > 0 {
		totalMB = v
	}
	const keyMB, readers = 64, 4
	// BASALT_CACHE_BENCH_REPL: cache replication of the hot set (default
	// 1; 3 puts the whole set on every datanode, for the restart figure);
	// BASALT_CACHE_BENCH_ROUNDS: read rounds (default 3; 0: restart only).
	repl, rounds := 1, 3
	if v, err := strconv.Atoi(os.Getenv("BASALT_CACHE_BENCH_REPL")); err == nil && v >= 1 && v <= 3 {
		repl = v
	}
	if v, err := strconv.Atoi(os.Getenv("BASALT_CACHE_BENCH_ROUNDS")); err == nil && v >= 0 {
		rounds = v
	}
	nkeys := totalMB / keyMB
	root := os.Getenv("BASALT_CACHE_ROOT")
	if root == "" {
		var err error
		if root, err = os.MkdirTemp("/dev/shm", "basalt-cache-bench"); err != nil {
			t.Fatal(err)
		}
	}
	defer os.RemoveAll(root)
	ctx := context.Background()
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	c, err := cluster.Start(sctx, cluster.Config{Dir: t.TempDir(), Datanodes: 3,
		HeartbeatInterval: 500 * time.Millisecond, BlockSize: 32 << 20,
		CacheBytes: int64(totalMB+64) << 20, CacheRescanInterval: time.Second, ContainerSize: 8 << 30, CacheRoot: root})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl := grpcClient(t, c)               // cached blocks over gRPC
	scl := newClient(t, c, "/dc1/rack1") // short-circuit reads of cached blocks
	makeBucket(t, cl, "vol", "bkt")
	// Two sets of the same size: hot/ gets a cache directive, cold/ not;
	// the phases alternate, so both see the same machine load.
	hot, cold := make([]string, nkeys), make([]string, nkeys)
	for i := range nkeys {
		hot[i], cold[i] = fmt.Sprintf("hot/%03d", i), fmt.Sprintf("cold/%03d", i)
		put(t, cl, hot[i], randData(int64(i), keyMB<<20))
		if rounds > 0 { // the restart figure needs no uncached set
			put(t, cl, cold[i], randData(int64(i+1000), keyMB<<20))
		}
	}
	drop := func() {
		if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0); err != nil {
			t.Logf("drop caches: %v (uncached figures may come from the page cache)", err)
		}
	}
	seq := func(cl *client.Client, keys []string) float64 {
		start := time.Now()
		var wg sync.WaitGroup
		for w := range readers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := w; i < len(keys); i += readers {
					r, err := cl.GetKey(ctx, "vol", "bkt", keys[i])
					if err != nil {
						t.Error(err)
						return
					}
					io.Copy(io.Discard, onlyReader{r})
					r.Close()
				}
			}()
		}
		wg.Wait()
		return float64(len(keys)*keyMB) / time.Since(start).Seconds()
	}
	random := func(cl *client.Client, keys []string, ops int) (mbps, iops float64) {
		start := time.Now()
		var wg sync.WaitGroup
		var mu sync.Mutex
		var bytes int64
		for w := range readers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(w), 9))
				rs := map[string]*client.KeyReader{}
				buf := make([]byte, 1<<20)
				var n int64
				for range ops / readers {
					k := keys[rng.IntN(len(keys))]
					r := rs[k]
					if r == nil {
						var err error
						if r, err = cl.GetKey(ctx, "vol", "bkt", k); err != nil {
							t.Error(err)
							return
						}
						rs[k] = r
					}
					size := 4<<10 + rng.IntN(1<<20-4<<10)
					off := rng.Int64N(keyMB<<20 - int64(size))
					got, err := r.ReadAt(buf[:size], off)
					if err != nil && err != io.EOF {
						t.Error(err)
						return
					}
					n += int64(got)
				}
				for _, r := range rs {
					r.Close()
				}
				mu.Lock()
				bytes += n
				mu.Unlock()
			}()
		}
		wg.Wait()
		el := time.Since(start).Seconds()
		return float64(bytes) / (1 << 20) / el, float64(ops) / el
	}

	if _, err := cl.Scm().AddCachePool(ctx, &metapb.CachePool{Name: "bench"}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := cl.Scm().AddCacheDirective(ctx, &metapb.CacheDirective{Volume: "vol", Bucket: "bkt", Path: "hot/", Prefix: true, Replication: uint32(repl), Pool: "bench"}); err != nil {
		t.Fatal(err)
	}
	waitCached(t, c, cl, hot, repl, 10*time.Minute)
	warm := time.Since(start)
	t.Logf("cache replication %d: warming %d MiB into the cache (directive to every block reported): %v (%.0f MiB/s)", repl, totalMB*repl, warm.Round(time.Millisecond), float64(totalMB*repl)/warm.Seconds())
	time.Sleep(2 * time.Second) // the SCM leader lists the cached replicas
	const ops = 400
	var us, cs, ss, ur, cr, sr, ui, ci, si []float64
	h0 := cacheHits(c)
	for range rounds {
		drop()
		us = append(us, seq(cl, cold))
		drop()
		cs = append(cs, seq(cl, hot))
		drop()
		ss = append(ss, seq(scl, hot))
		drop()
		a, b := random(cl, cold, ops)
		ur, ui = append(ur, a), append(ui, b)
		drop()
		a, b = random(cl, hot, ops)
		cr, ci = append(cr, a), append(ci, b)
		drop()
		a, b = random(scl, hot, ops)
		sr, si = append(sr, a), append(si, b)
	}
	med := func(x []float64) float64 {
		if len(x) == 0 {
			return 0
		}
		y := slices.Clone(x)
		slices.Sort(y)
		return y[len(y)/2]
	}
	t.Logf("sequential MiB/s, %d rounds: uncached %v, cached %v, cached short-circuit %v", rounds, fmtF(us), fmtF(cs), fmtF(ss))
	t.Logf("random MiB/s (4 KiB-1 MiB), %d rounds: uncached %v, cached %v, cached short-circuit %v", rounds, fmtF(ur), fmtF(cr), fmtF(sr))
	t.Logf("short-circuit medians: sequential %.0f MiB/s (%.1fx uncached), random %.0f MiB/s, %.0f reads/s (%.1fx uncached); short-circuit reads %d",
		med(ss), med(ss)/med(us), med(sr), med(si), med(sr)/med(ur), scl.ShortCircuitReads())
	t.Logf("medians: sequential uncached %.0f MiB/s, cached %.0f MiB/s, ratio %.2fx; random uncached %.0f MiB/s (%.0f reads/s), cached %.0f MiB/s (%.0f reads/s), ratio %.2fx; cache hits +%d",
		med(us), med(cs), med(cs)/med(us), med(ur), med(ui), med(cr), med(ci), med(cr)/med(ur), cacheHits(c)-h0)

	// Restart a datanode holding cached blocks (the one nearest the
	// readers when every datanode caches the whole set): time until it
	// serves a read from its cache again, against the time warming took.
	ri := 0
	for i := range 3 {
		if c.Datanode(i).CacheStats().Blocks > c.Datanode(ri).CacheStats().Blocks {
			ri = i
		}
	}
	before := c.Datanode(ri).CacheStats()
	// The old datanode's Close (unmapping its cache among the rest) is
	// timed apart: a crashed datanode has none. BASALT_CACHE_BENCH_PROFILE
	// writes a CPU profile of the restart.
	sstart := time.Now()
	c.StopDatanode(ri)
	stopped := time.Since(sstart)
	if p := os.Getenv("BASALT_CACHE_BENCH_PROFILE"); p != "" {
		if f, err := os.Create(p); err == nil {
			pprof.StartCPUProfile(f)
			defer func() { pprof.StopCPUProfile(); f.Close() }()
		}
	}
	rstart := time.Now()
	rctx, rcancel := context.WithTimeout(ctx, 60*time.Second)
	if err := c.RestartDatanode(rctx, ri); err != nil {
		t.Fatal(err)
	}
	rcancel()
	restart := time.Since(rstart)
	after := c.Datanode(ri).CacheStats()
	// A fresh client (the old one excluded the datanode while it was down)
	// reads until the restarted datanode answers from its cache.
	cl3 := newClient(t, c, "/dc1/rack1")
	first := time.Duration(0)
	buf := make([]byte, 1<<20)
	for i := 0; time.Since(rstart) < time.Minute; i++ {
		r, err := cl3.GetKey(ctx, "vol", "bkt", hot[i%len(hot)])
		if err == nil {
			r.ReadAt(buf, 0)
			r.Close()
		}
		if c.Datanode(ri).CacheStats().Hits > 0 {
			first = time.Since(rstart)
			break
		}
	}
	t.Logf("restart of datanode %d with %d cached blocks (%d MiB): stopping it took %v; then Start returned after %v with %d blocks recovered, %d copied; first read served from its cache %v after the start began (warming took %v)",
		ri+1, before.Blocks, before.Used>>20, stopped.Round(time.Millisecond), restart.Round(time.Millisecond), after.Recovered, after.Copied, first.Round(time.Millisecond), warm.Round(time.Millisecond))
}

func fmtF(x []float64) string {
	out := ""
	for i, v := range x {
		if i > 0 {
			out += " "
		}
		out += fmt.Sprintf("%.0f", v)
	}
	return out
}
