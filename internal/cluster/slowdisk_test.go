package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/slowdisk"
	"github.com/basalt-store/basalt/internal/vfs"
	"google.golang.org/grpc"
)

// Slow-disk avoidance end to end, with modelled disks (vfs.LatencyFS):
// every datanode has 4 disks, each holding Raft log directory j and volume
// j. Datanode 1's disk 2 is slow from the start: its probe finds it before
// any pipeline exists, so no Raft group and no container lands on it, and
// SCM's datanode list shows it. Then a disk of datanode 2 that holds a
// pipeline's log degrades: the datanode marks it, SCM closes that pipeline
// (reason "slow disk …") and its replacement's group is placed elsewhere.
//
// SCM's stale interval is 30 s here, not 10 heartbeats (3 s): datanode 2
// runs the commands a heartbeat brings (closing and creating pipelines,
// closing containers) before its next heartbeat, and with syncs of 300 ms
// on the degraded disk and a loaded machine that took up to 3.25 s; at 3 s
// it went STALE once in CI and its pipelines closed as stale, not for the
// slow disk. The test logs datanode 2's longest heartbeat gap.
func TestSlowDisksAvoided(t *testing.T) {
	dir := t.TempDir()
	const dns, disks = 4, 4
	fss := make([]*vfs.LatencyFS, dns)
	for i := range dns {
		m := map[string]vfs.DiskProfile{}
		for j := range disks {
			p := vfs.DiskProfile{SyncLatency: time.Millisecond, Capacity: 4 << 40}
			if i == 0 && j == 2 {
				p.SyncLatency = 300 * time.Millisecond
			}
			m[filepath.Join(dir, fmt.Sprintf("dn%d", i+1), fmt.Sprintf("disk%d", j))] = p
		}
		fss[i] = vfs.NewLatencyFS(vfs.Default, m, uint64(i+1))
		fss[i].NoRealSync = true
	}
	diskOf := func(i int, path string) int {
		for j, d := range fss[i].Disks() {
			if path == d.Root || strings.HasPrefix(path, d.Root+string(filepath.Separator)) {
				return j
			}
		}
		return -1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{
		Dir: dir, Datanodes: dns, PipelineLimit: 3, ContainerSize: 256 << 20, BlockSize: 16 << 20,
		HeartbeatInterval: 300 * time.Millisecond, TickInterval: 100 * time.Millisecond,
		StaleInterval: 30 * time.Second, DeadInterval: 90 * time.Second,
		SlowDisk: scm.SlowDiskConfig{CloseInterval: time.Second, MinAge: time.Nanosecond},
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		DatanodeConfig: func(i int, dc *datanode.Config) {
			dc.FS = fss[i]
			dc.LogDirs, dc.Volumes = nil, nil
			for _, d := range fss[i].Disks() {
				dc.LogDirs = append(dc.LogDirs, filepath.Join(d.Root, "raft"))
				dc.Volumes = append(dc.Volumes, filepath.Join(d.Root, "data"))
			}
			dc.SlowDisk = datanode.SlowDiskConfig{Interval: 300 * time.Millisecond,
				Detector: slowdisk.Config{Window: 4 * time.Second, LowThreshold: 40 * time.Millisecond}}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	cl := newClient(t, c, "")
	makeBucket(t, cl, "vol", "bkt")

	// Phase 1: found at start, avoided from the first placement.
	slow := c.Datanode(0).SlowDisks()
	var kinds []string
	for _, s := range slow {
		if diskOf(0, s.Path) != 2 {
			t.Fatalf("datanode 1 marked %s slow", s.Path)
		}
		kinds = append(kinds, s.Kind)
	}
	slices.Sort(kinds)
	if !slices.Equal(kinds, []string{"log", "volume"}) {
		t.Fatalf("datanode 1 slow disks %v, want disk 2's log dir and volume", slow)
	}
	data := randData(7, 64<<10)
	var keys []client.KeyInfo
	for n := range 24 {
		ki, err := cl.PutKey(ctx, "vol", "bkt", fmt.Sprintf("k%d", n), bytes.NewReader(data), client.PutOptions{SizeHint: int64(len(data))})
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, ki)
	}
	pipes := openPipelines(t, mc)
	if len(pipes) < 2 {
		t.Fatalf("%d pipelines open", len(pipes))
	}
	for _, p := range pipes {
		if ld := c.Datanode(0).PipelineLogDir(p.GetId()); ld != "" && diskOf(0, ld) == 2 {
			t.Fatalf("pipeline %d's log on datanode 1's slow disk", p.GetId())
		}
	}
	for _, ki := range keys {
		for _, b := range ki.Blocks {
			if v := c.Datanode(0).ContainerVolume(b.ContainerID); v != "" && diskOf(0, v) == 2 {
				t.Fatalf("container %d on datanode 1's slow volume", b.ContainerID)
			}
		}
	}
	waitFor(t, 30*time.Second, "SCM lists datanode 1's slow disks", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r, err := mc.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
		if err != nil {
			return false
		}
		for _, d := range r.GetDatanodes() {
			if d.GetDetails().GetId() == c.Datanode(0).ID() {
				return len(d.GetSlowDisks()) == 2
			}
		}
		return false
	})

	// Phase 2: a disk of datanode 2 holding a pipeline's log degrades.
	var victim uint64
	var vdisk int
	for _, p := range pipes {
		if ld := c.Datanode(1).PipelineLogDir(p.GetId()); ld != "" {
			victim, vdisk = p.GetId(), diskOf(1, ld)
			break
		}
	}
	if victim == 0 {
		t.Fatal("datanode 2 is in no pipeline")
	}
	old := map[uint64]bool{}
	for _, p := range allPipelines(t, mc) {
		old[p.GetId()] = true
	}
	// Datanode 2's longest heartbeat gap as SCM saw it, from here on.
	gapStop, gapDone := make(chan struct{}), make(chan time.Duration)
	go func() {
		var gap time.Duration
		for {
			select {
			case <-gapStop:
				gapDone <- gap
				return
			case <-time.After(100 * time.Millisecond):
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			r, err := mc.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
			cancel()
			for _, d := range r.GetDatanodes() {
				if err == nil && d.GetDetails().GetId() == c.Datanode(1).ID() {
					gap = max(gap, time.Since(time.UnixMilli(d.GetLastHeartbeatUnixMs())))
				}
			}
		}
	}()
	defer func() {
		close(gapStop)
		t.Logf("datanode 2's longest heartbeat gap after its disk degraded: %v (STALE at 30s)", (<-gapDone).Round(time.Millisecond))
	}()
	fss[1].Disks()[vdisk].SetSlowdown(300)
	waitFor(t, 60*time.Second, fmt.Sprintf("pipeline %d closed for datanode 2's slow disk %d", victim, vdisk), func() bool {
		for _, p := range allPipelines(t, mc) {
			if p.GetId() == victim && p.GetState() != metapb.PipelineState_PIPELINE_OPEN {
				if !strings.Contains(p.GetCloseReason(), "slow disk") {
					t.Fatalf("pipeline %d closed: %q", victim, p.GetCloseReason())
				}
				return true
			}
		}
		return false
	})
	// Writes go on; the pipelines created from now on (SCM may create the
	// replacement in the tick that closes the victim, before the wait
	// above returns: the snapshot is taken before the disk degrades) keep
	// their logs off the slow disk.
	waitFor(t, 60*time.Second, "a replacement pipeline with datanode 2", func() bool {
		for _, p := range openPipelines(t, mc) {
			if !old[p.GetId()] && slices.Contains(p.GetDatanodes(), c.Datanode(1).ID()) && c.Datanode(1).PipelineLogDir(p.GetId()) != "" {
				if d := diskOf(1, c.Datanode(1).PipelineLogDir(p.GetId())); d == vdisk {
					t.Fatalf("replacement pipeline %d's log on the slow disk", p.GetId())
				}
				return true
			}
		}
		return false
	})
	if _, err := cl.PutKey(ctx, "vol", "bkt", "after", bytes.NewReader(data), client.PutOptions{SizeHint: int64(len(data))}); err != nil {
		t.Fatal(err)
	}
}

func allPipelines(t *testing.T, mc *metaclient.Client) []*metapb.Pipeline {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := mc.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return r.GetPipelines()
}

func openPipelines(t *testing.T, mc *metaclient.Client) []*metapb.Pipeline {
	var out []*metapb.Pipeline
	for _, p := range allPipelines(t, mc) {
		if p.GetState() == metapb.PipelineState_PIPELINE_OPEN && len(p.GetDatanodes()) == 3 {
			out = append(out, p)
		}
	}
	return out
}

func waitFor(t *testing.T, bound time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", bound, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
