package applyhalt

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// BenchmarkDecode: what Decode adds to the unmarshal every Apply did
// before (the unknown-field check).
func BenchmarkDecode(b *testing.B) {
	cmd, err := proto.Marshal(&metapb.ScmCommand{NowUnixMs: 1, Op: &metapb.ScmCommand_AllocateIdRange{AllocateIdRange: &metapb.AllocateIDRangeOp{Count: 5}}})
	if err != nil {
		b.Fatal(err)
	}
	g := New("scm", nil, &metapb.ScmCommand{}, nil)
	b.Run("unmarshal", func(b *testing.B) {
		for range b.N {
			if err := proto.Unmarshal(cmd, &metapb.ScmCommand{}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode", func(b *testing.B) {
		for range b.N {
			if h := g.Decode(store.Entry{Index: 1, Cmd: cmd}, &metapb.ScmCommand{}); h != nil {
				b.Fatal(h)
			}
		}
	})
}
