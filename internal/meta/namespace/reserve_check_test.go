package namespace

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// reserveEnv: a bucket vol1/bk1 that alice may write (she owns it), on a
// namespace finalized at this binary's layout (reservations need layout 2).
func reserveEnv(t *testing.T) *nsEnv {
	t.Helper()
	e := newNS(t)
	e.finalizeLayout(t)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol1", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bk1", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	return e
}

// ReserveBlocks refuses before the log whatever OpenKey refuses of the
// same parameters (review 13, finding 1).
func TestReserveBlocksValidatedAsOpenKey(t *testing.T) {
	e := reserveEnv(t)
	long := strings.Repeat("x", maxLocationBytes+1)
	for _, c := range []struct {
		name string
		o    *metapb.OpenKeyRequest
	}{
		{"checksum type", &metapb.OpenKeyRequest{ChecksumType: 77}},
		{"bytes per checksum", &metapb.OpenKeyRequest{BytesPerChecksum: 1}},
		{"replication", &metapb.OpenKeyRequest{Replication: 9}},
		{"client location", &metapb.OpenKeyRequest{ClientLocation: long}},
		{"bucket name", &metapb.OpenKeyRequest{Bucket: strings.Repeat("b", 300)}},
	} {
		o := c.o
		if o.Bucket == "" {
			o.Bucket = "bk1"
		}
		o.Volume, o.Key = "vol1", "k"
		if _, err := e.s.OpenKey(e.ctx, o); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("%s: OpenKey %v, want INVALID_ARGUMENT", c.name, err)
		}
		before := e.s.raft.(*fakeRaft).idx
		_, err := e.s.ReserveBlocks(e.ctx, &metapb.ReserveBlocksRequest{Volume: o.Volume, Bucket: o.Bucket, Count: 1,
			Replication: o.Replication, ChecksumType: o.ChecksumType, BytesPerChecksum: o.BytesPerChecksum, ClientLocation: o.ClientLocation})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("%s: ReserveBlocks %v, want INVALID_ARGUMENT", c.name, err)
		}
		if after := e.s.raft.(*fakeRaft).idx; after != before {
			t.Fatalf("%s: the refused ReserveBlocks entered the log (%d -> %d)", c.name, before, after)
		}
	}
}

// The key, volume and bucket a commit names are bounded and checked
// against the open key before the log, for every caller: a user (alice,
// the reserver), and a trusted in-process caller (an admin's commit is
// trusted too) (review 13, findings 2 and 10).
func TestCommitNamesCheckedBeforeLog(t *testing.T) {
	e := reserveEnv(t)
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bk2", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	root := WithCaller(e.ctx, Caller{User: "root", Admin: true})
	for _, ctx := range []context.Context{alice, root, e.ctx} {
		c, _ := CallerOf(ctx)
		r, err := e.s.ReserveBlocks(ctx, &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: 1})
		if err != nil {
			t.Fatal(err)
		}
		rb := r.Blocks[0]
		open, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol1", Bucket: "bk1", Key: "k"})
		if err != nil {
			t.Fatal(err)
		}
		for _, bad := range []struct {
			name string
			req  *metapb.CommitKeyRequest
			code codes.Code
		}{
			{"open key renamed to 1 MiB", &metapb.CommitKeyRequest{OpenId: open.OpenId, Key: strings.Repeat("k", 1<<20)}, codes.InvalidArgument},
			{"open key renamed", &metapb.CommitKeyRequest{OpenId: open.OpenId, Key: "other"}, codes.InvalidArgument},
			{"open key of another bucket", &metapb.CommitKeyRequest{OpenId: open.OpenId, Volume: "vol1", Bucket: "bk2"}, codes.PermissionDenied},
			{"bucket name of 1 MiB", &metapb.CommitKeyRequest{OpenId: open.OpenId, Volume: "vol1", Bucket: strings.Repeat("b", 1<<20)}, codes.InvalidArgument},
			{"reservation without a name", &metapb.CommitKeyRequest{OpenId: rb.OpenId}, codes.InvalidArgument},
			{"reservation with a NUL in its name", &metapb.CommitKeyRequest{OpenId: rb.OpenId, Key: "a\x00b"}, codes.InvalidArgument},
			{"reservation into another bucket", &metapb.CommitKeyRequest{OpenId: rb.OpenId, Key: "x", Volume: "vol1", Bucket: "bk2"}, codes.PermissionDenied},
		} {
			before := e.s.raft.(*fakeRaft).idx
			_, err := e.s.CommitKey(ctx, bad.req)
			if status.Code(err) != bad.code {
				t.Fatalf("%v: %s: %v, want %v", c, bad.name, err, bad.code)
			}
			if len(err.Error()) > 4096 {
				t.Fatalf("%v: %s: error of %d bytes", c, bad.name, len(err.Error()))
			}
			_, berr := e.s.CommitKeys(ctx, &metapb.CommitKeysRequest{Requests: []*metapb.CommitKeyRequest{bad.req}})
			if after := e.s.raft.(*fakeRaft).idx; after != before {
				t.Fatalf("%v: %s: refused commit entered the log (%d -> %d; batch: %v)", c, bad.name, before, after, berr)
			}
		}
		// Both still commit as they should.
		if _, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: rb.OpenId, Key: "named", Volume: "vol1", Bucket: "bk1",
			Blocks: []*metapb.KeyBlock{{Id: rb.Block.Id, Length: 1}}}); err != nil {
			t.Fatalf("%v: commit of the reservation: %v", c, err)
		}
		if _, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: open.OpenId, Key: "k",
			Blocks: []*metapb.KeyBlock{{Id: open.Blocks[0].Id, Length: 1}}}); err != nil {
			t.Fatalf("%v: commit of the open key: %v", c, err)
		}
	}
}

