package storage

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"io"
)

// Export stream format (all integers big-endian):
//
//	magic "BSLTCNT1"
//	u64 containerID | u64 maxSize | u64 bcsid | u64 blockCount | u64 usedBytes
//	blockCount × ( u32 recordLen | block record | data, Length bytes )
//	sha256 of every byte before it (32)
//
// Each block's data is verified against its chunk checksums on export (so a
// corrupt replica is not spread) and on import; the trailing SHA-256 also
// covers the metadata and the framing.
const exportMagic = "BSLTCNT1"

// maxExportRecord bounds a block record read from an untrusted stream.
const maxExportRecord = 16 << 20

// Export writes a CLOSED container as one stream. It reads from the disk and
// verifies every checksum; a corrupt block fails the export with
// ErrCorruption.
func (s *Store) Export(cid ContainerID, w io.Writer) error {
	const op = "export"
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	// Holding commitMu keeps DeleteBlocks out while we stream.
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	rec, cnt := c.rec, c.cnt
	c.mu.Unlock()
	if rec.State != StateClosed {
		return cErr(op, ErrContainerNotClosed, cid, rec.State.String(), nil)
	}
	h := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(w, h), 1<<20)
	hdr := make([]byte, 0, 48)
	hdr = append(hdr, exportMagic...)
	for _, v := range []uint64{uint64(cid), uint64(rec.MaxSize), cnt.BCSID, uint64(cnt.Blocks), uint64(cnt.Used)} {
		hdr = binary.BigEndian.AppendUint64(hdr, v)
	}
	if _, err := bw.Write(hdr); err != nil {
		return cErr(op, ErrInvalidArgument, cid, "writing stream", err)
	}
	buf := AlignedBuffer(readPiece)
	var start LocalID
	var n int64
	for {
		blocks, err := s.ListBlocks(cid, start, 256)
		if err != nil {
			return err
		}
		for _, bd := range blocks {
			n++
			file := bd
			file.Inline = false // the stream carries the data; Import stores it in a file
			rec := encodeBlock(&file)
			if _, err := bw.Write(binary.BigEndian.AppendUint32(nil, uint32(len(rec)))); err != nil {
				return bErr(op, ErrInvalidArgument, cid, bd.LocalID, "writing stream", err)
			}
			bw.Write(rec)
			for off := int64(0); off < bd.Length; {
				k := min(int64(len(buf)), bd.Length-off)
				if _, err := s.readAt(c, bd.LocalID, buf[:k], off, true); err != nil {
					return err
				}
				if _, err := bw.Write(buf[:k]); err != nil {
					return oErr(op, ErrInvalidArgument, cid, bd.LocalID, off, "writing stream", err)
				}
				off += k
			}
		}
		if len(blocks) < 256 {
			break
		}
		start = blocks[len(blocks)-1].LocalID + 1
	}
	if n != cnt.Blocks {
		return cErr(op, ErrCorruption, cid, fmt.Sprintf("counters say %d blocks, found %d", cnt.Blocks, n), nil)
	}
	if err := bw.Flush(); err != nil {
		return cErr(op, ErrInvalidArgument, cid, "writing stream", err)
	}
	_, err = w.Write(h.Sum(nil))
	return err
}

// hashReader hashes what it reads.
type hashReader struct {
	r io.Reader
	h hash.Hash
}

func (h *hashReader) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	h.h.Write(p[:n])
	return n, err
}

