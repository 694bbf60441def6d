package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"slices"
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

// restartMeta closes the cluster's metadata node (the SCM leader) and
// starts it again on its directory and addresses, with the timing
// cluster.Start gave it.
func restartMeta(t *testing.T, c *cluster.Cluster, dir string) {
	t.Helper()
	grpcAddr, raftAddr := c.Meta.GRPCAddr(), c.Meta.RaftAddr()
	if err := c.Meta.Close(); err != nil {
		t.Fatal(err)
	}
	creds, err := c.Credentials(pki.Identity{Role: pki.RoleMeta, ID: "1"})
	if err != nil {
		t.Fatal(err)
	}
	ms, err := meta.New(meta.Config{TLS: creds, Admins: cluster.Admins,
		NodeID: 1, DataDir: filepath.Join(dir, "meta"), RaftAddr: raftAddr, GRPCAddr: grpcAddr, TickInterval: 50 * time.Millisecond,
		SCM: scm.Config{HeartbeatInterval: 200 * time.Millisecond, StaleInterval: 2 * time.Second, DeadInterval: 6 * time.Second,
			SafeModeMinDatanodes: 3, LoopInterval: 200 * time.Millisecond, ContainerSize: 512 << 20, BlockSize: 4 << 20},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ms.Start(); err != nil {
		ms.Close()
		t.Fatal(err)
	}
	c.Meta = ms
}

// opStatus is datanode dn as SCM lists it.
func opStatus(ctx context.Context, cl *client.Client, dn uint64) (*metapb.DatanodeStatus, error) {
	r, err := cl.Scm().ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
	if err != nil {
		return nil, err
	}
	for _, d := range r.Datanodes {
		if d.GetDetails().GetId() == dn {
			return d, nil
		}
	}
	return nil, fmt.Errorf("datanode %d not listed", dn)
}

// blockLocations returns, for every block of the keys, the datanodes SCM
// offers as its locations.
func blockLocations(ctx context.Context, cl *client.Client, keys []string) (map[string][]uint64, error) {
	out := map[string][]uint64{}
	cache := map[uint64][]uint64{}
	for _, k := range keys {
		st, err := cl.StatKey(ctx, "vol", "bkt", k)
		if err != nil {
			return nil, fmt.Errorf("stat %s: %w", k, err)
		}
		for _, b := range st.Blocks {
			locs, ok := cache[b.ContainerID]
			if !ok {
				resp, err := cl.Scm().GetContainers(ctx, &metapb.GetContainersRequest{ContainerIds: []uint64{b.ContainerID}})
				if err != nil {
					return nil, err
				}
				for _, d := range resp.GetContainers()[0].GetDatanodes() {
					locs = append(locs, d.GetId())
				}
				cache[b.ContainerID] = locs
			}
			out[fmt.Sprintf("%s/%d/%d", k, b.ContainerID, b.LocalID)] = locs
		}
	}
	return out, nil
}

// mostLoaded is the index and ID of the datanode holding the most block
// replicas of the keys.
func mostLoaded(t *testing.T, c *cluster.Cluster, cl *client.Client, keys []string, n int) (int, uint64) {
	t.Helper()
	held := map[uint64]int{}
	locs, err := blockLocations(context.Background(), cl, keys)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range locs {
		for _, id := range l {
			held[id]++
		}
	}
	vi, victim := -1, uint64(0)
	for i := range n {
		if id := c.Datanode(i).ID(); vi < 0 || held[id] > held[victim] {
			vi, victim = i, id
		}
	}
	return vi, victim
}

// TestDecommissionUnderWriteLoad decommissions one of 5 datanodes while a
// writer keeps writing: its pipelines close, writes go on over the other
// four, every container it holds is copied elsewhere, and it ends
// DECOMMISSIONED. All along no block is offered with fewer than 2
// locations; the SCM leader restarts in the middle of the drain and the
// drain goes on. At the end every block has 3 replicas off the
// datanode, and every key reads back.
func TestDecommissionUnderWriteLoad(t *testing.T) {
	const bound = 90 * time.Second
	dir := t.TempDir()
	c := start(t, dir, 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	ctx := context.Background()

	var mu sync.Mutex
	data := map[string][]byte{}
	var keys []string
	for i := range 12 {
		k := fmt.Sprintf("pre%02d", i)
		data[k] = randData(int64(300+i), 1<<20+i*(512<<10))
		put(t, cl, k, data[k])
		keys = append(keys, k)
	}
	vi, victim := mostLoaded(t, c, cl, keys, 5)

	// The writer.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writes, writeErrs atomic.Int64
	var lastErr atomic.Value
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			k := fmt.Sprintf("load%04d", i)
			d := randData(int64(1000+i), 256<<10+(i%8)*(256<<10))
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			_, err := cl.PutKey(wctx, "vol", "bkt", k, onlyReader{bytes.NewReader(d)}, client.PutOptions{})
			cancel()
			if err != nil {
				writeErrs.Add(1)
				lastErr.Store(err.Error())
				time.Sleep(50 * time.Millisecond)
				continue
			}
			writes.Add(1)
			mu.Lock()
			data[k] = d
			keys = append(keys, k)
			mu.Unlock()
		}
	}()
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()
	time.Sleep(time.Second)

	began := time.Now()
	if _, err := cl.Scm().SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_DECOMMISSIONING}); err != nil {
		t.Fatal(err)
	}
	t.Logf("decommissioning datanode %d (index %d)", victim, vi)
	restarted := false
	polls, minLocs := 0, 3
	var restartedAt time.Duration
	writesAtRestart := int64(0)
	for {
		d, err := opStatus(ctx, cl, victim)
		if err == nil && d.OpState == metapb.NodeOpState_DECOMMISSIONED {
			break
		}
		if time.Since(began) > bound {
			h, _ := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{Worst: 20})
			t.Fatalf("not DECOMMISSIONED %v after the start: %v %v\nhealth %v", bound, d, err, h)
		}
		mu.Lock()
		snap := slices.Clone(keys)
		mu.Unlock()
		if locs, err := blockLocations(ctx, cl, snap); err == nil {
			polls++
			for b, l := range locs {
				minLocs = min(minLocs, len(l))
				if len(l) < 2 {
					t.Fatalf("%v into the drain: block %s has %d locations %v", time.Since(began).Round(time.Millisecond), b, len(l), l)
				}
			}
		}
		h, herr := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
		if !restarted && err == nil && herr == nil && d.DrainLeft > 0 && (len(h.Copies) > 0 || h.CopiesDone > 0) {
			// Copies under way, containers still short: restart the SCM
			// leader.
			restartedAt = time.Since(began)
			t.Logf("restarting meta %v into the drain: %d of %d containers still short", restartedAt.Round(time.Millisecond), d.DrainLeft, d.DrainContainers)
			restartMeta(t, c, dir)
			restarted = true
			writesAtRestart = writes.Load()
		}
		time.Sleep(250 * time.Millisecond)
	}
	drained := time.Since(began)
	// Writes go on after the restart (a few, within a bound).
	for writes.Load() < writesAtRestart+3 {
		if time.Since(began) > drained+30*time.Second {
			t.Fatalf("writes stalled after the SCM restart: %d ok, %d after the restart, %d failed (last %v)", writes.Load(), writes.Load()-writesAtRestart, writeErrs.Load(), lastErr.Load())
		}
		time.Sleep(100 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	t.Logf("DECOMMISSIONED %v after the start (meta restarted: %v at %v); %d location polls, fewest locations %d; %d writes ok (%d after the restart), %d failed (last: %v)",
		drained.Round(time.Millisecond), restarted, restartedAt.Round(time.Millisecond), polls, minLocs, writes.Load(), writes.Load()-writesAtRestart, writeErrs.Load(), lastErr.Load())
	if !restarted {
		t.Log("the drain finished before a restart point was seen")
	}
	// Every block: 3 locations, none the decommissioned datanode.
	locs, err := blockLocations(ctx, cl, keys)
	if err != nil {
		t.Fatal(err)
	}
	for b, l := range locs {
		if slices.Contains(l, victim) {
			t.Fatalf("block %s still located on the decommissioned datanode: %v", b, l)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		short := ""
		locs, err := blockLocations(ctx, cl, keys)
		if err != nil {
			t.Fatal(err)
		}
		for b, l := range locs {
			if len(l) != 3 {
				short = fmt.Sprintf("block %s: %v", b, l)
			}
		}
		if short == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the drain: %s", short)
		}
		time.Sleep(250 * time.Millisecond)
	}
	for _, k := range keys {
		if got := get(t, cl, k); !bytes.Equal(got, data[k]) {
			t.Fatalf("key %s differs after the drain", k)
		}
	}
}

// TestMaintenanceAndRecommission puts a datanode into maintenance: it
// reaches IN_MAINTENANCE once each of its containers has 2 replicas
// elsewhere, is then stopped for longer than the dead interval without
// any repair, and every key reads. Restarted and recommissioned, it is
// IN_SERVICE, takes new pipelines, and writes succeed.
func TestMaintenanceAndRecommission(t *testing.T) {
	const bound = 60 * time.Second
	dir := t.TempDir()
	c := start(t, dir, 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	ctx := context.Background()
	data := map[string][]byte{}
	var keys []string
	for i := range 10 {
		k := fmt.Sprintf("k%02d", i)
		data[k] = randData(int64(500+i), 512<<10+i*(700<<10))
		put(t, cl, k, data[k])
		keys = append(keys, k)
	}
	vi, victim := mostLoaded(t, c, cl, keys, 5)
	// Pipelines made while only the first rack's datanodes had registered
	// hold mis-replicated containers; let those repairs finish first.
	waitHealthy(t, cl, bound)
	began := time.Now()
	if _, err := cl.Scm().SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_ENTERING_MAINTENANCE,
		MaintenanceEndUnixMs: time.Now().Add(time.Hour).UnixMilli()}); err != nil {
		t.Fatal(err)
	}
	for {
		d, err := opStatus(ctx, cl, victim)
		if err == nil && d.OpState == metapb.NodeOpState_IN_MAINTENANCE {
			break
		}
		if time.Since(began) > bound {
			t.Fatalf("not IN_MAINTENANCE after %v: %v %v", bound, d, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("IN_MAINTENANCE %v after the request", time.Since(began).Round(time.Millisecond))
	locs, err := blockLocations(ctx, cl, keys)
	if err != nil {
		t.Fatal(err)
	}
	for b, l := range locs {
		others := 0
		for _, id := range l {
			if id != victim {
				others++
			}
		}
		if others < 2 {
			t.Fatalf("block %s: locations %v, want 2 off datanode %d", b, l, victim)
		}
	}
	// Closing its pipelines closed containers that may be on one rack:
	// their moves are not repairs of the datanode's absence.
	waitHealthy(t, cl, bound)
	h0, err := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// Down for longer than the dead interval (6 s): no repair.
	c.StopDatanode(vi)
	time.Sleep(9 * time.Second)
	h1, err := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if h1.CopiesDone != h0.CopiesDone || len(h1.Copies) != 0 || h1.Counts["under_replicated"] != 0 || h1.Counts["missing"] != 0 {
		t.Fatalf("repairs while in maintenance: before %v, after %v", h0, h1)
	}
	if d, _ := opStatus(ctx, cl, victim); d.GetState() != metapb.NodeState_DEAD || d.GetOpState() != metapb.NodeOpState_IN_MAINTENANCE {
		t.Fatalf("datanode in maintenance, stopped: %v", d)
	}
	for _, k := range keys {
		if got := get(t, cl, k); !bytes.Equal(got, data[k]) {
			t.Fatalf("key %s differs while datanode %d is in maintenance", k, victim)
		}
	}
	// Back, and recommissioned.
	if err := c.RestartDatanode(ctx, vi); err != nil {
		t.Fatal(err)
	}
	if d, err := cl.Scm().SetDatanodeOpState(ctx, &metapb.SetDatanodeOpStateRequest{DatanodeId: victim, State: metapb.NodeOpState_IN_SERVICE}); err != nil || d.GetDatanode().GetOpState() != metapb.NodeOpState_IN_SERVICE {
		t.Fatalf("recommission: %v %v", d, err)
	}
	for {
		d, err := opStatus(ctx, cl, victim)
		if err == nil && d.Pipelines > 0 && d.State == metapb.NodeState_HEALTHY {
			break
		}
		if time.Since(began) > 2*bound {
			t.Fatalf("recommissioned datanode never back in a pipeline: %v %v", d, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for i := range 6 {
		k := fmt.Sprintf("after%02d", i)
		data[k] = randData(int64(900+i), 1<<20)
		put(t, cl, k, data[k])
		if got := get(t, cl, k); !bytes.Equal(got, data[k]) {
			t.Fatalf("key %s differs", k)
		}
	}
	h2, err := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if h2.Counts["missing"] != 0 || h2.Counts["under_replicated"] != 0 {
		t.Fatalf("health after recommission: %v", h2)
	}
}

// waitHealthy waits until the replication manager has nothing to do: no
// container short of replicas or on one rack, no copy in flight.
func waitHealthy(t *testing.T, cl *client.Client, bound time.Duration) {
	t.Helper()
	start := time.Now()
	for {
		h, err := cl.Scm().GetContainerHealth(context.Background(), &metapb.GetContainerHealthRequest{})
		if err == nil && h.RoundUnixMs != 0 && h.Counts["under_replicated"]+h.Counts["mis_replicated"]+h.Counts["over_replicated"]+h.Counts["missing"] == 0 && len(h.Copies) == 0 {
			return
		}
		if time.Since(start) > bound {
			t.Fatalf("containers not healthy after %v: %v %v", bound, h, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
