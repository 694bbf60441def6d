package meta

import (
	"context"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// openKeyWhenPipeline opens a key, waiting (bounded) while SCM has no
// open pipeline to allocate from: an UNHEALTHY report closes the
// replica's pipeline, and the SCM loop (slow on a loaded machine) opens
// the next one. Any other error fails the test.
func openKeyWhenPipeline(t *testing.T, ctx context.Context, cl metapb.NamespaceClient, req *metapb.OpenKeyRequest) *metapb.OpenKeyResponse {
	t.Helper()
	var o *metapb.OpenKeyResponse
	var err error
	waitFor(t, 20*time.Second, "an open pipeline to allocate from", func() bool {
		o, err = cl.OpenKey(ctx, req)
		return status.Code(err) != codes.FailedPrecondition
	})
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// A replica a datanode reports UNHEALTHY is recorded (through Raft), its
// container gets no more blocks, and neither LookupKey nor GetContainers
// offers it as a location.
func TestUnhealthyReplicaIsNoLocation(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3, PipelineLimit: 1, OpenContainersPerPipeline: 1})
	cl := c.client()
	ctx := context.Background()
	waitFor(t, 5*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	registerDatanodes(t, cl, 3)
	waitFor(t, 5*time.Second, "containers", func() bool {
		r, err := cl.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) >= 4
	})
	o := openKeyWhenPipeline(t, ctx, cl.Namespace, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"})
	blk := o.Blocks[0]
	if _, err := cl.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: blk.Id, Length: 42}}}); err != nil {
		t.Fatal(err)
	}
	cid, bad := blk.Id.ContainerId, blk.Datanodes[0].Id
	if _, err := dnScm(t, cl, bad).Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: bad, FullReport: true,
		Containers: []*metapb.ContainerReport{{ContainerId: cid, State: metapb.ContainerState_CONTAINER_UNHEALTHY}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the unhealthy replica recorded", func() bool {
		r, err := cl.Scm.GetContainers(ctx, &metapb.GetContainersRequest{ContainerIds: []uint64{cid}})
		return err == nil && slices.Contains(r.Containers[0].Container.UnhealthyReplicas, bad)
	})
	has := func(dns []*metapb.DatanodeDetails) bool {
		return slices.ContainsFunc(dns, func(d *metapb.DatanodeDetails) bool { return d.Id == bad })
	}
	r, err := cl.Scm.GetContainers(ctx, &metapb.GetContainersRequest{ContainerIds: []uint64{cid}})
	if err != nil || len(r.Containers[0].Datanodes) != 2 || has(r.Containers[0].Datanodes) {
		t.Fatalf("GetContainers: %v, %v; want the 2 healthy replicas", r, err)
	}
	if st := r.Containers[0].Container.State; st == metapb.ContainerState_CONTAINER_OPEN {
		t.Fatalf("container %d still OPEN", cid)
	}
	ki, err := cl.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"})
	if err != nil || len(ki.Locations[0].Datanodes) != 2 || has(ki.Locations[0].Datanodes) {
		t.Fatalf("LookupKey: %v, %v; want the 2 healthy replicas", ki, err)
	}
	for range 10 {
		o := openKeyWhenPipeline(t, ctx, cl.Namespace, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k2"})
		if o.Blocks[0].Id.ContainerId == cid {
			t.Fatalf("block allocated in container %d after its replica %d reported UNHEALTHY", cid, bad)
		}
	}
}

// A corruption report condemns a replica only when it comes from the
// datanode holding it, as its certificate shows: a client's report, or
// another datanode's, is stored and listed, and the replica stays.
func TestCorruptReportCondemnsOnlyFromHolder(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3, PipelineLimit: 1, OpenContainersPerPipeline: 1})
	cl := c.client()
	ctx := context.Background()
	waitFor(t, 5*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	registerDatanodes(t, cl, 3)
	waitFor(t, 5*time.Second, "containers", func() bool {
		r, err := cl.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) >= 4
	})
	o := openKeyWhenPipeline(t, ctx, cl.Namespace, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"})
	blk := o.Blocks[0]
	cid, victim, other := blk.Id.ContainerId, blk.Datanodes[0].Id, blk.Datanodes[1].Id
	report := func(s metapb.ScmClient, lid uint64) {
		t.Helper()
		if _, err := s.ReportCorruptReplica(ctx, &metapb.ReportCorruptReplicaRequest{Block: &metapb.BlockID{ContainerId: cid, LocalId: lid},
			DatanodeId: victim, Reason: "checksum mismatch"}); err != nil {
			t.Fatal(err)
		}
	}
	condemned := func() bool {
		r, err := cl.Scm.GetContainers(ctx, &metapb.GetContainersRequest{ContainerIds: []uint64{cid}})
		return err == nil && slices.Contains(r.Containers[0].Container.UnhealthyReplicas, victim)
	}
	report(cl.Scm, 1)              // a client
	report(dnScm(t, cl, other), 2) // another datanode
	waitFor(t, 5*time.Second, "both reports stored", func() bool {
		r, err := cl.Scm.ListCorruptReplicas(ctx, &metapb.ListCorruptReplicasRequest{})
		return err == nil && len(r.Replicas) == 2
	})
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if condemned() {
			t.Fatalf("replica %d of container %d condemned on a client's or another datanode's report", victim, cid)
		}
	}
	report(dnScm(t, cl, victim), 3) // the holder itself (its scrubber)
	waitFor(t, 5*time.Second, "the replica condemned on its datanode's report", condemned)
}
