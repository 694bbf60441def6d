package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
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
	"github.com/basalt-store/basalt/internal/storage"
)

// TestDeadDatanodeIsHealed kills one of 5 datanodes for good while keys
// are stored: SCM declares it dead (6 s with 200 ms heartbeats), closes
// its pipelines and their containers, and the replication manager copies
// every container it held to another datanode, verified, until every
// block has 3 healthy replicas again, none of them on the dead datanode.
// Each replica is checked by reading the block from that datanode's
// storage and comparing it with what was written. Reads run all along
// and must never fail.
func TestDeadDatanodeIsHealed(t *testing.T) {
	const healBound = 45 * time.Second
	c := start(t, t.TempDir(), 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	const keys = 24
	data := map[string][]byte{}
	for i := range keys {
		k := fmt.Sprintf("k%02d", i)
		data[k] = randData(int64(100+i), 256<<10+i*(320<<10)) // 256 KiB .. 7.6 MiB: 1-2 blocks
		put(t, cl, k, data[k])
	}
	ctx := context.Background()

	// The datanode holding the most block replicas dies.
	held := map[uint64]int{}
	for k := range data {
		st, err := cl.StatKey(ctx, "vol", "bkt", k)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range st.Blocks {
			for _, r := range b.Replicas {
				held[r.ID]++
			}
		}
	}
	victim, vi := uint64(0), -1
	for i := range 5 {
		if id := c.Datanode(i).ID(); vi < 0 || held[id] > held[victim] {
			victim, vi = id, i
		}
	}
	t.Logf("killing datanode %d (holds %d block replicas)", victim, held[victim])

	// Readers: every key, over and over, until the repair is done.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var reads, readErrs atomic.Int64
	var firstErr atomic.Value
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			for k, want := range data {
				select {
				case <-stop:
					return
				default:
				}
				r, err := cl.GetKey(ctx, "vol", "bkt", k)
				var got []byte
				if err == nil {
					got, err = readAll(r)
				}
				reads.Add(1)
				if err == nil && !bytes.Equal(got, want) {
					err = fmt.Errorf("key %s: wrong data", k)
				}
				if err != nil {
					readErrs.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
			}
		}
	}()

	killed := time.Now()
	c.StopDatanode(vi)
	deadline := killed.Add(healBound)
	var missing string
	for {
		missing = unhealed(t, c, cl, data, victim, 0)
		if missing == "" {
			break
		}
		if time.Now().After(deadline) {
			h, _ := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{Worst: 50})
			close(stop)
			wg.Wait()
			t.Fatalf("not healed %v after the kill: %s\nhealth: %v", healBound, missing, h)
		}
		time.Sleep(250 * time.Millisecond)
	}
	healed := time.Since(killed)
	close(stop)
	wg.Wait()
	t.Logf("every block back to 3 verified replicas %v after the kill; %d reads, %d failed", healed.Round(time.Millisecond), reads.Load(), readErrs.Load())
	if n := readErrs.Load(); n > 0 {
		t.Fatalf("%d of %d reads failed during the repair; first: %v", n, reads.Load(), firstErr.Load())
	}
	h, err := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if h.GetCounts()["missing"] != 0 || h.GetCopiesDone() == 0 {
		t.Fatalf("health after repair: %v", h)
	}
	t.Logf("health: %v, copies done %d, failed %d", h.GetCounts(), h.GetCopiesDone(), h.GetCopiesFailed())
}

