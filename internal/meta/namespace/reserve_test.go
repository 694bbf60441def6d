package namespace

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Reservations expire after ReservationExpiry, open keys of the same age
// after OpenKeyExpiry: the expiry's scan passes over a younger-than-its-
// expiry open key to the reservations after it, and releases their blocks
// to SCM. (The real-cluster tests are client/reserve_test.go.)
func TestReservationExpiresBeforeOpenKeys(t *testing.T) {
	e := newNS(t)
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: time.Hour, ReservationExpiry: 10 * time.Minute},
		e.st, &fakeRaft{st: e.st}, e.fb)
	e.finalizeLayout(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol1"})
	if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bk1"}); err != nil {
		t.Fatal(err)
	}
	reserve := func() *metapb.ReservedBlock {
		r, err := e.s.ReserveBlocks(ctx, &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: 1})
		if err != nil {
			t.Fatal(err)
		}
		return r.Blocks[0]
	}
	r1 := reserve()
	e.now = e.now.Add(time.Minute)
	open, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol1", Bucket: "bk1", Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	e.now = e.now.Add(time.Minute)
	r2 := reserve()
	e.now = e.now.Add(10*time.Minute + 30*time.Second) // r1 12.5 min old, open 11.5, r2 10.5
	if err := e.s.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*metapb.ReservedBlock{r1, r2} {
		_, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: r.OpenId, Key: "x", Blocks: []*metapb.KeyBlock{{Id: r.Block.Id}}})
		if status.Code(err) != codes.NotFound {
			t.Fatalf("commit of expired reservation %d: %v, want NOT_FOUND", r.OpenId, err)
		}
		if !e.fb.deleted[r.Block.Id.LocalId] {
			t.Fatalf("block of expired reservation %d not handed to SCM", r.OpenId)
		}
	}
	if _, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: open.OpenId, Blocks: []*metapb.KeyBlock{{Id: open.Blocks[0].Id, Length: 1}}}); err != nil {
		t.Fatalf("the open key of 11.5 minutes expired with the reservations: %v", err)
	}
	// A live reservation commits as a key of the name given.
	r3 := reserve()
	ki, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: r3.OpenId, Key: "named", Volume: "vol1", Bucket: "bk1",
		Blocks: []*metapb.KeyBlock{{Id: r3.Block.Id, Length: 5}}})
	if err != nil || ki.Name != "named" || ki.Size != 5 {
		t.Fatalf("commit of a live reservation: %v %v", ki, err)
	}
	if _, err := e.s.ReserveBlocks(ctx, &metapb.ReserveBlocksRequest{Volume: "vol1", Bucket: "bk1", Count: MaxReserveBlocks + 1}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("reserve %d blocks: %v, want INVALID_ARGUMENT", MaxReserveBlocks+1, err)
	}
}
