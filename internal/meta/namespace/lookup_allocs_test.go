package namespace

import (
	"fmt"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// lookupAllocsBound bounds the heap allocations per key of a LookupKeys
// batch in the namespace service (read barrier, authorization, Pebble
// get, decoding; no gRPC): session 7's code took 9.2 per key, session
// 8's 8.2 (issue 15: server CPU per lookup); session 9's 1.2 with the
// records in the lookup cache, session 10's too (a hit decodes the cached
// record in one allocation). lookupMissAllocsBound bounds a lookup the
// cache does not serve (turned off: every lookup misses; 8.2 until
// session 10's decodeRecord, 2.2 since).
const (
	lookupAllocsBound     = 2
	lookupMissAllocsBound = 3
)

// TestLookupAllocs is the regression check of a lookup's own cost: a
// LookupKeys batch of 16 keys allocates at most lookupAllocsBound times
// per key.
func TestLookupAllocs(t *testing.T) {
	t.Run("cached", func(t *testing.T) { testLookupAllocs(t, true, lookupAllocsBound) })
	t.Run("uncached", func(t *testing.T) { testLookupAllocs(t, false, lookupMissAllocsBound) })
}

func testLookupAllocs(t *testing.T, cached bool, bound float64) {
	e := newNS(t)
	if !cached {
		e.st.SetLookupCacheBytes(-1)
	}
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	bk, err := e.st.GetBucket("vol", "bkt")
	if err != nil {
		t.Fatal(err)
	}
	const n = 16
	var keys []*metapb.KeyInfo
	r := &metapb.LookupKeysRequest{}
	for i := range n {
		name := fmt.Sprintf("data/key-%04d", i)
		keys = append(keys, &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: name, Size: 4096,
			Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i + 1)}, Length: 4096}}})
		r.Requests = append(r.Requests, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: name, NoLocations: true})
	}
	if err := e.st.BulkLoadObjectKeys(bk.Id, keys); err != nil {
		t.Fatal(err)
	}
	call := func() {
		resp, err := e.s.LookupKeys(e.ctx, r)
		if err != nil || resp.Results[n-1].Code != 0 || resp.Results[n-1].Key.GetSize() != 4096 {
			t.Fatal(err, resp)
		}
	}
	call()
	best := 1e9
	for range 3 { // the least of a few rounds: the group's ticks allocate too
		best = min(best, testing.AllocsPerRun(100, call)/n)
	}
	t.Logf("allocations per key: %.1f", best)
	if best > bound {
		t.Fatalf("a lookup allocates %.1f times per key, more than %.0f: the lookup path got costlier (issue 15; docs/BENCHMARKS.md)", best, bound)
	}
}
