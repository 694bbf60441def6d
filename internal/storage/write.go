package storage

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/vfs"
)

// The write path. WriteChunk puts a chunk's bytes in its block file and
// remembers the chunk in memory; Sync makes every chunk written so far
// durable (block files fdatasync'd, new directory entries synced, then one
// chunk record per chunk in one synced Pebble batch per volume); PutBlock
// commits a block made only of chunks this replica holds, with the
// checksums the PutBlock names. A chunk record is written only after its
// data is on disk, so after a crash the records are exactly the durable
// chunks, and a range without one is a hole that PutBlock refuses
// (ErrChunkMissing) instead of committing zeros.

func writable(st State) bool { return st == StateOpen || st == StateClosing }

// ValidateChunk checks the shape of a chunk against the hard limits before
// anything is stored: offset and length in range (length at most
// MaxChunkSize, end at most MaxBlockSize), checksum metadata that covers
// exactly length bytes (known type, window in [512 B, 16 MiB], one sum per
// window). A datanode calls it before a WriteChunk or PutSmallFile enters
// a replicated log, because a chunk that every replica's storage refuses
// would otherwise sit in the log forever. Errors match ErrInvalidArgument.
func ValidateChunk(off, length int64, sum ChecksumData) error {
	return validateChunk("validate chunk", 0, 0, off, length, sum, MaxChunkSize, MaxBlockSize)
}

// ValidateChunk is the package's ValidateChunk with this store's limits
// (Options.MaxChunkSize, MaxBlockSize), naming container and block.
func (s *Store) ValidateChunk(cid ContainerID, lid LocalID, off, length int64, sum ChecksumData) error {
	return validateChunk("validate chunk", cid, lid, off, length, sum, s.opts.MaxChunkSize, s.opts.MaxBlockSize)
}

func validateChunk(op string, cid ContainerID, lid LocalID, off, n int64, sum ChecksumData, maxChunk, maxBlock int64) error {
	switch {
	case off < 0 || n <= 0:
		return oErr(op, ErrInvalidArgument, cid, lid, off, fmt.Sprintf("length %d", n), nil)
	case n > maxChunk:
		return oErr(op, ErrChunkTooLarge, cid, lid, off, fmt.Sprintf("length %d > %d", n, maxChunk), nil)
	case off > maxBlock-n:
		return oErr(op, ErrBlockTooLarge, cid, lid, off, fmt.Sprintf("end %d > %d", off+n, maxBlock), nil)
	}
	if sum.Type != ChecksumNone || len(sum.Sums) > 0 {
		if err := sum.validate(n); err != nil {
			return oErr(op, ErrBadChecksum, cid, lid, off, err.Error(), nil)
		}
	}
	return nil
}

// ValidateBlock checks a PutBlock's block description against this store's
// limits without touching storage: length in range, chunks contiguous from
// 0 and summing to the length, each with well-formed checksums. Errors
// match ErrInvalidArgument.
func (s *Store) ValidateBlock(cid ContainerID, bd BlockData) error {
	return s.validateBlock(cid, &bd)
}

func (s *Store) validateBlock(cid ContainerID, bd *BlockData) error {
	const op = "put block"
	lid := bd.LocalID
	switch {
	case bd.Length < 0 || bd.Length > s.opts.MaxBlockSize:
		return bErr(op, ErrBlockTooLarge, cid, lid, fmt.Sprintf("length %d, limit %d", bd.Length, s.opts.MaxBlockSize), nil)
	case len(bd.Chunks) > maxChunksPerBlock:
		return bErr(op, ErrBadBlockData, cid, lid, fmt.Sprintf("%d chunks > %d", len(bd.Chunks), maxChunksPerBlock), nil)
	}
	var pos int64
	for _, ch := range bd.Chunks {
		if ch.Offset != pos || ch.Length <= 0 || ch.Length > bd.Length-pos {
			return oErr(op, ErrBadBlockData, cid, lid, ch.Offset, fmt.Sprintf("chunk [%d,+%d) does not start at %d or passes length %d", ch.Offset, ch.Length, pos, bd.Length), nil)
		}
		if err := ch.Checksum.validate(ch.Length); err != nil {
			return oErr(op, ErrBadChecksum, cid, lid, ch.Offset, err.Error(), nil)
		}
		pos += ch.Length
	}
	if pos != bd.Length {
		return bErr(op, ErrBadBlockData, cid, lid, fmt.Sprintf("chunks sum to %d, length %d", pos, bd.Length), nil)
	}
	return nil
}

// WriteChunk writes data at offset off of an uncommitted part of block lid.
// sum, if its Type is not NONE, must hold the chunk's checksums; with verify
// the data is checked against them first.
//
// When WriteChunk returns nil the bytes are in the block file but not
// durable: they become durable at the next Sync (or at a PutBlock or
// BlockStream.Close that needs them); under SyncAlways before WriteChunk
// returns. Readers see them only after a PutBlock names them. Writing the
// same offset, length and checksums again (a Raft re-delivery) is a no-op
// whether the chunk is written, durable or committed.
func (s *Store) WriteChunk(cid ContainerID, lid LocalID, off int64, data []byte, sum ChecksumData, verify bool) error {
	return s.writeChunk(cid, lid, off, data, sum, verify, false, false)
}

// shareable reports whether data, handed over by WriteSmallChunkShared,
// is kept by reference: only if its capacity ends close to its length; a
// piece of a larger buffer whose capacity runs on (up to the buffer's
// end) is copied, so a block that is never committed cannot keep that
// buffer alive until it is deleted or the store restarts. Go cannot tell
// where an allocation starts, so a piece cut to its own length still
// passes: raft cuts each entry's data so (cap == len), and a follower's
// entry from a frame of 256 KiB or more (raft/frame.go aliasFrame; smaller
// frames are copied into one buffer per message) keeps that frame alive
// while its block stays uncommitted. Only an entry that a new leader
// drops leaves such a block behind (until DeleteBlocks, the container's
// deletion or a restart): at most one frame (MaxFrameBytes) per dropped
// entry, a leader change's worth.
func shareable(data []byte) bool {
	return cap(data)-len(data) <= len(data)/8+64
}

