package datanode

import (
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
)

// SetApplyBugForTest makes every committed entry into a container for
// which bug reports true hit a runtime error in apply (an index out of
// range, as a bug would) on each pipeline state machine d runs now, and
// returns how many it runs. Set it before the pipelines apply any write.
func (d *Datanode) SetApplyBugForTest(bug func(cid uint64) bool) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, sm := range d.sms {
		sm.applyHook = func(e raft.Entry, cmd *datanodepb.ContainerCommand) {
			if bug(commandContainer(cmd)) {
				var none []int
				_ = none[e.Index] // runtime error: index out of range
			}
		}
	}
	return len(d.sms)
}
