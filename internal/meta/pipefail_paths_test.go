package meta

import (
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestPipelineFailedReasonHidden: the close reason of a pipeline a member
// reported failed (scm/pipefail.go) keeps its datanode but not its raft
// log directory's path for non-admins. Fails without the failed case in
// slowDiskReason.
func TestPipelineFailedReasonHidden(t *testing.T) {
	const reason = "failed on datanode 2: raft log directory /srv/log3/raft failed"
	p := &metapb.Pipeline{Id: 4, CloseReason: reason}
	out := hidePipelinePaths([]*metapb.Pipeline{p})
	if got := out[0].CloseReason; got != "failed on datanode 2: "+hiddenPath {
		t.Fatalf("hidden reason %q", got)
	}
	if p.CloseReason != reason {
		t.Fatalf("state changed: %v", p)
	}
}

// The close reason of a pipeline closed because a member reported every
// raft log directory failed (scm/pipefail.go noLogDirsReason) keeps its
// datanode for non-admins too, like the others of its pattern.
func TestPipelineNoLogDirsReasonHidden(t *testing.T) {
	p := &metapb.Pipeline{Id: 5, CloseReason: "failed on datanode 3: every raft log directory failed"}
	if got := hidePipelinePaths([]*metapb.Pipeline{p})[0].CloseReason; got != "failed on datanode 3: "+hiddenPath {
		t.Fatalf("hidden reason %q", got)
	}
}
