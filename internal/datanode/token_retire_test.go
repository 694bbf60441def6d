package datanode

import (
	"crypto/rand"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestHeartbeatRetireTime: a datanode refuses a token signed with a key
// whose retire time (from a forced rotation after a meta node was
// removed) has passed by its own clock, although SCM still sends the key
// (its loop never dropped it: no quorum) or stopped answering: the key
// set from the heartbeat answer keeps the retire time. The refusal is a
// TOKEN_INVALID counted in basalt_datanode_block_tokens_invalid_total,
// not an expiry; tokens of the new key still pass.
func TestHeartbeatRetireTime(t *testing.T) {
	d := &Datanode{log: slog.New(slog.DiscardHandler)}
	d.ident.ID = 5
	secret := func() []byte {
		b := make([]byte, blocktoken.SecretSize)
		rand.Read(b)
		return b
	}
	now := time.Now()
	old := &metapb.SecretKey{Id: 1, Secret: secret(), ActivateUnixMs: now.Add(-time.Hour).UnixMilli()}
	// The removed member's copy of key 1 forges a long-lived write token.
	forger, err := blocktoken.NewKeySet([]blocktoken.Key{{ID: 1, Secret: old.Secret}})
	if err != nil {
		t.Fatal(err)
	}
	const container, local, pipeline = 7, 42, 3
	forged, err := forger.Issue(now, blocktoken.Claims{Block: blocktoken.Block{Container: container, Local: local},
		Modes: blocktoken.Read | blocktoken.Write, ExpiryUnixMs: now.Add(24 * time.Hour).UnixMilli(), Pipeline: pipeline})
	if err != nil {
		t.Fatal(err)
	}

	// Registration, before the rotation: key 1 only, no retire time.
	d.setKeys([]*metapb.SecretKey{old})
	if err := d.verifyToken(forged, container, local, blocktoken.Read); err != nil {
		t.Fatalf("before the rotation: %v", err)
	}
	// A heartbeat after the forced rotation, key 1 retiring later: still
	// accepted.
	fresh := &metapb.SecretKey{Id: 2, Secret: secret(), ActivateUnixMs: now.Add(-20 * time.Minute).UnixMilli()}
	retiring := &metapb.SecretKey{Id: 1, Secret: old.Secret, ActivateUnixMs: old.ActivateUnixMs, RetireUnixMs: now.Add(time.Hour).UnixMilli()}
	d.setKeys([]*metapb.SecretKey{retiring, fresh})
	if err := d.verifyToken(forged, container, local, blocktoken.Read); err != nil {
		t.Fatalf("before key 1's retire time: %v", err)
	}
	// The last heartbeat answer this datanode gets: key 1 retired a
	// second ago, not dropped.
	retired := &metapb.SecretKey{Id: 1, Secret: old.Secret, ActivateUnixMs: old.ActivateUnixMs, RetireUnixMs: now.Add(-time.Second).UnixMilli()}
	d.setKeys([]*metapb.SecretKey{retired, fresh})
	if !d.TokenKeys().Has(1) {
		t.Fatal("key 1 not in the datanode's set")
	}
	for _, mode := range []blocktoken.Mode{blocktoken.Read, blocktoken.Write} {
		err := d.verifyTokenVia(forged, container, local, mode, pipeline)
		if !errors.Is(err, blocktoken.ErrRetired) {
			t.Fatalf("%v past key 1's retire time: err %v, want ErrRetired", mode, err)
		}
		st, _ := status.FromError(tokenStatus(err))
		var kind datanodepb.Error_Kind
		for _, det := range st.Details() {
			if e, ok := det.(*datanodepb.Error); ok {
				kind = e.GetKind()
			}
		}
		if kind != datanodepb.Error_TOKEN_INVALID {
			t.Fatalf("answer kind %v, want TOKEN_INVALID", kind)
		}
	}
	if d.TokensRefused() != 2 || d.TokensExpired() != 0 {
		t.Fatalf("refused %d, expired %d; want 2, 0", d.TokensRefused(), d.TokensExpired())
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(d.tokenCollectors()...)
	if n, err := testutil.GatherAndCount(reg, "basalt_datanode_block_tokens_invalid_total"); err != nil || n != 1 {
		t.Fatalf("invalid counter: %d series, %v", n, err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		want := map[string]float64{"basalt_datanode_block_tokens_invalid_total": 2, "basalt_datanode_block_tokens_expired_total": 0}[mf.GetName()]
		if got := mf.GetMetric()[0].GetCounter().GetValue(); got != want {
			t.Fatalf("%s = %v, want %v", mf.GetName(), got, want)
		}
	}
	// The new key's tokens pass.
	ok, err := blocktoken.NewKeySet([]blocktoken.Key{{ID: 2, Secret: fresh.Secret}})
	if err != nil {
		t.Fatal(err)
	}
	good, err := ok.Issue(now, blocktoken.Claims{Block: blocktoken.Block{Container: container, Local: local},
		Modes: blocktoken.Read, ExpiryUnixMs: now.Add(time.Hour).UnixMilli()})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.verifyToken(good, container, local, blocktoken.Read); err != nil {
		t.Fatalf("key 2's token: %v", err)
	}
}
