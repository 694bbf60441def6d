package meta

import (
	"container/heap"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// utState is the state machine of the user-token Raft group (ID 3; see
// usertoken.go): the user-token keys, the next sequence number, the
// nonces of recent GetUserToken requests, and the renewed and cancelled
// tokens. Every record that expires is dropped by the first Apply whose
// (monotonic) time is past it, so the state stays as small as the tokens
// alive; an expiry-ordered heap finds them, so an Apply costs what it
// drops, not what is kept. Apply never reads a clock.
type utState struct {
	st *store.Store

	mu        sync.RWMutex
	keys      []*metapb.SecretKey  // by ID; replaced, never changed in place
	next      uint64               // next sequence number
	now       int64                // the latest command time applied (unix ms)
	nonces    map[[32]byte]utNonce // nonce ID → until and access key
	perKey    map[string]int       // access key → nonces held
	renewed   map[uint64]*metapb.UserTokenRecord
	cancelled map[uint64]*metapb.UserTokenRecord
	expiries  utExpiries // when each nonce and record may go
	// rotatedFor: removed meta node → the key its forced rotation added
	// (row "f/<id>"; members_keyrotate.go).
	rotatedFor map[uint64]uint64

	halt *applyhalt.Group // the apply halt (applyhalt)
}

// utNonce is a recorded GetUserToken nonce.
type utNonce struct {
	until int64
	key   string // the access key it counts against
}

// utExpiry: the nonce (kind utExpNonce) or record that may be dropped
// once the state's clock passes at. Entries outlive what they name
// (a renewal dropped by a cancellation): prune checks before dropping.
type utExpiry struct {
	at    int64
	kind  uint8
	nonce [32]byte
	seq   uint64
}

const (
	utExpNonce uint8 = iota
	utExpRenewed
	utExpCancelled
)

// utExpiries is a min-heap by at (container/heap).
type utExpiries []utExpiry

func (h utExpiries) Len() int           { return len(h) }
func (h utExpiries) Less(i, j int) bool { return h[i].at < h[j].at }
func (h utExpiries) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *utExpiries) Push(x any)        { *h = append(*h, x.(utExpiry)) }
func (h *utExpiries) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// Row keys of the user-token store.
var (
	utKeyNext      = []byte("s")
	utKeyNow       = []byte("t")
	utPfxKey       = []byte("k/")
	utPfxNonce     = []byte("n/")
	utPfxRenewed   = []byte("r/")
	utPfxCancelled = []byte("c/")
	utPfxRotated   = []byte("f/")
)

// Bounds on the records (Apply refuses beyond them): enough for a large
// cluster's users, small enough to keep in memory on every meta node.
const (
	utMaxNonces = 200_000
	// utMaxNoncesPerKey: one access key's share (its requests of the last
	// ~20 minutes), so that one key holder cannot use up utMaxNonces.
	utMaxNoncesPerKey = 5_000
	utMaxRecords      = 1_000_000
	utMaxKeys         = 64
	utSecretSize      = 32
	// utMaxForcedRotations bounds the removed meta nodes recorded as
	// rotated for (one row each, ever).
	utMaxForcedRotations = 4096
)

func utRow(pfx []byte, id uint64) []byte {
	return append(append([]byte(nil), pfx...), store.U64(id)...)
}

// openUTState opens the user-token state in dir; hidden are
// UserTokenCommand ops it treats as unknown (tests: an older binary;
// applyhalt).
func openUTState(dir string, opts store.Options, hidden ...int32) (*utState, error) {
	st, err := store.Open(dir, opts)
	if err != nil {
		return nil, err
	}
	s := &utState{st: st, halt: applyhalt.New("usertoken", st, &metapb.UserTokenCommand{}, hidden)}
	if err := s.halt.Load(); err != nil {
		st.Close()
		return nil, err
	}
	if err := s.load(); err != nil {
		st.Close()
		return nil, err
	}
	return s, nil
}

func (s *utState) load() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loadLocked()
}

