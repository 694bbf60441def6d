package scm

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Block token keys (package blocktoken). The SCM leader generates them
// and records them through Raft (SecretKeysOp, Pebble rows "k/<id>"), so
// every meta replica holds the same keys and a new leader carries on with
// them: tokens stay valid across a leader change. Datanodes receive the
// whole set at registration and in every heartbeat response.
//
// Rotation without a pause: a new key is recorded ActivationDelay before
// it signs anything (the namespace signs with the newest key whose
// activation time has come, SigningKey), so every datanode heartbeating
// in that window holds it before a token signed with it arrives; a key is
// dropped only TokenLifetime + ActivationDelay after a newer key became
// active, when every token it signed has expired. The cluster's first key
// is active at once: nothing can be waiting for it.
//
// Forced rotation (RotateSecretKeysFor): a removed meta node holds every
// key recorded while it was a replica, and could sign tokens with them.
// Once its removal has committed, the meta server's reconciler
// (members_keyrotate.go) has the SCM leader record a new key at once
// (activation after ActivationDelay, as a scheduled one) and give every
// key already recorded a retire time: the new key's activation +
// TokenLifetime + ActivationDelay, when every token an old key signed
// before the new one took over has expired. The op (ScmCommand
// forced_key_rotation: a top-level op, so that an older binary's replica
// halts at it, applyhalt, instead of applying it as a plain key addition)
// names the members and Apply records them (row "kf/<id>") and refuses
// a second op for any of them, so a member is rotated for once, whichever
// leader proposes it, and a leader that crashed before proposing leaves
// it to the next.

// SecretKeyConfig tunes rotation. Zero values take the defaults noted.
type SecretKeyConfig struct {
	// Rotation: a new key is generated when the newest is this old
	// (default 24h).
	Rotation time.Duration
	// ActivationDelay: a new key signs tokens only this long after it is
	// recorded (default 6 × HeartbeatInterval, at least 10s).
	ActivationDelay time.Duration
	// TokenLifetime: how long a token is valid (default 1h).
	TokenLifetime time.Duration
}

func (m *Manager) keyCfg() SecretKeyConfig {
	c := m.cfg.SecretKeys
	if c.Rotation <= 0 {
		c.Rotation = 24 * time.Hour
	}
	if c.ActivationDelay <= 0 {
		c.ActivationDelay = max(6*m.cfg.HeartbeatInterval, 10*time.Second)
	}
	if c.TokenLifetime <= 0 {
		c.TokenLifetime = time.Hour
	}
	return c
}

var (
	pfxSecretKey = []byte("k/")
	// pfxKeysRotatedFor: "kf/<member ID>" → the forced rotation's new
	// key ID (8 bytes), one row per removed meta node rotated for.
	pfxKeysRotatedFor = []byte("kf/")
)

// MaxForcedRotations bounds the members recorded as rotated for (one
// row per removed meta node, ever): beyond it a forced rotation is
// refused (ResourceExhausted).
const MaxForcedRotations = 4096

// secretKeys is State's mirror of the key rows.
type secretKeys struct {
	rows []*metapb.SecretKey               // by ID; replaced, never changed in place
	set  atomic.Pointer[blocktoken.KeySet] // the same keys, for issuing without a lock
	// rotatedFor: removed meta node → the key its forced rotation added.
	rotatedFor map[uint64]uint64
}

// loadSecretKeys reads the key rows (caller holds mu for writing).
func (s *State) loadSecretKeys(r pebble.Reader) error {
	s.keys.rows = nil
	s.keys.rotatedFor = map[uint64]uint64{}
	if err := store.Scan(r, pfxSecretKey, func(_, v []byte) error {
		k := &metapb.SecretKey{}
		if err := proto.Unmarshal(v, k); err != nil {
			return err
		}
		s.keys.rows = append(s.keys.rows, k)
		return nil
	}); err != nil {
		return err
	}
	if err := store.Scan(r, pfxKeysRotatedFor, func(k, v []byte) error {
		if len(k) != len(pfxKeysRotatedFor)+8 || len(v) != 8 {
			return fmt.Errorf("scm: bad forced rotation row %q", k)
		}
		s.keys.rotatedFor[binary.BigEndian.Uint64(k[len(pfxKeysRotatedFor):])] = binary.BigEndian.Uint64(v)
		return nil
	}); err != nil {
		return err
	}
	return s.rebuildKeySet()
}

