package client

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// settleNS answers CommitKey with commitErr (nil: success) and LookupKey
// with key.
type settleNS struct {
	metapb.UnimplementedNamespaceServer
	commitErr error
	key       *metapb.KeyInfo
	commits   int
}

func (s *settleNS) CommitKey(context.Context, *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
	s.commits++
	if s.commitErr != nil {
		return nil, s.commitErr
	}
	return &metapb.KeyInfo{Name: "k", ObjectId: 9}, nil
}

func (s *settleNS) LookupKey(context.Context, *metapb.LookupKeyRequest) (*metapb.KeyInfo, error) {
	if s.key == nil {
		return nil, status.Error(codes.NotFound, "no such key")
	}
	return s.key, nil
}

// A commit whose outcome is unknown (its meta node hung, or lost its
// leadership with the commit in its log) is settled: sent again, it
// either applies (the first never will: the open key is consumed by
// whichever applies first), or finds the open key gone, and then a
// linearizable read shows whether the key holds exactly this commit's
// blocks. Anything else stays OUTCOME_UNKNOWN.
func TestCommitOfUnknownOutcomeIsSettled(t *testing.T) {
	blocks := []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 3, LocalId: 77}, Length: 4096}}
	other := []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 3, LocalId: 78}, Length: 4096}}
	gone := status.Error(codes.NotFound, "open key 5 not found (expired or already committed)")
	cause := status.Error(codes.Unknown, "metaclient: CommitKey to x: outcome unknown")
	for _, tc := range []struct {
		name    string
		srv     *settleNS
		settled bool
		unknown bool
	}{
		{"resent-applies", &settleNS{}, true, false},
		{"first-had-applied", &settleNS{commitErr: gone, key: &metapb.KeyInfo{Name: "k", Blocks: blocks}}, true, false},
		{"overwritten-since", &settleNS{commitErr: gone, key: &metapb.KeyInfo{Name: "k", Blocks: other}}, false, true},
		{"key-missing", &settleNS{commitErr: gone}, false, true},
		{"refused", &settleNS{commitErr: status.Error(codes.FailedPrecondition, "precondition failed")}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			g := grpc.NewServer()
			metapb.RegisterNamespaceServer(g, tc.srv)
			go g.Serve(lis)
			defer g.Stop()
			c, err := New(Config{MetaAddrs: []string{lis.Addr().String()}, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			ki, err := c.settleCommit(ctx, "put key /v/b/k", "v", "b", "k", &metapb.CommitKeyRequest{OpenId: 5, Blocks: blocks}, cause)
			if tc.settled != (err == nil && ki != nil) {
				t.Fatalf("settled %v, want %v (err %v)", err == nil, tc.settled, err)
			}
			if got := errors.Is(wrapErr("put key", err), ErrOutcomeUnknown); got != tc.unknown {
				t.Fatalf("outcome unknown %v, want %v (err %v)", got, tc.unknown, err)
			}
			if tc.srv.commits != 1 {
				t.Fatalf("%d commits sent, want 1", tc.srv.commits)
			}
		})
	}
}
