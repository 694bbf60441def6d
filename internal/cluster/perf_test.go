package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
)

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestPerfV1 is a quick in-process throughput probe (client and servers in
// one process, so CPU/GiB includes the client). Run with BASALT_PERF=1.
func TestPerfV1(t *testing.T) {
	if os.Getenv("BASALT_PERF") == "" {
		t.Skip("set BASALT_PERF=1")
	}
	keys := 4
	if v, _ := strconv.Atoi(os.Getenv("BASALT_PERF_KEYS")); v > 0 {
		keys = v
	}
	c := start(t, t.TempDir(), 3, 256<<20)
	defer c.Close()
	cl := newClient(t, c, "")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(1, 128<<20)
	c0, t0 := cpuTime(), time.Now()
	for i := 0; i < keys; i++ {
		if _, err := cl.PutKey(context.Background(), "vol", "bkt", fmt.Sprint("k", i), bytes.NewReader(data), client.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	el, cpu := time.Since(t0), cpuTime()-c0
	gib := float64(keys*len(data)) / (1 << 30)
	t.Logf("V1 write: %d × 128 MiB in %v = %.0f MiB/s, process CPU %.1f s/GiB", keys, el.Round(time.Millisecond), gib*1024/el.Seconds(), cpu.Seconds()/gib)
}
