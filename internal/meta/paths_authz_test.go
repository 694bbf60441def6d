package meta

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// TestDatanodePathsAdminsOnly: ListDatanodes shows a datanode's volume and
// slow-disk paths to admins only; another user and a datanode get
// hiddenPath, and the manager's state keeps the real paths (the answer is
// a copy). Fails without showsPaths/hideDatanodePaths.
func TestDatanodePathsAdminsOnly(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	admin := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	ids := registerDatanodes(t, admin, 1)
	dc := dnClient(t, admin, "uuid-0")
	const vol, slow = "/srv/disk7/basalt", "/srv/log3/raft"
	if _, err := dc.Scm.Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: ids[0],
		Volumes:   []*metapb.VolumeReport{{Path: vol, CapacityBytes: 1 << 40}},
		SlowDisks: []*metapb.SlowDisk{{Path: slow, Kind: "log"}}}); err != nil {
		t.Fatal(err)
	}
	paths := func(who string, r *metapb.ListDatanodesResponse) (v, s string) {
		t.Helper()
		if len(r.Datanodes) != 1 || len(r.Datanodes[0].Volumes) != 1 || len(r.Datanodes[0].SlowDisks) != 1 {
			t.Fatalf("%s: %v", who, r)
		}
		return r.Datanodes[0].Volumes[0].Path, r.Datanodes[0].SlowDisks[0].Path
	}
	for _, who := range []string{"bob", "datanode", "admin", "bob again"} {
		cl := admin
		switch who {
		case "bob", "bob again":
			cl = c.userClient("bob")
		case "datanode":
			cl = dc
		}
		r, err := cl.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
		if err != nil {
			t.Fatalf("%s: %v", who, err)
		}
		v, s := paths(who, r)
		want, wantSlow := hiddenPath, hiddenPath
		if who == "admin" {
			want, wantSlow = vol, slow
		}
		if v != want || s != wantSlow {
			t.Fatalf("%s sees volume %q, slow disk %q; want %q, %q", who, v, s, want, wantSlow)
		}
	}
}

// TestPipelineSlowDiskReasonHidden: the close reason of a pipeline closed
// for a slow disk keeps its datanode but not its path for non-admins, and
// the state's pipeline is not changed.
func TestPipelineSlowDiskReasonHidden(t *testing.T) {
	p := &metapb.Pipeline{Id: 4, CloseReason: "slow disk on datanode 2: /srv/log3/raft"}
	q := &metapb.Pipeline{Id: 5, CloseReason: "datanode 3 is DEAD"}
	out := hidePipelinePaths([]*metapb.Pipeline{p, q})
	if got := out[0].CloseReason; got != "slow disk on datanode 2: "+hiddenPath {
		t.Fatalf("hidden reason %q", got)
	}
	if out[1] != q || p.CloseReason != "slow disk on datanode 2: /srv/log3/raft" {
		t.Fatalf("state changed or other reason copied: %v %v", p, out[1])
	}
}
