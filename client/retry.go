package client

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// allocation failure classes (allocClass).
const (
	allocFatal      = iota // an answer about the request: return it
	allocWait              // the service is not ready (safe mode, no leader): wait
	allocNoPipeline        // no open pipeline outside the exclude list: exclude less, wait
	allocNoRoom            // out of space: only excluding less can help
)

// allocClass classifies an error of an allocating call (OpenKey,
// AllocateBlock). SCM answers FailedPrecondition both for requests that
// cannot succeed (a path through a file) and for the passing states of a
// start or a failover (no open pipeline yet, safe mode); only its
// message tells them apart.
func allocClass(err error) int {
	st, _ := status.FromError(err)
	msg := strings.ToLower(st.Message())
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted:
		return allocWait
	case codes.FailedPrecondition:
		if strings.Contains(msg, "no open") {
			return allocNoPipeline
		}
		if strings.Contains(msg, "safe mode") {
			return allocWait
		}
	case codes.ResourceExhausted:
		if strings.Contains(msg, "out of space") {
			return allocNoRoom
		}
	}
	return allocFatal
}

// maxExcludeLevel is the last exclusion level of an allocating call:
// 0 sends the client-wide exclude list and the key's, 1 the key's only,
// 2 the key's failed datanodes and containers only (see blockSource.next).
const maxExcludeLevel = 2

// allocating runs call, an allocating metadata call, until it succeeds,
// fails for good, or Config.AllocateWait has passed since the first try:
// right after a start or a failover there may be no open pipeline (or SCM
// is in safe mode) for a few seconds, and spending every retry in
// milliseconds failed every write then. Waits back off from 50 ms to 2 s
// with jitter, so that many writers do not ask in lockstep. When nothing
// is left outside the exclude list, call is asked again at once with a
// higher level (fewer exclusions): other keys' exclusions are advice, and
// a pipeline this key gave up on may be ready now.
func (c *Client) allocating(ctx context.Context, op string, call func(level int) error) error {
	deadline := time.Now().Add(c.cfg.AllocateWait)
	backoff := 50 * time.Millisecond
	level := 0
	for tries := 1; ; tries++ {
		err := call(level)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w (last error: %v)", op, ctx.Err(), err)
		}
		class := allocClass(err)
		if (class == allocNoPipeline || class == allocNoRoom) && level < maxExcludeLevel {
			level++
			continue
		}
		if class != allocWait && class != allocNoPipeline {
			return wrapErr(op, err)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return wrapErr(op, fmt.Errorf("%w (still so after %d tries in %v)", err, tries, c.cfg.AllocateWait))
		}
		d := min(backoff/2+rand.N(backoff/2+1), left)
		if tries == 1 || tries%10 == 0 {
			c.log.Info("basalt client: nowhere to allocate a block yet; waiting", "op", op, "tries", tries, "err", err, "wait", d)
		}
		if !sleepCtx(ctx, d) {
			return fmt.Errorf("%s: %w (last error: %v)", op, ctx.Err(), err)
		}
		backoff = min(2*backoff, 2*time.Second)
		level = 0
	}
}

// settleCommit settles a CommitKey whose outcome is unknown (cause): the
// metadata node that had it stopped answering, or lost its leadership
// with the commit in its log. A commit consumes the open key in the same
// Raft entry that writes the key, so at most one commit of an open key
// ever applies, and the request can be sent again:
//
//   - it succeeds: this one applied (the first never will, it finds the
//     open key gone);
//   - NOT_FOUND: the open key is gone; a linearizable LookupKey then shows
//     whether the key holds exactly this commit's blocks (blocks are
//     allocated to one open key only, so they identify the commit). If it
//     does, the commit applied; if not (an expired open key, a later
//     overwrite, a key without blocks), the outcome stays unknown;
//   - any other answer is the outcome: the open key still existed and
//     the commit was refused. The first request cannot apply later: the
//     leader that answered had committed an entry of its term, so an
//     entry of the hung leader's older term that it does not hold can no
//     longer commit.
func (c *Client) settleCommit(ctx context.Context, op, volume, bucket, key string, commit *metapb.CommitKeyRequest, cause error) (*metapb.KeyInfo, error) {
	for try := 0; try < 3 && ctx.Err() == nil; try++ {
		ki, err := c.ns.CommitKey(ctx, commit)
		switch {
		case err == nil:
			c.log.Info("basalt client: commit settled: sent again and applied", "key", op)
			return ki, nil
		case errors.Is(wrapErr(op, err), ErrOutcomeUnknown):
			cause = err
			continue
		case status.Code(err) == codes.NotFound:
			got, lerr := c.ns.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: volume, Bucket: bucket, Key: key, NoLocations: true})
			if lerr == nil && sameBlocks(got.GetBlocks(), commit.Blocks) {
				c.log.Info("basalt client: commit settled: it had applied", "key", op)
				return got, nil
			}
			return nil, cause
		case status.Code(err) == codes.Unavailable:
			return nil, cause
		default:
			return nil, err
		}
	}
	return nil, cause
}

func sameBlocks(a, b []*metapb.KeyBlock) bool {
	if len(a) == 0 || len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].GetId().GetContainerId() != b[i].GetId().GetContainerId() || a[i].GetId().GetLocalId() != b[i].GetId().GetLocalId() ||
			a[i].GetLength() != b[i].GetLength() {
			return false
		}
	}
	return true
}
