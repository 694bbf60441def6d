package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/client"
)

// TestAdminCacheAgainstCluster runs `basalt admin cache` (the real
// binary): pools and directives added, listed as tables and JSON,
// modified and removed, and bad input refused with a clear message.
func TestAdminCacheAgainstCluster(t *testing.T) {
	_, bin, c := binaryAndCluster(t)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(bin, append(append([]string{"admin", "cache"}, args...), "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return out.String(), errb.String(), ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errb.String(), 0
	}
	ok := func(args ...string) string {
		t.Helper()
		out, stderr, code := run(args...)
		if code != 0 {
			t.Fatalf("admin cache %v: exit %d: %s", args, code, stderr)
		}
		return out
	}
	fails := func(msg string, args ...string) {
		t.Helper()
		_, stderr, code := run(args...)
		if code == 0 || !strings.Contains(stderr, msg) {
			t.Fatalf("admin cache %v: exit %d, stderr %q (want a failure saying %q)", args, code, stderr, msg)
		}
	}
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	if _, err := cl.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, "vol", "bkt", client.BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	ok("pool", "add", "hot", "--owner", "etl", "--limit", "1GiB", "--max-ttl", "48h")
	fails("already exists", "pool", "add", "hot")
	fails("want a byte count", "pool", "add", "x", "--limit", "lots")
	out := ok("pool", "list")
	if !strings.Contains(out, "hot") || !strings.Contains(out, "1.0 GiB") && !strings.Contains(out, "1 GiB") {
		t.Logf("pool list:\n%s", out)
	}
	ok("pool", "modify", "hot", "--limit", "2GiB")
	var pools []map[string]any
	if err := json.Unmarshal([]byte(ok("pool", "list", "--json")), &pools); err != nil || len(pools) != 1 || pools[0]["limit_bytes"].(float64) != 2<<30 || pools[0]["owner"] != "etl" {
		t.Fatalf("pool list --json: %v %v", pools, err)
	}
	ok("directive", "add", "/vol/bkt/tables/", "--pool", "hot", "--replication", "2", "--ttl", "1h")
	fails("replication 4", "directive", "add", "/vol/bkt/t", "--pool", "hot", "--replication", "4")
	fails("pool nope not found", "directive", "add", "/vol/bkt/t", "--pool", "nope")
	fails("not found", "directive", "add", "/vol/nobkt/t", "--pool", "hot")
	fails("exceeds", "directive", "add", "/vol/bkt/t", "--pool", "hot", "--ttl", "72h")
	var dirs []map[string]any
	if err := json.Unmarshal([]byte(ok("directive", "list", "--json")), &dirs); err != nil || len(dirs) != 1 || dirs[0]["path"] != "/vol/bkt/tables/" || dirs[0]["replication"].(float64) != 2 {
		t.Fatalf("directive list --json: %v %v", dirs, err)
	}
	out = ok("directive", "list", "--stats")
	for _, col := range []string{"BYTES NEEDED", "BYTES CACHED", "FILES NEEDED", "/vol/bkt/tables/"} {
		if !strings.Contains(out, col) {
			t.Fatalf("directive list lacks %q:\n%s", col, out)
		}
	}
	ok("directive", "modify", "1", "--replication", "3")
	ok("directive", "remove", "1")
	fails("not found", "directive", "remove", "1")
	ok("pool", "remove", "hot")
	if out := ok("pool", "list", "--json"); strings.TrimSpace(out) != "[]" {
		t.Fatalf("pools after remove: %s", out)
	}
}
