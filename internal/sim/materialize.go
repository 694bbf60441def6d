package sim

import "github.com/basalt-store/basalt/internal/raft"

// materialize returns the copy of o the receiver gets: entry data joined
// into the entries, nothing shared with the sender.
func materialize(o raft.Outgoing) (raft.Outgoing, bool) { return o.Materialize(), true }
