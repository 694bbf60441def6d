package metaclient

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Write coalescing (issue 15). OpenKeyCoalesced and CommitKeyCoalesced
// are OpenKey and CommitKey for writers of many small keys at once (a
// gateway serving small PUTs, a bench): concurrent calls of the same
// requester (the same outgoing metadata, as Lookup) merge into one
// OpenKeys or CommitKeys call, which the server answers key by key after
// one read barrier and one Raft entry for all of them. There is no timer:
// while fewer than Config.WritesInFlight (default 1) batches of a
// requester are in flight, a call leaves at once (a lone call as a plain
// OpenKey or CommitKey); beyond that, calls queue and leave together as
// soon as a batch returns. A batch runs until the latest of its callers' deadlines
// (now + CallTimeout for a caller without one), or until all of them gave
// up; if that passes while a caller still waits (one without a deadline),
// the caller's commit is of unknown outcome and its open UNAVAILABLE, as
// for a service's timeout of a single call.
//
// Errors are those of OpenKey and CommitKey: a key's own refusal comes
// back to its caller only; an error of the whole call (no leader after
// the router's retries, the entry's outcome unknown) to every caller of
// the batch, so a CommitKeys whose outcome is unknown makes each of its
// callers settle its own commit, as after a CommitKey (client/retry.go).
// An open that failed UNAVAILABLE on its own (no block token key yet) is
// sent again alone as an OpenKey (retried by the router as any OpenKey);
// a server without the batch calls gets one call per key from then on.

const (
	// DefaultWritesInFlight is the default of Config.WritesInFlight: one
	// batch in flight, the calls that come meanwhile wait for it and go
	// together (measured against 2 in session 10: 3-13% less server CPU
	// per small PUT and more objects/s; docs/BENCHMARKS.md).
	DefaultWritesInFlight = 1
	// maxWriteBatch is the server's bound (namespace.MaxWriteBatch).
	maxWriteBatch = 256
	// maxWriteBatchBytes bounds the encoded requests of one batch, half
	// the server's bound (namespace.MaxWriteBatchBytes).
	maxWriteBatchBytes = 1 << 20
	// maxCoalescedBytes: a bigger request (a commit of many blocks) goes
	// alone.
	maxCoalescedBytes = 64 << 10
	// maxCoalescedHint: an open whose size hint is bigger (a large
	// object: its data dominates, and its answer carries many blocks)
	// goes alone.
	maxCoalescedHint = 1 << 20
	// maxWriteQueue bounds the calls queued per requester.
	maxWriteQueue = 4 * maxWriteBatch
)

type writeCall[Q, R any] struct {
	ctx  context.Context
	req  Q
	size int
	done chan struct{}
	resp R
	err  error
}

type writeQueue[Q, R any] struct {
	key      string
	md       metadata.MD
	inflight int
	pending  []*writeCall[Q, R]
}

// writeCoalescer merges calls of one method (open or commit).
type writeCoalescer[Q proto.Message, R any] struct {
	maxInflight int
	// one sends a single call; many a batch, returning per-call answers
	// (again: send this call alone) or an error of the whole call.
	one  func(ctx context.Context, req Q) (R, error)
	many func(ctx context.Context, reqs []Q) (resps []R, errs []error, again []bool, err error)
	// expired is a caller's error when the batch's context expired (err)
	// while the caller's own context is live: a commit's outcome is
	// unknown (the caller settles it, client/retry.go), an open is a
	// retryable UNAVAILABLE (nothing of it is used).
	expired     func(err error) error
	callTimeout time.Duration // Config.CallTimeout
	method      string        // the single call's full method name (errors)

	mu      sync.Mutex
	queues  map[string]*writeQueue[Q, R]
	noBatch atomic.Bool
	// batchAfter: single calls until then (unix ns), after a batch call
	// was refused as needing a layout not finalized (layout.go).
	batchAfter atomic.Int64
	batches    atomic.Uint64
	keys       atomic.Uint64
}

// WriteStats returns the OpenKeys and CommitKeys calls the coalescer made
// and the keys they carried.
func (c *Client) WriteStats() (openBatches, openKeys, commitBatches, commitKeys uint64) {
	return c.opens.batches.Load(), c.opens.keys.Load(), c.commits.batches.Load(), c.commits.keys.Load()
}

// OpenKeyCoalesced is Namespace.OpenKey, coalesced with concurrent calls
// of the same requester into OpenKeys calls (see above).
func (c *Client) OpenKeyCoalesced(ctx context.Context, req *metapb.OpenKeyRequest) (*metapb.OpenKeyResponse, error) {
	if req.SizeHint == 0 || req.SizeHint > maxCoalescedHint {
		return c.Namespace.OpenKey(ctx, req)
	}
	return c.opens.call(ctx, req)
}

// CommitKeyCoalesced is Namespace.CommitKey, coalesced with concurrent
// calls of the same requester into CommitKeys calls (see above).
func (c *Client) CommitKeyCoalesced(ctx context.Context, req *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
	return c.commits.call(ctx, req)
}

