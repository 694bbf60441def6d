package storage

import (
	"errors"
	"io/fs"
	"slices"

	"github.com/cockroachdb/pebble/v2"
)

// Inline blocks (BlueStore keeps small objects' data in its key-value
// store the same way): a small block written by WriteSmallChunk — the one
// chunk of a block that never grows, such as a PutSmallFile's — gets no
// block file at all. Its bytes live in the volume's Pebble store under
// the chunk's deferred key (deferred.go), made permanent:
//
//   - until its Sync, only in memory (the span's data);
//   - from its Sync on, under its deferred key beside its chunk record,
//     in the Sync's synced batch; the flusher is not told about it (there
//     is no file to flush);
//   - at its PutBlock, the block record (version 2, which says "inline"),
//     the counters and the deletion of its chunk record go in one batch;
//     the deferred key stays (or is set in that batch, if no Sync came
//     first) and from then on is the block's data.
//
// So a small block costs no file create, no fdatasync and no directory
// sync on any replica, and its bytes are written to the WAL once: they are
// made durable by the WAL flushes the pipeline does anyway (Sync,
// SyncCommits).
//
// A crash between Sync and PutBlock leaves a deferred key without an
// inline record, which Open writes into a new block file as for any
// deferred write: the block is then an ordinary uncommitted block, and the
// PutBlock the log applies again commits it as a file block. Open leaves
// the deferred keys of inline blocks alone, and marks a container whose
// inline block lost its key UNHEALTHY. Readers (ReadAt, VerifyBlock,
// Export, ReadWritten) read inline data through blockReader; OpenBlockFile
// refuses an inline block (ErrNoBlockFile: short-circuit readers fall back
// to gRPC); DeleteBlocks deletes the block's deferred keys with its record
// (as it always did); DeleteContainer's range takes them; Export streams
// an inline block like any block and Import stores it as a file. An
// inline block cannot be extended; a block whose chunk was written by
// WriteSmallChunk (inline here or not: every replica alike) takes no
// other chunk and is committed only with exactly that chunk
// (smallCommitOK). The chunk record says so too (chunkRecVersionSmall,
// in the Sync's batch), so a replica that restarts between the Sync and
// the commit keeps refusing what its peers refuse.
const blockRecVersionInline = 2

// errInlineFinal refuses a write that would extend an inline block.
const errInlineFinal = "block is a small block kept inline; it cannot grow"

// WriteSmallChunk is WriteChunk at offset 0 for the only chunk of a block
// that will be committed with exactly that chunk and never extended (a
// PutSmallFile). On a posix volume with deferred writes on, a checksummed
// chunk of at most Options.DeferredMax bytes is kept inline (no block
// file); otherwise it is WriteChunk.
func (s *Store) WriteSmallChunk(cid ContainerID, lid LocalID, data []byte, sum ChecksumData, verify bool) error {
	return s.writeChunk(cid, lid, 0, data, sum, verify, true, false)
}

// WriteSmallChunkShared is WriteSmallChunk for data the caller never
// modifies again (a Raft entry's data, which raft also keeps for resends):
// the store may keep a reference to it until the block is committed
// instead of a copy. Storage itself only reads it.
func (s *Store) WriteSmallChunkShared(cid ContainerID, lid LocalID, data []byte, sum ChecksumData, verify bool) error {
	return s.writeChunk(cid, lid, 0, data, sum, verify, true, true)
}

// inlineOK reports whether a chunk written by WriteSmallChunk may be kept
// inline on c's volume. Caller holds ob.mu.
func (s *Store) inlineOK(c *container, ob *openBlock, off, n int64, sum ChecksumData) bool {
	return c.vol.defer_ != nil && off == 0 && ob.hwm == 0 && !ob.exists && len(ob.written) == 0 &&
		n <= s.opts.DeferredMax && sum.Type != ChecksumNone
}

// hasSmall reports whether ob's uncommitted data holds a chunk written by
// WriteSmallChunk (inline or not): its block takes no other chunk.
// Caller holds ob.mu.
func hasSmall(ob *openBlock) bool {
	return slices.ContainsFunc(ob.written, func(sp span) bool { return sp.small })
}

