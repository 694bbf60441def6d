package meta

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/pki"
)

// CaGroup is the Raft group of the cluster CA: the CA certificate and key,
// bootstrap tokens, the certificates issued and the revoked serials. Its
// own group (not the namespace's or SCM's) so that its state and its
// snapshots stay small and its commands change nothing else.
const CaGroup uint64 = 3

// Keys of the CA state.
var (
	caKeyCA      = []byte("ca")
	caKeyVersion = []byte("rv") // revocation version
	caPfxToken   = []byte("t/")
	caPfxIssued  = []byte("i/")
	caPfxRevoked = []byte("r/")
)

// Limits of the CA state (every command comes through an authenticated
// RPC, but the state must stay bounded anyway).
const (
	maxOpenTokens   = 10000
	tokenKeepUsedMs = 24 * 3600 * 1000 // used or expired tokens are kept a day, then dropped
)

// maxRevocations bounds the revoked serials (a variable for tests).
var maxRevocations = 100000

// caState is the CA group's state machine over its own Pebble store.
type caState struct {
	st   *store.Store
	seal []byte // AES-256 key sealing the CA key (nil: stored in the clear)
	log  *slog.Logger

	ca      atomic.Pointer[caLoaded]
	revoked atomic.Pointer[revocations]
	// onRevoked is called (on the apply goroutine) with every new
	// revocation list.
	onRevoked func([]string)
	// batchRevoked: serials revoked by the Apply call in progress (not
	// yet in revoked).
	batchRevoked int
	// halt: the apply halt (applyhalt).
	halt *applyhalt.Group
	// While halted, the TLS set (onRevoked) takes the revocations this
	// replica does not apply too: those of the committed entries past
	// the halt (scanned, not applied: scanPastHalt) and the list pulled
	// from another replica (setPulled; for ops this binary does not
	// know). pastMu guards them and serializes onRevoked.
	pastMu     sync.Mutex
	pastHalt   map[string]bool     // serials revoked past the halt
	pastIssued map[string][]string // identity → serials issued past the halt
	pastN      int                 // serials in pastIssued
	pulled     []string
}

// caLoaded is the recorded CA, parsed. ca is nil if its key is sealed and
// this node lacks the sealing secret (it cannot issue; others can).
type caLoaded struct {
	certDER []byte
	ca      *pki.CA
	err     error // why ca is nil
}

type revocations struct {
	serials []string
	version uint64
}

// openCaState opens the CA state in dir; hidden are CaCommand ops it
// treats as unknown (tests: an older binary; applyhalt).
func openCaState(dir string, opts store.Options, seal []byte, log *slog.Logger, hidden ...int32) (*caState, error) {
	st, err := store.Open(dir, opts)
	if err != nil {
		return nil, err
	}
	s := &caState{st: st, seal: seal, log: log, halt: applyhalt.New("CA", st, &metapb.CaCommand{}, hidden)}
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

// load rebuilds the in-memory views from the store.
func (s *caState) load() error {
	var rec *metapb.CaInitOp
	rev := &revocations{}
	err := s.st.View(func(r pebble.Reader) error {
		v, closer, err := r.Get(caKeyCA)
		if err == nil {
			rec = &metapb.CaInitOp{}
			err = proto.Unmarshal(v, rec)
			closer.Close()
			if err != nil {
				return err
			}
		} else if !errors.Is(err, pebble.ErrNotFound) {
			return err
		}
		if v, closer, err := r.Get(caKeyVersion); err == nil {
			if len(v) == 8 {
				rev.version = beU64(v)
			}
			closer.Close()
		}
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: caPfxRevoked, UpperBound: store.PrefixEnd(caPfxRevoked)})
		if err != nil {
			return err
		}
		for it.First(); it.Valid(); it.Next() {
			rev.serials = append(rev.serials, string(it.Key()[len(caPfxRevoked):]))
		}
		return it.Close()
	})
	if err != nil {
		return fmt.Errorf("meta: CA state: %w", err)
	}
	if rec != nil {
		s.ca.Store(s.parse(rec))
	} else {
		s.ca.Store(nil)
	}
	s.revoked.Store(rev)
	s.publishRevoked()
	return nil
}

