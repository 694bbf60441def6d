package meta

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// oldReplicaCluster is a 3-replica meta cluster whose node 3 runs "an
// older binary" (supports layout 1 only) while old is set.
func oldReplicaCluster(t *testing.T, old *atomic.Bool) *cluster {
	c := newClusterWith(t, 3, scm.Config{}, func(cfg *Config) {
		if cfg.NodeID == 3 && old.Load() {
			cfg.TestSupportedLayout = 1
		}
	})
	waitFor(t, 20*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	return c
}

// upgradeNode restarts node id with the (now) current binary.
func (c *cluster) restartNode(id uint64) {
	c.servers[id].Close()
	c.servers[id] = c.newServer(id)
	c.wire()
	if err := c.servers[id].Start(); err != nil {
		c.t.Fatal(err)
	}
}

func singleAddr(t *testing.T, addr string) *metaclient.Client {
	cl, err := metaclient.New(metaclient.Config{Addrs: []string{addr}, CallTimeout: 5 * time.Second, MaxAttempts: 1, DialOptions: clientDial()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// TestLayoutFinalize: with a test feature at layout 2 (CreateBucket) and
// one replica supporting layout 1, the op is refused before the log, and
// finalize is refused, until that replica is upgraded; then finalize
// passes and the op works.
func TestLayoutFinalize(t *testing.T) {
	defer namespace.RegisterLayoutFeature(namespace.LayoutFeature{Name: "test-create-bucket", Version: 2, Op: 4, Description: "test only"})()
	var old atomic.Bool
	old.Store(true)
	c := oldReplicaCluster(t, &old)
	cl := c.client()
	ctx := context.Background()
	// The new cluster recorded the version every member supports: 1.
	waitFor(t, 20*time.Second, "the fresh cluster's layout", func() bool {
		for _, s := range c.servers {
			if !s.nsState.LayoutRecorded() {
				return false
			}
		}
		return true
	})
	for id, s := range c.servers {
		if v := s.nsState.FinalizedLayout(); v != 1 {
			t.Fatalf("node %d: finalized %d, want 1 (node 3 supports only 1)", id, v)
		}
	}
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	_, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "gated"})
	if status.Code(err) != codes.FailedPrecondition || !metaclient.LayoutNotFinalized(err) || !strings.Contains(err.Error(), "finalize") {
		t.Fatalf("gated op before finalize: %v", err)
	}
	// The refused op did not reach the log: a write after it, applied
	// everywhere, finds no bucket and node 3 (which would halt on it) not
	// halted. (The commit index is no proof: the service token or a new
	// leader's entry may land meanwhile.)
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "probe"}); err != nil {
		t.Fatal(err)
	}
	for id, s := range c.servers {
		waitFor(t, 20*time.Second, "the probe applied", func() bool { _, err := s.nsState.GetVolume("probe"); return err == nil })
		if _, err := s.nsState.GetBucket("vol", "gated"); err == nil || s.nsState.Halted() != nil {
			t.Fatalf("node %d: the refused op reached the log (halted %v)", id, s.nsState.Halted())
		}
	}
	st, err := cl.Upgrade.GetLayoutStatus(ctx, &metapb.GetLayoutStatusRequest{All: true})
	if err != nil {
		t.Fatal(err)
	}
	if st.FinalizedVersion != 1 || len(st.Replicas) != 3 || st.Replicas[2].SoftwareVersion != 1 || st.Replicas[0].SoftwareVersion != 2 {
		t.Fatalf("status %v", st)
	}
	// The test feature and every real one at layout 2 (block
	// reservations) wait for the finalize.
	var testFeature bool
	for _, f := range st.Features {
		testFeature = testFeature || f.Name == "test-create-bucket"
		if f.Finalized {
			t.Fatalf("features %v", st.Features)
		}
	}
	if !testFeature {
		t.Fatalf("features %v", st.Features)
	}
	// Block reservations (layout 2) are refused first, before the bucket
	// is even looked up or a block allocated; clients fall back to OpenKey
	// (metaclient TestReserveFallbackRetriedLater).
	if _, err := cl.Namespace.ReserveBlocks(ctx, &metapb.ReserveBlocksRequest{Volume: "vol", Bucket: "resv", Count: 1}); !metaclient.LayoutNotFinalized(err) {
		t.Fatalf("ReserveBlocks before finalize: %v", err)
	}
	_, err = cl.Upgrade.FinalizeLayout(ctx, &metapb.FinalizeLayoutRequest{Version: 2})
	// (Refused by the leader after asking the members, or by node 3
	// itself when it leads.)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "node 3 supports layout 1") && !strings.Contains(err.Error(), "meta node 3: layout 2 is above this leader's binary (1)") {
		t.Fatalf("finalize with node 3 at layout 1: %v", err)
	}
	// Upgrade node 3's "binary".
	old.Store(false)
	c.restartNode(3)
	cl = c.client() // node 3 listens on a new address
	waitFor(t, 60*time.Second, "finalize after the upgrade", func() bool {
		r, err := cl.Upgrade.FinalizeLayout(ctx, &metapb.FinalizeLayoutRequest{})
		if err != nil {
			t.Logf("finalize: %v", err)
		}
		return err == nil && r.FinalizedVersion == 2
	})
	waitFor(t, 20*time.Second, "every replica at layout 2", func() bool {
		for _, s := range c.servers {
			if s.nsState.FinalizedLayout() != 2 {
				return false
			}
		}
		return true
	})
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "gated"}); err != nil {
		t.Fatalf("gated op after finalize: %v", err)
	}
	// A finalize never goes back.
	if r, err := cl.Upgrade.FinalizeLayout(ctx, &metapb.FinalizeLayoutRequest{Version: 1}); err != nil || r.FinalizedVersion != 2 {
		t.Fatalf("finalize 1 after 2: %v %v", r, err)
	}
	// Rolled back to the older binary, node 3 halts at load (the test
	// hook now applies from the load on; it was set after it before, so
	// this path was not reached through the server), and refuses reads.
	old.Store(true)
	c.restartNode(3)
	h := c.servers[3].nsState.Halted()
	if h == nil || !strings.Contains(h.Reason, "finalized layout version 2 is above this binary's 1") {
		t.Fatalf("node 3 rolled back to layout 1 after finalize 2: halt %+v", h)
	}
	_, err = singleAddr(t, c.servers[3].GRPCAddr()).Namespace.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "vol"})
	if !hasReason(err, metapb.ReasonReplicaHalted) {
		t.Fatalf("read on the rolled-back replica: %v", err)
	}
}

