package client

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestOutcomeUnknownFailsTheKey (issue 11, scenario 10, client side): a
// datanode's OUTCOME_UNKNOWN (its raft proposal may still commit) fails
// the write instead of being retried on a new block as a pipeline
// failure, and the error says the outcome is unknown. So does the
// metadata service's codes.Unknown "outcome unknown".
func TestOutcomeUnknownFailsTheKey(t *testing.T) {
	st, err := status.New(codes.Unknown, "outcome unknown, the write may or may not have been applied: raft: ...").
		WithDetails(&datanodepb.Error{Kind: datanodepb.Error_OUTCOME_UNKNOWN})
	if err != nil {
		t.Fatal(err)
	}
	blk := &metapb.BlockLocation{Id: &metapb.BlockID{ContainerId: 1, LocalId: 2}, PipelineId: 1000}
	f := classify(context.Background(), blk, st.Err())
	if !f.fatal {
		t.Fatalf("OUTCOME_UNKNOWN classified as retryable: %+v", f)
	}
	if werr := wrapErr("put key /v/b/k", f.err); !errors.Is(werr, ErrOutcomeUnknown) {
		t.Fatalf("wrapped error %v does not match ErrOutcomeUnknown", werr)
	}
	meta := status.Error(codes.Unknown, "meta node 1: outcome unknown, the operation may or may not have been applied: x")
	if werr := wrapErr("commit key /v/b/k", meta); !errors.Is(werr, ErrOutcomeUnknown) {
		t.Fatalf("meta outcome unknown wrapped as %v", werr)
	}
}

// TestTokenRefusalExcludesForTheKeyOnly: a datanode refusing a block's
// token (expired, or signed by a key it has not received yet) makes the
// key try a new block, but does not put the pipeline on the client-wide
// exclude list, where it would be avoided by every key for 10 minutes.
func TestTokenRefusalExcludesForTheKeyOnly(t *testing.T) {
	for _, kind := range []datanodepb.Error_Kind{datanodepb.Error_TOKEN_INVALID, datanodepb.Error_TOKEN_EXPIRED} {
		st, err := status.New(codes.PermissionDenied, "block token refused").WithDetails(&datanodepb.Error{Kind: kind})
		if err != nil {
			t.Fatal(err)
		}
		blk := &metapb.BlockLocation{Id: &metapb.BlockID{ContainerId: 1, LocalId: 2}, PipelineId: 1000}
		f := classify(context.Background(), blk, st.Err())
		if f.fatal || !f.keyOnly || f.pipeline != 1000 {
			t.Fatalf("%v classified as %+v, want a key-only pipeline exclusion", kind, f)
		}
	}
}
