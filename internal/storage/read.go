package storage

import (
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"sync"
)

// readPiece bounds the bytes one read step holds in memory (plus two
// alignment pages); a chunk with a larger checksum window reads one window
// at a time.
const readPiece = 4 << 20

// pipePiece is the unit of the read pipeline. 4 MiB: on the measured disk
// 1 MiB direct reads ran at 1.6 GB/s against 2.0+ for 4 MiB, which cost more
// than overlapping verification saved (docs/BENCHMARKS.md). So only calls
// larger than 4 MiB overlap; a 4 MiB call is one read then one verify.
const pipePiece = readPiece

// readStep is one piece of a ReadAt: the windows [ws, we) of chunk ch,
// serving the caller's bytes from pos.
type readStep struct {
	ch          int
	pos, ws, we int64
	buf, data   []byte
	pooled      *[]byte
	n           int
	at          int64 // offset where a short read stopped
	short       bool
	err         error
	// panicked: a panic of the read on its own goroutine, raised again
	// on the caller's (carried), where the caller's guard sees it.
	panicked any
}

var readBufPool = sync.Pool{New: func() any { b := AlignedBuffer(readPiece + 2*directAlign); return &b }}

// ReadAt fills p with the committed data of block lid at offset off,
// verifying every checksum window the range touches. The whole range must
// lie inside the block (ErrOutOfRange otherwise). Data that fails
// verification returns ErrCorruption naming the offset, within the block,
// of the first bad window. When p, off and len(p) are 4 KiB-aligned and the
// range covers whole windows, data is read straight into p (no copy).
//
// A block file that is missing or cannot be read fails this replica only:
// its container is marked UNHEALTHY and the error is ErrBlockFileMissing or
// ErrBlockUnreadable (both match ErrCorruption). Data that fails its
// checksums is reported as ErrCorruption without a mark: the datanode has
// the block re-verified (VerifyBlock), which marks it if confirmed.
func (s *Store) ReadAt(cid ContainerID, lid LocalID, p []byte, off int64) (int, error) {
	c, err := s.container("read", cid)
	if err != nil {
		return 0, err
	}
	return s.readAt(c, lid, p, off, false)
}

// ReadAtUnverified is ReadAt without the checksum verification: for a
// reader that verifies every window itself from the block's stored
// checksums (the client's read path), so the bytes are checked once, not
// twice. Missing, unreadable and short block files fail as with ReadAt;
// silent corruption is left to the caller and to the scrubber.
func (s *Store) ReadAtUnverified(cid ContainerID, lid LocalID, p []byte, off int64) (int, error) {
	c, err := s.container("read", cid)
	if err != nil {
		return 0, err
	}
	return s.readAtOpt(c, lid, p, off, false, false)
}

// readAt is ReadAt on a looked-up container; commitHeld: the caller holds
// c.commitMu (Export).
func (s *Store) readAt(c *container, lid LocalID, p []byte, off int64, commitHeld bool) (int, error) {
	return s.readAtOpt(c, lid, p, off, commitHeld, true)
}

