package faulttest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
)

// grayLog is what the gray test's writers did: every write's end, and
// whether it succeeded.
type grayLog struct {
	mu    sync.Mutex
	oks   []time.Time
	fails []grayFail
}

type grayFail struct {
	at  time.Time
	err string
}

func (g *grayLog) ok(at time.Time) {
	g.mu.Lock()
	g.oks = append(g.oks, at)
	g.mu.Unlock()
}

func (g *grayLog) fail(at time.Time, err error) {
	g.mu.Lock()
	g.fails = append(g.fails, grayFail{at, err.Error()})
	g.mu.Unlock()
}

// gap returns the longest time within [from, to] without a successful
// write ending (the window's edges count as ends), and where it began.
func (g *grayLog) gap(from, to time.Time) (time.Duration, time.Time) {
	g.mu.Lock()
	ts := []time.Time{from}
	for _, t := range g.oks {
		if t.After(from) && t.Before(to) {
			ts = append(ts, t)
		}
	}
	g.mu.Unlock()
	ts = append(ts, to)
	sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
	var worst time.Duration
	at := from
	for i := 1; i < len(ts); i++ {
		if d := ts[i].Sub(ts[i-1]); d > worst {
			worst, at = d, ts[i-1]
		}
	}
	return worst, at
}

// failsIn returns the failed writes that ended in [from, to).
func (g *grayLog) failsIn(from, to time.Time) []grayFail {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []grayFail
	for _, f := range g.fails {
		if !f.at.Before(from) && f.at.Before(to) {
			out = append(out, f)
		}
	}
	return out
}

func (g *grayLog) counts() (int, int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.oks), len(g.fails)
}

