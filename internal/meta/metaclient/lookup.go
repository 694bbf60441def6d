package metaclient

import (
	"context"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

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
// into one LookupKeys call. Batches are pipelined: while up to
// MaxLookupsInFlight batches are in flight, a call leaves at once in a
// batch of its own (no waiting, so a lone caller pays no latency); beyond
// that, calls queue and leave together as soon as a batch returns. The
// server authorizes every key on its own and runs one read barrier per
// batch that starts after the batch was sent, so each answer is as
// linearizable as LookupKey's.

const (
	// DefaultLookupsInFlight is the default of Config.LookupsInFlight.
	DefaultLookupsInFlight = 2
	// maxLookupBatch is the server's bound (namespace.MaxLookupBatch).
	maxLookupBatch = 1024
)

type lookupCall struct {
	req  *metapb.LookupKeyRequest
	done chan struct{}
	ki   *metapb.KeyInfo
	err  error
}

// lookupQueue holds the calls of one requester.
type lookupQueue struct {
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
		return c.Namespace.LookupKey(ctx, req)
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	key := mdKey(md)
	call := &lookupCall{req: req, done: make(chan struct{})}
	co.mu.Lock()
	if co.queues == nil {
		co.queues = map[string]*lookupQueue{}
	}
	q := co.queues[key]
	if q == nil {
		q = &lookupQueue{md: md.Copy()}
		co.queues[key] = q
	}
	q.pending = append(q.pending, call)
	var batch []*lookupCall
	if q.inflight < co.maxInflight {
		q.inflight++
		batch = q.take()
	}
	co.mu.Unlock()
	if batch != nil {
		// Sent from a goroutine that goes on with what queues meanwhile,
		// so that this caller's own context still bounds its wait.
		go co.drain(key, q, batch)
	}
	select {
	case <-call.done:
		return call.ki, call.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// take removes up to maxLookupBatch pending calls (under co.mu).
func (q *lookupQueue) take() []*lookupCall {
	n := min(len(q.pending), maxLookupBatch)
	b := q.pending[:n:n]
	if n == len(q.pending) {
		q.pending = nil
	} else {
		q.pending = q.pending[n:]
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
		if len(q.pending) == 0 {
			q.inflight--
			co.release(key, q)
			co.mu.Unlock()
			return
		}
		batch = q.take()
		co.mu.Unlock()
	}
}

// send makes one LookupKeys call for batch and hands each call its answer.
// The call runs under the client's CallTimeout, not a caller's context:
// one caller giving up must not fail the others' lookups.
func (co *coalescer) send(q *lookupQueue, batch []*lookupCall) {
	ctx := metadata.NewOutgoingContext(context.Background(), q.md)
	if len(batch) == 1 {
		ki, err := co.c.Namespace.LookupKey(ctx, batch[0].req)
		batch[0].ki, batch[0].err = ki, err
		close(batch[0].done)
		return
	}
	co.batches.Add(1)
	co.keys.Add(uint64(len(batch)))
	req := &metapb.LookupKeysRequest{Requests: make([]*metapb.LookupKeyRequest, len(batch))}
	for i, call := range batch {
		req.Requests[i] = call.req
	}
	resp, err := co.c.Namespace.LookupKeys(ctx, req)
	if status.Code(err) == codes.Unimplemented {
		// An older server: one LookupKey per call from now on.
		co.noBatch.Store(true)
		var wg sync.WaitGroup
		for _, call := range batch {
			wg.Add(1)
			go func() {
				defer wg.Done()
				call.ki, call.err = co.c.Namespace.LookupKey(ctx, call.req)
				close(call.done)
			}()
		}
		wg.Wait()
		return
	}
	if err == nil && len(resp.Results) != len(batch) {
		err = status.Errorf(codes.Internal, "metaclient: LookupKeys of %d keys returned %d results", len(batch), len(resp.Results))
	}
	for i, call := range batch {
		switch {
		case err != nil:
			call.err = err
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

// mdKey is a canonical form of outgoing metadata: calls with equal keys
// act for the same requester and may share a batch.
func mdKey(md metadata.MD) string {
	if len(md) == 0 {
		return ""
	}
	ks := make([]string, 0, len(md))
	for k := range md {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	var b strings.Builder
	for _, k := range ks {
		b.WriteString(k)
		for _, v := range md[k] {
			b.WriteByte(0)
			b.WriteString(v)
		}
		b.WriteByte(1)
	}
	return b.String()
}
