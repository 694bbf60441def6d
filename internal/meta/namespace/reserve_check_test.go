package namespace

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// reserveEnv: a bucket vol1/bk1 that alice may write (she owns it).
func reserveEnv(t *testing.T) *nsEnv {
	t.Helper()
	e := newNS(t)
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
