package datanode

import (
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestDeleteAcksBounded: a heartbeat carries at most SCM's limit of
// acknowledgements (the rest go in the next ones) with messages cut to
// what SCM keeps, and the queue itself is bounded.
func TestDeleteAcksBounded(t *testing.T) {
	d := &Datanode{acks: map[uint64]deleteAck{}}
	for tx := uint64(1); tx <= maxAcksPerHeartbeat+10; tx++ {
		d.ack(deleteAck{tx: tx, status: metapb.DeleteTxStatus_DELETE_TX_DONE, reason: strings.Repeat("x", 1000)})
	}
	req := &metapb.HeartbeatRequest{}
	sent := d.takeAcks(req)
	if len(sent) != maxAcksPerHeartbeat || len(req.DeleteAcks) != maxAcksPerHeartbeat {
		t.Fatalf("one heartbeat carries %d acknowledgements, want %d", len(req.DeleteAcks), maxAcksPerHeartbeat)
	}
	if m := req.DeleteAcks[0].GetMessage(); len(m) > maxAckMessage {
		t.Fatalf("message of %d bytes, SCM keeps %d", len(m), maxAckMessage)
	}
	d.clearAcks(sent)
	req = &metapb.HeartbeatRequest{}
	if d.takeAcks(req); len(req.DeleteAcks) != 10 || req.DeleteAcks[0].GetTxId() != maxAcksPerHeartbeat+1 {
		t.Fatalf("next heartbeat: %d acknowledgements from tx %d, want the remaining 10", len(req.DeleteAcks), req.DeleteAcks[0].GetTxId())
	}
	for tx := uint64(0); tx < 2*maxPendingAcks; tx++ {
		d.ack(deleteAck{tx: 1<<32 + tx})
	}
	if len(d.acks) > maxPendingAcks || len(d.ackOrder) > maxPendingAcks {
		t.Fatalf("%d acknowledgements queued, bound %d", len(d.acks), maxPendingAcks)
	}
}