// loadLocked is load with s.mu held.
func (s *utState) loadLocked() error {
	s.keys, s.next, s.now = nil, 1, 0
	s.nonces = map[[32]byte]utNonce{}
	s.perKey = map[string]int{}
	s.expiries = nil
	s.renewed = map[uint64]*metapb.UserTokenRecord{}
	s.cancelled = map[uint64]*metapb.UserTokenRecord{}
	s.rotatedFor = map[uint64]uint64{}
	return s.st.View(func(r pebble.Reader) error {
		for _, c := range []struct {
			k   []byte
			dst *uint64
		}{{utKeyNext, &s.next}, {utKeyNow, (*uint64)(nil)}} {
			v, closer, err := r.Get(c.k)
			if errors.Is(err, pebble.ErrNotFound) {
				continue
			}
			if err != nil {
				return err
			}
			if len(v) != 8 {
				closer.Close()
				return fmt.Errorf("usertoken: row %q of %d bytes", c.k, len(v))
			}
			x := binary.BigEndian.Uint64(v)
			closer.Close()
			if c.dst != nil {
				*c.dst = x
			} else {
				s.now = int64(x)
			}
		}
		if err := store.Scan(r, utPfxKey, func(_, v []byte) error {
			k := &metapb.SecretKey{}
			if err := proto.Unmarshal(v, k); err != nil {
				return err
			}
			s.keys = append(s.keys, k)
			return nil
		}); err != nil {
			return err
		}
		if err := store.Scan(r, utPfxRotated, func(k, v []byte) error {
			if len(k) != len(utPfxRotated)+8 || len(v) != 8 {
				return fmt.Errorf("usertoken: bad forced rotation row")
			}
			s.rotatedFor[binary.BigEndian.Uint64(k[len(utPfxRotated):])] = binary.BigEndian.Uint64(v)
			return nil
		}); err != nil {
			return err
		}
		if err := store.Scan(r, utPfxNonce, func(k, v []byte) error {
			if len(k) != len(utPfxNonce)+32 || len(v) < 8 {
				return fmt.Errorf("usertoken: bad nonce row")
			}
			n := utNonce{until: int64(binary.BigEndian.Uint64(v)), key: string(v[8:])}
			id := [32]byte(k[len(utPfxNonce):])
			s.nonces[id] = n
			s.perKey[n.key]++
			s.expiries = append(s.expiries, utExpiry{at: n.until + utPruneGraceMs, kind: utExpNonce, nonce: id})
			return nil
		}); err != nil {
			return err
		}
		for _, t := range []struct {
			pfx  []byte
			m    map[uint64]*metapb.UserTokenRecord
			kind uint8
		}{{utPfxRenewed, s.renewed, utExpRenewed}, {utPfxCancelled, s.cancelled, utExpCancelled}} {
			if err := store.Scan(r, t.pfx, func(k, v []byte) error {
				rec := &metapb.UserTokenRecord{}
				if len(k) != len(t.pfx)+8 {
					return fmt.Errorf("usertoken: bad record row")
				}
				if err := proto.Unmarshal(v, rec); err != nil {
					return err
				}
				seq := binary.BigEndian.Uint64(k[len(t.pfx):])
				t.m[seq] = rec
				s.expiries = append(s.expiries, utExpiry{at: rec.MaxUnixMs + utPruneGraceMs, kind: t.kind, seq: seq})
				return nil
			}); err != nil {
				return err
			}
		}
		heap.Init(&s.expiries)
		return nil
	})
}

func (s *utState) Close() error                             { return s.st.Close() }
func (s *utState) AppliedIndex() uint64                     { return s.st.DurableIndex() }
func (s *utState) Snapshot() (uint64, io.ReadCloser, error) { return s.st.Snapshot() }

func (s *utState) Restore(index uint64, r io.Reader) error {
	if err := s.halt.CheckRestore(); err != nil {
		return err
	}
	if err := s.st.Restore(index, r); err != nil {
		return err
	}
	if err := s.halt.Drop(); err != nil { // the sender's row, if any (applyhalt.Key)
		return err
	}
	return s.load()
}

