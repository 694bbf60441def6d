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
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// stubNS is a Namespace server on loopback that answers lookups with the
// key's name, for the coalescer's own behavior (batching, dropping,
// retries), which a real server cannot be made to show on demand. A
// LookupKey of "gate" waits for gate to close, so that a test holds the
// one in-flight slot while calls queue behind it.
type stubNS struct {
	metapb.UnimplementedNamespaceServer
	gate      chan struct{}
	single    atomic.Int64 // LookupKey calls
	batched   atomic.Int64 // keys of LookupKeys calls
	batches   atomic.Int64
	batchHook func(ctx context.Context, r *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error)
	failOnce  sync.Map      // key → true: its first LookupKey fails UNAVAILABLE
	slow      chan struct{} // if set, a LookupKey of "slow" waits for it
	mds       sync.Map      // key → the incoming metadata of its LookupKey
}

func (s *stubNS) LookupKey(ctx context.Context, r *metapb.LookupKeyRequest) (*metapb.KeyInfo, error) {
	s.single.Add(1)
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		s.mds.Store(r.Key, md)
	}
	if r.Key == "gate" {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if r.Key == "slow" && s.slow != nil {
		select {
		case <-s.slow:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if _, ok := s.failOnce.LoadAndDelete(r.Key); ok {
		return nil, status.Error(codes.Unavailable, "stub: not ready, retry")
	}
	return &metapb.KeyInfo{Name: r.Key}, nil
}

func (s *stubNS) LookupKeys(ctx context.Context, r *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
	s.batches.Add(1)
	s.batched.Add(int64(len(r.Requests)))
	if s.batchHook != nil {
		return s.batchHook(ctx, r)
	}
	return answerAll(r), nil
}

func answerAll(r *metapb.LookupKeysRequest) *metapb.LookupKeysResponse {
	resp := &metapb.LookupKeysResponse{}
	for _, q := range r.Requests {
		resp.Results = append(resp.Results, &metapb.LookupKeyResult{Key: &metapb.KeyInfo{Name: q.Key}})
	}
	return resp
}

func startStub(t *testing.T, s *stubNS) *Client {
	t.Helper()
	return startStubN(t, s, 1)
}

// startStubN is startStub with inflight LookupKeys batches in flight per
// requester (0: the default).
func startStubN(t testing.TB, s *stubNS, inflight int) *Client {
	t.Helper()
	if s.gate == nil {
		s.gate = make(chan struct{})
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	metapb.RegisterNamespaceServer(srv, s)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	c, err := New(Config{Addrs: []string{lis.Addr().String()}, CallTimeout: 10 * time.Second, LookupsInFlight: inflight, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func waitUntil(t *testing.T, d time.Duration, what string, f func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !f() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// holdSlot starts a Lookup of "gate" that holds the one in-flight slot
// until s.gate closes; it returns the lookup's error channel.
func holdSlot(t *testing.T, c *Client, s *stubNS) chan error {
	errc := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: "gate"})
		errc <- err
	}()
	waitUntil(t, 10*time.Second, "the gate lookup", func() bool { return s.single.Load() == 1 })
	return errc
}

// queued is the number of calls queued in c's coalescer.
func queued(c *Client) int {
	c.lookups.mu.Lock()
	defer c.lookups.mu.Unlock()
	n := 0
	for _, q := range c.lookups.queues {
		n += len(q.pending)
	}
	return n
}

// TestLookupFallsBackWithoutLookupKeys: against a server without
// LookupKeys, each caller still gets its own key (LookupKey each).
func TestLookupFallsBackWithoutLookupKeys(t *testing.T) {
	s := &stubNS{}
	s.batchHook = func(context.Context, *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
		return nil, status.Error(codes.Unimplemented, "stub: no LookupKeys")
	}
	c := startStub(t, s)
	errc := holdSlot(t, c, s)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var bad atomic.Int64
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := fmt.Sprint("k", i)
			ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: k})
			if err != nil || ki.GetName() != k {
				bad.Add(1)
				t.Logf("%s: %v %v", k, ki, err)
			}
		}()
	}
	waitUntil(t, 10*time.Second, "calls to queue", func() bool { return queued(c) == 200 })
	close(s.gate)
	wg.Wait()
	if err := <-errc; err != nil || bad.Load() > 0 {
		t.Fatalf("gate %v, %d bad lookups", err, bad.Load())
	}
	if s.batches.Load() == 0 {
		t.Fatalf("no LookupKeys was tried")
	}
}