// barrierRaft counts read barriers.
type barrierRaft struct {
	*fakeRaft
	barriers int
}

func (b *barrierRaft) ReadBarrier(context.Context) error { b.barriers++; return nil }

// A reservation's commit, where its key is authorized, is checked after
// a read barrier (as OpenKey is); an ordinary open key's commit takes
// none (review 13, finding 3).
func TestReservedCommitAfterBarrier(t *testing.T) {
	e := reserveEnv(t)
	br := &barrierRaft{fakeRaft: e.s.raft.(*fakeRaft)}
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: time.Hour}, e.st, br, e.fb)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	r, err := e.s.ReserveBlocks(alice, &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	open, err := e.s.OpenKey(alice, &metapb.OpenKeyRequest{Volume: "vol1", Bucket: "bk1", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	n := br.barriers
	if _, err := e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: open.OpenId, Blocks: []*metapb.KeyBlock{{Id: open.Blocks[0].Id}}}); err != nil {
		t.Fatal(err)
	}
	if br.barriers != n {
		t.Fatalf("commit of an ordinary open key took %d read barriers", br.barriers-n)
	}
	if _, err := e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: r.Blocks[0].OpenId, Key: "a",
		Blocks: []*metapb.KeyBlock{{Id: r.Blocks[0].Block.Id}}}); err != nil {
		t.Fatal(err)
	}
	if br.barriers != n+1 {
		t.Fatalf("commit of a reservation took %d read barriers, want 1 before its check", br.barriers-n)
	}
	res, err := e.s.CommitKeys(alice, &metapb.CommitKeysRequest{Requests: []*metapb.CommitKeyRequest{{OpenId: r.Blocks[1].OpenId, Key: "b",
		Blocks: []*metapb.KeyBlock{{Id: r.Blocks[1].Block.Id}}}}})
	if err != nil || res.Results[0].Code != 0 {
		t.Fatalf("CommitKeys of a reservation: %v %v", res, err)
	}
	if br.barriers != n+2 {
		t.Fatalf("CommitKeys of a reservation took %d read barriers, want 1", br.barriers-n-1)
	}
}

