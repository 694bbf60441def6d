package metaclient

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Lookup coalescing. Lookup is LookupKey for callers that make many at
// once (a gateway serving HEADs, a reader opening many keys): concurrent
// calls that act for the same requester (the same outgoing gRPC metadata:
// on-behalf-of user, anonymity, request attributes, user token) are merged
// into one LookupKeys call. Batches are pipelined: while fewer than
// Config.LookupsInFlight batches of a requester are in flight, a call
// leaves at once in a batch of its own (no waiting, so a lone caller pays
// no latency); beyond that, calls queue (up to maxLookupQueue; past it a
// call goes alone as a LookupKey) and leave together as soon as a batch
// returns. (Holding a second batch until 16 calls wait was measured in
// session 8: ~3% less metadata CPU within noise, ~2 ms more p99, ~10% less
// throughput; not done.) Calls whose callers gave up meanwhile are
// dropped, and a batch runs until the latest of its callers' deadlines,
// or until all of them gave up. The server authorizes every key on its own and runs one read
// barrier per batch that starts after the batch was sent, so each answer
// is as linearizable as LookupKey's. A key the server left unanswered
// (RetryAlone: its answer would have made the response too big), a key
// that failed UNAVAILABLE (not the leader, no block token key yet), and
// the keys of a batch refused RESOURCE_EXHAUSTED are sent again as
// LookupKey calls, which the client retries as it retries any read; those
// retries run outside the in-flight slots, so that no call waits behind
// them.

const (
	// DefaultLookupsInFlight is the default of Config.LookupsInFlight.
	DefaultLookupsInFlight = 2
	// maxLookupBatch is the server's bound (namespace.MaxLookupBatch).
	maxLookupBatch = 1024
	// maxLookupQueue bounds the calls queued per requester.
	maxLookupQueue = 4 * maxLookupBatch
	// lookupRetryers bounds the LookupKey calls one batch sends again at
	// once.
	lookupRetryers = 16
)

type lookupCall struct {
	ctx  context.Context // the caller's: its metadata, deadline and cancellation
	req  *metapb.LookupKeyRequest
	done chan struct{}
	ki   *metapb.KeyInfo
	err  error
}

// lookupQueue holds the calls of one requester.
type lookupQueue struct {
	key      string // its key in coalescer.queues (mdKey of md)
	md       metadata.MD
	inflight int
	pending  []*lookupCall
}

type coalescer struct {
	c           *Client
	maxInflight int
	mu          sync.Mutex
	queues      map[string]*lookupQueue
	noBatch     atomic.Bool // the server has no LookupKeys: one call each
	batches     atomic.Uint64
	keys        atomic.Uint64
}

// LookupStats returns the LookupKeys calls Lookup made and the keys they
// carried.
func (c *Client) LookupStats() (batches, keys uint64) {
	return c.lookups.batches.Load(), c.lookups.keys.Load()
}

// Lookup is Namespace.LookupKey, coalesced with concurrent calls of the
// same requester into LookupKeys calls (see above). Errors are LookupKey's.
func (c *Client) Lookup(ctx context.Context, req *metapb.LookupKeyRequest) (*metapb.KeyInfo, error) {
	co := &c.lookups
	if co.noBatch.Load() {
		return c.Namespace.LookupKey(ctx, req, lookupCallOpt)
	}
	var kbuf [512]byte
	md, kb := outgoingKey(ctx, kbuf[:0])
	call := &lookupCall{ctx: ctx, req: req, done: make(chan struct{})}
	co.mu.Lock()
	if co.queues == nil {
		co.queues = map[string]*lookupQueue{}
	}
	q := co.queues[string(kb)] // (no allocation for the lookup)
	key := ""
	if q == nil {
		key = string(kb)
		q = &lookupQueue{md: md, key: key}
		co.queues[key] = q
	} else {
		key = q.key
	}
	if len(q.pending) >= maxLookupQueue {
		co.mu.Unlock()
		return c.Namespace.LookupKey(ctx, req, lookupCallOpt)
	}
	q.pending = append(q.pending, call)
	var batch []*lookupCall
	if q.inflight < co.maxInflight {
		if batch = q.take(); len(batch) > 0 {
			q.inflight++
		} else {
			co.release(key, q) // the caller gave up already
		}
	}
	co.mu.Unlock()
	if len(batch) > 0 {
		// Sent from a goroutine that goes on with what queues meanwhile,
		// so that this caller's own context still bounds its wait.
		go co.drain(key, q, batch)
	}
	select {
	case <-call.done:
		return call.ki, call.err
	case <-ctx.Done():
		return nil, ctxError(metapb.Namespace_LookupKey_FullMethodName, ctx.Err())
	}
}

