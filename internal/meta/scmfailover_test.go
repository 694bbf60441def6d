package meta

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// TestScmFailoverAllocatesWithoutReports: when the SCM leader dies, the
// new one allocates blocks on the recorded pipelines at once, although no
// datanode has reported to it (here none ever does: the datanodes are
// only registered). Before, it stayed in safe mode and failed every
// allocation with "in safe mode: 0 of 3 datanodes reported" until enough
// datanodes found it — which datanodes stuck on a hung old leader never
// do.
func TestScmFailoverAllocatesWithoutReports(t *testing.T) {
	c := newCluster(t, 3, scm.Config{LoopInterval: 50 * time.Millisecond, SafeModeMinDatanodes: 3, PipelineLimit: 1,
		HeartbeatInterval: time.Second, StaleInterval: 60 * time.Second, DeadInterval: 120 * time.Second})
	cl := c.client()
	ctx := context.Background()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	registerDatanodes(t, cl, 3)
	open := func() error {
		octx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := cl.Namespace.OpenKey(octx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k", Replication: metapb.Replication_THREE})
		return err
	}
	waitFor(t, 10*time.Second, "a first allocation", func() bool { return open() == nil })
	var old uint64
	for id, s := range c.servers {
		if s.scmGroup.IsLeader() {
			old = id
		}
	}
	if old == 0 || !c.servers[old].scmState.SafeModeExited() {
		t.Fatalf("scm leader %d; safe mode exit recorded: %v", old, old != 0 && c.servers[old].scmState.SafeModeExited())
	}
	killed := time.Now()
	c.servers[old].Close()
	delete(c.servers, old)
	var err error
	for {
		if err = open(); err == nil {
			break
		}
		if time.Since(killed) > 15*time.Second {
			t.Fatalf("no allocation within 15 s of the SCM leader's death: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("SCM leader %d killed; a block allocated %v later, with no datanode report to the new leader", old, time.Since(killed).Round(time.Millisecond))
}
