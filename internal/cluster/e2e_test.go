package cluster_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// These tests run a real cluster in the test process: the metadata
// service and datanodes over loopback, with real Raft, Pebble and disks.

func start(t *testing.T, dir string, datanodes int, blockSize uint64) *cluster.Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: datanodes,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: blockSize, ContainerSize: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func newClient(t *testing.T, c *cluster.Cluster, location string) *client.Client {
	t.Helper()
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), Location: location, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func makeBucket(t *testing.T, cl *client.Client, vol, bkt string) {
	t.Helper()
	ctx := context.Background()
	if _, err := cl.CreateVolume(ctx, vol, ""); err != nil && !errors.Is(err, client.ErrExists) {
		t.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, vol, bkt, client.BucketOptions{}); err != nil && !errors.Is(err, client.ErrExists) {
		t.Fatal(err)
	}
}

func randData(seed int64, n int) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

// onlyReader hides io.WriterTo/Len so the client sees a stream of unknown
// length.
type onlyReader struct{ r io.Reader }

func (o onlyReader) Read(p []byte) (int, error) { return o.r.Read(p) }

func put(t *testing.T, cl *client.Client, key string, data []byte) client.KeyInfo {
	t.Helper()
	ki, err := cl.PutKey(context.Background(), "vol", "bkt", key, onlyReader{bytes.NewReader(data)}, client.PutOptions{})
	if err != nil {
		t.Fatalf("put %s (%d bytes): %v", key, len(data), err)
	}
	return ki
}

