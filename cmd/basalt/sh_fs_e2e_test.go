package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestShFsAgainstCluster runs `basalt sh fs` (the real binary) against an
// in-process cluster: mkdir with and without -p, ls and ls -R as tables
// and JSON with owners and permissions, stat, a directory mv that moves
// everything under it in one rename, rm with and without -r, and bad input
// with distinct exit codes.
func TestShFsAgainstCluster(t *testing.T) {
	_, bin, c := binaryAndCluster(t)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(bin, append(append([]string{"sh"}, args...), "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
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
			t.Fatalf("sh %v: exit %d: %s", args, code, stderr)
		}
		return out
	}
	fails := func(code int, msg string, args ...string) {
		t.Helper()
		_, stderr, got := run(args...)
		if got != code || !strings.Contains(stderr, msg) {
			t.Fatalf("sh %v: exit %d (want %d), stderr %q (want it to contain %q)", args, got, code, stderr, msg)
		}
	}
	listing := func(args ...string) map[string]fsEntry {
		t.Helper()
		var r struct{ Entries []fsEntry }
		out := ok(append(args, "--json")...)
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("sh %v --json: %v: %s", args, err, out)
		}
		m := map[string]fsEntry{}
		for _, e := range r.Entries {
			m[e.Path] = e
		}
		return m
	}
	ok("volume", "create", "/fsv")
	ok("bucket", "create", "/fsv/fsb", "--layout", "fs")
	me := currentUser()

	ok("fs", "mkdir", "-p", "/fsv/fsb/a/b/c")
	ok("fs", "mkdir", "-p", "/fsv/fsb/a/b/c") // exists: no error with -p
	ok("fs", "mkdir", "/fsv/fsb/a/d")
	fails(4, "exists", "fs", "mkdir", "/fsv/fsb/a/d")
	fails(3, "parent must exist", "fs", "mkdir", "/fsv/fsb/x/y")

	// Files written through the client, with data under a to move later.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for i := range 5 {
		if _, err := cl.PutKey(ctx, "fsv", "fsb", fmt.Sprintf("a/b/c/f%d", i), bytes.NewReader(bytes.Repeat([]byte{'x'}, 100+i)), client.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	perm := uint32(0o640)
	if _, err := cl.SetFileAttrs(ctx, "fsv", "fsb", "a/b/c/f1", &metapb.FileAttrs{Owner: "erin", Group: "eng", Permission: &perm}); err != nil {
		t.Fatal(err)
	}

	top := listing("fs", "ls", "/fsv/fsb")
	if e := top["/fsv/fsb/a"]; len(top) != 1 || e.Type != "dir" || e.Owner != me || e.Permission != "755" {
		t.Fatalf("ls /fsv/fsb: %+v", top)
	}
	all := listing("fs", "ls", "-R", "/fsv/fsb")
	if len(all) != 9 { // a, a/b, a/b/c, 5 files, a/d
		t.Fatalf("ls -R: %d entries, want 9: %+v", len(all), all)
	}
	if f := all["/fsv/fsb/a/b/c/f1"]; f.Type != "file" || f.Size != 101 || f.Owner != "erin" || f.Group != "eng" || f.Permission != "640" {
		t.Fatalf("ls -R f1: %+v", f)
	}
	tbl := ok("fs", "ls", "/fsv/fsb/a/b/c")
	if !strings.Contains(tbl, "-rw-r-----  erin") || !strings.Contains(tbl, "/fsv/fsb/a/b/c/f4") || !strings.HasPrefix(tbl, "PERMISSION") {
		t.Fatalf("ls table:\n%s", tbl)
	}
	if out := ok("fs", "ls", "/fsv/fsb/a/b/c/f0"); !strings.Contains(out, "/fsv/fsb/a/b/c/f0") || strings.Contains(out, "f1") {
		t.Fatalf("ls of a file:\n%s", out)
	}
	var st fsEntry
	if err := json.Unmarshal([]byte(ok("fs", "stat", "/fsv/fsb/a/b", "--json")), &st); err != nil || st.Type != "dir" || st.DirID == 0 || st.Owner != me {
		t.Fatalf("stat --json: %+v %v", st, err)
	}
	if out := ok("fs", "stat", "/fsv/fsb/a/b/c/f3"); !strings.Contains(out, "size:         103") || !strings.Contains(out, "type:         file") {
		t.Fatalf("stat:\n%s", out)
	}
	ok("fs", "stat", "/fsv/fsb") // the bucket's root

	// A directory mv: one rename, the children follow with their attributes.
	ok("fs", "mv", "/fsv/fsb/a/b", "/fsv/fsb/moved")
	moved := listing("fs", "ls", "-R", "/fsv/fsb/moved")
	if len(moved) != 6 || moved["/fsv/fsb/moved/c/f1"].Owner != "erin" {
		t.Fatalf("after mv: %+v", moved)
	}
	fails(3, "not found", "fs", "stat", "/fsv/fsb/a/b")
	// Onto an existing directory: moves into it.
	ok("fs", "mv", "/fsv/fsb/moved", "/fsv/fsb/a/d")
	ok("fs", "stat", "/fsv/fsb/a/d/moved/c/f4")
	fails(2, "another bucket", "fs", "mv", "/fsv/fsb/a", "/fsv/other/a")

	// rm: a non-empty directory needs -r; -r is one operation.
	fails(1, "not empty", "fs", "rm", "/fsv/fsb/a")
	ok("fs", "rm", "/fsv/fsb/a/d/moved/c/f0")
	ok("fs", "rm", "-r", "/fsv/fsb/a")
	if left := listing("fs", "ls", "-R", "/fsv/fsb"); len(left) != 0 {
		t.Fatalf("after rm -r: %+v", left)
	}
	fails(3, "not found", "fs", "rm", "/fsv/fsb/a")
	fails(2, "/volume/bucket", "fs", "ls", "/fsv")
	fails(2, "want", "fs", "rm", "/fsv/fsb")
	// An object bucket has no directories.
	ok("bucket", "create", "/fsv/objb")
	_, stderr, code := run("fs", "ls", "/fsv/objb")
	if code == 0 || !strings.Contains(stderr, "FS bucket") {
		t.Fatalf("ls of an object bucket: exit %d, %q", code, stderr)
	}
}