func (c *Client) initWrites(inflight int) {
	c.opens.maxInflight, c.commits.maxInflight = inflight, inflight
	c.opens.callTimeout, c.commits.callTimeout = c.cfg.CallTimeout, c.cfg.CallTimeout
	c.opens.method, c.commits.method = metapb.Namespace_OpenKey_FullMethodName, metapb.Namespace_CommitKey_FullMethodName
	c.opens.expired = func(err error) error {
		return status.Errorf(codes.Unavailable, "metaclient: OpenKeys: the batch's deadline passed before an answer (nothing of this open is used; open again): %v", err)
	}
	c.commits.expired = func(err error) error {
		st, _ := status.Newf(codes.Unknown, "metaclient: %s: outcome unknown, the call may or may not have been applied (the batch's deadline passed before an answer): %v",
			metapb.Namespace_CommitKeys_FullMethodName, err).
			WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonOutcomeUnknown, Domain: metapb.ReasonDomain})
		return st.Err()
	}
	c.opens.one = func(ctx context.Context, req *metapb.OpenKeyRequest) (*metapb.OpenKeyResponse, error) {
		return c.Namespace.OpenKey(ctx, req)
	}
	c.opens.many = func(ctx context.Context, reqs []*metapb.OpenKeyRequest) ([]*metapb.OpenKeyResponse, []error, []bool, error) {
		resp, err := c.Namespace.OpenKeys(ctx, &metapb.OpenKeysRequest{Requests: reqs})
		if err != nil {
			return nil, nil, nil, err
		}
		if len(resp.Results) != len(reqs) {
			return nil, nil, nil, status.Errorf(codes.Internal, "metaclient: OpenKeys of %d keys returned %d results", len(reqs), len(resp.Results))
		}
		out, errs, again := make([]*metapb.OpenKeyResponse, len(reqs)), make([]error, len(reqs)), make([]bool, len(reqs))
		for i, r := range resp.Results {
			switch {
			case r.GetCode() == uint32(codes.Unavailable):
				again[i] = true
			case r.GetCode() != 0:
				errs[i] = batchErr(r.GetCode(), r.GetMessage(), r.GetStatus())
			case r.GetOpen() == nil:
				errs[i] = status.Error(codes.Internal, "metaclient: OpenKeys returned neither an open key nor an error")
			default:
				out[i] = r.GetOpen()
			}
		}
		return out, errs, again, nil
	}
	c.commits.one = func(ctx context.Context, req *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
		return c.Namespace.CommitKey(ctx, req)
	}
	c.commits.many = func(ctx context.Context, reqs []*metapb.CommitKeyRequest) ([]*metapb.KeyInfo, []error, []bool, error) {
		resp, err := c.Namespace.CommitKeys(ctx, &metapb.CommitKeysRequest{Requests: reqs})
		if err != nil {
			return nil, nil, nil, err
		}
		if len(resp.Results) != len(reqs) {
			// The entry may have applied: the outcome of each is unknown.
			return nil, nil, nil, outcomeUnknown(metapb.Namespace_CommitKeys_FullMethodName, "",
				status.Errorf(codes.Internal, "CommitKeys of %d keys returned %d results", len(reqs), len(resp.Results)))
		}
		out, errs := make([]*metapb.KeyInfo, len(reqs)), make([]error, len(reqs))
		for i, r := range resp.Results {
			switch {
			case r.GetCode() != 0:
				errs[i] = batchErr(r.GetCode(), r.GetMessage(), r.GetStatus())
			case r.GetKey() == nil:
				errs[i] = outcomeUnknown(metapb.Namespace_CommitKeys_FullMethodName, "",
					status.Error(codes.Internal, "CommitKeys returned neither a key nor an error"))
			default:
				out[i] = r.GetKey()
			}
		}
		return out, errs, nil, nil
	}
}

// batchErr is a failed result's error as the single call would have
// returned it: with the status details when the server sent them.
func batchErr(code uint32, msg string, st []byte) error {
	if len(st) > 0 {
		sp := &spb.Status{}
		if proto.Unmarshal(st, sp) == nil && sp.Code == int32(code) {
			return status.FromProto(sp).Err()
		}
	}
	return status.Error(codes.Code(code), msg)
}

