// Package client is the Go client of Basalt: volumes, buckets and keys,
// with both write paths of seed 000 (V1: chunks through a pipeline's Raft
// leader; V2: a stream through the chain of datanodes) and
// replica-failover reads.
//
// # Authentication
//
// Every connection, to the metadata service and to datanodes (gRPC and V2
// streams), is mutual TLS with a certificate from the cluster CA:
// Config.Credentials, read with LoadCredentials from a TLS directory
// (ca.pem, cert.pem, key.pem; `basalt admin ca issue --role client`, or
// basalt dev's DATA_DIR/tls/client-cli). The client checks that it talks
// to the cluster's meta nodes and datanodes.
//
// Or, without a certificate, an S3 key: Config.AccessKey and SecretKey
// with Config.CACertFile (the cluster CA; KeysFromEnv reads the keys from
// $BASALT_ACCESS_KEY/$BASALT_SECRET_KEY or the AWS variables). The client
// proves the key to the metadata service once (a signed GetUserToken; the
// secret never travels), sends the user token it gets with every metadata
// call and renews it before it expires; datanodes take its reads and
// writes on the block tokens the metadata service returns. Such a client
// writes through V1 (the stream port needs a certificate). Without either,
// the servers refuse the client.
//
// # Writes
//
// PutKey reads an io.Reader of any length. The namespace manager opens the
// key and hands out blocks (a pipeline of datanodes each, nearest first).
// The data is cut into chunks of Config.ChunkSize, checksummed here (CRC32C
// per Config.BytesPerChecksum window, so the checksum covers the bytes from
// this process to the disk and back) and sent as WriteChunk calls to the
// pipeline's leader, Config.MaxInflightChunks at a time. Every FlushBytes
// and at each block's end a PutBlock with wait_all commits what was sent on
// every replica; only then are the buffers holding it released. All
// unacknowledged data lives in a bounded pool of Config.MaxBufferBytes, so
// a fast reader blocks instead of growing memory.
//
// On a failure (datanode unreachable, pipeline or container closed,
// replicas lagging, timeouts) the writer follows Ozone's
// KeyOutputStream.handleException: it adds the datanodes, pipeline or
// container to the key's exclude list, asks for a new block elsewhere and
// rewrites from its buffers everything not yet committed on all replicas.
// The failed block keeps the length last committed on all replicas and is
// never extended. At most Config.MaxBlockRetries blocks are re-allocated
// per key.
//
// # V2 (streaming) writes
//
// Keys of at least Config.StreamThreshold bytes (4 MiB) go through V2
// unless PutOptions.Pipeline or Config.Pipeline says otherwise; PutKey
// reads that much ahead to decide, so callers need not know the size. Per
// block the client orders the block's datanodes nearest to
// Config.Location first (stream.Route), opens a stream to the first
// (stream.Dial; each datanode forwards to the next), sends the data from
// the same bounded buffer pool as V1, closes the stream (every datanode
// synced) and commits with one PutBlock (wait_all) through the pipeline's
// leader, found as in V1. A block longer than the buffer pool is written in
// segments of the pool's size, each a stream extending the block from its
// committed length and a PutBlock: uncommitted data must stay in the
// client's memory for a resend, because a failed stream discards its
// partial block on every datanode. A failed stream names the datanode at
// fault; it is excluded (a refused pipeline or container likewise) and the
// segment is resent to a new block, within the same MaxBlockRetries budget
// as V1. Both paths store the same blocks, chunk lists and checksums, so a
// reader cannot tell them apart.
//
// # Reads
//
// GetKey makes one LookupKey call; the KeyReader then reads each block range
// from the nearest replica, verifies every checksum window it touches
// (reading whole windows and slicing), and on an error or mismatch moves to
// the next replica, reporting a corrupt one to SCM.
//
// # Errors
//
// Errors from the services are *Error values that match the sentinels
// (ErrNotFound, ErrExists, ...) with errors.Is and carry the server's
// message, which names the input.
package client
