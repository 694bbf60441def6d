package scm

import (
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestSecretKeyRotation walks SCM's key schedule on a fake clock: the
// first key signs at once; each later key is recorded Rotation after the
// previous one and signs only ActivationDelay after that; a key is dropped
// once a newer key has signed for TokenLifetime + ActivationDelay, so a
// token is verifiable with the recorded keys until it expires; the keys
// survive a restart of the state.
func TestSecretKeyRotation(t *testing.T) {
	kc := SecretKeyConfig{Rotation: time.Hour, ActivationDelay: time.Minute, TokenLifetime: 10 * time.Minute}
	e := newEnv(t, Config{SecretKeys: kc})
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	signer := func() uint64 {
		id, ok := e.st.TokenKeys().SigningKey(e.clk.Now())
		if !ok {
			t.Fatal("no signing key")
		}
		return id
	}
	if e.st.TokenKeys().Len() != 1 || signer() != 1 {
		t.Fatalf("first tick: %d keys, signer %d", e.st.TokenKeys().Len(), signer())
	}
	blk := &metapb.BlockID{ContainerId: 3, LocalId: 4}
	tok1, err := e.m.IssueToken(e.ctx, blk, blocktoken.Read, "")
	if err != nil {
		t.Fatal(err)
	}
	// Within the rotation period nothing changes.
	e.clk.Advance(59 * time.Minute)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.st.TokenKeys().Len() != 1 {
		t.Fatalf("rotated early: %d keys", e.st.TokenKeys().Len())
	}
	// Key 2 is recorded, but key 1 signs until key 2's activation.
	e.clk.Advance(time.Minute)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.st.TokenKeys().Len() != 2 || signer() != 1 {
		t.Fatalf("after rotation: %d keys, signer %d; want 2 keys, key 1 signing until key 2 activates", e.st.TokenKeys().Len(), signer())
	}
	// Key 1's last tokens, issued just before key 2 activates.
	late, err := e.m.IssueToken(e.ctx, blk, blocktoken.Read, "")
	if err != nil {
		t.Fatal(err)
	}
	lateAt := e.clk.Now()
	e.clk.Advance(time.Minute)
	if signer() != 2 {
		t.Fatalf("after the activation delay the signer is %d, want 2", signer())
	}
	// Key 1's last token (issued just before key 2 activated) expires
	// TokenLifetime later; key 1 stays until then (plus the delay).
	e.clk.Advance(kc.TokenLifetime)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if !e.st.TokenKeys().Has(1) {
		t.Fatal("key 1 dropped while tokens it signed may be live")
	}
	if c, err := e.st.TokenKeys().Verify(late, blocktoken.Block{Container: 3, Local: 4}, blocktoken.Read, lateAt.Add(kc.TokenLifetime-time.Millisecond)); err != nil || c.KeyID != 1 {
		t.Fatalf("key 1's last token just before it expires: key %d, %v", c.KeyID, err)
	}
	if _, err := e.st.TokenKeys().Verify(tok1, blocktoken.Block{Container: 3, Local: 4}, blocktoken.Read, e.clk.Now()); err == nil {
		t.Fatal("key 1's first token verified long after it expired")
	}
	e.clk.Advance(kc.ActivationDelay)
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.st.TokenKeys().Has(1) || !e.st.TokenKeys().Has(2) {
		t.Fatalf("key 1 should be dropped now, key 2 kept: %d keys", e.st.TokenKeys().Len())
	}
	// Recorded in Pebble: a reopened state has the same keys.
	keys := e.st.TokenKeys()
	dir := t.TempDir()
	st := openState(t, filepath.Join(dir, "a"))
	defer st.Close()
	_, rc, err := e.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Restore(e.fr.idx, rc); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if !st.TokenKeys().SameAs(keys) {
		t.Fatal("restored state has other keys")
	}
}

// TestSecretKeysOpValidated: an invalid key is refused whole by Apply.
func TestSecretKeysOpValidated(t *testing.T) {
	e := newEnv(t, Config{})
	for _, k := range []*metapb.SecretKey{{Id: 0, Secret: make([]byte, 32)}, {Id: 1, Secret: make([]byte, 31)}} {
		if _, err := e.m.propose(e.ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_SecretKeys{SecretKeys: &metapb.SecretKeysOp{Add: k}}}); err == nil {
			t.Fatalf("key %d with %d secret bytes accepted", k.Id, len(k.Secret))
		}
	}
	if e.st.TokenKeys().Len() != 0 {
		t.Fatal("a refused key was recorded")
	}
}

// TestRegistrationCarriesFirstKey: a datanode that registers before the
// leader's first Tick recorded a key must still get the key tokens are
// signed with, in its registration answer. The first key signs at once, so
// without it a client writing to a fresh pipeline right away was refused
// ("signed with key 1, which this datanode does not hold (0 keys)") until
// the datanode's next heartbeat (the gray-failure test's first write).
// Concurrent registrations record one key, not one each.
func TestRegistrationCarriesFirstKey(t *testing.T) {
	e := newEnv(t, Config{})
	const n = 4
	resps := make([]*metapb.RegisterDatanodeResponse, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resps[i], errs[i] = e.m.Register(e.ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{
				Uuid: fmt.Sprintf("dn-%d", i), DataAddr: "h:1", RaftAddr: "h:2", Location: "/r1"}})
		}()
	}
	wg.Wait()
	if got := e.st.TokenKeys().Len(); got != 1 {
		t.Fatalf("%d keys recorded by %d concurrent registrations, want 1", got, n)
	}
	blk := &metapb.BlockID{ContainerId: 1, LocalId: 1}
	tok, err := e.m.IssueToken(e.ctx, blk, blocktoken.Write, "")
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resps {
		if errs[i] != nil {
			t.Fatalf("register %d: %v", i, errs[i])
		}
		keys := make([]blocktoken.Key, len(r.SecretKeys))
		for j, k := range r.SecretKeys {
			keys[j] = blocktoken.Key{ID: k.Id, Secret: k.Secret, ActivateUnixMs: k.ActivateUnixMs}
		}
		ks, err := blocktoken.NewKeySet(keys)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ks.Verify(tok, blocktoken.Block{Container: 1, Local: 1}, blocktoken.Write, e.clk.Now()); err != nil {
			t.Fatalf("datanode %d cannot verify a token issued right after it registered: %v", r.DatanodeId, err)
		}
	}
	// The leader's Tick finds the key and records no other.
	if err := e.m.Tick(e.ctx); err != nil {
		t.Fatal(err)
	}
	if got := e.st.TokenKeys().Len(); got != 1 {
		t.Fatalf("%d keys after the first Tick, want 1", got)
	}
}
