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

// BenchmarkGuard: what Guard (a deferred recover around one command's
// apply) adds to calling the apply directly.
func BenchmarkGuard(b *testing.B) {
	g := New("scm", nil, &metapb.ScmCommand{}, nil)
	cmd := &metapb.ScmCommand{NowUnixMs: 1}
	n := 0
	apply := func(c *metapb.ScmCommand) any { n += int(c.NowUnixMs); return nil }
	b.Run("direct", func(b *testing.B) {
		for range b.N {
			_ = apply(cmd)
		}
	})
	b.Run("guard", func(b *testing.B) {
		for range b.N {
			if _, h := g.Guard(store.Entry{Index: 1}, 1, cmd, func() any { return apply(cmd) }); h != nil {
				b.Fatal(h)
			}
		}
	})
}
