package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestShAgainstCluster runs the real binary against an in-process cluster:
// the happy path, and bad input with clear messages and distinct exit codes.
func TestShAgainstCluster(t *testing.T) {
	dir, bin, c := binaryAndCluster(t)
	run := func(stdin []byte, args ...string) (string, string, int) {
		cmd := exec.Command(bin, append(args, "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if stdin != nil {
			cmd.Stdin = bytes.NewReader(stdin)
		}
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
	mustOK := func(args ...string) string {
		out, stderr, code := run(nil, args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, stderr)
		}
		return out
	}
	mustOK("sh", "volume", "create", "/vol1")
	mustOK("sh", "bucket", "create", "/vol1/bucket1")
	data := bytes.Repeat([]byte("basalt "), 300000) // 2.1 MB
	src := filepath.Join(dir, "src")
	os.WriteFile(src, data, 0o644)
	mustOK("sh", "key", "put", "/vol1/bucket1/dir/k1", src)
	dst := filepath.Join(dir, "dst")
	mustOK("sh", "key", "get", "/vol1/bucket1/dir/k1", dst)
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("key get returned different bytes")
	}
	if out := mustOK("sh", "key", "ls", "/vol1/bucket1", "--prefix", "dir/"); !strings.Contains(out, "dir/k1") {
		t.Fatalf("key ls: %s", out)
	}
	if out := mustOK("sh", "key", "info", "/vol1/bucket1/dir/k1", "--json"); !strings.Contains(out, "replicas") {
		t.Fatalf("key info --json: %s", out)
	}
	mustOK("sh", "key", "mv", "/vol1/bucket1/dir/k1", "dir/k2")
	mustOK("sh", "key", "cp", "/vol1/bucket1/dir/k2", "/vol1/bucket1/dir/k3")
	mustOK("sh", "key", "rm", "/vol1/bucket1/dir/k2")
	mustOK("sh", "key", "get", "/vol1/bucket1/dir/k3", dst)
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("the copy of a deleted key returned different bytes")
	}

	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"sh", "key", "get", "/vol1/nobucket/k", filepath.Join(dir, "x")}, 3, "nobucket"},
		{[]string{"sh", "key", "get", "/vol1/bucket1/missing", filepath.Join(dir, "x")}, 3, "missing"},
		{[]string{"sh", "key", "cat", "/novol/bucket1/k"}, 3, "novol"},
		{[]string{"sh", "bucket", "create", "/vol1/Bad_Name"}, 5, "Bad_Name"},
		{[]string{"sh", "volume", "create", "/vol1"}, 4, "vol1"},
		{[]string{"sh", "volume", "delete", "/vol1"}, 1, "vol1"},
		{[]string{"sh", "key", "put", "/vol1", src}, 2, "/vol1"},
	} {
		_, stderr, code := run(nil, tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.msg) {
			t.Errorf("%v: exit %d (want %d), stderr %q (want it to name %q)", tc.args, code, tc.code, stderr, tc.msg)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "x")); err == nil {
		t.Error("a failed key get left a file behind")
	}

	// S3 keys need the cluster service token: refused without it, made
	// with --service-token-file or the environment.
	_, stderr, code := run(nil, "admin", "s3", "create-key", "--access-key", "AKIDNOTOKEN")
	if code == 0 || !strings.Contains(stderr, "service token") {
		t.Errorf("create-key without a token: exit %d, stderr %q", code, stderr)
	}
	tokFile := filepath.Join(dir, "cluster", "meta", "service-token")
	out := mustOK("admin", "s3", "create-key", "--access-key", "AKIDE2E", "--owner", "e2e", "--service-token-file", tokFile)
	if !strings.Contains(out, "aws_access_key_id     = AKIDE2E") || !strings.Contains(out, "aws_secret_access_key = ") {
		t.Errorf("create-key: %s", out)
	}
	cmd := exec.Command(bin, "admin", "s3", "get-key", "AKIDE2E", "--json", "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())
	cmd.Env = append(os.Environ(), "BASALT_SERVICE_TOKEN="+c.ServiceToken())
	if b, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(b), `"owner": "e2e"`) {
		t.Errorf("get-key with $BASALT_SERVICE_TOKEN: %v: %s", err, b)
	}
	bad := filepath.Join(dir, "bad-token")
	os.WriteFile(bad, []byte("wrong-token-wrong-token\n"), 0o600)
	if _, stderr, code := run(nil, "admin", "s3", "delete-key", "AKIDE2E", "--service-token-file", bad); code == 0 || !strings.Contains(stderr, "does not match") {
		t.Errorf("delete-key with a wrong token: exit %d, stderr %q", code, stderr)
	}
	mustOK("admin", "s3", "delete-key", "AKIDE2E", "--service-token-file", tokFile)
}
