package scm

import (
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestForcedRotation walks a forced rotation on a fake clock: a new key
// is recorded at once and signs after ActivationDelay; the old key gets
// a retire time (the new key's activation + TokenLifetime +
// ActivationDelay), keeps verifying the tokens it signed until they
// expire, and is dropped at that time, a day before the scheduled
// rotation would have replaced it; the member is recorded once (a
// second call proposes nothing, a second op is refused whole) and the
// record survives a snapshot.
func TestForcedRotation(t *testing.T) {
	kc := SecretKeyConfig{Rotation: 24 * time.Hour, ActivationDelay: time.Minute, TokenLifetime: 10 * time.Minute}
	e := newEnv(t, Config{SecretKeys: kc})
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	blk := &metapb.BlockID{ContainerId: 3, LocalId: 4}
	e.clk.Advance(time.Hour)
	start := e.clk.Now()
	if err := e.m.RotateSecretKeysFor(e.ctx, []uint64{9}); err != nil {
		t.Fatal(err)
	}
	props := len(e.fr.props)
	if err := e.m.RotateSecretKeysFor(e.ctx, []uint64{9}); err != nil || len(e.fr.props) != props {
		t.Fatalf("a second rotation for member 9: %v, %d proposals (want none)", err, len(e.fr.props)-props)
	}
	rows := e.st.SecretKeys()
	if len(rows) != 2 || !e.st.KeysRotatedFor(9) || e.st.KeysRotatedFor(8) {
		t.Fatalf("after the forced rotation: %d keys, rotated for 9: %v", len(rows), e.st.KeysRotatedFor(9))
	}
	wantRetire := start.Add(2*kc.ActivationDelay + kc.TokenLifetime).UnixMilli()
	if rows[0].RetireUnixMs != wantRetire || rows[1].RetireUnixMs != 0 || rows[1].ActivateUnixMs != start.Add(kc.ActivationDelay).UnixMilli() {
		t.Fatalf("keys %v", rows)
	}
	// Key 1 signs until key 2 activates: its last token.
	e.clk.Advance(kc.ActivationDelay - time.Millisecond)
	late, err := e.m.IssueToken(e.ctx, blk, blocktoken.Read, "")
	if err != nil {
		t.Fatal(err)
	}
	if c, _ := blocktoken.Decode(late); c.KeyID != 1 {
		t.Fatalf("signed with key %d before key 2's activation", c.KeyID)
	}
	lateExpiry := e.clk.Now().Add(kc.TokenLifetime)
	e.clk.Advance(kc.TokenLifetime)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.st.TokenKeys().Verify(late, blocktoken.Block{Container: 3, Local: 4}, blocktoken.Read, lateExpiry.Add(-time.Millisecond)); err != nil {
		t.Fatalf("key 1's last token just before its expiry: %v", err)
	}
	e.clk.Advance(kc.ActivationDelay + time.Millisecond)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.st.TokenKeys().Has(1) || !e.st.TokenKeys().Has(2) {
		t.Fatalf("past key 1's retire time: %d keys, key 1 held: %v", e.st.TokenKeys().Len(), e.st.TokenKeys().Has(1))
	}
	// A second op naming member 9 (another leader's) is refused whole;
	// so is one without a key or a retire time, or naming 0 or a member
	// twice.
	for _, c := range []struct {
		op   *metapb.SecretKeysOp
		want codes.Code
	}{
		{&metapb.SecretKeysOp{RotateForMembers: []uint64{10, 9}, RetireUnixMs: 1, Add: &metapb.SecretKey{Id: 50, Secret: make([]byte, blocktoken.SecretSize)}}, codes.AlreadyExists},
		{&metapb.SecretKeysOp{RotateForMembers: []uint64{10}}, codes.InvalidArgument},
		{&metapb.SecretKeysOp{RotateForMembers: []uint64{10, 0}, RetireUnixMs: 1, Add: &metapb.SecretKey{Id: 50, Secret: make([]byte, blocktoken.SecretSize)}}, codes.InvalidArgument},
		{&metapb.SecretKeysOp{RotateForMembers: []uint64{10, 10}, RetireUnixMs: 1, Add: &metapb.SecretKey{Id: 50, Secret: make([]byte, blocktoken.SecretSize)}}, codes.InvalidArgument},
	} {
		_, err = e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_SecretKeys{SecretKeys: c.op}})
		if status.Code(err) != c.want || e.st.TokenKeys().Has(50) || e.st.KeysRotatedFor(10) || e.st.TokenKeys().Len() != 1 {
			t.Fatalf("forced op %v: %v, want %v and nothing recorded", c.op.RotateForMembers, err, c.want)
		}
	}
	// Two members in one op: one new key.
	if err := e.m.RotateSecretKeysFor(e.ctx, []uint64{11, 9, 12}); err != nil || !e.st.KeysRotatedFor(11) || !e.st.KeysRotatedFor(12) || e.st.TokenKeys().Len() != 2 {
		t.Fatalf("rotation for 11, 9, 12: %v, %d keys", err, e.st.TokenKeys().Len())
	}
	st := openState(t, filepath.Join(t.TempDir(), "a"))
	defer st.Close()
	_, rc, err := e.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Restore(e.fr.idx, rc); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if !st.KeysRotatedFor(9) || !st.TokenKeys().SameAs(e.st.TokenKeys()) {
		t.Fatal("the restored state lost the forced rotation")
	}
}
