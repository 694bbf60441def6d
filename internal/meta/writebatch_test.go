package meta

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// smallPut writes key through the coalescing calls, as the client's
// small-PUT path does: open with the size as hint, commit one block.
func smallPut(ctx context.Context, cl *metaclient.Client, bucket, key string, size uint64) (*metapb.CommitKeyRequest, *metapb.KeyInfo, error) {
	o, err := cl.OpenKeyCoalesced(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: bucket, Key: key, SizeHint: size})
	if err != nil {
		return nil, nil, err
	}
	req := &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: size}}}
	ki, err := cl.CommitKeyCoalesced(ctx, req)
	return req, ki, err
}

// TestWriteBatchesAuthorizeEachKey: an OpenKeys and a CommitKeys call of
// a gateway acting for alice mixing her bucket and bob's answer each key
// on its own (bob's refused, alice's done), and concurrent small PUTs of
// alice and bob through the coalescer share batches only with their own
// kind: bob's all refused, alice's all written.
func TestWriteBatchesAuthorizeEachKey(t *testing.T) {
	c, admin, ctx := lookupCluster(t, 1)
	gw := c.userClient(pki.GatewayPrefix + "test")
	alice := metaclient.WithUser(ctx, "alice", false)
	ro, err := gw.Namespace.OpenKeys(alice, &metapb.OpenKeysRequest{Requests: []*metapb.OpenKeyRequest{
		{Volume: "vol", Bucket: "abkt", Key: "a1", SizeHint: 10},
		{Volume: "vol", Bucket: "bbkt", Key: "b1", SizeHint: 10},
		{Volume: "vol", Bucket: "abkt", Key: "a2", SizeHint: 10},
	}})
	mustOK(t, "OpenKeys", err)
	for i, want := range []codes.Code{codes.OK, codes.PermissionDenied, codes.OK} {
		if got := codes.Code(ro.Results[i].Code); got != want {
			t.Fatalf("open %d: %v (%s), want %v", i, got, ro.Results[i].Message, want)
		}
	}
	// bob's own open key, opened by an admin: alice may not commit it.
	bo, err := admin.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bbkt", Key: "b2"})
	mustOK(t, "open bob's key", err)
	commit := func(o *metapb.OpenKeyResponse, n uint64) *metapb.CommitKeyRequest {
		return &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: n}}}
	}
	rc, err := gw.Namespace.CommitKeys(alice, &metapb.CommitKeysRequest{Requests: []*metapb.CommitKeyRequest{
		commit(ro.Results[0].Open, 11), commit(bo, 22), commit(ro.Results[2].Open, 12),
	}})
	mustOK(t, "CommitKeys", err)
	for i, want := range []codes.Code{codes.OK, codes.PermissionDenied, codes.OK} {
		if got := codes.Code(rc.Results[i].Code); got != want {
			t.Fatalf("commit %d: %v (%s), want %v", i, got, rc.Results[i].Message, want)
		}
	}
	for key, size := range map[string]uint64{"a1": 11, "a2": 12} {
		ki, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: key, NoLocations: true})
		if err != nil || ki.Size != size {
			t.Fatalf("%s: %v, size %d, want %d", key, err, ki.GetSize(), size)
		}
	}
	if _, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bbkt", Key: "b2", NoLocations: true}); status.Code(err) != codes.NotFound {
		t.Fatalf("bob's key after alice's refused commit: %v", err)
	}

	// Through the coalescer, concurrently.
	var wg sync.WaitGroup
	var bad atomic.Value
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			user, want := "alice", codes.OK
			if i%2 == 1 {
				user, want = "bob", codes.PermissionDenied
			}
			_, _, err := smallPut(metaclient.WithUser(ctx, user, false), gw, "abkt", fmt.Sprintf("c%d", i), 100)
			if status.Code(err) != want {
				bad.Store(fmt.Sprintf("%s: %v, want %v", user, err, want))
			}
		}()
	}
	wg.Wait()
	if b := bad.Load(); b != nil {
		t.Fatal(b)
	}
	for i := 0; i < 64; i += 2 {
		if _, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: fmt.Sprintf("c%d", i), NoLocations: true}); err != nil {
			t.Fatalf("alice's c%d: %v", i, err)
		}
	}
}