// take removes up to maxLookupBatch pending calls whose callers still wait
// (under co.mu); the others are dropped.
func (q *lookupQueue) take() []*lookupCall {
	var b []*lookupCall
	i := 0
	for ; i < len(q.pending) && len(b) < maxLookupBatch; i++ {
		call := q.pending[i]
		if err := call.ctx.Err(); err != nil {
			call.err = ctxError(metapb.Namespace_LookupKey_FullMethodName, err)
			close(call.done)
			continue
		}
		b = append(b, call)
	}
	clear(q.pending[:i])
	q.pending = q.pending[i:]
	if len(q.pending) == 0 {
		q.pending = nil
	}
	return b
}

// release drops an idle queue (under co.mu), so that requesters come and
// go without the map growing.
func (co *coalescer) release(key string, q *lookupQueue) {
	if q.inflight == 0 && len(q.pending) == 0 {
		delete(co.queues, key)
	}
}

// drain sends batches until the queue is empty.
func (co *coalescer) drain(key string, q *lookupQueue, batch []*lookupCall) {
	for {
		co.send(q, batch)
		co.mu.Lock()
		if len(q.pending) > 0 {
			batch = q.take()
		} else {
			batch = nil
		}
		if len(batch) == 0 {
			q.inflight--
			co.release(key, q)
			co.mu.Unlock()
			return
		}
		co.mu.Unlock()
	}
}

// batchContext is the context of one LookupKeys call for batch (see
// mergedContext).
func batchContext(q *lookupQueue, batch []*lookupCall, callTimeout time.Duration) (context.Context, func()) {
	return mergedContext(q.md, len(batch), func(i int) context.Context { return batch[i].ctx }, callTimeout)
}

// ctxError is a caller's own deadline or cancellation (err, its
// context's error) as the router returns it for a single call:
// errors.Is(err, context.DeadlineExceeded or Canceled) holds, so that the
// client tells it from a service's timeout, and status.Code still gives
// the code.
func ctxError(method string, err error) error {
	return fmt.Errorf("metaclient: %s: %w: %w", method, err, status.FromContextError(err).Err())
}

// mergedContext is the context of one batch call for n callers (ctxOf):
// metadata md, the latest of the callers' deadlines, counting now +
// callTimeout for a caller without one (what a single call of its own
// would get from the router), and cancelled once every caller gave up,
// for one caller giving up must not fail the others. A caller without a
// deadline must not cut the batch short for the others: the batch runs
// as long as the longest of its callers' single calls would. The batch's
// context can still expire while a caller's own context is live (a
// caller without a deadline outlives now + callTimeout): the senders
// report that to such a caller as the single call reports a server's
// timeout, not as a deadline of its own (see writeCoalescer.expired).
func mergedContext(md metadata.MD, n int, ctxOf func(int) context.Context, callTimeout time.Duration) (context.Context, func()) {
	ctx := metadata.NewOutgoingContext(context.Background(), md)
	now := time.Now()
	var latest time.Time
	for i := range n {
		d, ok := ctxOf(i).Deadline()
		if !ok {
			d = now.Add(callTimeout)
		}
		if d.After(latest) {
			latest = d
		}
	}
	ctx, cancel := context.WithDeadline(ctx, latest)
	live := atomic.Int64{}
	live.Store(int64(n))
	stops := make([]func() bool, n)
	for i := range n {
		stops[i] = context.AfterFunc(ctxOf(i), func() {
			if live.Add(-1) == 0 {
				cancel()
			}
		})
	}
	return ctx, func() {
		for _, stop := range stops {
			stop()
		}
		cancel()
	}
}

