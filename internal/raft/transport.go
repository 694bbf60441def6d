package raft

import (
	"context"
	"io"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Transport moves messages between hosts. All groups share it: it carries
// the messages of every group a pair of hosts has in common.
type Transport interface {
	// Start begins delivering inbound traffic to h. Called once.
	Start(h Handler) error
	// Send queues messages for host to. It never blocks: when the queue to
	// that host is full the messages are dropped (raft resends) and the
	// transport reports the host unreachable through Handler.Unreachable.
	Send(to uint64, msgs []Outgoing)
	// SendSnapshot streams a snapshot (the MsgSnap plus the state machine's
	// data) to host to and returns once the receiver has restored it or
	// failed. It blocks; the host calls it on its own goroutine.
	SendSnapshot(ctx context.Context, to, group uint64, m *pb.Message, body io.Reader) error
	// Addr is the address peers reach this host at.
	Addr() string
	Close() error
}

// Outgoing is one unit of traffic for one group: a raft message, or (when
// Msg is nil) a report that this host applied the group's log up to
// Applied, which the leader uses for WaitAppliedAll.
type Outgoing struct {
	Group   uint64
	Msg     *pb.Message
	Applied uint64
	// tails: tails[i], when set, is the data that follows
	// Msg.Entries[i].Data on the wire (kept apart so it is never copied).
	// See Materialize.
	tails [][]byte
}

// wireData is the payload of entry i as the receiver must see it.
func (o *Outgoing) wireData(i int) []byte {
	d := o.Msg.GetEntries()[i].GetData()
	if o.tails == nil || o.tails[i] == nil {
		return d
	}
	return append(append(make([]byte, 0, len(d)+len(o.tails[i])), d...), o.tails[i]...)
}

// Materialize returns a deep copy of o as the receiving host must get it:
// entry data kept beside the message (to avoid copying it on the sender) is
// joined into the entries. A transport that does not serialize messages
// (an in-memory or simulated network) delivers Materialize's result; the
// sender may reuse nothing of it.
func (o Outgoing) Materialize() Outgoing {
	c := Outgoing{Group: o.Group, Applied: o.Applied}
	if o.Msg == nil {
		return c
	}
	c.Msg = cloneMessage(o.Msg)
	if o.tails != nil {
		for i, e := range c.Msg.Entries {
			e.Data = o.wireData(i)
		}
	}
	return c
}

// Handler is the receiving side of a Transport: the Host.
type Handler interface {
	// HandleMessages delivers a batch received from host from.
	HandleMessages(from uint64, msgs []Outgoing)
	// HandleSnapshot delivers a snapshot; it returns after the state
	// machine restored it (or failed) and the MsgSnap was stepped.
	HandleSnapshot(from, group uint64, m *pb.Message, body io.Reader) error
	// Unreachable reports that messages to host id could not be sent.
	Unreachable(id uint64)
}
