package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestRecoverOutput: the table and --json of basalt admin container
// recover show each replica's status, reported state, BCSID and reason.
func TestRecoverOutput(t *testing.T) {
	r := &metapb.RecoverContainerResponse{
		Container: &metapb.Container{Id: 11, State: metapb.ContainerState_CONTAINER_CLOSING}, NewestBcsid: 9, Running: true,
		Replicas: []*metapb.RecoverReplica{
			{DatanodeId: 1, Status: "recovered", ReportedState: metapb.ContainerState_CONTAINER_CLOSED, Bcsid: 9, RecordedUnhealthy: true},
			{DatanodeId: 2, Status: "failed", ReportedState: metapb.ContainerState_CONTAINER_UNHEALTHY, Bcsid: 9, RecordedUnhealthy: true,
				Reason: "recover failed: verify: stored data corrupt: container 11 block 2 ..."},
			{DatanodeId: 3, Status: "dead", RecordedUnhealthy: true},
		},
	}
	var b bytes.Buffer
	if err := printRecover(&b, r); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"container 11: CLOSING, newest BCSID 9, done: false", "REPLICA ON", "recovered", "CLOSED", "block 2", "dead"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	b.Reset()
	if err := printJSON(&b, recoverJSON(r)); err != nil {
		t.Fatal(err)
	}
	var j struct {
		Container uint64 `json:"container"`
		Done      bool   `json:"done"`
		Running   bool   `json:"running"`
		Newest    uint64 `json:"newest_bcsid"`
		Replicas  []struct {
			Datanode uint64 `json:"datanode"`
			Status   string `json:"status"`
			Reported string `json:"reported_state"`
			BCSID    uint64 `json:"bcsid"`
			Reason   string `json:"reason"`
		} `json:"replicas"`
	}
	if err := json.Unmarshal(b.Bytes(), &j); err != nil {
		t.Fatalf("%v: %s", err, b.String())
	}
	if j.Container != 11 || j.Done || !j.Running || j.Newest != 9 || len(j.Replicas) != 3 || j.Replicas[1].Status != "failed" ||
		j.Replicas[0].Reported != "CLOSED" || !strings.Contains(j.Replicas[1].Reason, "block 2") || j.Replicas[2].Reported != "" {
		t.Fatalf("json: %+v", j)
	}
}

// TestRecoverPending: --wait stops when nothing is left to wait for, not
// while a counted replica waits for its container to close.
func TestRecoverPending(t *testing.T) {
	mk := func(state metapb.ContainerState, st ...string) *metapb.RecoverContainerResponse {
		r := &metapb.RecoverContainerResponse{Container: &metapb.Container{State: state}}
		for i, s := range st {
			r.Replicas = append(r.Replicas, &metapb.RecoverReplica{DatanodeId: uint64(i + 1), Status: s})
		}
		return r
	}
	closing, closed := metapb.ContainerState_CONTAINER_CLOSING, metapb.ContainerState_CONTAINER_CLOSED
	for _, tc := range []struct {
		r    *metapb.RecoverContainerResponse
		want bool
	}{
		{mk(closing, "waiting", "failed", "failed"), true},
		{mk(closing, "recovered", "failed", "stale"), true},
		{mk(closing, "healthy", "failed", "failed"), true},
		{mk(closing, "failed", "failed", "dead"), false},
		{mk(closed, "healthy", "stale", "failed"), false},
	} {
		if got := recoverPending(tc.r); got != tc.want {
			t.Errorf("%v: pending %v, want %v", tc.r.Replicas, got, tc.want)
		}
	}
}

