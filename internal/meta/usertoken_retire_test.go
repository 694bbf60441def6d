package meta

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// TestUserTokenRetiredKeyRefused: past a user-token key's forced retire
// time (after a meta node was removed), a token signed with it is refused
// by this node's clock, whether its MAC was checked before (cached) or
// not, although the key is still recorded (the user-token leader's loop
// never dropped it: no quorum). Before the retire time the same token
// verifies.
func TestUserTokenRetiredKeyRefused(t *testing.T) {
	st, err := openUTState(t.TempDir(), store.Options{SyncInterval: -1, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	now := time.Now()
	ms := now.UnixMilli()
	retire := ms + 5000
	add := utKeyCmd(ms, 2, ms+1000).GetKeys().Add
	res := utApply(t, st, 1, utKeyCmd(ms, 1, ms), &metapb.UserTokenCommand{NowUnixMs: ms, Op: &metapb.UserTokenCommand_ForcedKeyRotation{
		ForcedKeyRotation: &metapb.ForcedKeyRotationOp{Add: add, Members: []uint64{9}, RetireUnixMs: retire}}})
	if res[0] != nil || res[1] != nil || st.keyRetire(1) != retire {
		t.Fatalf("results %v, key 1 retires %d", res, st.keyRetire(1))
	}
	// Forged with the removed member's copy of key 1: a day to live.
	old := &metapb.SecretKey{Id: 1, Secret: st.key(1)}
	tok := signUserToken(old, userToken{User: "alice", Renewer: "alice", Seq: 7, IssueMs: ms,
		ExpiryMs: ms + 86_400_000, MaxMs: ms + 86_400_000, CertSerial: "1f2e"})
	s := &Server{ut: st}
	for _, at := range []int64{ms, retire - 1} {
		if _, err := s.verifyUserToken(context.Background(), tok, time.UnixMilli(at)); err != nil {
			t.Fatalf("%d ms before key 1's retire time: %v", retire-at, err)
		}
	}
	for _, cold := range []bool{false, true} {
		if cold {
			s.utCache.m = nil
		}
		for _, at := range []int64{retire, retire + 60_000} {
			_, err := s.verifyUserToken(context.Background(), tok, time.UnixMilli(at))
			if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "key 1 retired") {
				t.Fatalf("%d ms past key 1's retire time (cold cache %v): err %v, want Unauthenticated, key 1 retired", at-retire, cold, err)
			}
		}
	}
	if st.key(1) == nil {
		t.Fatal("key 1 dropped: the test no longer shows the verifier's own check")
	}
}
