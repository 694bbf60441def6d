package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/stream"
)

// startProc runs the binary and returns the first stdout line matching re
// (its submatches); the process is killed when the test ends.
func startProc(t *testing.T, re *regexp.Regexp, bin string, args ...string) []string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	found := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				found <- m
				break
			}
		}
		io.Copy(io.Discard, out)
	}()
	select {
	case m := <-found:
		return m
	case <-time.After(60 * time.Second):
		t.Fatalf("%v: no line matching %v in 60s; stderr:\n%s", args[0], re, stderr.String())
		return nil
	}
}

// TestCAWithProcesses: `basalt meta` starts a new cluster without any
// certificate (it makes the CA, kept in Raft, and an admin certificate);
// the admin makes a bootstrap token; `basalt datanode --bootstrap-token`
// joins with it and nothing else; the token does not work twice; the
// datanode's certificate is revoked by identity.
func TestCAWithProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and runs processes")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	metaDir := filepath.Join(dir, "meta")
	m := startProc(t, regexp.MustCompile(`gRPC (\S+),`), bin, "meta", "--id", "1", "--data-dir", metaDir,
		"--raft", "127.0.0.1:0", "--grpc", "127.0.0.1:0")
	addr := m[1]
	adminTLS := filepath.Join(metaDir, "admin-tls")
	run := func(args ...string) (string, string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		return out.String(), errb.String(), err
	}
	var tok string
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, stderr, err := run("admin", "ca", "token", "create", "--meta", addr, "--tls-dir", adminTLS, "--ttl", "10m")
		if err == nil {
			tok = strings.TrimSpace(out)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("token create: %v: %s", err, stderr)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := pki.ParseBootstrapToken(tok); err != nil {
		t.Fatalf("token %q: %v", tok, err)
	}

	dnDir := filepath.Join(dir, "dn")
	startProc(t, regexp.MustCompile(`^basalt datanode: id`), bin, "datanode", "--data-dir", dnDir, "--meta", addr, "--bootstrap-token", tok,
		"--listen", "127.0.0.1:0", "--raft", "127.0.0.1:0", "--stream", "127.0.0.1:0", "--scrub-rate", "0")
	creds, err := pki.Load(filepath.Join(dnDir, "tls"))
	if err != nil {
		t.Fatalf("the datanode's saved certificate: %v", err)
	}
	out, stderr, err := run("admin", "datanode", "list", "--json", "--meta", addr, "--tls-dir", adminTLS)
	if err != nil {
		t.Fatalf("datanode list: %v %s", err, stderr)
	}
	var dns []struct {
		UUID          string `json:"uuid"`
		StreamVersion uint32 `json:"stream_version"`
	}
	if err := json.Unmarshal([]byte(out), &dns); err != nil || len(dns) != 1 || dns[0].UUID != creds.Identity.ID {
		t.Fatalf("datanodes %s (err %v), want the one of %s", out, err, creds.Identity)
	}
	if dns[0].StreamVersion != stream.Version {
		t.Fatalf("datanode list shows stream version %d, want this binary's %d", dns[0].StreamVersion, stream.Version)
	}

	// The token again, for another datanode: refused.
	_, stderr, err = run("datanode", "--data-dir", filepath.Join(dir, "dn2"), "--meta", addr, "--bootstrap-token", tok,
		"--listen", "127.0.0.1:0", "--raft", "127.0.0.1:0", "--stream", "127.0.0.1:0")
	if err == nil || !strings.Contains(stderr, "already used") {
		t.Fatalf("second use of the token: %v: %s", err, stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "dn2", "tls", pki.CertFile)); err == nil {
		t.Fatal("a certificate was written for the second use")
	}

	// A client with a token of its own.
	out, stderr, err = run("admin", "ca", "token", "create", "--role", "client", "--id", "alice", "--meta", addr, "--tls-dir", adminTLS)
	if err != nil {
		t.Fatalf("client token: %v %s", err, stderr)
	}
	aliceDir := filepath.Join(dir, "alice-tls")
	if _, stderr, err := run("admin", "ca", "enroll", "--bootstrap-token", strings.TrimSpace(out), "--out", aliceDir, "--meta", addr); err != nil {
		t.Fatalf("enroll: %v %s", err, stderr)
	}
	if alice, err := pki.Load(aliceDir); err != nil || alice.Identity != (pki.Identity{Role: pki.RoleClient, ID: "alice"}) {
		t.Fatalf("alice's TLS directory: %v %v", alice, err)
	}
	if _, stderr, err := run("sh", "volume", "list", "--meta", addr, "--tls-dir", aliceDir); err != nil {
		t.Fatalf("alice lists volumes: %v %s", err, stderr)
	}

	out, stderr, err = run("admin", "ca", "revoke", creds.Identity.String(), "--meta", addr, "--tls-dir", adminTLS)
	serial := pki.SerialString(creds.Leaf().SerialNumber)
	if err != nil || !strings.Contains(out, "revoked "+serial) {
		t.Fatalf("revoke: %v %q %s", err, out, stderr)
	}
	out, _, err = run("admin", "ca", "revoked", "--meta", addr, "--tls-dir", adminTLS)
	if err != nil || strings.TrimSpace(out) != serial {
		t.Fatalf("revoked list %q, %v", out, err)
	}
	// The revoked datanode certificate no longer opens the meta port.
	if _, stderr, err := run("admin", "ca", "revoked", "--meta", addr, "--tls-dir", filepath.Join(dnDir, "tls")); err == nil {
		t.Fatalf("a revoked certificate was served: %s", stderr)
	}
}
