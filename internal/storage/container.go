package storage

import (
	"fmt"
	"sort"
)

// ContainerReport is what a datanode tells SCM about one container.
type ContainerReport struct {
	ID         ContainerID
	State      State // UNHEALTHY when its volume failed
	UsedBytes  int64 // committed bytes
	BlockCount int64
	MaxSize    int64
	BCSID      uint64 // highest committed Raft index
	Volume     string
}

// VolumeReport describes one data volume.
type VolumeReport struct {
	Path       string
	Capacity   int64 // file system size
	Used       int64 // committed bytes of containers on it
	Available  int64 // free to us, after the reserve
	Reserved   int64
	Containers int
	Failed     bool
	Error      string // why it failed
}

func (c *container) report() ContainerReport {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := ContainerReport{
		ID: c.id, State: c.rec.State, UsedBytes: c.cnt.Used, BlockCount: c.cnt.Blocks,
		MaxSize: c.rec.MaxSize, BCSID: c.cnt.BCSID, Volume: c.vol.path,
	}
	if c.vol.failed.Load() {
		r.State = StateUnhealthy
	}
	return r
}

// ListContainers reports every container, by ID, including those on failed
// volumes (as UNHEALTHY) so SCM can re-replicate them.
func (s *Store) ListContainers() []ContainerReport {
	s.mu.RLock()
	cs := make([]*container, 0, len(s.containers))
	for _, c := range s.containers {
		cs = append(cs, c)
	}
	s.mu.RUnlock()
	out := make([]ContainerReport, 0, len(cs))
	for _, c := range cs {
		c.mu.Lock()
		skip := c.importing
		c.mu.Unlock()
		if !skip {
			out = append(out, c.report())
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Container reports one container.
func (s *Store) Container(cid ContainerID) (ContainerReport, error) {
	s.mu.RLock()
	c := s.containers[cid]
	s.mu.RUnlock()
	if c == nil {
		return ContainerReport{}, cErr("report", ErrContainerNotFound, cid, "", nil)
	}
	c.mu.Lock()
	imp := c.importing
	c.mu.Unlock()
	if imp {
		return ContainerReport{}, cErr("report", ErrContainerNotFound, cid, "import in progress", nil)
	}
	return c.report(), nil
}

// Volumes reports every volume.
func (s *Store) Volumes() []VolumeReport {
	s.mu.RLock()
	used := map[*volume]int64{}
	count := map[*volume]int{}
	for _, c := range s.containers {
		c.mu.Lock()
		// A container being created or imported gets its volume without
		// c.mu; it is counted once done.
		if !c.importing {
			used[c.vol] += c.cnt.Used
			count[c.vol]++
		}
		c.mu.Unlock()
	}
	s.mu.RUnlock()
	var out []VolumeReport
	for _, v := range s.volumes {
		s.checkBackend(v)
		r := VolumeReport{Path: v.path, Used: used[v], Containers: count[v], Reserved: s.reserve()}
		if v.space != nil {
			// Reports are periodic (heartbeats): the refresh also brings the
			// ballast back once there is room.
			_ = v.space.Refresh()
		}
		if avail, total, err := v.diskUsage(); err == nil {
			r.Capacity, r.Available = total, max(0, avail-s.reserve())
		}
		if v.failed.Load() {
			r.Failed, r.Error, r.Available = true, fmt.Sprint(v.err()), 0
		}
		out = append(out, r)
	}
	return out
}

// setState persists a state change. Caller holds c.commitMu.
func (s *Store) setState(op string, c *container, st State) error {
	c.mu.Lock()
	rec := c.rec
	c.mu.Unlock()
	rec.State = st
	if err := c.vol.set(makeKey(c.id, kindContainer, idRecord), rec.encode(), s.metaSync()); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	c.mu.Lock()
	c.rec = rec
	c.mu.Unlock()
	return nil
}

// MarkClosing moves an OPEN container to CLOSING. Writes are still accepted
// so the pipeline can apply what it has already ordered.
func (s *Store) MarkClosing(cid ContainerID) error {
	c, err := s.container("mark closing", cid)
	if err != nil {
		return err
	}
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	st := c.rec.State
	c.mu.Unlock()
	switch st {
	case StateClosing:
		return nil
	case StateOpen:
		return s.setState("mark closing", c, StateClosing)
	}
	return cErr("mark closing", ErrContainerNotOpen, cid, st.String(), nil)
}

// MarkUnhealthy records that a container lost or damaged data (found by a
// scanner or a failed read); it stays readable for salvage.
func (s *Store) MarkUnhealthy(cid ContainerID, reason string) error {
	c, err := s.container("mark unhealthy", cid)
	if err != nil {
		return err
	}
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	s.opts.Logf("storage: container %d UNHEALTHY: %s", cid, reason)
	return s.setState("mark unhealthy", c, StateUnhealthy)
}

// CloseContainer makes a container immutable: data of blocks not committed
// is discarded (it could never be committed afterwards), then the CLOSED
// state is made durable. Closing a CLOSED container is a no-op.
func (s *Store) CloseContainer(cid ContainerID) error {
	const op = "close container"
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	c.commitMu.Lock()
	c.mu.Lock()
	st := c.rec.State
	if writable(st) {
		// Refuse new writes at once; persist below.
		c.rec.State = StateClosed
	}
	blocks := make(map[LocalID]*openBlock, len(c.open))
	for lid, ob := range c.open {
		blocks[lid] = ob
	}
	c.mu.Unlock()
	c.commitMu.Unlock()
	switch st {
	case StateClosed:
		return nil
	case StateUnhealthy:
		return cErr(op, ErrContainerNotOpen, cid, st.String(), nil)
	}
	for lid, ob := range blocks {
		if err := s.discardUncommitted(op, c, lid, ob); err != nil {
			return err
		}
	}
	if err := c.vol.files.SyncContainer(cid); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	rec := c.rec
	c.mu.Unlock()
	if err := c.vol.set(makeKey(cid, kindContainer, idRecord), rec.encode(), s.metaSync()); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	return nil
}

// discardUncommitted drops what block lid of c holds beyond its committed
// length (CloseContainer): its chunk records, its open state, and its
// file's tail (or the file, for a block never committed). The block lock
// is released by a defer: a panic in here that a caller's guard recovers
// (the datanode's apply guard, a request handler's) must not leave every
// later request on the block waiting for it.
func (s *Store) discardUncommitted(op string, c *container, lid LocalID, ob *openBlock) error {
	ob.mu.Lock()
	defer ob.mu.Unlock()
	if ob.dead {
		return nil
	}
	s.testPoint("discard uncommitted: block locked")
	if err := s.dropRecords(c, lid, ob); err != nil {
		return s.ioErr(op, c, lid, 0, err)
	}
	s.dropOpen(c, lid, ob)
	var err error
	if ob.committed.Inline {
		// no file (inline.go)
	} else if ob.exists {
		err = c.vol.files.Truncate(c.id, lid, ob.committed.Length)
	} else {
		err = c.vol.files.Remove(c.id, lid)
	}
	if err != nil {
		return s.ioErr(op, c, lid, 0, err)
	}
	return nil
}

// DeleteBlocks deletes committed blocks, in OPEN or CLOSED containers (block
// deletion is the one change a CLOSED container takes). It is all or
// nothing: if any block is unknown, none is deleted.
func (s *Store) DeleteBlocks(cid ContainerID, lids []LocalID) error {
	const op = "delete blocks"
	if len(lids) > maxDeleteBatch {
		return cErr(op, ErrInvalidArgument, cid, fmt.Sprintf("%d blocks > limit %d", len(lids), maxDeleteBatch), nil)
	}
	c, err := s.container(op, cid)
	if err != nil {
		return err
	}
	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	cnt := c.cnt
	st := c.rec.State
	c.mu.Unlock()
	if st == StateUnhealthy {
		return cErr(op, ErrContainerNotOpen, cid, st.String(), nil)
	}
	b := c.vol.db.NewBatch()
	defer c.vol.closeBatch(b)
	seen := map[LocalID]bool{}
	for _, lid := range lids {
		if seen[lid] {
			continue
		}
		seen[lid] = true
		bd, err := s.getBlock(c, lid)
		if err != nil {
			return err
		}
		cnt.Used -= bd.Length
		cnt.Blocks--
		b.Delete(makeKey(cid, kindBlock, uint64(lid)), nil)
		lo, hi := deferredRange(cid, lid) // an inline block's data too

		b.DeleteRange(lo, hi, nil)
	}
	cnt.check(cid)
	b.Set(makeKey(cid, kindContainer, idCounters), cnt.encode(), nil)
	if err := c.vol.commit(b, s.metaSync()); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	c.mu.Lock()
	c.cnt.Used, c.cnt.Blocks = cnt.Used, cnt.Blocks
	open := make(map[LocalID]*openBlock)
	for lid := range seen {
		if ob := c.open[lid]; ob != nil {
			open[lid] = ob
		}
	}
	c.mu.Unlock()
	// The metadata is gone, so the data is garbage from here: a crash
	// before the files go is cleaned up by Open.
	for lid := range seen {
		if ob := open[lid]; ob != nil {
			if err := s.dropOpenBlock(op, c, lid, ob); err != nil {
				return err
			}
		}
		if err := c.vol.files.Remove(cid, lid); err != nil {
			return s.ioErr(op, c, lid, 0, err)
		}
	}
	if err := c.vol.files.SyncContainer(cid); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	return nil
}

// dropOpenBlock drops the open state of block lid of c, deleted
// (DeleteBlocks), and its chunk records. The block lock is released by a
// defer (see discardUncommitted).
func (s *Store) dropOpenBlock(op string, c *container, lid LocalID, ob *openBlock) error {
	ob.mu.Lock()
	defer ob.mu.Unlock()
	if ob.dead {
		return nil
	}
	s.testPoint("drop open block: block locked")
	if err := s.dropRecords(c, lid, ob); err != nil {
		return s.ioErr(op, c, lid, 0, err)
	}
	s.dropOpen(c, lid, ob)
	return nil
}

// DeleteContainer removes a CLOSED or UNHEALTHY container and all its data
// (any state with force). Metadata goes first, durably; leftover files from
// a crash after that are orphans that Open removes.
func (s *Store) DeleteContainer(cid ContainerID, force bool) error {
	const op = "delete container"
	s.mu.Lock()
	c := s.containers[cid]
	if c == nil || s.closed {
		s.mu.Unlock()
		if s.closed {
			return cErr(op, ErrClosed, cid, "", nil)
		}
		return cErr(op, ErrContainerNotFound, cid, "", nil)
	}
	c.mu.Lock()
	st, imp := c.rec.State, c.importing
	c.mu.Unlock()
	if imp {
		s.mu.Unlock()
		return cErr(op, ErrContainerNotFound, cid, "import in progress", nil)
	}
	if writable(st) && !force {
		s.mu.Unlock()
		return cErr(op, ErrContainerNotClosed, cid, st.String(), nil)
	}
	delete(s.containers, cid)
	s.mu.Unlock()

	c.commitMu.Lock()
	defer c.commitMu.Unlock()
	c.mu.Lock()
	c.rec.State = StateClosed // stop writers that already hold c
	blocks := make(map[LocalID]*openBlock, len(c.open))
	for lid, ob := range c.open {
		blocks[lid] = ob
	}
	c.mu.Unlock()
	for lid, ob := range blocks {
		s.forgetOpenBlock(c, lid, ob)
	}
	if c.vol.failed.Load() {
		return nil // nothing more can be done on a dead disk
	}
	lo, hi := containerBounds(cid)
	if err := c.vol.deleteRange(lo, hi, s.metaSync()); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	if err := c.vol.files.RemoveContainer(cid); err != nil {
		return s.ioErr(op, c, 0, 0, err)
	}
	return nil
}

// forgetOpenBlock drops the open state of block lid of c, whose container
// is being deleted (its records go with the container's range). The
// block lock is released by a defer (see discardUncommitted).
func (s *Store) forgetOpenBlock(c *container, lid LocalID, ob *openBlock) {
	ob.mu.Lock()
	defer ob.mu.Unlock()
	if ob.dead {
		return
	}
	// An uncommitted inline span's key (set by its Sync) goes with the
	// container's range; the flusher never had it, so its generation
	// would stay in deferrer.gens for good.
	for _, sp := range ob.written {
		if sp.inline && c.vol.defer_ != nil {
			c.vol.defer_.dropGen(makeDeferredKey(c.id, lid, sp.off))
		}
	}
	s.dropOpen(c, lid, ob)
}
