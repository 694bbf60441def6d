package datanode

import (
	"context"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/raft"
)

// SetApplyStatusHook runs f at the start of every ApplyStatus call d
// serves (nil: none).
func (d *Datanode) SetApplyStatusHook(f func(context.Context)) {
	if f == nil {
		d.applyStatusHook.Store(nil)
		return
	}
	d.applyStatusHook.Store(&f)
}

// PipelineStatus is the raft status of d's replica of pipeline.
func (d *Datanode) PipelineStatus(pipeline uint64) (raft.Status, error) {
	g, err := d.host.Group(pipeline)
	if err != nil {
		return raft.Status{}, err
	}
	return g.Status(), nil
}

// SetCommandHook runs f before every SCM command d executes (nil: none).
func (d *Datanode) SetCommandHook(f func(*metapb.DatanodeCommand)) {
	if f == nil {
		d.commandHook.Store(nil)
		return
	}
	d.commandHook.Store(&f)
}

// QueueCommand queues cmd as a heartbeat answer's command would be.
func (d *Datanode) QueueCommand(cmd *metapb.DatanodeCommand) { d.queueCommand(cmd) }
