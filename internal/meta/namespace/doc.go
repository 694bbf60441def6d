// Package namespace is the namespace manager: volumes, buckets and keys
// (object and fs layouts) as a Raft state machine over Pebble (State), and
// the gRPC service with its leader-side background work (Service): open
// key expiry, reclaiming deleted directories in bounded steps, and handing
// deleted blocks to SCM in batches.
package namespace