// Apply applies entries in one batch; a result is the sequence number
// (issue), nil, or a status error.
func (s *utState) Apply(entries []store.Entry) []any {
	// One batch under s.mu; the halt rule and the apply guard of
	// applyhalt; a failed commit panics (the mirror would be ahead of the
	// disk: replay the log on restart).
	return applyhalt.ApplyMirrored(s.halt, entries, &s.mu, func() *metapb.UserTokenCommand { return &metapb.UserTokenCommand{} }, s.apply, s.loadLocked)
}

func (s *utState) set(b *pebble.Batch, k []byte, v []byte) {
	if err := b.Set(k, v, nil); err != nil {
		panic(err)
	}
}

func (s *utState) del(b *pebble.Batch, k []byte) {
	if err := b.Delete(k, nil); err != nil {
		panic(err)
	}
}

func (s *utState) setRecord(b *pebble.Batch, k []byte, rec *metapb.UserTokenRecord) {
	v, err := proto.Marshal(rec)
	if err != nil {
		panic(err)
	}
	s.set(b, k, v)
}

// utPruneGraceMs: nonces and renewal/cancellation records are kept this
// long past their expiry. The state's clock is the latest proposer's,
// while each node verifies with its own: a node whose clock is behind
// must still find a cancellation (or a replay's nonce) until it too sees
// the expiry pass. Clocks further apart than this are a misconfiguration
// (GetUserToken already refuses requests more than Skew off).
const utPruneGraceMs = 10 * 60 * 1000

// prune advances the state's clock to now (never back: leaders' clocks
// differ) and drops what expired by then (with utPruneGraceMs to spare).
func (s *utState) prune(b *pebble.Batch, now int64) {
	if now <= s.now {
		return
	}
	s.now = now
	s.set(b, utKeyNow, store.U64(uint64(now)))
	for len(s.expiries) > 0 && s.expiries[0].at < now {
		e := heap.Pop(&s.expiries).(utExpiry)
		switch e.kind {
		case utExpNonce:
			if n, ok := s.nonces[e.nonce]; ok && n.until+utPruneGraceMs == e.at {
				delete(s.nonces, e.nonce)
				if s.perKey[n.key]--; s.perKey[n.key] <= 0 {
					delete(s.perKey, n.key)
				}
				s.del(b, append(slices.Clone(utPfxNonce), e.nonce[:]...))
			}
		case utExpRenewed, utExpCancelled:
			m, pfx := s.renewed, utPfxRenewed
			if e.kind == utExpCancelled {
				m, pfx = s.cancelled, utPfxCancelled
			}
			if rec, ok := m[e.seq]; ok && rec.MaxUnixMs+utPruneGraceMs == e.at {
				delete(m, e.seq)
				s.del(b, utRow(pfx, e.seq))
			}
		}
	}
}

