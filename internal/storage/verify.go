package storage

import (
	"errors"
	"fmt"
	"io/fs"

	"golang.org/x/sys/unix"
)

// Replica failures. A committed block whose data is damaged, whose file is
// gone or whose file cannot be read fails its container's replica here,
// never the whole volume: the container is marked UNHEALTHY durably (the
// datanode reports it, SCM copies it from a healthy replica and drops this
// one) and the other containers of the volume carry on. Whether the disk
// itself is dead is decided by CheckVolumes (a probe file), by Pebble
// errors and by write errors, which fail the volume.

// corruptKind is a sentinel that also matches ErrCorruption, so a caller that
// treats any damaged replica alike (a reader that reports it and tries
// another) needs one test.
type corruptKind string

func (e corruptKind) Error() string        { return string(e) }
func (e corruptKind) Is(target error) bool { return target == ErrCorruption }

var (
	// ErrBlockFileMissing: a committed block has no data file on its
	// volume. Also matches ErrCorruption.
	ErrBlockFileMissing error = corruptKind("block file missing")
	// ErrBlockUnreadable: a committed block's data file exists but cannot
	// be opened or read (EIO, EACCES, ...). Also matches ErrCorruption.
	ErrBlockUnreadable error = corruptKind("block file unreadable")
	// ErrTemporary: a read failed for a reason that says nothing about the
	// replica (too many open files, out of memory); retry later.
	ErrTemporary = errors.New("temporary resource shortage")
)

// temporary reports whether err is a process resource limit rather than a
// fault of the file or the disk.
func temporary(err error) bool {
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) || errors.Is(err, unix.ENOMEM) ||
		errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR)
}

// blockFileErr classifies an error opening or reading the data file of a
// committed block of c: a missing file (ErrBlockFileMissing) or one that
// cannot be read (ErrBlockUnreadable) fails this replica (see
// failReplica); a resource limit is ErrTemporary and changes nothing.
// commitHeld: the caller holds c.commitMu.
func (s *Store) blockFileErr(op string, c *container, lid LocalID, off int64, err error, commitHeld bool) error {
	if temporary(err) {
		return oErr(op, ErrTemporary, c.id, lid, off, "", err).withVolume(c.vol.path)
	}
	kind := ErrBlockUnreadable
	if errors.Is(err, fs.ErrNotExist) {
		kind = ErrBlockFileMissing
	}
	return s.failReplica(op, c, lid, off, kind, kind.Error(), err, commitHeld)
}

// failReplica marks c UNHEALTHY durably because committed block lid is
// damaged (kind and detail say how) and returns the error for the caller,
// unless the block or container was deleted meanwhile (a delete removes
// the metadata before the files, so a vanished file of a block whose
// record is gone is no fault): then it returns ErrBlockNotFound or
// ErrContainerNotFound and marks nothing.
func (s *Store) failReplica(op string, c *container, lid LocalID, off int64, kind error, detail string, cause error, commitHeld bool) error {
	// A volume whose metadata store met a fatal error (its own DB, or a
	// zoned backend's) fails as a volume: an error from it says nothing
	// about this replica, whose data may well be intact, and must not be
	// written down as a damaged block (durably UNHEALTHY). Checked before
	// commitMu, which a request stalled in a wedged DB may hold.
	if ferr := metaFatal(c.vol, cause); ferr != nil {
		return s.volumeFatalErr(op, c, lid, off, ferr)
	}
	if !commitHeld {
		c.commitMu.Lock()
		defer c.commitMu.Unlock()
	}
	s.mu.RLock()
	live := s.containers[c.id] == c && !s.closed
	s.mu.RUnlock()
	if !live {
		return cErr(op, ErrContainerNotFound, c.id, "deleted meanwhile", nil)
	}
	if _, err := s.getBlock(c, lid); err != nil {
		return err // deleted meanwhile, or the DB failed (volume failed)
	}
	e := oErr(op, kind, c.id, lid, off, detail, cause).withVolume(c.vol.path)
	if off < 0 {
		e = bErr(op, kind, c.id, lid, detail, cause).withVolume(c.vol.path)
	}
	c.mu.Lock()
	st := c.rec.State
	c.mu.Unlock()
	if st != StateUnhealthy {
		s.opts.Logf("storage: container %d UNHEALTHY: %v", c.id, e)
		if err := s.setState(op, c, StateUnhealthy); err != nil {
			return err
		}
	}
	return e
}

// VerifyOptions tune VerifyBlock.
type VerifyOptions struct {
	// Buf is scratch space of at least 64 KiB, 4 KiB-aligned (see
	// AlignedBuffer) so reads bypass the page cache; it bounds the bytes
	// read at once (a checksum window larger than Buf gets its own buffer).
	// Default: a pooled 4 MiB buffer.
	Buf []byte
	// Before, if set, is called with the size of each read before it is
	// made (a rate limiter waits there); an error stops the verification
	// and is returned as is.
	Before func(n int64) error
}

