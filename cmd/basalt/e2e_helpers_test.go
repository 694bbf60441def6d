package main

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
)

// binaryAndCluster builds the basalt binary and starts a small in-process
// cluster for tests that run the real commands against it. It skips in
// -short mode; the cluster closes when the test ends.
func binaryAndCluster(t *testing.T) (dir, bin string, c *cluster.Cluster) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary and starts a cluster")
	}
	dir = t.TempDir()
	bin = filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: filepath.Join(dir, "cluster"), HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 8 << 20, ContainerSize: 256 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return dir, bin, c
}
