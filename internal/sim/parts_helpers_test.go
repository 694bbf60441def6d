package sim

import (
	"fmt"
	"io"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/basalt-store/basalt/internal/raft"
)

type raftOutgoing = raft.Outgoing

func testMsg(i uint64) raft.Outgoing {
	typ := pb.MsgHeartbeat
	return raft.Outgoing{Group: 1, Msg: &pb.Message{Type: &typ, Term: &i}}
}

type recHandler struct {
	id  uint64
	got *[]string
	clk *clock
}

func (h *recHandler) HandleMessages(from uint64, msgs []raft.Outgoing) {
	for _, m := range msgs {
		*h.got = append(*h.got, fmt.Sprintf("%v %d->%d t%d", time.Duration(h.clk.now), from, h.id, m.Msg.GetTerm()))
	}
}
func (h *recHandler) HandleSnapshot(uint64, uint64, *pb.Message, io.Reader) error { return nil }
func (h *recHandler) Unreachable(uint64)                                          {}
