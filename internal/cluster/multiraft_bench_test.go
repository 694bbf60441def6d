package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/vfs"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
)

// The multi-raft benchmark (seed 001; docs/BENCHMARKS.md, "Multi-raft on
// slow log disks"). Off by default; `make bench-multiraft` runs
//
//	BASALT_BENCH_MULTIRAFT=1 go test -run TestBenchMultiRaft -v -timeout 30m ./internal/cluster/
//
// Every datanode has MR_DISKS (12) modelled disks (vfs.LatencyFS): disk j
// holds Raft log directory j and data volume j; a disk flushes one flush at
// a time (syncs queued behind a running flush share the next; MR_NO_MERGE=1:
// each its own), each costing a few ms (an HDD) plus the bytes written
// since the previous flush at the disk's bandwidth; one disk per datanode (chosen
// at random) is much slower and stalls periodically. A mixed workload of
// many 4–64 KiB objects and a few multi-MiB ones runs for MR_DURATION
// against 1 pipeline per datanode and against MR_MANY; the table gives the
// share of writes under 200 ms.
func TestBenchMultiRaft(t *testing.T) {
	if os.Getenv("BASALT_BENCH_MULTIRAFT") == "" {
		t.Skip("set BASALT_BENCH_MULTIRAFT=1 to run the multi-raft benchmark")
	}
	p := mrParams{
		datanodes: envInt("MR_DATANODES", 6), disks: envInt("MR_DISKS", 12),
		duration: envDur("MR_DURATION", 30*time.Second), warmup: envDur("MR_WARMUP", 3*time.Second),
		small: envCount("MR_SMALL_WRITERS", 16), smallThink: envDur("MR_SMALL_THINK", 50*time.Millisecond),
		large: envCount("MR_LARGE_WRITERS", 2), largeMiB: envInt("MR_LARGE_MIB", 8), largeThink: envDur("MR_LARGE_THINK", time.Second),
		hdd: vfs.DiskProfile{
			SyncLatency: envDur("MR_SYNC", 4*time.Millisecond), SyncJitter: envDur("MR_JITTER", 4*time.Millisecond),
			WriteBytesPerSec: int64(envInt("MR_DISK_MBPS", 150)) * 1e6, Capacity: 4 << 40,
			NoFlushMerge: os.Getenv("MR_NO_MERGE") != "",
		},
		slowFactor: envInt("MR_SLOW_FACTOR", 10),
		stallEvery: envDur("MR_STALL_EVERY", 5*time.Second), stallFor: envDur("MR_STALL_FOR", 400*time.Millisecond),
	}
	// The client's retry messages would bury the table (the run counts
	// failed writes).
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})))
	runs := envInt("MR_RUNS", 1)
	many := envInt("MR_MANY", 9)
	seed := uint64(envInt("MR_SEED", 1))
	t.Logf("%d datanodes × %d disks (HDD: %v + [0,%v) per sync, %d MB/s; 1 slow disk per datanode: %d× latency, 1/%d bandwidth, stalls %v every %v); %d small writers (4–64 KiB, think %v), %d large writers (%d MiB, think %v); %v per config after %v warm-up",
		p.datanodes, p.disks, p.hdd.SyncLatency, p.hdd.SyncJitter, p.hdd.WriteBytesPerSec/1e6, p.slowFactor, p.slowFactor, p.stallFor, p.stallEvery,
		p.small, p.smallThink, p.large, p.largeMiB, p.largeThink, p.duration, p.warmup)
	limits := []int{1, many}
	if v := os.Getenv("MR_CONFIGS"); v != "" {
		limits = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < 1 {
				t.Fatalf("MR_CONFIGS %q: want pipelines per datanode, comma-separated", v)
			}
			limits = append(limits, n)
		}
	}
	// MR_AVOID: slow-disk avoidance off (0, the code before it) and/or on
	// (1), alternating within each run (default 1).
	avoids := []bool{true}
	if v := os.Getenv("MR_AVOID"); v != "" {
		avoids = nil
		for _, f := range strings.Split(v, ",") {
			avoids = append(avoids, f == "1")
		}
	}
	p.closeEvery = envDur("MR_CLOSE_EVERY", 10*time.Second)
	var results []mrResult
	for run := range runs {
		for _, limit := range limits {
			for _, avoid := range avoids {
				r := runMultiRaft(t, p, limit, avoid, seed+uint64(run))
				r.run = run + 1
				results = append(results, r)
				t.Logf("run %d, %s: %s", run+1, r.config(), r.row())
				for _, l := range r.disks {
					t.Logf("    %s", l)
				}
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n| config | run | pipelines | writes | p50 | p90 | p99 | max | < 200 ms | < 200 ms, off slow log dirs | writes via a slow log dir |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		fmt.Fprintf(&b, "| %s | %d | %s |\n", r.config(), r.run, r.row())
	}
	if runs > 1 {
		for _, limit := range limits {
			for _, avoid := range avoids {
				var share []float64
				var cfg string
				for _, r := range results {
					if r.limit == limit && r.avoid == avoid {
						share = append(share, r.under)
						cfg = r.config()
					}
				}
				sort.Float64s(share)
				fmt.Fprintf(&b, "| %s | median of %d | | | | | | | %.1f%% | | |\n", cfg, runs, 100*share[len(share)/2])
			}
		}
	}
	t.Log(b.String())
}

type mrParams struct {
	datanodes, disks       int
	duration, warmup       time.Duration
	small, large, largeMiB int
	smallThink, largeThink time.Duration
	hdd                    vfs.DiskProfile
	slowFactor             int
	stallEvery, stallFor   time.Duration
	closeEvery             time.Duration // SCM's SlowDisk.CloseInterval with avoidance
}

type mrWrite struct {
	lat        time.Duration
	size       int
	containers []uint64
}

type mrResult struct {
	limit, run, pipelines int
	avoid                 bool
	writes                []mrWrite
	lats                  []time.Duration
	under, underOff       float64
	viaSlow               float64
	disks                 []string
}

func (r mrResult) config() string {
	if r.avoid {
		return fmt.Sprintf("%d/datanode, avoid slow disks", r.limit)
	}
	return fmt.Sprintf("%d/datanode", r.limit)
}

func (r mrResult) row() string {
	q := func(f float64) time.Duration {
		if len(r.lats) == 0 {
			return 0
		}
		return r.lats[min(len(r.lats)-1, int(f*float64(len(r.lats))))].Round(time.Millisecond)
	}
	return fmt.Sprintf("%d | %d | %v | %v | %v | %v | %.1f%% | %.1f%% | %.1f%%", r.pipelines, len(r.lats), q(0.5), q(0.9), q(0.99),
		q(1), 100*r.under, 100*r.underOff, 100*r.viaSlow)
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// envCount is envInt that takes 0 as well.
func envCount(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v >= 0 {
		return v
	}
	return def
}

func envDur(name string, def time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func runMultiRaft(t *testing.T, p mrParams, limit int, avoid bool, seed uint64) mrResult {
	// Removed after each config, not at the end of the test: the log
	// stores' preallocated WALs alone take GBs per cluster.
	dir, err := os.MkdirTemp("", "basalt-multiraft-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	rng := rand.New(rand.NewPCG(seed, 0))
	// Each datanode's disks; one of them, at random, is the slow one.
	fss := make([]*vfs.LatencyFS, p.datanodes)
	slowRoot := make([]string, p.datanodes)
	for i := range p.datanodes {
		slow := rng.IntN(p.disks)
		disks := map[string]vfs.DiskProfile{}
		for j := range p.disks {
			root := filepath.Join(dir, fmt.Sprintf("dn%d", i+1), fmt.Sprintf("disk%02d", j))
			prof := p.hdd
			if j == slow {
				slowRoot[i] = root
				prof.SyncLatency *= time.Duration(p.slowFactor)
				prof.SyncJitter *= time.Duration(p.slowFactor)
				prof.WriteBytesPerSec /= int64(p.slowFactor)
				prof.StallEvery, prof.StallFor = p.stallEvery, p.stallFor
			}
			disks[root] = prof
		}
		fss[i] = vfs.NewLatencyFS(vfs.Default, disks, seed*1000+uint64(i))
		// The model is the disk: the host's own fsyncs would add its
		// latency (and its noise) to every modelled sync.
		fss[i].NoRealSync = true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	scmSlow := scm.SlowDiskConfig{CloseInterval: -1}
	if avoid {
		scmSlow = scm.SlowDiskConfig{CloseInterval: p.closeEvery}
	}
	reg := prometheus.NewRegistry()
	dnRegs := make([]*prometheus.Registry, p.datanodes)
	for i := range dnRegs {
		dnRegs[i] = prometheus.NewRegistry()
	}
	c, err := cluster.Start(ctx, cluster.Config{
		Dir: dir, Datanodes: p.datanodes, PipelineLimit: limit,
		Registerer: reg,
		Logger:     slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
		// A slower tick than the default keeps elections quiet on a
		// loaded machine; it does not enter a write's latency.
		HeartbeatInterval: time.Second, TickInterval: 200 * time.Millisecond,
		SlowDisk: scmSlow,
		DatanodeConfig: func(i int, dc *datanode.Config) {
			dc.FS = fss[i]
			dc.SlowDisk.Disabled = !avoid
			// Its own registry: the datanodes' Raft metrics have other
			// labels than meta's, which one registry refuses.
			dc.Registerer = dnRegs[i]
			dc.LogDirs, dc.Volumes = nil, nil
			for _, d := range fss[i].Disks() {
				dc.LogDirs = append(dc.LogDirs, filepath.Join(d.Root, "raft"))
				dc.Volumes = append(dc.Volumes, filepath.Join(d.Root, "data"))
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// SCM places up to limit·N/3 pipelines of three, fewer if the racks
	// or the distinct sets of three do not allow them.
	pipes := waitPipelines(t, c, limit*p.datanodes/3, 90*time.Second)
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 30 * time.Second, WaitAllTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	makeBucket(t, cl, "vol", "bkt")

	// Which pipelines have a log on a slow disk (on any member).
	slowPipe := map[uint64]bool{}
	for _, pid := range pipes {
		for i := range p.datanodes {
			if ld := c.Datanode(i).PipelineLogDir(pid); ld != "" && strings.HasPrefix(ld, slowRoot[i]+string(filepath.Separator)) {
				slowPipe[pid] = true
			}
		}
	}

	data := randData(int64(seed), max(64<<10, p.largeMiB<<20))
	var mu sync.Mutex
	var writes []mrWrite
	var errs int
	start, cpu0 := time.Now(), cpuTime()
	measureFrom, end := start.Add(p.warmup), start.Add(p.warmup+p.duration)
	var wg sync.WaitGroup
	writer := func(id int, large bool) {
		defer wg.Done()
		r := rand.New(rand.NewPCG(seed, uint64(id)+1))
		for n := 0; time.Now().Before(end); n++ {
			size := p.largeMiB << 20
			think := p.largeThink
			if !large {
				size = 4<<10 + r.IntN(61<<10)
				think = p.smallThink
			}
			off := r.IntN(len(data) - size + 1)
			t0 := time.Now()
			ki, err := cl.PutKey(ctx, "vol", "bkt", fmt.Sprintf("w%d/%d", id, n), bytes.NewReader(data[off:off+size]), client.PutOptions{SizeHint: int64(size)})
			lat := time.Since(t0)
			if t0.After(measureFrom) && t0.Before(end) {
				mu.Lock()
				if err != nil {
					errs++
				} else {
					w := mrWrite{lat: lat, size: size}
					for _, b := range ki.Blocks {
						w.containers = append(w.containers, b.ContainerID)
					}
					writes = append(writes, w)
				}
				mu.Unlock()
			}
			if err != nil {
				t.Logf("writer %d: %v", id, err)
				time.Sleep(100 * time.Millisecond)
			}
			time.Sleep(time.Duration(r.Int64N(int64(2 * think))))
		}
	}
	for i := range p.small {
		wg.Add(1)
		go writer(i, false)
	}
	for i := range p.large {
		wg.Add(1)
		go writer(p.small+i, true)
	}
	wg.Wait()
	cpu, wall := cpuTime()-cpu0, time.Since(start)
	if errs > 0 {
		t.Logf("%d writes failed", errs)
	}

	pipeOf := containerPipelines(t, c)
	res := mrResult{limit: limit, avoid: avoid, pipelines: len(pipes), writes: writes}
	var under, off, offUnder, via, unknown int
	for _, w := range writes {
		if slices.ContainsFunc(w.containers, func(id uint64) bool { return !slices.Contains(pipes, pipeOf[id]) }) {
			unknown++ // a pipeline created during the run
		}
		res.lats = append(res.lats, w.lat)
		slow := slices.ContainsFunc(w.containers, func(id uint64) bool { return slowPipe[pipeOf[id]] })
		if slow {
			via++
		}
		if w.lat < 200*time.Millisecond {
			under++
		}
		if !slow {
			off++
			if w.lat < 200*time.Millisecond {
				offUnder++
			}
		}
	}
	slices.Sort(res.lats)
	if n := len(writes); n > 0 {
		res.under, res.viaSlow = float64(under)/float64(n), float64(via)/float64(n)
	}
	if off > 0 {
		res.underOff = float64(offUnder) / float64(off)
	}
	// Per disk: the busiest and the slow ones, with the groups logged there.
	groups := map[string][]uint64{}
	for _, pid := range pipes {
		for i := range p.datanodes {
			if ld := c.Datanode(i).PipelineLogDir(pid); ld != "" {
				groups[filepath.Dir(ld)] = append(groups[filepath.Dir(ld)], pid)
			}
		}
	}
	type ds struct {
		vfs.DiskStats
		slow bool
	}
	var all []ds
	for i, fs := range fss {
		for _, d := range fs.Disks() {
			all = append(all, ds{d.Stats(), d.Root == slowRoot[i]})
		}
	}
	sort.Slice(all, func(i, j int) bool { return all[i].Wait+all[i].Busy > all[j].Wait+all[j].Busy })
	var syncs, flushes int64
	var busy time.Duration
	shown := 0
	for _, d := range all {
		syncs += d.Syncs
		flushes += d.Flushes
		if !d.slow {
			busy += d.Busy
		}
	}
	res.disks = append(res.disks, fmt.Sprintf("all disks: %d syncs (%.1f per write) in %d flushes; normal disks busy %.0f%% on average",
		syncs, float64(syncs)/float64(max(1, len(writes))), flushes, 100*busy.Seconds()/wall.Seconds()/float64(len(all)-len(fss))))
	for _, d := range all {
		if !d.slow {
			if shown >= 4 {
				continue
			}
			shown++
		}
		rel, _ := filepath.Rel(dir, d.Root)
		mark := ""
		if d.slow {
			mark = " (slow)"
		}
		res.disks = append(res.disks, fmt.Sprintf("%s%s: pipelines %v, %d syncs in %d flushes, busy %v, queued %v, max %v, %d stalled, %d MiB written",
			rel, mark, groups[d.Root], d.Syncs, d.Flushes, d.Busy.Round(time.Millisecond), d.Wait.Round(time.Millisecond), d.Max.Round(time.Millisecond), d.Stalled, d.Written>>20))
	}
	var sl []uint64
	for id := range slowPipe {
		sl = append(sl, id)
	}
	slices.Sort(sl)
	res.disks = append(res.disks, stages(t, append([]*prometheus.Registry{reg}, dnRegs...))...)
	// What the datanodes marked slow (the modelled slow disk is right), and
	// the pipelines SCM closed for a slow disk.
	var marked []string
	for i := range p.datanodes {
		for _, s := range c.Datanode(i).SlowDisks() {
			ok := "wrong disk"
			if strings.HasPrefix(s.Path, slowRoot[i]+string(filepath.Separator)) {
				ok = "the slow one"
			}
			rel, _ := filepath.Rel(dir, s.Path)
			marked = append(marked, fmt.Sprintf("%s %s (%s, median %v, peers %v)", s.Kind, rel, ok,
				time.Duration(s.MedianFlushUs)*time.Microsecond, time.Duration(s.PeersMedianUs)*time.Microsecond))
		}
	}
	var closedSlow int
	for _, pl := range listPipelines(t, c) {
		if strings.Contains(pl.GetCloseReason(), "slow disk") {
			closedSlow++
		}
	}
	res.disks = append(res.disks, fmt.Sprintf("marked slow at the end: %v; pipelines closed for a slow disk: %d", marked, closedSlow))
	load, _ := os.ReadFile("/proc/loadavg")
	res.disks = append(res.disks, fmt.Sprintf("pipelines %v; with a log on a slow disk: %v; %d writes on pipelines created later; %d writes failed; process CPU %.2f cores; loadavg %s",
		pipes, sl, unknown, errs, cpu.Seconds()/wall.Seconds(), strings.TrimSpace(string(load))))
	return res
}

func listPipelines(t *testing.T, c *cluster.Cluster) []*metapb.Pipeline {
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := mc.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return r.GetPipelines()
}

// containerPipelines maps every container to its pipeline.
func containerPipelines(t *testing.T, c *cluster.Cluster) map[uint64]uint64 {
	t.Helper()
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	out := map[uint64]uint64{}
	var after uint64
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := mc.Scm.ListContainers(ctx, &metapb.ListContainersRequest{StartAfter: after, PageSize: 1000})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		for _, ct := range r.GetContainers() {
			out[ct.GetId()] = ct.GetPipelineId()
			after = ct.GetId()
		}
		if !r.GetTruncated() || len(r.GetContainers()) == 0 {
			return out
		}
	}
}

// waitPipelines waits until SCM has created want pipelines of three (or
// stopped creating them: the count unchanged for 15 s) and each open one
// has a leader; it returns their IDs.
func waitPipelines(t *testing.T, c *cluster.Cluster, want int, bound time.Duration) []uint64 {
	t.Helper()
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	deadline := time.Now().Add(bound)
	var last []uint64
	stable := time.Now()
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		pl, err := mc.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
		cancel()
		if err == nil {
			var ids []uint64
			led := true
			for _, p := range pl.GetPipelines() {
				if p.GetState() != metapb.PipelineState_PIPELINE_OPEN || len(p.GetDatanodes()) != 3 {
					continue
				}
				ids = append(ids, p.GetId())
				has := false
				for i := range c.Datanodes {
					if dn := c.Datanode(i); dn != nil && dn.IsPipelineLeader(p.GetId()) {
						has = true
					}
				}
				led = led && has
			}
			slices.Sort(ids)
			if !slices.Equal(ids, last) || !led {
				last, stable = ids, time.Now()
			} else if len(ids) >= want || (len(ids) > 0 && time.Since(stable) > 15*time.Second) {
				if len(ids) < want {
					t.Logf("%d pipelines of three, not %d", len(ids), want)
				}
				return ids
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("pipelines not settled in %v: %v", bound, last)
	return nil
}

// stages summarizes the per-stage latency histograms of the run: the
// metadata service's calls by method, and on the datanodes the Raft
// commit latency (propose to applied on the leader), the log-store batch
// commit (fsync) and the store-loop iteration (WriteData, storage sync,
// log persist), each over all hosts.
func stages(t *testing.T, regs []*prometheus.Registry) []string {
	var mfs []*dto.MetricFamily
	for _, reg := range regs {
		m, err := reg.Gather()
		if err != nil {
			t.Logf("gather: %v", err)
			return nil
		}
		mfs = append(mfs, m...)
	}
	type agg struct {
		n      uint64
		sum    float64
		bounds []float64
		counts []uint64
	}
	by := map[string]*agg{}
	var names []string
	for _, mf := range mfs {
		name := mf.GetName()
		want := name == "basalt_raft_commit_latency_seconds" || name == "basalt_raft_batch_commit_seconds" ||
			name == "basalt_raft_loop_iteration_seconds" || name == "basalt_meta_rpc_duration_seconds" ||
			name == "basalt_datanode_disk_flush_seconds"
		if !want || mf.GetType() != dto.MetricType_HISTOGRAM {
			continue
		}
		for _, m := range mf.GetMetric() {
			key := strings.TrimPrefix(strings.TrimSuffix(name, "_seconds"), "basalt_")
			role := ""
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "method":
					key += " " + l.GetValue()
				case "role":
					role = l.GetValue()
				case "kind":
					key += " " + l.GetValue()
				}
			}
			if strings.HasPrefix(key, "raft_") {
				if role == "meta" {
					key = "meta " + key
				} else {
					key = "datanode " + key
				}
			}
			h := m.GetHistogram()
			a := by[key]
			if a == nil {
				a = &agg{}
				by[key] = a
				names = append(names, key)
				for _, b := range h.GetBucket() {
					a.bounds = append(a.bounds, b.GetUpperBound())
				}
				a.counts = make([]uint64, len(a.bounds))
			}
			a.n += h.GetSampleCount()
			a.sum += h.GetSampleSum()
			for i, b := range h.GetBucket() {
				if i < len(a.counts) {
					a.counts[i] += b.GetCumulativeCount()
				}
			}
		}
	}
	sort.Strings(names)
	q := func(a *agg, f float64) string {
		want := uint64(f * float64(a.n))
		for i, c := range a.counts {
			if c >= want {
				return "≤" + time.Duration(a.bounds[i]*float64(time.Second)).Round(100*time.Microsecond).String()
			}
		}
		return "+Inf"
	}
	var out []string
	for _, k := range names {
		a := by[k]
		if a.n == 0 || (strings.HasPrefix(k, "meta_rpc_duration") && a.n < 50) {
			continue
		}
		out = append(out, fmt.Sprintf("stage %s: n=%d mean %v p50 %s p99 %s", k, a.n,
			time.Duration(a.sum/float64(a.n)*float64(time.Second)).Round(100*time.Microsecond), q(a, 0.5), q(a, 0.99)))
	}
	return out
}
