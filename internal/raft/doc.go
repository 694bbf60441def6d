// Package raft hosts many Raft groups in one process ("multi-raft", seed
// 001) on go.etcd.io/raft/v3. The Raft algorithm is etcd's; this package
// owns what etcd raft leaves to its caller: storage, network, scheduling,
// applying, snapshots. The metadata service's two groups and every
// datanode pipeline run on it.
//
// # Shape
//
// A Host has one log store per log directory (one per disk) and one store
// loop per log store. A group lives on the least-loaded directory when it
// is created and stays there. Events (a proposal, an inbound message, a
// tick) mark a group ready on its loop; the loop takes all ready groups,
// collects their Ready, and:
//
//  1. sends the leaders' messages and everyone's heartbeats at once (a
//     leader's own vote counts only after Advance, raft thesis 10.2.1;
//     heartbeats assert nothing about the disk);
//  2. hands the data of new entries to the state machine (WriteData), in
//     parallel across groups;
//  3. writes every group's entries (metadata only) and HardState into ONE
//     Pebble batch and commits it with ONE sync — group commit;
//  4. sends the remaining messages (votes, append acks) and calls Advance;
//  5. queues committed entries for the group's apply goroutine.
//
// A slow disk therefore stalls only the groups whose logs are on it.
//
// # Data kept out of the log
//
// A proposal is (metadata, data). An entry's payload carries a header
// (proposing host, sequence number) so the proposer gets the state
// machine's result back. On every replica, step 2 gives the data to a
// DataStateMachine before the log batch that acknowledges the entry is
// synced; the log keeps the entry with its data elided (the data's length
// stays). When raft must resend an entry it reads from the log, the data is
// put back from a small per-group cache or from ReadData (Ozone's
// stateMachineData, seed 000).
//
// # Transport
//
// One TCP connection per pair of hosts (the one dialed by the smaller ID
// wins a race) carries the messages of all groups. Each peer has a bounded
// queue drained by its own writer goroutine into one frame per write;
// heartbeats go in a compact (group, term, commit) form. A full queue drops
// messages (raft resends) and reports the peer unreachable; nothing blocks
// the loops. Snapshots stream on a connection of their own. Followers send
// the leader their applied index after every apply, which is what
// Group.WaitAppliedAll (Ozone's watch for ALL_COMMITTED) waits on.
//
// # Snapshots and truncation
//
// The state machine is durable on its own and reports the index it has
// durably applied; the log is truncated up to there (keeping CompactKeep
// entries, and what an active follower close behind still needs). A new
// group starts from a virtual snapshot at index 1 holding the initial
// members, so a replica that joins later always receives a snapshot,
// which carries the membership. A snapshot is taken by the state machine
// when it is sent (StateMachine.Snapshot, on the apply goroutine, so it is
// consistent with the index it reports) and restored before raft is told.
//
// # Crash safety
//
// An entry is acknowledged (to a leader, or to a proposer on a single
// replica) only after the batch holding it was synced. HardState changes
// that need no sync (commit index alone) may be lost in a crash; raft
// recovers the commit index from the leader, and a state machine ahead of
// the recovered commit index is not applied twice.
package raft
