package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
)

// freeAddr is a loopback address with a port nobody listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestMetaJoinsWithBootstrapToken: a cluster of three meta nodes whose
// third member has no certificate: an admin makes a meta token for node
// 3, `basalt meta --bootstrap-token` gets its certificate through nodes
// 1 and 2 and joins; with node 1 stopped, nodes 2 and 3 still form a
// quorum. Fails on the old code: no meta tokens, no --bootstrap-token on
// basalt meta.
func TestMetaJoinsWithBootstrapToken(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and runs processes")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	run := func(args ...string) (string, string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		return out.String(), errb.String(), err
	}
	caDir, adminTLS := filepath.Join(dir, "ca"), filepath.Join(dir, "admin-tls")
	for _, args := range [][]string{{"admin", "ca", "init", "--dir", caDir},
		{"admin", "ca", "issue", "--dir", caDir, "--role", "client", "--id", "admin", "--out", adminTLS}} {
		if _, stderr, err := run(args...); err != nil {
			t.Fatalf("%v: %v %s", args, err, stderr)
		}
	}
	var peers []string
	grpcs := map[int]string{}
	for i := 1; i <= 3; i++ {
		grpcs[i] = freeAddr(t)
		peers = append(peers, fmt.Sprintf("%d=%s/%s", i, freeAddr(t), grpcs[i]))
	}
	start := func(i int, extra ...string) *exec.Cmd {
		args := append([]string{"meta", "--id", fmt.Sprint(i), "--data-dir", filepath.Join(dir, fmt.Sprint("meta", i)),
			"--raft", strings.Split(strings.Split(peers[i-1], "=")[1], "/")[0], "--grpc", grpcs[i], "--peers", strings.Join(peers, ","),
			"--admins", "admin"}, extra...)
		cmd := exec.Command(bin, args...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	first := start(1, "--ca-dir", caDir)
	start(2, "--ca-dir", caDir)
	token := func(metas string) (string, error) {
		var last error
		deadline := time.Now().Add(90 * time.Second)
		for time.Now().Before(deadline) {
			out, stderr, err := run("admin", "ca", "token", "create", "--role", "meta", "--id", "3", "--meta", metas, "--tls-dir", adminTLS, "--ttl", "10m")
			if err == nil {
				return strings.TrimSpace(out), nil
			}
			last = fmt.Errorf("%v: %s", err, stderr)
			time.Sleep(300 * time.Millisecond)
		}
		return "", last
	}
	tok, err := token(grpcs[1] + "," + grpcs[2])
	if err != nil {
		t.Fatalf("meta token: %v", err)
	}
	m := startProc(t, regexp.MustCompile(`^basalt meta: node 3, gRPC (\S+),`), bin, "meta", "--id", "3", "--data-dir", filepath.Join(dir, "meta3"),
		"--raft", strings.Split(strings.Split(peers[2], "=")[1], "/")[0], "--grpc", grpcs[3], "--peers", strings.Join(peers, ","),
		"--admins", "admin", "--bootstrap-token", tok)
	if m[1] != grpcs[3] {
		t.Fatalf("node 3 serves on %s, want %s", m[1], grpcs[3])
	}
	c, err := pki.Load(filepath.Join(dir, "meta3", "tls"))
	if err != nil || c.Identity != (pki.Identity{Role: pki.RoleMeta, ID: "3"}) {
		t.Fatalf("node 3's saved certificate: %v %v", c, err)
	}
	// Without node 1, the CA group commits only if node 3 is a member.
	first.Process.Kill()
	first.Wait()
	if _, err := token(grpcs[2] + "," + grpcs[3]); err != nil {
		t.Fatalf("nodes 2 and 3 without node 1: %v", err)
	}
}
