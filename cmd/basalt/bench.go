package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
)

// benchCmd is the load generator (Ozone's Freon).
func benchCmd() *cobra.Command {
	f := &connFlags{}
	o := &benchOpts{}
	root := &cobra.Command{
		Use:   "bench",
		Short: "Load generator: write, read and metadata benchmarks (Ozone's Freon)",
		Long: `Load generator. Keys are named PREFIX + index (PREFIX defaults to "bench-"),
in --volume/--bucket (created if missing). Data is a pseudo-random stream
(a pre-generated buffer read at a per-key offset), so keys differ and
"read --validate" can check what "write" stored.

Examples:
  basalt bench write -n 100 --size 64MiB -t 8 --validate
  basalt bench read -n 100 --size 64MiB -t 8 --validate
  basalt bench meta --op create -n 100000 -t 32
  basalt bench meta --op lookup -n 100000 -t 32
  basalt bench write -n 16 --size 1GiB --server-pid $(pgrep -f 'basalt dev')
` + exitCodesHelp,
	}
	f.register(root)
	pf := root.PersistentFlags()
	pf.StringVar(&o.volume, "volume", "bench", "volume to use (created if missing)")
	pf.StringVar(&o.bucket, "bucket", "bench", "bucket to use (created if missing)")
	pf.StringVar(&o.prefix, "prefix", "bench-", "key name prefix")
	pf.IntVarP(&o.keys, "keys", "n", 100, "number of keys")
	pf.StringVar(&o.sizeStr, "size", "16MiB", "bytes per key (suffixes KiB, MiB, GiB, K, M, G)")
	pf.IntVarP(&o.threads, "threads", "t", 8, "concurrent operations")
	pf.BoolVar(&o.validate, "validate", false, "read every key back and compare SHA-256 digests")
	pf.StringVar(&o.pids, "server-pid", "", "PID[,PID...] of server processes whose CPU time to report")
	pf.BoolVar(&o.progress, "progress", false, "show a progress bar even when stderr is not a terminal")
	pf.StringVar(&o.replStr, "replication", "", "replication for new keys: 3 or 1 (default: the bucket's)")

	write := &cobra.Command{
		Use: "write", Short: "Write N keys of --size bytes with T threads",
		RunE: runE(func(cmd *cobra.Command, args []string) error { return o.run(cmd, f, "write", args) }),
	}
	write.Flags().StringVar(&o.pipeline, "pipeline", "auto", "write path: v1 (Raft), v2 (streaming chain) or auto (v1 below 4 MiB, else v2)")
	read := &cobra.Command{
		Use: "read", Short: "Read back the keys of a previous write run (same --prefix, -n, --size)",
		RunE: runE(func(cmd *cobra.Command, args []string) error { return o.run(cmd, f, "read", args) }),
	}
	meta := &cobra.Command{
		Use: "meta", Short: "Metadata load: create N empty keys, or look up N existing keys",
		RunE: runE(func(cmd *cobra.Command, args []string) error { return o.run(cmd, f, "meta", args) }),
	}
	meta.Flags().StringVar(&o.metaOp, "op", "create", "create (empty keys) or lookup (existing keys)")
	root.AddCommand(write, read, meta, benchS3Cmd(o, f))
	return root
}

type benchOpts struct {
	volume, bucket, prefix string
	keys, threads          int
	sizeStr, replStr       string
	size                   int64
	validate, progress     bool
	pids, pipeline, metaOp string
}

// Limits: a benchmark is a tool, not a way to exhaust memory.
const (
	maxBenchKeys    = 100_000_000
	maxBenchThreads = 1024
	patternBytes    = 64 << 20
)

func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range []struct {
		suf string
		m   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1}} {
		if strings.HasSuffix(t, u.suf) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suf)), u.m
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 || n > (1<<50)/mult {
		return 0, fmt.Errorf("size %q: want a non-negative number of bytes with an optional suffix (KiB, MiB, GiB)", s)
	}
	return n * mult, nil
}

// pattern is the data source: a random buffer generated once (ChaCha8,
// fixed seed, so runs agree); key i reads it from offset i*prime, wrapping.
type pattern struct{ buf []byte }

