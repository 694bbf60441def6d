package storage

// BlockStream writes one block sequentially, for the V2 streaming path: a
// datanode writes each packet as it arrives (from the same buffer it
// forwards downstream) and syncs once at Close; PutBlock later commits the
// chunk list the client computed. Not safe for concurrent use.
type BlockStream struct {
	s   *Store
	cid ContainerID
	lid LocalID
	off int64
}

// OpenStream starts a sequential writer at offset off of block lid
// (0 for a new block, or its committed length to extend it).
func (s *Store) OpenStream(cid ContainerID, lid LocalID, off int64) *BlockStream {
	return &BlockStream{s: s, cid: cid, lid: lid, off: off}
}

// Write writes p at the stream's offset, in pieces of at most MaxChunkSize.
// Checksums are not verified here; PutBlock's chunk list carries them and
// every read verifies.
func (b *BlockStream) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		k := min(len(p)-done, int(b.s.opts.MaxChunkSize))
		if err := b.s.WriteChunk(b.cid, b.lid, b.off, p[done:done+k], ChecksumData{}, false); err != nil {
			return done, err
		}
		done += k
		b.off += int64(k)
	}
	return done, nil
}

// Offset is where the next Write goes.
func (b *BlockStream) Offset() int64 { return b.off }

// Close makes the written data durable, as Sync does for this block (no
// fsync under SyncNone); it does not commit the block.
func (b *BlockStream) Close() error {
	const op = "stream close"
	s := b.s
	c, err := s.container(op, b.cid)
	if err != nil {
		return err
	}
	ob, err := s.lockOpen(op, c, b.lid)
	if err != nil {
		return err
	}
	defer s.unlockOpen(c, b.lid, ob) // nothing written: do not hold the slot
	return s.flushLocked(c, b.lid, ob)
}

// Abort discards what the stream wrote (see Store.AbortBlock).
func (b *BlockStream) Abort() error { return b.s.AbortBlock(b.cid, b.lid) }

// AbortBlock discards a block's uncommitted data: a V2 stream that broke
// leaves data no PutBlock will ever name, and with KeepUncommitted nothing
// else would remove it. A block never committed loses its file; a
// committed one is truncated back to its committed length. Chunk records
// go first, so a crash midway leaves bytes no record names, which Open
// removes. Committed data is never touched, so aborting twice, or
// aborting a block with nothing uncommitted, is a no-op.
func (s *Store) AbortBlock(cid ContainerID, lid LocalID) error {
	const op = "abort block"
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	ob, err := s.lockOpen(op, c, lid)
	if err != nil {
		return err
	}
	defer ob.mu.Unlock()
	exists, keep, inline := ob.exists, ob.committed.Length, ob.committed.Inline
	if err := s.dropRecords(c, lid, ob); err != nil {
		return s.ioErr(op, c, lid, keep, err)
	}
	s.dropOpen(c, lid, ob)
	if !exists {
		if err := c.vol.files.Remove(cid, lid); err != nil {
			return s.ioErr(op, c, lid, 0, err)
		}
		if err := c.vol.files.SyncContainer(cid); err != nil {
			return s.ioErr(op, c, lid, 0, err)
		}
		return nil
	}
	if inline {
		return nil // an inline block has no file, and nothing uncommitted
	}
	if err := c.vol.files.Truncate(cid, lid, keep); err != nil {
		return s.ioErr(op, c, lid, keep, err)
	}
	return nil
}

// dropRecords deletes the chunk records of a block's durable spans, durably.
// Caller holds ob.mu and drops the block's open state after.
func (s *Store) dropRecords(c *container, lid LocalID, ob *openBlock) error {
	b := c.vol.db.NewBatch()
	defer c.vol.closeBatch(b)
	for _, sp := range ob.written {
		if sp.durable {
			b.Delete(makeChunkKey(c.id, lid, sp.off), nil)
			b.Delete(makeDeferredKey(c.id, lid, sp.off), nil) // if it was one
		}
	}
	if b.Empty() {
		return nil
	}
	if err := c.vol.commit(b, s.metaSync()); err != nil {
		return err
	}
	for _, sp := range ob.written {
		if sp.durable && sp.inline {
			c.vol.defer_.dropGen(makeDeferredKey(c.id, lid, sp.off)) // never the flusher's
		}
	}
	return nil
}