// publishRevoked hands the TLS set (onRevoked) the applied revocations,
// plus, while halted, those past the halt and the pulled ones.
func (s *caState) publishRevoked() {
	if s.onRevoked == nil {
		return
	}
	s.pastMu.Lock()
	defer s.pastMu.Unlock()
	serials := s.revoked.Load().serials
	if len(s.pastHalt) > 0 || len(s.pulled) > 0 {
		serials = slices.Clone(serials)
		for sn := range s.pastHalt {
			serials = append(serials, sn)
		}
		serials = append(serials, s.pulled...)
	}
	s.onRevoked(serials)
}

// setPulled records the revocation list taken from another replica
// while this one is halted (upgrade.go: pullRevocations).
func (s *caState) setPulled(serials []string) {
	if len(serials) > maxRevocations {
		serials = serials[:maxRevocations]
	}
	s.pastMu.Lock()
	s.pulled = serials
	s.pastMu.Unlock()
	s.publishRevoked()
}

// scanPastHalt reads the committed entries a halted replica does not
// apply for their revocations, for the TLS set only (the state stays at
// the halt): a certificate revoked after the halt is refused here as it
// would be had the replica applied its log (review drift 3). Revoke ops
// by serial, and by identity (the certificates this replica recorded,
// and those recorded past the halt). Entries this binary cannot decode
// are skipped (the pulled list covers them). Bounded by maxRevocations.
func (s *caState) scanPastHalt(entries []store.Entry) {
	changed := false
	for _, e := range entries {
		if len(e.Cmd) == 0 {
			continue
		}
		cmd := &metapb.CaCommand{}
		if s.halt.Decode(e, cmd) != nil {
			continue
		}
		switch op := cmd.Op.(type) {
		case *metapb.CaCommand_RecordIssued:
			if id := op.RecordIssued.GetIdentity(); id != "" && s.pastN < maxRevocations {
				if s.pastIssued == nil {
					s.pastIssued = map[string][]string{}
				}
				s.pastIssued[id] = append(s.pastIssued[id], op.RecordIssued.GetSerial())
				s.pastN++
			}
		case *metapb.CaCommand_Revoke:
			serials := s.pastIssued[op.Revoke.GetIdentity()]
			if sn := op.Revoke.GetSerial(); sn != "" {
				serials = append(slices.Clone(serials), sn)
			}
			if want := op.Revoke.GetIdentity(); want != "" {
				_ = s.st.View(func(r pebble.Reader) error {
					it, err := r.NewIter(&pebble.IterOptions{LowerBound: caPfxIssued, UpperBound: store.PrefixEnd(caPfxIssued)})
					if err != nil {
						return err
					}
					for it.First(); it.Valid(); it.Next() {
						ic := &metapb.CaIssuedCert{}
						if proto.Unmarshal(it.Value(), ic) == nil && ic.GetIdentity() == want {
							serials = append(serials, ic.GetSerial())
						}
					}
					return it.Close()
				})
			}
			s.pastMu.Lock()
			for _, sn := range serials {
				if sn != "" && !s.pastHalt[sn] && len(s.pastHalt) < maxRevocations {
					if s.pastHalt == nil {
						s.pastHalt = map[string]bool{}
					}
					s.pastHalt[sn] = true
					changed = true
				}
			}
			s.pastMu.Unlock()
		}
	}
	if changed {
		s.publishRevoked()
	}
}

func beU64(b []byte) uint64 {
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return v
}