func newPattern() *pattern {
	var seed [32]byte
	copy(seed[:], "basalt bench data pattern v1....")
	r := rand.NewChaCha8(seed)
	b := make([]byte, patternBytes)
	_, _ = r.Read(b)
	return &pattern{buf: b}
}

func (p *pattern) reader(key int, size int64) io.Reader {
	return &patternReader{p: p.buf, off: int((int64(key) * 1_000_003) % int64(len(p.buf))), left: size}
}

type patternReader struct {
	p    []byte
	off  int
	left int64
}

func (r *patternReader) Read(b []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	n := 0
	for n < len(b) && r.left > 0 {
		c := copy(b[n:min(len(b), n+int(min(r.left, int64(len(b)))))], r.p[r.off:])
		n += c
		r.left -= int64(c)
		r.off = (r.off + c) % len(r.p)
	}
	return n, nil
}

func (p *pattern) digest(key int, size int64) [32]byte {
	h := sha256.New()
	_, _ = io.Copy(h, p.reader(key, size))
	var d [32]byte
	h.Sum(d[:0])
	return d
}

type benchResult struct {
	Phase       string  `json:"phase"`
	Pipeline    string  `json:"pipeline,omitempty"` // write: the path asked for (auto, v1, v2)
	Ops         int     `json:"ops"`
	Errors      int     `json:"errors"`
	Bytes       int64   `json:"bytes"`
	Seconds     float64 `json:"seconds"`
	MiBPerSec   float64 `json:"mib_per_sec"`
	OpsPerSec   float64 `json:"ops_per_sec"`
	P50Ms       float64 `json:"p50_ms"`
	P90Ms       float64 `json:"p90_ms"`
	P99Ms       float64 `json:"p99_ms"`
	MaxMs       float64 `json:"max_ms"`
	ServerCPUs  float64 `json:"server_cpu_seconds,omitempty"`
	CPUsPerGiB  float64 `json:"server_cpu_seconds_per_gib,omitempty"`
	FirstError  string  `json:"first_error,omitempty"`
	Validated   int     `json:"validated,omitempty"`
	Mismatching int     `json:"mismatching,omitempty"`
}

