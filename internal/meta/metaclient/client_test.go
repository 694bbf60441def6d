package metaclient

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// scripted answers each call with the next error of its script (nil: OK)
// and counts the calls.
type scripted struct {
	metapb.UnimplementedNamespaceServer
	mu     sync.Mutex
	script []error
	calls  int
}

func (s *scripted) next() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if len(s.script) == 0 {
		return nil
	}
	err := s.script[0]
	s.script = s.script[1:]
	return err
}

func (s *scripted) CommitKey(context.Context, *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
	if err := s.next(); err != nil {
		return nil, err
	}
	return &metapb.KeyInfo{}, nil
}

func (s *scripted) LookupKey(context.Context, *metapb.LookupKeyRequest) (*metapb.KeyInfo, error) {
	if err := s.next(); err != nil {
		return nil, err
	}
	return &metapb.KeyInfo{}, nil
}

func serve(t *testing.T, srv metapb.NamespaceServer) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	metapb.RegisterNamespaceServer(g, srv)
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return lis.Addr().String()
}

func notLeader() error {
	st, _ := status.New(codes.Unavailable, "not the leader").WithDetails(&metapb.NotLeader{GroupId: 1})
	return st.Err()
}

func notApplied() error {
	st, _ := status.New(codes.Unavailable, "token not established").WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonNotApplied, Domain: metapb.ReasonDomain})
	return st.Err()
}

func reason(err error) string {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.Reason
		}
	}
	return ""
}

// Issue 11 scenario 10: a call that changes state is sent again only when
// the server proved it had no effect; an UNAVAILABLE without that proof
// (a connection that broke after the request went out looks the same) and
// the server's UNKNOWN "outcome unknown" come back as UNKNOWN /
// OUTCOME_UNKNOWN after one call. Reads are retried.
func TestRetryOnlyWhatIsSafe(t *testing.T) {
	bare := status.Error(codes.Unavailable, "error reading from server: EOF")
	unknown := status.Error(codes.Unknown, "outcome unknown")
	for _, tc := range []struct {
		name      string
		lookup    bool // LookupKey (a read) instead of CommitKey
		script    []error
		wantCode  codes.Code
		wantCalls int
	}{
		{"commit/not-leader", false, []error{notLeader()}, codes.OK, 2},
		{"commit/not-applied", false, []error{notApplied()}, codes.OK, 2},
		{"commit/bare-unavailable", false, []error{bare}, codes.Unknown, 1},
		{"commit/outcome-unknown", false, []error{unknown}, codes.Unknown, 1},
		{"lookup/bare-unavailable", true, []error{bare}, codes.OK, 2},
		{"lookup/unknown", true, []error{unknown}, codes.Unknown, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := &scripted{script: tc.script}
			c, err := New(Config{Addrs: []string{serve(t, srv)}, Backoff: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if tc.lookup {
				_, err = c.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{})
			} else {
				_, err = c.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{})
			}
			if status.Code(err) != tc.wantCode || srv.calls != tc.wantCalls {
				t.Fatalf("got %v after %d calls; want %v after %d", err, srv.calls, tc.wantCode, tc.wantCalls)
			}
			if tc.name == "commit/bare-unavailable" && reason(err) != metapb.ReasonOutcomeUnknown {
				t.Fatalf("reason %q, want %s", reason(err), metapb.ReasonOutcomeUnknown)
			}
		})
	}
}

// A node that cannot be reached never got the request: a commit goes on
// to the next node.
func TestCommitRetriedWhenTheConnectionCannotBeMade(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := lis.Addr().String()
	lis.Close()
	srv := &scripted{}
	c, err := New(Config{Addrs: []string{dead, serve(t, srv)}, Backoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{}); err != nil || srv.calls != 1 {
		t.Fatalf("commit with the first node down: %v after %d calls", err, srv.calls)
	}
}

func notLeaderAt(addr string) error {
	st, _ := status.New(codes.Unavailable, "not the leader").WithDetails(&metapb.NotLeader{GroupId: 1, LeaderAddr: addr})
	return st.Err()
}

// A leader hint naming a node the client was not configured with (a meta
// node forwarding for a client is not given its own address; after a
// failover the hint names that very node) sent nothing: the client pauses
// and asks its configured nodes again instead of failing the call at once
// with a non-gRPC error, as it did in the multi-process fault test.
func TestUnknownLeaderHintIsRetried(t *testing.T) {
	srv := &scripted{script: []error{notLeaderAt("127.0.0.1:1"), notLeaderAt("127.0.0.1:1")}}
	c, err := New(Config{Addrs: []string{serve(t, srv)}, Backoff: time.Millisecond, MaxAttempts: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{}); err != nil || srv.calls != 3 {
		t.Fatalf("got %v after %d calls; want success after 3", err, srv.calls)
	}
	// Hints that never lead anywhere end in a retryable UNAVAILABLE.
	srv = &scripted{script: []error{notLeaderAt("127.0.0.1:1"), notLeaderAt("127.0.0.1:1"), notLeaderAt("127.0.0.1:1"), notLeaderAt("127.0.0.1:1")}}
	c2, err := New(Config{Addrs: []string{serve(t, srv)}, Backoff: time.Millisecond, MaxAttempts: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := c2.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("got %v, want UNAVAILABLE", err)
	}
}
