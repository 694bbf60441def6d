package meta

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

func keySetOf(t *testing.T, keys []*metapb.SecretKey) *blocktoken.KeySet {
	t.Helper()
	ks := make([]blocktoken.Key, len(keys))
	for i, k := range keys {
		ks[i] = blocktoken.Key{ID: k.Id, Secret: k.Secret, ActivateUnixMs: k.ActivateUnixMs}
	}
	s, err := blocktoken.NewKeySet(ks)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestBlockTokensSurviveLeaderChange: SCM's block token keys are in its
// Raft group, so every meta node holds the same ones; after the SCM
// leader dies, the new leader hands datanodes the same keys (a token
// issued before the change still verifies with them), issues tokens they
// verify, and does not start over with a key of its own.
func TestBlockTokensSurviveLeaderChange(t *testing.T) {
	c := newCluster(t, 3, scm.Config{LoopInterval: 50 * time.Millisecond})
	cl := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	scmLeader := func() uint64 {
		for id, s := range c.servers {
			if s.scmGroup.IsLeader() {
				return id
			}
		}
		return 0
	}
	waitFor(t, 10*time.Second, "an SCM key on every node", func() bool {
		for _, s := range c.servers {
			if s.scmState.TokenKeys().Len() == 0 {
				return false
			}
		}
		return scmLeader() != 0
	})
	old := scmLeader()
	blk := &metapb.BlockID{ContainerId: 5, LocalId: 17}
	tok, err := c.servers[old].scmMgr.IssueToken(ctx, blk, blocktoken.Read, "")
	if err != nil {
		t.Fatal(err)
	}
	dc := dnClient(t, cl, "dn-a") // node RPCs need the datanode's certificate
	reg, err := dc.Scm.RegisterDatanode(ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{
		Uuid: "dn-a", DataAddr: "127.0.0.1:9000", RaftAddr: "127.0.0.1:9100"}})
	if err != nil {
		t.Fatal(err)
	}
	before := keySetOf(t, reg.GetSecretKeys())
	want := blocktoken.Block{Container: 5, Local: 17}
	if _, err := before.Verify(tok, want, blocktoken.Read, time.Now()); err != nil {
		t.Fatalf("token from the leader with the keys it registered the datanode with: %v", err)
	}

	c.servers[old].Close()
	delete(c.servers, old)
	waitFor(t, 10*time.Second, "a new SCM leader", func() bool { return scmLeader() != 0 })
	nl := c.servers[scmLeader()]
	// The datanode's heartbeats go to the new leader.
	var hb *metapb.HeartbeatResponse
	waitFor(t, 20*time.Second, "a heartbeat answered by the new leader", func() bool {
		hb, err = dc.Scm.Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: reg.GetDatanodeId()})
		return err == nil && len(hb.GetSecretKeys()) > 0
	})
	after := keySetOf(t, hb.GetSecretKeys())
	if !after.SameAs(before) {
		t.Fatalf("the new leader sends other keys (%d) than the old one did (%d)", after.Len(), before.Len())
	}
	if _, err := after.Verify(tok, want, blocktoken.Read, time.Now()); err != nil {
		t.Fatalf("token issued before the leader change, keys from the new leader: %v", err)
	}
	tok2, err := nl.scmMgr.IssueToken(ctx, blk, blocktoken.Write, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := after.Verify(tok2, want, blocktoken.Write, time.Now()); err != nil {
		t.Fatalf("token from the new leader: %v", err)
	}
}
