package namespace

import (
	"fmt"
	"runtime"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestLookupCacheBoundedRichRecords: the byte bound holds for records
// of every shape (many blocks, ACL entries, S3 attribute maps, plain
// one-block records whose index share is largest): the heap the cache
// holds stays within 1.15x of its bound. (The decoded-record cache of
// session 9 counted 2x the encoded bytes at first and held 1.8-3.6 times
// its bound.)
func TestLookupCacheBoundedRichRecords(t *testing.T) {
	const limit = 8 << 20
	kinds := map[string]func(i int) *metapb.KeyInfo{
		"blocks64": func(i int) *metapb.KeyInfo {
			ki := &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("big/%08d", i), Size: 64 << 22}
			for j := range 64 {
				ki.Blocks = append(ki.Blocks, &metapb.KeyBlock{Id: &metapb.BlockID{ContainerId: uint64(j%7 + 1), LocalId: uint64(i*64 + j + 1)}, Length: 4 << 20})
			}
			return ki
		},
		"usermeta": func(i int) *metapb.KeyInfo {
			m := &metapb.ObjectMeta{Etag: fmt.Sprintf("%032x", i), ContentType: "text/plain", User: map[string]string{}, Tags: map[string]string{}}
			for j := range 10 {
				m.User[fmt.Sprintf("k%d", j)] = "v"
			}
			for j := range 5 {
				m.Tags[fmt.Sprintf("t%d", j)] = "v"
			}
			return &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("m/%08d", i), Size: 1, Meta: m,
				Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i + 1)}, Length: 1}}}
		},
		"plain": func(i int) *metapb.KeyInfo { // as the lookup benchmark's: the index's share is largest
			return &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("p/%08d", i), Size: 4096, Replication: metapb.Replication_THREE,
				Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 1, LocalId: uint64(i + 1)}, Length: 4096}}}
		},
		"acls20": func(i int) *metapb.KeyInfo {
			ki := &metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: fmt.Sprintf("a/%08d", i), Size: 1}
			for j := range 20 {
				ki.Acls = append(ki.Acls, &metapb.Acl{Type: metapb.AclType_ACL_USER, Name: fmt.Sprintf("u%d", j), Rights: 3})
			}
			return ki
		},
	}
	for name, mk := range kinds {
		t.Run(name, func(t *testing.T) {
			c := newLookupCache(limit)
			heap := func() uint64 {
				runtime.GC()
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				return ms.HeapAlloc
			}
			before := heap()
			enc := 0
			for i := 0; i < 200_000; i++ {
				v, _ := proto.Marshal(mk(i))
				enc = len(v)
				k := objKey(7, mk(i).Name)
				for range 6 {
					if ki, _, gen := c.get(k, recordNames{}); ki == nil {
						c.put(k, gen, v)
					}
				}
				if c.stats().Evictions > 20000 {
					break
				}
			}
			after := heap()
			st := c.stats()
			held := int64(after) - int64(before)
			t.Logf("%s: encoded %d B/record, entries %d, counted %.1f MiB, real heap %.1f MiB (%.2fx bound %.0f MiB), per entry counted %d real %d",
				name, enc, st.Entries, float64(st.Bytes)/(1<<20), float64(held)/(1<<20), float64(held)/limit, float64(limit)/(1<<20), st.Bytes/int64(st.Entries), held/int64(st.Entries))
			if st.Bytes > limit || st.Evictions == 0 {
				t.Fatalf("%s: over the bound or never evicted: %+v", name, st)
			}
			if held > limit*23/20 {
				t.Fatalf("%s: cache holds %.1f MiB of heap, bound %.0f MiB", name, float64(held)/(1<<20), float64(limit)/(1<<20))
			}
			runtime.KeepAlive(c)
		})
	}
}
