package metaclient

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// reserveStub is a Namespace server on loopback whose ReserveBlocks
// answers what a test sets (what a real server cannot be made to do on
// demand: be of an older version, fail over). Its blocks are on
// pipeline s.pipeline, datanode 1. (The real-cluster tests are
// client/reserve_test.go.)
type reserveStub struct {
	metapb.UnimplementedNamespaceServer
	mu       sync.Mutex
	code     codes.Code // answer this error (OK: blocks)
	pipeline uint64
	next     uint64
	calls    atomic.Int64
}

func (s *reserveStub) ReserveBlocks(ctx context.Context, r *metapb.ReserveBlocksRequest) (*metapb.ReserveBlocksResponse, error) {
	s.calls.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.code != codes.OK {
		return nil, status.Error(s.code, "stub: refused")
	}
	resp := &metapb.ReserveBlocksResponse{BlockSize: 1 << 20, ExpiresUnixMs: time.Now().Add(10 * time.Minute).UnixMilli()}
	for range r.Count {
		s.next++
		resp.Blocks = append(resp.Blocks, &metapb.ReservedBlock{OpenId: s.next, Block: &metapb.BlockLocation{
			Id: &metapb.BlockID{ContainerId: 1, LocalId: s.next}, PipelineId: s.pipeline, Datanodes: []*metapb.DatanodeDetails{{Id: s.pipeline}}}})
	}
	return resp, nil
}

func (s *reserveStub) set(code codes.Code, pipeline uint64) {
	s.mu.Lock()
	s.code, s.pipeline = code, pipeline
	s.mu.Unlock()
}

func startReserveStub(t *testing.T, s *reserveStub) *Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	metapb.RegisterNamespaceServer(srv, s)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	c, err := New(Config{Addrs: []string{lis.Addr().String()}, CallTimeout: 10 * time.Second, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func takeOne(t *testing.T, c *Client, ctx context.Context, ex *metapb.ExcludeList) *Reserved {
	t.Helper()
	r, err := c.TakeReserved(ctx, &metapb.ReserveBlocksRequest{Volume: "v", Bucket: "b", Count: 16, ExpectedBytes: 4096, Exclude: ex})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// One pool per requester, not per request: the same user from many
// source IPs and user agents (a gateway's clients) shares one pool, and
// each refill carries the latest request's attributes (review 13,
// finding 4; the commit carries each request's own, and the service
// checks them there: namespace TestReservedCommitChecksItsRequest).
func TestReservePoolPerRequester(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := &reserveStub{pipeline: 1}
	c := startReserveStub(t, s)
	alice := WithUser(ctx, "alice", false)
	for i := range 20 {
		rctx := WithRequestInfo(alice, RequestInfo{SourceIP: fmt.Sprintf("10.0.0.%d", i), UserAgent: fmt.Sprintf("sdk/%d", i)})
		if takeOne(t, c, rctx, nil) == nil {
			t.Fatalf("take %d: none", i)
		}
	}
	// (A refill alice's takes started in the background is counted
	// once it is back: wait for it, or it is taken for bob's.)
	waitRefills(t, c)
	calls, blocks, taken := c.ReserveStats()
	if taken != 20 || calls > 4 || blocks > 4+8+16+16 { // (batches grow 4, 8, 16, 16)
		t.Fatalf("20 takes from 20 source IPs: %d ReserveBlocks calls, %d blocks reserved, %d taken; want one pool (at most 4 calls)", calls, blocks, taken)
	}
	// Another user: a pool of its own.
	if takeOne(t, c, WithUser(ctx, "bob", false), nil) == nil {
		t.Fatal("bob: none")
	}
	if c2, _, _ := c.ReserveStats(); c2 != calls+1 {
		t.Fatalf("bob's take made %d ReserveBlocks calls, want 1 (a pool of his own)", c2-calls)
	}
}

// waitRefills waits until no pool of c has a refill in flight.
func waitRefills(t *testing.T, c *Client) {
	t.Helper()
	rp := &c.reserves
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		rp.mu.Lock()
		busy := 0
		for _, p := range rp.pools {
			if p.refill != nil {
				busy++
			}
		}
		rp.mu.Unlock()
		if busy == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d refills still in flight after 30 s", busy)
		}
	}
}

// A pooled block on an excluded pipeline or datanode is dropped, not
// handed out (review 13, finding 5).
func TestReservePoolHonorsExclude(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := &reserveStub{pipeline: 1}
	c := startReserveStub(t, s)
	if r := takeOne(t, c, ctx, nil); r == nil || r.Block.PipelineId != 1 {
		t.Fatalf("first take: %v", r)
	}
	s.set(codes.OK, 2) // pipeline 1 fails: the next refills are on 2
	for _, ex := range []*metapb.ExcludeList{{Pipelines: []uint64{1}}, {Datanodes: []uint64{1}}} {
		r := takeOne(t, c, ctx, ex)
		if r == nil {
			t.Fatalf("exclude %v: none", ex)
		}
		if r.Block.PipelineId == 1 {
			t.Fatalf("exclude %v: handed out a pooled block on pipeline 1", ex)
		}
	}
}

// A server without ReserveBlocks (UNIMPLEMENTED: an older leader in a
// rolling upgrade) is asked again after a while, not never; a refused
// refill (FAILED_PRECONDITION: an fs bucket, or a cluster whose layout
// does not have reservations yet) and a failing one (UNAVAILABLE: a
// failover) send keys the usual way, backed off, without a
// ReserveBlocks per take (review 13, finding 9).
func TestReserveFallbackRetriedLater(t *testing.T) {
	defer func(a, b time.Duration) { reserveAbsentFor, reserveRefusedFor = a, b }(reserveAbsentFor, reserveRefusedFor)
	reserveAbsentFor, reserveRefusedFor = 300*time.Millisecond, 300*time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, code := range []codes.Code{codes.Unimplemented, codes.FailedPrecondition, codes.Unavailable} {
		s := &reserveStub{pipeline: 1, code: code}
		c := startReserveStub(t, s)
		for i := range 10 {
			if r := takeOne(t, c, ctx, nil); r != nil {
				t.Fatalf("%v: take %d got a block", code, i)
			}
		}
		if n, _, _ := c.ReserveStats(); n != 1 {
			t.Fatalf("%v: %d ReserveBlocks calls for 10 takes, want 1", code, n)
		}
		s.set(codes.OK, 1) // upgraded, failed over, layout finalized
		deadline := time.Now().Add(20 * time.Second)
		for takeOne(t, c, ctx, nil) == nil {
			if time.Now().After(deadline) {
				t.Fatalf("%v: reservations not used again 20 s after the server has them", code)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}