// A reservation behind more than one round's scan of older open keys
// expires all the same: each round goes on where the last stopped
// (review 13, finding 6).
func TestReservationExpiresBehindOpenKeys(t *testing.T) {
	e := reserveEnv(t)
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: time.Hour, ReservationExpiry: 10 * time.Minute},
		e.st, e.s.raft, e.fb)
	e.s.reserveScan.rows = 8
	for i := 0; i < 30; i++ {
		if _, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "vol1", Bucket: "bk1", Key: "k"}); err != nil {
			t.Fatal(err)
		}
	}
	r, err := e.s.ReserveBlocks(e.ctx, &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	rb := r.Blocks[0]
	e.now = e.now.Add(20 * time.Minute)  // the open keys live (1 h), the reservation expired
	for round := 0; round < 5; round++ { // 31 rows, 8 a round: 4 rounds
		if err := e.s.RunOnce(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.st.OpenKey(rb.OpenId); status.Code(err) != codes.NotFound {
		t.Fatalf("reservation 20 min old (expiry 10 min) behind 30 open keys, after 5 rounds of 8 rows: %v, want NOT_FOUND", err)
	}
	if !e.fb.deleted[rb.Block.Id.LocalId] {
		t.Fatal("the expired reservation's block was not handed to SCM")
	}
}

// The expiry ReserveBlocks promises is the one enforced: with an open
// key expiry shorter than the reservations', that one (review 13,
// finding 7).
func TestReservationExpiryPromised(t *testing.T) {
	e := reserveEnv(t)
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: 5 * time.Minute, ReservationExpiry: 10 * time.Minute},
		e.st, e.s.raft, e.fb)
	r, err := e.s.ReserveBlocks(e.ctx, &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	promised := time.UnixMilli(r.ExpiresUnixMs)
	e.now = promised.Add(-time.Second)
	if err := e.s.RunOnce(e.ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.st.OpenKey(r.Blocks[0].OpenId); err != nil {
		t.Fatalf("reservation gone before its promised expiry %v: %v", promised, err)
	}
	e.now = promised.Add(time.Second)
	if err := e.s.RunOnce(e.ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.st.OpenKey(r.Blocks[0].OpenId); status.Code(err) != codes.NotFound {
		t.Fatalf("reservation kept past its promised expiry: %v", err)
	}
}

// A reservation is the requester's, not the request's: the commit of a
// reserved block is checked with the committing request's own
// attributes (policy conditions on the source IP), whatever request the
// reservation was made with. (metaclient pools by requester: review 13,
// finding 4.)
func TestReservedCommitChecksItsRequest(t *testing.T) {
	e := reserveEnv(t)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	from := func(ip string) context.Context {
		return WithCaller(e.ctx, Caller{User: "alice", Request: &RequestInfo{SourceIP: ip}})
	}
	if _, err := e.s.SetBucketPolicy(alice, &metapb.BucketPolicy{Volume: "vol1", Bucket: "bk1", Policy: `{"Version":"2012-10-17","Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:PutObject","Resource":"arn:aws:s3:::bk1/*","Condition":{"IpAddress":{"aws:SourceIp":"10.66.0.0/16"}}}]}`}); err != nil {
		t.Fatal(err)
	}
	r, err := e.s.ReserveBlocks(from("10.1.1.1"), &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	req := func(i int, key string) *metapb.CommitKeyRequest {
		return &metapb.CommitKeyRequest{OpenId: r.Blocks[i].OpenId, Key: key, Volume: "vol1", Bucket: "bk1",
			Blocks: []*metapb.KeyBlock{{Id: r.Blocks[i].Block.Id, Length: 1}}}
	}
	if _, err := e.s.CommitKey(from("10.66.1.1"), req(0, "a")); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("commit from a denied source IP of a block reserved from another: %v, want PERMISSION_DENIED", err)
	}
	res, err := e.s.CommitKeys(from("10.66.1.1"), &metapb.CommitKeysRequest{Requests: []*metapb.CommitKeyRequest{req(0, "a")}})
	if err != nil || res.Results[0].Code != uint32(codes.PermissionDenied) {
		t.Fatalf("CommitKeys from a denied source IP: %v %v, want PERMISSION_DENIED", res, err)
	}
	if _, err := e.s.CommitKey(from("10.1.1.2"), req(0, "a")); err != nil {
		t.Fatalf("commit from an allowed source IP: %v", err)
	}
}

// finalizeLayout finalizes e's namespace at this binary's layout through
// e.s's Raft, as `basalt admin upgrade finalize` would.
func (e *nsEnv) finalizeLayout(t *testing.T) {
	t.Helper()
	cmd := mustCmd(t, &metapb.NsCommand{Op: &metapb.NsCommand_Layout{Layout: &metapb.LayoutOp{Version: SoftwareLayoutVersion()}}})
	if _, err := e.s.raft.Propose(e.ctx, cmd); err != nil {
		t.Fatal(err)
	}
	if got := e.st.FinalizedLayout(); got != SoftwareLayoutVersion() {
		t.Fatalf("finalized at %d, want %d", got, SoftwareLayoutVersion())
	}
}
