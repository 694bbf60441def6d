package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// realCluster is a real metadata node and real datanodes (Raft, Pebble,
// storage, gRPC over loopback) in this process, started without waiting
// for anything: the tests below decide what they wait for.
type realCluster struct {
	meta *meta.Server
	dns  []*datanode.Datanode
	fs   []*vfs.FaultFS // each datanode's data volume file system
	// creds is a client certificate of the test cluster's CA.
	creds *pki.Credentials
}

func startReal(t *testing.T, ctx context.Context, n int) *realCluster {
	t.Helper()
	dir := t.TempDir()
	reg := prometheus.NewRegistry()
	prov, err := pki.NewProvisioner(filepath.Join(dir, "tls"))
	if err != nil {
		t.Fatal(err)
	}
	creds := func(role pki.Role, id string) *pki.Credentials {
		c, err := prov.Credentials(pki.Identity{Role: role, ID: id})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	ms, err := meta.New(meta.Config{TLS: creds(pki.RoleMeta, "1"), Admins: []string{"gray-test"},
		NodeID: 1, DataDir: filepath.Join(dir, "meta"), TickInterval: 50 * time.Millisecond,
		SCM: scm.Config{HeartbeatInterval: 200 * time.Millisecond, StaleInterval: 10 * time.Second, DeadInterval: 30 * time.Second,
			BlockSize: 4 << 20, ContainerSize: 256 << 20, SafeModeMinDatanodes: 3, LoopInterval: 200 * time.Millisecond},
		Namespace:  namespace.Config{},
		Registerer: prometheus.WrapRegistererWith(prometheus.Labels{"role": "meta"}, reg),
		Logger:     quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ms.Start(); err != nil {
		ms.Close()
		t.Fatal(err)
	}
	rc := &realCluster{meta: ms, creds: creds(pki.RoleClient, "gray-test")}
	t.Cleanup(func() {
		for _, d := range rc.dns {
			d.Close()
		}
		ms.Close()
	})
	for i := range n {
		ffs := vfs.NewFaultFS(vfs.Default)
		loc := "/dc1/rack1"
		if i >= (n+1)/2 {
			loc = "/dc1/rack2"
		}
		var u [16]byte
		rand.Read(u[:])
		d, err := datanode.New(datanode.Config{TLS: creds(pki.RoleDatanode, hex.EncodeToString(u[:])),
			DataDir: filepath.Join(dir, fmt.Sprintf("dn%d", i+1)), Location: loc, Hostname: fmt.Sprintf("dn%d", i+1),
			MetaAddrs: []string{ms.GRPCAddr()}, ListenAddr: "127.0.0.1:0", RaftAddr: "127.0.0.1:0", StreamAddr: "127.0.0.1:0",
			TickInterval: 50 * time.Millisecond,
			Storage:      storage.Options{FS: ffs, ContainerSize: 256 << 20},
			Registerer:   prometheus.WrapRegistererWith(prometheus.Labels{"role": "datanode", "datanode": fmt.Sprint(i + 1)}, reg),
			Logger:       quiet,
		})
		if err != nil {
			t.Fatal(err)
		}
		rc.dns = append(rc.dns, d)
		rc.fs = append(rc.fs, ffs)
	}
	for i, d := range rc.dns {
		if err := d.Start(ctx); err != nil {
			t.Fatalf("datanode %d: %v", i+1, err)
		}
	}
	return rc
}

// TestWriteWaitsForPipelinesAtStartup (issue 12): a write issued the moment
// the datanodes have registered, while SCM is still in safe mode or its
// pipelines have no leaders yet, waits for them and succeeds. The old
// client spent its 3 retries in about 10 ms and failed with "no open
// THREE pipeline".
func TestWriteWaitsForPipelinesAtStartup(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rc := startReal(t, ctx, 3)
	c, err := New(Config{MetaAddrs: []string{rc.meta.GRPCAddr()}, Credentials: rc.creds, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	sm, err := c.Scm().GetSafeMode(ctx, &metapb.GetSafeModeRequest{})
	if err != nil {
		t.Fatal(err)
	}
	pl, err := c.Scm().ListPipelines(ctx, &metapb.ListPipelinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("at the first write: safe mode %v, %d pipelines listed", sm.GetInSafeMode(), len(pl.GetPipelines()))
	start := time.Now()
	data := randBytes(7, 100<<10)
	if _, err := c.PutKey(ctx, "vol", "bkt", "first", bytes.NewReader(data), PutOptions{}); err != nil {
		t.Fatalf("first write after start-up (after %v): %v", time.Since(start), err)
	}
	t.Logf("first write took %v", time.Since(start))
	if got := getAll(t, c, "first"); !bytes.Equal(got, data) {
		t.Fatal("content differs")
	}
}

// TestFullDatanodeExcludedClientWide (issue 12): a datanode whose disk is
// full fails the writes that reach it; the client excludes the datanode
// itself (not only the container), for the whole client: later keys are
// not placed on it and every write succeeds. The old client excluded the
// container only, per key, so every key paid for the full datanode again.
func TestFullDatanodeExcludedClientWide(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	rc := startReal(t, ctx, 5)
	retries := &retryCounter{}
	c, err := New(Config{MetaAddrs: []string{rc.meta.GRPCAddr()}, Credentials: rc.creds, Logger: slog.New(retries), ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	// Warm up: containers exist on every pipeline before the disk fills.
	put := func(name string, size int, o PutOptions) (KeyInfo, error) {
		return c.PutKey(ctx, "vol", "bkt", name, bytes.NewReader(randBytes(uint64(len(name)*size), size)), o)
	}
	for i := range 30 {
		if _, err := put(fmt.Sprintf("warm%d", i), 8<<10, PutOptions{}); err != nil {
			t.Fatalf("warm-up write %d: %v", i, err)
		}
	}
	// Fill the disk of the datanode that leads the most pipelines.
	full := 0
	most := -1
	pl, err := c.Scm().ListPipelines(ctx, &metapb.ListPipelinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range rc.dns {
		lead := 0
		for _, p := range pl.GetPipelines() {
			if d.IsPipelineLeader(p.GetId()) {
				lead++
			}
		}
		if lead > most {
			full, most = i, lead
		}
	}
	fullID := rc.dns[full].ID()
	rc.fs[full].SetCapacity(&vfs.DiskUsage{TotalBytes: 1 << 30, AvailBytes: 1 << 10, UsedBytes: 1<<30 - 1<<10})
	t.Logf("datanode %d (ID %d, leads %d pipelines) is full now", full+1, fullID, most)

	excludedAt := -1
	for i := range 40 {
		o := PutOptions{}
		size := 8 << 10
		if i%4 == 3 {
			size, o.Pipeline = 3<<20, PipelineV2
		}
		_, err := put(fmt.Sprintf("k%d", i), size, o)
		if err != nil {
			t.Fatalf("write %d with datanode %d full: %v", i, full+1, err)
		}
		dns, _, _ := c.Excluded()
		if excludedAt < 0 {
			for _, d := range dns {
				if d == fullID {
					excludedAt = i
					retries.n.Store(0)
				}
			}
			continue
		}
		// Once excluded, no new key goes to the full datanode.
		ki, err := c.StatKey(ctx, "vol", "bkt", fmt.Sprintf("k%d", i))
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range ki.Blocks {
			for _, r := range b.Replicas {
				if r.ID == fullID {
					t.Fatalf("key k%d written after datanode %d was excluded (at k%d) has a replica on it", i, fullID, excludedAt)
				}
			}
		}
	}
	if excludedAt < 0 {
		t.Fatalf("datanode %d never excluded client-wide", fullID)
	}
	t.Logf("datanode %d excluded client-wide after key k%d", fullID, excludedAt)
	// The keys after it never met the full datanode: no retries at all.
	if n := retries.n.Load(); n > 0 {
		t.Fatalf("%d block retries after datanode %d was excluded client-wide", n, fullID)
	}
}

// retryCounter is a slog handler counting the client's "retrying on a
// new block" warnings.
type retryCounter struct{ n atomic.Int64 }

func (r *retryCounter) Enabled(context.Context, slog.Level) bool { return true }
func (r *retryCounter) Handle(_ context.Context, rec slog.Record) error {
	if strings.Contains(rec.Message, "retrying on a new block") {
		r.n.Add(1)
	}
	return nil
}
func (r *retryCounter) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *retryCounter) WithGroup(string) slog.Handler      { return r }