// Import reads a stream made by Export into a new CLOSED container on the
// volume with most room, verifying every chunk checksum and the stream's
// SHA-256. Nothing is visible until the whole stream verified and the data
// is durable; a failed or interrupted import leaves no trace (after Open).
func (s *Store) Import(r io.Reader) (ContainerReport, error) {
	const op = "import"
	hr := &hashReader{r: bufio.NewReaderSize(r, 1<<20), h: sha256.New()}
	hdr := make([]byte, 48)
	if _, err := io.ReadFull(hr, hdr); err != nil {
		return ContainerReport{}, cErr(op, ErrBadExport, 0, "short header", err)
	}
	if string(hdr[:8]) != exportMagic {
		return ContainerReport{}, cErr(op, ErrBadExport, 0, fmt.Sprintf("bad magic %q", hdr[:8]), nil)
	}
	u := func(i int) uint64 { return binary.BigEndian.Uint64(hdr[8+8*i:]) }
	cid := ContainerID(u(0))
	rec := containerRecord{State: StateClosed, MaxSize: int64(u(1))}
	want := counters{BCSID: u(2), Blocks: int64(u(3)), Used: int64(u(4))}
	if rec.MaxSize <= 0 || want.Blocks < 0 || want.Used < 0 || want.Used > rec.MaxSize {
		return ContainerReport{}, cErr(op, ErrBadExport, cid, fmt.Sprintf("bad header: max %d, %d blocks, %d bytes", rec.MaxSize, want.Blocks, want.Used), nil)
	}
	c, err := s.reserveID(op, cid)
	if err != nil {
		return ContainerReport{}, err
	}
	v, err := s.pickVolume(want.Used)
	if err != nil {
		s.dropID(cid)
		return ContainerReport{}, cErr(op, ErrNoVolume, cid, "", err)
	}
	c.vol, c.rec = v, rec
	ok := false
	defer func() {
		if !ok {
			s.dropID(cid)
			if !v.failed.Load() {
				v.files.RemoveContainer(cid)
			}
		}
	}()
	if err := v.files.CreateContainer(cid); err != nil {
		return ContainerReport{}, s.ioErr(op, c, 0, 0, err)
	}
	batch := v.db.NewBatch()
	defer v.closeBatch(batch)
	var got counters
	buf := AlignedBuffer(readPiece)
	var lenBuf [4]byte
	var prev LocalID
	for i := int64(0); i < want.Blocks; i++ {
		if _, err := io.ReadFull(hr, lenBuf[:]); err != nil {
			return ContainerReport{}, cErr(op, ErrBadExport, cid, fmt.Sprintf("block %d of %d: short stream", i, want.Blocks), err)
		}
		rl := binary.BigEndian.Uint32(lenBuf[:])
		if rl > maxExportRecord {
			return ContainerReport{}, cErr(op, ErrBadExport, cid, fmt.Sprintf("block record of %d bytes", rl), nil)
		}
		// Grow with the bytes that arrive, not with what the stream claims.
		raw, err := io.ReadAll(io.LimitReader(hr, int64(rl)))
		if err == nil && len(raw) < int(rl) {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return ContainerReport{}, cErr(op, ErrBadExport, cid, "short block record", err)
		}
		bd, err := decodeBlock(raw)
		if err != nil {
			return ContainerReport{}, cErr(op, ErrBadExport, cid, "block record: "+err.Error(), nil)
		}
		if err := s.validateBlock(cid, &bd); err != nil {
			return ContainerReport{}, err
		}
		// Export writes blocks in local ID order; a repeated or unordered ID
		// would overwrite a record while counting it twice.
		if i > 0 && bd.LocalID <= prev {
			return ContainerReport{}, bErr(op, ErrBadExport, cid, bd.LocalID, fmt.Sprintf("block %d follows block %d", bd.LocalID, prev), nil)
		}
		prev = bd.LocalID
		if err := s.importBlock(c, &bd, hr, buf); err != nil {
			return ContainerReport{}, err
		}
		got.Blocks++
		got.Used += bd.Length
		got.BCSID = max(got.BCSID, bd.BCSID)
		c.noteBlock(bd.LocalID)
		batch.Set(makeKey(cid, kindBlock, uint64(bd.LocalID)), raw, nil)
	}
	sum := hr.h.Sum(nil)
	trailer := make([]byte, sha256.Size)
	if _, err := io.ReadFull(hr.r, trailer); err != nil {
		return ContainerReport{}, cErr(op, ErrBadExport, cid, "missing SHA-256 trailer", err)
	}
	if string(trailer) != string(sum) {
		return ContainerReport{}, cErr(op, ErrBadExport, cid, "stream SHA-256 mismatch", ErrChecksumMismatch)
	}
	if got.Used != want.Used {
		return ContainerReport{}, cErr(op, ErrBadExport, cid, fmt.Sprintf("header says %d bytes, blocks hold %d", want.Used, got.Used), nil)
	}
	if err := v.files.SyncContainer(cid); err != nil {
		return ContainerReport{}, s.ioErr(op, c, 0, 0, err)
	}
	got.BCSID = max(got.BCSID, want.BCSID)
	batch.Set(makeKey(cid, kindContainer, idRecord), rec.encode(), nil)
	batch.Set(makeKey(cid, kindContainer, idCounters), got.encode(), nil)
	if err := v.commit(batch, s.metaSync()); err != nil {
		return ContainerReport{}, s.ioErr(op, c, 0, 0, err)
	}
	c.mu.Lock()
	c.cnt, c.importing = got, false
	c.mu.Unlock()
	ok = true
	return c.report(), nil
}

// importBlock copies one block's data from r to disk chunk by chunk,
// verifying each piece before writing it, and syncs it.
func (s *Store) importBlock(c *container, bd *BlockData, r io.Reader, buf []byte) error {
	const op = "import"
	if bd.Length == 0 {
		return nil
	}
	w, err := c.vol.files.OpenWriter(c.id, bd.LocalID)
	if err != nil {
		return s.ioErr(op, c, bd.LocalID, 0, err)
	}
	defer w.Close()
	for _, ch := range bd.Chunks {
		step := int64(len(buf))
		bpc := int64(ch.Checksum.BytesPerChecksum)
		if ch.Checksum.Type != ChecksumNone {
			if bpc > step {
				return oErr(op, ErrBadExport, c.id, bd.LocalID, ch.Offset, fmt.Sprintf("checksum window %d too large to import", bpc), nil)
			}
			step = step / bpc * bpc
		}
		for pos := ch.Offset; pos < ch.Offset+ch.Length; {
			k := min(step, ch.Offset+ch.Length-pos)
			if _, err := io.ReadFull(r, buf[:k]); err != nil {
				return oErr(op, ErrBadExport, c.id, bd.LocalID, pos, "short block data", err)
			}
			if ch.Checksum.Type != ChecksumNone {
				if bad := ch.Checksum.verifyRange(buf[:k], int((pos-ch.Offset)/bpc)); bad >= 0 {
					return oErr(op, ErrBadExport, c.id, bd.LocalID, pos+bad, "data does not match checksum", ErrChecksumMismatch)
				}
			}
			if _, err := w.WriteAt(buf[:k], pos); err != nil {
				return s.ioErr(op, c, bd.LocalID, pos, err)
			}
			pos += k
		}
	}
	if err := w.Sync(); err != nil {
		return s.ioErr(op, c, bd.LocalID, 0, err)
	}
	return nil
}
