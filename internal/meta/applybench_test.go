package meta

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// BenchmarkGroupApply: Apply of batches of 64 small commands in the SCM,
// CA and user-token state machines (the path the apply halt's decode
// check sits on); ns/op is per entry.
func BenchmarkGroupApply(b *testing.B) {
	now := time.Now().UnixMilli()
	opts := store.Options{SyncInterval: time.Hour, Logger: quiet}
	for _, bc := range []struct {
		name string
		open func(dir string) (stateMachine, func())
		cmd  func(i int) proto.Message
	}{
		{"scm", func(dir string) (stateMachine, func()) {
			s, err := scm.Open(dir, opts)
			if err != nil {
				b.Fatal(err)
			}
			return s, func() { s.Close() }
		}, func(int) proto.Message {
			return &metapb.ScmCommand{NowUnixMs: now, Op: &metapb.ScmCommand_AllocateIdRange{AllocateIdRange: &metapb.AllocateIDRangeOp{Count: 5}}}
		}},
		{"ca", func(dir string) (stateMachine, func()) {
			s, err := openCaState(dir, opts, nil, quiet)
			if err != nil {
				b.Fatal(err)
			}
			return s, func() { s.Close() }
		}, func(i int) proto.Message {
			return &metapb.CaCommand{NowUnixMs: now, Op: &metapb.CaCommand_RecordIssued{RecordIssued: &metapb.CaIssuedCert{Serial: string(rune('a' + i%26)), Identity: "basalt://datanode/x"}}}
		}},
		{"usertoken", func(dir string) (stateMachine, func()) {
			s, err := openUTState(dir, opts)
			if err != nil {
				b.Fatal(err)
			}
			return s, func() { s.Close() }
		}, func(i int) proto.Message {
			return &metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Renew{Renew: &metapb.UserTokenRenewOp{Sequence: uint64(i % 1000), ExpiryUnixMs: now + int64(i), MaxUnixMs: now + 3600_000}}}
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			sm, closeSM := bc.open(b.TempDir())
			defer closeSM()
			const batch = 64
			cmds := make([][]byte, batch)
			for i := range cmds {
				var err error
				if cmds[i], err = proto.Marshal(bc.cmd(i)); err != nil {
					b.Fatal(err)
				}
			}
			ents := make([]store.Entry, batch)
			idx := uint64(0)
			b.ResetTimer()
			for n := 0; n < b.N; n += batch {
				for i := range ents {
					idx++
					ents[i] = store.Entry{Index: idx, Cmd: cmds[i]}
				}
				for _, r := range sm.Apply(ents) {
					if err, ok := r.(error); ok {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
