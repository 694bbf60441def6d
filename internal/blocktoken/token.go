package blocktoken

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Limits and sizes.
const (
	// Version is the layout Issue writes: version 2 adds the pipeline.
	// Decode also reads version 1 tokens (no pipeline: Pipeline 0), which
	// still grant reads; a write needs a pipeline (CheckPipeline).
	Version    = 2
	version1   = 1
	SecretSize = 32 // bytes of a secret key (HMAC-SHA256's block of entropy)
	MaxOwner   = 128
	fixedLen1  = 36
	fixedLen   = fixedLen1 + 8
	macLen     = sha256.Size
	// MaxTokenSize bounds an encoded token; anything longer is refused
	// before it is parsed.
	MaxTokenSize = fixedLen + MaxOwner + macLen
	// MaxKeys bounds a key set: rotation keeps a handful (the active key,
	// the next one, those whose tokens may still be live).
	MaxKeys = 64
)

// Mode is a set of access modes.
type Mode uint8

const (
	Read Mode = 1 << iota
	Write
	Delete
	allModes = Read | Write | Delete
)

func (m Mode) String() string {
	if m == 0 {
		return "none"
	}
	var parts []string
	for _, x := range []struct {
		m Mode
		s string
	}{{Read, "read"}, {Write, "write"}, {Delete, "delete"}} {
		if m&x.m != 0 {
			parts = append(parts, x.s)
		}
	}
	if m&^allModes != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint8(m&^allModes)))
	}
	return strings.Join(parts, "+")
}

// Block names what a token grants access to: one block, or (Local 0) one
// whole container (a replication export).
type Block struct {
	Container uint64
	Local     uint64
}

func (b Block) String() string { return fmt.Sprintf("%d/%d", b.Container, b.Local) }

// Claims is what a token says.
type Claims struct {
	KeyID        uint64
	Block        Block
	Modes        Mode
	ExpiryUnixMs int64
	Owner        string
	// Pipeline is the pipeline (Raft group) a write token lets its holder
	// write through: the one SCM allocated the block's container to. 0 in
	// read tokens and container export tokens (and version 1 tokens).
	Pipeline uint64
}

// CheckPipeline refuses (ErrInvalid) a write through pipeline p unless
// the token names p: a token for a block of a container in pipeline P1
// must not write through another pipeline P2 the same datanode belongs
// to, or P2's log would adopt the container and give its blocks P2's
// (unrelated) indexes as BCSIDs.
func (c Claims) CheckPipeline(p uint64) error {
	if c.Pipeline == 0 {
		return fmt.Errorf("%w: token for block %v names no pipeline; a write needs one (pipeline %d requested)", ErrInvalid, c.Block, p)
	}
	if c.Pipeline != p {
		return fmt.Errorf("%w: token for block %v allows writes through pipeline %d only, request goes through pipeline %d", ErrInvalid, c.Block, c.Pipeline, p)
	}
	return nil
}

// Errors. Every refusal matches ErrInvalid or ErrExpired with errors.Is;
// the message says what was wrong.
var (
	// ErrInvalid: malformed, forged (bad MAC), signed with a key this
	// verifier does not hold, or for another block or mode.
	ErrInvalid = errors.New("block token invalid")
	// ErrMissing: no token came with the request (matches ErrInvalid).
	ErrMissing = fmt.Errorf("%w: no token sent (a token comes with every block location the namespace returns)", ErrInvalid)
	// ErrExpired: a genuine token past its expiry. The caller may ask
	// the namespace for a fresh one.
	ErrExpired = errors.New("block token expired")
	// ErrRetired: a token signed with a key past its retire time (a
	// forced rotation after a meta node was removed retires every older
	// key; Key.RetireUnixMs). It matches ErrInvalid: a token the issuer
	// signed with that key expired before the key retired (the retire time
	// leaves a token lifetime and the activation delay after the new key
	// took over), so an unexpired one was forged, most likely with the
	// removed node's copy of the key. Verifiers refuse it by their own
	// clock, whether or not SCM's loop has dropped the key yet.
	ErrRetired = fmt.Errorf("%w: signed with a retired key", ErrInvalid)
	// ErrNoKey: the issuer has no active key yet (SCM has not generated
	// one, or this replica has not applied it).
	ErrNoKey = errors.New("no active block token key")
)

// Key is one secret key as SCM records it.
type Key struct {
	ID     uint64
	Secret []byte
	// ActivateUnixMs: signers use the key from then on (verifiers accept
	// it as soon as they hold it).
	ActivateUnixMs int64
	// RetireUnixMs: 0, or the time from which the key neither signs nor
	// verifies (ErrRetired), set by a forced rotation.
	RetireUnixMs int64
}

type keyState struct {
	Key
	pool sync.Pool // of hash.Hash: hmac.New costs more than a token
}

func (k *keyState) mac(msg []byte, dst []byte) []byte {
	h, _ := k.pool.Get().(hash.Hash)
	if h == nil {
		h = hmac.New(sha256.New, k.Secret)
	} else {
		h.Reset()
	}
	h.Write(msg)
	dst = h.Sum(dst)
	k.pool.Put(h)
	return dst
}

