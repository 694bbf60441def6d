package datanode_test

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

func deleteCmd(tx uint64, b *metapb.BlockLocation) *metapb.DatanodeCommand {
	return &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_DeleteBlocks{DeleteBlocks: &metapb.DeleteBlocksCommand{
		TxId: tx, ContainerId: b.GetId().GetContainerId(), LocalIds: []uint64{b.GetId().GetLocalId()}}}}
}

func committed(dn *datanode.Datanode, b *metapb.BlockLocation) bool {
	_, err := dn.Store().GetBlock(storage.ContainerID(b.GetId().GetContainerId()), storage.LocalID(b.GetId().GetLocalId()))
	return err == nil
}

// roles returns the pipeline's leader and its followers.
func (e *env) roles(b *metapb.BlockLocation) (leader *datanode.Datanode, followers []*datanode.Datanode) {
	e.t.Helper()
	e.leaderClient(b.GetPipelineId()) // waits for a leader
	for _, d := range b.GetDatanodes() {
		_, dn := e.byID(d.GetId())
		if dn.IsPipelineLeader(b.GetPipelineId()) {
			leader = dn
		} else {
			followers = append(followers, dn)
		}
	}
	return leader, followers
}

// TestDeleteAckForUnhealthyContainer (scenario 8): a delete transaction
// for a container that is UNHEALTHY on this replica used to fail on every
// heartbeat and never be acknowledged, so SCM waited forever. It is
// acknowledged with DELETE_CONTAINER_UNHEALTHY.
func TestDeleteAckForUnhealthyContainer(t *testing.T) {
	e := startEnv(t)
	b := e.block()
	data := randBytes(3000, 1)
	if _, err := e.putSmall(b, smallBlock(b, data), data); err != nil {
		t.Fatal(err)
	}
	_, followers := e.roles(b)
	f := followers[0]
	if err := f.Store().MarkUnhealthy(storage.ContainerID(b.GetId().GetContainerId()), "test"); err != nil {
		t.Fatal(err)
	}
	if err := f.Execute(deleteCmd(77, b)); err != nil {
		t.Fatalf("delete on an UNHEALTHY container: %v", err)
	}
	if st, ok := f.DeleteAck(77); !ok || st != metapb.DeleteTxStatus_DELETE_TX_CONTAINER_UNHEALTHY {
		t.Fatalf("acknowledgement of tx 77: %v %v, want DELETE_TX_CONTAINER_UNHEALTHY", st, ok)
	}

	// A container this datanode does not hold is missing here, not done:
	// SCM must not count this replica as a copy of it.
	missing := &metapb.BlockLocation{Id: &metapb.BlockID{ContainerId: 1 << 40, LocalId: 1}}
	if err := f.Execute(deleteCmd(79, missing)); err != nil {
		t.Fatal(err)
	}
	if st, ok := f.DeleteAck(79); !ok || st != metapb.DeleteTxStatus_DELETE_TX_CONTAINER_MISSING {
		t.Fatalf("acknowledgement of tx 79 (container not here): %v %v, want DELETE_TX_CONTAINER_MISSING", st, ok)
	}
}

// TestDeleteThroughPipelineLog (scenario 8): deletes in an open pipeline's
// container go through its log, proposed by the leader, and only once
// every replica applied the blocks' PutBlocks. They used to be carried out
// on each replica as the heartbeat brought them, so a follower that was
// down while a block was written found, when it came back, that the
// leader had deleted the data it needed resent, and committed nothing.
func TestDeleteThroughPipelineLog(t *testing.T) {
	e := startEnv(t)
	ctx := testCtx(t)
	b := e.block()
	leader, followers := e.roles(b)
	down := followers[0]
	di, _ := e.byID(down.ID())
	downID := down.ID()
	if err := e.c.StopDatanode(di); err != nil {
		t.Fatal(err)
	}

	// Written and committed on two of three replicas.
	data := randBytes(100_000, 2)
	id := &datanodepb.BlockID{ContainerId: b.GetId().GetContainerId(), LocalId: b.GetId().GetLocalId()}
	ci := chunkOf(0, data)
	lc := dnClient(t, leader.Addr())
	if _, err := lc.WriteChunk(ctx, &datanodepb.WriteChunkRequest{PipelineId: b.GetPipelineId(), Block: id, Chunk: ci, Data: data}); err != nil {
		t.Fatal(err)
	}
	if _, err := lc.PutBlock(ctx, &datanodepb.PutBlockRequest{PipelineId: b.GetPipelineId(),
		Block: &datanodepb.BlockData{Id: id, Length: uint64(len(data)), Chunks: []*datanodepb.ChunkInfo{ci}}}); err != nil {
		t.Fatal(err)
	}

	// A follower that has the block leaves the delete to the leader; the
	// leader does not delete what the down replica still needs.
	up := followers[1]
	waitFor(t, 20*time.Second, "the running follower to commit the block", func() bool { return committed(up, b) })
	if err := up.Execute(deleteCmd(78, b)); err != nil {
		t.Fatal(err)
	}
	if err := leader.Execute(deleteCmd(78, b)); err != nil {
		t.Fatal(err)
	}
	if !committed(up, b) || !committed(leader, b) {
		t.Fatal("block deleted while a replica has not applied its PutBlock")
	}
	if _, ok := leader.DeleteAck(78); ok {
		t.Fatal("leader acknowledged a delete it did not carry out")
	}

	// The replica comes back and catches up from the leader's data.
	rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := e.c.RestartDatanode(rctx, di); err != nil {
		t.Fatal(err)
	}
	_, down = e.byID(downID)
	waitFor(t, 30*time.Second, "the restarted replica to commit the block", func() bool { return committed(down, b) })

	// Now the delete goes through the log: every replica deletes and
	// acknowledges it.
	waitFor(t, 30*time.Second, "every replica to delete the block", func() bool {
		// As SCM does: send it again until every replica acknowledged.
		ld, _ := e.roles(b)
		if err := ld.Execute(deleteCmd(78, b)); err != nil {
			t.Fatal(err)
		}
		for _, d := range b.GetDatanodes() {
			_, dn := e.byID(d.GetId())
			if st, ok := dn.DeleteAck(78); committed(dn, b) || !ok || st != metapb.DeleteTxStatus_DELETE_TX_DONE {
				return false
			}
		}
		return true
	})
}