// TestGrayFailures is issue 12's availability test under gray failures:
// 3 `basalt meta` and 5 `basalt datanode` processes on loopback, small-key
// writers running; the meta leader (namespace and SCM) is stopped with
// SIGSTOP for 20 s, then a datanode for 30 s. A stopped process keeps its
// connections open and answers nothing, the case a crash detector does
// not see. It measures the longest time without a successful write
// around each stop (bounded by BASALT_GRAY_MAX_GAP, default 8 s) and
// requires that no write fails once the stopped process resumed, nor a
// write right after start-up. It runs only with BASALT_GRAY_TEST=1 (make
// test-gray); BASALT_BIN tests a prebuilt binary, BASALT_FAULT_KEEP=1
// keeps the logs of a passing run.
func TestGrayFailures(t *testing.T) {
	if os.Getenv("BASALT_GRAY_TEST") != "1" {
		t.Skip("multi-process gray-failure test: set BASALT_GRAY_TEST=1 (make test-gray)")
	}
	maxGap := 8 * time.Second
	if s := os.Getenv("BASALT_GRAY_MAX_GAP"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("BASALT_GRAY_MAX_GAP=%q: %v", s, err)
		}
		maxGap = d
	}
	const (
		writers   = 4
		metaStop  = 20 * time.Second
		dnStop    = 30 * time.Second
		settle    = 10 * time.Second
		keyTimout = 60 * time.Second
	)
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	for _, d := range CleanStale(filepath.Join(os.TempDir(), "basalt-gray-*")) {
		t.Logf("cleaned %s, left by a test process that no longer runs", d)
	}
	root, err := os.MkdirTemp("", "basalt-gray-")
	if err != nil {
		t.Fatal(err)
	}
	if err := ClaimDir(root); err != nil {
		t.Fatal(err)
	}
	var c *Cluster
	defer func() {
		if c != nil {
			c.Close()
		}
		os.RemoveAll(filepath.Join(root, "data"))
		os.Remove(filepath.Join(root, "basalt"))
		os.Remove(filepath.Join(root, ownerFile))
		if t.Failed() || os.Getenv("BASALT_FAULT_KEEP") == "1" {
			t.Logf("logs kept in %s", filepath.Join(root, "logs"))
		} else {
			os.RemoveAll(root)
		}
	}()
	logf := func(format string, args ...any) {
		t.Logf("[%6.1fs] %s", time.Since(began).Seconds(), fmt.Sprintf(format, args...))
	}
	bin, err := buildBinary(root)
	if err != nil {
		t.Fatal(err)
	}
	c, err = NewCluster(ClusterConfig{Bin: bin, Dir: root, MetaLogLevel: os.Getenv("BASALT_GRAY_META_LOG_LEVEL")})
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithTimeout(ctx, 2*time.Minute)
	err = c.Start(sctx)
	scancel()
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	logf("cluster ready: meta %v, datanodes %v", c.MetaGRPC, c.DNData)

	clog, err := os.Create(filepath.Join(c.Logs, "client.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer clog.Close()
	cl, err := client.New(client.Config{MetaAddrs: c.MetaGRPC, Credentials: c.Creds, Logger: slog.New(slog.NewTextHandler(clog, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	const vol, bucket = "gray", "keys"
	if _, err := cl.CreateVolume(ctx, vol, "graytest"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, vol, bucket, client.BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	// A write right after the cluster reports ready (every datanode
	// registered and in an open pipeline) must succeed: the pipelines'
	// groups may still be electing, and the client waits for them.
	start := time.Now()
	if _, err := cl.PutKey(ctx, vol, bucket, "first", bytes.NewReader(keyData(1, 4096, nil)), client.PutOptions{}); err != nil {
		t.Errorf("first write after start-up: %v", err)
	}
	logf("first write after ready took %v", time.Since(start).Round(time.Millisecond))

	log := &grayLog{}
	wctx, wcancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf []byte
			for seq := 0; wctx.Err() == nil; seq++ {
				size := int64(4<<10 + (seq*7919+i*104729)%(60<<10))
				buf = keyData(uint64(i)<<32|uint64(seq), size, buf)
				kctx, kcancel := context.WithTimeout(wctx, keyTimout)
				_, err := cl.PutKey(kctx, vol, bucket, "w"+strconv.Itoa(i)+"/"+strconv.Itoa(seq), bytes.NewReader(buf), client.PutOptions{})
				kcancel()
				switch {
				case err == nil:
					log.ok(time.Now())
				case wctx.Err() != nil:
					return // the test is ending
				default:
					log.fail(time.Now(), err)
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	defer func() { wcancel(); wg.Wait() }()

	sleep := func(d time.Duration) {
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
	}
	type window struct {
		name              string
		stop, cont, until time.Time
	}
	var windows []window
	stopFor := func(p *Proc, d time.Duration, what string) {
		before := time.Now().Add(-5 * time.Second)
		if err := p.Stop(); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		logf("SIGSTOP %s (%s) for %v", p.Name, what, d)
		if os.Getenv("BASALT_GRAY_STACKS") == "1" {
			// Where the writers wait, halfway through the stop.
			sleep(d / 2)
			if f, err := os.Create(filepath.Join(c.Logs, "stacks-"+p.Name+".txt")); err == nil {
				pprof.Lookup("goroutine").WriteTo(f, 1)
				f.Close()
			}
			procs, addrs := append(append([]*Proc{}, c.Metas...), c.DNs...), append(append([]string{}, c.MetaHTTP...), c.DNHTTP...)
			for i, m := range procs {
				if m == p {
					continue
				}
				hc := http.Client{Timeout: 5 * time.Second}
				if r, err := hc.Get("http://" + addrs[i] + "/debug/pprof/goroutine?debug=2"); err == nil {
					b, _ := io.ReadAll(io.LimitReader(r.Body, 16<<20))
					r.Body.Close()
					os.WriteFile(filepath.Join(c.Logs, fmt.Sprintf("stacks-%s-during-%s.txt", m.Name, p.Name)), b, 0o644)
				}
			}
			sleep(d - d/2)
		} else {
			sleep(d)
		}
		if err := p.Cont(); err != nil {
			t.Fatal(err)
		}
		cont := time.Now()
		logf("SIGCONT %s", p.Name)
		sleep(settle)
		gapBefore, _ := log.gap(before, stopped)
		windows = append(windows, window{name: p.Name + " (" + what + ")", stop: stopped, cont: cont, until: time.Now()})
		logf("longest gap in the 5 s before the stop: %v", gapBefore.Round(time.Millisecond))
	}
	sleep(5 * time.Second)
	if n, _ := log.counts(); n == 0 {
		t.Fatalf("no write succeeded in the first 5 s")
	}
	li := c.Leader(ctx)
	if li < 0 {
		t.Fatal("no meta leader")
	}
	stopFor(c.Metas[li], metaStop, "meta leader")
	// The datanode that leads the most pipelines (every small write of
	// those goes through it first).
	dn, most := 0, -1
	for i := range c.DNs {
		if lead, _, err := c.Roles(ctx, i); err == nil && lead > most {
			dn, most = i, lead
		}
	}
	stopFor(c.DNs[dn], dnStop, fmt.Sprintf("datanode leading %d pipelines", most))
	wcancel()
	wg.Wait()

	oks, fails := log.counts()
	logf("writes: %d succeeded, %d failed", oks, fails)
	for _, w := range windows {
		gap, at := log.gap(w.stop, w.until)
		during := log.failsIn(w.stop, w.cont)
		after := log.failsIn(w.cont, w.until)
		logf("%s stopped %v: longest gap without a successful write %v (from %.1fs after the stop); %d writes failed while stopped, %d after SIGCONT",
			w.name, w.cont.Sub(w.stop).Round(time.Second), gap.Round(time.Millisecond), at.Sub(w.stop).Seconds(), len(during), len(after))
		for i, f := range append(during, after...) {
			if i == 5 {
				break
			}
			logf("  failed at %.1fs after the stop: %s", f.at.Sub(w.stop).Seconds(), truncate(f.err, 300))
		}
		var perSec []string
		for s := w.stop; s.Before(w.until); s = s.Add(time.Second) {
			n := 0
			log.mu.Lock()
			for _, t := range log.oks {
				if !t.Before(s) && t.Before(s.Add(time.Second)) {
					n++
				}
			}
			log.mu.Unlock()
			perSec = append(perSec, strconv.Itoa(n))
		}
		logf("  successful writes per second from the stop: %s", strings.Join(perSec, " "))
		fmt.Printf("GRAY %s gap=%.2fs failed_during=%d failed_after=%d\n", strings.Fields(w.name)[0], gap.Seconds(), len(during), len(after))
		if gap > maxGap {
			t.Errorf("%s: %v without a successful write, more than %v", w.name, gap.Round(time.Millisecond), maxGap)
		}
		if len(after) > 0 {
			t.Errorf("%s: %d writes failed after the process resumed", w.name, len(after))
		}
	}
	for _, cr := range c.Crashes() {
		t.Errorf("%s exited unexpectedly: %s\n%s", cr.Name, cr.Err, cr.Tail)
	}
	logf("total %.1fs", time.Since(began).Seconds())
}
