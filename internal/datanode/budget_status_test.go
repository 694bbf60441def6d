package datanode

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// TestBudgetWaitNotLeader: a small file whose proposal waited for the
// pipeline's inflight budget until its context ended (the error raft's
// Propose and ProposeMany return then, see raft's
// TestProposeManyWaitsForBudget) is answered DeadlineExceeded, never
// NOT_LEADER: the client must not take a busy leader for an election and
// exclude a healthy pipeline.
func TestBudgetWaitNotLeader(t *testing.T) {
	s := &service{}
	for _, cause := range []error{context.DeadlineExceeded, context.Canceled} {
		err := s.toStatus(fmt.Errorf("raft: group 7: waiting for inflight budget: %w", cause))
		st := status.Convert(err)
		if st.Code() != codes.DeadlineExceeded {
			t.Errorf("%v: code %v, want DeadlineExceeded", cause, st.Code())
		}
		for _, d := range st.Details() {
			if e, ok := d.(*datanodepb.Error); ok && e.Kind == datanodepb.Error_NOT_LEADER {
				t.Errorf("%v: answered NOT_LEADER", cause)
			}
		}
		r := smallFileResult(0, err)
		if r.GetError().GetKind() == datanodepb.Error_NOT_LEADER || codes.Code(r.GetCode()) != codes.DeadlineExceeded {
			t.Errorf("%v: small-file result %v", cause, r)
		}
	}
}
