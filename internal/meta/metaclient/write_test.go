package metaclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// writeStub is a Namespace server on loopback for the write coalescer's
// own behavior (what a real server cannot be made to do on demand: fail
// a whole batch with an unknown outcome, lack the batch calls). An
// OpenKey of "gate" waits for gate to close, so that a test holds the one
// in-flight slot while calls queue behind it. Open IDs are the keys'
// lengths; a commit's key is named after its open ID.
type writeStub struct {
	metapb.UnimplementedNamespaceServer
	gate                  chan struct{}
	noBatch               bool
	opens, commits        atomic.Int64 // single calls
	openBatches, commitBs atomic.Int64
	commitsHook           func(*metapb.CommitKeysRequest) (*metapb.CommitKeysResponse, error)
	failOnce              sync.Map      // key → its first open in a batch fails UNAVAILABLE
	cgate                 chan struct{} // a CommitKey of open ID 1000 waits for it
	opensDelay            time.Duration // an OpenKeys call takes this long (ignoring its context)
	callTimeout           time.Duration // the client's CallTimeout (10 s if zero)
}

func (s *writeStub) OpenKey(ctx context.Context, r *metapb.OpenKeyRequest) (*metapb.OpenKeyResponse, error) {
	s.opens.Add(1)
	if r.Key == "gate" {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &metapb.OpenKeyResponse{OpenId: uint64(len(r.Key))}, nil
}

func (s *writeStub) OpenKeys(ctx context.Context, r *metapb.OpenKeysRequest) (*metapb.OpenKeysResponse, error) {
	if s.noBatch {
		return nil, status.Error(codes.Unimplemented, "stub: no OpenKeys")
	}
	s.openBatches.Add(1)
	time.Sleep(s.opensDelay)
	resp := &metapb.OpenKeysResponse{}
	for _, q := range r.Requests {
		res := &metapb.OpenKeyResult{Open: &metapb.OpenKeyResponse{OpenId: uint64(len(q.Key))}}
		if _, ok := s.failOnce.LoadAndDelete(q.Key); ok {
			res = &metapb.OpenKeyResult{Code: uint32(codes.Unavailable), Message: "stub: no block token key yet"}
		} else if q.Key == "denied" {
			res = &metapb.OpenKeyResult{Code: uint32(codes.PermissionDenied), Message: "stub: denied"}
		}
		resp.Results = append(resp.Results, res)
	}
	return resp, nil
}

func (s *writeStub) CommitKey(ctx context.Context, r *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
	s.commits.Add(1)
	if r.OpenId == 1000 {
		select {
		case <-s.cgate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &metapb.KeyInfo{Name: fmt.Sprint(r.OpenId)}, nil
}

func (s *writeStub) CommitKeys(ctx context.Context, r *metapb.CommitKeysRequest) (*metapb.CommitKeysResponse, error) {
	if s.noBatch {
		return nil, status.Error(codes.Unimplemented, "stub: no CommitKeys")
	}
	s.commitBs.Add(1)
	if s.commitsHook != nil {
		return s.commitsHook(r)
	}
	resp := &metapb.CommitKeysResponse{}
	for _, q := range r.Requests {
		resp.Results = append(resp.Results, &metapb.CommitKeyResult{Key: &metapb.KeyInfo{Name: fmt.Sprint(q.OpenId)}})
	}
	return resp, nil
}

func startWriteStub(t *testing.T, s *writeStub) *Client {
	t.Helper()
	s.gate = make(chan struct{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	metapb.RegisterNamespaceServer(srv, s)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	ct := s.callTimeout
	if ct == 0 {
		ct = 10 * time.Second
	}
	c, err := New(Config{Addrs: []string{lis.Addr().String()}, CallTimeout: ct, WritesInFlight: 1, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// queueWrites holds the open slot with "gate", starts n opens of keys of
// 1..n bytes ("x", "xx", ...; with the given names instead when names is
// set) and waits until they are queued; release lets them go.
func queueOpens(t *testing.T, c *Client, s *writeStub, names []string) (release func(), results []chan error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	gate := make(chan error, 1)
	go func() {
		_, err := c.OpenKeyCoalesced(ctx, &metapb.OpenKeyRequest{Key: "gate", SizeHint: 1})
		gate <- err
	}()
	waitUntil(t, 10*time.Second, "the gate open", func() bool { return s.opens.Load() == 1 })
	for _, name := range names {
		ch := make(chan error, 1)
		results = append(results, ch)
		go func() {
			o, err := c.OpenKeyCoalesced(ctx, &metapb.OpenKeyRequest{Key: name, SizeHint: 4096})
			if err == nil && o.OpenId != uint64(len(name)) {
				err = fmt.Errorf("%s: open id %d, want %d", name, o.OpenId, len(name))
			}
			ch <- err
		}()
	}
	waitUntil(t, 10*time.Second, "opens to queue", func() bool {
		c.opens.mu.Lock()
		defer c.opens.mu.Unlock()
		n := 0
		for _, q := range c.opens.queues {
			n += len(q.pending)
		}
		return n == len(names)
	})
	return func() {
		close(s.gate)
		if err := <-gate; err != nil {
			t.Fatalf("gate: %v", err)
		}
	}, results
}

// TestOpenKeysPerKeyAnswers: queued opens leave as one OpenKeys call; a
// refused key's error goes to its caller only, and a key answered
// UNAVAILABLE on its own is sent again alone as an OpenKey.
func TestOpenKeysPerKeyAnswers(t *testing.T) {
	s := &writeStub{}
	c := startWriteStub(t, s)
	s.failOnce.Store("retry", true)
	names := []string{"a", "bb", "denied", "retry", "ccccc"}
	release, results := queueOpens(t, c, s, names)
	release()
	for i, ch := range results {
		err := <-ch
		switch names[i] {
		case "denied":
			if status.Code(err) != codes.PermissionDenied {
				t.Fatalf("denied: %v", err)
			}
		default:
			if err != nil {
				t.Fatalf("%s: %v", names[i], err)
			}
		}
	}
	if b := s.openBatches.Load(); b != 1 {
		t.Fatalf("%d OpenKeys calls, want 1", b)
	}
	if n := s.opens.Load(); n != 2 { // the gate and "retry" again
		t.Fatalf("%d OpenKey calls, want 2 (the gate, the retried key)", n)
	}
	if ob, ok, _, _ := c.WriteStats(); ob != 1 || ok != uint64(len(names)) {
		t.Fatalf("WriteStats: %d batches, %d keys", ob, ok)
	}
}

// TestWritesFallBackWithoutBatchCalls: against a server without OpenKeys
// and CommitKeys, every caller still gets its own answer (one call each)
// and later calls do not try batches again.
func TestWritesFallBackWithoutBatchCalls(t *testing.T) {
	s := &writeStub{noBatch: true}
	c := startWriteStub(t, s)
	names := []string{"a", "bb", "ccc"}
	release, results := queueOpens(t, c, s, names)
	release()
	for i, ch := range results {
		if err := <-ch; err != nil {
			t.Fatalf("%s: %v", names[i], err)
		}
	}
	if n := s.opens.Load(); n != 1+int64(len(names)) {
		t.Fatalf("%d OpenKey calls, want %d", n, 1+len(names))
	}
	if !c.opens.noBatch.Load() {
		t.Fatal("the coalescer still tries OpenKeys")
	}
}

// TestCommitKeysUnknownOutcomeIsEveryones: a CommitKeys whose outcome is
// unknown (the server lost track of its entry) is not sent again, and
// each of its callers gets UNKNOWN with the OUTCOME_UNKNOWN reason, to
// settle its own commit; a key refused on its own gets its own error
// with its details.
func TestCommitKeysUnknownOutcomeIsEveryones(t *testing.T) {
	s := &writeStub{}
	c := startWriteStub(t, s)
	var mode atomic.Int64
	s.commitsHook = func(r *metapb.CommitKeysRequest) (*metapb.CommitKeysResponse, error) {
		if mode.Load() == 0 {
			st, _ := status.New(codes.Unknown, "stub: outcome unknown").WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonOutcomeUnknown, Domain: metapb.ReasonDomain})
			return nil, st.Err()
		}
		resp := &metapb.CommitKeysResponse{}
		for _, q := range r.Requests {
			if q.OpenId == 2 {
				st, _ := status.New(codes.FailedPrecondition, "stub: precondition").WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonPreconditionFailed, Domain: metapb.ReasonDomain})
				resp.Results = append(resp.Results, &metapb.CommitKeyResult{Code: uint32(codes.FailedPrecondition), Message: "stub: precondition", Status: mustMarshalStatus(t, st)})
				continue
			}
			resp.Results = append(resp.Results, &metapb.CommitKeyResult{Key: &metapb.KeyInfo{Name: fmt.Sprint(q.OpenId)}})
		}
		return resp, nil
	}
	for m := range int64(2) {
		mode.Store(m)
		before := s.commitBs.Load()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		// Hold the one slot with a gated commit; 32 commits queue behind
		// it and leave together.
		s.cgate = make(chan struct{})
		singles := s.commits.Load()
		gate := make(chan error, 1)
		go func() {
			_, err := c.CommitKeyCoalesced(ctx, &metapb.CommitKeyRequest{OpenId: 1000})
			gate <- err
		}()
		waitUntil(t, 10*time.Second, "the gate commit", func() bool { return s.commits.Load() == singles+1 })
		var wg sync.WaitGroup
		errs := make([]error, 32)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ki, err := c.CommitKeyCoalesced(ctx, &metapb.CommitKeyRequest{OpenId: uint64(i)})
				if err == nil && ki.Name != fmt.Sprint(i) {
					err = fmt.Errorf("commit %d answered for %s", i, ki.Name)
				}
				errs[i] = err
			}()
		}
		waitUntil(t, 10*time.Second, "commits to queue", func() bool {
			c.commits.mu.Lock()
			defer c.commits.mu.Unlock()
			n := 0
			for _, q := range c.commits.queues {
				n += len(q.pending)
			}
			return n == len(errs)
		})
		close(s.cgate)
		if err := <-gate; err != nil {
			t.Fatalf("gate commit: %v", err)
		}
		wg.Wait()
		cancel()
		batches := s.commitBs.Load() - before
		if batches != 1 {
			t.Fatalf("mode %d: %d CommitKeys calls for 32 queued commits, want 1", m, batches)
		}
		for i, err := range errs {
			switch {
			case m == 0:
				if status.Code(err) != codes.Unknown || reasonOf(err) != metapb.ReasonOutcomeUnknown {
					t.Fatalf("commit %d of a batch of unknown outcome: %v", i, err)
				}
			case m == 1 && i == 2:
				if status.Code(err) != codes.FailedPrecondition || reasonOf(err) != metapb.ReasonPreconditionFailed {
					t.Fatalf("commit 2: %v, want its own precondition failure", err)
				}
			case err != nil:
				t.Fatalf("mode %d commit %d: %v", m, i, err)
			}
		}
	}
	// No batch was sent again (a CommitKeys of unknown outcome may have
	// applied): the stub saw exactly the coalescer's batches.
	if _, _, cb, _ := c.WriteStats(); cb != uint64(s.commitBs.Load()) {
		t.Fatalf("the stub got %d CommitKeys calls, the coalescer sent %d", s.commitBs.Load(), cb)
	}
}

func mustMarshalStatus(t *testing.T, st *status.Status) []byte {
	b, err := proto.Marshal(st.Proto())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func reasonOf(err error) string {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.Reason
		}
	}
	return ""
}

// TestBatchDeadlineIsTheLatestCallers: a caller without a deadline does
// not cut its batch short for the others (the batch runs until the latest
// of the callers' deadlines, now + CallTimeout for one without), and when
// the batch's deadline passes while a caller still waits, that caller
// gets what the single call gives for a service's timeout: a commit of
// unknown outcome (the client settles it), a retryable UNAVAILABLE open;
// never a deadline that looks like its own.
func TestBatchDeadlineIsTheLatestCallers(t *testing.T) {
	s := &writeStub{callTimeout: 300 * time.Millisecond, opensDelay: time.Second}
	c := startWriteStub(t, s)
	var applied atomic.Int64
	s.commitsHook = func(r *metapb.CommitKeysRequest) (*metapb.CommitKeysResponse, error) {
		time.Sleep(time.Second) // a slow entry; it applies whatever the caller's context
		applied.Add(int64(len(r.Requests)))
		resp := &metapb.CommitKeysResponse{}
		for _, q := range r.Requests {
			resp.Results = append(resp.Results, &metapb.CommitKeyResult{Key: &metapb.KeyInfo{Name: fmt.Sprint(q.OpenId)}})
		}
		return resp, nil
	}
	long, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// commits holds the commit slot with a gated commit, queues one commit
	// per context and returns their errors once the batch answered.
	commits := func(ctxs ...context.Context) []error {
		s.cgate = make(chan struct{})
		singles, before := s.commits.Load(), s.commitBs.Load()
		gate := make(chan error, 1)
		go func() {
			_, err := c.CommitKeyCoalesced(long, &metapb.CommitKeyRequest{OpenId: 1000})
			gate <- err
		}()
		waitUntil(t, 10*time.Second, "the gate commit", func() bool { return s.commits.Load() == singles+1 })
		errs := make([]error, len(ctxs))
		var wg sync.WaitGroup
		for i, ctx := range ctxs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = c.CommitKeyCoalesced(ctx, &metapb.CommitKeyRequest{OpenId: uint64(i + 1)})
			}()
		}
		waitUntil(t, 10*time.Second, "commits to queue", func() bool {
			c.commits.mu.Lock()
			defer c.commits.mu.Unlock()
			n := 0
			for _, q := range c.commits.queues {
				n += len(q.pending)
			}
			return n == len(ctxs)
		})
		close(s.cgate)
		if err := <-gate; err != nil {
			t.Fatalf("gate commit: %v", err)
		}
		wg.Wait()
		if got := s.commitBs.Load() - before; got != 1 {
			t.Fatalf("%d CommitKeys calls, want 1", got)
		}
		return errs
	}

	// A (no deadline) and B (5 s): the batch lives until B's deadline and
	// both commits succeed; a lone CommitKey with B's deadline would.
	b, bcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer bcancel()
	errs := commits(context.Background(), b)
	for i, err := range errs {
		if err != nil {
			t.Errorf("caller %c (batch with a 5 s caller, CallTimeout 300 ms, a 1 s CommitKeys): %v (own context: %v)", 'A'+i, err, []error{nil, b.Err()}[i])
		}
	}

	// Two callers without a deadline: the batch's deadline (now +
	// CallTimeout) passes while they wait; the stub applies the commits
	// anyway, so each must learn that its outcome is unknown.
	before := applied.Load()
	errs = commits(context.Background(), context.Background())
	for i, err := range errs {
		if status.Code(err) != codes.Unknown || reasonOf(err) != metapb.ReasonOutcomeUnknown || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("caller %d without a deadline, batch past CallTimeout: %v, want outcome unknown", i, err)
		}
	}
	waitUntil(t, 10*time.Second, "the stub to apply", func() bool { return applied.Load() == before+2 })

	// Opens: the same expiry is a retryable UNAVAILABLE.
	gate := make(chan error, 1)
	go func() {
		_, err := c.OpenKeyCoalesced(long, &metapb.OpenKeyRequest{Key: "gate", SizeHint: 1})
		gate <- err
	}()
	waitUntil(t, 10*time.Second, "the gate open", func() bool { return s.opens.Load() == 1 })
	oerrs := make([]error, 2)
	var wg sync.WaitGroup
	for i := range oerrs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, oerrs[i] = c.OpenKeyCoalesced(context.Background(), &metapb.OpenKeyRequest{Key: fmt.Sprint(i), SizeHint: 4096})
		}()
	}
	waitUntil(t, 10*time.Second, "opens to queue", func() bool {
		c.opens.mu.Lock()
		defer c.opens.mu.Unlock()
		n := 0
		for _, q := range c.opens.queues {
			n += len(q.pending)
		}
		return n == len(oerrs)
	})
	close(s.gate)
	if err := <-gate; err != nil {
		t.Fatalf("gate open: %v", err)
	}
	wg.Wait()
	for i, err := range oerrs {
		if status.Code(err) != codes.Unavailable || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("open %d without a deadline, batch past CallTimeout: %v, want UNAVAILABLE", i, err)
		}
	}
}

