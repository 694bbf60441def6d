package main

import (
	"testing"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestReplicaRowsReasonShown: container info shows the datanode's own
// reason, but SCM's record when the datanode gives none or does not know
// the cause (its neutral text after a restart, or storage's own mark).
func TestReplicaRowsReasonShown(t *testing.T) {
	rec := "datanode 2 reports its replica UNHEALTHY: entry 9 (PutBlock) failed in apply: runtime error"
	unknown := datanode.UnknownUnhealthyReason + " (storage's own mark, or marked before this datanode restarted): ..."
	cr := &metapb.ContainerReplicas{
		Replicas: []*metapb.ReplicaInfo{
			{DatanodeId: 1, UnhealthyReason: "volume /v failed: input/output error"},
			{DatanodeId: 2, UnhealthyReason: unknown},
			{DatanodeId: 3},
			{DatanodeId: 4, UnhealthyReason: unknown},
		},
		Reports: []*metapb.CorruptReplica{
			{Block: &metapb.BlockID{ContainerId: 5}, DatanodeId: 1, Reporter: "scm", Reason: "datanode 1 reports its replica UNHEALTHY: volume /v failed"},
			{Block: &metapb.BlockID{ContainerId: 5}, DatanodeId: 2, Reporter: "scm", Reason: rec},
			{Block: &metapb.BlockID{ContainerId: 5}, DatanodeId: 3, Reporter: "scm", Reason: "datanode 3 reports its replica UNHEALTHY"},
			{Block: &metapb.BlockID{ContainerId: 5, LocalId: 7}, DatanodeId: 4, Reporter: "client h", Reason: "checksum"},
		},
	}
	want := map[uint64]string{1: "volume /v failed: input/output error", 2: rec, 3: "datanode 3 reports its replica UNHEALTHY", 4: unknown}
	for _, r := range replicaRows(cr) {
		if r.Reason != want[r.Datanode] {
			t.Errorf("replica on %d: reason shown %q, want %q", r.Datanode, r.Reason, want[r.Datanode])
		}
	}
}