func (s *State) rebuildKeySet() error {
	ks, err := blocktoken.NewKeySet(keysOf(s.keys.rows))
	if err != nil {
		return fmt.Errorf("scm: block token keys: %w", err)
	}
	s.keys.set.Store(ks)
	return nil
}

func keysOf(rows []*metapb.SecretKey) []blocktoken.Key {
	out := make([]blocktoken.Key, len(rows))
	for i, k := range rows {
		out[i] = blocktoken.Key{ID: k.Id, Secret: k.Secret, ActivateUnixMs: k.ActivateUnixMs, RetireUnixMs: k.RetireUnixMs}
	}
	return out
}

// applySecretKeys removes, then adds (caller holds mu for writing). An
// invalid addition is refused whole; removals of unknown keys are no-ops.
func (s *State) applySecretKeys(b *pebble.Batch, op *metapb.SecretKeysOp) any {
	return s.applyKeyChange(b, op.GetAdd(), op.GetRemove(), nil)
}

// applyForcedKeyRotation applies a forced rotation (ScmCommand
// forced_key_rotation, see the top of this file): refused whole unless
// CheckForced accepts it.
func (s *State) applyForcedKeyRotation(b *pebble.Batch, op *metapb.ForcedKeyRotationOp) any {
	if err := checkForced("scm", op.GetMembers(), op.GetAdd() != nil, op.GetRetireUnixMs(), s.keys.rotatedFor, MaxForcedRotations); err != nil {
		return err
	}
	return s.applyKeyChange(b, op.GetAdd(), nil, op)
}

// applyKeyChange adds add, removes remove and, for a forced rotation
// (forced non-nil, checked), retires the other keys and records its
// members.
func (s *State) applyKeyChange(b *pebble.Batch, add *metapb.SecretKey, remove []uint64, forced *metapb.ForcedKeyRotationOp) any {
	rows := slices.Clone(s.keys.rows)
	for _, id := range remove {
		rows = slices.DeleteFunc(rows, func(k *metapb.SecretKey) bool { return k.Id == id })
	}
	if a := add; a != nil {
		switch {
		case a.Id == 0 || len(a.Secret) != blocktoken.SecretSize:
			return status.Errorf(codes.InvalidArgument, "scm: secret key %d with a %d-byte secret", a.Id, len(a.Secret))
		case slices.ContainsFunc(rows, func(k *metapb.SecretKey) bool { return k.Id == a.Id }):
			return status.Errorf(codes.AlreadyExists, "scm: secret key %d exists", a.Id)
		case len(rows) >= blocktoken.MaxKeys:
			return status.Errorf(codes.ResourceExhausted, "scm: %d secret keys already", len(rows))
		}
		rows = append(rows, proto.Clone(a).(*metapb.SecretKey))
		slices.SortFunc(rows, func(x, y *metapb.SecretKey) int { return cmpU64(x.Id, y.Id) })
	}
	if forced != nil {
		for _, k := range RetireForced(rows, add.GetId(), forced.RetireUnixMs) {
			s.put(b, key(pfxSecretKey, k.Id), k)
		}
		for _, id := range forced.GetMembers() {
			if err := b.Set(key(pfxKeysRotatedFor, id), binary.BigEndian.AppendUint64(nil, add.GetId()), nil); err != nil {
				panic(err)
			}
			s.keys.rotatedFor[id] = add.GetId()
		}
	}
	for _, id := range remove {
		if err := b.Delete(key(pfxSecretKey, id), nil); err != nil {
			panic(err)
		}
	}
	if add != nil {
		a := add
		s.put(b, key(pfxSecretKey, a.Id), a)
	}
	s.keys.rows = rows
	if err := s.rebuildKeySet(); err != nil {
		panic(err) // validated above
	}
	return nil
}

// RetireForced gives every key of keys but the new one (keep) the forced
// rotation's retire time, unless it retires earlier already: any of them
// may be known to the removed nodes. The changed keys are copies, put in
// keys in place of the old ones and returned, for the caller to record.
// Shared with the user-token state.
func RetireForced(keys []*metapb.SecretKey, keep uint64, retireMs int64) (changed []*metapb.SecretKey) {
	for i, k := range keys {
		if k.Id == keep || (k.RetireUnixMs != 0 && k.RetireUnixMs <= retireMs) {
			continue
		}
		k = proto.Clone(k).(*metapb.SecretKey)
		k.RetireUnixMs = retireMs
		keys[i] = k
		changed = append(changed, k)
	}
	return changed
}

