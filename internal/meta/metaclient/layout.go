package metaclient

import (
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// LayoutNotFinalized reports whether err is the refusal of a request that
// needs a layout feature above the cluster's finalized layout version
// (docs/ARCHITECTURE.md, "Upgrades"): refused before the log, so nothing
// was applied, and the feature is not available yet: a caller falls back
// to what the finalized layout offers.
func LayoutNotFinalized(err error) bool {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.FailedPrecondition {
		return false
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.Reason == metapb.ReasonLayoutNotFinalized {
			return true
		}
	}
	return false
}

// layoutRetryAfter is how long the write coalescers send single calls
// after a batch call was refused as not finalized, before they try a
// batch again (a finalize takes effect without restarting clients).
const layoutRetryAfter = 30 * time.Second
