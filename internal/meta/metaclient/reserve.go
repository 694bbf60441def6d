package metaclient

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Block reservation pools (issue 15; namespace/reserve.go). A writer of
// small keys takes a reserved block from the pool of its requester (the
// identity in the outgoing metadata: the end user, anonymous, or the
// caller itself, but not the request's attributes for policy conditions,
// source IP and the like, which the commit carries and the service
// checks with each request's own), bucket, replication and size class
// instead of opening each key: the key is then committed with one
// CommitKey naming it, so a small PUT makes one meta round instead of
// two. A pool refills itself in the background when it runs low, with
// one ReserveBlocks call (one Raft entry for all its blocks) under the
// requester's metadata, growing its batch while it is drained fast
// (from minReserve to the caller's count) and shrinking it while it is
// not, so that a writer of one key reserves little it will not use.
//
// A pooled block on anything the caller's exclude list names (a failed
// datanode, pipeline or container) is dropped, not handed out.
//
// TakeReserved answers nil, with no error, whenever the caller should
// open the key the usual way: a server without ReserveBlocks (asked
// again after reserveAbsentFor: a rolling upgrade), a bucket or a
// cluster the server refused to reserve for (FailedPrecondition, also a
// cluster whose layout does not have reservations yet; PermissionDenied
// and the like: for reserveRefusedFor), or a refill that failed (then
// the pool's refills back off, from reserveBackoffMin to
// reserveRefusedFor, so that a failover does not make every PUT wait on
// a failing ReserveBlocks first).

const (
	// minReserve is the first batch of a pool.
	minReserve = 4
	// reserveMaxAge: a reservation older than this is not handed out
	// (the server's expiry is minutes; one left unused expires there).
	reserveMaxAge = time.Minute
	// maxReservePools bounds the pools kept; beyond, idle ones go.
	maxReservePools = 1024
	// reserveTries: refills a caller waits for before it opens its key
	// the usual way.
	reserveTries = 6
)

// (Variables for the tests.)
var (
	// reserveRefusedFor: how long a pool whose reservation the server
	// refused (an fs bucket, no right to write the whole bucket, a
	// cluster whose layout does not have reservations yet) sends its
	// keys the usual way before it asks again.
	reserveRefusedFor = 30 * time.Second
	// reserveAbsentFor: how long a client whose server answered
	// Unimplemented opens its keys the usual way before it asks again.
	reserveAbsentFor = time.Minute
	// reserveBackoffMin is the first back-off after a failed refill
	// (doubling per failure up to reserveRefusedFor).
	reserveBackoffMin = time.Second
)

// Reserved is one reserved block: an open key without a name, to be
// committed with CommitKeyRequest.key (and volume, bucket) set.
type Reserved struct {
	OpenID    uint64
	Block     *metapb.BlockLocation
	BlockSize uint64
}

type reservePool struct {
	key     string
	md      metadata.MD
	req     *metapb.ReserveBlocksRequest // the refills' request (count set per refill)
	blocks  []*Reserved
	taken   time.Time // when the pool was last refilled
	expires time.Time // when its blocks stop being handed out
	batch   int       // the next refill's count
	refill  chan struct{}
	refused time.Time     // refills refused (or backed off) until then
	backoff time.Duration // the next back-off after a failed refill
	used    time.Time
	waiting int // callers waiting for the refill
}

type reservePools struct {
	mu     sync.Mutex
	pools  map[string]*reservePool
	absent atomic.Int64 // the server has no ReserveBlocks: until then (unix ns)
	calls  atomic.Uint64
	blocks atomic.Uint64
	taken  atomic.Uint64
}

// ReserveStats returns the ReserveBlocks calls made, the blocks they
// reserved and the blocks TakeReserved handed out.
func (c *Client) ReserveStats() (calls, blocks, taken uint64) {
	return c.reserves.calls.Load(), c.reserves.blocks.Load(), c.reserves.taken.Load()
}

