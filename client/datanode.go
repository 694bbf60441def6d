package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// maxDNConns bounds the datanode connections one client keeps; far above
// any cluster we target, it only stops a leak from bad leader hints.
const maxDNConns = 4096

// dnPool keeps one persistent connection per datanode address, made on
// first use. HTTP/2 multiplexes all of a client's calls to a datanode on
// it, so there is no reason to have more.
type dnPool struct {
	opts   []grpc.DialOption
	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	closed bool
}

func newDNPool(maxMsg int, extra []grpc.DialOption) *dnPool {
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg), grpc.MaxCallSendMsgSize(maxMsg)),
		// Large windows: a chunk is megabytes, the default 64 KiB window
		// would make every WriteChunk wait for window updates.
		grpc.WithInitialWindowSize(16 << 20),
		grpc.WithInitialConnWindowSize(64 << 20),
		// Receive buffers are not cleared before use (dirtyPool), and
		// frames are read from the TLS connection straight into them:
		// TLS already buffers what it decrypted, a bufio.Reader between
		// them only added a copy (8% of a GET's CPU).
		experimental.WithBufferPool(dnBufPool),
		grpc.WithReadBufferSize(0),
	}
	return &dnPool{opts: append(opts, extra...), conns: map[string]*grpc.ClientConn{}}
}

func (p *dnPool) get(addr string) (datanodepb.DatanodeClient, error) {
	cc, err := p.conn(addr)
	if err != nil {
		return nil, err
	}
	return datanodepb.NewDatanodeClient(cc), nil
}

func (p *dnPool) conn(addr string) (*grpc.ClientConn, error) {
	if addr == "" {
		return nil, errors.New("datanode has no data address")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errors.New("client is closed")
	}
	cc, ok := p.conns[addr]
	if !ok {
		if len(p.conns) >= maxDNConns {
			return nil, fmt.Errorf("too many datanode connections (%d); not connecting to %s", len(p.conns), addr)
		}
		var err error
		if cc, err = grpc.NewClient(addr, p.opts...); err != nil {
			return nil, fmt.Errorf("connect to datanode %s: %w", addr, err)
		}
		p.conns[addr] = cc
	}
	return cc, nil
}

func (p *dnPool) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	var errs []error
	for _, cc := range p.conns {
		errs = append(errs, cc.Close())
	}
	p.conns = nil
	return errors.Join(errs...)
}

// dnErrorOf returns the datanode's error detail, if the status has one.
func dnErrorOf(err error) *datanodepb.Error {
	st, ok := status.FromError(err)
	if !ok {
		return nil
	}
	for _, d := range st.Details() {
		if e, ok := d.(*datanodepb.Error); ok {
			return e
		}
	}
	return nil
}

// unreachable reports whether err means the datanode could not be reached
// (or died mid-call), as opposed to an answer from it.
func unreachable(err error) bool {
	return status.Code(err) == codes.Unavailable && dnErrorOf(err) == nil
}

// leaderError is a failure to get an answer from a pipeline's leader.
type leaderError struct {
	pipeline    uint64
	unreachable []uint64 // datanode IDs that could not be reached (or hung)
	last        error
}

// dnAnswer is an error a datanode answered a call with; it names the
// datanode, so a failure that is the datanode's own (its disk is full)
// can exclude it.
type dnAnswer struct {
	datanode uint64
	addr     string
	err      error
}

func (e *dnAnswer) Error() string { return fmt.Sprintf("datanode %s: %v", e.addr, e.err) }
func (e *dnAnswer) Unwrap() error { return e.err }

func (e *leaderError) Error() string {
	return fmt.Sprintf("pipeline %d: no leader answered (unreachable datanodes %v): %v", e.pipeline, e.unreachable, e.last)
}

func (e *leaderError) Unwrap() error { return e.last }

// maxRedirects bounds the NOT_LEADER hops of one call: an election moves
// the leader at most a few times in a call's life. maxLeaderAttempts bounds
// the calls made while looking for a leader.
const (
	maxRedirects      = 8
	maxLeaderAttempts = 100
)