// KeySet is an immutable set of keys: it issues tokens with its newest
// active key and verifies tokens signed with any of them. Safe for
// concurrent use.
type KeySet struct {
	keys   map[uint64]*keyState
	byAct  []*keyState // by activation time, newest first
	digest [sha256.Size]byte
}

// NewKeySet validates keys (at most MaxKeys, distinct nonzero IDs,
// SecretSize-byte secrets) and returns their set.
func NewKeySet(keys []Key) (*KeySet, error) {
	if len(keys) > MaxKeys {
		return nil, fmt.Errorf("blocktoken: %d keys, at most %d", len(keys), MaxKeys)
	}
	s := &KeySet{keys: make(map[uint64]*keyState, len(keys))}
	for _, k := range keys {
		if k.ID == 0 {
			return nil, errors.New("blocktoken: key ID 0")
		}
		if len(k.Secret) != SecretSize {
			return nil, fmt.Errorf("blocktoken: key %d has a %d-byte secret, want %d", k.ID, len(k.Secret), SecretSize)
		}
		if s.keys[k.ID] != nil {
			return nil, fmt.Errorf("blocktoken: key %d twice", k.ID)
		}
		ks := &keyState{Key: Key{ID: k.ID, Secret: append([]byte(nil), k.Secret...), ActivateUnixMs: k.ActivateUnixMs, RetireUnixMs: k.RetireUnixMs}}
		s.keys[k.ID] = ks
		s.byAct = append(s.byAct, ks)
	}
	// The digest (SameAs) covers IDs, secrets and retire times in ID order.
	ids := slices.Sorted(maps.Keys(s.keys))
	d := sha256.New()
	for _, id := range ids {
		d.Write(binary.BigEndian.AppendUint64(nil, id))
		d.Write(s.keys[id].Secret)
		d.Write(binary.BigEndian.AppendUint64(nil, uint64(s.keys[id].RetireUnixMs)))
	}
	// Newest activation first; ties by higher ID.
	for i := 1; i < len(s.byAct); i++ {
		for j := i; j > 0 && newer(s.byAct[j], s.byAct[j-1]); j-- {
			s.byAct[j], s.byAct[j-1] = s.byAct[j-1], s.byAct[j]
		}
	}
	d.Sum(s.digest[:0])
	return s, nil
}

func newer(a, b *keyState) bool {
	if a.ActivateUnixMs != b.ActivateUnixMs {
		return a.ActivateUnixMs > b.ActivateUnixMs
	}
	return a.ID > b.ID
}

// Len is the number of keys.
func (s *KeySet) Len() int {
	if s == nil {
		return 0
	}
	return len(s.keys)
}

// Has reports whether the set holds key id.
func (s *KeySet) Has(id uint64) bool { return s != nil && s.keys[id] != nil }

// SameAs reports whether s and o hold the same keys (IDs, secrets and
// retire times).
func (s *KeySet) SameAs(o *KeySet) bool {
	if s == nil || o == nil {
		return s == o
	}
	return s.digest == o.digest
}

// SigningKey returns the ID of the key tokens are signed with at now: the
// newest key whose activation time has come and whose retire time (if
// any) has not: a retired key never signs.
func (s *KeySet) SigningKey(now time.Time) (uint64, bool) {
	if s == nil {
		return 0, false
	}
	ms := now.UnixMilli()
	for _, k := range s.byAct {
		if k.ActivateUnixMs <= ms && !k.retiredAt(ms) {
			return k.ID, true
		}
	}
	return 0, false
}

// Issue returns a token for c, signed with the signing key at now (c.KeyID
// is set to it).
func (s *KeySet) Issue(now time.Time, c Claims) ([]byte, error) {
	id, ok := s.SigningKey(now)
	if !ok {
		return nil, ErrNoKey
	}
	c.KeyID = id
	return s.keys[id].encode(c)
}

// retiredAt reports whether the key is past its retire time at ms.
func (k *keyState) retiredAt(ms int64) bool { return k.RetireUnixMs != 0 && ms >= k.RetireUnixMs }

func (k *keyState) encode(c Claims) ([]byte, error) {
	if len(c.Owner) > MaxOwner {
		return nil, fmt.Errorf("blocktoken: owner of %d bytes, at most %d", len(c.Owner), MaxOwner)
	}
	if c.Modes == 0 || c.Modes&^allModes != 0 {
		return nil, fmt.Errorf("blocktoken: modes %v", c.Modes)
	}
	b := make([]byte, 0, fixedLen+len(c.Owner)+macLen)
	b = append(b, Version, byte(c.Modes), byte(len(c.Owner)), 0)
	b = binary.BigEndian.AppendUint64(b, c.KeyID)
	b = binary.BigEndian.AppendUint64(b, c.Block.Container)
	b = binary.BigEndian.AppendUint64(b, c.Block.Local)
	b = binary.BigEndian.AppendUint64(b, uint64(c.ExpiryUnixMs))
	b = binary.BigEndian.AppendUint64(b, c.Pipeline)
	b = append(b, c.Owner...)
	return k.mac(b, b), nil
}

