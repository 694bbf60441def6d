package namespace

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// lagRaft models a replica whose applied state lags what is committed
// (a leader elected a moment ago): pending commands are committed but
// not applied until a read barrier or the next proposal (applied in log
// order before it).
type lagRaft struct {
	*fakeRaft
	pending [][]byte
}

func (l *lagRaft) catchUp() {
	p := l.pending
	l.pending = nil
	for _, c := range p {
		l.fakeRaft.Propose(context.Background(), c)
	}
}

func (l *lagRaft) Propose(ctx context.Context, cmd []byte) (any, error) {
	l.catchUp()
	return l.fakeRaft.Propose(ctx, cmd)
}

func (l *lagRaft) ReadBarrier(context.Context) error { l.catchUp(); return nil }

// TestWritesAuthorizeAgainstCommittedState: alice's removal of bob's
// DELETE grant is committed but not yet applied on the replica bob's
// DeleteKey reaches. Authorizing against that replica's applied state
// would let bob delete the key (the removal applies just before the
// delete, which does not check again); a read barrier first makes the
// check see the removal. Likewise a volume created a moment ago is found.
func TestWritesAuthorizeAgainstCommittedState(t *testing.T) {
	e := authzEnv(t)
	alice, bob := e.as("alice"), e.as("bob")
	must(t, e.setAcl(t, alice, ref("obkt", "k"), metapb.AclOp_ACL_ADD, user("bob", rD)))
	lag := &lagRaft{fakeRaft: e.s.raft.(*fakeRaft)}
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: time.Hour, ReclaimBatch: 3}, e.st, lag, e.fb)

	removal, err := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_SetAcl{SetAcl: &metapb.SetAclRequest{
		Ref: ref("obkt", "k"), Op: metapb.AclOp_ACL_REMOVE, Acls: []*metapb.Acl{user("bob", rD)}}}})
	must(t, err)
	lag.pending = append(lag.pending, removal)
	if _, err := e.s.DeleteKey(bob, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); statusCode(err) != codes.PermissionDenied {
		t.Fatalf("bob deletes after his grant's removal was committed: %v", err)
	}
	if _, err := e.s.LookupKey(alice, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "obkt", Key: "k"}); err != nil {
		t.Fatalf("the key is gone: %v", err)
	}

	vol, err := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_CreateVolume{CreateVolume: &metapb.CreateVolumeRequest{Name: "vol2", Owner: "alice"}}})
	must(t, err)
	lag.pending = append(lag.pending, vol)
	if _, err := e.s.CreateBucket(alice, &metapb.CreateBucketRequest{Volume: "vol2", Name: "bkt2"}); err != nil {
		t.Fatalf("alice creates a bucket in a volume created a moment ago: %v", err)
	}
}
