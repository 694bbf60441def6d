package meta

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/raft"
)

// Errors from the raft groups become gRPC codes that tell a client whether
// it may send the call again: UNAVAILABLE with a NotLeader detail only
// when the proposal certainly never entered the log, UNKNOWN with the
// OUTCOME_UNKNOWN reason when it may still commit (issue 11 scenario 10).
func TestTranslateRaftErrors(t *testing.T) {
	s := &Server{cfg: Config{NodeID: 1}, peers: map[uint64]Peer{}}
	const method = "/basalt.meta.v1.Namespace/CommitKey"
	for _, tc := range []struct {
		err        error
		code       codes.Code
		notLeader  bool
		reasonWant string
	}{
		{raft.ErrOutcomeUnknown, codes.Unknown, false, metapb.ReasonOutcomeUnknown},
		{fmt.Errorf("raft: group 1: stopped waiting: %w (%w)", raft.ErrOutcomeUnknown, context.DeadlineExceeded), codes.Unknown, false, metapb.ReasonOutcomeUnknown},
		{fmt.Errorf("raft: group 1: %w", raft.ErrStopped), codes.Unavailable, true, ""},
		{raft.ErrProposalDropped, codes.Unavailable, true, ""},
		{&raft.NotLeaderError{Group: 1, Leader: 2}, codes.Unavailable, true, ""},
		{scm.ErrNotLeader, codes.Unavailable, true, ""},
		{context.DeadlineExceeded, codes.DeadlineExceeded, false, ""},
		{status.Error(codes.NotFound, "no such key"), codes.NotFound, false, ""},
	} {
		got := s.translate(method, tc.err)
		st, _ := status.FromError(got)
		var nl bool
		var reason string
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *metapb.NotLeader:
				nl = true
			case *errdetails.ErrorInfo:
				reason = d.Reason
			}
		}
		if st.Code() != tc.code || nl != tc.notLeader || reason != tc.reasonWant {
			t.Errorf("%v → %v (NotLeader %v, reason %q); want %v (NotLeader %v, reason %q)", tc.err, st.Code(), nl, reason, tc.code, tc.notLeader, tc.reasonWant)
		}
	}
}