// TestRecoverWait (review should-fix 2): --wait after an SCM failover
// rides out Unavailable, takes a refused restart (a replica already
// counted) as no error and ends when the status says done; NotFound and
// PermissionDenied end the wait at once with the error; every step is
// printed. (The old loop retried every error silently: the first case
// spun until its deadline.)
func TestRecoverWait(t *testing.T) {
	closing, closed := metapb.ContainerState_CONTAINER_CLOSING, metapb.ContainerState_CONTAINER_CLOSED
	mk := func(state metapb.ContainerState, running, done bool, st ...string) *metapb.RecoverContainerResponse {
		r := &metapb.RecoverContainerResponse{Container: &metapb.Container{Id: 5, State: state}, Running: running, Done: done}
		for i, s := range st {
			r.Replicas = append(r.Replicas, &metapb.RecoverReplica{DatanodeId: uint64(i + 1), Status: s})
		}
		return r
	}
	type answer struct {
		r   *metapb.RecoverContainerResponse
		err error
	}
	start := mk(closing, true, false, "recovered", "recovered", "stale")
	belowFloor := mk(closing, true, false, "blocked", "blocked")
	floor10 := &metapb.BcsidFloor{Bcsid: 10, DatanodeId: 3, UnixMs: 1_700_000_000_000, Reason: "replica dropped: over-replicated"}
	belowFloor.NewestBcsid, belowFloor.BcsidFloor = 7, floor10
	// After a failover: a leader that knows nothing of the recovery
	// (floor 10), one that ignores accept_dropped_floor (an older
	// version: no echo), and a floor raised to 12 since.
	forgotten := mk(closing, false, false, "not started", "not started")
	forgotten.NewestBcsid, forgotten.BcsidFloor = 7, floor10
	noEcho := mk(closing, true, false, "waiting", "waiting")
	noEcho.NewestBcsid, noEcho.BcsidFloor = 7, floor10
	raised := mk(closing, false, false, "not started", "not started")
	raised.NewestBcsid, raised.BcsidFloor = 7, &metapb.BcsidFloor{Bcsid: 12, DatanodeId: 4, UnixMs: 1_700_000_000_000, Reason: "replica dropped: replaced"}
	accept10 := &metapb.RecoverContainerRequest{ContainerId: 5, AcceptDroppedFloor: 10}
	for _, tc := range []struct {
		name      string
		answers   []answer // in order; the last repeats
		restart   *metapb.RecoverContainerRequest
		wantErr   string // "" : done
		wantOut   []string
		wantCalls int // 0: any
	}{
		{"failover after counting", []answer{
			{nil, status.Error(codes.Unavailable, "scm: not the leader")},
			{mk(closing, false, false, "healthy", "not started", "not started"), nil},
			{nil, status.Error(codes.FailedPrecondition, "container 5 has replicas that count")},
			{mk(closed, false, true, "healthy", "not started", "not started"), nil},
		}, nil, "", []string{"retrying: ", "not started again: container 5 has replicas that count", "CLOSED  1:healthy"}, 0},
		{"container deleted", []answer{{nil, status.Error(codes.NotFound, "container 5 not found")}}, nil, "not found", nil, 0},
		{"not an admin", []answer{{nil, status.Error(codes.PermissionDenied, "admins only")}}, nil, "admins only", nil, 0},
		{"blocked", []answer{{mk(closing, true, false, "missing", "missing", "blocked"), nil}}, nil, "--accept-missing-replicas", []string{"3:blocked"}, 0},
		{"below the floor", []answer{{belowFloor, nil}}, nil,
			"bring datanode 3 back (a copy it reports at or above the floor is adopted), or, to accept losing BCSIDs 8 to 10, run it again with --accept-dropped-replicas=10", []string{"1:blocked"}, 0},
		{"restart on an older leader", []answer{{forgotten, nil}, {noEcho, nil}}, accept10,
			"did not confirm --accept-dropped-replicas=10", nil, 2},
		{"restart after the floor rose", []answer{{raised, nil}}, accept10,
			"floor is now 12", nil, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls []*metapb.RecoverContainerRequest
			call := func(ctx context.Context, req *metapb.RecoverContainerRequest) (*metapb.RecoverContainerResponse, error) {
				calls = append(calls, req)
				a := tc.answers[min(len(calls), len(tc.answers))-1]
				return a.r, a.err
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			var out bytes.Buffer
			restart := tc.restart
			if restart == nil {
				restart = &metapb.RecoverContainerRequest{ContainerId: 5}
			}
			r, err := waitRecover(ctx, call, start, restart, &out, time.Millisecond)
			if tc.wantCalls != 0 && len(calls) != tc.wantCalls {
				t.Errorf("%d calls, want %d", len(calls), tc.wantCalls)
			}
			if tc.wantErr == "" {
				if err != nil || !r.GetDone() {
					t.Fatalf("wait: %v, %v\n%s", r, err, out.String())
				}
			} else if err == nil || !strings.Contains(err.Error(), tc.wantErr) || errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("wait: %v, want an error with %q\n%s", err, tc.wantErr, out.String())
			}
			for _, want := range tc.wantOut {
				if !strings.Contains(out.String(), want) {
					t.Errorf("progress lacks %q:\n%s", want, out.String())
				}
			}
		})
	}
}

// TestRecoverAcceptDropped (review should-fix 4, nit 7): the CLI fails
// when the SCM leader does not echo --accept-dropped-replicas=FLOOR (an
// older version ignores the field), and warns only when a floor is
// actually being accepted, worded from what set it.
func TestRecoverAcceptDropped(t *testing.T) {
	req := &metapb.RecoverContainerRequest{ContainerId: 5, AcceptDroppedFloor: 10}
	if err := droppedEchoed("x", req, &metapb.RecoverContainerResponse{}); err == nil || !strings.Contains(err.Error(), "did not confirm") {
		t.Fatalf("no echo: %v, want an error", err)
	}
	if err := droppedEchoed("x", req, &metapb.RecoverContainerResponse{AcceptedDroppedFloor: 10}); err != nil {
		t.Fatal(err)
	}
	if err := droppedEchoed("x", &metapb.RecoverContainerRequest{ContainerId: 5}, &metapb.RecoverContainerResponse{}); err != nil {
		t.Fatal(err)
	}
	fl := &metapb.BcsidFloor{Bcsid: 10, DatanodeId: 3, UnixMs: 1_700_000_000_000, Reason: "replica dropped: replaced"}
	if w := droppedWarning("x", &metapb.RecoverContainerResponse{NewestBcsid: 7, BcsidFloor: fl}); w != "" {
		t.Fatalf("warning without an acceptance: %q", w)
	}
	if w := droppedWarning("x", &metapb.RecoverContainerResponse{NewestBcsid: 10, BcsidFloor: fl, AcceptedDroppedFloor: 10}); strings.Contains(w, "WARNING") || !strings.Contains(w, "nothing accepted") {
		t.Fatalf("warning with nothing below the floor: %q", w)
	}
	w := droppedWarning("x", &metapb.RecoverContainerResponse{NewestBcsid: 7, BcsidFloor: fl, AcceptedDroppedFloor: 10})
	if !strings.Contains(w, "WARNING") || !strings.Contains(w, "datanode 3") || !strings.Contains(w, "LOSES BCSIDs 8 to 10") {
		t.Fatalf("warning: %q", w)
	}
	closeFloor := &metapb.BcsidFloor{Bcsid: 10, UnixMs: 1_700_000_000_000, Reason: "closed: the lowest BCSID its healthy closed replicas reported"}
	if w := droppedWarning("x", &metapb.RecoverContainerResponse{NewestBcsid: 7, BcsidFloor: closeFloor, AcceptedDroppedFloor: 10}); strings.Contains(w, "was dropped") || !strings.Contains(w, "closed") {
		t.Fatalf("warning for a close's floor: %q", w)
	}
}
