package datanode

import "context"

// SetApplyStatusHook runs f at the start of every ApplyStatus call d
// serves (nil: none).
func (d *Datanode) SetApplyStatusHook(f func(context.Context)) {
	if f == nil {
		d.applyStatusHook.Store(nil)
		return
	}
	d.applyStatusHook.Store(&f)
}