// TestUnknownOpHaltsReplica: an entry whose op one replica does not know
// (proposed past the gate, as every op added before layout versions was)
// halts that replica at that index, visibly, while the others apply it;
// the halted replica refuses reads and leadership; restarted with a binary
// that knows the op it resumes from that index and ends with the same
// Pebble contents as the others. The old code recorded an error for the
// entry on that replica and went on: its state drifted (the bucket
// missing there only).
func TestUnknownOpHaltsReplica(t *testing.T) {
	defer namespace.RegisterLayoutFeature(namespace.LayoutFeature{Name: "test-create-bucket", Version: 2, Op: 4, Description: "test only"})()
	var old atomic.Bool
	old.Store(true)
	c := oldReplicaCluster(t, &old)
	cl := c.client()
	ctx := context.Background()
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	haltAt := proposeUnknownToNode3(t, c)
	// More writes after it, applied by nodes 1 and 2 only.
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "after"}); err != nil {
		t.Fatal(err)
	}
	s3 := c.servers[3]
	waitFor(t, 20*time.Second, "node 3 halted", func() bool { return s3.nsState.Halted() != nil })
	h := s3.nsState.Halted()
	if h.Index != haltAt || h.Op != 4 || !strings.Contains(h.Reason, "upgrade this replica's binary") {
		t.Fatalf("halt %+v, want index %d op 4", h, haltAt)
	}
	for _, id := range []uint64{1, 2} {
		s := c.servers[id]
		waitFor(t, 20*time.Second, "nodes 1 and 2 to apply", func() bool { _, err := s.nsState.GetVolume("after"); return err == nil })
		if s.nsState.Halted() != nil {
			t.Fatalf("node %d halted", id)
		}
		if _, err := s.nsState.GetBucket("vol", "newop"); err != nil {
			t.Fatalf("node %d: %v", id, err)
		}
	}
	if _, err := s3.nsState.GetBucket("vol", "newop"); err == nil {
		t.Fatal("node 3 applied the op it does not know")
	}
	if _, err := s3.nsState.GetVolume("after"); err == nil {
		t.Fatal("node 3 applied past its halt")
	}
	if a := s3.nsState.Store().AppliedIndex(); a >= haltAt {
		t.Fatalf("node 3 applied index %d, halt at %d", a, haltAt)
	}
	// Visible: reads refused there, its status and metric say why; the
	// rest of the process (SCM) still answers.
	one := singleAddr(t, s3.GRPCAddr())
	_, err := one.Namespace.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "vol"})
	if !hasReason(err, metapb.ReasonReplicaHalted) {
		t.Fatalf("read on the halted replica: %v", err)
	}
	ls, err := one.Upgrade.GetLayoutStatus(ctx, &metapb.GetLayoutStatusRequest{All: true})
	if err != nil || ls.Self.HaltedIndex != haltAt || len(ls.Replicas) != 3 || ls.Replicas[2].HaltedIndex != haltAt || ls.Replicas[0].HaltedIndex != 0 {
		t.Fatalf("layout status on node 3: %v %v", ls, err)
	}
	if g := gaugeValue(t, s3, "basalt_meta_namespace_apply_halted_index"); g != float64(haltAt) {
		t.Fatalf("halted gauge %v", g)
	}
	if _, err := one.Scm.GetSafeMode(ctx, &metapb.GetSafeModeRequest{}); err != nil && status.Code(err) != codes.Unavailable {
		t.Fatalf("SCM on the halted node: %v", err)
	}
	// A client still reads through the others.
	if _, err := cl.Namespace.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol", Name: "newop"}); err != nil {
		t.Fatal(err)
	}
	// Made leader, the halted replica hands leadership over.
	// (Retried: the transfer may not take; node 3 must have led once for
	// the hand-over below to mean anything.)
	led, last := false, time.Now().Add(-time.Second)
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end) && !led; time.Sleep(2 * time.Millisecond) {
		if l := c.nsLeader(); l == 3 {
			led = true
		} else if l != 0 && time.Since(last) > 500*time.Millisecond {
			c.servers[l].nsGroup.TransferLeader(3)
			last = time.Now()
		}
	}
	if !led {
		t.Fatal("node 3 never became leader: the hand-over is not tested")
	}
	waitFor(t, 20*time.Second, "a leader other than the halted node", func() bool { l := c.nsLeader(); return l != 0 && l != 3 })
	// Upgrade node 3: it resumes from the halt index.
	old.Store(false)
	c.restartNode(3)
	cl = c.client() // node 3 listens on a new address
	s3 = c.servers[3]
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "last"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "identical replicas", func() bool {
		var sums []string
		var idx []uint64
		for id := uint64(1); id <= 3; id++ {
			s := c.servers[id]
			if s.nsState.Halted() != nil {
				t.Fatalf("node %d halted after the upgrade", id)
			}
			idx = append(idx, s.nsState.Store().AppliedIndex())
			sums = append(sums, pebbleSum(t, s))
		}
		return idx[0] == idx[1] && idx[1] == idx[2] && sums[0] == sums[1] && sums[1] == sums[2]
	})
	if _, err := s3.nsState.GetBucket("vol", "newop"); err != nil {
		t.Fatalf("upgraded node 3: %v", err)
	}
}