func (o *benchOpts) run(cmd *cobra.Command, f *connFlags, mode string, args []string) error {
	if err := exactArgs(args, 0, "none; use flags"); err != nil {
		return err
	}
	var err error
	if o.size, err = parseSize(o.sizeStr); err != nil {
		return usagef("--size: %v", err)
	}
	if o.keys < 1 || o.keys > maxBenchKeys {
		return usagef("-n %d: want 1..%d", o.keys, maxBenchKeys)
	}
	if o.threads < 1 || o.threads > maxBenchThreads {
		return usagef("-t %d: want 1..%d", o.threads, maxBenchThreads)
	}
	repl, err := client.ParseReplication(o.replStr)
	if err != nil {
		return usagef("--replication: %v", err)
	}
	pipeline, err := client.ParsePipeline(o.pipeline)
	if err != nil {
		return usagef("--pipeline %q: want v1, v2 or auto", o.pipeline)
	}
	if mode == "meta" && o.metaOp != "create" && o.metaOp != "lookup" {
		return usagef("--op %q: want create or lookup", o.metaOp)
	}
	pids, err := parsePIDs(o.pids)
	if err != nil {
		return usagef("--server-pid: %v", err)
	}
	c, err := f.client(nil)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx := cmd.Context()
	if ctx == nil {
		ctx = context.Background()
	}
	if mode != "read" && !(mode == "meta" && o.metaOp == "lookup") {
		if err := ensureBucket(ctx, c, o.volume, o.bucket); err != nil {
			return err
		}
	}
	var pat *pattern
	if mode != "meta" {
		pat = newPattern()
	}
	showBar := o.progress || isTerminal(os.Stderr)
	key := func(i int) string { return fmt.Sprintf("%s%08d", o.prefix, i) }

	var results []benchResult
	cpu0, err := cpuSeconds(pids)
	if err != nil {
		return err
	}
	var op func(i int) (int64, error)
	label, unit, total := mode, "bytes", int64(o.keys)*o.size
	switch mode {
	case "write":
		op = func(i int) (int64, error) {
			ki, err := c.PutKey(ctx, o.volume, o.bucket, key(i), pat.reader(i, o.size), client.PutOptions{SizeHint: o.size, Replication: repl, Pipeline: pipeline})
			return int64(ki.Size), err
		}
	case "read":
		op = func(i int) (int64, error) { return readKey(ctx, c, o.volume, o.bucket, key(i), nil) }
	case "meta":
		label, unit, total = "meta "+o.metaOp, "ops", int64(o.keys)
		if o.metaOp == "create" {
			op = func(i int) (int64, error) {
				_, err := c.PutKey(ctx, o.volume, o.bucket, key(i), bytes.NewReader(nil), client.PutOptions{Replication: repl, Pipeline: pipeline})
				return 0, err
			}
		} else {
			op = func(i int) (int64, error) {
				_, err := c.StatKey(ctx, o.volume, o.bucket, key(i))
				return 0, err
			}
		}
	}
	res := runPhase(label, o.keys, o.threads, newProgress(showBar, label, total, unit), unit == "ops", op)
	if len(pids) > 0 {
		cpu1, err := cpuSeconds(pids)
		if err == nil {
			res.ServerCPUs = cpu1 - cpu0
			if mode == "write" && res.Bytes > 0 {
				res.CPUsPerGiB = res.ServerCPUs / (float64(res.Bytes) / (1 << 30))
			}
		} else {
			fmt.Fprintln(os.Stderr, "basalt: server CPU:", err)
		}
	}
	if mode == "write" {
		res.Pipeline = pipeline.String()
		if pipeline == client.PipelineDefault {
			res.Pipeline = client.PipelineAuto.String()
		}
	}
	results = append(results, res)
	if o.validate && mode != "meta" {
		results = append(results, o.validateAll(ctx, c, pat, key, showBar))
	}
	if f.json {
		if err := printJSON(cmd.OutOrStdout(), results); err != nil {
			return err
		}
	} else {
		t := newTable(cmd.OutOrStdout(), "PHASE", "OPS", "ERRORS", "BYTES", "SECONDS", "MiB/s", "OPS/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "SERVER CPU-s", "CPU-s/GiB")
		for _, r := range results {
			cpu, per := "-", "-"
			if r.ServerCPUs > 0 {
				cpu = fmt.Sprintf("%.2f", r.ServerCPUs)
			}
			if r.CPUsPerGiB > 0 {
				per = fmt.Sprintf("%.2f", r.CPUsPerGiB)
			}
			t.row(r.Phase, r.Ops, r.Errors, fmtBytes(uint64(r.Bytes)), fmt.Sprintf("%.2f", r.Seconds), fmt.Sprintf("%.1f", r.MiBPerSec), fmt.Sprintf("%.1f", r.OpsPerSec),
				fmt.Sprintf("%.2f", r.P50Ms), fmt.Sprintf("%.2f", r.P90Ms), fmt.Sprintf("%.2f", r.P99Ms), fmt.Sprintf("%.2f", r.MaxMs), cpu, per)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	for _, r := range results {
		if r.Errors > 0 || r.Mismatching > 0 {
			return fmt.Errorf("bench %s: %d errors, %d mismatching keys (first error: %s)", r.Phase, r.Errors, r.Mismatching, dash(r.FirstError))
		}
	}
	return nil
}

func (o *benchOpts) validateAll(ctx context.Context, c *client.Client, pat *pattern, key func(int) string, bar bool) benchResult {
	var mismatching atomic.Int64
	res := runPhase("validate", o.keys, o.threads, newProgress(bar, "validate", int64(o.keys)*o.size, "bytes"), false, func(i int) (int64, error) {
		h := sha256.New()
		n, err := readKey(ctx, c, o.volume, o.bucket, key(i), h)
		if err != nil {
			return n, err
		}
		var got [32]byte
		h.Sum(got[:0])
		if n != o.size || got != pat.digest(i, o.size) {
			mismatching.Add(1)
			return n, fmt.Errorf("key %s: %d bytes, SHA-256 %x differs from what bench writes (%d bytes)", key(i), n, got[:8], o.size)
		}
		return n, nil
	})
	res.Mismatching = int(mismatching.Load())
	res.Validated = res.Ops - res.Errors
	return res
}

// readKey reads a whole key into w (discarded if nil).
func readKey(ctx context.Context, c *client.Client, vol, bucket, key string, w io.Writer) (int64, error) {
	r, err := c.GetKey(ctx, vol, bucket, key)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	if w == nil {
		w = io.Discard
	}
	return r.WriteTo(w)
}

// runPhase runs op for 0..n-1 on threads goroutines and measures it.
func runPhase(name string, n, threads int, bar *progress, countOps bool, op func(i int) (int64, error)) benchResult {
	lat := make([]time.Duration, n)
	var next atomic.Int64
	var bytesDone atomic.Int64
	var errCount atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for range min(threads, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				t0 := time.Now()
				b, err := op(i)
				lat[i] = time.Since(t0)
				bytesDone.Add(b)
				if err != nil {
					errCount.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
				if countOps {
					bar.add(1)
				} else {
					bar.add(b)
				}
			}
		}()
	}
	wg.Wait()
	bar.finish()
	el := time.Since(start).Seconds()
	slices.Sort(lat)
	pct := func(p float64) float64 { return percentileMs(lat, p) }
	r := benchResult{Phase: name, Ops: n, Errors: int(errCount.Load()), Bytes: bytesDone.Load(), Seconds: el,
		P50Ms: pct(0.50), P90Ms: pct(0.90), P99Ms: pct(0.99), MaxMs: float64(lat[len(lat)-1]) / 1e6}
	if el > 0 {
		r.MiBPerSec = float64(r.Bytes) / (1 << 20) / el
		r.OpsPerSec = float64(n) / el
	}
	if e, ok := firstErr.Load().(string); ok {
		r.FirstError = e
	}
	return r
}

// percentileMs is the p-quantile of sorted latencies in milliseconds (0
// for none).
func percentileMs(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]) / 1e6
}

