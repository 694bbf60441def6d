package storage

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// ErrNoBlockFile: the block's data cannot be handed out as a file of its
// own (a backend other than posix, a file system without descriptors, a
// block with uncommitted writes, an UNHEALTHY container). Read it instead.
var ErrNoBlockFile = errors.New("block data not available as a file")

// PassesBlockFiles reports whether some volume keeps block data in
// per-block files of the operating system's file system (the posix
// backend), whose descriptors OpenBlockFile can hand to a local reader.
func (s *Store) PassesBlockFiles() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, v := range s.volumes {
		if _, ok := v.files.(*Posix); ok {
			return true
		}
	}
	return false
}

// OpenBlockFile opens committed block lid's data file read-only for a
// reader on this host (short-circuit reads) and returns it with the
// block's committed description. Only bytes [0, bd.Length) are committed;
// the caller does not verify them: whoever reads the file checks every
// checksum window against bd. Committed bytes are never rewritten, so the
// open file stays valid after the block is deleted. ErrNoBlockFile when
// the data is not in a file of its own (see there).
func (s *Store) OpenBlockFile(cid ContainerID, lid LocalID) (*os.File, BlockData, error) {
	c, err := s.container("open block file", cid)
	if err != nil {
		return nil, BlockData{}, err
	}
	p, ok := c.vol.files.(*Posix)
	if !ok {
		return nil, BlockData{}, ErrNoBlockFile
	}
	c.mu.Lock()
	unhealthy := c.rec.State == StateUnhealthy
	_, open := c.open[lid]
	c.mu.Unlock()
	if unhealthy || open {
		return nil, BlockData{}, ErrNoBlockFile
	}
	bd, err := s.getBlock(c, lid)
	if err != nil {
		return nil, BlockData{}, err
	}
	if bd.Inline {
		return nil, BlockData{}, ErrNoBlockFile // no file: its data is in the metadata store (inline.go)
	}
	vf, err := p.fs.OpenFile(p.path(cid, lid), os.O_RDONLY, 0)
	if err != nil {
		return nil, BlockData{}, err
	}
	defer vf.Close()
	fder, ok := vf.(interface{ Fd() uintptr })
	if !ok {
		return nil, BlockData{}, ErrNoBlockFile // a test or fault-injecting file system
	}
	fd, err := unix.FcntlInt(fder.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, BlockData{}, err
	}
	return os.NewFile(uintptr(fd), p.path(cid, lid)), bd, nil
}
