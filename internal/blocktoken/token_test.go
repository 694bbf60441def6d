package blocktoken

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
)

func testKey(t testing.TB, id uint64, activate int64) Key {
	s := make([]byte, SecretSize)
	if _, err := rand.Read(s); err != nil {
		t.Fatal(err)
	}
	return Key{ID: id, Secret: s, ActivateUnixMs: activate}
}

func mustSet(t testing.TB, keys ...Key) *KeySet {
	s, err := NewKeySet(keys)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestIssueVerify(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	ks := mustSet(t, testKey(t, 1, 0))
	blk := Block{Container: 7, Local: 42}
	tok, err := ks.Issue(now, Claims{Block: blk, Modes: Read | Write, ExpiryUnixMs: now.Add(time.Hour).UnixMilli(), Owner: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := ks.Verify(tok, blk, Write, now)
	if err != nil {
		t.Fatal(err)
	}
	if c.Owner != "alice" || c.KeyID != 1 || c.Block != blk || c.Modes != Read|Write {
		t.Fatalf("claims %+v", c)
	}
	if d, err := Decode(tok); err != nil || d != c {
		t.Fatalf("Decode = %+v, %v; want %+v", d, err, c)
	}

	other := mustSet(t, testKey(t, 1, 0)) // same ID, another secret
	cases := []struct {
		name string
		ks   *KeySet
		tok  []byte
		blk  Block
		mode Mode
		now  time.Time
		want error
	}{
		{"missing", ks, nil, blk, Read, now, ErrMissing},
		{"other block", ks, tok, Block{7, 43}, Read, now, ErrInvalid},
		{"other container", ks, tok, Block{8, 42}, Read, now, ErrInvalid},
		{"mode not granted", ks, tok, blk, Delete, now, ErrInvalid},
		{"expired", ks, tok, blk, Read, now.Add(time.Hour), ErrExpired},
		{"forged key", other, tok, blk, Read, now, ErrInvalid},
		{"unknown key", mustSet(t, testKey(t, 2, 0)), tok, blk, Read, now, ErrInvalid},
		{"no keys", nil, tok, blk, Read, now, ErrInvalid},
		{"truncated", ks, tok[:len(tok)-1], blk, Read, now, ErrInvalid},
		{"too long", ks, append(bytes.Clone(tok), make([]byte, MaxTokenSize)...), blk, Read, now, ErrInvalid},
	}
	for _, tc := range cases {
		if _, err := tc.ks.Verify(tc.tok, tc.blk, tc.mode, tc.now); !errors.Is(err, tc.want) {
			t.Errorf("%s: err %v, want %v", tc.name, err, tc.want)
		}
	}
	// Every single-bit change of the token is refused: claims are covered
	// by the MAC, and the MAC by the key.
	for i := range tok {
		for bit := 0; bit < 8; bit++ {
			bad := bytes.Clone(tok)
			bad[i] ^= 1 << bit
			if _, err := ks.Verify(bad, blk, Read, now); err == nil {
				t.Fatalf("token with byte %d bit %d flipped was accepted", i, bit)
			}
		}
	}
}

func TestSigningKeyRotation(t *testing.T) {
	k1, k2, k3 := testKey(t, 1, 0), testKey(t, 2, 10_000), testKey(t, 3, 20_000)
	ks := mustSet(t, k3, k1, k2)
	for _, c := range []struct {
		ms   int64
		want uint64
	}{{0, 1}, {9_999, 1}, {10_000, 2}, {19_999, 2}, {20_000, 3}, {1 << 40, 3}} {
		if id, ok := ks.SigningKey(time.UnixMilli(c.ms)); !ok || id != c.want {
			t.Errorf("at %d ms: signing key %d %v, want %d", c.ms, id, ok, c.want)
		}
	}
	if _, err := mustSet(t, testKey(t, 5, 5000)).Issue(time.UnixMilli(0), Claims{Block: Block{1, 1}, Modes: Read, ExpiryUnixMs: 1}); !errors.Is(err, ErrNoKey) {
		t.Fatalf("issue before any key is active: %v", err)
	}
	// A token signed with the old key still verifies after the new one is
	// active, as long as the old key is held.
	now := time.UnixMilli(15_000)
	old, _ := mustSet(t, k1).Issue(now, Claims{Block: Block{1, 2}, Modes: Read, ExpiryUnixMs: 30_000})
	if _, err := ks.Verify(old, Block{1, 2}, Read, now); err != nil {
		t.Fatal(err)
	}
	if !ks.SameAs(mustSet(t, k1, k2, k3)) || ks.SameAs(mustSet(t, k1, k2)) {
		t.Fatal("SameAs")
	}
}

func TestNewKeySetBounds(t *testing.T) {
	if _, err := NewKeySet([]Key{{ID: 1, Secret: make([]byte, 16)}}); err == nil {
		t.Error("short secret accepted")
	}
	if _, err := NewKeySet([]Key{testKey(t, 0, 0)}); err == nil {
		t.Error("key ID 0 accepted")
	}
	if _, err := NewKeySet([]Key{testKey(t, 1, 0), testKey(t, 1, 0)}); err == nil {
		t.Error("duplicate key ID accepted")
	}
	many := make([]Key, MaxKeys+1)
	for i := range many {
		many[i] = testKey(t, uint64(i+1), 0)
	}
	if _, err := NewKeySet(many); err == nil {
		t.Error("too many keys accepted")
	}
	ks := mustSet(t, testKey(t, 1, 0))
	if _, err := ks.Issue(time.Now(), Claims{Block: Block{1, 1}, Modes: Read, Owner: string(make([]byte, MaxOwner+1))}); err == nil {
		t.Error("long owner accepted")
	}
	if _, err := ks.Issue(time.Now(), Claims{Block: Block{1, 1}}); err == nil {
		t.Error("no modes accepted")
	}
}

func FuzzDecodeToken(f *testing.F) {
	ks := mustSet(f, Key{ID: 9, Secret: bytes.Repeat([]byte{7}, SecretSize)})
	tok, err := ks.Issue(time.UnixMilli(0), Claims{Block: Block{3, 4}, Modes: Read, ExpiryUnixMs: 1 << 50, Owner: "bob"})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(tok)
	f.Add([]byte{})
	f.Add(make([]byte, fixedLen+macLen))
	f.Add(make([]byte, fixedLen1+macLen))
	v1 := encodeV1(ks.keys[9], Claims{KeyID: 9, Block: Block{3, 4}, Modes: Read, ExpiryUnixMs: 1 << 50, Owner: "bob"})
	f.Add(v1)
	wtok, _ := ks.Issue(time.UnixMilli(0), Claims{Block: Block{3, 4}, Modes: Write, ExpiryUnixMs: 1 << 50, Pipeline: 77})
	f.Add(wtok)
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Decode(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Decode error %v does not match ErrInvalid", err)
			}
		} else if len(c.Owner) > MaxOwner || len(b) > MaxTokenSize {
			t.Fatalf("decoded %+v from %d bytes", c, len(b))
		}
		// Nothing but the genuine tokens (version 2 and 1) verifies.
		_, verr := ks.Verify(b, Block{3, 4}, Read, time.UnixMilli(1))
		if verr == nil && !bytes.Equal(b, tok) && !bytes.Equal(b, v1) {
			t.Fatalf("forged token %x verified", b)
		}
	})
}