// callLeader runs call against the leader of blk's pipeline, with blk's
// block token (package blocktoken) attached to the call: it starts
// with the last leader seen for the pipeline (else the nearest member),
// follows NOT_LEADER hints, and skips unreachable members. Errors other
// than "not the leader" and "unreachable" are returned as they are, with
// the address that gave them.
func (c *Client) callLeader(ctx context.Context, blk *metapb.BlockLocation, timeout time.Duration,
	call func(ctx context.Context, dn datanodepb.DatanodeClient) error) (string, error) {
	return c.callLeaderAt(ctx, blk, timeout, func(ctx context.Context, _ string, cc *grpc.ClientConn) error {
		return call(ctx, datanodepb.NewDatanodeClient(cc))
	})
}

// callLeaderAt is callLeader for a call that needs the member's address
// and connection (the small-file coalescer queues per address).
func (c *Client) callLeaderAt(ctx context.Context, blk *metapb.BlockLocation, timeout time.Duration,
	call func(ctx context.Context, addr string, cc *grpc.ClientConn) error) (string, error) {
	members := blk.Datanodes
	if len(members) == 0 {
		return "", &leaderError{pipeline: blk.PipelineId, last: fmt.Errorf("block %d/%d has no datanodes", blk.GetId().GetContainerId(), blk.GetId().GetLocalId())}
	}
	idOf := func(addr string) uint64 {
		for _, d := range members {
			if d.DataAddr == addr {
				return d.Id
			}
		}
		return 0
	}
	down := map[string]bool{}
	c.leadersMu.Lock()
	addr := c.leaders[blk.PipelineId]
	c.leadersMu.Unlock()
	if addr == "" || idOf(addr) == 0 {
		addr = members[0].DataAddr
	}
	backoff := 20 * time.Millisecond
	var last error
	nextMember := func() string {
		for _, d := range members {
			if !down[d.DataAddr] && d.DataAddr != addr {
				return d.DataAddr
			}
		}
		for _, d := range members {
			if !down[d.DataAddr] {
				return d.DataAddr
			}
		}
		return ""
	}
	// A new or recovering pipeline may need a few election timeouts to
	// get a leader: wait up to leaderWait for one, then give up on the
	// pipeline (the caller excludes it).
	giveUp := time.Now().Add(c.cfg.LeaderWait)
	redirects := 0
	for attempt := 0; attempt < maxLeaderAttempts && time.Now().Before(giveUp); attempt++ {
		if addr == "" {
			break
		}
		cc, err := c.dns.conn(addr)
		hung := false
		if err == nil {
			cctx, cancel := context.WithTimeout(ctx, timeout)
			wctx, done := c.prober.Watch(cctx, cc)
			err = call(blocktoken.WithToken(wctx, blk.Token), addr, cc)
			hung = done()
			cancel()
		}
		if err == nil {
			c.leadersMu.Lock()
			c.leaders[blk.PipelineId] = addr
			c.leadersMu.Unlock()
			return addr, nil
		}
		if ctx.Err() != nil {
			return addr, ctx.Err()
		}
		last = fmt.Errorf("datanode %s: %w", addr, err)
		if hung {
			// The leader took the call and answers nothing, not even a
			// probe (a stopped process): give up on this pipeline at
			// once rather than wait for its election; the caller excludes
			// the pipeline and the datanode and writes elsewhere.
			down[addr] = true
			last = fmt.Errorf("datanode %s: %w", addr, metaclient.ErrHung)
			break
		}
		if e := dnErrorOf(err); e != nil && e.Kind == datanodepb.Error_NOT_LEADER {
			if e.LeaderAddr != "" && e.LeaderAddr != addr && !down[e.LeaderAddr] && redirects < maxRedirects {
				redirects++
				addr = e.LeaderAddr
				continue
			}
			// Election in progress: wait a little, then ask another member.
			if !sleepCtx(ctx, backoff) {
				return addr, ctx.Err()
			}
			backoff = min(2*backoff, 500*time.Millisecond)
			addr = nextMember()
			continue
		}
		if unreachable(err) {
			down[addr] = true
			addr = nextMember()
			continue
		}
		return addr, &dnAnswer{datanode: idOf(addr), addr: addr, err: err}
	}
	le := &leaderError{pipeline: blk.PipelineId, last: last}
	for a := range down {
		if id := idOf(a); id != 0 {
			le.unreachable = append(le.unreachable, id)
		}
	}
	c.leadersMu.Lock()
	delete(c.leaders, blk.PipelineId)
	c.leadersMu.Unlock()
	return "", le
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func dnBlockID(id *metapb.BlockID) *datanodepb.BlockID {
	return &datanodepb.BlockID{ContainerId: id.GetContainerId(), LocalId: id.GetLocalId()}
}
