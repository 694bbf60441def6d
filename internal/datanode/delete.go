package datanode

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// Block deletion. SCM sends a delete-blocks transaction to every replica
// of the container in heartbeat responses until each acknowledges it.
//
// A container of an open pipeline is written through the pipeline's log,
// so it is deleted from there too: the pipeline's leader proposes the
// delete (DeleteBlocksCmd with the transaction ID) and every replica
// deletes at the same point of the log, after the PutBlocks of those
// blocks, and acknowledges the transaction when it applied the entry. The
// leader proposes only once every replica has applied the PutBlocks of
// the blocks it deletes (the highest BCSID among them), so no replica can
// still need their data: not to apply, nor from a resend by the leader.
// Until then the transaction stays unacknowledged and SCM sends it again.
// Followers leave the command to the leader.
//
// A container with no open pipeline here (closed, or its pipeline gone) is
// deleted from directly. Every transaction is answered with a status
// (metapb.DeleteTxAck): DONE; CONTAINER_UNHEALTHY when the replica is
// UNHEALTHY or on a failed volume (it can never carry the transaction out,
// and SCM stops waiting for it); CONTAINER_MISSING when this datanode does
// not hold the container at all. Nothing is left for SCM to wait on forever.

// deleteAck is one acknowledgement for SCM.
type deleteAck struct {
	tx, cid uint64
	status  metapb.DeleteTxStatus
	reason  string
}

// maxPendingAcks bounds the acknowledgements waiting for a heartbeat that
// gets through; past it the oldest are dropped (SCM sends those again).
// maxAcksPerHeartbeat is SCM's limit per heartbeat.
const (
	maxPendingAcks      = 1 << 16
	maxAcksPerHeartbeat = 4096
	maxAckMessage       = 256
)

// ack queues an acknowledgement for the next heartbeat.
func (d *Datanode) ack(a deleteAck) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.acks[a.tx]; ok {
		return
	}
	if len(d.ackOrder) >= maxPendingAcks {
		delete(d.acks, d.ackOrder[0])
		d.ackOrder = d.ackOrder[1:]
	}
	d.acks[a.tx] = a
	d.ackOrder = append(d.ackOrder, a.tx)
	if len(d.recentAcks) >= maxRecentAcks {
		d.recentAcks = d.recentAcks[1:]
	}
	d.recentAcks = append(d.recentAcks, a)
}

// maxRecentAcks bounds the acknowledgements kept for DeleteAck.
const maxRecentAcks = 1024

// takeAcks puts the oldest queued acknowledgements into a heartbeat; it
// returns them, to clear (clearAcks) once SCM received the heartbeat.
func (d *Datanode) takeAcks(req *metapb.HeartbeatRequest) []uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	sent := append([]uint64(nil), d.ackOrder[:min(len(d.ackOrder), maxAcksPerHeartbeat)]...)
	for _, tx := range sent {
		a := d.acks[tx]
		msg := a.reason
		if len(msg) > maxAckMessage {
			msg = msg[:maxAckMessage]
		}
		req.DeleteAcks = append(req.DeleteAcks, &metapb.DeleteTxAck{TxId: tx, Status: a.status, Message: msg})
	}
	return sent
}

func (d *Datanode) clearAcks(sent []uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, tx := range sent {
		delete(d.acks, tx)
	}
	kept := d.ackOrder[:0]
	for _, tx := range d.ackOrder {
		if _, ok := d.acks[tx]; ok {
			kept = append(kept, tx)
		}
	}
	d.ackOrder = kept
}

// DeleteAck reports whether this datanode acknowledged delete
// transaction tx recently (queued for, or sent in, a heartbeat) and with
// what status. For tests and operators.
func (d *Datanode) DeleteAck(tx uint64) (metapb.DeleteTxStatus, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := len(d.recentAcks) - 1; i >= 0; i-- {
		if a := d.recentAcks[i]; a.tx == tx {
			return a.status, true
		}
	}
	return 0, false
}

// deleteOutcome turns the result of a deletion into an acknowledgement,
// or nil if it should be tried again later (a transient error).
func deleteOutcome(tx, cid uint64, err error) *deleteAck {
	a := &deleteAck{tx: tx, cid: cid, status: metapb.DeleteTxStatus_DELETE_TX_DONE}
	switch {
	case err == nil:
	case errors.Is(err, storage.ErrContainerNotFound):
		a.status, a.reason = metapb.DeleteTxStatus_DELETE_TX_CONTAINER_MISSING, err.Error()
	case errors.Is(err, storage.ErrVolumeFailed), errors.Is(err, storage.ErrContainerNotOpen):
		// DeleteBlocks refuses only an UNHEALTHY container as not open.
		a.status, a.reason = metapb.DeleteTxStatus_DELETE_TX_CONTAINER_UNHEALTHY, err.Error()
	default:
		return nil
	}
	return a
}

// pipelineOf returns the open pipeline (here) whose container cid is.
func (d *Datanode) pipelineOf(cid uint64) (uint64, *containerSM) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, sm := range d.sms {
		if sm.hasContainer(cid) {
			return id, sm
		}
	}
	return 0, nil
}