// TakeReserved takes a reserved block of req's bucket (req.Count is the
// most a refill asks for, at most 64) for the requester of ctx, waiting
// for a refill when the pool is empty. See above for a nil answer.
func (c *Client) TakeReserved(ctx context.Context, req *metapb.ReserveBlocksRequest) (*Reserved, error) {
	rp := &c.reserves
	if rp.absentNow() || req.Count == 0 {
		return nil, nil
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	var kbuf [512]byte
	kb := appendIdentityKey(kbuf[:0], md)
	kb = fmt.Appendf(kb, "\x01%s\x00%s\x00%d\x00%d\x00%d\x00%d\x00%s", req.Volume, req.Bucket, req.Replication,
		req.ExpectedBytes, req.ChecksumType, req.BytesPerChecksum, req.ClientLocation)
	// A few times at most: refills that leave nothing to take (other
	// callers took it all) send this key the usual way. (Each refill is
	// sized for the callers waiting, so a burst is served within a few.)
	for try := 0; try < reserveTries; try++ {
		rp.mu.Lock()
		if rp.pools == nil {
			rp.pools = map[string]*reservePool{}
		}
		p := rp.pools[string(kb)]
		if p == nil {
			if len(rp.pools) >= maxReservePools {
				rp.evict()
			}
			p = &reservePool{key: string(kb), md: md, req: req, batch: minReserve}
			rp.pools[p.key] = p
		}
		now := time.Now()
		p.used, p.req, p.md = now, req, md // (the latest exclude list and request attributes)
		if now.After(p.expires) {
			p.blocks = nil // (they expire on the server)
		}
		var r *Reserved
		for r == nil && len(p.blocks) > 0 {
			r, p.blocks = p.blocks[0], p.blocks[1:]
			if excludes(req.Exclude, r.Block) {
				r = nil // (it expires on the server)
			}
		}
		if r == nil && now.Before(p.refused) {
			rp.mu.Unlock()
			return nil, nil
		}
		if len(p.blocks) <= p.batch/2 && p.refill == nil && !now.Before(p.refused) {
			c.startRefill(p, int(req.Count))
		}
		wait := p.refill
		if r == nil {
			p.waiting++
		}
		rp.mu.Unlock()
		if r != nil {
			rp.taken.Add(1)
			return r, nil
		}
		var err error
		select {
		case <-wait:
		case <-ctx.Done():
			err = ctx.Err()
		}
		rp.mu.Lock()
		p.waiting--
		failed := len(p.blocks) == 0 && p.refill == nil
		rp.mu.Unlock()
		if err != nil {
			return nil, err
		}
		if failed || rp.absentNow() {
			return nil, nil
		}
	}
	return nil, nil
}

// startRefill sends one ReserveBlocks for p in the background (under
// rp.mu).
func (c *Client) startRefill(p *reservePool, most int) {
	now := time.Now()
	// Grow while the pool drains within a second of its last refill.
	if !p.taken.IsZero() && now.Sub(p.taken) < time.Second {
		p.batch = min(p.batch*2, most)
	} else if !p.taken.IsZero() && now.Sub(p.taken) > 10*time.Second {
		p.batch = max(p.batch/2, minReserve)
	}
	p.batch = max(min(p.batch, most), 1)
	// Enough for the callers already waiting, too.
	count := min(max(p.batch, p.waiting+1), most)
	done := make(chan struct{})
	p.refill = done
	q := p.req
	req := &metapb.ReserveBlocksRequest{Volume: q.Volume, Bucket: q.Bucket, Count: uint32(count), Replication: q.Replication,
		ChecksumType: q.ChecksumType, BytesPerChecksum: q.BytesPerChecksum, ClientLocation: q.ClientLocation,
		Exclude: q.Exclude, ExpectedBytes: q.ExpectedBytes}
	md := p.md
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), c.cfg.CallTimeout)
		defer cancel()
		if len(md) > 0 {
			ctx = metadata.NewOutgoingContext(ctx, md)
		}
		resp, err := c.Namespace.ReserveBlocks(ctx, req)
		rp := &c.reserves
		rp.calls.Add(1)
		rp.mu.Lock()
		defer rp.mu.Unlock()
		defer close(done)
		p.refill = nil
		switch code := status.Code(err); {
		case err == nil:
			p.backoff = 0
		case code == codes.Unimplemented:
			rp.absent.Store(time.Now().Add(reserveAbsentFor).UnixNano())
			return
		case LayoutNotFinalized(err):
			// A cluster not finalized at the reservations' layout: also
			// a fresh cluster for the moment before its first leader
			// records its layout, so ask again soon, backing off.
			p.backoff = min(max(2*p.backoff, reserveBackoffMin), reserveRefusedFor)
			p.refused = time.Now().Add(p.backoff)
			return
		case code == codes.FailedPrecondition || code == codes.PermissionDenied || code == codes.NotFound || code == codes.InvalidArgument:
			p.refused = time.Now().Add(reserveRefusedFor)
			return
		default:
			// (The waiting callers open their keys the usual way, and
			// so do the next ones for a while.)
			p.backoff = min(max(2*p.backoff, reserveBackoffMin), reserveRefusedFor)
			p.refused = time.Now().Add(p.backoff)
			return
		}
		now := time.Now()
		// At most reserveMaxAge, and half the time the server gives (its
		// clock may be ahead).
		exp := now.Add(reserveMaxAge)
		if resp.ExpiresUnixMs != 0 {
			if srv := now.Add(time.UnixMilli(resp.ExpiresUnixMs).Sub(now) / 2); srv.Before(exp) {
				exp = srv
			}
		}
		if now.After(p.expires) {
			p.blocks = nil
		}
		p.taken, p.expires = now, exp
		for _, b := range resp.Blocks {
			if b.GetBlock() != nil && len(b.Block.Datanodes) > 0 {
				p.blocks = append(p.blocks, &Reserved{OpenID: b.OpenId, Block: b.Block, BlockSize: resp.BlockSize})
			}
		}
		rp.blocks.Add(uint64(len(resp.Blocks)))
	}()
}