// readAtOpt is readAt; verify: check the checksum windows read.
func (s *Store) readAtOpt(c *container, lid LocalID, p []byte, off int64, commitHeld, verify bool) (int, error) {
	const op = "read"
	cid := c.id
	bd, err := s.getBlock(c, lid)
	if err != nil {
		return 0, err
	}
	end := off + int64(len(p))
	if off < 0 || end > bd.Length {
		return 0, oErr(op, ErrOutOfRange, cid, lid, off, fmt.Sprintf("range [%d,%d) outside block length %d", off, end, bd.Length), nil)
	}
	if len(p) == 0 {
		return 0, nil
	}
	r, err := s.blockReader(c, &bd)
	if err != nil {
		return 0, s.blockFileErr(op, c, lid, off, err, commitHeld)
	}
	defer r.Close()

	// Plan the pieces: whole checksum windows, at most pipePiece each.
	var pieces []readStep
	i := sort.Search(len(bd.Chunks), func(i int) bool { return bd.Chunks[i].Offset+bd.Chunks[i].Length > off })
	for pos := off; pos < end; {
		ch := bd.Chunks[i]
		cend := ch.Offset + ch.Length
		var ws, we int64
		bpc := int64(ch.Checksum.BytesPerChecksum)
		if ch.Checksum.Type == ChecksumNone || !verify {
			ws, we = pos, min(end, cend, pos+pipePiece)
		} else {
			ws = ch.Offset + (pos-ch.Offset)/bpc*bpc
			stop := min(end, cend)
			span := (stop - ws + bpc - 1) / bpc * bpc
			span = min(span, max(pipePiece/bpc, 1)*bpc)
			we = min(ws+span, cend)
		}
		pieces = append(pieces, readStep{ch: i, pos: pos, ws: ws, we: we})
		pos = min(end, we)
		if pos == cend {
			i++
		}
	}
	// Read piece k+1 while piece k is verified, so checksum work overlaps
	// the disk instead of adding to it (one read in flight, like dd).
	run := func(st *readStep) {
		dst := p[st.pos-off:]
		if st.pos == st.ws && st.we <= end && st.ws%directAlign == 0 && (st.we-st.ws)%directAlign == 0 && isAligned(dst) {
			st.data = dst[:st.we-st.ws]
			st.n, st.err = r.ReadAt(st.data, st.ws)
			st.short = int64(st.n) < st.we-st.ws
			st.at = st.ws + int64(st.n)
			return
		}
		as := st.ws &^ (directAlign - 1)
		ae := (st.we + directAlign - 1) &^ (directAlign - 1)
		if ae-as <= readPiece+2*directAlign {
			st.pooled = readBufPool.Get().(*[]byte)
			st.buf = (*st.pooled)[:ae-as]
		} else {
			st.buf = AlignedBuffer(int(ae - as)) // one window larger than readPiece
		}
		st.n, st.err = r.ReadAt(st.buf, as)
		st.short = int64(st.n) < st.we-as
		st.at = as + int64(st.n)
		if !st.short {
			st.data = st.buf[st.ws-as : st.we-as]
		}
	}
	done := make(chan struct{}, 1)
	run(&pieces[0])
	defer func() {
		for k := range pieces {
			if pieces[k].pooled != nil {
				readBufPool.Put(pieces[k].pooled)
			}
		}
	}()
	for k := range pieces {
		if k > 0 {
			<-done
		}
		if k+1 < len(pieces) {
			go func() {
				defer func() {
					if p := recover(); p != nil {
						pieces[k+1].panicked = carried(p)
					}
					done <- struct{}{}
				}()
				run(&pieces[k+1])
			}()
		}
		wait := func() {
			if k+1 < len(pieces) {
				<-done
			}
		}
		st := &pieces[k]
		if st.panicked != nil {
			wait()
			panic(st.panicked)
		}
		if st.err != nil {
			wait()
			return int(st.pos - off), s.blockFileErr(op, c, lid, st.ws, st.err, commitHeld)
		}
		if st.short {
			wait()
			return int(st.pos - off), oErr(op, ErrCorruption, cid, lid, st.at, "block file shorter than committed length", nil)
		}
		ch := bd.Chunks[st.ch]
		if verify && ch.Checksum.Type != ChecksumNone {
			bpc := int64(ch.Checksum.BytesPerChecksum)
			if bad := ch.Checksum.verifyRange(st.data, int((st.ws-ch.Offset)/bpc)); bad >= 0 {
				wait()
				return int(st.pos - off), oErr(op, ErrCorruption, cid, lid, st.ws+bad,
					fmt.Sprintf("%s window of %d bytes does not match", ch.Checksum.Type, bpc), ErrChecksumMismatch)
			}
		}
		dst := p[st.pos-off:]
		if &st.data[0] != &dst[0] {
			copy(dst, st.data[st.pos-st.ws:min(end, st.we)-st.ws])
		}
		if st.pooled != nil {
			readBufPool.Put(st.pooled)
			st.pooled = nil
		}
	}
	return len(p), nil
}

// ReadChunk returns length bytes of block lid from off, verified.
func (s *Store) ReadChunk(cid ContainerID, lid LocalID, off, length int64) ([]byte, error) {
	if length < 0 || length > s.opts.MaxBlockSize {
		return nil, oErr("read", ErrOutOfRange, cid, lid, off, fmt.Sprintf("length %d", length), nil)
	}
	p := AlignedBuffer(int(length))
	n, err := s.ReadAt(cid, lid, p, off)
	return p[:n], err
}

