package datanode

import (
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func closeCmd(id uint64) *metapb.DatanodeCommand {
	return &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_ClosePipeline{ClosePipeline: &metapb.ClosePipelineCommand{PipelineId: id}}}
}

// TestCmdQueue: commands come out in order; one equal to a waiting
// command is not queued again (SCM resends until it sees the effect),
// but is once the first has started; beyond maxQueuedCommands a command
// is dropped and counted.
func TestCmdQueue(t *testing.T) {
	q := newCmdQueue()
	q.enqueue(closeCmd(1))
	q.enqueue(closeCmd(2))
	q.enqueue(closeCmd(1)) // waiting already
	if got := q.waiting(); got != 2 {
		t.Fatalf("%d waiting, want 2 (the resend of pipeline 1's close is not queued twice)", got)
	}
	if c := q.next(); c.GetClosePipeline().GetPipelineId() != 1 {
		t.Fatalf("first out: %v", c)
	}
	q.enqueue(closeCmd(1)) // started: queued again
	for _, want := range []uint64{2, 1} {
		if c := q.next(); c.GetClosePipeline().GetPipelineId() != want {
			t.Fatalf("next: %v, want pipeline %d", c, want)
		}
	}
	if q.next() != nil {
		t.Fatal("queue not empty")
	}
	for i := range maxQueuedCommands + 5 {
		q.enqueue(closeCmd(uint64(100 + i)))
	}
	if q.waiting() != maxQueuedCommands || q.dropped.Load() != 5 || q.deduped.Load() != 1 {
		t.Fatalf("waiting %d dropped %d deduped %d, want %d 5 1", q.waiting(), q.dropped.Load(), q.deduped.Load(), maxQueuedCommands)
	}
}