// inlineCommit reports whether bd (a PutBlock of ob) commits ob's inline
// span as an inline block. Caller holds ob.mu.
func inlineCommit(ob *openBlock, bd *BlockData) bool {
	if ob.exists || len(bd.Chunks) != 1 || len(ob.written) != 1 {
		return false
	}
	sp := ob.written[0]
	return sp.inline && sp.off == 0 && sp.n == bd.Length && sp.data != nil
}

// smallCommitOK reports whether bd may commit ob: true unless ob's
// uncommitted data holds a small chunk (WriteSmallChunk) and bd is not
// exactly that one chunk, at offset 0, of its length, with its checksums
// (when both sides have them). A PutBlock of another shape racing a
// PutSmallFile would otherwise commit a file block over an inline span.
// Caller holds ob.mu.
func smallCommitOK(ob *openBlock, bd *BlockData) bool {
	i := slices.IndexFunc(ob.written, func(sp span) bool { return sp.small })
	if i < 0 {
		return true
	}
	sp := ob.written[i]
	if ob.exists || len(ob.written) != 1 || len(bd.Chunks) != 1 {
		return false
	}
	ch := bd.Chunks[0]
	if ch.Offset != 0 || ch.Length != sp.n || bd.Length != sp.n {
		return false
	}
	return sp.sum.Type == ChecksumNone || ch.Checksum.Type == ChecksumNone || sp.sum.equal(ch.Checksum)
}

// blockReader opens committed block bd's data: its file, or its inline
// bytes.
func (s *Store) blockReader(c *container, bd *BlockData) (BlockReader, error) {
	if !bd.Inline {
		return c.vol.files.OpenReader(c.id, bd.LocalID)
	}
	val, closer, err := c.vol.get(makeDeferredKey(c.id, bd.LocalID, 0))
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, errInlineMissing
	}
	if err != nil {
		return nil, err
	}
	data := append([]byte(nil), val...)
	closer.Close()
	return bytesReader(data), nil
}

// errInlineMissing: an inline block's record without its data (the two
// are written in one batch, so only damage makes this).
var errInlineMissing = &inlineMissingError{}

type inlineMissingError struct{}

func (*inlineMissingError) Error() string { return "inline block data missing" }

// Is makes a missing inline key read as a missing block file.
func (*inlineMissingError) Is(target error) bool { return target == fs.ErrNotExist }

// bytesReader is a BlockReader over an inline block's bytes, with the
// posix reader's ReadAt semantics (fullReadAt): a short count without an
// error at the end of the data.
type bytesReader []byte

func (b bytesReader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("negative offset")
	}
	if off >= int64(len(b)) {
		return 0, nil
	}
	return copy(p, b[off:]), nil
}

func (bytesReader) Close() error { return nil }

// writtenInline returns the bytes of an uncommitted inline span covering
// [off, off+n) of ob, if there is one. Caller holds ob.mu.
func writtenInline(ob *openBlock, off, n int64) ([]byte, bool) {
	for _, sp := range ob.written {
		if sp.inline && sp.data != nil && off >= sp.off && off+n <= sp.end() {
			return sp.data[off-sp.off : off-sp.off+n], true
		}
	}
	return nil, false
}

// SmallChunkPending reports whether block lid's chunk written by
// WriteSmallChunk is kept inline and only in memory: not yet synced, no
// file. Its block's commit (PutBlock, or PutBlockDeferred and
// SyncCommitsFor) then writes the bytes with the block record, so the
// chunk needs no Sync of its own if the caller keeps them durable
// elsewhere until that commit (the datanode: in the Raft log entry) and
// writes them again after a restart that lost them.
func (s *Store) SmallChunkPending(cid ContainerID, lid LocalID) bool {
	c, err := s.container("small chunk pending", cid)
	if err != nil {
		return false
	}
	c.mu.Lock()
	ob := c.open[lid]
	c.mu.Unlock()
	if ob == nil {
		return false
	}
	ob.mu.Lock()
	defer ob.mu.Unlock()
	if ob.dead || ob.exists || len(ob.written) != 1 {
		return false
	}
	sp := ob.written[0]
	return sp.inline && sp.small && !sp.durable && sp.data != nil && sp.off == 0
}
