package meta

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime/pprof"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
)

// The benchmarks run only with META_BENCH=1 (see docs/BENCHMARKS.md). The
// load comes from a child process (this test binary re-run with
// META_BENCH_CLIENT set) so client CPU is not counted as server CPU.

func TestMain(m *testing.M) {
	if os.Getenv("META_BENCH_CLIENT") != "" {
		benchClient()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type benchResult struct {
	Ops   int64
	Secs  float64
	P50us float64
	P99us float64
	Errs  int64
}

func envInt(k string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(k)); err == nil {
		return v
	}
	return def
}

func benchClient() {
	addrs := []string{}
	json.Unmarshal([]byte(os.Getenv("META_BENCH_CLIENT")), &addrs)
	mode := os.Getenv("META_BENCH_MODE")
	conc := envInt("META_BENCH_CONC", 64)
	keys := envInt("META_BENCH_KEYS", 1000000)
	if hot := envInt("META_BENCH_HOT", 0); hot > 0 {
		keys = hot // see TestBenchLookups
	}
	dur := time.Duration(envInt("META_BENCH_SECS", 10)) * time.Second
	batch := envInt("META_BENCH_BATCH", 16)
	creds, err := pki.Load(os.Getenv("META_BENCH_TLS"))
	if err != nil {
		panic(err)
	}
	// META_BENCH_INFLIGHT: the coalescer's LookupsInFlight (default metaclient.DefaultLookupsInFlight).
	cl, err := metaclient.New(metaclient.Config{Addrs: addrs, ConnsPerAddr: 4, DialOptions: []grpc.DialOption{creds.GRPCDialOption(pki.RoleMeta)},
		LookupsInFlight: envInt("META_BENCH_INFLIGHT", 0)})
	if err != nil {
		panic(err)
	}
	defer cl.Close()
	var ops, errs atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	deadline := time.Now().Add(dur)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			var mine []time.Duration
			ctx := context.Background()
			for i := 0; time.Now().Before(deadline); i++ {
				t0 := time.Now()
				var err error
				n := 1
				switch mode {
				case "lookup": // one LookupKey call per lookup
					_, err = cl.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: benchKey(rng.IntN(keys)), ClientLocation: "/dc1/rack0"})
				case "coalesced": // metaclient.Lookup: concurrent callers share LookupKeys calls
					_, err = cl.Lookup(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: benchKey(rng.IntN(keys)), ClientLocation: "/dc1/rack0"})
				case "batch": // each caller sends LookupKeys of META_BENCH_BATCH keys
					req := &metapb.LookupKeysRequest{}
					for range batch {
						req.Requests = append(req.Requests, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: benchKey(rng.IntN(keys)), ClientLocation: "/dc1/rack0"})
					}
					var r *metapb.LookupKeysResponse
					if r, err = cl.Namespace.LookupKeys(ctx, req); err == nil {
						for _, x := range r.Results {
							if x.Code != 0 {
								err = fmt.Errorf("LookupKeys: %s", x.Message)
							}
						}
					}
					n = batch
				default:
					var o *metapb.OpenKeyResponse
					o, err = cl.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: fmt.Sprintf("new/%d/%d", w, i)})
					if err == nil {
						_, err = cl.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 4096}}})
					}
				}
				if err != nil {
					if errs.Add(1) == 1 {
						fmt.Fprintln(os.Stderr, "bench client: first error:", err)
					}
					continue
				}
				mine = append(mine, time.Since(t0))
				ops.Add(int64(n))
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	r := benchResult{Ops: ops.Load(), Secs: time.Since(start).Seconds(), Errs: errs.Load()}
	if len(lat) > 0 {
		r.P50us = float64(lat[len(lat)/2].Microseconds())
		r.P99us = float64(lat[len(lat)*99/100].Microseconds())
	}
	json.NewEncoder(os.Stdout).Encode(r)
}

func benchKey(i int) string { return fmt.Sprintf("data/part-%03d/key-%08d", i%1000, i) }

func cpuSelf() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func runChild(t *testing.T, addrs []string, mode string) benchResult {
	a, _ := json.Marshal(addrs)
	// The child is another process: it gets a client certificate of this
	// process's test CA in a directory.
	tlsDir := t.TempDir()
	if err := testCreds(pki.RoleClient, "bench").Save(tlsDir); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "META_BENCH_CLIENT="+string(a), "META_BENCH_MODE="+mode, "META_BENCH_TLS="+tlsDir)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("bench client: %v", err)
	}
	var r benchResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("bench client output %q: %v", out, err)
	}
	return r
}

