package main

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
)

// TestAdminContainerRecoverRefusesHealthy runs the real binary's `basalt
// admin container recover` against a cluster (the admin client's
// certificate): for a container none of whose replicas is unhealthy it
// fails with SCM's reason and changes nothing; for an unknown container it
// says not found. (The full recovery, with an apply bug injected into every
// replica, is internal/datanode's TestRecoverContainerEndToEnd: the bug
// needs a test hook inside the datanode.)
func TestAdminContainerRecoverRefusesHealthy(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and starts a cluster")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: filepath.Join(dir, "cluster"), HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 8 << 20, ContainerSize: 256 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 20 * time.Second})
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
	if _, err := cl.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(bytes.Repeat([]byte("basalt"), 100<<10)), client.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	st, err := cl.StatKey(ctx, "vol", "bkt", "k")
	if err != nil || len(st.Blocks) == 0 {
		t.Fatalf("stat: %+v %v", st, err)
	}
	run := func(args ...string) (string, string, error) {
		cmd := exec.Command(bin, append(append([]string{"admin", "container", "recover"}, args...), "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		return out.String(), errb.String(), err
	}
	cid := strconv.FormatUint(st.Blocks[0].ContainerID, 10)
	_, stderr, err := run(cid)
	if err == nil || !strings.Contains(stderr, "no replica of it is recorded unhealthy") {
		t.Fatalf("recover of a healthy container: %v, stderr %q; want a failure: no replica is unhealthy", err, stderr)
	}
	_, stderr, err = run("999999")
	if err == nil || !strings.Contains(stderr, "not found") {
		t.Fatalf("recover of an unknown container: %v, stderr %q", err, stderr)
	}
	if r, err := cl.GetKey(ctx, "vol", "bkt", "k"); err != nil {
		t.Fatalf("the object after the refused recovery: %v", err)
	} else {
		r.Close()
	}
}