// TestRepairSurvivesMetaRestart restarts the metadata service (the SCM
// leader) while copies of a dead datanode's containers are in flight: the
// new leader starts over from the replicated replica sets and the
// datanodes' reports (adopting copies that finished, scheduling the rest)
// and the repair completes.
func TestRepairSurvivesMetaRestart(t *testing.T) {
	const healBound = 50 * time.Second
	dir := t.TempDir()
	c := start(t, dir, 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := map[string][]byte{}
	for i := range 12 {
		k := fmt.Sprintf("k%02d", i)
		data[k] = randData(int64(200+i), 512<<10+i*(512<<10))
		put(t, cl, k, data[k])
	}
	ctx := context.Background()
	victim := c.Datanode(0).ID()
	killed := time.Now()
	c.StopDatanode(0)
	// Wait for the first copies, then restart the SCM leader.
	for {
		h, err := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{})
		if err == nil && (len(h.GetCopies()) > 0 || h.GetCopiesDone() > 0) {
			t.Logf("restarting meta with %d copies in flight, %d done", len(h.GetCopies()), h.GetCopiesDone())
			break
		}
		if time.Since(killed) > healBound {
			t.Fatalf("no copy scheduled: %v %v", h, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	grpcAddr, raftAddr := c.Meta.GRPCAddr(), c.Meta.RaftAddr()
	if err := c.Meta.Close(); err != nil {
		t.Fatal(err)
	}
	metaCreds, err := c.Credentials(pki.Identity{Role: pki.RoleMeta, ID: "1"})
	if err != nil {
		t.Fatal(err)
	}
	ms, err := meta.New(meta.Config{
		NodeID: 1, DataDir: filepath.Join(dir, "meta"), TLS: metaCreds, Admins: cluster.Admins, RaftAddr: raftAddr, GRPCAddr: grpcAddr, TickInterval: 50 * time.Millisecond,
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
	for {
		missing := unhealed(t, c, cl, data, victim, 0)
		if missing == "" {
			break
		}
		if time.Since(killed) > healBound {
			h, _ := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{Worst: 50})
			t.Fatalf("not healed %v after the kill (meta restarted mid-repair): %s\nhealth: %v", healBound, missing, h)
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("healed %v after the kill, across a meta restart", time.Since(killed).Round(time.Millisecond))
	for k, want := range data {
		if got := get(t, cl, k); !bytes.Equal(got, want) {
			t.Fatalf("key %s differs after the repair", k)
		}
	}
}

// TestCorruptReplicaIsReplaced: a replica with flipped bytes is found by
// a read (the client reports it), recorded unhealthy through Raft, its
// container closes on the other replicas, and the replication manager
// copies it to a fifth datanode and drops the corrupt replica: every
// block ends with 3 replicas that read back correctly, none of them the
// corrupt one.
func TestCorruptReplicaIsReplaced(t *testing.T) {
	const healBound = 30 * time.Second
	dir := t.TempDir()
	c := start(t, dir, 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := map[string][]byte{"k": randData(7, 6<<20)}
	put(t, cl, "k", data["k"])
	ctx := context.Background()
	st, err := cl.StatKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	b := st.Blocks[0]
	victim := b.Replicas[0].ID
	for i := range 5 {
		if c.Datanode(i).ID() != victim {
			continue
		}
		path := filepath.Join(dir, fmt.Sprintf("dn%d", i+1), "data", "basalt", "containers", fmt.Sprint(b.ContainerID), fmt.Sprintf("%d.block", b.LocalID))
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		one := []byte{0}
		f.ReadAt(one, 1<<20)
		one[0] ^= 0xff
		f.WriteAt(one, 1<<20)
		f.Sync()
		f.Close()
	}
	start := time.Now()
	// Read until a client has tried the corrupt replica (replicas at the
	// same distance come in either order) and reported it. A fresh client
	// each time: a client prefers replicas whose block file it has cached,
	// so one that read a good replica first would keep to it.
	for reported := false; !reported; {
		rc := newClient(t, c, "/dc1/rack1")
		got := get(t, rc, "k")
		rc.Close()
		if !bytes.Equal(got, data["k"]) {
			t.Fatal("read returned wrong data")
		}
		resp, err := cl.Scm().ListCorruptReplicas(ctx, &metapb.ListCorruptReplicasRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range resp.GetReplicas() {
			reported = reported || r.GetDatanodeId() == victim
		}
		if time.Since(start) > healBound {
			t.Fatal("corrupt replica never reported")
		}
	}
	for {
		missing := unhealed(t, c, cl, data, victim, b.ContainerID)
		if missing == "" {
			break
		}
		if time.Since(start) > healBound {
			h, _ := cl.Scm().GetContainerHealth(ctx, &metapb.GetContainerHealthRequest{Worst: 50})
			t.Fatalf("corrupt replica not replaced within %v: %s\nhealth: %v", healBound, missing, h)
		}
		if got := get(t, cl, "k"); !bytes.Equal(got, data["k"]) {
			t.Fatal("read returned wrong data")
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("corrupt replica on datanode %d replaced %v after the corruption", victim, time.Since(start).Round(time.Millisecond))
	// And the datanode is told to delete the replica SCM dropped.
	for i := range 5 {
		if dn := c.Datanode(i); dn.ID() == victim {
			for {
				if _, err := dn.Store().Container(storage.ContainerID(b.ContainerID)); err != nil {
					break
				}
				if time.Since(start) > healBound {
					t.Fatalf("datanode %d still holds its dropped replica of container %d", victim, b.ContainerID)
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
}

// unhealed returns "" when every block of every key has exactly 3
// recorded healthy replicas, none on the dead datanode, and each of those
// datanodes holds the block's bytes; otherwise what is not yet so.
// With only != 0, dead must be absent from container only's replicas.
func unhealed(t *testing.T, c *cluster.Cluster, cl *client.Client, data map[string][]byte, dead, only uint64) string {
	t.Helper()
	ctx := context.Background()
	stores := map[uint64]*storage.Store{}
	for i := range 5 {
		if dn := c.Datanode(i); dn != nil {
			stores[dn.ID()] = dn.Store()
		}
	}
	for k, want := range data {
		st, err := cl.StatKey(ctx, "vol", "bkt", k)
		if err != nil {
			return fmt.Sprintf("stat %s: %v", k, err)
		}
		for _, b := range st.Blocks {
			resp, err := cl.Scm().GetContainers(ctx, &metapb.GetContainersRequest{ContainerIds: []uint64{b.ContainerID}})
			if err != nil || len(resp.GetContainers()) != 1 {
				return fmt.Sprintf("container %d: %v", b.ContainerID, err)
			}
			ct := resp.GetContainers()[0].GetContainer()
			if len(ct.GetReplicas()) != 3 || len(ct.GetUnhealthyReplicas()) != 0 || (only == 0 || only == ct.GetId()) && slices.Contains(ct.GetReplicas(), dead) {
				return fmt.Sprintf("container %d (%v): replicas %v, unhealthy %v", ct.GetId(), ct.GetState(), ct.GetReplicas(), ct.GetUnhealthyReplicas())
			}
			for _, r := range ct.GetReplicas() {
				s := stores[r]
				if s == nil {
					return fmt.Sprintf("container %d: replica on unknown datanode %d", ct.GetId(), r)
				}
				got, err := s.ReadChunk(storage.ContainerID(b.ContainerID), storage.LocalID(b.LocalID), 0, int64(b.Length))
				if err != nil {
					return fmt.Sprintf("block %d/%d on datanode %d: %v", b.ContainerID, b.LocalID, r, err)
				}
				if !bytes.Equal(got, want[b.Offset:b.Offset+b.Length]) {
					return fmt.Sprintf("block %d/%d on datanode %d: wrong data", b.ContainerID, b.LocalID, r)
				}
			}
		}
	}
	return ""
}

func readAll(r io.ReadCloser) ([]byte, error) {
	defer r.Close()
	return io.ReadAll(onlyReader{r})
}