// proposeUnknownToNode3 proposes, through a leader other than node 3, a
// CreateBucket of volume "vol" bypassing the layout gate (node 3 does not
// know the op: it halts there) and returns the entry's index.
func proposeUnknownToNode3(t *testing.T, c *cluster) uint64 {
	t.Helper()
	ctx := context.Background()
	// Propose through a leader other than node 3.
	waitFor(t, 20*time.Second, "a leader other than node 3", func() bool {
		if l := c.nsLeader(); l == 3 {
			c.servers[3].nsGroup.TransferLeader(1)
			time.Sleep(100 * time.Millisecond)
		}
		l := c.nsLeader()
		return l != 0 && l != 3
	})
	leader := c.servers[c.nsLeader()]
	cmd, _ := proto.Marshal(&metapb.NsCommand{NowUnixMs: time.Now().UnixMilli(), Op: &metapb.NsCommand_CreateBucket{CreateBucket: &metapb.CreateBucketRequest{Volume: "vol", Name: "newop"}}})
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	res, err := leader.nsGroup.Propose(pctx, cmd, nil)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	return res.Index
}

func hasReason(err error, reason string) bool {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.Reason == reason {
			return true
		}
	}
	return false
}

// pebbleSum hashes every namespace row of s (not the store's own applied
// index row).
func pebbleSum(t *testing.T, s *Server) string { return storeSum(t, s.nsState.Store()) }