// TestCoalescedCallerContextErrors: a caller's own deadline or
// cancellation while its call waits in the queue comes back as the
// router returns it for a single call: errors.Is matches the context's
// error (the client tells it from a service's timeout by that), and
// status.Code still gives the code.
func TestCoalescedCallerContextErrors(t *testing.T) {
	s := &writeStub{}
	c := startWriteStub(t, s)
	s.cgate = make(chan struct{})
	long, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	gates := make(chan error, 2)
	go func() {
		_, err := c.OpenKeyCoalesced(long, &metapb.OpenKeyRequest{Key: "gate", SizeHint: 1})
		gates <- err
	}()
	go func() {
		_, err := c.CommitKeyCoalesced(long, &metapb.CommitKeyRequest{OpenId: 1000})
		gates <- err
	}()
	waitUntil(t, 10*time.Second, "the gate calls", func() bool { return s.opens.Load() == 1 && s.commits.Load() == 1 })
	for _, tc := range []struct {
		name string
		want error
		code codes.Code
		ctx  func() (context.Context, context.CancelFunc)
	}{
		{"deadline", context.DeadlineExceeded, codes.DeadlineExceeded, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 200*time.Millisecond)
		}},
		{"cancel", context.Canceled, codes.Canceled, func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(200*time.Millisecond, cancel)
			return ctx, cancel
		}},
	} {
		ctx, cancel := tc.ctx()
		_, oerr := c.OpenKeyCoalesced(ctx, &metapb.OpenKeyRequest{Key: "x", SizeHint: 4096})
		_, cerr := c.CommitKeyCoalesced(ctx, &metapb.CommitKeyRequest{OpenId: 1})
		cancel()
		for what, err := range map[string]error{"open": oerr, "commit": cerr} {
			if !errors.Is(err, tc.want) || status.Code(err) != tc.code {
				t.Errorf("%s queued until its caller's %s: %v (code %v), want errors.Is %v and code %v", what, tc.name, err, status.Code(err), tc.want, tc.code)
			}
		}
	}
	close(s.gate)
	close(s.cgate)
	for range 2 {
		if err := <-gates; err != nil {
			t.Fatalf("gate: %v", err)
		}
	}
}