// ensureBucket creates what is missing; what exists is used as it is (a
// user who is not an admin may not create a volume, even an existing one).
func ensureBucket(ctx context.Context, c *client.Client, vol, bucket string) error {
	if _, err := c.BucketInfo(ctx, vol, bucket); err == nil {
		return nil
	}
	if _, err := c.VolumeInfo(ctx, vol); err != nil {
		if _, err := c.CreateVolume(ctx, vol, ""); err != nil && !errors.Is(err, client.ErrExists) {
			return err
		}
	}
	if _, err := c.CreateBucket(ctx, vol, bucket, client.BucketOptions{}); err != nil && !errors.Is(err, client.ErrExists) {
		return err
	}
	return nil
}

func parsePIDs(s string) ([]int, error) {
	var out []int
	for p := range strings.SplitSeq(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("PID %q is not a positive integer", p)
		}
		out = append(out, n)
	}
	return out, nil
}

// clockTicks is USER_HZ, 100 on every Linux architecture Go supports.
const clockTicks = 100

// cpuSeconds sums user+system CPU time of the processes (fields 14 and 15
// of /proc/PID/stat, after the parenthesized command name).
func cpuSeconds(pids []int) (float64, error) {
	var total float64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, fmt.Errorf("server CPU of PID %d: %w", pid, err)
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			return 0, fmt.Errorf("server CPU of PID %d: unexpected /proc/%d/stat format", pid, pid)
		}
		fields := strings.Fields(s[i+1:])
		// fields[0] is field 3 (state); utime is field 14, stime 15.
		if len(fields) < 13 {
			return 0, fmt.Errorf("server CPU of PID %d: /proc/%d/stat has %d fields", pid, pid, len(fields)+2)
		}
		ut, err1 := strconv.ParseUint(fields[11], 10, 64)
		st, err2 := strconv.ParseUint(fields[12], 10, 64)
		if err1 != nil || err2 != nil {
			return 0, fmt.Errorf("server CPU of PID %d: bad utime/stime %q %q", pid, fields[11], fields[12])
		}
		total += float64(ut+st) / clockTicks
	}
	return total, nil
}