// TestLookupDropsAbandonedCalls: calls whose callers gave up while queued
// are never sent.
func TestLookupDropsAbandonedCalls(t *testing.T) {
	s := &stubNS{}
	c := startStub(t, s)
	errc := holdSlot(t, c, s)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Lookup(ctx, &metapb.LookupKeyRequest{Key: fmt.Sprint("k", i)})
		}()
	}
	waitUntil(t, 10*time.Second, "calls to queue", func() bool { return queued(c) == 100 })
	cancel()
	wg.Wait()
	close(s.gate)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the queue to empty", func() bool { return queued(c) == 0 })
	time.Sleep(100 * time.Millisecond)
	if n := s.batched.Load() + s.single.Load() - 1; n != 0 {
		t.Fatalf("%d lookups of callers that had all given up were sent", n)
	}
}

// TestLookupCancelledCallerKeepsNoSlot: a call whose context is done
// before it is made takes no in-flight slot with it.
func TestLookupCancelledCallerKeepsNoSlot(t *testing.T) {
	s := &stubNS{}
	c := startStub(t, s)
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Lookup(done, &metapb.LookupKeyRequest{Key: "k"}); status.Code(err) != codes.Canceled {
		t.Fatalf("cancelled lookup: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: "k2"}); err != nil || ki.GetName() != "k2" {
		t.Fatalf("lookup after a cancelled one: %v %v", ki, err)
	}
	waitUntil(t, 10*time.Second, "no queue left", func() bool {
		c.lookups.mu.Lock()
		defer c.lookups.mu.Unlock()
		return len(c.lookups.queues) == 0
	})
}

// TestLookupBatchFollowsCallers: a batch's call runs until the latest of
// its callers' deadlines, and is cancelled once all of them gave up.
func TestLookupBatchFollowsCallers(t *testing.T) {
	s := &stubNS{}
	var deadline atomic.Value
	cancelled := make(chan struct{})
	s.batchHook = func(ctx context.Context, r *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
		d, _ := ctx.Deadline()
		deadline.Store(d)
		select {
		case <-ctx.Done():
			close(cancelled)
			return nil, ctx.Err()
		case <-time.After(20 * time.Second):
			return answerAll(r), nil
		}
	}
	c := startStub(t, s)
	errc := holdSlot(t, c, s)
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Lookup(ctx, &metapb.LookupKeyRequest{Key: fmt.Sprint("k", i)})
		}()
	}
	waitUntil(t, 10*time.Second, "calls to queue", func() bool { return queued(c) == 8 })
	close(s.gate)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the batch", func() bool { return deadline.Load() != nil })
	if d := deadline.Load().(time.Time); time.Until(d) < 30*time.Minute {
		t.Fatalf("the batch's deadline is %v away, its callers' an hour", time.Until(d))
	}
	cancel()
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatalf("the batch went on after all its callers gave up")
	}
	wg.Wait()
}