func gaugeValue(t *testing.T, s *Server, name string) float64 {
	mfs, err := s.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestBatchWritesFallBackBeforeFinalize: binaries with OpenKeys and
// CommitKeys as features one layout above the cluster's refuse the
// batch calls before the log (LAYOUT_NOT_FINALIZED) and metaclient's
// coalescers fall back to single calls: every small write succeeds.
// After finalize the batch calls work.
func TestBatchWritesFallBackBeforeFinalize(t *testing.T) {
	c, admin, ctx := lookupCluster(t, 1)
	// The fresh cluster is finalized at this binary's layout; the test
	// features come one above it.
	base := namespace.SoftwareLayoutVersion()
	waitFor(t, 20*time.Second, "the fresh cluster's layout", func() bool {
		for _, s := range c.servers {
			if !s.nsState.LayoutRecorded() {
				return false
			}
		}
		return true
	})
	defer namespace.RegisterLayoutFeature(namespace.LayoutFeature{Name: "test-open-keys", Version: base + 1, Op: 1400})()
	defer namespace.RegisterLayoutFeature(namespace.LayoutFeature{Name: "test-commit-keys", Version: base + 1, Op: 1401})()
	if v := c.servers[1].nsState.FinalizedLayout(); v != base {
		t.Fatalf("finalized %d, want %d", v, base)
	}
	mustOK(t, "bucket", func() error {
		_, err := admin.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "fallback"})
		return err
	}())
	_, err := admin.Namespace.OpenKeys(ctx, &metapb.OpenKeysRequest{Requests: []*metapb.OpenKeyRequest{{Volume: "vol", Bucket: "fallback", Key: "x"}}})
	if !metaclient.LayoutNotFinalized(err) {
		t.Fatalf("OpenKeys before finalize: %v", err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 32)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, errs[i] = smallPut(ctx, admin, "fallback", fmt.Sprintf("k%02d", i), 100)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("small write %d before finalize: %v", i, err)
		}
	}
	r, err := admin.Namespace.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "fallback"})
	if err != nil || len(r.Keys) != len(errs) {
		t.Fatalf("keys %d, %v", len(r.GetKeys()), err)
	}
	if f, err := admin.Upgrade.FinalizeLayout(ctx, &metapb.FinalizeLayoutRequest{}); err != nil || f.FinalizedVersion != base+1 {
		t.Fatalf("finalize: %v %v", f, err)
	}
	if _, err := admin.Namespace.OpenKeys(ctx, &metapb.OpenKeysRequest{Requests: []*metapb.OpenKeyRequest{{Volume: "vol", Bucket: "fallback", Key: "x"}}}); err != nil {
		t.Fatalf("OpenKeys after finalize: %v", err)
	}
}

// TestHaltedReplicaRefusesS3Keys: raft's read index passes on a halted
// replica (raft's applied index moves on past the halt, its state does
// not), so an access key deleted after the halt still resolved there
// (s3Secret, the user-token check's key cache). Both refuse on a halted
// replica now, and so does proposeLayout (it went to the log directly,
// without the halt check and the outcome-unknown mapping).
func TestHaltedReplicaRefusesS3Keys(t *testing.T) {
	defer namespace.RegisterLayoutFeature(namespace.LayoutFeature{Name: "test-create-bucket", Version: 2, Op: 4, Description: "test only"})()
	var old atomic.Bool
	old.Store(true)
	c := oldReplicaCluster(t, &old)
	ctx := context.Background()
	waitFor(t, 20*time.Second, "the service token", func() bool { return c.servers[1].ServiceToken() != "" })
	cl, err := metaclient.New(metaclient.Config{Addrs: c.addrs(), ServiceToken: c.servers[1].ServiceToken(), CallTimeout: 20 * time.Second, DialOptions: clientDial()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	const ak = "AKIDREVOKED"
	if _, err := cl.Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: ak}); err != nil {
		t.Fatal(err)
	}
	s3 := c.servers[3]
	waitFor(t, 20*time.Second, "node 3 has the key", func() bool { return s3.s3Keys.get(s3, ak).exists })
	haltAt := proposeUnknownToNode3(t, c)
	waitFor(t, 20*time.Second, "node 3 halted", func() bool { return s3.nsState.Halted() != nil })
	if _, err := cl.Namespace.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: ak}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint64{1, 2} {
		s := c.servers[id]
		waitFor(t, 20*time.Second, "the deletion applied", func() bool { return !s.s3Keys.get(s, ak).exists })
	}
	// Raft's read index on node 3 passes past the halt: what made the
	// stale key visible.
	waitFor(t, 20*time.Second, "node 3's raft applied index past the halt", func() bool { return s3.nsGroup.Status().Applied > haltAt })
	if k := s3.s3Keys.get(s3, ak); k.exists {
		t.Fatal("the halted replica's token check still sees the deleted key")
	}
	sec, err := s3.s3Secret(ctx, ak)
	if !hasReason(err, metapb.ReasonReplicaHalted) {
		t.Fatalf("s3Secret on the halted replica: %v, %v", sec, err)
	}
	_, err = s3.proposeLayout(ctx, &metapb.LayoutOp{Version: 1})
	if !hasReason(err, metapb.ReasonReplicaHalted) {
		t.Fatalf("proposeLayout on the halted replica: %v", err)
	}
}
