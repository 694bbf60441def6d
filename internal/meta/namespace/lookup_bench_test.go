package namespace

import (
	"fmt"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// BenchmarkLookup is the namespace's part of a lookup, without gRPC:
// LookupKey one key per call against LookupKeys of 16 and 256 keys (one
// read barrier and one authorizer per call). ns/op and allocs/op are per
// key. The keys are spread over 10,000 so that Pebble reads are not all
// from one block.
func BenchmarkLookup(b *testing.B) {
	e := newNS(b)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		b.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		b.Fatal(err)
	}
	const n = 10_000
	var keys []*metapb.KeyInfo
	for i := range n {
		keys = append(keys, &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("data/part-%03d/key-%08d", i%100, i), Size: 4096,
			Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i + 1)}, Length: 4096}}})
	}
	bk, err := e.st.GetBucket("vol", "bkt")
	if err != nil {
		b.Fatal(err)
	}
	if err := e.st.BulkLoadObjectKeys(bk.Id, keys); err != nil {
		b.Fatal(err)
	}
	req := func(i int) *metapb.LookupKeyRequest {
		return &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: keys[(i*7919)%n].Name, NoLocations: true}
	}
	b.Run("single", func(b *testing.B) {
		i := 0
		for b.Loop() {
			if _, err := e.s.LookupKey(e.ctx, req(i)); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	for _, size := range []int{16, 256} {
		b.Run(fmt.Sprintf("batch%d", size), func(b *testing.B) {
			r := &metapb.LookupKeysRequest{}
			for i := range size {
				r.Requests = append(r.Requests, req(i))
			}
			b.ReportAllocs()
			for b.Loop() {
				resp, err := e.s.LookupKeys(e.ctx, r)
				if err != nil || resp.Results[size-1].Code != 0 {
					b.Fatal(err, resp.Results[size-1].Message)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*size), "ns/key")
		})
	}
}
