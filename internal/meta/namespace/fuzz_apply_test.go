package namespace

import (
	"encoding/hex"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/vfs"
)

// FuzzApplyEntry: any bytes as a committed namespace entry (the
// decodeEntry check and the apply behind it). Two replicas with the same
// state apply the same entry: neither panics, both reach the same state
// with the same result, and a replica that halts does so at that entry
// with nothing of it applied. The seeds are every op of NsCommand (empty
// and with a volume, bucket and key named) beside real commands, so the
// mutations reach each op's apply.
func FuzzApplyEntry(f *testing.F) {
	cmd := &metapb.NsCommand{}
	oneof := cmd.ProtoReflect().Descriptor().Oneofs().ByName("op")
	for i := range oneof.Fields().Len() {
		fd := oneof.Fields().Get(i)
		m := cmd.ProtoReflect().New()
		op := m.NewField(fd).Message()
		b, _ := proto.Marshal(m.Interface())
		f.Add(b)
		// The same op naming the volume, bucket and key set up below,
		// where its message has such fields.
		for name, v := range map[protoreflect.Name]string{"volume": "vol", "bucket": "abkt", "key": "a", "name": "abkt"} {
			if fd := op.Descriptor().Fields().ByName(name); fd != nil && fd.Kind() == protoreflect.StringKind && fd.Cardinality() != protoreflect.Repeated {
				op.Set(fd, protoreflect.ValueOfString(v))
			}
		}
		m.Set(fd, protoreflect.ValueOfMessage(op))
		b, _ = proto.Marshal(m.Interface())
		f.Add(b)
	}
	real := []*metapb.NsCommand{
		{NowUnixMs: 1, Op: &metapb.NsCommand_CommitKey{CommitKey: &metapb.CommitKeyRequest{OpenId: 1, Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 7, LocalId: 1}, Length: 3}}}}},
		{NowUnixMs: 1, Op: &metapb.NsCommand_DeleteBucket{DeleteBucket: &metapb.DeleteBucketRequest{Volume: "vol", Name: "abkt"}}},
		{NowUnixMs: 1, Op: &metapb.NsCommand_Layout{Layout: &metapb.LayoutOp{Version: 2, Init: true}}},
	}
	for _, c := range real {
		b, _ := proto.Marshal(c)
		f.Add(b)
	}
	f.Add([]byte{0x08})
	setup := [][]byte{
		mustMarshal(&metapb.NsCommand{Op: &metapb.NsCommand_CreateVolume{CreateVolume: &metapb.CreateVolumeRequest{Name: "vol"}}}),
		mustMarshal(&metapb.NsCommand{Op: &metapb.NsCommand_CreateBucket{CreateBucket: &metapb.CreateBucketRequest{Volume: "vol", Name: "abkt"}}}),
		mustMarshal(&metapb.NsCommand{Op: &metapb.NsCommand_OpenKeys{OpenKeys: &metapb.OpenKeysOp{Opens: []*metapb.OpenKeyOp{{Request: &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: "a"}, Blocks: []*metapb.BlockLocation{{Id: &metapb.BlockID{ContainerId: 7, LocalId: 1}}}}}}}}),
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var dumps, results []string
		var halts []*Halt
		for range 2 {
			// (On an in-memory FS: a DB per replica per input.)
			st, err := Open("/ns", store.Options{FS: vfs.NewMem(vfs.MemOptions{}), ReserveBytes: -1})
			if err != nil {
				t.Fatal(err)
			}
			st.Apply([]store.Entry{{Index: 1, Cmd: setup[0]}, {Index: 2, Cmd: setup[1]}, {Index: 3, Cmd: setup[2]}})
			before := dump(t, st)
			r := st.Apply([]store.Entry{{Index: 4, Cmd: b}})
			h := st.Halted()
			if h != nil {
				if h.Index != 4 || st.Store().AppliedIndex() != 3 {
					t.Fatalf("halt %+v at applied index %d, want at entry 4 with 3 applied", h, st.Store().AppliedIndex())
				}
				// (Beside the halt row itself.)
				if after := withoutHaltRow(dump(t, st)); after != before {
					t.Fatalf("a halting entry (%+v) changed the state:\n%s\n----\n%s", h, before, after)
				}
			}
			halts = append(halts, h)
			dumps = append(dumps, dump(t, st))
			results = append(results, resultString(r[0]))
			st.Close()
		}
		if (halts[0] == nil) != (halts[1] == nil) {
			t.Fatalf("one replica halted, the other did not: %v / %v", halts[0], halts[1])
		}
		if dumps[0] != dumps[1] {
			t.Fatal("two replicas applied one entry into different states")
		}
		if results[0] != results[1] {
			t.Fatalf("two replicas applied one entry with different results:\n%s\n----\n%s", results[0], results[1])
		}
	})
}

// withoutHaltRow drops the m/halt row from a dump.
func withoutHaltRow(d string) string {
	var out []string
	for _, l := range strings.SplitAfter(d, "\n") {
		if !strings.HasPrefix(l, hex.EncodeToString(keyHalt)+"=") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "")
}

func mustMarshal(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}