// CheckForced validates a forced rotation's members (what, the group's
// name for the messages; done, the members rotated for already; limit,
// the most it may hold): at least one, none 0 or repeated, none done already (that is
// AlreadyExists: another leader's op came first), room for them all, and
// a new key and a retire time. Shared with the user-token state.
func CheckForced(what string, members []uint64, hasKey bool, retireMs int64, done map[uint64]uint64, limit int) error {
	return checkForced(what, members, hasKey, retireMs, done, limit)
}

func checkForced(what string, members []uint64, hasKey bool, retireMs int64, done map[uint64]uint64, limit int) error {
	if len(members) == 0 || !hasKey || retireMs <= 0 {
		return status.Errorf(codes.InvalidArgument, "%s: a forced rotation for meta nodes %v without members, a new key or a retire time", what, members)
	}
	if len(members) > limit-len(done) {
		return status.Errorf(codes.ResourceExhausted, "%s: %d forced rotations recorded already, %d more asked for (at most %d)", what, len(done), len(members), limit)
	}
	for i, id := range members {
		if id == 0 || slices.Contains(members[:i], id) {
			return status.Errorf(codes.InvalidArgument, "%s: a forced rotation for meta nodes %v (0 or repeated)", what, members)
		}
		if _, ok := done[id]; ok {
			return status.Errorf(codes.AlreadyExists, "%s: the keys were rotated for removed meta node %d already", what, id)
		}
	}
	return nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// SecretKeys returns the recorded keys, by ID (shared: do not modify).
func (s *State) SecretKeys() []*metapb.SecretKey {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.keys.rows
}

// KeysRotatedFor reports whether the block token keys were rotated for
// removed meta node id (a forced rotation is recorded).
func (s *State) KeysRotatedFor(id uint64) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	_, ok := s.keys.rotatedFor[id]
	return ok
}

// TokenKeys returns the keys as a set for issuing and verifying tokens.
func (s *State) TokenKeys() *blocktoken.KeySet { return s.keys.set.Load() }

// rotateSecretKeys records a new key when the newest is older than
// Rotation (or there is none) and drops keys whose tokens have all
// expired. Leader only (Tick).
func (m *Manager) rotateSecretKeys(ctx context.Context) error {
	m.keyMu.Lock()
	defer m.keyMu.Unlock()
	kc := m.keyCfg()
	now := m.cfg.Now()
	rows := m.st.SecretKeys()
	op := &metapb.SecretKeysOp{}
	var maxID uint64
	var newest *metapb.SecretKey
	for _, k := range rows {
		maxID = max(maxID, k.Id)
		if newest == nil || k.CreatedUnixMs > newest.CreatedUnixMs {
			newest = k
		}
	}
	if newest == nil || now.Sub(time.UnixMilli(newest.CreatedUnixMs)) >= kc.Rotation {
		secret := make([]byte, blocktoken.SecretSize)
		if _, err := rand.Read(secret); err != nil {
			return err
		}
		activate := now.Add(kc.ActivationDelay)
		if newest == nil {
			activate = now // the first key: no datanode waits for it
		}
		op.Add = &metapb.SecretKey{Id: maxID + 1, Secret: secret, CreatedUnixMs: now.UnixMilli(), ActivateUnixMs: activate.UnixMilli()}
	}
	// A key is done once a newer key has been signing for longer than a
	// token lives (plus the activation delay, for clocks that disagree).
	retire := now.Add(-kc.TokenLifetime - kc.ActivationDelay).UnixMilli()
	for _, k := range rows {
		if k.RetireUnixMs != 0 && k.RetireUnixMs <= now.UnixMilli() {
			op.Remove = append(op.Remove, k.Id) // a forced rotation's retire time
			continue
		}
		for _, j := range rows {
			if j.ActivateUnixMs > k.ActivateUnixMs && j.ActivateUnixMs <= retire {
				op.Remove = append(op.Remove, k.Id)
				break
			}
		}
	}
	if op.Add == nil && len(op.Remove) == 0 {
		return nil
	}
	if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_SecretKeys{SecretKeys: op}}); err != nil {
		return fmt.Errorf("scm: rotating block token keys: %w", err)
	}
	if op.Add != nil {
		m.log.Info("scm: block token key recorded", "key", op.Add.Id, "activates", time.UnixMilli(op.Add.ActivateUnixMs).UTC(), "dropped", op.Remove)
	}
	return nil
}

