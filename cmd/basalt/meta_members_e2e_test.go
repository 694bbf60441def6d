package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// rangeAddr is a loopback address with a free port in 22000–22999 (the
// port range of this test; BASALT_TEST_PORT_BASE=N moves it to N…N+999;
// a random port if none is free).
// An address is handed out once per process: a probed port is closed
// again, so without this two calls could return the same one.
var rangeUsed sync.Map

func rangeAddr(t *testing.T) string {
	t.Helper()
	base := 22000
	if b, err := strconv.Atoi(os.Getenv("BASALT_TEST_PORT_BASE")); err == nil && b > 0 && b+1000 <= 65536 {
		base = b
	}
	start := (os.Getpid()*7 + int(time.Now().UnixNano()/1000)) % 1000
	for i := 0; i < 1000; i++ {
		a := fmt.Sprintf("127.0.0.1:%d", base+(start+i)%1000)
		if _, used := rangeUsed.LoadOrStore(a, true); used {
			continue
		}
		if l, err := net.Listen("tcp", a); err == nil {
			l.Close()
			return a
		}
	}
	return freeAddr(t)
}

// TestMetaReplaceNode replaces a meta node whose disk died: three meta
// nodes; volumes and buckets written; node 3 killed (SIGKILL) and its
// data directory deleted; `admin meta remove 3`; node 4 started with
// --join (new ID, new directory, new ports, a bootstrap token) and
// `admin meta add 4`; once it caught up, node 1 is killed: nodes 2 and 4
// form a quorum in every group, every volume and bucket reads back and
// new writes commit (namespace and CA groups). Also: node 3's ID cannot
// be added back, --join refuses a data directory with state, and an
// added member cannot be added again. Fails on the old code: no
// `admin meta`, no --join (and a static membership: with node 1 gone,
// nodes 2 and 4 would not be a quorum).
func TestMetaReplaceNode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and runs processes")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "basalt")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	// The whole test is bounded well under go test's 10 minutes: every
	// command and every server runs under testCtx (CommandContext kills
	// it), and the servers also die with this process (Pdeathsig), so a
	// timeout panic, which skips t.Cleanup, leaks no meta node.
	testCtx, cancelAll := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancelAll)
	runUntil := func(deadline time.Time, args ...string) (string, string, error) {
		ctx, cancel := context.WithDeadline(testCtx, deadline)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		return out.String(), errb.String(), err
	}
	run := func(args ...string) (string, string, error) {
		return runUntil(time.Now().Add(60*time.Second), args...)
	}
	caDir, adminTLS := filepath.Join(dir, "ca"), filepath.Join(dir, "admin-tls")
	for _, args := range [][]string{{"admin", "ca", "init", "--dir", caDir},
		{"admin", "ca", "issue", "--dir", caDir, "--role", "client", "--id", "admin", "--out", adminTLS}} {
		if _, stderr, err := run(args...); err != nil {
			t.Fatalf("%v: %v %s", args, err, stderr)
		}
	}
	raft, grpcs := map[int]string{}, map[int]string{}
	peer := func(i int) string { return fmt.Sprintf("%d=%s/%s", i, raft[i], grpcs[i]) }
	for i := 1; i <= 4; i++ {
		raft[i], grpcs[i] = rangeAddr(t), rangeAddr(t)
	}
	peers := strings.Join([]string{peer(1), peer(2), peer(3)}, ",")
	logs := map[int]*bytes.Buffer{}
	procs := map[int]*exec.Cmd{}
	start := func(i int, extra ...string) {
		args := append([]string{"meta", "--id", fmt.Sprint(i), "--data-dir", filepath.Join(dir, fmt.Sprint("meta", i)),
			"--raft", raft[i], "--grpc", grpcs[i], "--admins", "admin", "--log-level", "info", "--ballast-bytes", "0"}, extra...)
		cmd := exec.CommandContext(testCtx, bin, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		logs[i] = &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = logs[i], logs[i]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[i] = cmd
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	kill := func(i int) {
		procs[i].Process.Kill() // SIGKILL
		procs[i].Wait()
	}
	t.Cleanup(func() {
		if t.Failed() {
			for i, l := range logs {
				t.Logf("meta %d:\n%s", i, lastLines(l.String(), 40))
			}
		}
	})
	for i := 1; i <= 3; i++ {
		start(i, "--peers", peers, "--ca-dir", caDir)
	}
	admin := func(metas string, args ...string) []string {
		return append(args, "--meta", metas, "--tls-dir", adminTLS)
	}
	// retry runs a command until it succeeds (elections, catching up).
	retry := func(what string, d time.Duration, args ...string) string {
		t.Helper()
		var last string
		for deadline := time.Now().Add(d); time.Now().Before(deadline) && testCtx.Err() == nil; time.Sleep(300 * time.Millisecond) {
			out, stderr, err := runUntil(deadline, args...)
			if err == nil {
				return out
			}
			last = fmt.Sprintf("%v: %s%s", err, stderr, out)
		}
		t.Fatalf("%s: %s", what, last)
		return ""
	}
	all3 := grpcs[1] + "," + grpcs[2] + "," + grpcs[3]
	var vols []string
	for i := 0; i < 6; i++ {
		v := fmt.Sprintf("/vol%d", i)
		retry("create "+v, 90*time.Second, admin(all3, "sh", "volume", "create", v)...)
		retry("create bucket in "+v, 30*time.Second, admin(all3, "sh", "bucket", "create", v+"/bkt")...)
		vols = append(vols, v)
	}

	members := func(addr string) *metapb.ListMembersResponse {
		out := retry("members on "+addr, 30*time.Second, admin(addr, "admin", "meta", "members", "--json")...)
		var r metapb.ListMembersResponse
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("members --json: %v %s", err, out)
		}
		return &r
	}
	// The members leader records every initial member it heard from.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(300 * time.Millisecond) {
		n := 0
		for _, m := range members(grpcs[1]).Members {
			if m.Source == "table" {
				n++
			}
		}
		if n == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the member table holds %d initial members, want 3", n)
		}
	}

	// Node 3's disk dies.
	phase := time.Now()
	lap := func(what string) {
		t.Logf("phase %s: %v", what, time.Since(phase).Round(time.Millisecond))
		phase = time.Now()
	}
	kill(3)
	if err := os.RemoveAll(filepath.Join(dir, "meta3")); err != nil {
		t.Fatal(err)
	}
	// Restarting it under its old ID on an empty directory is refused.
	if _, stderr, err := run("meta", "--id", "3", "--data-dir", filepath.Join(dir, "meta3"), "--raft", raft[3], "--grpc", grpcs[3],
		"--peers", peers, "--ca-dir", caDir, "--ballast-bytes", "0"); err == nil || !strings.Contains(stderr, "has run in this cluster before") {
		t.Fatalf("node 3 restarted on an empty directory: %v %s", err, stderr)
	}
	lap("a wiped node 3 refused")
	both := grpcs[1] + "," + grpcs[2]
	out := retry("remove node 3", 60*time.Second, admin(both, "admin", "meta", "remove", "3", "--json")...)
	var ch metapb.MemberChangeResponse
	if err := json.Unmarshal([]byte(out), &ch); err != nil || len(ch.Groups) != 5 || !ch.GetMember().GetRemoved() {
		t.Fatalf("remove 3: %v %s", err, out)
	}
	lap("remove 3 (kill -9 to answer)")
	for _, g := range ch.Groups {
		if g.Outcome != "removed" {
			t.Fatalf("remove 3: group %s: %q, want removed", g.Name, g.Outcome)
		}
	}
	// Its certificates are revoked (node 3 made its own from --ca-dir:
	// the CA never recorded it, the identity basalt://meta/3 is revoked),
	// and a node 3 restarted on an empty directory, with a new certificate
	// from --ca-dir, is refused at the members' handshakes.
	if !ch.GetMember().GetRevoked() {
		t.Fatalf("remove 3: %s, want its certificates revoked", out)
	}
	for _, m := range members(grpcs[2]).Members {
		if m.Id == 3 && (!m.Removed || !m.Revoked) {
			t.Fatalf("node 2's row of node 3: %v, want removed and revoked", m)
		}
	}
	if _, stderr, err := run("meta", "--id", "3", "--data-dir", filepath.Join(dir, "meta3"), "--raft", raft[3], "--grpc", grpcs[3],
		"--peers", peers, "--ca-dir", caDir, "--ballast-bytes", "0"); err == nil || !strings.Contains(stderr, "refuses this node's certificate") {
		t.Fatalf("node 3 restarted after its removal: %v %s", err, stderr)
	}
	if out, _, err := run(admin(both, "admin", "meta", "members")...); err != nil || !strings.Contains(out, "removed, certificates revoked") {
		t.Fatalf("admin meta members after the removal: %v %s", err, out)
	}
	lap("node 3 revoked")
	// Its token keys are rotated (within a second or so: the reconciler
	// runs every second on the SCM and user-token leaders).
	for deadline := time.Now().Add(20 * time.Second); ; {
		out, _, err := run(admin(both, "admin", "meta", "members")...)
		if err == nil && strings.Contains(out, "removed, certificates revoked, token keys rotated") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("admin meta members: node 3's token keys not rotated: %v %s", err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	lap("node 3's token keys rotated")
	// A retry changes nothing and says so.
	out = retry("remove node 3 again", 30*time.Second, admin(both, "admin", "meta", "remove", "3", "--json")...)
	if err := json.Unmarshal([]byte(out), &ch); err != nil || len(ch.Groups) != 5 {
		t.Fatalf("remove 3 again: %v %s", err, out)
	}
	for _, g := range ch.Groups {
		if g.Outcome != "already removed" {
			t.Fatalf("remove 3 again: group %s: %q, want already removed", g.Name, g.Outcome)
		}
	}
	// Node 3's ID never comes back.
	if _, stderr, err := run(admin(both, "admin", "meta", "add", "3", raft[3]+"/"+grpcs[3])...); err == nil || !strings.Contains(stderr, "was removed") {
		t.Fatalf("add 3 after its removal: %v %s", err, stderr)
	}

	// Node 4 joins with a new ID, an empty directory and new ports.
	tok := strings.TrimSpace(retry("meta token for node 4", 30*time.Second,
		admin(both, "admin", "ca", "token", "create", "--role", "meta", "--id", "4", "--ttl", "10m")...))
	lap("token for 4")
	current := peer(1) + "," + peer(2)
	logs[4] = &bytes.Buffer{}
	m, killJoined := startProcKill(t, regexp.MustCompile(`^basalt meta: node 4, gRPC (\S+),`), logs[4], bin, "meta", "--id", "4", "--join", "--log-level", "info",
		"--data-dir", filepath.Join(dir, "meta4"), "--raft", raft[4], "--grpc", grpcs[4], "--peers", current,
		"--admins", "admin", "--ballast-bytes", "0", "--bootstrap-token", tok)
	lap("node 4 started with --join (certificate by token)")
	if m[1] != grpcs[4] {
		t.Fatalf("node 4 serves on %s, want %s", m[1], grpcs[4])
	}
	out = retry("add node 4", 60*time.Second, admin(both, "admin", "meta", "add", "4", raft[4]+"/"+grpcs[4], "--json")...)
	if err := json.Unmarshal([]byte(out), &ch); err != nil || len(ch.Groups) != 5 {
		t.Fatalf("add 4: %v %s", err, out)
	}
	lap("add 4")
	for _, g := range ch.Groups {
		if g.Outcome != "added" {
			t.Fatalf("add 4: group %s: %q, want added", g.Name, g.Outcome)
		}
	}
	if _, stderr, err := run(admin(both, "admin", "meta", "add", "4", raft[4]+"/"+grpcs[4])...); err == nil || !strings.Contains(stderr, "already a member") {
		t.Fatalf("add 4 twice: %v %s", err, stderr)
	}
	// --join refuses a directory that holds state.
	if _, stderr, err := run("meta", "--id", "5", "--join", "--data-dir", filepath.Join(dir, "meta1"), "--peers", current); err == nil || !strings.Contains(stderr, "holds Raft state") {
		t.Fatalf("--join on meta1's directory: %v %s", err, stderr)
	}

	// Wait until node 4 applied, in every group, what node 2 had
	// committed after the add.
	want := map[string]uint64{}
	for _, g := range members(grpcs[2]).Groups {
		want[g.Name] = g.Commit
		if !slices.Equal(g.Voters, []uint64{1, 2, 4}) {
			t.Fatalf("node 2's view of group %s: voters %v, want [1 2 4]", g.Name, g.Voters)
		}
	}
	if len(want) != 5 {
		t.Fatalf("node 2 reports groups %v", want)
	}
	var r *metapb.ListMembersResponse
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(300 * time.Millisecond) {
		r = members(grpcs[4])
		caught := len(r.Groups) == 5
		for _, g := range r.Groups {
			caught = caught && g.Applied >= want[g.Name] && slices.Contains(g.Voters, 4)
		}
		if caught {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node 4 did not catch up with %v: %+v", want, r.Groups)
		}
	}
	lap("node 4 caught up (after the add and the checks)")
	var row *metapb.MemberInfo
	for _, mi := range r.Members {
		if mi.Id == 4 {
			row = mi
		}
	}
	if row == nil || row.Source != "table" || row.GrpcAddr != grpcs[4] || row.RaftAddr != raft[4] {
		t.Fatalf("node 4's member table: %+v", r.Members)
	}

	// Node 1 goes: nodes 2 and 4 are a quorum of every group.
	kill(1)
	lap("-")
	after := grpcs[2] + "," + grpcs[4]
	for _, v := range vols {
		out := retry("read "+v+"/bkt without node 1", 60*time.Second, admin(after, "sh", "bucket", "info", v+"/bkt", "--json")...)
		if !strings.Contains(out, strings.TrimPrefix(v, "/")) {
			t.Fatalf("bucket info %s/bkt: %s", v, out)
		}
	}
	lap("kill 1 to all 6 buckets read from 2+4")
	retry("a new volume without node 1", 60*time.Second, admin(after, "sh", "volume", "create", "/after")...)
	retry("read the new volume", 30*time.Second, admin(after, "sh", "volume", "info", "/after")...)
	retry("a CA group write without node 1", 60*time.Second,
		admin(after, "admin", "ca", "token", "create", "--role", "meta", "--id", "5", "--ttl", "10m")...)

	// The member table survives restarts: nodes 2 and 4 killed and
	// restarted with the original --peers (1, 2, 3; no --join): node 2
	// finds node 4's addresses in its table, node 4 its membership.
	kill(2)
	killJoined()
	start(2, "--peers", peers, "--ca-dir", caDir)
	start(4, "--peers", peers)
	retry("read the new volume after restarting 2 and 4", 90*time.Second, admin(after, "sh", "volume", "info", "/after")...)
	retry("a write after restarting 2 and 4", 60*time.Second, admin(after, "sh", "volume", "create", "/after2")...)
	lap("restart 2 and 4 to a read and a write")
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// startProcKill is startProc that also returns a function that kills the
// process (SIGKILL) and waits for it.
func startProcKill(t *testing.T, re *regexp.Regexp, stderr *bytes.Buffer, bin string, args ...string) ([]string, func()) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // dies with the test
	cmd.Stderr = stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	kill := func() { cmd.Process.Kill(); cmd.Wait() }
	t.Cleanup(kill)
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
		return m, kill
	case <-time.After(60 * time.Second):
		t.Fatalf("%v: no line matching %v in 60s; stderr:\n%s", args[0], re, stderr.String())
		return nil, nil
	}
}