// executeDelete carries out (or routes) one delete-blocks command from SCM.
func (d *Datanode) executeDelete(del *metapb.DeleteBlocksCommand) error {
	tx, cid := del.GetTxId(), del.GetContainerId()
	lids := make([]storage.LocalID, len(del.GetLocalIds()))
	for i, l := range del.GetLocalIds() {
		lids[i] = storage.LocalID(l)
	}
	rep, err := d.store.Container(storage.ContainerID(cid))
	if err != nil {
		if a := deleteOutcome(tx, cid, err); a != nil {
			d.ack(*a)
			return nil
		}
		return err
	}
	if rep.State == storage.StateUnhealthy {
		a := deleteAck{tx: tx, cid: cid, status: metapb.DeleteTxStatus_DELETE_TX_CONTAINER_UNHEALTHY,
			reason: fmt.Sprintf("container %d is UNHEALTHY on datanode %d", cid, d.ident.ID)}
		if v := d.failedVolume(rep.Volume); v != "" {
			a.reason = v
		}
		d.ack(a)
		return nil
	}
	if rep.State == storage.StateOpen || rep.State == storage.StateClosing {
		if pid, _ := d.pipelineOf(cid); pid != 0 {
			if _, err := d.host.Group(pid); err == nil {
				return d.proposeDelete(pid, tx, storage.ContainerID(cid), lids)
			}
		}
	}
	err = deleteBlocks(d.store, storage.ContainerID(cid), lids)
	if a := deleteOutcome(tx, cid, err); a != nil {
		d.ack(*a)
		return nil
	}
	return err
}

func (d *Datanode) failedVolume(path string) string {
	for _, v := range d.store.Volumes() {
		if v.Path == path && v.Failed {
			return fmt.Sprintf("volume %s failed: %s", v.Path, v.Error)
		}
	}
	return ""
}

// proposeDelete sends a delete through the pipeline's log, on the leader,
// once every replica applied the blocks' PutBlocks (see the top of this
// file). It proposes in the background: the command loop (commands.go)
// does not wait for the pipeline.
func (d *Datanode) proposeDelete(pipeline, tx uint64, cid storage.ContainerID, lids []storage.LocalID) error {
	g, err := d.host.Group(pipeline)
	if err != nil || !g.IsLeader() {
		return nil // the leader proposes it; this replica acknowledges on apply
	}
	var need uint64
	for _, lid := range lids {
		if bd, err := d.store.GetBlock(cid, lid); err == nil {
			need = max(need, bd.BCSID)
		}
	}
	st := g.Status()
	for _, v := range st.Voters {
		if v == d.ident.ID {
			continue
		}
		if f, ok := st.Followers[v]; !ok || f.Applied < need {
			d.log.Debug("delete waits for a replica to apply its blocks", "pipeline", pipeline, "tx", tx, "replica", v, "need", need)
			return nil // SCM sends it again
		}
	}
	d.mu.Lock()
	if d.proposingDel[tx] || len(d.proposingDel) >= maxProposingDeletes {
		d.mu.Unlock()
		return nil
	}
	d.proposingDel[tx] = true
	d.mu.Unlock()
	ids := make([]uint64, len(lids))
	for i, l := range lids {
		ids[i] = uint64(l)
	}
	meta := mustMarshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_DeleteBlocks{
		DeleteBlocks: &datanodepb.DeleteBlocksCmd{ContainerId: uint64(cid), LocalIds: ids, TxId: tx}}})
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer func() {
			d.mu.Lock()
			delete(d.proposingDel, tx)
			d.mu.Unlock()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		go func() {
			select {
			case <-d.stopc:
				cancel()
			case <-ctx.Done():
			}
		}()
		if _, err := g.Propose(ctx, meta, nil); err != nil {
			d.log.Warn("delete through the pipeline failed; SCM will send it again", "pipeline", pipeline, "tx", tx, "err", err)
		}
	}()
	return nil
}

// maxProposingDeletes bounds the delete proposals in flight.
const maxProposingDeletes = 256

// deleteBlocks deletes blocks from storage. Blocks that were allocated but
// never committed here (an abandoned write, a spare block) are not "not
// found" errors: their uncommitted data, if any, is discarded, and the
// deletion counts as done, so SCM stops resending it.
func deleteBlocks(store *storage.Store, cid storage.ContainerID, lids []storage.LocalID) error {
	err := store.DeleteBlocks(cid, lids)
	switch {
	case err == nil:
		return nil
	case !errors.Is(err, storage.ErrBlockNotFound):
		return err
	}
	for _, lid := range lids {
		err := store.DeleteBlocks(cid, []storage.LocalID{lid})
		if errors.Is(err, storage.ErrBlockNotFound) {
			err = store.AbortBlock(cid, lid)
		}
		if err != nil && !errors.Is(err, storage.ErrBlockNotFound) {
			return err
		}
	}
	return nil
}
