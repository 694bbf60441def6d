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
// replica's report and BCSID, and the container's floor
// (Container.bcsid_floor): it proposes a BCSID below the floor only when
// the operator accepted that floor (countableLocked). Apply refuses
// nothing on account of the floor: the floor is state an older binary
// does not keep, and a refusal that depends on it would make replicas of
// mixed versions diverge in unhealthy_replicas (an older leader's op
// would apply on old replicas and be refused on new ones). So the op
// applies the same everywhere; only the floor (new state) depends on
// it: an op whose accepted_floor is at least the floor lowers it to the
// recovered BCSID, so the replication manager copies the container from
// it. The race: a floor raised between the leader's decision and the
// apply (a drop, or the close) leaves the op applied with the floor
// unchanged; the replica is then off unhealthy_replicas but below the
// floor, so the replication manager takes it for lagging (never a
// source, never counted) rather than losing anything.
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
	if op.Bcsid < floor.GetBcsid() && op.AcceptedFloor >= floor.GetBcsid() {
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
