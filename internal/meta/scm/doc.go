// Package scm is the storage container manager: the replicated state of
// datanodes, pipelines and containers (State, a Raft state machine over
// Pebble) and the leader-side Manager that tracks datanode liveness from
// heartbeats, keeps pipelines (multi-raft placement, seed 001) and open
// containers topped up, allocates blocks, and derives the commands
// datanodes receive in heartbeat responses. See package meta's doc for
// which state is replicated and which is soft.
package scm
