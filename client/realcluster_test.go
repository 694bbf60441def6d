//go:build realcluster

// Run with: go test -tags realcluster -run TestRealCluster ./client/
// It exercises the client against the real datanodes of internal/cluster;
// the lead's integration package owns the permanent end-to-end tests.
package client_test

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
)

func TestRealCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cl, err := cluster.Start(ctx, cluster.Config{Dir: t.TempDir(), Datanodes: 4,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.WaitWritable(ctx); err != nil {
		t.Fatal(err)
	}
	c, err := client.New(client.Config{MetaAddrs: []string{cl.MetaAddr()}, Credentials: cl.ClientCredentials(), Location: "/dc1/rack1", ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", client.BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 10<<20+12345)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	start := time.Now()
	ki, err := c.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(data), client.PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("put %d bytes in %d blocks in %v", ki.Size, len(ki.Blocks), time.Since(start))
	start = time.Now()
	kr, err := c.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if _, err := io.Copy(&out, kr); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), data) {
		t.Fatal("content differs")
	}
	t.Logf("get in %v", time.Since(start))
	p := make([]byte, 100000)
	if _, err := kr.ReadAt(p, 5<<20-777); err != nil || !bytes.Equal(p, data[5<<20-777:5<<20-777+100000]) {
		t.Fatalf("ReadAt across blocks: %v", err)
	}
	// A datanode dies mid-life: writes go elsewhere, reads fail over.
	if err := cl.StopDatanode(0); err != nil {
		t.Fatal(err)
	}
	ki2, err := c.PutKey(ctx, "vol", "bkt", "k2", bytes.NewReader(data), client.PutOptions{})
	if err != nil {
		t.Fatalf("put with datanode 0 stopped: %v", err)
	}
	t.Logf("put with a stopped datanode: %d blocks", len(ki2.Blocks))
	for _, k := range []string{"k", "k2"} {
		kr, err := c.GetKey(ctx, "vol", "bkt", k)
		if err != nil {
			t.Fatal(err)
		}
		out.Reset()
		if _, err := io.Copy(&out, kr); err != nil || !bytes.Equal(out.Bytes(), data) {
			t.Fatalf("get %s with datanode 0 stopped: %v", k, err)
		}
	}
}
