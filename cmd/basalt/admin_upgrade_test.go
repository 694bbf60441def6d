package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

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