// Decode parses a token without checking its MAC: for logs and tools. It
// checks every length, so any input is safe to give it.
func Decode(tok []byte) (Claims, error) {
	c, _, err := decode(tok)
	return c, err
}

// decode returns the claims and the length of the signed part.
func decode(tok []byte) (Claims, int, error) {
	if len(tok) == 0 {
		return Claims{}, 0, ErrMissing
	}
	if len(tok) > MaxTokenSize {
		return Claims{}, 0, fmt.Errorf("%w: %d bytes, at most %d", ErrInvalid, len(tok), MaxTokenSize)
	}
	if len(tok) < fixedLen1+macLen {
		return Claims{}, 0, fmt.Errorf("%w: %d bytes, at least %d", ErrInvalid, len(tok), fixedLen1+macLen)
	}
	var fixed int
	switch tok[0] {
	case version1:
		fixed = fixedLen1
	case Version:
		fixed = fixedLen
	default:
		return Claims{}, 0, fmt.Errorf("%w: version %d, want %d or %d", ErrInvalid, tok[0], version1, Version)
	}
	n := int(tok[2])
	if n > MaxOwner || len(tok) != fixed+n+macLen || tok[3] != 0 {
		return Claims{}, 0, fmt.Errorf("%w: %d bytes with an owner of %d (layout damaged)", ErrInvalid, len(tok), n)
	}
	be := binary.BigEndian
	c := Claims{
		Modes:        Mode(tok[1]),
		KeyID:        be.Uint64(tok[4:]),
		Block:        Block{be.Uint64(tok[12:]), be.Uint64(tok[20:])},
		ExpiryUnixMs: int64(be.Uint64(tok[28:])),
		Owner:        string(tok[fixed : fixed+n]),
	}
	if fixed == fixedLen {
		c.Pipeline = be.Uint64(tok[fixedLen1:])
	}
	if c.Modes == 0 || c.Modes&^allModes != 0 {
		return Claims{}, 0, fmt.Errorf("%w: modes %#x", ErrInvalid, uint8(c.Modes))
	}
	return c, fixed + n, nil
}

// Verify checks that tok is genuine (a key of s signed it; the MAC is
// compared in constant time), grants mode on blk, has not expired at now
// (ErrExpired) and its key had not retired at now (ErrRetired; checked
// after the expiry, so an old genuine token reads as expired). It returns
// the token's claims.
func (s *KeySet) Verify(tok []byte, blk Block, mode Mode, now time.Time) (Claims, error) {
	c, signed, err := decode(tok)
	if err != nil {
		return Claims{}, err
	}
	var k *keyState
	if s != nil {
		k = s.keys[c.KeyID]
	}
	if k == nil {
		return Claims{}, fmt.Errorf("%w: signed with key %d, which this datanode does not hold (%d keys)", ErrInvalid, c.KeyID, s.Len())
	}
	var buf [macLen]byte
	if !hmac.Equal(k.mac(tok[:signed], buf[:0]), tok[signed:]) {
		return Claims{}, fmt.Errorf("%w: signature does not match (forged or damaged)", ErrInvalid)
	}
	if c.Block != blk {
		return Claims{}, fmt.Errorf("%w: token is for block %v, request is for %v", ErrInvalid, c.Block, blk)
	}
	if c.Modes&mode != mode {
		return Claims{}, fmt.Errorf("%w: token grants %v on block %v, request needs %v", ErrInvalid, c.Modes, blk, mode)
	}
	ms := now.UnixMilli()
	if ms >= c.ExpiryUnixMs {
		return Claims{}, fmt.Errorf("%w: block %v token expired at %s (%v ago)", ErrExpired, blk,
			time.UnixMilli(c.ExpiryUnixMs).UTC().Format(time.RFC3339), time.Duration(ms-c.ExpiryUnixMs)*time.Millisecond)
	}
	if k.retiredAt(ms) {
		return Claims{}, fmt.Errorf("%w: key %d retired at %s (%v ago); the token claims to live until %s", ErrRetired, k.ID,
			time.UnixMilli(k.RetireUnixMs).UTC().Format(time.RFC3339), time.Duration(ms-k.RetireUnixMs)*time.Millisecond,
			time.UnixMilli(c.ExpiryUnixMs).UTC().Format(time.RFC3339))
	}
	return c, nil
}

// Verifier holds the key set a datanode checks tokens with; SCM replaces
// it at registration and with heartbeats. The zero value holds no keys and
// refuses every token.
type Verifier struct {
	keys atomic.Pointer[KeySet]
}

// Set replaces the keys; it reports whether they changed.
func (v *Verifier) Set(s *KeySet) bool {
	old := v.keys.Swap(s)
	return !old.SameAs(s)
}

// Keys returns the current set (nil if none).
func (v *Verifier) Keys() *KeySet { return v.keys.Load() }

// Verify is Keys().Verify.
func (v *Verifier) Verify(tok []byte, blk Block, mode Mode, now time.Time) (Claims, error) {
	return v.keys.Load().Verify(tok, blk, mode, now)
}
