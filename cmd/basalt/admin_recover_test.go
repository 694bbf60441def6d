package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

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