func (s *caState) parse(rec *metapb.CaInitOp) *caLoaded {
	l := &caLoaded{certDER: rec.GetCertDer()}
	key := rec.GetKey()
	if rec.GetKeySealed() {
		if s.seal == nil {
			l.err = errors.New("the CA key is sealed and this meta node was not given the sealing secret (basalt meta --ca-key-secret-file)")
			return l
		}
		var err error
		if key, err = openSealed(s.seal, key, rec.GetCertDer()); err != nil {
			l.err = fmt.Errorf("unsealing the CA key: %w (is --ca-key-secret-file the cluster's?)", err)
			return l
		}
	}
	l.ca, l.err = pki.CAFromDER(rec.GetCertDer(), key)
	return l
}

// sealKey derives the AES-256 key from a secret file's contents.
func sealKey(secret []byte) []byte {
	h := sha256.Sum256(append([]byte("basalt CA key seal v1\x00"), secret...))
	return h[:]
}

// sealCAKey encrypts key (AES-256-GCM, the certificate as associated
// data): nonce || ciphertext.
func sealCAKey(k, key, certDER []byte) ([]byte, error) {
	blk, err := aes.NewCipher(k)
	if err != nil {
		return nil, err
	}
	g, err := cipher.NewGCM(blk)
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, g.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	return g.Seal(nonce, nonce, key, certDER), nil
}

func openSealed(k, sealed, certDER []byte) ([]byte, error) {
	blk, err := aes.NewCipher(k)
	if err != nil {
		return nil, err
	}
	g, err := cipher.NewGCM(blk)
	if err != nil {
		return nil, err
	}
	if len(sealed) < g.NonceSize() {
		return nil, errors.New("sealed key too short")
	}
	return g.Open(nil, sealed[:g.NonceSize()], sealed[g.NonceSize():], certDER)
}

// CA returns the recorded CA: nil, nil if none is recorded yet; nil and
// an error if this node cannot use its key.
func (s *caState) CA() (*pki.CA, []byte, error) {
	l := s.ca.Load()
	if l == nil {
		return nil, nil, nil
	}
	return l.ca, l.certDER, l.err
}

// Revocations is the revoked serials (sorted) and the list's version.
func (s *caState) Revocations() ([]string, uint64) {
	r := s.revoked.Load()
	return r.serials, r.version
}

// token reads a stored token (nil if none).
// issued is the record of a certificate issued by serial (nil if none).
func (s *caState) issued(serial string) (*metapb.CaIssuedCert, error) {
	ic := &metapb.CaIssuedCert{}
	if ok, err := s.get(key(caPfxIssued, serial), ic); !ok {
		return nil, err
	}
	return ic, nil
}

func (s *caState) token(id string) (*metapb.CaToken, error) {
	t := &metapb.CaToken{}
	if ok, err := s.get(append(slices.Clone(caPfxToken), id...), t); !ok {
		return nil, err
	}
	return t, nil
}

