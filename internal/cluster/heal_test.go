package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
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
		missing = unhealed(t, c, cl, data, victim)
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

// unhealed returns "" when every block of every key has exactly 3
// recorded healthy replicas, none on the dead datanode, and each of those
// datanodes holds the block's bytes; otherwise what is not yet so.
func unhealed(t *testing.T, c *cluster.Cluster, cl *client.Client, data map[string][]byte, dead uint64) string {
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
			if len(ct.GetReplicas()) != 3 || len(ct.GetUnhealthyReplicas()) != 0 || slices.Contains(ct.GetReplicas(), dead) {
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
