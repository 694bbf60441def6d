package meta

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// TestRecoverContainerAdminOnly: RecoverContainer (basalt admin container
// recover) changes what SCM counts as a replica: a user who is not an
// admin is refused before SCM looks at the container, even for its
// progress; an admin gets SCM's answer (here: refused, the container has
// no unhealthy replica). Fails if the RPC is missing from adminMethods.
func TestRecoverContainerAdminOnly(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	admin := c.client() // "test", an admin
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	registerDatanodes(t, admin, 3)
	var cid uint64
	waitFor(t, 10*time.Second, "containers", func() bool {
		r, err := admin.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		if err != nil || len(r.Containers) == 0 {
			return false
		}
		cid = r.Containers[0].Id
		return true
	})
	bob := c.userClient("bob")
	_, err := bob.Scm.RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: cid})
	wantDenied(t, "bob recovers a container", err)
	_, err = bob.Scm.RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: cid, StatusOnly: true})
	wantDenied(t, "bob reads a recovery's progress", err)
	_, err = admin.Scm.RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: cid})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("admin recovers a container with no unhealthy replica: %v, want FailedPrecondition", err)
	}
}

// TestRecoverContainerRefusedBeforeFinalize (review nit 10): the SCM
// group has no layout gate, and a meta node on an older binary halts at
// the first ReplicaRecoveredOp; so a recovery is not started while the
// cluster's upgrade is not finalized (this binary knows a newer layout
// than the finalized one); its progress can still be read. Fails without
// the check in scmServer.RecoverContainer.
func TestRecoverContainerRefusedBeforeFinalize(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	admin := c.client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })
	waitFor(t, 20*time.Second, "the fresh cluster's layout", func() bool { return c.servers[1].nsState.LayoutRecorded() })
	registerDatanodes(t, admin, 3)
	var cid uint64
	waitFor(t, 10*time.Second, "containers", func() bool {
		r, err := admin.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		if err != nil || len(r.Containers) == 0 {
			return false
		}
		cid = r.Containers[0].Id
		return true
	})
	base := namespace.SoftwareLayoutVersion()
	defer namespace.RegisterLayoutFeature(namespace.LayoutFeature{Name: "test-recover-gate", Version: base + 1, Op: 9990})()
	_, err := admin.Scm.RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: cid})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "not finalized") {
		t.Fatalf("recover before finalize: %v, want FailedPrecondition, not finalized", err)
	}
	if _, err := admin.Scm.RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: cid, StatusOnly: true}); err != nil {
		t.Fatalf("progress before finalize: %v", err)
	}
}