// ReadWritten returns length bytes of block lid from off whether or not the
// block is committed: the Raft layer uses it to resend a chunk it wrote
// (WriteChunk) but that no PutBlock has committed yet. The range must be
// written (durable or not) or committed on this replica; otherwise, and
// for a hole left by a crash, it fails with ErrBlockNotFound, which the
// caller reports as data lost. sum, the checksums the chunk was written
// with, verifies the data (ErrCorruption on a mismatch).
func (s *Store) ReadWritten(cid ContainerID, lid LocalID, off, length int64, sum ChecksumData) ([]byte, error) {
	const op = "read written"
	if off < 0 || length <= 0 || length > s.opts.MaxChunkSize {
		return nil, oErr(op, ErrOutOfRange, cid, lid, off, fmt.Sprintf("length %d", length), nil)
	}
	if sum.Type != ChecksumNone || len(sum.Sums) > 0 {
		if err := sum.validate(length); err != nil {
			return nil, oErr(op, ErrBadChecksum, cid, lid, off, err.Error(), nil)
		}
	}
	c, err := s.container(op, cid)
	if err != nil {
		return nil, err
	}
	held, inl, err := s.holdsInline(c, lid, off, length, true)
	if err != nil {
		return nil, s.ioErr(op, c, lid, off, err)
	}
	if !held {
		return nil, oErr(op, ErrBlockNotFound, cid, lid, off, fmt.Sprintf("range [%d,%d) not written on this replica", off, off+length), nil)
	}
	var r BlockReader
	if inl != nil {
		r, err = inl, nil
	} else if bd, gerr := s.getBlock(c, lid); gerr == nil && bd.Inline {
		r, err = s.blockReader(c, &bd)
	} else {
		r, err = c.vol.files.OpenReader(cid, lid)
	}
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, oErr(op, ErrBlockNotFound, cid, lid, off, "no data written", err)
		}
		if ferr := metaFatal(c.vol, err); ferr != nil {
			return nil, s.volumeFatalErr(op, c, lid, off, ferr)
		}
		return nil, readErr(op, c, lid, off, err)
	}
	defer r.Close()
	p := AlignedBuffer(int(length))
	n, err := r.ReadAt(p, off)
	if err != nil && !isEOF(err) {
		return nil, readErr(op, c, lid, off, err)
	}
	if int64(n) < length {
		return nil, oErr(op, ErrBlockNotFound, cid, lid, off, fmt.Sprintf("only %d of %d bytes written", n, length), nil)
	}
	if sum.Type != ChecksumNone {
		if bad := sum.Verify(p); bad >= 0 {
			return nil, oErr(op, ErrCorruption, cid, lid, off+bad, "written data fails its checksum", nil)
		}
	}
	return p, nil
}

// HasChunk reports whether bytes [off, off+length) of block lid are on this
// replica: committed, or written by WriteChunk (durable after Sync). After a
// restart a chunk that was not synced is not held: this is how a caller
// learns, persistently, that a chunk was lost here. Errors are those of a
// missing container or failed volume.
func (s *Store) HasChunk(cid ContainerID, lid LocalID, off, length int64) (bool, error) {
	if off < 0 || length <= 0 || off > MaxBlockSize-length {
		return false, oErr("has chunk", ErrInvalidArgument, cid, lid, off, fmt.Sprintf("length %d", length), nil)
	}
	c, err := s.container("has chunk", cid)
	if err != nil {
		return false, err
	}
	ok, err := s.holds(c, lid, off, length)
	if err != nil {
		return false, s.ioErr("has chunk", c, lid, off, err)
	}
	return ok, nil
}

// holds reports whether [off, off+n) of block lid is committed or covered
// by written spans (recovered ones checked against their checksums first).
func (s *Store) holds(c *container, lid LocalID, off, n int64) (bool, error) {
	ok, _, err := s.holdsInline(c, lid, off, n, false)
	return ok, err
}

// holdsInline is holds; with reader, inl, if not nil, reads the range from
// an uncommitted inline span (which has no file). Without reader no copy
// is made (holds runs per small file on every replica: SyncData's check).
func (s *Store) holdsInline(c *container, lid LocalID, off, n int64, reader bool) (held bool, inl BlockReader, err error) {
	end := off + n
	c.mu.Lock()
	ob := c.open[lid]
	c.mu.Unlock()
	committed := func() bool {
		bd, err := s.getBlock(c, lid)
		return err == nil && end <= bd.Length
	}
	if ob == nil {
		return committed(), nil, nil
	}
	ob.mu.Lock()
	defer ob.mu.Unlock()
	if ob.dead {
		return committed(), nil, nil
	}
	if err := s.verifyLocked(c, lid, ob, off, end); err != nil {
		return false, nil, err
	}
	if data, ok := writtenInline(ob, off, n); ok {
		if !reader {
			return true, nil, nil
		}
		// A copy: the span's bytes go when it is committed.
		return true, bytesReader(append(make([]byte, off), data...)), nil
	}
	pos := max(off, ob.committed.Length)
	for _, sp := range ob.written {
		if pos >= end {
			break
		}
		if sp.end() <= pos {
			continue
		}
		if sp.off > pos {
			return false, nil, nil
		}
		pos = sp.end()
	}
	return pos >= end, nil, nil
}

// readErr classifies a failed read of data that may not be committed:
// the replica's problem (ErrBlockUnreadable) or a resource limit
// (ErrTemporary), never the volume's; nothing is marked.
func readErr(op string, c *container, lid LocalID, off int64, err error) error {
	kind := ErrBlockUnreadable
	if temporary(err) {
		kind = ErrTemporary
	}
	return oErr(op, kind, c.id, lid, off, "", err).withVolume(c.vol.path)
}