// send looks batch up and hands each call its answer, or the calls to
// send again alone to a goroutine of their own: their LookupKey retries
// may take up to their callers' deadlines, and the slot must not wait for
// them. A batch of one is a LookupKey that keeps the slot (else lone calls
// would never queue, and no batch would form).
func (co *coalescer) send(q *lookupQueue, batch []*lookupCall) {
	if len(batch) == 1 {
		co.sendAlone(batch)
		return
	}
	var again []*lookupCall // calls to send again alone
	co.sendBatch(q, batch, &again)
	if len(again) > 0 {
		go co.sendAlone(again)
	}
}

// sendBatch makes one LookupKeys call for batch (a LookupKey for one
// call), answers the calls it can and adds those to send again alone to
// again. A batch refused RESOURCE_EXHAUSTED (its answer passed the receive
// limit) is sent again in halves.
func (co *coalescer) sendBatch(q *lookupQueue, batch []*lookupCall, again *[]*lookupCall) {
	if len(batch) == 1 {
		*again = append(*again, batch[0])
		return
	}
	ctx, done := batchContext(q, batch, co.c.cfg.CallTimeout)
	defer done()
	co.batches.Add(1)
	co.keys.Add(uint64(len(batch)))
	req := &metapb.LookupKeysRequest{Requests: make([]*metapb.LookupKeyRequest, len(batch))}
	for i, call := range batch {
		req.Requests[i] = call.req
	}
	resp, err := co.c.Namespace.LookupKeys(ctx, req, lookupCallOpt)
	switch status.Code(err) {
	case codes.Unimplemented:
		// An older server: one LookupKey per call from now on.
		co.noBatch.Store(true)
		*again = append(*again, batch...)
		return
	case codes.ResourceExhausted:
		h := len(batch) / 2
		co.sendBatch(q, batch[:h], again)
		co.sendBatch(q, batch[h:], again)
		return
	}
	if err == nil && len(resp.Results) != len(batch) {
		err = status.Errorf(codes.Internal, "metaclient: LookupKeys of %d keys returned %d results", len(batch), len(resp.Results))
	}
	for i, call := range batch {
		switch {
		case err != nil && ctx.Err() != nil && call.ctx.Err() == nil:
			// The batch's deadline passed (now + CallTimeout for a caller
			// without one) while this caller still waits: a timeout of
			// the service, not of the caller (see mergedContext).
			call.err = status.Errorf(codes.Unavailable, "metaclient: LookupKeys: the batch's deadline passed before an answer: %v", err)
		case err != nil:
			call.err = err
		case resp.Results[i].GetRetryAlone(), codes.Code(resp.Results[i].GetCode()) == codes.Unavailable:
			// Not answered for its size, or not the leader / not ready:
			// LookupKey retries that.
			*again = append(*again, call)
			continue
		case resp.Results[i].GetCode() != 0:
			call.err = resultErr(resp.Results[i])
		case resp.Results[i].GetKey() == nil:
			call.err = status.Error(codes.Internal, "metaclient: LookupKeys returned neither a key nor an error")
		default:
			call.ki = resp.Results[i].GetKey()
		}
		close(call.done)
	}
}