// get reads the record at k into m; ok is false if there is none (or on
// an error).
func (s *caState) get(k []byte, m proto.Message) (ok bool, err error) {
	err = s.st.View(func(r pebble.Reader) error {
		v, closer, err := r.Get(k)
		if errors.Is(err, pebble.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		defer closer.Close()
		ok = true
		return proto.Unmarshal(v, m)
	})
	return ok && err == nil, err
}

// AppliedIndex is the durable applied index (raft.StateMachine): raft
// compacts its log up to it, so it must not count what a crash can lose.
func (s *caState) AppliedIndex() uint64                     { return s.st.DurableIndex() }
func (s *caState) Snapshot() (uint64, io.ReadCloser, error) { return s.st.Snapshot() }
func (s *caState) Close() error                             { return s.st.Close() }

func (s *caState) Restore(index uint64, r io.Reader) error {
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

// Apply applies entries in one batch; each result is nil or an error (a
// gRPC status for refusals).
func (s *caState) Apply(entries []store.Entry) []any {
	if len(entries) == 0 {
		return nil
	}
	if s.halt.Halted() != nil {
		s.scanPastHalt(entries)
		return applyhalt.Results(entries)
	}
	b := s.st.NewBatch()
	changed := false
	s.batchRevoked = 0
	res, commit, halted, panicked := applyhalt.Run(s.halt, entries, true, func() *metapb.CaCommand { return &metapb.CaCommand{} },
		func(cmd *metapb.CaCommand) any {
			r, ch := s.apply(b, cmd)
			changed = changed || ch
			return r
		})
	if panicked {
		// A runtime error in a command's apply (applyhalt.Guard): nothing
		// of this call commits (the views change only after a commit);
		// its revocations still reach the TLS set.
		b.Close()
		s.batchRevoked = 0
		s.scanPastHalt(entries)
		return res
	}
	var past []store.Entry // entries past a halt in this call
	if halted != nil {
		past = entries[len(commit)+1:]
	}
	s.halt.Finish(b, commit, halted) // a failed commit panics, as the other groups: replay the log on restart
	if changed {
		if err := s.load(); err != nil {
			panic(err)
		}
	}
	s.scanPastHalt(past)
	return res
}

func get(b *pebble.Batch, k []byte, m proto.Message) (bool, error) {
	v, closer, err := b.Get(k)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer closer.Close()
	return true, proto.Unmarshal(v, m)
}

func put(b *pebble.Batch, k []byte, m proto.Message) {
	v, err := proto.Marshal(m)
	if err == nil {
		err = b.Set(k, v, nil)
	}
	if err != nil {
		panic(err)
	}
}

func key(pfx []byte, s string) []byte { return append(slices.Clone(pfx), s...) }

// apply applies one command; changed reports whether the in-memory views
// must be reloaded.
func (s *caState) apply(b *pebble.Batch, cmd *metapb.CaCommand) (res any, changed bool) {
	now := cmd.GetNowUnixMs()
	switch op := cmd.Op.(type) {
	case *metapb.CaCommand_Init:
		var cur metapb.CaInitOp
		if found, err := get(b, caKeyCA, &cur); err != nil || found {
			return err, false // the first CA recorded stays the cluster's
		}
		put(b, caKeyCA, op.Init)
		return nil, true
	case *metapb.CaCommand_AddToken:
		return s.addToken(b, op.AddToken, now), false
	case *metapb.CaCommand_ConsumeToken:
		c := op.ConsumeToken
		t := &metapb.CaToken{}
		found, err := get(b, key(caPfxToken, c.GetTokenId()), t)
		switch {
		case err != nil:
			return err, false
		case !found:
			return status.Error(codes.PermissionDenied, "bootstrap token unknown"), false
		case !pki.SecretHashesEqual(t.GetSecretHash(), c.GetSecretHash()):
			return status.Error(codes.PermissionDenied, "bootstrap token secret does not match"), false
		case t.GetUsedUnixMs() != 0:
			return status.Errorf(codes.PermissionDenied, "bootstrap token already used (for certificate %s)", t.GetUsedBy()), false
		case now >= t.GetExpiresUnixMs():
			return status.Error(codes.PermissionDenied, "bootstrap token expired"), false
		}
		id, err := pki.ParseIdentity(c.GetIssued().GetIdentity())
		if err != nil || string(id.Role) != t.GetRole() || (t.GetIdentityId() != "" && id.ID != t.GetIdentityId()) {
			return status.Errorf(codes.PermissionDenied, "bootstrap token is for role %s, not for %s", t.GetRole(), clip(c.GetIssued().GetIdentity())), false
		}
		t.UsedUnixMs, t.UsedBy = now, c.GetIssued().GetSerial()
		put(b, key(caPfxToken, c.GetTokenId()), t)
		put(b, key(caPfxIssued, c.GetIssued().GetSerial()), c.GetIssued())
		return nil, false
	case *metapb.CaCommand_RecordIssued:
		if from := op.RecordIssued.GetRenewedFrom(); from != "" {
			if _, closer, err := b.Get(key(caPfxRevoked, from)); err == nil {
				closer.Close()
				return status.Errorf(codes.PermissionDenied, "renewal of certificate %s refused: it is revoked", from), false
			}
		}
		put(b, key(caPfxIssued, op.RecordIssued.GetSerial()), op.RecordIssued)
		return nil, false
	case *metapb.CaCommand_Revoke:
		return s.revoke(b, op.Revoke)
	}
	return fmt.Errorf("meta: CA: unknown command %T", cmd.Op), false
}

func (s *caState) addToken(b *pebble.Batch, op *metapb.CaAddTokenOp, now int64) any {
	// Drop tokens used or expired over a day ago; count the rest.
	it, err := b.NewIter(&pebble.IterOptions{LowerBound: caPfxToken, UpperBound: store.PrefixEnd(caPfxToken)})
	if err != nil {
		return err
	}
	var drop [][]byte
	open := 0
	for it.First(); it.Valid(); it.Next() {
		t := &metapb.CaToken{}
		if proto.Unmarshal(it.Value(), t) != nil {
			continue
		}
		end := t.GetExpiresUnixMs()
		if u := t.GetUsedUnixMs(); u != 0 && u < end {
			end = u
		}
		if now-end > tokenKeepUsedMs {
			drop = append(drop, slices.Clone(it.Key()))
		} else {
			open++
		}
	}
	if err := it.Close(); err != nil {
		return err
	}
	for _, k := range drop {
		if err := b.Delete(k, nil); err != nil {
			return err
		}
	}
	if open >= maxOpenTokens {
		return status.Errorf(codes.ResourceExhausted, "%d bootstrap tokens are outstanding; wait for them to expire", open)
	}
	k := key(caPfxToken, op.GetTokenId())
	if found, err := get(b, k, &metapb.CaToken{}); err != nil || found {
		if err == nil {
			err = status.Error(codes.AlreadyExists, "bootstrap token ID already exists")
		}
		return err
	}
	put(b, k, &metapb.CaToken{SecretHash: op.GetSecretHash(), Role: op.GetRole(), ExpiresUnixMs: op.GetExpiresUnixMs(), IdentityId: op.GetIdentityId()})
	return nil
}

// revoke records the serial, or every serial issued to the identity; the
// result is the serials newly revoked ([]string).
func (s *caState) revoke(b *pebble.Batch, op *metapb.RevokeCertificateRequest) (any, bool) {
	var serials []string
	if op.GetSerial() != "" {
		serials = append(serials, op.GetSerial())
	}
	if want := op.GetIdentity(); want != "" {
		it, err := b.NewIter(&pebble.IterOptions{LowerBound: caPfxIssued, UpperBound: store.PrefixEnd(caPfxIssued)})
		if err != nil {
			return err, false
		}
		for it.First(); it.Valid(); it.Next() {
			ic := &metapb.CaIssuedCert{}
			if proto.Unmarshal(it.Value(), ic) == nil && ic.GetIdentity() == want {
				serials = append(serials, ic.GetSerial())
			}
		}
		if err := it.Close(); err != nil {
			return err, false
		}
	}
	// All or nothing: the serials not revoked yet are counted against the
	// limit before any is recorded.
	var added []string
	seen := make(map[string]bool, len(serials))
	for _, sn := range serials {
		if seen[sn] {
			continue
		}
		seen[sn] = true
		if _, closer, err := b.Get(key(caPfxRevoked, sn)); err == nil {
			closer.Close()
			continue
		}
		added = append(added, sn)
	}
	if n := len(s.revoked.Load().serials) + s.batchRevoked; n+len(added) > maxRevocations {
		return status.Errorf(codes.ResourceExhausted, "%d serials are revoked already; %d more would pass the limit of %d: nothing revoked",
			n, len(added), maxRevocations), false
	}
	for _, sn := range added {
		if err := b.Set(key(caPfxRevoked, sn), nil, nil); err != nil {
			panic(err)
		}
	}
	s.batchRevoked += len(added)
	if len(added) > 0 {
		var v uint64
		if val, closer, err := b.Get(caKeyVersion); err == nil {
			v = beU64(val)
			closer.Close()
		}
		if err := b.Set(caKeyVersion, store.U64(v+1), nil); err != nil {
			panic(err)
		}
	}
	return added, len(added) > 0
}
