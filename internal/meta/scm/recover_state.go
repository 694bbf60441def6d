package scm

import (
	"fmt"
	"slices"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// applyReplicaRecovered takes a recovered replica off its container's
// unhealthy_replicas (basalt admin container recover, recover.go) and
// drops the reports against it (its datanode verified every committed
// block before it reported the replica CLOSED). It returns whether the
// record changed: a repeat changes nothing. The leader checked the
// replica's report and BCSID; Apply re-checks what the state shows: a
// BCSID below the container's floor (Container.bcsid_floor) is refused
// unless the op says the operator accepted that floor (accepted_floor at
// least the floor: a floor raised since the leader decided is refused);
// an accepted one lowers the floor to the recovered BCSID, so the
// replication manager copies the container from it.
func (s *State) applyReplicaRecovered(b *pebble.Batch, op *metapb.ReplicaRecoveredOp, now int64) any {
	c := s.containers[op.ContainerId]
	if c == nil {
		return status.Errorf(codes.NotFound, "replica recovered: container %d not found", op.ContainerId)
	}
	if c.State == metapb.ContainerState_CONTAINER_OPEN {
		return status.Errorf(codes.FailedPrecondition, "replica recovered: container %d is OPEN", c.Id)
	}
	if !slices.Contains(c.Replicas, op.DatanodeId) || !slices.Contains(c.UnhealthyReplicas, op.DatanodeId) {
		return false
	}
	floor := c.GetBcsidFloor()
	if op.Bcsid < floor.GetBcsid() {
		if op.AcceptedFloor < floor.GetBcsid() {
			return status.Errorf(codes.FailedPrecondition, "replica recovered: container %d replica on datanode %d has BCSID %d, below the container's floor %d (%s), not accepted (accepted floor %d)",
				c.Id, op.DatanodeId, op.Bcsid, floor.GetBcsid(), floor.GetReason(), op.AcceptedFloor)
		}
		floor = &metapb.BcsidFloor{Bcsid: op.Bcsid, DatanodeId: 0, UnixMs: now,
			Reason: truncReason(fmt.Sprintf("lowered from %d by a recovery the operator accepted (datanode %d): %s", floor.GetBcsid(), op.DatanodeId, op.Reason))}
	}
	s.dropReports(b, c.Id, op.DatanodeId)
	c = proto.Clone(c).(*metapb.Container)
	c.BcsidFloor = floor
	c.UnhealthyReplicas = slices.DeleteFunc(c.UnhealthyReplicas, func(r uint64) bool { return r == op.DatanodeId })
	s.setContainer(c)
	s.put(b, key(pfxContainer, c.Id), c)
	return true
}
