// Package storage is the container storage of a datanode: data volumes,
// containers, blocks and chunks, with checksums on every read.
//
// # On-disk layout
//
// Each volume (one directory per disk) holds
//
//	<volume>/basalt/meta/                  Pebble DB: all metadata of the volume
//	<volume>/basalt/containers/<cid>/      one directory per container
//	<volume>/basalt/containers/<cid>/<localID>.block   one file per block
//
// Pebble keys are 17 bytes, containerID (8, big-endian) | kind (1) | id (8,
// big-endian): kind 0 id 0 is the container record (state, size limit),
// kind 0 id 1 its counters (committed bytes, block count, highest BCSID),
// kind 1 id localID a committed block (length, BCSID, chunk list with
// checksums). A container's keys are contiguous, so its blocks are one
// prefix seek away and deleting a container is one DeleteRange.
//
// # Commit point and crash semantics
//
// WriteChunk writes block data but no metadata; PutBlock is the commit:
// under SyncPolicy SyncOnCommit (the default) it fdatasyncs the block file,
// fsyncs the container directory the first time the file appears, and only
// then writes the block record and counters in one synced Pebble batch. So
// after a crash at any point:
//   - a block whose PutBlock returned reads back intact (its data was
//     durable before its record could be);
//   - a block without a record is invisible and its file is deleted by Open
//     (Options.KeepUncommitted keeps it for a caller that will replay
//     PutBlock), and bytes past a record's length are truncated;
//   - a container directory without a record (interrupted create, import or
//     delete) is removed by Open; a record whose data is missing marks the
//     container UNHEALTHY rather than failing the datanode.
//
// Container state changes (OPEN → CLOSING → CLOSED, or UNHEALTHY) are synced
// Pebble writes. CloseContainer first discards uncommitted block data, so a
// CLOSED container's files hold exactly its committed blocks, which is what
// Export streams and Import rebuilds elsewhere.
//
// # Checksums
//
// Chunks carry a checksum per window of BytesPerChecksum (CRC32C over 64
// KiB by default; SHA-256 and NONE are allowed). Clients compute them with
// Checksum.Compute; WriteChunk verifies them when asked; every ReadAt
// verifies every window it touches and returns ErrCorruption naming the
// container, block and offset of the first bad window.
//
// # Errors
//
// Every error a caller can cause wraps one exported sentinel (use errors.Is)
// inside an *Error that names the operation, container, block and offset.
// Refused input changes nothing stored. ENOSPC is ErrDiskFull and leaves the
// volume usable; any other I/O error marks the volume failed
// (ErrVolumeFailed): its containers are reported UNHEALTHY and the rest of
// the datanode carries on.
//
// # Extension points
//
// Block data goes through BlockFiles (posix now: file per block, O_DIRECT for
// 4 KiB-aligned pieces with a buffered fallback for tails and for file
// systems that refuse O_DIRECT). A zoned backend (append-only, aligned, tail
// kept in memory until Sync) and a persistent-memory cache tier implement
// the same interface. Files go through FS, so tests inject ENOSPC, EIO and
// torn writes (FaultFS); Pebble takes its own vfs.FS.
package storage
