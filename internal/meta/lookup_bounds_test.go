package meta

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/raft"
)

// TestLookupKeysBoundsResponseSize: LookupKeys of many large keys (200
// blocks each, ~20 KB answered) stops looking keys up once its answer
// reaches namespace.MaxLookupsBytes and marks the rest RetryAlone; and
// coalesced Lookups of such keys all succeed (before, batches whose
// answer passed the client's 4 MiB receive limit failed every key).
func TestLookupKeysBoundsResponseSize(t *testing.T) {
	c, admin, ctx := lookupCluster(t, 1)
	mustOK(t, "put", putKey(ctx, admin, "abkt", "small", 1))
	small, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "small"})
	mustOK(t, "lookup small", err)
	st := c.servers[1].nsState
	bk, err := st.GetBucket("vol", "abkt")
	mustOK(t, "bucket", err)
	big := &metapb.KeyInfo{Volume: "vol", Bucket: "abkt", Name: "big"}
	for range 200 {
		big.Blocks = append(big.Blocks, &metapb.KeyBlock{Id: small.Blocks[0].Id, Length: 1})
		big.Size++
	}
	mustOK(t, "bulk", st.BulkLoadObjectKeys(bk.Id, []*metapb.KeyInfo{big}))
	one, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "big"})
	mustOK(t, "lookup big alone", err)
	oneSize := proto.Size(one)

	var all []*metapb.LookupKeyRequest
	for range namespace.MaxLookupBatch {
		all = append(all, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "big"})
	}
	r, err := c.servers[1].nsSvc.LookupKeys(ctx, &metapb.LookupKeysRequest{Requests: all})
	mustOK(t, "in-process LookupKeys", err)
	answered, alone := 0, 0
	for _, res := range r.Results {
		switch {
		case res.Key != nil:
			answered++
		case res.RetryAlone && codes.Code(res.Code) == codes.ResourceExhausted:
			alone++
		default:
			t.Fatalf("unexpected result %v", res)
		}
	}
	t.Logf("one answer %d bytes; LookupKeys of %d: %d answered, %d to retry alone, %d bytes", oneSize, len(all), answered, alone, proto.Size(r))
	if alone == 0 || answered == 0 || proto.Size(r) > namespace.MaxLookupsBytes+2*oneSize+len(all)*128 {
		t.Fatalf("answer of %d bytes (%d answered, %d to retry alone): not bounded by %d", proto.Size(r), answered, alone, namespace.MaxLookupsBytes)
	}

	var wg sync.WaitGroup
	var fails atomic.Int64
	var last atomic.Value
	for range 256 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ki, err := admin.Lookup(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: "big"})
			if err == nil && len(ki.Locations) != 200 {
				err = fmt.Errorf("%d locations", len(ki.Locations))
			}
			if err != nil {
				fails.Add(1)
				last.Store(fmt.Sprint(status.Code(err), err))
			}
		}()
	}
	wg.Wait()
	b, k := admin.LookupStats()
	if fails.Load() > 0 {
		t.Fatalf("%d of 256 coalesced lookups failed (batches %d keys %d), e.g. %v", fails.Load(), b, k, last.Load())
	}
	t.Logf("256 coalesced lookups: %d batches, %d keys", b, k)
}

// failingTokens fails every block token: with a raw error for key "raw",
// with the raft's not-leader error for key "notleader".
type failingTokens struct{ key *atomic.Value }

func (f failingTokens) IssuePipelineToken(context.Context, *metapb.BlockID, uint64, blocktoken.Mode, string) ([]byte, error) {
	if f.key.Load() == "notleader" {
		return nil, fmt.Errorf("issuing: %w", raft.ErrNotLeader)
	}
	return nil, errors.New("disk on fire")
}

// TestLookupKeysTranslatesKeyErrors: a key's error in LookupKeys is the
// status the server would have returned for LookupKey (translate): a raw
// error INTERNAL, not UNKNOWN; not-the-leader a retryable UNAVAILABLE with
// its NotLeader detail.
func TestLookupKeysTranslatesKeyErrors(t *testing.T) {
	c, admin, ctx := lookupCluster(t, 1)
	mustOK(t, "put", putKey(ctx, admin, "abkt", "k", 1))
	s := c.servers[1]
	var key atomic.Value
	svc := namespace.NewService(namespace.Config{Tokens: failingTokens{&key}, Translate: s.translate}, s.nsState, &nsRaft{s: s}, &scmBlocks{s: s})
	for _, tc := range []struct {
		key    string
		code   codes.Code
		detail bool
	}{{"raw", codes.Internal, false}, {"notleader", codes.Unavailable, true}} {
		key.Store(tc.key)
		r, err := svc.LookupKeys(ctx, &metapb.LookupKeysRequest{Requests: []*metapb.LookupKeyRequest{{Volume: "vol", Bucket: "abkt", Key: "k"}}})
		mustOK(t, "LookupKeys", err)
		res := r.Results[0]
		if codes.Code(res.Code) != tc.code || (len(res.Status) > 0) != tc.detail {
			t.Fatalf("%s: code %v (status %d bytes) %q, want %v", tc.key, codes.Code(res.Code), len(res.Status), res.Message, tc.code)
		}
	}
}