// RotateSecretKeysFor records, on the SCM leader, a new block token key
// because the meta nodes members were removed, and retires every key
// recorded before it at the new key's activation + TokenLifetime +
// ActivationDelay (see the top of this file). Members already rotated
// for are left out (nothing if none is left); an AlreadyExists from
// Apply (another leader's op came first) is retried by the caller's next
// round with what is left.
func (m *Manager) RotateSecretKeysFor(ctx context.Context, members []uint64) error {
	m.keyMu.Lock()
	defer m.keyMu.Unlock()
	var todo []uint64
	for _, id := range members {
		if id != 0 && !slices.Contains(todo, id) && !m.st.KeysRotatedFor(id) {
			todo = append(todo, id)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	kc := m.keyCfg()
	now := m.cfg.Now()
	var maxID uint64
	for _, k := range m.st.SecretKeys() {
		maxID = max(maxID, k.Id)
	}
	secret := make([]byte, blocktoken.SecretSize)
	if _, err := rand.Read(secret); err != nil {
		return err
	}
	activate := now.Add(kc.ActivationDelay)
	op := &metapb.ForcedKeyRotationOp{
		Add:          &metapb.SecretKey{Id: maxID + 1, Secret: secret, CreatedUnixMs: now.UnixMilli(), ActivateUnixMs: activate.UnixMilli()},
		Members:      todo,
		RetireUnixMs: activate.Add(kc.TokenLifetime + kc.ActivationDelay).UnixMilli(),
	}
	v, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ForcedKeyRotation{ForcedKeyRotation: op}})
	if e, ok := v.(error); ok && err == nil {
		err = e // Apply refused it
	}
	if err != nil {
		return fmt.Errorf("scm: rotating block token keys for removed meta nodes %v: %w", todo, err)
	}
	m.log.Info("scm: block token keys rotated for removed meta nodes", "members", todo, "key", op.Add.Id,
		"activates", activate.UTC(), "old keys retire", time.UnixMilli(op.RetireUnixMs).UTC())
	return nil
}

// containerToken is the token of a ReplicateContainer command: read on
// the whole container (local ID 0), for the sources' ExportContainer. nil
// if no key is active (the copy is refused and the command sent again).
func (m *Manager) containerToken(cid uint64) []byte {
	now := m.cfg.Now()
	tok, err := m.st.TokenKeys().Issue(now, blocktoken.Claims{Block: blocktoken.Block{Container: cid}, Modes: blocktoken.Read,
		ExpiryUnixMs: now.Add(m.keyCfg().TokenLifetime).UnixMilli()})
	if err != nil {
		m.log.Warn("scm: no token for a container copy", "container", cid, "err", err)
	}
	return tok
}

// issueWait bounds how long IssueToken waits for this replica to apply
// the cluster's first key (it is recorded before any pipeline exists, so
// only a replica that lags behind at start-up waits at all).
const issueWait = 3 * time.Second

// IssueToken returns a block token granting modes on id, signed with the
// local replica's signing key and valid for TokenLifetime. The namespace
// calls it for every block location it returns.
func (m *Manager) IssueToken(ctx context.Context, id *metapb.BlockID, modes blocktoken.Mode, owner string) ([]byte, error) {
	return m.IssuePipelineToken(ctx, id, 0, modes, owner)
}

// IssuePipelineToken is IssueToken for a token that names pipeline (the
// one the block's container was allocated to): a write token needs one,
// and datanodes take its writes through that pipeline only.
func (m *Manager) IssuePipelineToken(ctx context.Context, id *metapb.BlockID, pipeline uint64, modes blocktoken.Mode, owner string) ([]byte, error) {
	now := m.cfg.Now()
	c := blocktoken.Claims{Block: blocktoken.Block{Container: id.GetContainerId(), Local: id.GetLocalId()}, Modes: modes,
		ExpiryUnixMs: now.Add(m.keyCfg().TokenLifetime).UnixMilli(), Owner: owner, Pipeline: pipeline}
	tok, err := m.st.TokenKeys().Issue(now, c)
	if !errors.Is(err, blocktoken.ErrNoKey) {
		return tok, err
	}
	deadline := time.Now().Add(issueWait)
	for time.Now().Before(deadline) {
		t := time.NewTimer(20 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
		if tok, err = m.st.TokenKeys().Issue(m.cfg.Now(), c); !errors.Is(err, blocktoken.ErrNoKey) {
			return tok, err
		}
	}
	return nil, status.Errorf(codes.Unavailable, "no block token key is active yet (SCM is starting); retry")
}