// VerifyBlock re-reads committed block lid of container cid from disk and
// checks every checksum window of every chunk, one piece at a time (memory
// is bounded by the buffer, not the block). It returns the bytes verified.
// A damaged replica fails its container (marked UNHEALTHY durably, logged)
// and the error says how, each kind also matching ErrCorruption:
//   - data that does not match its checksums, or a file shorter than the
//     committed length: ErrCorruption (wrapping ErrChecksumMismatch for a
//     mismatch), naming the offset of the first bad window;
//   - no data file: ErrBlockFileMissing;
//   - a file that cannot be opened or read: ErrBlockUnreadable.
//
// A block or container deleted while it was verified is ErrBlockNotFound
// or ErrContainerNotFound and marks nothing; a failed volume is
// ErrVolumeFailed; a process resource limit is ErrTemporary. Chunks
// without checksums (type NONE) are read, so an unreadable file is still
// found, but not verified.
func (s *Store) VerifyBlock(cid ContainerID, lid LocalID, o VerifyOptions) (int64, error) {
	const op = "verify"
	c, err := s.container(op, cid)
	if err != nil {
		return 0, err
	}
	bd, err := s.getBlock(c, lid)
	if err != nil {
		return 0, err
	}
	if bd.Length == 0 {
		return 0, nil
	}
	buf := o.Buf
	if len(buf) < 64<<10 || !isAligned(buf) {
		p := readBufPool.Get().(*[]byte)
		defer readBufPool.Put(p)
		buf = *p
	}
	r, err := s.blockReader(c, &bd)
	if err != nil {
		return 0, s.blockFileErr(op, c, lid, -1, err, false)
	}
	defer r.Close()
	var done int64
	var big []byte // for a window larger than buf
	for _, ch := range bd.Chunks {
		bpc := int64(ch.Checksum.BytesPerChecksum)
		if ch.Checksum.Type == ChecksumNone || bpc <= 0 {
			bpc = directAlign
		}
		b := buf
		// Whole windows per read, plus the alignment slack at both ends.
		step := (int64(len(b)) - 2*directAlign) / bpc * bpc
		if step <= 0 {
			if big == nil || int64(len(big)) < bpc+2*directAlign {
				big = AlignedBuffer(int(bpc + 2*directAlign))
			}
			b, step = big, bpc
		}
		for ws := ch.Offset; ws < ch.Offset+ch.Length; ws += step {
			we := min(ws+step, ch.Offset+ch.Length)
			as := ws &^ (directAlign - 1)
			ae := (we + directAlign - 1) &^ (directAlign - 1)
			if o.Before != nil {
				if err := o.Before(we - ws); err != nil {
					return done, err
				}
			}
			n, err := r.ReadAt(b[:ae-as], as)
			if int64(n) < we-as {
				if err != nil && !isEOF(err) {
					return done, s.blockFileErr(op, c, lid, ws, err, false)
				}
				return done, s.failReplica(op, c, lid, as+int64(n), ErrCorruption,
					fmt.Sprintf("block file shorter than committed length %d", bd.Length), nil, false)
			}
			if ch.Checksum.Type != ChecksumNone {
				if bad := ch.Checksum.verifyRange(b[ws-as:we-as], int((ws-ch.Offset)/bpc)); bad >= 0 {
					return done, s.failReplica(op, c, lid, ws+bad,
						ErrCorruption, fmt.Sprintf("%s window of %d bytes does not match", ch.Checksum.Type, bpc), ErrChecksumMismatch, false)
				}
			}
			done += we - ws
		}
	}
	return done, nil
}

// metaFatal returns the fatal error of v's metadata store if err is one
// (a *FatalError, from v's DB or its backend's) or v's DB is wedged or its
// backend reports one; else nil.
func metaFatal(v *volume, err error) error {
	if fe := (*FatalError)(nil); errors.As(err, &fe) {
		return err
	}
	if v.wedged.Load() {
		return v.usable()
	}
	return backendFatal(v)
}

// volumeFatalErr fails c's volume for the fatal error ferr of its metadata
// store and returns the caller's ErrVolumeFailed.
func (s *Store) volumeFatalErr(op string, c *container, lid LocalID, off int64, ferr error) error {
	s.fatalVolume(c.vol, ferr)
	if off < 0 {
		return bErr(op, ErrVolumeFailed, c.id, lid, "", ferr).withVolume(c.vol.path)
	}
	return oErr(op, ErrVolumeFailed, c.id, lid, off, "", ferr).withVolume(c.vol.path)
}