// writeChunk is WriteChunk; small: WriteSmallChunk's (inline.go); shared:
// the caller never modifies data again, so it may be kept instead of a
// copy (WriteSmallChunkShared).
func (s *Store) writeChunk(cid ContainerID, lid LocalID, off int64, data []byte, sum ChecksumData, verify, small, shared bool) error {
	const op = "write chunk"
	n := int64(len(data))
	if err := validateChunk(op, cid, lid, off, n, sum, s.opts.MaxChunkSize, s.opts.MaxBlockSize); err != nil {
		return err
	}
	if verify && sum.Type != ChecksumNone {
		if bad := sum.Verify(data); bad >= 0 {
			return oErr(op, ErrChecksumMismatch, cid, lid, off+bad, "data sent does not match its checksum", nil)
		}
	}
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	ob, err := s.lockOpen(op, c, lid)
	if err != nil {
		return err
	}
	defer s.unlockOpen(c, lid, ob)
	if err := s.writeLocked(op, c, lid, ob, off, data, sum, small, shared); err != nil {
		return err
	}
	if s.opts.Sync == SyncAlways {
		return s.flushLocked(c, lid, ob)
	}
	return nil
}

func (s *Store) writeLocked(op string, c *container, lid LocalID, ob *openBlock, off int64, data []byte, sum ChecksumData, small, shared bool) error {
	n := int64(len(data))
	end := off + n
	if ob.committed.Inline && off >= ob.committed.Length {
		return oErr(op, ErrChunkOverlap, c.id, lid, off, errInlineFinal, nil)
	}
	if off < ob.committed.Length {
		for _, ch := range ob.committed.Chunks {
			if ch.Offset == off && ch.Length == n && sum.Type != ChecksumNone && ch.Checksum.equal(sum) {
				return nil // re-delivery of a committed chunk
			}
		}
		return oErr(op, ErrChunkOverlap, c.id, lid, off, fmt.Sprintf("range [%d,%d) overlaps committed length %d", off, end, ob.committed.Length), nil)
	}
	// A chunk recovered after a crash is checked before a re-delivery can
	// be taken as a no-op: it may be the very chunk that was lost.
	if err := s.verifyLocked(c, lid, ob, off, end); err != nil {
		return s.ioErr(op, c, lid, off, err)
	}
	// Find the first written span ending after off.
	i := sort.Search(len(ob.written), func(i int) bool { return ob.written[i].end() > off })
	if i < len(ob.written) && ob.written[i].off < end {
		w := ob.written[i]
		if w.off != off || w.n != n {
			return oErr(op, ErrChunkOverlap, c.id, lid, off, fmt.Sprintf("range [%d,%d) partly overlaps written [%d,%d)", off, end, w.off, w.end()), nil)
		}
		if w.sum.Type != ChecksumNone && sum.Type != ChecksumNone {
			if !w.sum.equal(sum) {
				return oErr(op, ErrChunkOverlap, c.id, lid, off, "rewrite with different checksums", nil)
			}
			// Re-delivery: the same bytes are written already, and durable
			// or queued for the next Sync.
			return nil
		}
		return s.rewriteLocked(op, c, lid, ob, i, data, sum)
	}
	if hasSmall(ob) {
		// Refused by the small flag, not by whether the chunk is inline
		// here: alike on every replica, whatever its volume's settings.
		return oErr(op, ErrChunkOverlap, c.id, lid, off, errInlineFinal, nil)
	}
	inline := small && s.inlineOK(c, ob, off, n, sum)
	if !s.opts.OutOfOrderWrites && off != ob.hwm {
		return oErr(op, ErrChunkOutOfOrder, c.id, lid, off, fmt.Sprintf("expected offset %d", ob.hwm), nil)
	}
	grow := max(0, end-ob.hwm)

	c.mu.Lock()
	switch {
	case !writable(c.rec.State):
		c.mu.Unlock()
		return oErr(op, ErrContainerNotOpen, c.id, lid, off, c.rec.State.String(), nil)
	case c.cnt.Used+c.pending+grow > c.rec.MaxSize:
		c.mu.Unlock()
		return oErr(op, ErrContainerFull, c.id, lid, off, fmt.Sprintf("%d used + %d pending + %d > limit %d", c.cnt.Used, c.pending, grow, c.rec.MaxSize), nil)
	}
	c.pending += grow // reserve; released on the way out unless the write is kept
	c.mu.Unlock()
	kept := false
	defer func() {
		// Also on a panic a caller's guard recovers (the datanode's
		// WriteData guard): a reservation left behind would count
		// against the container for good.
		if !kept {
			c.mu.Lock()
			c.pending -= grow
			c.mu.Unlock()
		}
	}()
	s.testPoint("write: space reserved")

	if grow > 0 {
		// A cached figure, not a statfs per chunk (see vfs.Space).
		if err := c.vol.space.Admit(grow); err != nil {
			if errors.Is(err, vfs.ErrNoSpace) {
				return oErr(op, ErrDiskFull, c.id, lid, off, "", err).withVolume(c.vol.path)
			}
			return s.ioErr(op, c, lid, off, err)
		}
	}
	if !inline {
		if err := s.openWriter(c, lid, ob); err != nil {
			return s.ioErr(op, c, lid, off, err)
		}
		if _, err := ob.w.WriteAt(data, off); err != nil {
			return s.ioErr(op, c, lid, off, err)
		}
	}
	sp := span{off: off, n: n, sum: sum, inline: inline, small: small && off == 0}
	if c.vol.defer_ != nil && n <= s.opts.DeferredMax && sum.Type != ChecksumNone {
		// May be a deferred write (deferred.go) or inline data (inline.go);
		// only read from here on.
		if shared && shareable(data) {
			sp.data = data[:n:n]
		} else {
			sp.data = slices.Clone(data)
		}
	}
	ob.written = slices.Insert(ob.written, i, sp)
	kept = true
	ob.hwm = max(ob.hwm, end)
	s.queue(c, lid, ob)
	s.checkOpen(c, ob)
	return nil
}

