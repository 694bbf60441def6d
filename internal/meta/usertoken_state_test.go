package meta

import (
	"context"
	"crypto/sha256"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// utApply applies cmds to st as log entries from index on and returns
// their results.
func utApply(t testing.TB, st *utState, index uint64, cmds ...*metapb.UserTokenCommand) []any {
	t.Helper()
	ents := make([]store.Entry, len(cmds))
	for i, c := range cmds {
		b, err := proto.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		ents[i] = store.Entry{Index: index + uint64(i), Cmd: b}
	}
	return st.Apply(ents)
}

func utKeyCmd(now int64, id uint64, activate int64) *metapb.UserTokenCommand {
	return &metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Keys{Keys: &metapb.UserTokenKeysOp{
		Add: &metapb.SecretKey{Id: id, Secret: make([]byte, utSecretSize), CreatedUnixMs: now, ActivateUnixMs: activate}}}}
}

// TestUTStateRecordsAndReloads: sequence numbers, nonces, renewals,
// cancellations and keys survive a reopen and travel in a snapshot;
// records go once their time has passed (and the clock never goes back,
// whatever a proposer stamps).
func TestUTStateRecordsAndReloads(t *testing.T) {
	dir := t.TempDir()
	opts := store.Options{SyncInterval: -1, Logger: quiet}
	st, err := openUTState(filepath.Join(dir, "a"), opts)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UnixMilli()
	nonce := make([]byte, 32)
	res := utApply(t, st, 1,
		utKeyCmd(now, 1, now),
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Issue{Issue: &metapb.UserTokenIssueOp{NonceId: nonce, NonceUntilUnixMs: now + 1000}}},
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Issue{Issue: &metapb.UserTokenIssueOp{NonceId: nonce, NonceUntilUnixMs: now + 1000}}},
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Issue{Issue: &metapb.UserTokenIssueOp{}}},
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Renew{Renew: &metapb.UserTokenRenewOp{Sequence: 1, ExpiryUnixMs: now + 5000, MaxUnixMs: now + 10000}}},
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Cancel{Cancel: &metapb.UserTokenCancelOp{Sequence: 2, MaxUnixMs: now + 3000}}},
		&metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Renew{Renew: &metapb.UserTokenRenewOp{Sequence: 2, ExpiryUnixMs: now + 5000, MaxUnixMs: now + 10000}}},
	)
	if res[0] != nil || res[1] != uint64(1) || status.Code(res[2].(error)) != codes.Unauthenticated || res[3] != uint64(2) || res[4] != nil || res[5] != nil ||
		status.Code(res[6].(error)) != codes.PermissionDenied {
		t.Fatalf("results %v", res)
	}
	check := func(st *utState, what string) {
		t.Helper()
		if c, r := st.status(1); c || r != now+5000 {
			t.Fatalf("%s: token 1: cancelled %v, renewed until %d", what, c, r)
		}
		if c, _ := st.status(2); !c {
			t.Fatalf("%s: token 2 not cancelled", what)
		}
		if st.key(1) == nil || st.signingKey(now) == nil || st.next != 3 || len(st.nonces) != 1 {
			t.Fatalf("%s: key %v, next %d, nonces %d", what, st.key(1), st.next, len(st.nonces))
		}
	}
	check(st, "applied")
	st.Close()
	if st, err = openUTState(filepath.Join(dir, "a"), opts); err != nil {
		t.Fatal(err)
	}
	check(st, "reopened")
	idx, snap, err := st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	other, err := openUTState(filepath.Join(dir, "b"), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.Restore(idx, snap); err != nil {
		t.Fatal(err)
	}
	snap.Close()
	check(other, "restored")

	// Time passes: the nonce and the cancellation go, the renewal stays
	// until its max date; a command stamped earlier does not bring them back.
	// (They are kept utPruneGraceMs past their expiry, for nodes whose
	// clocks are behind the proposer's.)
	later := int64(4000 + utPruneGraceMs)
	utApply(t, st, 8, utKeyCmd(now+later, 2, now+4000), utKeyCmd(now, 3, now))
	if len(st.nonces) != 0 || len(st.cancelled) != 0 || len(st.renewed) != 1 || st.now != now+later {
		t.Fatalf("after 4 s + grace: nonces %d, cancelled %d, renewed %d, clock %d", len(st.nonces), len(st.cancelled), len(st.renewed), st.now-now)
	}
	if k := st.signingKey(now + 4000); k == nil || k.Id != 2 {
		t.Fatalf("signing key %v, want 2 (the newest active)", k)
	}
	st.Close()
}

// BenchmarkUserTokenVerify is what every token-authenticated call pays on
// the meta node once the token's MAC was checked (cache, key, expiry,
// cancellation); Cold every time (decode, MAC, state lookups);
// BenchmarkUserTokenSign the signing of a new token (its Raft proposal
// not included).
func BenchmarkUserTokenVerify(b *testing.B) { benchVerify(b, false) }

