package sim

import "github.com/basalt-store/basalt/internal/raft"

// materialize returns the copy of o the receiver gets: entry data joined
// into the entries, nothing shared with the sender.
func materialize(o raft.Outgoing) (raft.Outgoing, bool) {
	c := raft.Outgoing{Group: o.Group, Applied: o.Applied}
	m := o.Msg
	if o.Hydrate != nil {
		hm, tails, err := o.Hydrate(o.Msg)
		if err != nil {
			return c, false
		}
		m = hm
		if tails != nil {
			cm, err := cloneMsg(m)
			if err != nil {
				return c, false
			}
			for i := range cm.Entries {
				if i < len(tails) && tails[i] != nil {
					cm.Entries[i].Data = append(append([]byte(nil), cm.Entries[i].Data...), tails[i]...)
				}
			}
			m = cm
		}
	}
	if m != nil {
		cm, err := cloneMsg(m)
		if err != nil {
			return c, false
		}
		c.Msg = cm
	}
	return c, true
}