func (s *utState) apply(b *pebble.Batch, cmd *metapb.UserTokenCommand) any {
	s.prune(b, cmd.NowUnixMs)
	switch op := cmd.Op.(type) {
	case *metapb.UserTokenCommand_Issue:
		if id := op.Issue.GetNonceId(); len(id) > 0 {
			if len(id) != 32 {
				return status.Errorf(codes.InvalidArgument, "usertoken: nonce ID of %d bytes", len(id))
			}
			if _, seen := s.nonces[[32]byte(id)]; seen {
				return status.Error(codes.Unauthenticated, "usertoken: this request was seen before (a replayed signature): sign each request with a new nonce")
			}
			ak := op.Issue.GetAccessKeyId()
			if len(ak) > 255 {
				return status.Errorf(codes.InvalidArgument, "usertoken: access key of %d bytes", len(ak))
			}
			if n := s.perKey[ak]; n >= utMaxNoncesPerKey {
				return status.Errorf(codes.ResourceExhausted, "usertoken: access key %s made %d token requests in the last minutes; retry later", clip(ak), n)
			}
			if len(s.nonces) >= utMaxNonces {
				return status.Errorf(codes.ResourceExhausted, "usertoken: %d token requests in the last minutes; retry later", len(s.nonces))
			}
			n := utNonce{until: op.Issue.NonceUntilUnixMs, key: ak}
			s.nonces[[32]byte(id)] = n
			s.perKey[ak]++
			heap.Push(&s.expiries, utExpiry{at: n.until + utPruneGraceMs, kind: utExpNonce, nonce: [32]byte(id)})
			s.set(b, append(slices.Clone(utPfxNonce), id...), append(store.U64(uint64(n.until)), ak...))
		}
		seq := s.next
		s.next++
		s.set(b, utKeyNext, store.U64(s.next))
		return seq
	case *metapb.UserTokenCommand_Renew:
		r := op.Renew
		if _, ok := s.cancelled[r.Sequence]; ok {
			return status.Errorf(codes.PermissionDenied, "usertoken: token %d was cancelled", r.Sequence)
		}
		if len(s.renewed) >= utMaxRecords {
			return status.Errorf(codes.ResourceExhausted, "usertoken: %d renewed tokens recorded", len(s.renewed))
		}
		if old := s.renewed[r.Sequence]; old != nil && old.ExpiryUnixMs >= r.ExpiryUnixMs {
			return nil // a later renewal is recorded already
		}
		rec := &metapb.UserTokenRecord{ExpiryUnixMs: r.ExpiryUnixMs, MaxUnixMs: r.MaxUnixMs}
		if old := s.renewed[r.Sequence]; old == nil || old.MaxUnixMs != rec.MaxUnixMs {
			heap.Push(&s.expiries, utExpiry{at: rec.MaxUnixMs + utPruneGraceMs, kind: utExpRenewed, seq: r.Sequence})
		}
		s.renewed[r.Sequence] = rec
		s.setRecord(b, utRow(utPfxRenewed, r.Sequence), rec)
		return nil
	case *metapb.UserTokenCommand_Cancel:
		c := op.Cancel
		if _, ok := s.cancelled[c.Sequence]; ok {
			return nil
		}
		if len(s.cancelled) >= utMaxRecords {
			return status.Errorf(codes.ResourceExhausted, "usertoken: %d cancelled tokens recorded", len(s.cancelled))
		}
		rec := &metapb.UserTokenRecord{MaxUnixMs: c.MaxUnixMs}
		s.cancelled[c.Sequence] = rec
		heap.Push(&s.expiries, utExpiry{at: rec.MaxUnixMs + utPruneGraceMs, kind: utExpCancelled, seq: c.Sequence})
		s.setRecord(b, utRow(utPfxCancelled, c.Sequence), rec)
		if _, ok := s.renewed[c.Sequence]; ok {
			delete(s.renewed, c.Sequence)
			s.del(b, utRow(utPfxRenewed, c.Sequence))
		}
		return nil
	case *metapb.UserTokenCommand_Keys:
		return s.applyKeys(b, op.Keys)
	case *metapb.UserTokenCommand_ForcedKeyRotation:
		return s.applyForcedKeyRotation(b, op.ForcedKeyRotation)
	}
	return status.Errorf(codes.InvalidArgument, "usertoken: unknown command %T", cmd.Op)
}

func (s *utState) applyKeys(b *pebble.Batch, op *metapb.UserTokenKeysOp) any {
	return s.applyKeyChange(b, op.GetAdd(), op.GetRemove(), nil)
}

// applyForcedKeyRotation applies a forced rotation (UserTokenCommand
// forced_key_rotation; members_keyrotate.go): refused whole unless
// scm.CheckForced accepts it.
func (s *utState) applyForcedKeyRotation(b *pebble.Batch, op *metapb.ForcedKeyRotationOp) any {
	if err := scm.CheckForced("usertoken", op.GetMembers(), op.GetAdd() != nil, op.GetRetireUnixMs(), s.rotatedFor, utMaxForcedRotations); err != nil {
		return err
	}
	return s.applyKeyChange(b, op.GetAdd(), nil, op)
}

