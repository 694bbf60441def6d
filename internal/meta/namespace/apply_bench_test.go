package namespace

import (
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// BenchmarkApplyWriteBatch is the meta apply of small PUTs as the write
// coalescer sends them: per op, one OpenKeys entry of 64 keys and one
// CommitKeys entry committing them (new keys of 4 KiB, one block each),
// applied as Raft hands them to the state machine (each entry its own
// Apply call, its own Pebble batch). ns/op and allocs/op are per key;
// "cache=off" is the same with the apply cache off (applycache.go).
// WAL-B/key is what the meta store's Pebble WAL took per key (the open-key
// row's Set and Delete, the key's row, the counters and applied index per
// batch).
func BenchmarkApplyWriteBatch(b *testing.B) {
	const batch = 64
	for _, off := range []bool{false, true} {
		b.Run(fmt.Sprintf("cache=%v", map[bool]string{false: "on", true: "off"}[off]), func(b *testing.B) {
			st, err := Open(b.TempDir(), store.Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			st.applied.off = off
			idx := uint64(0)
			apply := func(cmd *metapb.NsCommand) any {
				enc, err := proto.Marshal(cmd)
				if err != nil {
					b.Fatal(err)
				}
				idx++
				return st.Apply([]store.Entry{{Index: idx, Cmd: enc}})[0]
			}
			apply(&metapb.NsCommand{Op: &metapb.NsCommand_CreateVolume{CreateVolume: &metapb.CreateVolumeRequest{Name: "vol"}}})
			apply(&metapb.NsCommand{Op: &metapb.NsCommand_CreateBucket{CreateBucket: &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}}})
			local := uint64(0)
			wal0 := st.Store().Metrics().WAL.BytesWritten
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i += batch {
				op := &metapb.OpenKeysOp{}
				for j := range batch {
					local++
					op.Opens = append(op.Opens, &metapb.OpenKeyOp{
						Request: &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: fmt.Sprintf("obj/%010d-%d", i, j), Replication: metapb.Replication_THREE,
							ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 16 << 10, SizeHint: 4096},
						Blocks: []*metapb.BlockLocation{{Id: &metapb.BlockID{ContainerId: 1 + local%8, LocalId: local}, PipelineId: 1}}})
				}
				res := apply(&metapb.NsCommand{NowUnixMs: 1, Op: &metapb.NsCommand_OpenKeys{OpenKeys: op}}).([]any)
				cop := &metapb.CommitKeysOp{}
				for j, r := range res {
					id, ok := r.(uint64)
					if !ok {
						b.Fatalf("open: %v", r)
					}
					cop.Commits = append(cop.Commits, &metapb.CommitKeyRequest{OpenId: id,
						Blocks: []*metapb.KeyBlock{{Id: op.Opens[j].Blocks[0].Id, Length: 4096}}, Meta: &metapb.ObjectMeta{Etag: "0123456789abcdef0123456789abcdef", ContentType: "application/octet-stream"}})
				}
				for _, r := range apply(&metapb.NsCommand{NowUnixMs: 2, Op: &metapb.NsCommand_CommitKeys{CommitKeys: cop}}).([]any) {
					if _, ok := r.(*metapb.KeyInfo); !ok {
						b.Fatalf("commit: %v", r)
					}
				}
			}
			b.StopTimer()
			m := st.Store().Metrics()
			keys := (b.N + batch - 1) / batch * batch
			b.ReportMetric(float64(m.WAL.BytesWritten-wal0)/float64(keys), "WAL-B/key")
		})
	}
}
