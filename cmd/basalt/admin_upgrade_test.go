package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

// TestAdminUpgrade runs the real binary: `admin upgrade status` (table
// and --json) and `admin upgrade finalize` on a fresh cluster, which
// records the layout its members support (this binary's: block
// reservations are layout 2).
func TestAdminUpgrade(t *testing.T) {
	_, bin, c := binaryAndCluster(t)
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, append(args, "--meta", c.MetaAddr(), "--tls-dir", c.ClientTLSDir())...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, errb.String())
		}
		return out.String()
	}
	var st struct {
		Finalized uint32 `json:"finalized_version"`
		Replicas  []struct {
			Node     uint64 `json:"node"`
			Software uint32 `json:"software_version"`
			State    string `json:"state"`
		} `json:"replicas"`
		Waiting []string `json:"features_waiting"`
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := json.Unmarshal([]byte(run("admin", "upgrade", "status", "--json")), &st); err != nil {
			t.Fatal(err)
		}
		if len(st.Replicas) > 0 && st.Replicas[0].State == "applying" || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	// A fresh cluster is finalized at its binary's layout.
	v := namespace.SoftwareLayoutVersion()
	if st.Finalized != v || len(st.Replicas) == 0 || st.Replicas[0].Software != v || st.Replicas[0].State != "applying" || len(st.Waiting) != 0 {
		t.Fatalf("status %+v (binary's layout %d)", st, v)
	}
	if out := run("admin", "upgrade", "status"); !strings.Contains(out, fmt.Sprintf("finalized layout version: %d", v)) || !strings.Contains(out, "applying") {
		t.Fatalf("status table:\n%s", out)
	}
	if out := run("admin", "upgrade", "finalize"); !strings.Contains(out, fmt.Sprintf("finalized at layout version %d", v)) {
		t.Fatalf("finalize: %s", out)
	}
}

// TestUpgradeStatusGroupHalts: a replica whose SCM, CA or user-token
// group halted is shown GROUP HALTED with each halt, in the table and in
// --json.
func TestUpgradeStatusGroupHalts(t *testing.T) {
	r := &metapb.GetLayoutStatusResponse{FinalizedVersion: 2, Replicas: []*metapb.ReplicaLayout{
		{NodeId: 1, SoftwareVersion: 2, FinalizedVersion: 2, AppliedIndex: 40},
		{NodeId: 3, SoftwareVersion: 2, FinalizedVersion: 2, AppliedIndex: 39, GroupHalts: []*metapb.GroupHalt{
			{Group: "scm", Index: 17, Op: 10, Reason: "scm entry 17 holds op or field 10, unknown to this binary"}}},
	}}
	for _, js := range []bool{false, true} {
		cmd := &cobra.Command{}
		var out bytes.Buffer
		cmd.SetOut(&out)
		if err := printLayoutStatus(cmd, &connFlags{json: js}, r); err != nil {
			t.Fatal(err)
		}
		s := out.String()
		want := []string{"GROUP HALTED", "scm halted at entry 17: scm entry 17 holds op or field 10"}
		if js {
			want = []string{`"state": "GROUP HALTED"`, `"group": "scm"`, `"index": 17`, `"op": 10`}
		}
		for _, w := range want {
			if !strings.Contains(s, w) {
				t.Fatalf("json %v: no %q in\n%s", js, w, s)
			}
		}
		if strings.Count(s, "GROUP HALTED") != 1 {
			t.Fatalf("json %v: node 1 shown halted too:\n%s", js, s)
		}
	}
}
