package storage

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error returned by this package that a caller can act
// on wraps exactly one of these, so callers test with errors.Is and never
// parse messages. The wrapping *Error carries the inputs that caused it.
var (
	ErrContainerNotFound = errors.New("container not found")
	ErrContainerExists   = errors.New("container already exists")
	ErrBlockNotFound     = errors.New("block not found")
	// ErrContainerNotOpen: a write or commit to a container that is CLOSED
	// (immutable) or UNHEALTHY.
	ErrContainerNotOpen = errors.New("container not open for writes")
	// ErrContainerNotClosed: export or delete of a container that is still
	// accepting writes.
	ErrContainerNotClosed = errors.New("container not closed")
	ErrContainerFull      = errors.New("container size limit exceeded")
	// ErrBlockTooLarge, ErrChunkTooLarge, ErrBadBlockData and ErrBadChecksum
	// are malformed requests: each also matches ErrInvalidArgument.
	ErrBlockTooLarge error = invalid("block size limit exceeded")
	ErrChunkTooLarge error = invalid("chunk size limit exceeded")
	// ErrChunkOverlap: a chunk partly overlaps one already written, or
	// rewrites a committed range, or rewrites an uncommitted chunk with
	// different data.
	ErrChunkOverlap = errors.New("chunk overlaps existing data")
	// ErrChunkOutOfOrder: with sequential writes (the default), a chunk that
	// does not start where the block's written data ends.
	ErrChunkOutOfOrder = errors.New("chunk offset out of order")
	// ErrBadBlockData: a PutBlock whose chunk list is malformed (gaps,
	// overlaps, wrong length, checksums that do not cover the chunk) or
	// that would change a committed block.
	ErrBadBlockData error = invalid("invalid block data")
	// ErrBadChecksum: checksum metadata that is malformed (unknown type,
	// window size 0 or out of range, too few or too many sums), as opposed
	// to data that fails verification.
	ErrBadChecksum error = invalid("invalid checksum metadata")
	// ErrChunkMissing: a PutBlock names a chunk that is not durably written
	// on this replica (never written, lost in a crash before it was synced,
	// or written with other checksums). Nothing is committed; the replica
	// cannot hold this block without the data being sent again.
	ErrChunkMissing = errors.New("chunk not written on this replica")
	// ErrChecksumMismatch: data does not match its checksum. On write it
	// means the caller sent bad data; on read it means the disk returned
	// corrupt data (see ErrCorruption, which wraps this too).
	ErrChecksumMismatch = errors.New("checksum mismatch")
	// ErrCorruption: stored data failed verification on read.
	ErrCorruption   = errors.New("stored data corrupt")
	ErrOutOfRange   = errors.New("read past end of block")
	ErrDiskFull     = errors.New("disk full")
	ErrVolumeFailed = errors.New("volume failed")
	ErrNoVolume     = errors.New("no volume with room for a container")
	ErrClosed       = errors.New("store closed")
	// ErrTooManyOpenBlocks: the limit on blocks with uncommitted writes in
	// one store was reached.
	ErrTooManyOpenBlocks = errors.New("too many open blocks")
	ErrBadExport         = errors.New("invalid container export stream")
	ErrInvalidArgument   = errors.New("invalid argument")
)

// invalid is a sentinel that is also ErrInvalidArgument, so a caller can
// map every malformed request to one status without listing them.
type invalid string

func (e invalid) Error() string        { return string(e) }
func (e invalid) Is(target error) bool { return target == ErrInvalidArgument }

// Error is the concrete error type: an operation, the inputs it was given
// (container, block, offset, volume; unset ones are -1 or ""), the sentinel
// kind and an optional underlying cause (an *os.PathError, say).
type Error struct {
	Op        string
	Container ContainerID
	Block     LocalID
	Offset    int64
	Volume    string
	Kind      error // one of the sentinel errors above
	Detail    string
	Err       error // underlying cause, may be nil

	hasBlock bool
	hasOff   bool
}

func (e *Error) Error() string {
	s := e.Op + ": " + e.Kind.Error() + fmt.Sprintf(": container %d", e.Container)
	if e.hasBlock {
		s += fmt.Sprintf(" block %d", e.Block)
	}
	if e.hasOff {
		s += fmt.Sprintf(" offset %d", e.Offset)
	}
	if e.Volume != "" {
		s += " volume " + e.Volume
	}
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap lets errors.Is match both the sentinel kind and the cause.
func (e *Error) Unwrap() []error {
	if e.Err != nil {
		return []error{e.Kind, e.Err}
	}
	return []error{e.Kind}
}

// HasBlock reports whether Block is meaningful.
func (e *Error) HasBlock() bool { return e.hasBlock }

// HasOffset reports whether Offset is meaningful.
func (e *Error) HasOffset() bool { return e.hasOff }

func cErr(op string, kind error, cid ContainerID, detail string, cause error) *Error {
	return &Error{Op: op, Kind: kind, Container: cid, Detail: detail, Err: cause, Offset: -1}
}

func bErr(op string, kind error, cid ContainerID, lid LocalID, detail string, cause error) *Error {
	e := cErr(op, kind, cid, detail, cause)
	e.Block, e.hasBlock = lid, true
	return e
}

func oErr(op string, kind error, cid ContainerID, lid LocalID, off int64, detail string, cause error) *Error {
	e := bErr(op, kind, cid, lid, detail, cause)
	e.Offset, e.hasOff = off, true
	return e
}