func get(t *testing.T, cl *client.Client, key string) []byte {
	t.Helper()
	r, err := cl.GetKey(context.Background(), "vol", "bkt", key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	defer r.Close()
	b, err := io.ReadAll(onlyReader{r})
	if err != nil {
		t.Fatalf("read %s: %v", key, err)
	}
	return b
}

func TestPutGetSizes(t *testing.T) {
	c := start(t, t.TempDir(), 3, 8<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	sizes := []int{0, 1, 64<<10 - 1, 4 << 20, 4<<20 + 1, 8 << 20, 8<<20 + 1, 20<<20 + 7}
	for i, n := range sizes {
		data := randData(int64(i), n)
		key := fmt.Sprintf("size-%d", n)
		ki := put(t, cl, key, data)
		if ki.Size != uint64(n) {
			t.Fatalf("%s: size %d", key, ki.Size)
		}
		if got := get(t, cl, key); !bytes.Equal(got, data) {
			t.Fatalf("%s: read back %d bytes, differing", key, len(got))
		}
		if n == 0 {
			continue
		}
		// Range reads through ReaderAt and Seek.
		r, err := cl.GetKey(context.Background(), "vol", "bkt", key)
		if err != nil {
			t.Fatal(err)
		}
		rnd := rand.New(rand.NewSource(int64(n)))
		for j := 0; j < 5; j++ {
			off := rnd.Intn(n)
			l := 1 + rnd.Intn(min(n-off, 5<<20))
			p := make([]byte, l)
			if _, err := r.ReadAt(p, int64(off)); err != nil && err != io.EOF {
				t.Fatalf("%s: ReadAt(%d, %d): %v", key, off, l, err)
			}
			if !bytes.Equal(p, data[off:off+l]) {
				t.Fatalf("%s: ReadAt(%d, %d) differs", key, off, l)
			}
		}
		if _, err := r.Seek(int64(n/2), io.SeekStart); err != nil {
			t.Fatal(err)
		}
		rest, err := io.ReadAll(onlyReader{r})
		if err != nil || !bytes.Equal(rest, data[n/2:]) {
			t.Fatalf("%s: read after seek: %v", key, err)
		}
		r.Close()
	}
	// A key spanning several blocks has several blocks.
	st, err := cl.StatKey(context.Background(), "vol", "bkt", "size-20971527")
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Blocks) < 3 {
		t.Fatalf("20 MiB key with 8 MiB blocks has %d blocks", len(st.Blocks))
	}
}

func TestClusterRestartKeepsData(t *testing.T) {
	dir := t.TempDir()
	c := start(t, dir, 3, 8<<20)
	cl := newClient(t, c, "")
	makeBucket(t, cl, "vol", "bkt")
	want := map[string][]byte{}
	for i, n := range []int{1000, 5 << 20, 17 << 20} {
		k := fmt.Sprintf("k%d", i)
		want[k] = randData(int64(100+i), n)
		put(t, cl, k, want[k])
	}
	cl.Close()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	c = start(t, dir, 3, 8<<20)
	defer c.Close()
	cl = newClient(t, c, "")
	for k, v := range want {
		if got := get(t, cl, k); !bytes.Equal(got, v) {
			t.Fatalf("after restart %s differs", k)
		}
	}
	// And the restarted cluster takes writes.
	put(t, cl, "after", randData(7, 3<<20))
}

// killingReader stops a datanode once n bytes have been read from it.
type killingReader struct {
	r     io.Reader
	read  atomic.Int64
	at    int64
	kill  func()
	fired atomic.Bool
}

func (k *killingReader) Read(p []byte) (int, error) {
	n, err := k.r.Read(p)
	if k.read.Add(int64(n)) >= k.at && k.fired.CompareAndSwap(false, true) {
		k.kill()
	}
	return n, err
}

func TestDatanodeKilledMidWrite(t *testing.T) {
	if testing.Short() {
		t.Skip("300 MiB write")
	}
	c := start(t, t.TempDir(), 5, 32<<20)
	defer c.Close()
	cl := newClient(t, c, "")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(42, 300<<20)
	// Kill the leader of a pipeline in use: the datanode that leads the
	// pipeline of the first allocated block is not known from outside, so
	// kill every datanode's chance: stop the one that has written the most
	// chunks so far (it is in the pipeline being written).
	kr := &killingReader{r: bytes.NewReader(data), at: 100 << 20, kill: func() {
		best, bestN := -1, uint64(0)
		for i := range 5 {
			if dn := c.Datanode(i); dn != nil {
				if n := dn.ChunksWritten(); n > bestN {
					best, bestN = i, n
				}
			}
		}
		t.Logf("stopping datanode %d (had written %d chunks)", best+1, bestN)
		go c.StopDatanode(best)
	}}
	// V1: the victim is picked by its V1 chunk counter (V2's equivalent is
	// TestV2DatanodeKilledMidStream).
	ki, err := cl.PutKey(context.Background(), "vol", "bkt", "big", kr, client.PutOptions{Pipeline: client.PipelineV1})
	if err != nil {
		t.Fatalf("put with a datanode killed mid-write: %v", err)
	}
	if ki.Size != uint64(len(data)) {
		t.Fatalf("size %d", ki.Size)
	}
	got := get(t, cl, "big")
	if sha256.Sum256(got) != sha256.Sum256(data) {
		t.Fatal("300 MiB key read back differs")
	}
}

func TestReadWithReplicaDown(t *testing.T) {
	c := start(t, t.TempDir(), 3, 8<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(3, 12<<20)
	put(t, cl, "k", data)
	st, err := cl.StatKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	// Stop the replica the client would read first.
	first := st.Blocks[0].Replicas[0].ID
	for i := range 3 {
		if dn := c.Datanode(i); dn != nil && dn.ID() == first {
			c.StopDatanode(i)
		}
	}
	if got := get(t, cl, "k"); !bytes.Equal(got, data) {
		t.Fatal("read with a replica down differs")
	}
}

func TestCorruptReplicaIsSkippedAndReported(t *testing.T) {
	dir := t.TempDir()
	c := start(t, dir, 3, 8<<20)
	defer c.Close()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(4, 6<<20)
	put(t, cl, "k", data)
	st, err := cl.StatKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	b := st.Blocks[0]
	// Corrupt every replica but the farthest: replicas at the same distance
	// may come in either order, so whichever the reader tries first is
	// corrupt, and only the last one has good data.
	victims := map[uint64]bool{}
	for _, r := range b.Replicas[:len(b.Replicas)-1] {
		victims[r.ID] = true
	}
	for i := range 3 {
		if !victims[c.Datanode(i).ID()] {
			continue
		}
		path := filepath.Join(dir, fmt.Sprintf("dn%d", i+1), "data", "basalt", "containers", fmt.Sprint(b.ContainerID), fmt.Sprintf("%d.block", b.LocalID))
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		one := []byte{0}
		f.ReadAt(one, 5<<20)
		one[0] ^= 0xff
		f.WriteAt(one, 5<<20)
		f.Sync()
		f.Close()
	}
	if got := get(t, cl, "k"); !bytes.Equal(got, data) {
		t.Fatal("read with a corrupt replica returned wrong data")
	}
	resp, err := cl.Scm().ListCorruptReplicas(context.Background(), &metapb.ListCorruptReplicasRequest{})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, r := range resp.GetReplicas() {
		// A whole-replica report (local ID 0: the scrubber or a read
		// marked the victim's container UNHEALTHY) names the container only.
		if lid := r.GetBlock().GetLocalId(); !victims[r.GetDatanodeId()] || r.GetBlock().GetContainerId() != b.ContainerID || (lid != b.LocalID && lid != 0) {
			t.Fatalf("reported a replica that is not corrupt: %v", r)
		}
		found = true
	}
	if !found {
		t.Fatalf("corruption of block %d/%d on datanodes %v not reported to SCM: %v", b.ContainerID, b.LocalID, victims, resp.GetReplicas())
	}
}

// TestSmallKeysOneEntry: keys whose whole data fits in one chunk go as one
// PutSmallFile (one call, one pipeline Raft entry per block); the others
// take the usual paths. All read back identically, also with the nearest
// replica stopped (so from another replica).
func TestSmallKeysOneEntry(t *testing.T) {
	c := start(t, t.TempDir(), 3, 8<<20)
	defer c.Close()
	const chunk = 1 << 20
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), Location: "/dc1/rack1", ChunkSize: chunk,
		RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	makeBucket(t, cl, "vol", "bkt")
	smallFiles := func() uint64 {
		var n uint64
		for i := range 3 {
			if dn := c.Datanode(i); dn != nil {
				n += dn.SmallFiles()
			}
		}
		return n
	}
	sizes := []struct {
		n     int
		small bool // one PutSmallFile
	}{{0, false}, {1, true}, {4096, true}, {chunk - 1, true}, {chunk, true}, {chunk + 1, false}}
	for i, sz := range sizes {
		data := randData(int64(1000+i), sz.n)
		key := fmt.Sprintf("small-%d", sz.n)
		before := smallFiles()
		ki := put(t, cl, key, data)
		if ki.Size != uint64(sz.n) {
			t.Fatalf("%s: size %d", key, ki.Size)
		}
		want := uint64(0)
		if sz.small {
			want = 3 // one commit on each replica
		}
		if got := smallFiles() - before; got != want {
			t.Fatalf("%s: %d small-file commits on the datanodes, want %d", key, got, want)
		}
		if got := get(t, cl, key); !bytes.Equal(got, data) {
			t.Fatalf("%s: read back %d bytes, differing", key, len(got))
		}
		st, err := cl.StatKey(context.Background(), "vol", "bkt", key)
		if err != nil {
			t.Fatal(err)
		}
		if sz.small && (len(st.Blocks) != 1 || st.Blocks[0].Length != uint64(sz.n)) {
			t.Fatalf("%s: blocks %+v, want one of %d bytes", key, st.Blocks, sz.n)
		}
	}
	// Stop the replica the client reads first for a small key: the others
	// have identical copies.
	st, err := cl.StatKey(context.Background(), "vol", "bkt", "small-4096")
	if err != nil {
		t.Fatal(err)
	}
	first := st.Blocks[0].Replicas[0].ID
	for i := range 3 {
		if dn := c.Datanode(i); dn != nil && dn.ID() == first {
			c.StopDatanode(i)
		}
	}
	for i, sz := range sizes {
		if got := get(t, cl, fmt.Sprintf("small-%d", sz.n)); !bytes.Equal(got, randData(int64(1000+i), sz.n)) {
			t.Fatalf("small-%d with replica %d down: read back differs", sz.n, first)
		}
	}
}