// TestLookupQueueBounded: past maxLookupQueue queued calls, a call goes
// alone as a LookupKey instead of queueing.
func TestLookupQueueBounded(t *testing.T) {
	s := &stubNS{}
	c := startStub(t, s)
	errc := holdSlot(t, c, s)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var bad atomic.Int64
	for i := range maxLookupQueue + 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: fmt.Sprint("k", i)}); err != nil {
				bad.Add(1)
			}
		}()
	}
	waitUntil(t, 15*time.Second, "the calls past the bound to go alone", func() bool { return s.single.Load() == 11 })
	if n := queued(c); n != maxLookupQueue {
		t.Fatalf("%d calls queued, want %d", n, maxLookupQueue)
	}
	close(s.gate)
	wg.Wait()
	if err := <-errc; err != nil || bad.Load() > 0 {
		t.Fatalf("gate %v, %d failed", err, bad.Load())
	}
}

// TestLookupRetriesAlone: keys a LookupKeys call left unanswered for its
// size (RetryAlone) or failed UNAVAILABLE, and the keys of a batch refused
// RESOURCE_EXHAUSTED, are looked up again alone (with LookupKey's
// retries), and their callers get their keys.
func TestLookupRetriesAlone(t *testing.T) {
	s := &stubNS{}
	s.failOnce.Store("u1", true) // its LookupKey too fails once: retried
	s.batchHook = func(ctx context.Context, r *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
		if len(r.Requests) > 8 {
			return nil, status.Error(codes.ResourceExhausted, "stub: answer too big")
		}
		resp := answerAll(r)
		for i, q := range r.Requests {
			switch q.Key[0] {
			case 'u':
				resp.Results[i] = &metapb.LookupKeyResult{Code: uint32(codes.Unavailable), Message: "not the leader"}
			case 'r':
				resp.Results[i] = &metapb.LookupKeyResult{Code: uint32(codes.ResourceExhausted), RetryAlone: true, Message: "too big"}
			}
		}
		return resp, nil
	}
	c := startStub(t, s)
	errc := holdSlot(t, c, s)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	keys := []string{"u1", "u2", "r1", "r2"}
	for i := range 28 {
		keys = append(keys, fmt.Sprint("k", i))
	}
	var wg sync.WaitGroup
	var bad atomic.Int64
	for _, k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: k})
			if err != nil || ki.GetName() != k {
				bad.Add(1)
				t.Logf("%s: %v %v", k, ki, err)
			}
		}()
	}
	waitUntil(t, 10*time.Second, "calls to queue", func() bool { return queued(c) == len(keys) })
	close(s.gate)
	wg.Wait()
	if err := <-errc; err != nil || bad.Load() > 0 {
		t.Fatalf("gate %v, %d of %d lookups failed", err, bad.Load(), len(keys))
	}
	// 1 gate + u1 twice + u2, r1, r2.
	if n := s.single.Load(); n != 6 {
		t.Fatalf("%d LookupKey calls, want 6", n)
	}
}

// TestLookupMdKeyUnambiguous: requesters whose metadata differ never share
// a batch, whatever bytes their -bin values hold.
func TestLookupMdKeyUnambiguous(t *testing.T) {
	pairs := [][2]metadata.MD{
		{{"a-bin": {"x\x01basalt-on-behalf-of\x00bob"}}, {"a-bin": {"x"}, "basalt-on-behalf-of": {"bob"}}},
		{{"a-bin": {"x\x00y"}}, {"a-bin": {"x", "y"}}},
		{{"a-bin": {""}}, {"a-bin": {}}},
	}
	for _, p := range pairs {
		if mdKey(p[0]) == mdKey(p[1]) {
			t.Fatalf("%v and %v share a key %q", p[0], p[1], mdKey(p[0]))
		}
	}
	if mdKey(metadata.MD{"a": {"1"}, "b": {"2"}}) != mdKey(metadata.MD{"b": {"2"}, "a": {"1"}}) {
		t.Fatalf("equal metadata, different keys")
	}
}