func report(t *testing.T, name string, r benchResult, cpu time.Duration) {
	t.Logf("%s: %d ops in %.1fs = %.0f ops/s, p50 %.0fµs, p99 %.0fµs, errors %d, server CPU %.1fµs/op",
		name, r.Ops, r.Secs, float64(r.Ops)/r.Secs, r.P50us, r.P99us, r.Errs, float64(cpu.Microseconds())/float64(max(r.Ops, 1)))
}

func TestBenchLookups(t *testing.T) {
	if os.Getenv("META_BENCH") == "" {
		t.Skip("set META_BENCH=1")
	}
	nkeys := envInt("META_BENCH_KEYS", 1000000)
	// META_BENCH_LOOKUP_CACHE: Config.LookupCacheBytes (0: the default).
	c := newClusterWith(t, 1, scm.Config{LoopInterval: 50 * time.Millisecond}, func(cfg *Config) {
		cfg.LookupCacheBytes = int64(envInt("META_BENCH_LOOKUP_CACHE", 0))
	})
	cl := c.client()
	ctx := context.Background()
	registerDatanodes(t, cl, 3)
	cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	b, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "containers", func() bool { return len(c.servers[1].scmState.Containers()) > 0 })
	cont := c.servers[1].scmState.Containers()[0].Id
	c.servers[1].Close()
	// Load the keys into the stopped node's store, then restart it.
	s := c.newServer(1)
	load := time.Now()
	for base := 0; base < nkeys; base += 50000 {
		var batch []*metapb.KeyInfo
		for i := base; i < min(base+50000, nkeys); i++ {
			batch = append(batch, &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: benchKey(i), Size: 4096, Replication: metapb.Replication_THREE,
				ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 65536,
				Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: cont, LocalId: uint64(i + 1)}, Length: 4096}}})
		}
		if err := s.nsState.BulkLoadObjectKeys(b.Id, batch); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("loaded %d keys in %v", nkeys, time.Since(load))
	// META_BENCH_HOT=N: the callers look up only the first N keys (a
	// working set), each read once here first (warm caches).
	if hot := envInt("META_BENCH_HOT", 0); hot > 0 {
		for i := range hot {
			if _, err := s.nsState.LookupKey("vol", "bkt", benchKey(i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// META_BENCH_WARM=1: every key is read once before the measured
	// phase (the steady state of a long-running node; without it a 10 s
	// run of uniform lookups over 1M keys reads each key ~0.5 times and
	// mostly measures a cache filling).
	if os.Getenv("META_BENCH_WARM") != "" {
		warm := time.Now()
		for i := range nkeys {
			if _, err := s.nsState.LookupKey("vol", "bkt", benchKey(i)); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("read %d keys in %v; lookup cache: %+v", nkeys, time.Since(warm), s.nsState.LookupCacheStats())
	}
	c.servers[1] = s
	c.wire()
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "leader", func() bool { return s.nsGroup.IsLeader() })
	// META_BENCH_LOOKUP: lookup (LookupKey per lookup, the default),
	// coalesced (metaclient.Lookup) or batch (LookupKeys of
	// META_BENCH_BATCH keys; ops count keys, latency is per call).
	mode := cmp.Or(os.Getenv("META_BENCH_LOOKUP"), "lookup")
	b0 := s.nsGroup.ReadBarriers()
	if p := os.Getenv("META_BENCH_PROFILE"); p != "" { // the measured phase only
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	cpu0 := cpuSelf()
	r := runChild(t, c.addrs(), mode)
	report(t, mode+" (1 node, 64 callers)", r, cpuSelf()-cpu0)
	t.Logf("read barriers: %d (%.1f lookups each)", s.nsGroup.ReadBarriers()-b0, float64(r.Ops)/float64(max(s.nsGroup.ReadBarriers()-b0, 1)))
	t.Logf("lookup cache: %+v", s.nsState.LookupCacheStats())
}

func TestBenchCreates(t *testing.T) {
	if os.Getenv("META_BENCH") == "" {
		t.Skip("set META_BENCH=1")
	}
	c := newCluster(t, 3, scm.Config{LoopInterval: 50 * time.Millisecond})
	cl := c.client()
	ctx := context.Background()
	registerDatanodes(t, cl, 3)
	cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "containers", func() bool {
		r, err := cl.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) > 0
	})
	// Keep the datanodes alive: a new SCM leader (leadership moves to the
	// namespace leader) needs heartbeats to leave safe mode.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
			for id := uint64(1); id <= 3; id++ {
				dnScm(t, cl, id).Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: id})
			}
		}
	}()
	cpu0 := cpuSelf()
	r := runChild(t, c.addrs(), "create")
	report(t, "create = OpenKey+CommitKey (3 nodes in one process, 64 callers)", r, cpuSelf()-cpu0)
}