// CheckSpace reports whether n bytes of block data would be refused for
// lack of space (ErrDiskFull), from the cached free space: a caller asks
// before putting a write into a replicated log. For a container not here
// yet (its first write creates it) it asks every healthy volume and
// refuses only if none has room.
func (s *Store) CheckSpace(cid ContainerID, n int64) error {
	s.mu.RLock()
	c := s.containers[cid]
	vols := s.volumes
	s.mu.RUnlock()
	if c != nil {
		// A container still being created or imported: ask every
		// volume, as for one not here yet.
		if v := c.visibleVol(); v != nil {
			vols = []*volume{v}
		}
	}
	var last error
	for _, v := range vols {
		if v.failed.Load() || v.space == nil {
			continue
		}
		err := v.space.Check(n)
		if err == nil || !errors.Is(err, vfs.ErrNoSpace) {
			return nil // an I/O error shows up on the write itself
		}
		last = err
	}
	if last != nil {
		return oErr("write chunk", ErrDiskFull, cid, 0, 0, "", last)
	}
	return nil
}

// rewriteLocked writes span i again: a re-delivery where one side has no
// checksums, so equality cannot be told and the bytes are written again.
// A durable span loses its record first: while the bytes are rewritten
// they may be torn, and a record must only ever name good bytes.
func (s *Store) rewriteLocked(op string, c *container, lid LocalID, ob *openBlock, i int, data []byte, sum ChecksumData) error {
	off := ob.written[i].off
	if ob.written[i].inline {
		return oErr(op, ErrChunkOverlap, c.id, lid, off, "rewrite of an inline chunk without checksums", nil)
	}
	c.mu.Lock()
	st := c.rec.State
	c.mu.Unlock()
	if !writable(st) {
		return oErr(op, ErrContainerNotOpen, c.id, lid, off, st.String(), nil)
	}
	if ob.written[i].durable {
		// A deferred write's key goes in the same batch: left, a crash
		// before the flusher deleted it would make Open write the old
		// bytes over the rewrite (deferred.go).
		b := c.vol.db.NewBatch()
		b.Delete(makeChunkKey(c.id, lid, off), nil)
		b.Delete(makeDeferredKey(c.id, lid, off), nil) // if it was one
		err := c.vol.commit(b, s.metaSync())
		c.vol.closeBatch(b)
		if err != nil {
			return s.ioErr(op, c, lid, off, err)
		}
		ob.written[i].durable = false
		s.queue(c, lid, ob)
	}
	err := s.openWriter(c, lid, ob)
	if err == nil {
		_, err = ob.w.WriteAt(data, off)
	}
	if err != nil {
		// The old bytes may be torn now: the chunk is gone.
		s.forget(c, ob, func(sp span) bool { return sp.off == off })
		return s.ioErr(op, c, lid, off, err)
	}
	if sum.Type != ChecksumNone {
		ob.written[i].sum = sum
	}
	ob.written[i].unverified = false
	s.queue(c, lid, ob)
	return nil
}

func (s *Store) openWriter(c *container, lid LocalID, ob *openBlock) error {
	if ob.w != nil {
		return nil
	}
	w, err := c.vol.files.OpenWriter(c.id, lid)
	if err != nil {
		return err
	}
	ob.w = w
	return nil
}

// queue puts a block with non-durable spans in its volume's dirty set.
// Caller holds ob.mu.
func (s *Store) queue(c *container, lid LocalID, ob *openBlock) {
	if ob.queued {
		return
	}
	ob.queued = true
	c.vol.dmu.Lock()
	c.vol.dirty[ob] = blockRef{c, lid}
	c.vol.dmu.Unlock()
}

// forget drops the non-durable spans for which drop is true: their bytes
// cannot be trusted (a failed write or sync). A non-durable span has no
// chunk record, so nothing on disk names them. hwm and the container's
// pending bytes follow. Caller holds ob.mu.
func (s *Store) forget(c *container, ob *openBlock, drop func(span) bool) {
	keep := ob.written[:0]
	for _, sp := range ob.written {
		if sp.durable || !drop(sp) {
			keep = append(keep, sp)
		}
	}
	clear(ob.written[len(keep):])
	ob.written = keep
	hwm := ob.committed.Length
	if n := len(ob.written); n > 0 {
		hwm = max(hwm, ob.written[n-1].end())
	}
	c.mu.Lock()
	c.pending -= ob.hwm - hwm
	c.mu.Unlock()
	ob.hwm = hwm
}

// checkOpen asserts the invariants of an open block (see openBlock).
func (s *Store) checkOpen(c *container, ob *openBlock) {
	pos := ob.committed.Length
	for _, sp := range ob.written {
		if sp.off < pos || sp.n <= 0 || sp.end() > ob.hwm {
			panic(fmt.Sprintf("storage: container %d: written spans out of order: [%d,+%d) after %d, hwm %d, committed %d",
				c.id, sp.off, sp.n, pos, ob.hwm, ob.committed.Length))
		}
		if !sp.durable && !ob.queued {
			panic(fmt.Sprintf("storage: container %d: span [%d,+%d) neither durable nor queued for Sync", c.id, sp.off, sp.n))
		}
		if sp.unverified && (!sp.durable || sp.sum.Type == ChecksumNone) {
			panic(fmt.Sprintf("storage: container %d: span [%d,+%d) unverified but not a durable checksummed chunk", c.id, sp.off, sp.n))
		}
		pos = sp.end()
	}
}

// WriteChunkDurable is WriteChunk followed by the Sync that makes the chunk
// durable, for a caller that acknowledges this one chunk: it returns nil
// only when this chunk is durable. Concurrent callers share Sync rounds
// (group commit). Prefer it to WriteChunk + Sync when the caller cannot
// tell whose chunks a failed round forgot: a round started by another
// caller may fail for this block before this caller's Sync, and that Sync
// would then find nothing to do. The error then wraps ErrDiskFull or
// ErrVolumeFailed (the round's failure), or ErrChunkMissing (a round that
// a runtime error ended, recovered by a caller's guard: see syncRound),
// and names the chunk.
func (s *Store) WriteChunkDurable(cid ContainerID, lid LocalID, off int64, data []byte, sum ChecksumData, verify bool) error {
	if err := s.WriteChunk(cid, lid, off, data, sum, verify); err != nil {
		return err
	}
	return s.awaitDurable(cid, lid, off, int64(len(data)))
}