// TestLookupLoneCallPassesHeldBatch: with the default LookupsInFlight, a
// lone call made while its requester's batch is held (a read barrier
// stalled by a leader change) leaves in the second slot at once instead
// of waiting for the held batch to return.
func TestLookupLoneCallPassesHeldBatch(t *testing.T) {
	s := &stubNS{}
	c := startStubN(t, s, 0)
	errc := holdSlot(t, c, s)
	defer func() {
		close(s.gate)
		if err := <-errc; err != nil {
			t.Errorf("gate: %v", err)
		}
	}()
	for i := range 3 { // and again once the timer fired before
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		start := time.Now()
		k := fmt.Sprint("lone", i)
		ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: k})
		cancel()
		if err != nil || ki.GetName() != k {
			t.Fatalf("lone lookup behind a held batch after %v: %v %v", time.Since(start), ki, err)
		}
	}
}

// TestLookupRetriesKeepNoSlot: a key of a batch sent again alone (here
// RetryAlone, its LookupKey held) does not keep its batch's slot: a later
// call does not wait for it, even with one batch in flight.
func TestLookupRetriesKeepNoSlot(t *testing.T) {
	s := &stubNS{slow: make(chan struct{})}
	s.batchHook = func(ctx context.Context, r *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
		resp := answerAll(r)
		for i, q := range r.Requests {
			if q.Key == "slow" {
				resp.Results[i] = &metapb.LookupKeyResult{Code: uint32(codes.ResourceExhausted), RetryAlone: true, Message: "too big"}
			}
		}
		return resp, nil
	}
	c := startStub(t, s)
	errc := holdSlot(t, c, s)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var bad atomic.Int64
	for _, k := range []string{"slow", "k"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: k}); err != nil || ki.GetName() != k {
				bad.Add(1)
				t.Logf("%s: %v %v", k, ki, err)
			}
		}()
	}
	waitUntil(t, 10*time.Second, "calls to queue", func() bool { return queued(c) == 2 })
	close(s.gate)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	// The batch of "slow" and "k" went; "slow" is now a held LookupKey.
	waitUntil(t, 10*time.Second, "the retry of slow", func() bool { return s.single.Load() == 2 })
	lctx, lcancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	start := time.Now()
	ki, err := c.Lookup(lctx, &metapb.LookupKeyRequest{Key: "x"})
	lcancel()
	close(s.slow)
	wg.Wait()
	if err != nil || ki.GetName() != "x" {
		t.Fatalf("a lookup behind a held retry after %v: %v %v", time.Since(start), ki, err)
	}
	if bad.Load() > 0 {
		t.Fatalf("%d lookups of the batch failed", bad.Load())
	}
}

// BenchmarkLookupConcurrent: 64 callers looking keys up in a loop, as a
// gateway's handlers under warp stat's 64 clients, against the stub on
// loopback with the default LookupsInFlight: reports the RPCs per lookup
// and the share of lookups that went alone as LookupKey calls (issue 15).
//
//	go test -run '^$' -bench LookupConcurrent ./internal/meta/metaclient/
func BenchmarkLookupConcurrent(b *testing.B) {
	s := &stubNS{}
	c := startStubN(b, s, 0)
	b.SetParallelism(32) // 64 callers on two cores
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			if ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: "k"}); err != nil || ki.GetName() != "k" {
				b.Errorf("lookup: %v %v", ki, err)
				return
			}
		}
	})
	b.StopTimer()
	single, batches := s.single.Load(), s.batches.Load()
	b.ReportMetric(float64(single+batches)/float64(b.N), "rpcs/op")
	b.ReportMetric(float64(single)/float64(b.N), "alone/op")
}