// evict drops the pools not used for the longest (under mu): their
// reservations expire on the server.
func (rp *reservePools) evict() {
	cut := time.Now().Add(-reserveMaxAge)
	for k, p := range rp.pools {
		if p.refill == nil && p.used.Before(cut) {
			delete(rp.pools, k)
		}
	}
	for k, p := range rp.pools {
		if len(rp.pools) < maxReservePools {
			return
		}
		if p.refill == nil {
			delete(rp.pools, k)
		}
	}
}

// absentNow reports whether the server answered ReserveBlocks
// Unimplemented less than reserveAbsentFor ago.
func (rp *reservePools) absentNow() bool {
	until := rp.absent.Load()
	return until != 0 && time.Now().UnixNano() < until
}

// appendIdentityKey is appendMDKey of md without the request attributes
// (source IP, TLS, user agent, referer): a pool is a requester's, not a
// request's.
func appendIdentityKey(b []byte, md metadata.MD) []byte {
	for _, k := range requestInfoHeaders {
		if _, ok := md[k]; ok {
			md = md.Copy()
			for _, k := range requestInfoHeaders {
				delete(md, k)
			}
			break
		}
	}
	return appendMDKey(b, md)
}

var requestInfoHeaders = [...]string{SourceIPHeader, SecureTransportHeader, UserAgentHeader, RefererHeader}

// excludes reports whether blk is on anything ex names.
func excludes(ex *metapb.ExcludeList, blk *metapb.BlockLocation) bool {
	if ex == nil {
		return false
	}
	if slices.Contains(ex.Pipelines, blk.GetPipelineId()) || slices.Contains(ex.Containers, blk.GetId().GetContainerId()) {
		return true
	}
	for _, d := range blk.GetDatanodes() {
		if slices.Contains(ex.Datanodes, d.GetId()) {
			return true
		}
	}
	return false
}
