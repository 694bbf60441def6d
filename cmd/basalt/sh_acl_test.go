package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func TestParseAcls(t *testing.T) {
	acls, err := parseAcls("user:alice:rwl, group:etl:xy[ACCESS],world::a,anonymous::r")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, a := range acls {
		got = append(got, formatAcl(a))
	}
	if want := "user:alice:rwl group:etl:xy world::a anonymous::r"; strings.Join(got, " ") != want {
		t.Fatalf("got %q, want %q", strings.Join(got, " "), want)
	}
	if acls[0].Rights != uint32(metapb.AclRight_ACL_READ|metapb.AclRight_ACL_WRITE|metapb.AclRight_ACL_LIST) {
		t.Fatalf("rights %b", acls[0].Rights)
	}
	for _, bad := range []string{"", "user::r", "world:bob:r", "alien:x:r", "user:alice:q", "user:alice", "user:alice:n", "user:alice:r[DEFAULT]"} {
		if _, err := parseAcls(bad); err == nil {
			t.Errorf("parseAcls(%q) accepted", bad)
		}
	}
}

// TestShAcl runs the real binary: addacl, getacl (table and --json),
// removeacl, setacl, and a malformed ACL refused as a usage error.
func TestShAcl(t *testing.T) {
	_, bin, c := binaryAndCluster(t)
	run := func(args ...string) (string, string, int) {
		cmd := exec.Command(bin, append(args, "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
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
	mustOK := func(args ...string) string {
		t.Helper()
		out, stderr, code := run(args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, stderr)
		}
		return out
	}
	mustOK("sh", "volume", "create", "/aclv")
	mustOK("sh", "bucket", "create", "/aclv/aclb")
	mustOK("sh", "volume", "addacl", "/aclv", "--acl", "group:etl:c")
	mustOK("sh", "bucket", "addacl", "/aclv/aclb", "-a", "user:bob:rl,world::l")
	out := mustOK("sh", "bucket", "getacl", "/aclv/aclb")
	if !strings.Contains(out, "user:bob:rl") || !strings.Contains(out, "world::l") {
		t.Fatalf("getacl: %s", out)
	}
	mustOK("sh", "bucket", "removeacl", "/aclv/aclb", "--acl", "user:bob:r")
	var got struct {
		Owner string
		Acls  []struct{ Type, Name, Rights string }
	}
	if err := json.Unmarshal([]byte(mustOK("sh", "bucket", "getacl", "/aclv/aclb", "--json")), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Acls) != 2 || got.Acls[0].Name != "bob" || got.Acls[0].Rights != "l" {
		t.Fatalf("after removeacl: %+v", got)
	}
	out = mustOK("sh", "bucket", "setacl", "/aclv/aclb", "--acl", "group:etl:a")
	if strings.Contains(out, "bob") || !strings.Contains(out, "group:etl:a") {
		t.Fatalf("setacl: %s", out)
	}
	if out := mustOK("sh", "volume", "getacl", "/aclv"); !strings.Contains(out, "group:etl:c") {
		t.Fatalf("volume getacl: %s", out)
	}
	_, stderr, code := run("sh", "bucket", "addacl", "/aclv/aclb", "--acl", "user:bob:q")
	if code != exitUsage || !strings.Contains(stderr, "right") {
		t.Fatalf("bad right: exit %d: %s", code, stderr)
	}
	_, stderr, code = run("sh", "key", "getacl", "/aclv/aclb/missing")
	if code == 0 || !strings.Contains(stderr, "missing") {
		t.Fatalf("getacl of a missing key: exit %d: %s", code, stderr)
	}

	// Bucket policy and Block Public Access.
	pol := filepath.Join(t.TempDir(), "policy.json")
	os.WriteFile(pol, []byte(`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::aclb/*"}]}`), 0o644)
	mustOK("sh", "bucket", "policy", "set", "/aclv/aclb", pol)
	if out := mustOK("sh", "bucket", "policy", "get", "/aclv/aclb"); !strings.Contains(out, `"Principal":"*"`) {
		t.Fatalf("policy get: %s", out)
	}
	if out := mustOK("sh", "bucket", "policy", "status", "/aclv/aclb", "--json"); !strings.Contains(out, `"is_public": true`) {
		t.Fatalf("policy status: %s", out)
	}
	mustOK("sh", "bucket", "public-access-block", "set", "/aclv/aclb", "--block-public-policy", "--block-public-acls")
	if _, stderr, code := run("sh", "bucket", "policy", "set", "/aclv/aclb", pol); code == 0 || !strings.Contains(stderr, "BlockPublicPolicy") {
		t.Fatalf("public policy under BlockPublicPolicy: exit %d: %s", code, stderr)
	}
	if _, stderr, code := run("sh", "bucket", "addacl", "/aclv/aclb", "-a", "anonymous::r"); code == 0 || !strings.Contains(stderr, "BlockPublicAcls") {
		t.Fatalf("public ACL under BlockPublicAcls: exit %d: %s", code, stderr)
	}
	if out := mustOK("sh", "bucket", "public-access-block", "get", "/aclv/aclb"); !strings.Contains(out, "true") {
		t.Fatalf("public-access-block get: %s", out)
	}
	os.WriteFile(pol, []byte(`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:Fly","Resource":"arn:aws:s3:::aclb/*"}]}`), 0o644)
	if _, stderr, code := run("sh", "bucket", "policy", "set", "/aclv/aclb", pol); code == 0 || !strings.Contains(stderr, "s3:Fly") {
		t.Fatalf("invalid policy: exit %d: %s", code, stderr)
	}
	mustOK("sh", "bucket", "policy", "delete", "/aclv/aclb")
	if out := mustOK("sh", "bucket", "policy", "get", "/aclv/aclb"); strings.TrimSpace(out) != "" {
		t.Fatalf("policy after delete: %q", out)
	}
}
