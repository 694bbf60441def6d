package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// TestShWithS3KeysOnly: `basalt sh` with only an S3 key and the cluster
// CA (no client certificate) creates a bucket in its owner's volume and
// puts and gets a key (through the datanodes, on block tokens); the key
// acts as its owner (another user's key is refused), and a wrong secret
// is refused. Fails on the old code: there were no such flags, and the
// meta and datanode ports refused connections without a certificate.
func TestShWithS3KeysOnly(t *testing.T) {
	dir, bin, c := binaryAndCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), ServiceToken: c.ServiceToken()})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if _, err := admin.CreateVolume(ctx, "avol", "alice"); err != nil {
		t.Fatal(err)
	}
	keys := map[string]*metapb.S3Secret{}
	for _, u := range []string{"alice", "bob"} {
		if keys[u], err = admin.Namespace().CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{Owner: u}); err != nil {
			t.Fatal(err)
		}
	}
	ca := filepath.Join(c.ClientTLSDir(), pki.CACertFile)
	run := func(user, secret string, args ...string) (string, string, int) {
		cmd := exec.Command(bin, append(args, "--meta", c.MetaAddr(), "--access-key", keys[user].AccessKeyId, "--ca-cert", ca)...)
		// The secret from the environment, as users should pass it; no
		// TLS directory anywhere.
		cmd.Env = append(os.Environ(), "BASALT_SECRET_KEY="+secret, "BASALT_TLS_DIR=", "HOME="+dir)
		cmd.Dir = dir
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errb.String(), code
	}
	mustOK := func(user string, args ...string) string {
		out, stderr, code := run(user, keys[user].SecretAccessKey, args...)
		if code != 0 {
			t.Fatalf("%s: %v: exit %d: %s", user, args, code, stderr)
		}
		return out
	}
	mustOK("alice", "sh", "bucket", "create", "/avol/bkt1")
	data := bytes.Repeat([]byte("token "), 1<<20) // 6 MiB: several chunks
	src := filepath.Join(dir, "src")
	if err := os.WriteFile(src, data, 0o644); err != nil {
		t.Fatal(err)
	}
	mustOK("alice", "sh", "key", "put", "/avol/bkt1/k", src)
	dst := filepath.Join(dir, "dst")
	mustOK("alice", "sh", "key", "get", "/avol/bkt1/k", dst)
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("key get returned different bytes")
	}
	if b, err := admin.Namespace().GetBucket(ctx, &metapb.GetBucketRequest{Volume: "avol", Name: "bkt1"}); err != nil || b.Owner != "alice" {
		t.Fatalf("the bucket made with alice's key: %v, %v (want owner alice)", b, err)
	}
	// basalt bench takes the same flags.
	if out := mustOK("alice", "bench", "write", "--volume", "avol", "--bucket", "bkt1", "-n", "20", "--size", "4KiB", "-t", "2"); !strings.Contains(out, "20") {
		t.Fatalf("bench write: %s", out)
	}
	if _, stderr, code := run("bob", keys["bob"].SecretAccessKey, "sh", "key", "cat", "/avol/bkt1/k"); code == 0 || !strings.Contains(strings.ToLower(stderr), "denied") {
		t.Fatalf("bob reads alice's key: exit %d: %s", code, stderr)
	}
	if _, stderr, code := run("alice", "wrong-secret", "sh", "key", "cat", "/avol/bkt1/k"); code == 0 || !strings.Contains(stderr, "bad signature") {
		t.Fatalf("a wrong secret: exit %d: %s", code, stderr)
	}
}
