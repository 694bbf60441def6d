package storage

import (
	"fmt"

	"github.com/cockroachdb/pebble/v2"
)

// RecoverStats is what RecoverUnhealthy verified.
type RecoverStats struct {
	Blocks int   // committed blocks verified
	Bytes  int64 // bytes verified
}

// RecoverUnhealthy brings an UNHEALTHY container back as CLOSED (read
// only), for the operator path after a deterministic apply bug (the
// datanode decides whether the cause allows it: see datanode/recover.go).
// In order:
//   - the container must be UNHEALTHY and its volume not failed
//     (ErrContainerNotOpen naming the state, ErrVolumeFailed);
//   - data beyond each open block's committed length is discarded, as
//     CloseContainer does (it was never committed, and never can be), and
//     the container's files are synced;
//   - every committed block is verified in full against its stored
//     checksums (VerifyBlock); the first failure is returned, naming the
//     block, and the container stays UNHEALTHY;
//   - check, if set, runs last, under the container's commit lock (no
//     state change can come in between): an error from it leaves the
//     container UNHEALTHY and is returned as is;
//   - the CLOSED state is written with a synced Pebble commit (whatever
//     Options.Sync says) before RecoverUnhealthy returns nil.
//
// An UNHEALTHY container takes no writes (writable), so nothing changes
// its blocks while they are verified but a delete of the whole container,
// which then fails the call with ErrContainerNotFound.
func (s *Store) RecoverUnhealthy(cid ContainerID, o VerifyOptions, check func() error) (RecoverStats, error) {
	const op = "recover container"
	var st RecoverStats
	c, err := s.container(op, cid)
	if err != nil {
		return st, err
	}
	if err := s.recoverable(op, c); err != nil {
		return st, err
	}
	c.mu.Lock()
	blocks := make(map[LocalID]*openBlock, len(c.open))
	for lid, ob := range c.open {
		blocks[lid] = ob
	}
	c.mu.Unlock()
	for lid, ob := range blocks {
		if err := s.discardUncommitted(op, c, lid, ob); err != nil {
			return st, err
		}
	}
	if err := c.vol.files.SyncContainer(cid); err != nil {
		return st, s.ioErr(op, c, 0, 0, err)
	}
	for start := LocalID(0); ; {
		bds, err := s.ListBlocks(cid, start, 1000)
		if err != nil {
			return st, err
		}
		for _, bd := range bds {
			n, err := s.VerifyBlock(cid, bd.LocalID, o)
			st.Bytes += n
			if err != nil {
				return st, err
			}
			st.Blocks++
		}
		if len(bds) < 1000 {
			break
		}
		start = bds[len(bds)-1].LocalID + 1
	}
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	s.mu.RLock()
	live := s.containers[cid] == c && !s.closed
	s.mu.RUnlock()
	if !live {
		return st, cErr(op, ErrContainerNotFound, cid, "deleted meanwhile", nil)
	}
	if err := s.recoverable(op, c); err != nil {
		return st, err
	}
	if check != nil {
		if err := check(); err != nil {
			return st, err
		}
	}
	c.mu.Lock()
	rec := c.rec
	c.mu.Unlock()
	rec.State = StateClosed
	if err := c.vol.set(makeKey(cid, kindContainer, idRecord), rec.encode(), pebble.Sync); err != nil {
		return st, s.ioErr(op, c, 0, 0, err)
	}
	c.mu.Lock()
	c.rec = rec
	c.mu.Unlock()
	s.opts.Logf("storage: container %d recovered: UNHEALTHY -> CLOSED (%d blocks, %d bytes verified)", cid, st.Blocks, st.Bytes)
	return st, nil
}

// recoverable checks that c is UNHEALTHY on a volume that has not failed.
func (s *Store) recoverable(op string, c *container) error {
	if c.vol.failed.Load() {
		return cErr(op, ErrVolumeFailed, c.id, c.vol.path, nil)
	}
	c.mu.Lock()
	st := c.rec.State
	c.mu.Unlock()
	if st != StateUnhealthy {
		return cErr(op, ErrContainerNotOpen, c.id, fmt.Sprintf("%v, not UNHEALTHY", st), nil)
	}
	return nil
}
