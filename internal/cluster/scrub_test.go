package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// blockFile is the path of a block's file on datanode i (0-based) of a
// cluster in dir.
func blockFile(dir string, i int, cid, lid uint64) string {
	return filepath.Join(dir, fmt.Sprintf("dn%d", i+1), "data", "basalt", "containers", fmt.Sprint(cid), fmt.Sprintf("%d.block", lid))
}

// dnIndex returns the index of the datanode with ID id.
func dnIndex(t *testing.T, c *cluster.Cluster, n int, id uint64) (int, *datanode.Datanode) {
	t.Helper()
	for i := range n {
		if dn := c.Datanode(i); dn != nil && dn.ID() == id {
			return i, dn
		}
	}
	t.Fatalf("no datanode %d", id)
	return -1, nil
}

func scrubNow(t *testing.T, dn *datanode.Datanode) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := dn.Scrub(ctx); err != nil {
		t.Fatalf("scrub datanode %d: %v", dn.ID(), err)
	}
}

func waitHealed(t *testing.T, c *cluster.Cluster, cl *client.Client, data map[string][]byte, bad, only uint64, since time.Time, bound time.Duration) {
	t.Helper()
	for {
		missing := unhealed(t, c, cl, data, bad, only)
		if missing == "" {
			t.Logf("repaired %v after the fault", time.Since(since).Round(time.Millisecond))
			return
		}
		if time.Since(since) > bound {
			h, _ := cl.Scm().GetContainerHealth(context.Background(), &metapb.GetContainerHealthRequest{Worst: 50})
			t.Fatalf("not repaired within %v: %s\nhealth: %v", bound, missing, h)
		}
		for k, want := range data {
			if got := get(t, cl, k); !bytes.Equal(got, want) {
				t.Fatalf("key %s: wrong data during the repair", k)
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// TestScrubberFindsFlippedBytes: bytes flipped in one replica's block file
// on disk, with no client reading it, are found by that datanode's
// scrubber: the container is UNHEALTHY there, SCM hears of it (the
// datanode's ReportCorruptReplica), and the replication manager replaces
// the replica, so the block ends with 3 replicas that read back
// correctly, none of them the corrupt one.
func TestScrubberFindsFlippedBytes(t *testing.T) {
	const bound = 40 * time.Second
	dir := t.TempDir()
	c := start(t, dir, 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := map[string][]byte{"k": randData(11, 6<<20)}
	put(t, cl, "k", data["k"])
	ctx := context.Background()
	st, err := cl.StatKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	b := st.Blocks[1] // the 2 MiB tail block
	victim := b.Replicas[0].ID
	vi, dn := dnIndex(t, c, 5, victim)
	f, err := os.OpenFile(blockFile(dir, vi, b.ContainerID, b.LocalID), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{0xde, 0xad}, 1<<20+5); err != nil {
		t.Fatal(err)
	}
	f.Sync()
	f.Close()
	faulted := time.Now()
	before := dn.ScrubStats()
	scrubNow(t, dn)
	after := dn.ScrubStats()
	if after.Checksum != before.Checksum+1 {
		t.Fatalf("scrubber findings %+v -> %+v: the flipped bytes were not found", before, after)
	}
	if r, err := dn.Store().Container(storage.ContainerID(b.ContainerID)); err != nil || r.State != storage.StateUnhealthy {
		t.Fatalf("container %d on datanode %d: %+v, %v", b.ContainerID, victim, r, err)
	}
	// SCM heard of it from the datanode (no client read the block).
	for {
		resp, err := cl.Scm().ListCorruptReplicas(ctx, &metapb.ListCorruptReplicasRequest{})
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, r := range resp.GetReplicas() {
			if r.GetDatanodeId() != victim || r.GetBlock().GetContainerId() != b.ContainerID {
				t.Fatalf("reported a replica that is not corrupt: %v", r)
			}
			found = found || strings.Contains(r.GetReason(), "scrubber")
		}
		if found {
			break
		}
		if time.Since(faulted) > bound {
			t.Fatalf("scrubber finding not reported to SCM: %v", resp.GetReplicas())
		}
		time.Sleep(50 * time.Millisecond)
	}
	waitHealed(t, c, cl, data, victim, b.ContainerID, faulted, bound)
}

// TestMissingBlockFileFailsOnlyThatReplica: one block file deleted on a
// datanode fails that container's replica there (UNHEALTHY, repaired
// elsewhere) and nothing else: the volume stays healthy and the other
// containers on it stay readable from that datanode. Before, the read of
// the missing file failed the whole volume and nothing was rebuilt.
func TestMissingBlockFileFailsOnlyThatReplica(t *testing.T) {
	const bound = 40 * time.Second
	dir := t.TempDir()
	c := start(t, dir, 5, 4<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	ctx := context.Background()
	data := map[string][]byte{}
	// Write until one datanode holds blocks of two containers.
	type loc struct{ cid, lid, off, n uint64 }
	var victim uint64
	var held map[uint64]map[uint64][]loc // datanode -> container -> blocks
	for i := 0; victim == 0; i++ {
		if i == 40 {
			t.Fatal("no datanode holds two containers after 40 keys")
		}
		k := fmt.Sprintf("k%02d", i)
		data[k] = randData(int64(300+i), 300<<10+i*(97<<10))
		put(t, cl, k, data[k])
		held = map[uint64]map[uint64][]loc{}
		for k := range data {
			st, err := cl.StatKey(ctx, "vol", "bkt", k)
			if err != nil {
				t.Fatal(err)
			}
			for _, b := range st.Blocks {
				for _, r := range b.Replicas {
					if held[r.ID] == nil {
						held[r.ID] = map[uint64][]loc{}
					}
					held[r.ID][b.ContainerID] = append(held[r.ID][b.ContainerID], loc{b.ContainerID, b.LocalID, b.Offset, b.Length})
				}
			}
		}
		for id, cs := range held {
			if len(cs) >= 2 {
				victim = id
			}
		}
	}
	vi, dn := dnIndex(t, c, 5, victim)
	var lost loc
	for _, bs := range held[victim] {
		lost = bs[0]
		break
	}
	if err := os.Remove(blockFile(dir, vi, lost.cid, lost.lid)); err != nil {
		t.Fatal(err)
	}
	faulted := time.Now()
	scrubNow(t, dn)
	if s := dn.ScrubStats(); s.Missing != 1 {
		t.Fatalf("scrubber stats %+v: the missing file was not found", s)
	}
	for _, v := range dn.Store().Volumes() {
		if v.Failed {
			t.Fatalf("volume %s failed by one missing block file: %s", v.Path, v.Error)
		}
	}
	if r, _ := dn.Store().Container(storage.ContainerID(lost.cid)); r.State != storage.StateUnhealthy {
		t.Fatalf("container %d on datanode %d is %v", lost.cid, victim, r.State)
	}
	// Every other container on the volume still reads back from this
	// datanode, and stays healthy.
	keyOf := map[uint64][]byte{}
	for k, d := range data {
		st, _ := cl.StatKey(ctx, "vol", "bkt", k)
		for _, b := range st.Blocks {
			keyOf[b.LocalID] = d
		}
	}
	others := 0
	for cid, bs := range held[victim] {
		if cid == lost.cid {
			continue
		}
		r, err := dn.Store().Container(storage.ContainerID(cid))
		if err != nil || r.State == storage.StateUnhealthy {
			t.Fatalf("container %d on the same volume: %+v %v", cid, r, err)
		}
		for _, b := range bs {
			got, err := dn.Store().ReadChunk(storage.ContainerID(cid), storage.LocalID(b.lid), 0, int64(b.n))
			if err != nil {
				t.Fatalf("block %d/%d on the same volume: %v", cid, b.lid, err)
			}
			if !bytes.Equal(got, keyOf[b.lid][b.off:b.off+b.n]) {
				t.Fatalf("block %d/%d: wrong data", cid, b.lid)
			}
			others++
		}
	}
	t.Logf("datanode %d: block %d/%d file removed; %d blocks of %d other containers on the volume read back", victim, lost.cid, lost.lid, others, len(held[victim])-1)
	waitHealed(t, c, cl, data, victim, lost.cid, faulted, bound)
}

// TestFailedVolumeIsRepairedElsewhere: a datanode's volume starts
// refusing to create and write files (EIO; its Pebble DB is left alone,
// as a failing WAL would stop the process): the periodic health check
// (run here at once) fails the volume, the datanode reports its
// containers UNHEALTHY, and every one is rebuilt on other datanodes while
// reads keep working.
func TestFailedVolumeIsRepairedElsewhere(t *testing.T) {
	const bound = 60 * time.Second
	dir := t.TempDir()
	ffs := vfs.NewFaultFS(vfs.Default)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	reg := prometheus.NewRegistry()
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: 5,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20, Storage: storage.Options{FS: ffs}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := map[string][]byte{}
	for i := range 10 {
		k := fmt.Sprintf("k%02d", i)
		data[k] = randData(int64(500+i), 300<<10+i*(400<<10))
		put(t, cl, k, data[k])
	}
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
	victim := uint64(0)
	for id, n := range held {
		if victim == 0 || n > held[victim] {
			victim = id
		}
	}
	vi, dn := dnIndex(t, c, 5, victim)
	vol := filepath.Join(dir, fmt.Sprintf("dn%d", vi+1), "data", "basalt")
	ffs.SetInject(func(op, path string) error {
		if strings.HasPrefix(path, vol+string(filepath.Separator)) && !strings.HasPrefix(path, filepath.Join(vol, "meta")) &&
			(op == "create" || op == "open" || op == "write" || op == "sync" || op == "mkdir") {
			return syscall.EIO
		}
		return nil
	})
	faulted := time.Now()
	res := dn.CheckVolumes()
	if len(res) != 1 || !res[0].NewlyFailed {
		t.Fatalf("health check of the failing volume: %+v", res)
	}
	t.Logf("datanode %d (holds %d block replicas): volume failed: %v", victim, held[victim], res[0].Err)
	for _, r := range dn.Store().ListContainers() {
		if r.State != storage.StateUnhealthy {
			t.Fatalf("container %d on the failed volume reported %v", r.ID, r.State)
		}
	}
	// The failure is exported for alerting, on this datanode only.
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["role"] != "datanode" {
				continue
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			seen[fmt.Sprintf("%s{dn=%s,result=%s}", mf.GetName(), labels["datanode"], labels["result"])] += v
		}
	}
	for i := range 5 {
		failed, want := seen[fmt.Sprintf("basalt_datanode_volumes_failed{dn=%d,result=}", i+1)], 0.0
		if i == vi {
			want = 1
		}
		if failed != want {
			t.Fatalf("datanode %d: basalt_datanode_volumes_failed = %v, want %v (%v)", i+1, failed, want, seen)
		}
	}
	if n := seen[fmt.Sprintf("basalt_datanode_volume_checks_total{dn=%d,result=failed}", vi+1)]; n != 1 {
		t.Fatalf("volume_checks_total{result=failed} = %v", n)
	}
	if _, ok := seen[fmt.Sprintf("basalt_datanode_scrub_bytes_total{dn=%d,result=}", vi+1)]; !ok {
		t.Fatalf("no scrubber metrics: %v", seen)
	}
	for k, want := range data {
		if got := get(t, cl, k); !bytes.Equal(got, want) {
			t.Fatalf("key %s: wrong data after the volume failed", k)
		}
	}
	waitHealed(t, c, cl, data, victim, 0, faulted, bound)
}

// TestReadFindingIsReverified: a client read that meets a corrupt replica
// makes that datanode verify the whole block at once (outside the
// scrubber's rate): the finding is confirmed, counted, and the container
// marked UNHEALTHY there, without waiting for the next pass. Replicas
// that were not damaged stay healthy.
func TestReadFindingIsReverified(t *testing.T) {
	dir := t.TempDir()
	c := start(t, dir, 3, 8<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(21, 5<<20)
	put(t, cl, "k", data)
	st, err := cl.StatKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	b := st.Blocks[0]
	// Every replica but the last is corrupt, so the read meets one.
	victims := map[uint64]bool{}
	for _, r := range b.Replicas[:len(b.Replicas)-1] {
		victims[r.ID] = true
		vi, _ := dnIndex(t, c, 3, r.ID)
		f, err := os.OpenFile(blockFile(dir, vi, b.ContainerID, b.LocalID), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteAt([]byte{1, 2, 3}, 3<<20)
		f.Close()
	}
	if got := get(t, cl, "k"); !bytes.Equal(got, data) {
		t.Fatal("read returned wrong data")
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		confirmed := 0
		for i := range 3 {
			dn := c.Datanode(i)
			r, err := dn.Store().Container(storage.ContainerID(b.ContainerID))
			if err != nil {
				t.Fatal(err)
			}
			bad := r.State == storage.StateUnhealthy
			if bad && !victims[dn.ID()] {
				t.Fatalf("intact replica on datanode %d marked UNHEALTHY", dn.ID())
			}
			if bad && dn.ScrubStats().Checksum == 1 {
				confirmed++
			}
		}
		if confirmed > 0 {
			t.Logf("%d corrupt replica(s) confirmed by re-verification after the read", confirmed)
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the corrupt replica the read met was not re-verified and marked")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
