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
// A slow disk therefore stalls only the groups whose logs are on it. A slow
// state machine stalls only its own applies: past maxApplyBacklog entries
// waiting in memory, committed entries stay in the log and the apply
// goroutine reads them back, while the group keeps processing its Ready
// (heartbeats, votes, appends) and so keeps its leadership.
//
// Inbound messages go to the group's inbox. They are stepped at once when
// the group's lock is free, else by the store loop (before the Ready) or
// the next tick, in arrival order: a transport goroutine never waits for a
// group, and the host lock is held only to look groups up. AddGroup holds
// the host lock only to reserve the ID and to publish the group, not
// across the log store's syncs.
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
// stateMachineData, seed 000). That happens on a bounded per-group send
// queue drained by one worker per group, before the message reaches the
// transport: a slow ReadData delays that group's resends only, never the
// store loop or the per-peer writer every group shares.
//
// The data of a local proposal (fmtLocal entries) belongs to the entry,
// not to the caller: it stays in Group.local until WriteData stored it, or
// until a Ready shows raft discarded the entry before appending it. A
// caller whose context ends only stops waiting.
//
// # Outcomes
//
// ErrNotLeader, ErrStopped, ErrProposalDropped and ErrTooLarge mean the
// proposal never entered the log (or was replaced there): retry. Once it
// was handed to raft, giving up returns ErrOutcomeUnknown: it may have
// committed, or may still. A group that stops (Close, or a fatal error, a
// violated invariant, or etcd raft panicking on an inbound message its log
// cannot take — each logged with the cause and counted) is visibly
// stopped: IsLeader is false, Status.Role is "stopped", proposals get
// ErrStopped naming the cause. The process and the other groups go on.
// A proposal whose entry a snapshot covers before this host applied it
// also gets ErrOutcomeUnknown. Entries are matched to proposals by
// (host, sequence number); each incarnation of a host numbers from a
// random point, so an entry written before a restart and applied after it
// never finishes a proposal made after it.
//
// # Invariants asserted
//
// The applied index never goes back (setApplied); a snapshot is restored
// only if it is past what the state machine applied, compared on the apply
// goroutine in order with every apply, so of two snapshots arriving
// newer-then-older the older is ignored; a local proposal's data is
// present when its entry is written. A violation stops the group.
//
// # Transport
//
// One TCP connection per pair of hosts (the one dialed by the smaller ID
// wins a race) carries the messages of all groups. Each peer has a bounded
// queue drained by its own writer goroutine into one frame per write;
// heartbeats go in a compact (group, term, commit) form. A full queue drops
// messages (raft resends) and reports the peer unreachable; nothing blocks
// the loops. Snapshots stream on a connection of their own.
//
// Every frame carries its length and a CRC32C (Castagnoli) of its body,
// checked before decoding; the length is bounded (MaxFrameBytes, from
// MaxProposalBytes) and a buffer beyond ~9 MiB grows only as bytes arrive.
// Every count and length inside is checked against the bytes left, without
// overflow, before it sizes anything. Snapshot chunks carry a CRC32C too. A
// bad frame closes the connection with a logged error; a panic on a reader
// goroutine is recovered, logged with its stack, counted
// (basalt_raft_reader_panics_total) and closes the connection. The
// decoders have fuzz targets (FuzzDecodeFrame, FuzzDecodeApp,
// FuzzDecodeEntryData) whose corpora in testdata/fuzz run with go test. Followers send
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
//
// # Manual mode (deterministic simulation)
//
// With HostConfig.Manual the host starts no goroutine at all: no store
// loops, apply goroutines, ticker, snapshot senders, send workers, and
// WriteData runs group after group instead of in parallel. The caller
// drives it, single-threaded, as etcd raft's rafttest and TigerBeetle's
// VOPR do:
//
//   - Host.Tick advances every group's clock by one tick (TickInterval is
//     ignored).
//   - Host.Poll runs everything runnable now on the caller's goroutine: one
//     store-loop iteration per log store with pending groups (inbound
//     messages stepped, Ready, WriteData, one batch, sends, Advance), each
//     group's queued apply tasks (ProposeAsync callbacks run here), queued
//     sends of resend data, and queued snapshot sends. It returns whether
//     it did anything: call it until false to quiesce.
//   - Group.ProposeAsync proposes without blocking; its callback runs in
//     Poll (or in Host.Close with ErrOutcomeUnknown); so do
//     Group.ProposeManyAsync's (ProposeMany's submission, one callback per
//     entry). Group.AppliedAll is
//     the non-blocking WaitAppliedAll. The blocking calls (Propose,
//     ReadIndex, WaitApplied, WaitAppliedAll, AddMember) need another
//     goroutine to call Poll meanwhile.
//   - The Transport is the caller's (required): Send must only queue; the
//     caller later delivers with Host.HandleMessages, and uses
//     Outgoing.Materialize to copy a message as the receiver must see it.
//     Snapshots need the transport to implement SnapshotSender: Poll takes
//     the state machine's snapshot, reads it whole and hands it over with
//     QueueSnapshot; the caller delivers it with Host.HandleSnapshot (which
//     restores inline, after the group's queued applies) and reports the
//     result through the callback.
//
// Groups, peers, pending proposals and callbacks are visited in ID order
// and no decision reads the wall clock, so a run is a function of the
// calls made, with one exception outside this package: etcd raft draws
// its randomized election timeouts from crypto/rand. A simulator running
// as a test makes those deterministic with
// testing/cryptotest.SetGlobalRandom(t, seed), as TestManualHostsDeterministic
// does (it fails without it). Pebble, under the log stores, keeps its own
// background goroutines; they make no decision the host depends on.
package raft