var sink []byte

func BenchmarkIssue(b *testing.B) {
	ks := mustSet(b, testKey(b, 1, 0), testKey(b, 2, 0), testKey(b, 3, 0))
	now := time.Now()
	c := Claims{Block: Block{12345, 678901}, Modes: Read, ExpiryUnixMs: now.Add(time.Hour).UnixMilli(), Owner: "s3user"}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			tok, err := ks.Issue(now, c)
			if err != nil {
				b.Fatal(err)
			}
			sink = tok
		}
	})
}

func BenchmarkVerify(b *testing.B) {
	ks := mustSet(b, testKey(b, 1, 0), testKey(b, 2, 0), testKey(b, 3, 0))
	now := time.Now()
	blk := Block{12345, 678901}
	tok, _ := ks.Issue(now, Claims{Block: blk, Modes: Read, ExpiryUnixMs: now.Add(time.Hour).UnixMilli(), Owner: "s3user"})
	var v Verifier
	v.Set(ks)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := v.Verify(tok, blk, Read, now); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkVerifyRetiring is BenchmarkVerify with every key carrying a
// retire time not reached yet (after a forced rotation): the retire check
// is taken to its comparison on every call.
func BenchmarkVerifyRetiring(b *testing.B) {
	now := time.Now()
	keys := []Key{testKey(b, 1, 0), testKey(b, 2, 0), testKey(b, 3, 0)}
	for i := range keys {
		keys[i].RetireUnixMs = now.Add(time.Hour).UnixMilli()
	}
	ks := mustSet(b, keys...)
	blk := Block{12345, 678901}
	tok, _ := ks.Issue(now, Claims{Block: blk, Modes: Read, ExpiryUnixMs: now.Add(time.Hour).UnixMilli(), Owner: "s3user"})
	var v Verifier
	v.Set(ks)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := v.Verify(tok, blk, Read, now); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func TestTokenThroughGRPCMetadata(t *testing.T) {
	tok := []byte{1, 0, 255, 10, 13, 0x80, 'a'} // binary: the -bin key carries any bytes
	out := WithToken(context.Background(), tok)
	md, _ := metadata.FromOutgoingContext(out)
	in := metadata.NewIncomingContext(context.Background(), md)
	if got := FromIncoming(in); !bytes.Equal(got, tok) {
		t.Fatalf("got %x, want %x", got, tok)
	}
	if got := FromIncoming(context.Background()); got != nil {
		t.Fatalf("no metadata: got %x", got)
	}
	huge := metadata.NewIncomingContext(context.Background(), metadata.Pairs(MetadataKey, string(make([]byte, 1<<20))))
	if got := FromIncoming(huge); len(got) != MaxTokenSize+1 {
		t.Fatalf("a 1 MiB value came back as %d bytes, want it cut to %d", len(got), MaxTokenSize+1)
	}
}

func TestPipelineClaim(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	ks := mustSet(t, testKey(t, 1, 0))
	blk := Block{Container: 7, Local: 42}
	exp := now.Add(time.Hour).UnixMilli()
	tok, err := ks.Issue(now, Claims{Block: blk, Modes: Read | Write, ExpiryUnixMs: exp, Pipeline: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	if tok[0] != Version || len(tok) != fixedLen+macLen {
		t.Fatalf("version %d, %d bytes", tok[0], len(tok))
	}
	c, err := ks.Verify(tok, blk, Write, now)
	if err != nil {
		t.Fatal(err)
	}
	if c.Pipeline != 1<<40 {
		t.Fatalf("pipeline %d", c.Pipeline)
	}
	if d, err := Decode(tok); err != nil || d != c {
		t.Fatalf("Decode = %+v, %v; want %+v", d, err, c)
	}
	if err := c.CheckPipeline(1 << 40); err != nil {
		t.Fatal(err)
	}
	for _, p := range []uint64{0, 1, 1<<40 + 1} {
		if err := c.CheckPipeline(p); !errors.Is(err, ErrInvalid) {
			t.Errorf("pipeline %d: %v, want ErrInvalid", p, err)
		}
	}
	// A token without a pipeline grants no write anywhere.
	tok0, _ := ks.Issue(now, Claims{Block: blk, Modes: Read | Write, ExpiryUnixMs: exp})
	c0, err := ks.Verify(tok0, blk, Read, now)
	if err != nil {
		t.Fatal(err)
	}
	if err := c0.CheckPipeline(0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("no pipeline: %v", err)
	}
	// Flipping any bit of the pipeline is caught by the MAC.
	for i := fixedLen1; i < fixedLen; i++ {
		bad := bytes.Clone(tok)
		bad[i] ^= 1
		if _, err := ks.Verify(bad, blk, Write, now); !errors.Is(err, ErrInvalid) {
			t.Fatalf("pipeline byte %d changed: %v", i, err)
		}
	}
}

// encodeV1 writes a version 1 token (no pipeline), as issuers before
// version 2 did.
func encodeV1(k *keyState, c Claims) []byte {
	b := []byte{version1, byte(c.Modes), byte(len(c.Owner)), 0}
	b = binary.BigEndian.AppendUint64(b, c.KeyID)
	b = binary.BigEndian.AppendUint64(b, c.Block.Container)
	b = binary.BigEndian.AppendUint64(b, c.Block.Local)
	b = binary.BigEndian.AppendUint64(b, uint64(c.ExpiryUnixMs))
	b = append(b, c.Owner...)
	return k.mac(b, b)
}

func TestVersion1TokenReadsOnly(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	ks := mustSet(t, testKey(t, 3, 0))
	blk := Block{Container: 5, Local: 6}
	tok := encodeV1(ks.keys[3], Claims{KeyID: 3, Block: blk, Modes: Read | Write, ExpiryUnixMs: now.Add(time.Hour).UnixMilli(), Owner: "carol"})
	c, err := ks.Verify(tok, blk, Read, now)
	if err != nil {
		t.Fatal(err)
	}
	if c.Pipeline != 0 || c.Owner != "carol" {
		t.Fatalf("claims %+v", c)
	}
	if err := c.CheckPipeline(1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("version 1 token allowed a write: %v", err)
	}
	// A version 1 header on a version 2 layout (or the reverse) is refused.
	bad := bytes.Clone(tok)
	bad[0] = Version
	if _, err := Decode(bad); !errors.Is(err, ErrInvalid) {
		t.Fatalf("v1 layout read as v2: %v", err)
	}
}

// A key past its retire time (a forced rotation after a meta node was
// removed) neither verifies nor signs, by the verifier's clock; before it,
// it does both. The refusal is ErrRetired (an ErrInvalid, not an
// ErrExpired: the client cannot renew its way out of a forged token).
func TestRetiredKey(t *testing.T) {
	now := time.UnixMilli(10_000_000)
	retire := now.Add(time.Minute)
	old := testKey(t, 1, 0)
	old.RetireUnixMs = retire.UnixMilli()
	ks := mustSet(t, old)
	blk := Block{Container: 7, Local: 42}
	// Signed before the retire time, claiming to live past it (as a token
	// forged with the removed node's copy of the key would).
	tok, err := ks.Issue(now, Claims{Block: blk, Modes: Read, ExpiryUnixMs: retire.Add(time.Hour).UnixMilli()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ks.Verify(tok, blk, Read, retire.Add(-time.Millisecond)); err != nil {
		t.Fatalf("before the retire time: %v", err)
	}
	for _, at := range []time.Time{retire, retire.Add(time.Second)} {
		_, err := ks.Verify(tok, blk, Read, at)
		if !errors.Is(err, ErrRetired) || !errors.Is(err, ErrInvalid) || errors.Is(err, ErrExpired) {
			t.Fatalf("at retire%+v: err %v, want ErrRetired (an ErrInvalid, not ErrExpired)", at.Sub(retire), err)
		}
	}
	// An expired token of a retired key reads as expired (the client
	// renews it, which is what a genuine old token needs).
	short, err := ks.Issue(now, Claims{Block: blk, Modes: Read, ExpiryUnixMs: retire.UnixMilli()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ks.Verify(short, blk, Read, retire); !errors.Is(err, ErrExpired) {
		t.Fatalf("expired token of a retired key: err %v, want ErrExpired", err)
	}
	// A retired key never signs, even as the only active key...
	if id, ok := ks.SigningKey(retire); ok {
		t.Fatalf("retired key %d signs", id)
	}
	if _, err := ks.Issue(retire, Claims{Block: blk, Modes: Read, ExpiryUnixMs: retire.Add(time.Hour).UnixMilli()}); !errors.Is(err, ErrNoKey) {
		t.Fatalf("Issue with only a retired key: err %v, want ErrNoKey", err)
	}
	// ... nor as the newest: the older unretired key signs instead.
	newest := testKey(t, 3, 5)
	newest.RetireUnixMs = retire.UnixMilli()
	two := mustSet(t, testKey(t, 2, 1), newest)
	if id, ok := two.SigningKey(retire.Add(-time.Millisecond)); !ok || id != 3 {
		t.Fatalf("before the retire time: signing key %d %v, want 3", id, ok)
	}
	if id, ok := two.SigningKey(retire); !ok || id != 2 {
		t.Fatalf("after the retire time: signing key %d %v, want 2", id, ok)
	}
	// The retire time is part of the set's identity: a heartbeat that only
	// adds it is a change.
	unretired := old
	unretired.RetireUnixMs = 0
	if ks.SameAs(mustSet(t, unretired)) || !ks.SameAs(mustSet(t, old)) {
		t.Fatal("SameAs ignores the retire time")
	}
}