// sendAlone sends each call as a LookupKey under its caller's context, a
// few at a time.
func (co *coalescer) sendAlone(calls []*lookupCall) {
	if len(calls) == 0 {
		return
	}
	if len(calls) == 1 {
		// A batch of one (a lone caller, the usual case at low
		// concurrency): sent from this goroutine, without a semaphore and
		// a goroutine of its own (issue 15: CPU per S3 HEAD).
		call := calls[0]
		if err := call.ctx.Err(); err != nil {
			call.err = ctxError(metapb.Namespace_LookupKey_FullMethodName, err)
		} else {
			call.ki, call.err = co.c.Namespace.LookupKey(call.ctx, call.req, lookupCallOpt)
		}
		close(call.done)
		return
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, lookupRetryers)
	for _, call := range calls {
		if err := call.ctx.Err(); err != nil {
			call.err = ctxError(metapb.Namespace_LookupKey_FullMethodName, err)
			close(call.done)
			continue
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			call.ki, call.err = co.c.Namespace.LookupKey(call.ctx, call.req, lookupCallOpt)
			close(call.done)
		}()
	}
	wg.Wait()
}

// resultErr is a failed result's error as LookupKey would have returned
// it: with the status details when the server sent them.
func resultErr(r *metapb.LookupKeyResult) error {
	code := codes.Code(r.GetCode())
	if b := r.GetStatus(); len(b) > 0 {
		sp := &spb.Status{}
		if proto.Unmarshal(b, sp) == nil && codes.Code(sp.Code) == code {
			return status.FromProto(sp).Err()
		}
	}
	return status.Error(code, r.GetMessage())
}

// Requester is the outgoing metadata of one requester, prepared for many
// calls: Lookup finds its coalescing queue by the key computed here
// instead of copying the metadata out of each call's context (a map and
// a slice per name: issue 15, allocations per S3 HEAD).
type Requester struct {
	md  metadata.MD // read-only, shared by every call (gRPC only reads it)
	key []byte      // appendMDKey(nil, md)
}

// NewRequester prepares md (copied, names lower-cased as
// metadata.FromOutgoingContext gives them).
func NewRequester(md metadata.MD) *Requester {
	md, _ = metadata.FromOutgoingContext(metadata.NewOutgoingContext(context.Background(), md))
	return &Requester{md: md, key: appendMDKey(nil, md)}
}

// Context returns parent with the requester's metadata as its outgoing
// metadata (replacing parent's, as metadata.NewOutgoingContext does).
func (r *Requester) Context(parent context.Context) context.Context {
	return &requesterCtx{Context: metadata.NewOutgoingContext(parent, r.md), r: r}
}

// requesterCtx is a Requester's context. Lookup trusts r only when the
// context it is given is a requesterCtx itself: a context derived from
// it (a deadline, other metadata appended or set) is not one, and its
// metadata is read the ordinary way.
type requesterCtx struct {
	context.Context // metadata.NewOutgoingContext(parent, r.md)
	r               *Requester
}

// outgoingKey returns ctx's outgoing metadata (not to be modified) and
// its key (appendMDKey, appended to b): a Requester's own, without a
// copy, when ctx was made by Requester.Context and nothing derived from
// it since; else a copy of the metadata, and its key computed.
func outgoingKey(ctx context.Context, b []byte) (metadata.MD, []byte) {
	if rc, ok := ctx.(*requesterCtx); ok {
		return rc.r.md, rc.r.key
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	return md, appendMDKey(b, md)
}

// mdKey is a canonical form of outgoing metadata: calls with equal keys
// act for the same requester and may share a batch.
func mdKey(md metadata.MD) string { return string(appendMDKey(nil, md)) }

// appendMDKey appends mdKey(md) to b, without allocating for a small md
// when b has room (the coalescer looks its queue up with it per call).
func appendMDKey(b []byte, md metadata.MD) []byte {
	if len(md) == 0 {
		return b
	}
	var arr [16]string
	ks := arr[:0]
	for k := range md {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	// Each name and value length-prefixed: a -bin value may hold any byte,
	// so no separator could tell two requesters apart.
	for _, k := range ks {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(md[k])))
		for _, v := range md[k] {
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return b
}
