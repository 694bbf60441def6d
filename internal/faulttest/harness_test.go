package faulttest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The harness's own pieces, cheap enough for make test.

func TestProcCrashIsRecordedKillIsNot(t *testing.T) {
	dir := t.TempDir()
	crashed := make(chan string, 2)
	onCrash := func(p *Proc, err error, tail string) { crashed <- p.Name + ": " + tail }

	p := &Proc{Name: "crasher", Bin: "/bin/sh", Args: []string{"-c", "echo dying; exit 3"}, LogPath: filepath.Join(dir, "c.log"), onCrash: onCrash}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-crashed:
		if want := "crasher: "; len(got) < len(want) || got[:len(want)] != want {
			t.Fatalf("crash report %q", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("exit 3 not reported as a crash")
	}

	k := &Proc{Name: "sleeper", Bin: "/bin/sleep", Args: []string{"30"}, LogPath: filepath.Join(dir, "s.log"), onCrash: onCrash}
	if err := k.Start(); err != nil {
		t.Fatal(err)
	}
	if !k.Running() {
		t.Fatal("sleeper not running")
	}
	if err := k.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := k.Kill(); err != nil { // SIGKILL ends a stopped process too
		t.Fatal(err)
	}
	if k.Running() {
		t.Fatal("sleeper still running after Kill")
	}
	select {
	case got := <-crashed:
		t.Fatalf("a kill by the harness was reported as a crash: %q", got)
	case <-time.After(200 * time.Millisecond):
	}
}

func TestPlanIsSeeded(t *testing.T) {
	cfg := PlanConfig{KillDN: 3, KillMeta: 2, StopDN: 1, FillDisk: true, StopFor: 30 * time.Second, ImpatientFor: 10 * time.Second}
	a, b := Plan(7, cfg), Plan(7, cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("same seed, different plans:\n%v\n%v", a, b)
	}
	if reflect.DeepEqual(a, Plan(8, cfg)) {
		t.Fatal("seeds 7 and 8 gave the same plan")
	}
	kinds := map[FaultKind]int{}
	for _, f := range a {
		kinds[f.Kind]++
	}
	want := map[FaultKind]int{KillDN: 3, KillMeta: 2, StopDN: 1, FillDisk: 1, ImpatientClient: 1}
	if !reflect.DeepEqual(kinds, want) {
		t.Fatalf("plan kinds %v, want %v", kinds, want)
	}
}

func TestFaultsDuring(t *testing.T) {
	s := time.Second
	events := []Event{
		{Kind: KillDN, Target: "dn1", Start: 10 * s, End: 15 * s},
		{Kind: FillDisk, Target: "dn2", Start: 20 * s, End: 20 * s, Note: "ballast 100 MiB"},
		{Kind: FillDisk, Target: "dn2", Start: 40 * s, End: 40 * s, Note: "ballast removed"},
	}
	for _, tc := range []struct {
		start, end time.Duration
		want       string
	}{
		{0, 5 * s, "none"},
		{9 * s, 11 * s, "kill-dn dn1"},
		{14 * s, 21 * s, "kill-dn dn1, disk-full dn2"},
		{30 * s, 31 * s, "disk-full dn2"},
		{41 * s, 50 * s, "none"},
	} {
		if got := faultsDuring(events, tc.start, tc.end); got != tc.want {
			t.Errorf("faultsDuring(%v, %v) = %q, want %q", tc.start, tc.end, got, tc.want)
		}
	}
}

func TestReported(t *testing.T) {
	three := func(st metapb.ContainerState, replicas ...uint64) *metapb.Container {
		return &metapb.Container{Replication: metapb.Replication_THREE, State: st, Replicas: replicas}
	}
	open, closed := metapb.ContainerState_CONTAINER_OPEN, metapb.ContainerState_CONTAINER_CLOSED
	for _, tc := range []struct {
		name    string
		c       *metapb.Container
		listed  int
		failing []uint64
		want    bool
	}{
		{"three listed, one fails, nothing reported", three(open, 1, 2, 3), 3, []uint64{3}, false},
		{"SCM lists two replicas", three(closed, 1, 2), 2, nil, true},
		{"lookup left one out", three(closed, 1, 2, 3), 2, nil, true},
		{"unknown container", nil, 3, []uint64{3}, false},
	} {
		if got := reported(tc.c, tc.listed, tc.failing, func(ids []uint64) string { return fmt.Sprint(ids) }) != ""; got != tc.want {
			t.Errorf("%s: reported = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestKeyDataIsSeeded(t *testing.T) {
	a := append([]byte(nil), keyData(1, 1000, nil)...)
	if !reflect.DeepEqual(a, keyData(1, 1000, nil)) {
		t.Fatal("same seed, different bytes")
	}
	if reflect.DeepEqual(a, keyData(2, 1000, nil)) {
		t.Fatal("seeds 1 and 2 gave the same bytes")
	}
}

func TestCleanStaleLeavesLiveAndReleasedRuns(t *testing.T) {
	base := t.TempDir()
	mk := func(name, pid string) string {
		d := filepath.Join(base, name)
		if err := os.MkdirAll(filepath.Join(d, "logs"), 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, "data"), []byte("x"), 0o644)
		if pid != "" {
			os.WriteFile(filepath.Join(d, ownerFile), []byte(pid), 0o644)
		}
		return d
	}
	live := mk("basalt-fault-1-live", strconv.Itoa(os.Getpid()))
	released := mk("basalt-fault-2-released", "")
	// A PID above the kernel's maximum never runs.
	dead := mk("basalt-fault-3-dead", "99999999")
	got := CleanStale(filepath.Join(base, "basalt-fault-*"))
	if !reflect.DeepEqual(got, []string{dead}) {
		t.Fatalf("cleaned %v, want only %v", got, dead)
	}
	for _, d := range []string{live, released} {
		if _, err := os.Stat(filepath.Join(d, "data")); err != nil {
			t.Errorf("%s was touched: %v", d, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dead, "data")); err == nil {
		t.Error("dead run's data still there")
	}
	if _, err := os.Stat(filepath.Join(dead, "logs")); err != nil {
		t.Errorf("dead run's logs removed: %v", err)
	}
}

func TestAmbiguous(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("put key /v/b/k: %w", context.DeadlineExceeded), true},
		{&client.Error{Op: "commit key /v/b/k", Code: codes.Unknown, Msg: "raft: outcome unknown"}, true},
		{&client.Error{Op: "commit key /v/b/k", Code: codes.NotFound, Msg: "open key 7 not found (expired or already committed)"}, false},
		{errors.New("allocate blocks: no open THREE pipeline"), false},
	} {
		if got := ambiguous(tc.err); got != tc.want {
			t.Errorf("ambiguous(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