// call queues req and waits for its answer (or its caller giving up).
func (co *writeCoalescer[Q, R]) call(ctx context.Context, req Q) (R, error) {
	var zero R
	size := proto.Size(req)
	if co.noBatch.Load() || size > maxCoalescedBytes || time.Now().UnixNano() < co.batchAfter.Load() {
		return co.one(ctx, req)
	}
	var kbuf [512]byte
	md, kb := outgoingKey(ctx, kbuf[:0]) // (a Requester's: no copy)
	call := &writeCall[Q, R]{ctx: ctx, req: req, size: size, done: make(chan struct{})}
	co.mu.Lock()
	if co.queues == nil {
		co.queues = map[string]*writeQueue[Q, R]{}
	}
	q := co.queues[string(kb)]
	if q == nil {
		q = &writeQueue[Q, R]{md: md, key: string(kb)}
		co.queues[q.key] = q
	}
	if len(q.pending) >= maxWriteQueue {
		co.mu.Unlock()
		return co.one(ctx, req)
	}
	q.pending = append(q.pending, call)
	var batch []*writeCall[Q, R]
	if q.inflight < co.maxInflight {
		if batch = co.take(q); len(batch) > 0 {
			q.inflight++
		} else {
			co.release(q)
		}
	}
	co.mu.Unlock()
	if len(batch) > 0 {
		go co.drain(q, batch)
	}
	select {
	case <-call.done:
		return call.resp, call.err
	case <-ctx.Done():
		return zero, ctxError(co.method, ctx.Err())
	}
}

// take removes pending calls whose callers still wait, up to the batch
// bounds (under co.mu); calls whose callers gave up are dropped.
func (co *writeCoalescer[Q, R]) take(q *writeQueue[Q, R]) []*writeCall[Q, R] {
	var b []*writeCall[Q, R]
	size, i := 0, 0
	for ; i < len(q.pending) && len(b) < maxWriteBatch; i++ {
		call := q.pending[i]
		if err := call.ctx.Err(); err != nil {
			call.err = ctxError(co.method, err)
			close(call.done)
			continue
		}
		if len(b) > 0 && size+call.size > maxWriteBatchBytes {
			break
		}
		size += call.size
		b = append(b, call)
	}
	clear(q.pending[:i])
	q.pending = q.pending[i:]
	if len(q.pending) == 0 {
		q.pending = nil
	}
	return b
}

func (co *writeCoalescer[Q, R]) release(q *writeQueue[Q, R]) {
	if q.inflight == 0 && len(q.pending) == 0 {
		delete(co.queues, q.key)
	}
}

// drain sends batches until the queue is empty.
func (co *writeCoalescer[Q, R]) drain(q *writeQueue[Q, R], batch []*writeCall[Q, R]) {
	for {
		co.send(q, batch)
		co.mu.Lock()
		batch = nil
		if len(q.pending) > 0 {
			batch = co.take(q)
		}
		if len(batch) == 0 {
			q.inflight--
			co.release(q)
			co.mu.Unlock()
			return
		}
		co.mu.Unlock()
	}
}

// send makes one call for batch: a plain single call for a batch of one.
func (co *writeCoalescer[Q, R]) send(q *writeQueue[Q, R], batch []*writeCall[Q, R]) {
	if len(batch) == 1 {
		call := batch[0]
		call.resp, call.err = co.one(call.ctx, call.req)
		close(call.done)
		return
	}
	ctx, done := mergedContext(q.md, len(batch), func(i int) context.Context { return batch[i].ctx }, co.callTimeout)
	defer done()
	co.batches.Add(1)
	co.keys.Add(uint64(len(batch)))
	reqs := make([]Q, len(batch))
	for i, call := range batch {
		reqs[i] = call.req
	}
	resps, errs, again, err := co.many(ctx, reqs)
	if status.Code(err) == codes.Unimplemented {
		// An older server: nothing was applied; one call per key from
		// now on.
		co.noBatch.Store(true)
		go co.sendAlone(batch)
		return
	}
	if LayoutNotFinalized(err) {
		// Refused before the log: the batch call is not available until
		// the cluster's upgrade is finalized; one call per key meanwhile.
		co.batchAfter.Store(time.Now().Add(layoutRetryAfter).UnixNano())
		go co.sendAlone(batch)
		return
	}
	var alone []*writeCall[Q, R]
	for i, call := range batch {
		switch {
		case err != nil && call.ctx.Err() == nil && (ctx.Err() != nil || status.Code(err) == codes.DeadlineExceeded):
			// The batch's deadline passed (now + CallTimeout for a caller
			// without one) while this caller still waits: for it, a
			// timeout of the service, reported as the single call
			// reports one (see mergedContext). The server may see the
			// deadline first (it gets the remaining time with the call)
			// and end the call DEADLINE_EXCEEDED an instant before ctx
			// is done here: the same expiry (the batch's deadline is the
			// latest of its callers', and this caller's is still ahead).
			call.err = co.expired(err)
		case err != nil:
			call.err = err
		case again != nil && again[i]:
			alone = append(alone, call)
			continue
		default:
			call.resp, call.err = resps[i], errs[i]
		}
		close(call.done)
	}
	if len(alone) > 0 {
		go co.sendAlone(alone)
	}
}

// sendAlone sends each call on its own under its caller's context.
func (co *writeCoalescer[Q, R]) sendAlone(calls []*writeCall[Q, R]) {
	var wg sync.WaitGroup
	for _, call := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			call.resp, call.err = co.one(call.ctx, call.req)
			close(call.done)
		}()
	}
	wg.Wait()
}
