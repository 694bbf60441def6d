package datanode_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

func getAll(ctx context.Context, cl *client.Client, key string) ([]byte, error) {
	r, err := cl.GetKey(ctx, "vol", "bkt", key)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return io.ReadAll(r)
}

// TestRecoverContainerEndToEnd: the operator path for a deterministic
// apply bug, through a real cluster (meta with SCM, three datanodes). An
// object is PUT; then every committed entry into its container fails in
// apply on every replica (the bug), so the container goes UNHEALTHY on all
// three, SCM counts it missing and the object cannot be read. With the
// bug gone (the fixed binary), `basalt admin container recover ID --wait
// --json` (the real binary, over the admin RPC) brings it back: the datanodes leave the
// closed pipeline, verify their replicas and report them CLOSED, SCM
// counts them again, and GET returns the same bytes; so do the other
// objects whose PUT was acknowledged meanwhile. Without the recovery the
// container stays missing and the object unreadable for good.
func TestRecoverContainerEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/basalt-store/basalt/cmd/basalt").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 240*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: filepath.Join(dir, "cluster"), HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 8 << 20, ContainerSize: 256 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The bug's hook, on every pipeline before any write.
	var bug atomic.Uint64
	hit := func(cid uint64) bool { return cid != 0 && cid == bug.Load() }
	for i := range 3 {
		for deadline := time.Now().Add(60 * time.Second); c.Datanode(i).SetApplyBugForTest(hit) < 2; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("datanode %d runs fewer than 2 pipelines", i)
			}
		}
	}
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, "vol", "bkt", client.BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("basalt recover "), 20<<10)
	if _, err := cl.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(data), client.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	st, err := cl.StatKey(ctx, "vol", "bkt", "k")
	if err != nil || len(st.Blocks) != 1 || len(st.Blocks[0].Replicas) != 3 {
		t.Fatalf("stat: %+v %v (want one block on three replicas)", st, err)
	}
	cid := st.Blocks[0].ContainerID

	// The bug: every entry into the container fails in apply, everywhere.
	bug.Store(cid)
	unhealthy := func() int {
		n := 0
		for i := range 3 {
			if r, err := c.Datanode(i).Store().Container(storage.ContainerID(cid)); err == nil && r.State == storage.StateUnhealthy {
				n++
			}
		}
		return n
	}
	acked := map[string][]byte{}
	for i := 0; unhealthy() < 3; i++ {
		if i == 40 {
			t.Fatalf("after 40 PUTs the bug hit %d replicas of container %d", unhealthy(), cid)
		}
		k := fmt.Sprintf("k%d", i)
		d := bytes.Repeat([]byte(k), 10<<10)
		wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
		_, err := cl.PutKey(wctx, "vol", "bkt", k, bytes.NewReader(d), client.PutOptions{})
		wcancel()
		if err == nil {
			acked[k] = d
		}
	}
	// SCM records the replicas unhealthy: the object can no longer be read.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := getAll(rctx, cl, "k")
		rcancel()
		if err != nil {
			t.Logf("with every replica UNHEALTHY: %v", err)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the object stays readable with every replica of its container UNHEALTHY")
		}
	}

	// The fixed binary; the operator recovers the container with the
	// real command (basalt admin container recover ID --wait --json).
	bug.Store(0)
	cmd := exec.CommandContext(ctx, bin, "admin", "container", "recover", fmt.Sprint(cid), "--wait", "--timeout", "90s", "--json",
		"--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("basalt admin container recover %d --wait: %v\nstdout: %s\nstderr: %s", cid, err, out.String(), errb.String())
	}
	var res struct {
		Done     bool   `json:"done"`
		State    string `json:"state"`
		Replicas []struct {
			Datanode uint64 `json:"datanode"`
			Status   string `json:"status"`
			BCSID    uint64 `json:"bcsid"`
		} `json:"replicas"`
	}
	if err := json.Unmarshal(out.Bytes(), &res); err != nil || !res.Done || res.State != "CLOSED" || len(res.Replicas) != 3 {
		t.Fatalf("recover --json: %v: %s", err, out.String())
	}
	for _, r := range res.Replicas {
		if r.Status != "healthy" {
			t.Fatalf("replica on %d after the recovery: %s, want healthy (%s)", r.Datanode, r.Status, out.String())
		}
	}
	t.Logf("recovered: %s", out.String())
	// Progress answers only for admins; the same RPC through gRPC.
	conn, err := grpc.NewClient(c.MetaAddr(), c.MetaDialOption())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if resp, err := metapb.NewScmClient(conn).RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: cid, StatusOnly: true}); err != nil || !resp.Done {
		t.Fatalf("status after the recovery: %v %v", resp, err)
	}
	for i := range 3 {
		if r, err := c.Datanode(i).Store().Container(storage.ContainerID(cid)); err != nil || r.State != storage.StateClosed {
			t.Fatalf("datanode %d: container %d %+v %v, want CLOSED", i, cid, r, err)
		}
	}
	got, err := getAll(ctx, cl, "k")
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("GET after the recovery: %d bytes, %v (want the %d bytes PUT)", len(got), err, len(data))
	}
	for k, d := range acked {
		if got, err := getAll(ctx, cl, k); err != nil || !bytes.Equal(got, d) {
			t.Fatalf("GET %s (acknowledged while the bug ran): %d bytes, %v", k, len(got), err)
		}
	}
	t.Logf("%d other objects acknowledged meanwhile read back", len(acked))
}
