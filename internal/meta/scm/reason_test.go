package scm

import (
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// replicaOf is datanode dn's replica of cid in m.Replicas.
func replicaOf(t *testing.T, e *env, cid, dn uint64) (*metapb.ReplicaInfo, []*metapb.CorruptReplica) {
	t.Helper()
	r, err := e.m.Replicas(cid, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Containers) != 1 {
		t.Fatalf("replicas of %d: %v", cid, r)
	}
	for _, x := range r.Containers[0].Replicas {
		if x.DatanodeId == dn {
			return x, r.Containers[0].Reports
		}
	}
	t.Fatalf("no replica of %d on %d", cid, dn)
	return nil, nil
}

// TestUnhealthyReasonKeptPerReplica: the reason a datanode gives for an
// UNHEALTHY replica is kept with its last report (bounded to 256 bytes of
// valid UTF-8 whatever it sent), returned per replica by Replicas
// (GetContainerReplicas), and put in the reason SCM records through Raft
// when it records the replica unhealthy. A later report of the replica
// that is not UNHEALTHY drops it; a reason on a report that is not
// UNHEALTHY is not kept.
func TestUnhealthyReasonKeptPerReplica(t *testing.T) {
	cfg := Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3}
	e := newEnvAt(t, cfg, t.TempDir())
	defer e.st.Close()
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2))
	}
	e.tick(t)
	b := e.alloc(t, metapb.Replication_THREE)
	cid := b.Id.ContainerId
	bad, good := b.Datanodes[0].Id, b.Datanodes[1].Id
	why := "entry 42 (PutBlock) failed in apply: runtime error: index out of range [3] with length 0"

	e.report(t, good, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_OPEN, UnhealthyReason: "not unhealthy"})
	e.report(t, bad, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, Bcsid: 42, UnhealthyReason: why})
	ri, _ := replicaOf(t, e, cid, bad)
	if ri.ReportedState != metapb.ContainerState_CONTAINER_UNHEALTHY || ri.UnhealthyReason != why || ri.Bcsid != 42 {
		t.Fatalf("replica on %d: %v, want UNHEALTHY at 42 with %q", bad, ri, why)
	}
	if ri, _ := replicaOf(t, e, cid, good); ri.UnhealthyReason != "" {
		t.Fatalf("healthy replica on %d has a reason: %q", good, ri.UnhealthyReason)
	}
	// Recorded through Raft with the datanode's reason.
	e.tick(t)
	_, reps := replicaOf(t, e, cid, bad)
	found := false
	for _, r := range reps {
		if r.DatanodeId == bad && r.Reporter == "scm" && r.GetBlock().GetLocalId() == 0 {
			found = strings.Contains(r.Reason, why) && strings.Contains(r.Reason, "reports its replica UNHEALTHY")
			if !found {
				t.Fatalf("recorded reason %q lacks the datanode's %q", r.Reason, why)
			}
		}
	}
	if !found {
		t.Fatalf("no record of why replica %d is unhealthy: %v", bad, reps)
	}
	// Bounded whatever the datanode sends.
	e.report(t, bad, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UnhealthyReason: strings.Repeat("é", 5000) + "\xff"})
	if ri, _ := replicaOf(t, e, cid, bad); len(ri.UnhealthyReason) > maxReasonBytes || !utf8.ValidString(ri.UnhealthyReason) || ri.UnhealthyReason == "" {
		t.Fatalf("reason of %d bytes kept (valid %v)", len(ri.UnhealthyReason), utf8.ValidString(ri.UnhealthyReason))
	}
	// Healthy again in the next report: the reason goes with the old report.
	e.report(t, bad, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_CLOSED, UnhealthyReason: "stale"})
	if ri, _ := replicaOf(t, e, cid, bad); ri.UnhealthyReason != "" {
		t.Fatalf("replica reported CLOSED keeps reason %q", ri.UnhealthyReason)
	}
}

// TestUnhealthyReasonCleanedAndCut: SCM never trusts a datanode's reason:
// control characters (newline, tab, ESC) become spaces in what it keeps
// and records; a long reason is cut in the Raft record with "…" after
// SCM's prefix ("datanode N reports its replica UNHEALTHY: "), so the
// record shows it was cut; and a corrupt-replica report cannot name block
// 0, the key of SCM's own record.
func TestUnhealthyReasonCleanedAndCut(t *testing.T) {
	cfg := Config{PipelineLimit: 1, OpenContainersPerPipeline: 1, SafeModeMinDatanodes: 3}
	e := newEnvAt(t, cfg, t.TempDir())
	defer e.st.Close()
	for i := range 3 {
		e.register(t, fmt.Sprintf("dn%d", i), fmt.Sprintf("/dc1/rack%d", i%2))
	}
	e.tick(t)
	b := e.alloc(t, metapb.Replication_THREE)
	cid := b.Id.ContainerId
	bad, other := b.Datanodes[0].Id, b.Datanodes[1].Id
	why := "sync failed\nsecond\x1b[2J\t" + strings.Repeat("x", 300) + "END"
	e.report(t, bad, &metapb.ContainerReport{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY, UnhealthyReason: why})
	ri, _ := replicaOf(t, e, cid, bad)
	if !strings.HasPrefix(ri.UnhealthyReason, "sync failed second [2J x") || len(ri.UnhealthyReason) > maxReasonBytes || !strings.HasSuffix(ri.UnhealthyReason, "…") {
		t.Fatalf("kept reason %q (%d bytes)", ri.UnhealthyReason, len(ri.UnhealthyReason))
	}
	e.tick(t)
	_, reps := replicaOf(t, e, cid, bad)
	var rec string
	for _, r := range reps {
		if r.DatanodeId == bad && r.Reporter == "scm" && r.GetBlock().GetLocalId() == 0 {
			rec = r.Reason
		}
	}
	prefix := fmt.Sprintf("datanode %d reports its replica UNHEALTHY: sync failed second [2J x", bad)
	if !strings.HasPrefix(rec, prefix) || !strings.HasSuffix(rec, "…") || len(rec) > maxReasonBytes || strings.ContainsAny(rec, "\n\x1b\t") {
		t.Fatalf("recorded reason %q (%d bytes), want %q…, cut with \"…\"", rec, len(rec), prefix)
	}
	// A client cannot overwrite SCM's record (block 0), and its reason is
	// cleaned too.
	err := e.m.ReportCorrupt(e.ctx, &metapb.ReportCorruptReplicaRequest{Block: &metapb.BlockID{ContainerId: cid}, DatanodeId: bad, Reason: "x"}, "client h", false)
	if code(err) != codes.InvalidArgument {
		t.Fatalf("report of block 0: %v, want InvalidArgument", err)
	}
	if err := e.m.ReportCorrupt(e.ctx, &metapb.ReportCorruptReplicaRequest{Block: &metapb.BlockID{ContainerId: cid, LocalId: 7}, DatanodeId: other, Reason: "bad\r\nread\x1b]0;t\x07"}, "client h", false); err != nil {
		t.Fatal(err)
	}
	_, reps = replicaOf(t, e, cid, other)
	found := false
	for _, r := range reps {
		if r.DatanodeId == other && r.GetBlock().GetLocalId() == 7 {
			found = r.Reason == "bad  read ]0;t "
			if !found {
				t.Fatalf("client's reason kept as %q", r.Reason)
			}
		}
		if r.DatanodeId == bad && r.GetBlock().GetLocalId() == 0 && r.Reporter != "scm" {
			t.Fatalf("SCM's record overwritten: %v", r)
		}
	}
	if !found {
		t.Fatalf("client's report not stored: %v", reps)
	}
}
