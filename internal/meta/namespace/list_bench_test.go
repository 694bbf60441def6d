package namespace

import (
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// BenchmarkList1M lists a bucket of a million keys (10 top-level
// directories of 100,000 keys each, the layout commit writes) the ways S3
// clients do, and the same on 20,000 keys for comparison. A page must cost
// the same whatever the bucket's size: 1,000
// keys from a start-after in the middle, or the 10 common prefixes of the
// whole bucket with a delimiter (one seek per prefix, not a scan).
//
//	go test -run '^$' -bench BenchmarkList1M -benchtime 200x ./internal/meta/namespace/
func BenchmarkList1M(b *testing.B) {
	for _, n := range []int{20_000, 1_000_000} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) { benchList(b, n) })
	}
}

func benchList(b *testing.B, n int) {
	e, bid := listBucket(b, n)
	for _, c := range []struct {
		name string
		req  *metapb.ListKeysRequest
		want int
	}{
		{"page1000-first", &metapb.ListKeysRequest{PageSize: 1000}, 1000},
		{"page1000-middle", &metapb.ListKeysRequest{StartAfter: "dir05/file0500005", PageSize: 1000}, 1000},
		{"prefix-page1000", &metapb.ListKeysRequest{Prefix: "dir07/", PageSize: 1000}, 1000},
		{"delimiter-root", &metapb.ListKeysRequest{Delimiter: "/", PageSize: 1000}, 10},
		{"delimiter-in-dir", &metapb.ListKeysRequest{Prefix: "dir03/", Delimiter: "/", PageSize: 1000}, 1000},
	} {
		b.Run(c.name, func(b *testing.B) {
			req := proto.Clone(c.req).(*metapb.ListKeysRequest)
			req.Volume, req.Bucket = "vol", "bkt"
			for b.Loop() {
				resp, err := e.s.ListKeys(e.ctx, req)
				if err != nil {
					b.Fatal(err)
				}
				if n := len(resp.Keys) + len(resp.CommonPrefixes); n != c.want {
					b.Fatalf("%s: %d entries, want %d (bucket %d)", c.name, n, c.want, bid)
				}
			}
		})
	}
}

func listBucket(b *testing.B, n int) (*nsEnv, uint64) {
	e := newNS(b)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		b.Fatal(err)
	}
	bk, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	if err != nil {
		b.Fatal(err)
	}
	for lo := 0; lo < n; lo += 100_000 {
		batch := e.st.st.NewBatch()
		for i := lo; i < min(n, lo+100_000); i++ {
			k := fmt.Sprintf("dir%02d/file%07d", i%10, i*(1_000_000/n))
			v, _ := proto.Marshal(&metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: k, Size: 4096,
				Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i)}, Length: 4096}}})
			if err := batch.Set(objKey(bk.Id, k), v, nil); err != nil {
				b.Fatal(err)
			}
		}
		if err := e.st.st.Commit(batch, uint64(1<<40+lo)); err != nil {
			b.Fatal(err)
		}
	}
	return e, bk.Id
}
