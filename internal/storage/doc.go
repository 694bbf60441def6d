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
// checksums). Kind 2 keys have 8 more bytes, the offset: the record of a
// chunk written and synced but not yet committed by a PutBlock (length and
// checksums). A container's keys are contiguous, so its blocks are one
// prefix seek away and deleting a container is one DeleteRange.
//
// # Acknowledgements (the contract callers build on)
//
//   - WriteChunk returns nil: the bytes are in the block file, not durable.
//     Nothing may be acknowledged to anyone yet.
//   - Sync returns nil: every chunk whose WriteChunk returned before Sync
//     was called is durable — its data fdatasync'd, its file's directory
//     entry synced, its chunk record committed in a synced Pebble batch. A
//     Raft follower acknowledges an entry only after this (one Sync per
//     Ready batch: group commit; concurrent callers share rounds). For
//     chunks with checksums the three run at once (one device flush per
//     Sync): a record that reached disk without its bytes is caught by the
//     checksums when the chunk is next used after a crash. Chunks without
//     checksums are recorded only after their data. If Sync fails, the
//     chunks of the blocks it could not sync are forgotten as if never
//     written and the error wraps ErrDiskFull or ErrVolumeFailed. A small
//     checksummed chunk that is all of its block's unsynced data is a
//     deferred write (deferred.go): its bytes go in the synced Pebble batch
//     instead of the file and directory being synced; a background flusher
//     syncs the file later and Open replays the bytes after a crash.
//   - WriteChunkDurable returns nil: this chunk is durable (WriteChunk, a
//     shared Sync round, and a check that no failed round forgot it). A
//     writer that acknowledges its own chunk uses it: plain Sync reports a
//     failure only to the caller whose round failed.
//   - PutBlock returns nil: the block is committed durably with the given
//     chunk list, length and BCSID, and every byte of it is the data that
//     was written with those checksums. It commits only chunks this replica
//     holds: a chunk it names must be written (durable, or written in this
//     process and then synced by PutBlock itself) with the same offset,
//     length and checksums, else ErrChunkMissing naming the range — a hole
//     is never committed as zeros. A missing chunk record is therefore the
//     persistent "lost" mark: there is no separate list of lost chunks.
//   - PutBlockDeferred returns nil: the block is committed as by PutBlock
//     (its data durable, readable at once) but its record is durable only
//     after a SyncCommits called after it returns nil. A pipeline's apply
//     loop commits a batch so and acknowledges nothing before its
//     SyncCommitsFor (its containers' volumes only): one WAL flush per
//     volume per batch, shared by concurrent batches.
//   - BlockStream.Close returns nil: what the stream wrote is durable, as
//     after Sync.
//   - CreateContainer, state changes, DeleteBlocks, DeleteContainer, Import,
//     AbortBlock return nil: the change is durable (Pebble synced, files and
//     directory entries synced).
//
// Requests are validated before anything is stored, and ValidateChunk /
// ValidateBlock let a caller refuse them before they enter a replicated
// log: a chunk longer than MaxChunkSize, past MaxBlockSize, or with
// checksum metadata that does not cover it exactly (window 0 or out of
// range, too few or too many sums) is ErrInvalidArgument-class
// (ErrChunkTooLarge, ErrBlockTooLarge, ErrBadChecksum, ErrBadBlockData).
//
// # Crash semantics
//
// Data is synced before the metadata that names it, and every directory
// entry before the record that needs it. So after a crash at any point:
//   - a block whose PutBlock returned reads back intact;
//   - a chunk whose Sync returned is still written (with KeepUncommitted) and
//     can be committed by a replayed PutBlock; a chunk not synced is gone
//     and its range is a hole PutBlock refuses (a recovered chunk is checked
//     against its checksums before PutBlock, a re-delivery, HasChunk or
//     ReadWritten relies on it);
//   - Open removes block files without a record or durable chunk, truncates
//     bytes past a block's committed length and its last recorded chunk,
//     drops chunk records whose bytes are not in the file, removes
//     container directories without a record (interrupted create, import or
//     delete), and marks a container whose committed data is missing
//     UNHEALTHY rather than failing the datanode. What recovery removes or
//     keeps is synced before Open returns.
//
// Container state changes (OPEN → CLOSING → CLOSED, or UNHEALTHY) are synced
// Pebble writes. CloseContainer first discards uncommitted block data and
// its chunk records, so a CLOSED container's files hold exactly its
// committed blocks, which is what Export streams and Import rebuilds
// elsewhere.
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
// volume usable. A committed block that is damaged fails only its replica:
// its container is marked UNHEALTHY durably and the error says how
// (ErrCorruption for data that fails its checksums, ErrBlockFileMissing,
// ErrBlockUnreadable; all match ErrCorruption). VerifyBlock re-reads a
// block and checks every window (the datanode's scrubber). A volume is
// failed (ErrVolumeFailed: its containers are reported UNHEALTHY and the
// rest of the datanode carries on) only by its health check (CheckVolumes:
// a probe file created, written, fsynced, read back and removed within a
// timeout), by a Pebble error or by an error writing or syncing to it.
//
// # Full disks
//
// Pebble treats a failed WAL write as fatal, so block data never eats into
// a reserve kept free for the volume's DB: WriteChunk (and so streams)
// fails with ErrDiskFull once free space would fall below ReservedBytes +
// MetaReserveBytes, judged on a cached figure (vfs.Space: a statfs per
// second, per Reserve/4 bytes admitted and per Volumes report, never per
// chunk), and CheckSpace lets the datanode refuse a write before it enters
// a raft log. An emergency ballast file (BallastBytes) beside the DB is
// removed by Open when the disk is below the reserve, so Pebble can replay
// its WAL and the volume opens full (writes refused, reads served) instead
// of Open hanging; it is recreated once there is room.
//
// # Extension points
//
// Block data goes through BlockFiles (posix now: file per block, O_DIRECT for
// 4 KiB-aligned pieces with a buffered fallback for tails and for file
// systems that refuse O_DIRECT). A zoned backend (append-only, aligned, tail
// kept in memory until Sync) and a persistent-memory cache tier implement
// the same interface. Every file, directory and the Pebble DB of a volume go
// through one internal/vfs FS (Options.FS), so tests inject ENOSPC, EIO and
// torn writes (vfs.FaultFS) and crash a whole volume on an in-memory FS
// that keeps only what was synced.
package storage