// TestConcurrentSmallPutsShareEntries: 64 small PUTs at once on a 3-node
// group. Each plain OpenKey and CommitKey is a Raft entry of its own
// (128 entries); through the coalescer they share OpenKeys and CommitKeys
// calls, and far fewer entries carry them. (Without the coalescer, the
// "coalesced" mode makes as many entries as the plain one and fails.)
func TestConcurrentSmallPutsShareEntries(t *testing.T) {
	c, admin, ctx := lookupCluster(t, 3)
	const n = 64
	entries := func() uint64 { return c.servers[c.nsLeader()].nsGroup.Status().Commit }
	run := func(mode string, round int) uint64 {
		start := make(chan struct{})
		var wg sync.WaitGroup
		var errs atomic.Int64
		before := entries()
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				key := fmt.Sprintf("%s-%d-%d", mode, round, i)
				var err error
				if mode == "coalesced" {
					_, _, err = smallPut(ctx, admin, "abkt", key, 4096)
				} else {
					var o *metapb.OpenKeyResponse
					if o, err = admin.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: key, SizeHint: 4096}); err == nil {
						_, err = admin.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 4096}}})
					}
				}
				if err != nil {
					errs.Add(1)
					t.Logf("%s: %v", key, err)
				}
			}()
		}
		close(start)
		wg.Wait()
		if errs.Load() > 0 {
			t.Fatalf("%s: %d puts failed", mode, errs.Load())
		}
		return entries() - before
	}
	plain := run("plain", 0)
	if plain < 2*n {
		t.Fatalf("plain: %d entries for %d keys, want at least %d", plain, n, 2*n)
	}
	best := plain
	ob0, ok0, cb0, ck0 := admin.WriteStats()
	for round := 1; round <= 5 && best > n/2; round++ {
		best = min(best, run("coalesced", round))
	}
	ob, ok, cb, ck := admin.WriteStats()
	t.Logf("%d small puts: %d entries plain, %d coalesced (best round); coalescer: %d OpenKeys calls for %d keys, %d CommitKeys calls for %d keys",
		n, plain, best, ob-ob0, ok-ok0, cb-cb0, ck-ck0)
	if best > n/2 {
		t.Fatalf("coalesced: %d entries for %d small puts (plain: %d), want at most %d", best, n, plain, n/2)
	}
	if ob == ob0 || cb == cb0 || ok-ok0 < 2*(ob-ob0) || ck-ck0 < 2*(cb-cb0) {
		t.Fatalf("coalescer stats: %d OpenKeys calls for %d keys, %d CommitKeys calls for %d keys", ob-ob0, ok-ok0, cb-cb0, ck-ck0)
	}
	for round := 1; round <= 5; round++ {
		for i := range n {
			key := fmt.Sprintf("coalesced-%d-%d", round, i)
			ki, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: key, NoLocations: true})
			if round > 1 && status.Code(err) == codes.NotFound {
				break // the round did not run
			}
			if err != nil || ki.Size != 4096 {
				t.Fatalf("%s: %v, size %d", key, err, ki.GetSize())
			}
		}
	}
}

// TestWriteBatchesAcrossLeaderChange: small PUTs through the coalescer
// while the namespace leader is killed. Every acknowledged commit is
// there with its blocks; a commit refused with a definite answer (not
// outcome unknown) is not; writes resume on the new leader; and the
// killed node, restarted, replays the log into the same keys.
func TestWriteBatchesAcrossLeaderChange(t *testing.T) {
	c, admin, ctx := lookupCluster(t, 3)
	type outcome struct {
		req *metapb.CommitKeyRequest
		err error
	}
	var mu sync.Mutex
	results := map[string]outcome{}
	var acked atomic.Int64
	var lastAck atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("w%d-%d", w, i)
				cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				req, _, err := smallPut(cctx, admin, "abkt", key, uint64(100+w))
				cancel()
				if req == nil {
					continue // the open failed: nothing to check
				}
				mu.Lock()
				results[key] = outcome{req, err}
				mu.Unlock()
				if err == nil {
					acked.Add(1)
					lastAck.Store(time.Now().UnixNano())
				}
			}
		}()
	}
	waitFor(t, 30*time.Second, "some puts", func() bool { return acked.Load() > 200 })
	old := c.nsLeader()
	killed := time.Now()
	c.servers[old].Close()
	delete(c.servers, old)
	waitFor(t, 60*time.Second, "puts to resume after killing the leader", func() bool {
		return time.Unix(0, lastAck.Load()).After(killed.Add(200*time.Millisecond)) && acked.Load() > 400
	})
	close(stop)
	wg.Wait()
	ob, ok, cb, ck := admin.WriteStats()
	t.Logf("leader %d killed; %d puts acknowledged of %d committed or tried; %d OpenKeys calls for %d keys, %d CommitKeys calls for %d keys",
		old, acked.Load(), len(results), ob, ok, cb, ck)
	if cb == 0 || ck < 2*cb {
		t.Fatalf("commits were not batched: %d CommitKeys calls for %d keys", cb, ck)
	}
	unknown := 0
	for key, o := range results {
		ki, err := admin.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "abkt", Key: key, NoLocations: true})
		there := err == nil && len(ki.Blocks) == 1 && ki.Blocks[0].Id.LocalId == o.req.Blocks[0].Id.LocalId && ki.Blocks[0].Id.ContainerId == o.req.Blocks[0].Id.ContainerId
		switch {
		case o.err == nil:
			if !there {
				t.Fatalf("acknowledged %s lost: %v", key, err)
			}
		case status.Code(o.err) == codes.Unknown || status.Code(o.err) == codes.DeadlineExceeded:
			unknown++ // either
		default:
			if there {
				t.Fatalf("%s refused (%v) but committed", key, o.err)
			}
		}
	}
	t.Logf("%d commits with an unknown outcome", unknown)
	// The killed node replays the log (batched entries included) into
	// the same keys.
	c.servers[old] = c.newServer(old)
	c.wire()
	if err := c.servers[old].Start(); err != nil {
		t.Fatal(err)
	}
	want := c.servers[c.nsLeader()].nsGroup.Status().Commit
	waitFor(t, 60*time.Second, "restarted node to catch up", func() bool {
		return c.servers[old].nsGroup.Status().Applied >= want
	})
	leader := c.servers[c.nsLeader()]
	for key := range results {
		a, errA := leader.nsState.LookupKey("vol", "abkt", key)
		b, errB := c.servers[old].nsState.LookupKey("vol", "abkt", key)
		if status.Code(errA) != status.Code(errB) || a.GetSize() != b.GetSize() || a.GetObjectId() != b.GetObjectId() {
			t.Fatalf("%s: leader has %v (%v), restarted node %v (%v)", key, a, errA, b, errB)
		}
	}
}