// applyKeyChange adds add, removes remove and, for a forced rotation
// (forced non-nil, checked), retires the other keys and records its
// members.
func (s *utState) applyKeyChange(b *pebble.Batch, add *metapb.SecretKey, remove []uint64, forced *metapb.ForcedKeyRotationOp) any {
	keys := slices.Clone(s.keys)
	for _, id := range remove {
		keys = slices.DeleteFunc(keys, func(k *metapb.SecretKey) bool { return k.Id == id })
	}
	if a := add; a != nil {
		switch {
		case a.Id == 0 || len(a.Secret) != utSecretSize:
			return status.Errorf(codes.InvalidArgument, "usertoken: key %d with a %d-byte secret", a.Id, len(a.Secret))
		case slices.ContainsFunc(keys, func(k *metapb.SecretKey) bool { return k.Id == a.Id }):
			return status.Errorf(codes.AlreadyExists, "usertoken: key %d exists", a.Id)
		case len(keys) >= utMaxKeys:
			return status.Errorf(codes.ResourceExhausted, "usertoken: %d keys already", len(keys))
		}
		keys = append(keys, proto.Clone(a).(*metapb.SecretKey))
		slices.SortFunc(keys, func(x, y *metapb.SecretKey) int { return cmpUint(x.Id, y.Id) })
	}
	if forced != nil {
		for _, k := range scm.RetireForced(keys, add.GetId(), forced.RetireUnixMs) {
			v, err := proto.Marshal(k)
			if err != nil {
				panic(err)
			}
			s.set(b, utRow(utPfxKey, k.Id), v)
		}
		for _, id := range forced.GetMembers() {
			s.set(b, utRow(utPfxRotated, id), store.U64(add.GetId()))
			s.rotatedFor[id] = add.GetId()
		}
	}
	for _, id := range remove {
		s.del(b, utRow(utPfxKey, id))
	}
	if a := add; a != nil {
		v, err := proto.Marshal(a)
		if err != nil {
			panic(err)
		}
		s.set(b, utRow(utPfxKey, a.Id), v)
	}
	s.keys = keys
	return nil
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Keys returns the recorded keys, by ID (shared: do not modify).
func (s *utState) Keys() []*metapb.SecretKey {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.keys
}

// keysRotatedFor reports whether the user-token keys were rotated for
// removed meta node id.
func (s *utState) keysRotatedFor(id uint64) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	_, ok := s.rotatedFor[id]
	return ok
}

// keyRetire is key id's forced retire time (0: none, or not recorded).
func (s *utState) keyRetire(id uint64) int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, k := range s.keys {
		if k.Id == id {
			return k.RetireUnixMs
		}
	}
	return 0
}

// key returns key id's secret, nil if it is not recorded.
func (s *utState) key(id uint64) []byte {
	secret, _ := s.keyFor(id)
	return secret
}

// keyFor returns key id's secret (nil if it is not recorded) and its
// forced retire time (0: none), for the verification.
func (s *utState) keyFor(id uint64) (secret []byte, retireUnixMs int64) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, k := range s.keys {
		if k.Id == id {
			return k.Secret, k.RetireUnixMs
		}
	}
	return nil, 0
}

// signingKey is the newest key active at now (unix ms).
func (s *utState) signingKey(now int64) *metapb.SecretKey {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var best *metapb.SecretKey
	for _, k := range s.keys {
		if k.ActivateUnixMs <= now && (best == nil || k.ActivateUnixMs > best.ActivateUnixMs ||
			(k.ActivateUnixMs == best.ActivateUnixMs && k.Id > best.Id)) {
			best = k
		}
	}
	return best
}

// status returns whether token seq is cancelled and its renewed expiry
// (0: never renewed).
func (s *utState) status(seq uint64) (cancelled bool, renewedUntil int64) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	_, cancelled = s.cancelled[seq]
	if r := s.renewed[seq]; r != nil {
		renewedUntil = r.ExpiryUnixMs
	}
	return cancelled, renewedUntil
}