// awaitDurable runs a Sync round of the chunk's volume and checks that the
// chunk is durable (committed, or a durable span).
func (s *Store) awaitDurable(cid ContainerID, lid LocalID, off, n int64) error {
	const op = "write chunk"
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	// The round's error may be another block's: this chunk's own state
	// decides.
	serr := s.syncVolume(c.vol)
	if s.durableRange(c, lid, off, n) {
		return nil
	}
	c.vol.dmu.Lock()
	cause := cmp.Or(serr, c.vol.lastSyncErr)
	c.vol.dmu.Unlock()
	kind := ErrVolumeFailed
	var se *Error
	if errors.As(cause, &se) {
		kind = se.Kind
	}
	return oErr(op, kind, cid, lid, off, fmt.Sprintf("chunk [%d,%d) lost: a sync of its block failed", off, off+n), cause).withVolume(c.vol.path)
}

// durableRange reports whether [off, off+n) of block lid is committed or
// covered by durable spans.
func (s *Store) durableRange(c *container, lid LocalID, off, n int64) bool {
	end := off + n
	c.mu.Lock()
	ob := c.open[lid]
	c.mu.Unlock()
	committed := func() bool {
		bd, err := s.getBlock(c, lid)
		return err == nil && end <= bd.Length
	}
	if ob == nil {
		return committed()
	}
	ob.mu.Lock()
	defer ob.mu.Unlock()
	if ob.dead {
		return committed()
	}
	pos := max(off, ob.committed.Length)
	for _, sp := range ob.written {
		if pos >= end {
			break
		}
		if sp.end() <= pos {
			continue
		}
		if sp.off > pos || !sp.durable {
			return false
		}
		pos = sp.end()
	}
	return pos >= end
}

// Sync makes durable every chunk whose WriteChunk returned before Sync was
// called: it fdatasyncs each block file with new chunks, syncs the
// directory entry of each new block file, and commits one chunk record per
// chunk in one synced Pebble batch per volume (volumes in parallel). It is
// the acknowledgement point of a chunk write: call it once per batch of
// writes (one raft Ready) and acknowledge the batch only if it returns nil.
//
// Concurrent callers share work: a Sync takes everything pending into its
// round and then waits for the rounds already running (they hold chunks
// written before it was called), so N writers calling Sync at once cost
// overlapping flushes, not N flushes in a row.
//
// On error (ErrDiskFull, or ErrVolumeFailed naming the volume) the chunks
// of the blocks whose sync failed are forgotten, as if never written (after a failed fsync their
// bytes cannot be trusted): a PutBlock naming them fails with
// ErrChunkMissing and a re-delivery writes them again. Chunks on other
// volumes and other blocks are durable. The error goes to the caller whose
// round failed, which need not be the writer of the forgotten chunks: a
// writer that acknowledges its own chunk uses WriteChunkDurable.
func (s *Store) Sync() error {
	s.mu.RLock()
	closed := s.closed
	s.mu.RUnlock()
	if closed {
		return cErr("sync", ErrClosed, 0, "", nil)
	}
	if len(s.volumes) == 1 {
		return s.syncVolume(s.volumes[0]) // no method value to allocate
	}
	return onVolumes(s.volumes, s.syncVolume)
}

type dirtyBlock struct {
	ob *openBlock
	blockRef
}

func (s *Store) syncVolume(v *volume) error {
	v.dmu.Lock()
	earlier := make([]*round, 0, len(v.inflight))
	for r := range v.inflight {
		earlier = append(earlier, r)
	}
	if len(v.dirty) == 0 && len(earlier) == 0 {
		v.dmu.Unlock()
		return nil
	}
	list := make([]dirtyBlock, 0, len(v.dirty))
	for ob, r := range v.dirty {
		list = append(list, dirtyBlock{ob, r})
	}
	v.dirty = make(map[*openBlock]blockRef, len(list))
	r := &round{done: make(chan struct{})}
	v.inflight[r] = struct{}{}
	v.dmu.Unlock()

	s.syncRound(v, r, list)
	// Chunks written before this call may be in rounds still running.
	err := r.err
	for _, e := range earlier {
		<-e.done
		if err == nil {
			err = e.err
		}
	}
	return err
}

// syncRound runs round r over list: it locks each live block, persists
// them, and finishes the round (blocks unlocked, r out of v.inflight,
// r.done closed) by defer, so that a panic inside the round, which a
// caller's guard may recover (the datanode's SyncData guard does), leaves
// no block locked and no later round of the volume waiting for r. After a
// panic r fails (ErrChunkMissing), and the blocks' non-durable spans
// are forgotten as after a failed fsync: nothing is acknowledged as
// durable that the round did not make so, and a re-delivery writes the
// chunks again.
func (s *Store) syncRound(v *volume, r *round, list []dirtyBlock) {
	var live []dirtyBlock // the blocks locked so far
	finished := false
	defer func() {
		if !finished {
			r.err = cErr("sync", ErrChunkMissing, 0, "a sync round panicked: its unsynced chunks are forgotten", nil).withVolume(v.path)
			for _, d := range live {
				s.forget(d.c, d.ob, func(span) bool { return true })
			}
		}
		for _, d := range live {
			d.ob.mu.Unlock()
		}
		v.dmu.Lock()
		delete(v.inflight, r)
		if r.err != nil {
			v.lastSyncErr = r.err
		}
		v.dmu.Unlock()
		close(r.done)
	}()
	// One lock order (container, block) within a round. Rounds hold
	// disjoint blocks (a block is queued again only under its lock, which
	// its round holds until done), and no other path holds two block
	// locks, so rounds overlap without deadlock: a Sync that arrives while
	// another flushes starts its own flush at once.
	slices.SortFunc(list, func(a, b dirtyBlock) int {
		return cmp.Or(cmp.Compare(a.c.id, b.c.id), cmp.Compare(a.lid, b.lid))
	})
	live = list[:0]
	for _, d := range list {
		d.ob.mu.Lock()
		if d.ob.dead {
			d.ob.mu.Unlock()
			continue
		}
		d.ob.queued = false
		live = append(live, d)
	}
	if len(live) > 0 {
		s.testPoint("sync round: blocks locked")
		r.err = s.persist("sync", v, live)
	}
	finished = true
}

