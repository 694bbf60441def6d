package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestAdminContainerInfoShowsUnhealthyReason runs `basalt admin container
// info ID --json` (the real binary) against an in-process cluster whose
// datanodes' volumes sit on a fault-injecting file system. One replica's
// volume starts failing with EIO and the datanode's health check fails
// it (the path of TestFailedVolumeIsRepairedElsewhere): its containers go
// UNHEALTHY there. The command must show that replica UNHEALTHY with a
// reason naming the cause (the volume and its I/O error), the other
// replicas without one; the table shows the reason too, and `container
// list` the replica SCM recorded unhealthy. (With three datanodes no copy
// can replace the replica, so it stays listed.)
func TestAdminContainerInfoShowsUnhealthyReason(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and starts a cluster")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ffs := vfs.NewFaultFS(vfs.Default)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: filepath.Join(dir, "cluster"), HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 8 << 20, ContainerSize: 256 << 20, Storage: storage.Options{FS: ffs}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, append(append([]string{"admin", "container"}, args...), "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("admin container %v: %v: %s", args, err, errb.String())
		}
		return out.String()
	}
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
	if err != nil || len(st.Blocks) == 0 || len(st.Blocks[0].Replicas) != 3 {
		t.Fatalf("stat: %+v %v (want a block on three replicas)", st, err)
	}
	cid := st.Blocks[0].ContainerID
	victim := st.Blocks[0].Replicas[0].ID
	var dn *datanode.Datanode
	for i := range 3 {
		if d := c.Datanode(i); d != nil && d.ID() == victim {
			dn = d
		}
	}
	if dn == nil {
		t.Fatalf("no datanode %d", victim)
	}
	vol := dn.Store().Volumes()[0].Path
	ffs.SetInject(func(op, path string) error {
		if strings.HasPrefix(path, vol+string(filepath.Separator)) && !strings.HasPrefix(path, filepath.Join(vol, "meta")) &&
			(op == "create" || op == "open" || op == "write" || op == "sync" || op == "mkdir") {
			return syscall.EIO
		}
		return nil
	})
	if res := dn.CheckVolumes(); len(res) != 1 || !res[0].NewlyFailed {
		t.Fatalf("health check of the failing volume: %+v", res)
	}
	type replica struct {
		Datanode uint64 `json:"datanode"`
		Health   string `json:"health"`
		Reported string `json:"reported_state"`
		BCSID    uint64 `json:"bcsid"`
		Reason   string `json:"unhealthy_reason"`
		Recorded string `json:"recorded_reason"`
		Shown    string `json:"reason"`
	}
	var info struct {
		Container struct {
			ID        uint64   `json:"id"`
			Unhealthy []uint64 `json:"unhealthy_replicas"`
		} `json:"container"`
		Replicas []replica `json:"replicas"`
	}
	id := strconv.FormatUint(cid, 10)
	deadline := time.Now().Add(30 * time.Second)
	var bad replica
	for {
		out := run("info", id, "--json")
		info.Replicas = nil
		if err := json.Unmarshal([]byte(out), &info); err != nil {
			t.Fatalf("info --json: %v\n%s", err, out)
		}
		bad = replica{}
		othersReported := 0
		for _, r := range info.Replicas {
			if r.Datanode == victim {
				bad = r
			} else if r.Reported != "" {
				othersReported++
			}
		}
		// Wait for the other two replicas' reports too, so that their
		// check below is not vacuous.
		if bad.Reported == "UNHEALTHY" && bad.Reason != "" && bad.Recorded != "" && len(info.Container.Unhealthy) > 0 && othersReported == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica on datanode %d not shown UNHEALTHY with a reason (and recorded) within 30s:\n%s", victim, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, want := range []string{"volume " + vol + " failed", "input/output error"} {
		if !strings.Contains(bad.Reason, want) {
			t.Errorf("reason %q does not name the cause (want %q)", bad.Reason, want)
		}
	}
	// SCM's record (at most 256 bytes) starts with who reported it, then
	// the datanode's reason, cut with "…" to fit.
	if pre := "datanode " + strconv.FormatUint(victim, 10) + " reports its replica UNHEALTHY: "; bad.Health != "unhealthy" ||
		!strings.HasPrefix(bad.Recorded, pre) || !strings.HasPrefix(bad.Reason, strings.TrimSuffix(strings.TrimPrefix(bad.Recorded, pre), "…")) ||
		len(bad.Recorded) > 256 {
		t.Errorf("replica %+v: want health unhealthy and SCM's record holding the datanode's reason", bad)
	}
	if bad.Shown != bad.Reason {
		t.Errorf("reason shown %q, want the datanode's %q", bad.Shown, bad.Reason)
	}
	for _, r := range info.Replicas {
		if r.Datanode != victim && (r.Reported == "" || r.Reason != "" || r.Recorded != "" || r.Shown != "" || r.Reported == "UNHEALTHY") {
			t.Errorf("healthy replica %+v not reported, or shown with a reason", r)
		}
	}
	if len(info.Replicas) != 3 {
		t.Errorf("replicas %+v, want 3", info.Replicas)
	}
	table := run("info", id)
	for _, want := range []string{"REPLICA ON", "REASON", "UNHEALTHY", "input/output error"} {
		if !strings.Contains(table, want) {
			t.Errorf("info table lacks %q:\n%s", want, table)
		}
	}
	// container list: UNHEALTHY is the last column, and the container's
	// row names the victim there.
	list := run("list")
	lines := strings.Split(strings.TrimSpace(list), "\n")
	if h := strings.Fields(lines[0]); len(h) == 0 || h[len(h)-1] != "UNHEALTHY" {
		t.Errorf("container list's last column is not UNHEALTHY:\n%s", list)
	}
	row := ""
	for _, l := range lines[1:] {
		if f := strings.Fields(l); len(f) > 0 && f[0] == id {
			row = l
			if f[len(f)-1] != strconv.FormatUint(victim, 10) {
				t.Errorf("container %s's row does not name replica %d UNHEALTHY in its last column:\n%s", id, victim, list)
			}
		}
	}
	if row == "" {
		t.Errorf("container %s not listed:\n%s", id, list)
	}
	// A certificate that may not call GetContainerReplicas (a datanode's,
	// refused by role; a client's that is not an admin, refused as
	// replica records are admins only; GetContainers answers both): the
	// container is still shown, exit 0, with a warning on stderr.
	tlsDir := cluster.TLSDir(filepath.Join(dir, "cluster"))
	dnDirs, _ := filepath.Glob(filepath.Join(tlsDir, "datanode-*"))
	if len(dnDirs) == 0 {
		t.Fatal("no datanode TLS directory")
	}
	if _, err := c.Credentials(pki.Identity{Role: pki.RoleClient, ID: "bob"}); err != nil {
		t.Fatal(err)
	}
	for _, cert := range []struct{ name, dir string }{{"a datanode certificate", dnDirs[0]}, {"a non-admin client certificate", filepath.Join(tlsDir, "client-bob")}} {
		for _, args := range [][]string{{"info", id}, {"info", id, "--json"}} {
			cmd := exec.Command(bin, append(append([]string{"admin", "container"}, args...), "--meta", c.MetaAddr(), "--tls-dir", cert.dir)...)
			var out, errb bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errb
			if err := cmd.Run(); err != nil {
				t.Fatalf("container %v with %s: %v: %s", args, cert.name, err, errb.String())
			}
			if !strings.Contains(errb.String(), "warning: replicas not shown") || !strings.Contains(out.String(), id) ||
				strings.Contains(out.String(), "REPLICA ON") {
				t.Errorf("container %v with %s: stdout %q, stderr %q", args, cert.name, out.String(), errb.String())
			}
		}
	}
	t.Logf("replica on datanode %d: %s (%s); SCM recorded: %s", victim, bad.Reported, bad.Reason, bad.Recorded)
	t.Logf("info:\n%s", table)
}
