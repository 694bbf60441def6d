package metapb

// ReasonLayoutNotFinalized marks a FAILED_PRECONDITION refused before the
// Raft log because the request needs a layout feature above the cluster's
// finalized layout version (an upgrade not finalized yet: `basalt admin
// upgrade finalize`). Nothing was applied; a client falls back to what
// the finalized layout offers (metaclient: batch calls to single calls).
const ReasonLayoutNotFinalized = "LAYOUT_NOT_FINALIZED"

// ReasonReplicaHalted marks an UNAVAILABLE from a meta replica that
// stopped applying the namespace log at an entry its binary cannot apply
// (a newer binary's command): another replica can answer.
const ReasonReplicaHalted = "REPLICA_HALTED"
