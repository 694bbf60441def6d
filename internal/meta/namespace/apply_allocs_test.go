package namespace

import (
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// applyAllocsBound bounds the heap allocations per key of applying small
// PUTs' entries (an OpenKeysOp of 64 keys, then the CommitKeysOp that
// commits them; decoding the entries included): session 11 measured 34.4
// with the apply cache (applycache.go), 49.4 with it off (and main before
// it, which also built three error strings per commit, about 52).
const applyAllocsBound = 38

// TestApplyWriteBatchAllocs is the regression check of the apply's cost
// per small PUT.
func TestApplyWriteBatchAllocs(t *testing.T) {
	for _, off := range []bool{false, true} {
		t.Run(fmt.Sprintf("cacheOff=%v", off), func(t *testing.T) {
			per := applyAllocsPerKey(t, off)
			t.Logf("allocations per key: %.1f", per)
			if off {
				return // (for comparison)
			}
			if per > applyAllocsBound {
				t.Fatalf("applying a small PUT allocates %.1f times per key, more than %d: the apply path got costlier (issue 15; docs/BENCHMARKS.md)", per, applyAllocsBound)
			}
		})
	}
}

func applyAllocsPerKey(t *testing.T, off bool) float64 {
	const batch, runs = 64, 20
	st, err := Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.applied.off = off
	enc := func(cmd *metapb.NsCommand) []byte {
		b, err := proto.Marshal(cmd)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	idx := uint64(0)
	apply := func(b []byte) any {
		idx++
		return st.Apply([]store.Entry{{Index: idx, Cmd: b}})[0]
	}
	apply(enc(&metapb.NsCommand{Op: &metapb.NsCommand_CreateVolume{CreateVolume: &metapb.CreateVolumeRequest{Name: "vol"}}}))
	apply(enc(&metapb.NsCommand{Op: &metapb.NsCommand_CreateBucket{CreateBucket: &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}}}))
	// The entries of runs+1 rounds (AllocsPerRun runs once more to warm
	// up); the open IDs the opens will get are known: st.nextOpen on.
	type round struct{ opens, commits []byte }
	var rounds []round
	nextOpen, local := st.nextOpen, uint64(0)
	for r := range runs + 1 {
		op, cop := &metapb.OpenKeysOp{}, &metapb.CommitKeysOp{}
		for j := range batch {
			local++
			id := &metapb.BlockID{ContainerId: 1 + local%8, LocalId: local}
			op.Opens = append(op.Opens, &metapb.OpenKeyOp{
				Request: &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: fmt.Sprintf("obj/%06d-%02d", r, j), Replication: metapb.Replication_THREE,
					ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: 16 << 10},
				Blocks: []*metapb.BlockLocation{{Id: id}}})
			cop.Commits = append(cop.Commits, &metapb.CommitKeyRequest{OpenId: nextOpen, Blocks: []*metapb.KeyBlock{{Id: id, Length: 4096}},
				Meta: &metapb.ObjectMeta{Etag: "0123456789abcdef0123456789abcdef", ContentType: "application/octet-stream"}})
			nextOpen++
		}
		rounds = append(rounds, round{enc(&metapb.NsCommand{NowUnixMs: 1, Op: &metapb.NsCommand_OpenKeys{OpenKeys: op}}),
			enc(&metapb.NsCommand{NowUnixMs: 2, Op: &metapb.NsCommand_CommitKeys{CommitKeys: cop}})})
	}
	next := 0
	per := testing.AllocsPerRun(runs, func() {
		r := rounds[next]
		next++
		apply(r.opens)
		for _, res := range apply(r.commits).([]any) {
			if _, ok := res.(*metapb.KeyInfo); !ok {
				t.Fatalf("commit: %v", res)
			}
		}
	}) / batch
	return per
}