// flushLocked makes one block's written chunks durable now (SyncAlways,
// BlockStream.Close). Caller holds ob.mu.
func (s *Store) flushLocked(c *container, lid LocalID, ob *openBlock) error {
	return s.persist("sync", c.vol, []dirtyBlock{{ob, blockRef{c, lid}}})
}

func nonDurable(ob *openBlock) bool {
	for _, sp := range ob.written {
		if !sp.durable {
			return true
		}
	}
	return false
}

// earlySize is about the byte size of persist's early batch for todo:
// each unsynced span's record, and the data of those deferred.
func earlySize(v *volume, todo []dirtyBlock) int {
	n := 0
	for _, d := range todo {
		def := v.defer_ != nil && deferrable(d.ob)
		for _, sp := range d.ob.written {
			if sp.durable {
				continue
			}
			n += 64
			if def {
				n += 64 + len(sp.data)
			}
		}
	}
	return n
}

// persist makes the non-durable spans of blocks durable. Callers hold every
// ob.mu.
//
// Order: the data of a chunk must be on disk before anything can commit it.
// For a chunk with checksums the record may become durable first, because
// its checksums tell good bytes from missing ones: after a crash such a
// record is checked against the bytes before the chunk is used (verify), so
// the fdatasyncs, the directory syncs and the Pebble commit of checksummed
// chunks run at the same time and a Sync costs one device flush, not three
// in a row. A chunk without checksums (the V2 stream) cannot be checked, so
// its record is committed only after its data and directory entry are
// durable.
func (s *Store) persist(op string, v *volume, blocks []dirtyBlock) error {
	var firstErr error
	setErr := func(d dirtyBlock, err error) {
		if firstErr == nil {
			off := int64(-1)
			for _, sp := range d.ob.written {
				if !sp.durable {
					off = sp.off
					break
				}
			}
			firstErr = s.ioErr(op, d.c, d.lid, off, err)
		}
	}
	if v.failed.Load() {
		for _, d := range blocks {
			if nonDurable(d.ob) {
				setErr(d, v.err())
				s.forget(d.c, d.ob, func(span) bool { return true })
			}
		}
		return firstErr
	}
	var todo []dirtyBlock
	for _, d := range blocks {
		if nonDurable(d.ob) {
			todo = append(todo, d)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	// Records of checksummed chunks (early) and of the others (after data).
	// The early batch is sized for its deferred data up front: grown by
	// doubling from a small pooled batch, a batch of small files' bytes
	// allocated about twice their size on every replica.
	early, late := v.db.NewBatchWithSize(earlySize(v, todo)), v.db.NewBatch()
	defer v.closeBatch(early)
	defer v.closeBatch(late)
	// On a panic (a caller's guard may recover it, see syncRound), before
	// the batches close: wait for an early commit still running on its
	// goroutine (closing the batch under it would race), and undo the
	// deferred keys' generations if not done yet. Set at every return.
	earlyDone := make(chan error, 1)
	var (
		earlyAsync  bool   // the early commit runs on a committer
		earlyWait   func() // waits for it (once), then sends to earlyDone
		earlyWaited bool
		undone      bool
		returned    bool
		undoBuf     [4]func() // up to 4 deferred keys without an allocation
	)
	undos := undoBuf[:0]
	//
	// The undos are only for an early batch that did not commit: once it
	// committed, the new generations stand (undoing them let an older
	// flush delete a rewritten key the round had marked durable:
	// TestPanicAfterSpansMarkedKeepsRewrite). Keep returned set at every
	// return below, or a normal return would run the undos.
	defer func() {
		if returned {
			return
		}
		if !earlyWaited {
			err := errEarlyNotRun
			if earlyAsync {
				earlyWait()
				err = <-earlyDone
			} else {
				select {
				case err = <-earlyDone:
				default:
				}
			}
			earlyWaited = true
			if err == nil {
				undone = true
			}
		}
		if !undone {
			for _, undo := range undos {
				undo()
			}
		}
	}()
	// deferred[i]: todo[i]'s unsynced data is all small checksummed
	// chunks: their bytes go in the early batch and its file is synced
	// later (deferred.go); the others are synced now.
	deferred := make([]bool, len(todo))
	// gens: the generation of each deferred key set below (deferrer.gens);
	// undos restore the previous ones if the batch fails.
	type deferSlot struct {
		c   *container
		lid LocalID
		off int64
	}
	var gens map[deferSlot]uint64
	var now []dirtyBlock
	var nowAt []int
	for i, d := range todo {
		deferred[i] = v.defer_ != nil && deferrable(d.ob)
		if !deferred[i] {
			now = append(now, d)
			nowAt = append(nowAt, i)
		}
		for _, sp := range d.ob.written {
			if sp.durable {
				continue
			}
			b := late
			if sp.sum.Type != ChecksumNone {
				b = early
			}
			b.Set(makeChunkKey(d.c.id, d.lid, sp.off), encodeChunkRec(sp.n, sp.sum, sp.small), nil)
			if deferred[i] {
				k := makeDeferredKey(d.c.id, d.lid, sp.off)
				gen, undo := v.defer_.setGen(k)
				if gens == nil {
					gens = map[deferSlot]uint64{}
				}
				gens[deferSlot{d.c, d.lid, sp.off}] = gen
				undos = append(undos, undo)
				early.Set(k, sp.data, nil)
			}
		}
	}
	// The early commit runs beside the data syncs of the others; with no
	// data to sync now (a batch of small files, all deferred) it runs on
	// this goroutine: a goroutine per Sync grew a fresh stack through
	// Pebble's commit every time.
	syncNow := s.opts.Sync != SyncNone && len(now) > 0
	switch {
	case early.Empty():
		earlyDone <- nil
	case !syncNow:
		earlyDone <- v.commit(early, s.metaSync())
	default:
		// Handed to a committer (no goroutine of its own), waited for
		// below or, on a panic, by the deferred undo above.
		c, err := v.g.start(early, s.metaSync())
		if c == nil {
			earlyDone <- err
			break
		}
		earlyAsync = true
		earlyWait = func() {
			// A panic of the commit fails the volume (guardVolume)
			// instead of the process, and the round gets an error.
			err := errEarlyPanic
			defer func() { earlyDone <- err }()
			defer s.guardVolume(v, "the early commit of a sync round")
			err = v.g.wait(c)
		}
	}
	errs := make([]error, len(todo))
	if syncNow {
		nowErrs := make([]error, len(now))
		s.syncData(v, now, nowErrs)
		for j, i := range nowAt {
			errs[i] = nowErrs[j]
		}
	}
	s.testPoint("persist: early commit started")
	if earlyAsync {
		earlyWait()
	}
	earlyErr := <-earlyDone
	earlyWaited = true
	if earlyErr == nil {
		undone = true // committed: the generations stand
	} else {
		undone = true
		for _, undo := range undos {
			undo()
		}
	}
	var ok, bad []dirtyBlock
	var okAt []int
	for i, d := range todo {
		if errs[i] != nil {
			setErr(d, errs[i])
			bad = append(bad, d)
		} else {
			ok = append(ok, d)
			okAt = append(okAt, i)
		}
	}
	var lateErr error
	if earlyErr == nil && !late.Empty() {
		lateErr = v.commit(late, s.metaSync())
	}
	var handed []deferredChunk
	for k, d := range ok {
		def := deferred[okAt[k]] && earlyErr == nil
		for i := range d.ob.written {
			sp := &d.ob.written[i]
			switch {
			case sp.durable:
			case sp.sum.Type != ChecksumNone && earlyErr == nil:
				sp.durable = true
				if def && !sp.inline {
					handed = append(handed, deferredChunk{c: d.c, lid: d.lid, off: sp.off, dir: d.ob.dirSync, gen: gens[deferSlot{d.c, d.lid, sp.off}]})
					d.c.deferredKeys.Add(1)
				}
			case sp.sum.Type == ChecksumNone && earlyErr == nil && lateErr == nil:
				sp.durable = true
			}
			if sp.durable && !sp.inline {
				sp.data = nil // an inline span's bytes wait for its PutBlock
			}
		}
		if def {
			// The deferred key stands for the directory entry until the
			// flusher syncs it.
			d.ob.dirSync = false
		}
		if err := cmp.Or(earlyErr, lateErr); err != nil {
			setErr(d, err)
			s.forget(d.c, d.ob, func(span) bool { return true })
		}
		s.checkOpen(d.c, d.ob)
	}
	s.testPoint("persist: spans marked")
	if len(handed) > 0 {
		v.addDeferred(handed)
	}
	if len(bad) > 0 {
		// A failed fsync may have dropped the dirty pages: the chunks are
		// gone. Records committed early for them go too (best effort: if
		// this fails as well, recovery checks them against their bytes).
		del := v.db.NewBatch()
		for _, d := range bad {
			for _, sp := range d.ob.written {
				if !sp.durable && sp.sum.Type != ChecksumNone && earlyErr == nil {
					del.Delete(makeChunkKey(d.c.id, d.lid, sp.off), nil)
				}
			}
			s.forget(d.c, d.ob, func(span) bool { return true })
		}
		if !del.Empty() {
			if err := v.commit(del, s.metaSync()); err != nil {
				s.opts.Logf("storage: volume %s: deleting records of chunks whose sync failed: %v", v.path, err)
			}
		}
		v.closeBatch(del)
	}
	returned = true
	return firstErr
}

// errEarlyNotRun: persist's early batch was never committed (a panic
// came before its commit).
var errEarlyNotRun = errors.New("storage: early batch not committed")

// syncData fdatasyncs the files of blocks and the directory entries of new
// ones, several at once (each is a device flush; the device overlaps
// them); errs[i] is block i's outcome.
func (s *Store) syncData(v *volume, blocks []dirtyBlock, errs []error) {
	sem := make(chan struct{}, maxSyncParallel)
	var wg sync.WaitGroup
	// On a panic too: the syncs use the blocks' writers, which the
	// caller's blocks' locks guard (see syncRound).
	defer wg.Wait()
	// A panic on a sync's goroutine is raised again on the caller's
	// (carried) once every sync has returned, as onVolumes does.
	var pmu sync.Mutex
	var panicked any
	defer func() {
		wg.Wait()
		if panicked != nil {
			panic(panicked)
		}
	}()
	run := func(f func()) {
		if len(blocks) == 1 {
			f()
			return
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			defer func() {
				if p := recover(); p != nil {
					pmu.Lock()
					if panicked == nil {
						panicked = carried(p)
					}
					pmu.Unlock()
				}
			}()
			f()
		}()
	}
	dirs := map[ContainerID]*error{}
	for _, d := range blocks {
		// A container with deferred writes not flushed yet has file
		// entries that may not be durable, perhaps this block's own.
		if (d.ob.dirSync || d.c.deferredKeys.Load() > 0) && dirs[d.c.id] == nil {
			e := new(error)
			dirs[d.c.id] = e
			cid := d.c.id
			run(func() { *e = v.files.SyncContainer(cid) })
		}
	}
	for i, d := range blocks {
		if err := s.openWriter(d.c, d.lid, d.ob); err != nil {
			errs[i] = err
			continue
		}
		run(func() { errs[i] = d.ob.w.Sync() })
	}
	wg.Wait()
	for i, d := range blocks {
		if e := dirs[d.c.id]; e != nil {
			if errs[i] == nil {
				errs[i] = *e
			}
			if *e == nil {
				d.ob.dirSync = false
			}
		}
	}
}

// verifyLocked checks the recovered chunks of a block that overlap
// [from, to) against their checksums (see persist): a chunk whose bytes do
// not match was not durable when the machine stopped; its record is
// deleted and the range becomes a hole. Caller holds ob.mu.
func (s *Store) verifyLocked(c *container, lid LocalID, ob *openBlock, from, to int64) error {
	var r BlockReader
	defer func() {
		if r != nil {
			r.Close()
		}
	}()
	var lost []int64
	for i := range ob.written {
		sp := &ob.written[i]
		if !sp.unverified || sp.end() <= from || sp.off >= to {
			continue
		}
		if sp.end() > ob.committed.Length && sp.n > MaxChunkSize {
			panic(fmt.Sprintf("storage: container %d block %d: recovered chunk of %d bytes", c.id, lid, sp.n))
		}
		if r == nil {
			var err error
			if r, err = c.vol.files.OpenReader(c.id, lid); err != nil {
				return err
			}
		}
		buf := AlignedBuffer(int(sp.n))
		n, err := r.ReadAt(buf, sp.off)
		if err != nil {
			return err
		}
		if int64(n) == sp.n && sp.sum.Verify(buf) < 0 {
			sp.unverified = false
			continue
		}
		s.opts.Logf("storage: container %d block %d: chunk [%d,+%d) lost in a crash (bytes do not match its record)", c.id, lid, sp.off, sp.n)
		lost = append(lost, sp.off)
	}
	if len(lost) == 0 {
		return nil
	}
	b := c.vol.db.NewBatch()
	defer c.vol.closeBatch(b)
	for _, off := range lost {
		b.Delete(makeChunkKey(c.id, lid, off), nil)
	}
	if err := c.vol.commit(b, s.metaSync()); err != nil {
		return err
	}
	for i := range ob.written {
		if slices.Contains(lost, ob.written[i].off) {
			ob.written[i].durable = false // no record any more
		}
	}
	s.forget(c, ob, func(sp span) bool { return slices.Contains(lost, sp.off) })
	return nil
}

// PutBlock commits a block: its chunk list, length and checksums become
// visible, durably (under SyncOnCommit) when it returns nil. The chunks
// must cover [0, Length) contiguously, and each chunk beyond the block's
// previous commit must be written on this replica with the same offset,
// length and checksums (a chunk written without checksums, as the V2
// stream does, only has to be covered): otherwise ErrChunkMissing names
// the first range that is not, and nothing changes. Chunks written but not
// yet durable are synced first. Re-committing with a longer chunk list that
// starts with the committed one extends the block (its BCSID may not go
// back); repeating a commit is a no-op.
func (s *Store) PutBlock(cid ContainerID, bd BlockData) error {
	return s.putBlock(cid, bd, false)
}

// PutBlockDeferred commits a block as PutBlock does (same checks; the
// chunks' data is durable before the record that names it), except that it
// does not wait for the record to reach disk: the block is committed at
// once for readers, and durable once a SyncCommits called after this
// returned has returned. Nothing may be acknowledged in between. A
// pipeline's apply loop commits a batch of entries this way and makes them
// durable with one SyncCommits (one WAL flush per volume for the batch, and
// concurrent batches of pipelines sharing a volume share that flush)
// before it reports any of them applied: group commit, where PutBlock
// costs a device flush per block.
func (s *Store) PutBlockDeferred(cid ContainerID, bd BlockData) error {
	return s.putBlock(cid, bd, true)
}

// SyncCommits makes durable every PutBlockDeferred that returned before it
// was called, on every volume: one Pebble WAL sync per volume that had
// such a commit since its last sync (the WAL is sequential, so a sync
// covers every record before it). On error the volume is failed (its
// containers are reported UNHEALTHY) and the error wraps ErrVolumeFailed.
// A pipeline uses SyncCommitsFor, which waits only for its containers'
// volumes.
func (s *Store) SyncCommits() error {
	s.mu.RLock()
	closed := s.closed
	vols := s.volumes
	s.mu.RUnlock()
	if closed {
		return cErr("sync commits", ErrClosed, 0, "", nil)
	}
	var errs []error
	for _, v := range vols {
		if err := s.syncCommitsVolume(v); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// SyncCommitsFor is SyncCommits limited to the volumes holding the given
// containers (synced in parallel): a slow or failed disk delays or fails
// only the batches with a container on it, never a pipeline whose
// containers are all elsewhere (as SyncContainers for chunks). A container
// not here (deleted since its commit) has nothing left to make durable and
// is skipped. A volume failed already reports its failure without being
// touched. The error names the failed volumes; a caller that must know
// which containers are affected asks again per container (a call for a
// volume synced since costs nothing).
func (s *Store) SyncCommitsFor(ids []ContainerID) error {
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return cErr("sync commits", ErrClosed, 0, "", nil)
	}
	var vols []*volume
	for _, id := range ids {
		if c := s.containers[id]; c != nil && c.vol != nil && !slices.Contains(vols, c.vol) {
			vols = append(vols, c.vol)
		}
	}
	s.mu.RUnlock()
	return onVolumes(vols, s.syncCommitsVolume)
}

// syncCommitsVolume makes v's deferred commits durable (SyncCommits).
func (s *Store) syncCommitsVolume(v *volume) error {
	// Every commit counted in target had returned from its Pebble
	// commit; a sync that completed after covering target (this one or a
	// concurrent caller's) makes them durable.
	target := v.deferredSeq.Load()
	if v.syncedSeq.Load() >= target {
		return nil
	}
	if v.failed.Load() {
		// A failed disk is not asked again (it may hang): what it did
		// not sync is lost to this replica.
		return cErr("sync commits", ErrVolumeFailed, 0, "volume failed", v.err()).withVolume(v.path)
	}
	if err := v.logData(pebble.Sync); err != nil {
		v.fail(err, s.opts.Logf)
		return cErr("sync commits", ErrVolumeFailed, 0, "WAL sync", err).withVolume(v.path)
	}
	for {
		done := v.syncedSeq.Load()
		if done >= target || v.syncedSeq.CompareAndSwap(done, target) {
			break
		}
	}
	return nil
}

func (s *Store) putBlock(cid ContainerID, bd BlockData, deferred bool) error {
	const op = "put block"
	lid := bd.LocalID
	if err := s.validateBlock(cid, &bd); err != nil {
		return err
	}
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	ob, err := s.lockOpen(op, c, lid)
	if err != nil {
		return err
	}
	defer s.unlockOpen(c, lid, ob)
	c.mu.Lock()
	st := c.rec.State
	c.mu.Unlock()
	if !writable(st) {
		return bErr(op, ErrContainerNotOpen, cid, lid, st.String(), nil)
	}
	old := ob.committed
	if len(bd.Chunks) < len(old.Chunks) || bd.Length < old.Length {
		return bErr(op, ErrBadBlockData, cid, lid, fmt.Sprintf("length %d shrinks committed length %d", bd.Length, old.Length), nil)
	}
	for i, ch := range old.Chunks {
		n := bd.Chunks[i]
		if n.Offset != ch.Offset || n.Length != ch.Length || !n.Checksum.equal(ch.Checksum) {
			return oErr(op, ErrBadBlockData, cid, lid, ch.Offset, "changes a committed chunk", nil)
		}
	}
	if ob.exists && bd.Length == old.Length && len(old.Chunks) == len(bd.Chunks) {
		return nil // repeated commit (Raft re-apply)
	}
	if old.Inline {
		return bErr(op, ErrBadBlockData, cid, lid, errInlineFinal, nil)
	}
	if ob.exists && bd.BCSID < old.BCSID {
		return bErr(op, ErrBadBlockData, cid, lid, fmt.Sprintf("BCSID %d goes back from committed %d", bd.BCSID, old.BCSID), nil)
	}
	if !smallCommitOK(ob, &bd) {
		// Any other shape would commit a file block over an inline span
		// (no file holds its bytes). Refused by the span's small flag, not
		// by whether it is inline here, so every replica refuses alike.
		return bErr(op, ErrBadBlockData, cid, lid, "commit differs from the block's small chunk", nil)
	}
	if err := s.verifyLocked(c, lid, ob, old.Length, bd.Length); err != nil {
		return s.ioErr(op, c, lid, old.Length, err)
	}
	if err := matchWritten(op, cid, lid, ob.written, bd.Chunks[len(old.Chunks):]); err != nil {
		return err
	}
	// An inline block's bytes go in the commit's own batch: nothing to
	// sync first (inline.go).
	inline := inlineCommit(ob, &bd)
	bd.Inline = inline
	var need bool
	for _, sp := range ob.written {
		if sp.off < bd.Length && !sp.durable {
			need = true
		}
	}
	if s.opts.Sync != SyncNone && bd.Length > old.Length && (need || ob.dirSync) && !inline {
		if err := s.openWriter(c, lid, ob); err != nil {
			return s.ioErr(op, c, lid, 0, err)
		}
		if err := ob.w.Sync(); err != nil {
			s.forget(c, ob, func(span) bool { return true })
			return s.ioErr(op, c, lid, 0, err)
		}
		if ob.dirSync || c.deferredKeys.Load() > 0 {
			if err := c.vol.files.SyncContainer(cid); err != nil {
				return s.ioErr(op, c, lid, 0, err)
			}
			ob.dirSync = false
		}
	}

	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	st = c.rec.State
	cnt := c.cnt
	c.mu.Unlock()
	if !writable(st) {
		return bErr(op, ErrContainerNotOpen, cid, lid, st.String(), nil)
	}
	grow := bd.Length - old.Length
	cnt.Used += grow
	if !ob.exists {
		cnt.Blocks++
	}
	cnt.BCSID = max(cnt.BCSID, bd.BCSID)
	cnt.check(cid)
	c.noteBlock(lid)
	b := c.vol.db.NewBatch()
	b.Set(makeKey(cid, kindBlock, uint64(lid)), encodeBlock(&bd), nil)
	b.Set(makeKey(cid, kindContainer, idCounters), cnt.encode(), nil)
	var inlineKey []byte
	if inline {
		// The data stays under its deferred key, for good: set by the
		// Sync that made the chunk durable, or here (inline.go).
		inlineKey = makeDeferredKey(cid, lid, 0)
		if sp := ob.written[0]; !sp.durable {
			b.Set(inlineKey, sp.data, nil)
		}
	}
	// The committed chunks' records go in the same batch; a chunk that
	// straddles the new length keeps its tail as a chunk of unknown sums.
	var keep []span
	for _, sp := range ob.written {
		if sp.off >= bd.Length {
			keep = append(keep, sp)
			continue
		}
		if sp.durable {
			b.Delete(makeChunkKey(cid, lid, sp.off), nil)
		}
		if sp.end() > bd.Length {
			tail := span{off: bd.Length, n: sp.end() - bd.Length, durable: sp.durable}
			if tail.durable {
				b.Set(makeChunkKey(cid, lid, tail.off), encodeChunk(tail.n, ChecksumData{}), nil)
			}
			keep = append(keep, tail)
		}
	}
	wo := s.metaSync()
	deferred = deferred && wo.Sync
	if deferred {
		wo = pebble.NoSync
	}
	if err := c.vol.commit(b, wo); err != nil {
		return s.ioErr(op, c, lid, 0, err)
	}
	if deferred {
		c.vol.deferredSeq.Add(1) // after the commit: see SyncCommits
	}
	if inlineKey != nil {
		c.vol.defer_.dropGen(inlineKey)
	}
	c.mu.Lock()
	c.cnt = cnt
	c.pending -= grow
	c.mu.Unlock()
	ob.committed, ob.exists = bd, true
	ob.written = keep
	s.checkOpen(c, ob)
	return nil
}

// matchWritten checks that every chunk is written: covered by spans, and
// equal to the one span that holds it when both have checksums.
func matchWritten(op string, cid ContainerID, lid LocalID, written []span, chunks []ChunkInfo) error {
	i := 0
	for _, ch := range chunks {
		end := ch.Offset + ch.Length
		for i < len(written) && written[i].end() <= ch.Offset {
			i++
		}
		for j, pos := i, ch.Offset; pos < end; j++ {
			if j >= len(written) || written[j].off > pos {
				hole := end
				if j < len(written) {
					hole = min(end, written[j].off)
				}
				return oErr(op, ErrChunkMissing, cid, lid, pos, fmt.Sprintf("chunk [%d,%d): no data at [%d,%d)", ch.Offset, end, pos, hole), nil)
			}
			sp := written[j]
			if sp.sum.Type != ChecksumNone && ch.Checksum.Type != ChecksumNone {
				if sp.off != ch.Offset || sp.n != ch.Length {
					return oErr(op, ErrChunkMissing, cid, lid, ch.Offset, fmt.Sprintf("chunk [%d,%d) differs from the chunk written at [%d,%d)", ch.Offset, end, sp.off, sp.end()), nil)
				}
				if !sp.sum.equal(ch.Checksum) {
					return oErr(op, ErrChunkMissing, cid, lid, ch.Offset, fmt.Sprintf("chunk [%d,%d) was written with other checksums", ch.Offset, end), nil)
				}
			}
			pos = sp.end()
		}
	}
	return nil
}