// TestLookupRequesterContext: calls made with a Requester's context
// (metadata not copied per call) share the queue of calls made with the
// same metadata set the ordinary way, and a context derived from a
// Requester's that changes the metadata (appends to it, or re-targets it
// to another user: replaced metadata, WithUser) is not taken for the
// Requester's: its call carries its own metadata and does not queue
// behind the Requester's held batch.
func TestLookupRequesterContext(t *testing.T) {
	var batchMD []metadata.MD
	var batchKeys [][]string
	var mu sync.Mutex
	s := &stubNS{}
	s.batchHook = func(ctx context.Context, r *metapb.LookupKeysRequest) (*metapb.LookupKeysResponse, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		var ks []string
		for _, q := range r.Requests {
			ks = append(ks, q.Key)
		}
		mu.Lock()
		batchMD, batchKeys = append(batchMD, md), append(batchKeys, ks)
		mu.Unlock()
		return answerAll(r), nil
	}
	c := startStub(t, s) // one batch in flight per requester
	mdA := metadata.MD{"x-who": {"alice"}, "X-Mixed": {"v"}}
	rq := NewRequester(mdA)
	if got, want := string(rq.key), mdKey(metadata.Pairs("x-who", "alice", "x-mixed", "v")); got != want {
		t.Fatalf("requester key %q, want %q", got, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ctxA := rq.Context(ctx)
	if md, _ := metadata.FromOutgoingContext(ctxA); md.Get("x-who")[0] != "alice" || md.Get("x-mixed")[0] != "v" {
		t.Fatalf("requester context's metadata %v", md)
	}
	gate := make(chan error, 1)
	go func() {
		_, err := c.Lookup(ctxA, &metapb.LookupKeyRequest{Key: "gate"})
		gate <- err
	}()
	waitUntil(t, 10*time.Second, "the gate lookup", func() bool { return s.single.Load() == 1 })
	done := make(chan error, 3)
	look := func(ctx context.Context, k string) {
		ki, err := c.Lookup(ctx, &metapb.LookupKeyRequest{Key: k})
		if err == nil && ki.GetName() != k {
			err = fmt.Errorf("%s: answer %v", k, ki)
		}
		done <- err
	}
	go look(ctxA, "k1")
	go look(metadata.NewOutgoingContext(ctx, mdA), "k3") // the same requester, set the ordinary way
	waitUntil(t, 10*time.Second, "k1 and k3 to queue", func() bool { return queued(c) == 2 })
	// Derived with more metadata: another requester, not held by the gate.
	look(metadata.AppendToOutgoingContext(ctxA, "x-extra", "1"), "k2")
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if md, ok := s.mds.Load("k2"); !ok || md.(metadata.MD).Get("x-extra") == nil || md.(metadata.MD).Get("x-who")[0] != "alice" {
		t.Fatalf("k2 went with metadata %v", md)
	}
	// Re-targeted to another user (metadata replaced, or the user set
	// over alice's): bob's calls carry bob's metadata and do not queue
	// behind alice's held batch (a short deadline: joining it would
	// fail here, not hang the test).
	bob := func(name string, ctx context.Context, k string, isBob func(metadata.MD) bool) {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		look(ctx, k)
		if err := <-done; err != nil {
			t.Fatalf("%s: bob's lookup (alice's batch held): %v", name, err)
		}
		md, ok := s.mds.Load(k)
		if !ok || !isBob(md.(metadata.MD)) {
			t.Fatalf("%s: bob's lookup went with metadata %v", name, md)
		}
	}
	bob("NewOutgoingContext", metadata.NewOutgoingContext(ctxA, metadata.Pairs("x-who", "bob")), "kb1", func(md metadata.MD) bool {
		return len(md.Get("x-who")) == 1 && md.Get("x-who")[0] == "bob" && md.Get("x-mixed") == nil
	})
	bob("WithUser", WithUser(ctxA, "bob", false), "kb2", func(md metadata.MD) bool {
		u := md.Get(OnBehalfOfHeader)
		return len(u) == 1 && u[0] == "bob"
	})
	close(s.gate)
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if err := <-gate; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(batchKeys) != 1 || len(batchKeys[0]) != 2 || batchMD[0].Get("x-who")[0] != "alice" || batchMD[0].Get("x-extra") != nil {
		t.Fatalf("batches %v with metadata %v, want k1 and k3 in one as alice", batchKeys, batchMD)
	}
}