func BenchmarkUserTokenVerifyCold(b *testing.B) { benchVerify(b, true) }

func benchVerify(b *testing.B, cold bool) {
	st, err := openUTState(b.TempDir(), store.Options{Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	now := time.Now()
	utApply(b, st, 1, utKeyCmd(now.UnixMilli(), 1, now.UnixMilli()))
	s := &Server{ut: st}
	tok := signUserToken(st.signingKey(now.UnixMilli()), userToken{User: "alice", Renewer: "alice", Seq: 7, IssueMs: now.UnixMilli(),
		ExpiryMs: now.Add(time.Hour).UnixMilli(), MaxMs: now.Add(time.Hour).UnixMilli(), CertSerial: "1f2e"})
	b.ResetTimer()
	for range b.N {
		if cold {
			s.utCache.m = nil
		}
		if _, err := s.verifyUserToken(context.Background(), tok, now); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUserTokenVerifyBound is BenchmarkUserTokenVerify for a token
// issued against an S3 key: the check that the key still exists (the
// cached key state) is added to every call.
func BenchmarkUserTokenVerifyBound(b *testing.B) {
	st, err := openUTState(b.TempDir(), store.Options{Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	ns, err := namespace.Open(b.TempDir(), store.Options{Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	now := time.Now()
	cmd, _ := proto.Marshal(&metapb.NsCommand{NowUnixMs: now.UnixMilli(), Op: &metapb.NsCommand_CreateS3Secret{CreateS3Secret: &metapb.CreateS3SecretRequest{
		AccessKeyId: "AKIDBENCH", Owner: "alice", SecretAccessKey: "0123456789abcdef0123"}}})
	ns.Apply([]store.Entry{{Index: 1, Cmd: cmd}})
	sec, err := ns.GetS3Secret("AKIDBENCH")
	if err != nil {
		b.Fatal(err)
	}
	utApply(b, st, 1, utKeyCmd(now.UnixMilli(), 1, now.UnixMilli()))
	s := &Server{ut: st, nsState: ns}
	tok := signUserToken(st.signingKey(now.UnixMilli()), userToken{User: "alice", Renewer: "alice", Seq: 7, IssueMs: now.UnixMilli(),
		ExpiryMs: now.Add(time.Hour).UnixMilli(), MaxMs: now.Add(time.Hour).UnixMilli(), AccessKey: "AKIDBENCH", KeyCreatedMs: sec.CreatedUnixMs})
	b.ResetTimer()
	for range b.N {
		if _, err := s.verifyUserToken(context.Background(), tok, now); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkUserTokenSign(b *testing.B) {
	key := &metapb.SecretKey{Id: 1, Secret: make([]byte, utSecretSize)}
	now := time.Now()
	t := userToken{User: "alice", Renewer: "alice", Seq: 7, IssueMs: now.UnixMilli(), ExpiryMs: now.Add(time.Hour).UnixMilli(), MaxMs: now.Add(time.Hour).UnixMilli()}
	for range b.N {
		_ = signUserToken(key, t)
	}
}

// FuzzUserTokenDecode: no input makes the token decoders panic, and what
// decodes re-encodes to the same identifier.
func FuzzUserTokenDecode(f *testing.F) {
	key := &metapb.SecretKey{Id: 3, Secret: make([]byte, utSecretSize)}
	f.Add(signUserToken(key, userToken{User: "alice", Renewer: "bob", Seq: 9, IssueMs: 1, ExpiryMs: 2, MaxMs: 3, Admin: true, CertSerial: "1f2e"}))
	f.Add("AmlkAnB3AUsBUw")
	f.Add("j4_____________w")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		parts, err := metaclient.DecodeTokenURL(s)
		if err != nil {
			return
		}
		_, _ = metaclient.UserTokenOwner(s)
		ut, err := parseUserToken(parts.Identifier)
		if err != nil {
			return
		}
		if got := ut.marshal(); string(got) != string(parts.Identifier) {
			t.Fatalf("identifier %x re-encodes to %x", parts.Identifier, got)
		}
	})
}

// TestUTStateKeepsCancellationsPastExpiry: a cancellation is kept
// utPruneGraceMs past the token's max date by the state's clock (the
// latest proposer's), so a node whose clock is behind still refuses the
// cancelled token until its own clock passes that date.
func TestUTStateKeepsCancellationsPastExpiry(t *testing.T) {
	st, err := openUTState(t.TempDir(), store.Options{SyncInterval: -1, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	now := int64(1_800_000_000_000)
	utApply(t, st, 1, &metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Cancel{Cancel: &metapb.UserTokenCancelOp{Sequence: 7, MaxUnixMs: now + 1000}}})
	utApply(t, st, 2, utKeyCmd(now+1000+60_000, 1, now)) // a proposer a minute ahead
	if len(st.cancelled) != 1 {
		t.Fatalf("cancellation dropped a minute after its max date by the proposer's clock")
	}
	utApply(t, st, 3, utKeyCmd(now+1000+utPruneGraceMs+1, 2, now))
	if len(st.cancelled) != 0 {
		t.Fatalf("cancellation kept past the grace")
	}
}

func utIssueCmd(now int64, ak string, i int, until int64) *metapb.UserTokenCommand {
	id := sha256.Sum256([]byte(fmt.Sprintf("%s\n%d", ak, i)))
	return &metapb.UserTokenCommand{NowUnixMs: now, Op: &metapb.UserTokenCommand_Issue{Issue: &metapb.UserTokenIssueOp{
		NonceId: id[:], NonceUntilUnixMs: until, AccessKeyId: ak}}}
}

// TestUTStateNonceCapPerKey: one access key can hold only
// utMaxNoncesPerKey nonces; another key is still served, and the count
// survives a reopen and goes down as nonces expire. Fails on the old
// code: the only cap was cluster-wide, so one key holder could exhaust
// issuance for everyone.
func TestUTStateNonceCapPerKey(t *testing.T) {
	dir := t.TempDir()
	opts := store.Options{SyncInterval: -1, Logger: quiet}
	st, err := openUTState(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	now := int64(1_800_000_000_000)
	cmds := make([]*metapb.UserTokenCommand, 0, utMaxNoncesPerKey+1)
	for i := range utMaxNoncesPerKey + 1 {
		cmds = append(cmds, utIssueCmd(now, "HOG", i, now+1000))
	}
	res := utApply(t, st, 1, cmds...)
	if e, ok := res[utMaxNoncesPerKey].(error); !ok || status.Code(e) != codes.ResourceExhausted {
		t.Fatalf("request %d of one key: %v, want ResourceExhausted", utMaxNoncesPerKey+1, res[utMaxNoncesPerKey])
	}
	if _, ok := utApply(t, st, uint64(len(cmds)+1), utIssueCmd(now, "OTHER", 0, now+1000))[0].(uint64); !ok {
		t.Fatalf("another key is refused once one key used up its share")
	}
	st.Close()
	if st, err = openUTState(dir, opts); err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	idx := uint64(len(cmds) + 2)
	if e, ok := utApply(t, st, idx, utIssueCmd(now, "HOG", -1, now+1000))[0].(error); !ok || status.Code(e) != codes.ResourceExhausted {
		t.Fatalf("after a reopen the key's share is forgotten: %v", e)
	}
	later := now + 1000 + utPruneGraceMs + 1
	if _, ok := utApply(t, st, idx+1, utIssueCmd(later, "HOG", -2, later+1000))[0].(uint64); !ok {
		t.Fatalf("the key is still refused once its nonces expired")
	}
	if len(st.nonces) != 1 || st.perKey["HOG"] != 1 || len(st.perKey) != 1 {
		t.Fatalf("after expiry: %d nonces, per key %v", len(st.nonces), st.perKey)
	}
}

// TestUTStatePruneCostsWhatItDrops: with many live nonces, applying
// commands whose clock advances each time does not scan them all (an
// expiry-ordered heap finds what goes). Fails on the old code, which
// scanned every nonce and record on each apply with a newer clock: 4,000
// commands over 100,000 live nonces took seconds.
func TestUTStatePruneCostsWhatItDrops(t *testing.T) {
	st, err := openUTState(t.TempDir(), store.Options{SyncInterval: -1, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	now := int64(1_800_000_000_000)
	const live = 100_000
	idx := uint64(1)
	for i := 0; i < live; i += 5000 {
		cmds := make([]*metapb.UserTokenCommand, 0, 5000)
		for j := i; j < i+5000; j++ {
			cmds = append(cmds, utIssueCmd(now, fmt.Sprint("K", j%100), j, now+3_600_000)) // an hour out
		}
		utApply(t, st, idx, cmds...)
		idx += uint64(len(cmds))
	}
	// One nonce that expires soon, to see pruning still works.
	utApply(t, st, idx, utIssueCmd(now, "SOON", 0, now+10))
	idx++
	cmds := make([]*metapb.UserTokenCommand, 4000)
	for i := range cmds {
		cmds[i] = &metapb.UserTokenCommand{NowUnixMs: now + utPruneGraceMs + 100 + int64(i), Op: &metapb.UserTokenCommand_Issue{Issue: &metapb.UserTokenIssueOp{}}}
	}
	start := time.Now()
	utApply(t, st, idx, cmds...)
	took := time.Since(start)
	t.Logf("4,000 commands over %d live nonces: %v", live, took)
	if took > 1500*time.Millisecond {
		t.Fatalf("4,000 commands over %d live nonces took %v: pruning scans what it keeps", live, took)
	}
	if len(st.nonces) != live || st.perKey["SOON"] != 0 {
		t.Fatalf("%d nonces kept (want %d), SOON's count %d", len(st.nonces), live, st.perKey["SOON"])
	}
}
