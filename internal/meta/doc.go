// Package meta is the metadata service, `basalt meta`: one process per
// node (1, 3 or 5 nodes) running two Raft groups on one raft.Host — the
// namespace manager (group 1, Ozone's OM; package namespace) and the
// storage container manager (group 2, Ozone's SCM; package scm) — and
// serving both gRPC services (proto/meta/meta.proto).
//
// # Replicated state and soft state
//
// Everything that must survive a failover goes through Raft and lives in
// Pebble (one DB per group, package store): volumes, buckets, keys, open
// keys, deleted-block queues; datanode registrations (UUID → numeric ID),
// pipelines, containers and their states, ID counters, delete-block
// transactions. Apply is deterministic: the proposer stamps the time into
// each command.
//
// Datanode liveness is soft state on the SCM leader: heartbeats (every few
// seconds from every datanode) never go through Raft. A new leader starts
// every registered datanode with a full grace period and in safe mode,
// and rebuilds the rest from the next heartbeats — their full reports
// carry volumes, containers and pipelines. Only the consequences that
// matter are replicated: a DEAD datanode's pipelines are closed through
// Raft (re-checked every loop, so a failover in between loses nothing),
// containers move OPEN → CLOSING → CLOSED through Raft. Commands to
// datanodes are not queued anywhere: each heartbeat response is derived
// from replicated state and the datanode's last report (a pipeline it
// should be in but does not report → create; a closed pipeline or closing
// container it still reports open → close; a delete-block transaction it
// has not acknowledged → delete), resent after a retry interval until the
// report shows it done. So a new leader sends exactly the commands still
// needed. The price: after a failover the leader needs one heartbeat round
// before its view is complete, and a datanode that died just before a
// failover is declared dead one DeadInterval later than it would have been.
//
// Block IDs: the SCM leader takes ranges of local IDs through Raft and
// hands out IDs from its range without Raft; ranges never overlap, so no
// ID repeats after a failover. Block allocations themselves are not
// replicated by SCM — the namespace records them in the open key, and the
// containers' fill level is estimated by the leader from allocations and
// reports.
//
// # Leaders and routing
//
// Writes go through the group leader; reads run a ReadIndex barrier on the
// leader first, so they are linearizable (concurrent reads share barriers,
// and LookupKeys answers many lookups after one; OpenKeys and CommitKeys
// carry many keys' opens or commits in one Raft entry, each key validated,
// authorized and applied on its own). A follower answers UNAVAILABLE
// with a NotLeader detail carrying the leader's gRPC address; metaclient
// follows it. The namespace leader allocates blocks by calling SCM
// in-process when the local SCM replica leads, and over gRPC otherwise; a
// background loop transfers SCM leadership to the namespace leader's node
// so the in-process path is the normal one.
package meta
