package namespace

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestBucketCacheFollowsBucketChanges: lookups go through the bucket cache,
// and a bucket deleted and re-created under the same name (a new ID) is
// never served from the old row, even by lookups racing the change.
func TestBucketCacheFollowsBucketChanges(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	if _, err := e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	mk := func() uint64 {
		b, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
		if err != nil {
			t.Fatal(err)
		}
		return b.Id
	}
	id1 := mk()
	e.put(t, "vol", "bkt", "k", 10)
	look := func() (*metapb.KeyInfo, error) {
		return e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"})
	}
	if ki, err := look(); err != nil || ki.Size != 10 {
		t.Fatalf("lookup: %v %v", ki, err)
	}
	if e.st.buckets.m[bucketRef{"vol", "bkt"}].GetId() != id1 {
		t.Fatal("a lookup did not cache its bucket")
	}
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	_, err := look()
	wantCode(t, err, codes.NotFound, "bkt")

	// Racing lookups while the bucket is re-created and filled, over and
	// over: once a round's writes returned, every later lookup must see
	// the new bucket's key.
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				look()
			}
		}()
	}
	for round := range 50 {
		mk()
		e.put(t, "vol", "bkt", "k", uint64(100+round))
		for range 3 {
			if ki, err := look(); err != nil || ki.Size != uint64(100+round) {
				stop.Store(true)
				wg.Wait()
				t.Fatalf("round %d: lookup after re-create: %v %v", round, ki, err)
			}
		}
		if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
			t.Fatal(err)
		}
		if _, err := look(); err == nil {
			stop.Store(true)
			wg.Wait()
			t.Fatalf("round %d: lookup found a key in a deleted bucket", round)
		}
	}
	stop.Store(true)
	wg.Wait()
}

// TestDeletionKeepsUpWithWrites: one background round hands the blocks of
// thousands of deleted keys to SCM (in batches), so garbage does not pile
// up on the datanodes faster than it is reclaimed; each block exactly once.
func TestDeletionKeepsUpWithWrites(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	const n = 5000
	for i := range n {
		e.put(t, "vol", "bkt", fmt.Sprintf("k%05d", i), 1)
	}
	for i := range n {
		if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: fmt.Sprintf("k%05d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.s.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	e.fb.mu.Lock()
	defer e.fb.mu.Unlock()
	if len(e.fb.freed) != n {
		t.Fatalf("one round handed %d of %d deleted keys' blocks to SCM", len(e.fb.freed), n)
	}
	for id, c := range e.fb.freed {
		if c != 1 {
			t.Fatalf("block %d handed over %d times", id, c)
		}
	}
	if rows, _ := e.st.DeletedRows(10); len(rows) != 0 {
		t.Fatalf("%d deleted rows left after the round", len(rows))
	}
}
