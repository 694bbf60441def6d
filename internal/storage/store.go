package storage

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// ContainerID names a container cluster-wide (assigned by SCM).
type ContainerID uint64

// LocalID names a block within its container.
type LocalID uint64

// State is a container's lifecycle state.
type State uint8

const (
	StateOpen      State = iota // accepts writes
	StateClosing                // still accepts writes so the pipeline can drain
	StateClosed                 // immutable except for block deletion
	StateUnhealthy              // lost or damaged data; read-only, for the replication manager
)

func (s State) String() string {
	switch s {
	case StateOpen:
		return "OPEN"
	case StateClosing:
		return "CLOSING"
	case StateClosed:
		return "CLOSED"
	case StateUnhealthy:
		return "UNHEALTHY"
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// SyncPolicy says when block data and metadata are forced to disk.
type SyncPolicy int

const (
	// SyncOnCommit fsyncs the block file (and its directory entry) and the
	// metadata WAL in PutBlock: a committed block survives a crash, chunk
	// writes cost no fsync. The default.
	SyncOnCommit SyncPolicy = iota
	// SyncAlways also fsyncs after every WriteChunk.
	SyncAlways
	// SyncNone never fsyncs: a crash may lose committed blocks (tests and
	// benchmarks of the page cache only).
	SyncNone
)

// ChunkInfo is one chunk of a block: a byte range and its checksums.
type ChunkInfo struct {
	Offset, Length int64
	Checksum       ChecksumData
}

// BlockData is the committed description of a block (Ozone's BlockData).
type BlockData struct {
	LocalID LocalID
	Length  int64
	Chunks  []ChunkInfo // sorted, contiguous from offset 0, summing to Length
	BCSID   uint64      // the Raft log index of the PutBlock that committed it
}

// Defaults of Options.
const (
	DefaultContainerSize = 5 << 30
	DefaultMaxBlockSize  = 256 << 20
	DefaultChunkSize     = 4 << 20
	DefaultMaxChunkSize  = 16 << 20
	DefaultMaxOpenBlocks = 1024
	maxDeleteBatch       = 1 << 16
)

// Options configure a Store. Only Volumes is required.
type Options struct {
	Volumes []string // one directory per disk
	// FS is the file system of everything on the volumes: block files,
	// directories and the Pebble DB, so a crashable in-memory FS crashes a
	// whole volume consistently. Default vfs.Default.
	FS vfs.FS
	// NewBackend builds the block data backend of a volume; default the
	// posix backend with DirectIO.
	NewBackend func(fs vfs.FS, dir string) (BlockFiles, error)
	DirectIO   DirectIO
	// ReservedBytes is left free on every volume for other users of the
	// disk: containers are not placed and chunks not written into it.
	ReservedBytes int64
	ContainerSize int64 // default 5 GiB
	MaxBlockSize  int64 // default 256 MiB
	MaxChunkSize  int64 // largest WriteChunk; default 16 MiB
	Sync          SyncPolicy
	// OutOfOrderWrites lets chunks of a block arrive at any non-overlapping
	// offset. Off by default: chunks must extend the block's written data
	// (or repeat an earlier chunk exactly), which append-only backends need.
	OutOfOrderWrites bool
	// KeepUncommitted keeps the data of uncommitted blocks at Open instead
	// of deleting it, for a caller that will replay their PutBlock.
	KeepUncommitted bool
	// MaxOpenBlocks bounds the blocks with uncommitted writes (each holds
	// file descriptors and per-chunk state); default 1024.
	MaxOpenBlocks int
	// Logf reports volume failures and recovery actions; default discard.
	Logf func(format string, args ...any)
}

func (o *Options) setDefaults() {
	if o.FS == nil {
		o.FS = vfs.Default
	}
	if o.NewBackend == nil {
		mode := o.DirectIO
		o.NewBackend = func(fs vfs.FS, dir string) (BlockFiles, error) { return NewPosix(fs, dir, mode) }
	}
	if o.ContainerSize <= 0 {
		o.ContainerSize = DefaultContainerSize
	}
	if o.MaxBlockSize <= 0 {
		o.MaxBlockSize = DefaultMaxBlockSize
	}
	if o.MaxChunkSize <= 0 {
		o.MaxChunkSize = DefaultMaxChunkSize
	}
	if o.MaxOpenBlocks <= 0 {
		o.MaxOpenBlocks = DefaultMaxOpenBlocks
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
}

// Store is the container storage of one datanode. All methods are safe for
// concurrent use. Writes to different blocks proceed in parallel; writes to
// one block are serialized.
type Store struct {
	opts Options

	mu         sync.RWMutex
	closed     bool
	volumes    []*volume
	containers map[ContainerID]*container

	openBlocks atomic.Int64 // blocks with uncommitted writes, all containers
}

type volume struct {
	path  string
	files BlockFiles
	db    *pebble.DB
	fs    vfs.FS

	failed  atomic.Bool
	mu      sync.Mutex
	failErr error
}

type container struct {
	id  ContainerID
	vol *volume

	// commitMu serializes this container's metadata writes (PutBlock,
	// DeleteBlocks, state changes) so counters are read-modify-written
	// without races. Raft applies one container's commands in order anyway.
	commitMu sync.Mutex

	mu        sync.Mutex // guards the fields below
	rec       containerRecord
	cnt       counters
	pending   int64 // bytes written to blocks beyond their committed length
	open      map[LocalID]*openBlock
	importing bool // Import in progress: invisible to other calls
}

// openBlock is the in-memory state of a block with uncommitted writes.
type openBlock struct {
	mu        sync.Mutex // held across the block's I/O
	dead      bool       // dropped from container.open; look it up again
	w         BlockWriter
	committed BlockData // Length 0 and no chunks if never committed
	written   []span    // uncommitted chunks, sorted, non-overlapping
	hwm       int64     // end of the highest byte written or committed
	dirSync   bool      // file created; its directory entry is not durable yet
	exists    bool      // committed at least once
}

type span struct {
	off, n int64
	sum    ChecksumData // Type NONE: unknown, any rewrite allowed
}

// Open opens (creating if needed) the store on opts.Volumes and recovers
// each volume: block data not covered by committed metadata is deleted
// (or kept, with KeepUncommitted), orphan container directories from
// interrupted creates, imports and deletes are removed, and containers
// whose committed data is missing are marked UNHEALTHY. A volume that
// cannot be opened is reported as failed; Open fails only if none opens.
func Open(opts Options) (*Store, error) {
	opts.setDefaults()
	if len(opts.Volumes) == 0 {
		return nil, fmt.Errorf("storage: %w: no volumes", ErrInvalidArgument)
	}
	s := &Store{opts: opts, containers: map[ContainerID]*container{}}
	healthy := 0
	var firstErr error
	for _, p := range opts.Volumes {
		v := &volume{path: p, fs: opts.FS}
		s.volumes = append(s.volumes, v)
		if err := s.openVolume(v); err != nil {
			if errors.Is(err, ErrContainerExists) {
				s.Close()
				return nil, err
			}
			v.fail(err, opts.Logf)
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		healthy++
	}
	if healthy == 0 {
		s.Close()
		return nil, fmt.Errorf("storage: %w: no volume opened: %w", ErrVolumeFailed, firstErr)
	}
	return s, nil
}

type quietLogger struct{ logf func(string, ...any) }

func (quietLogger) Infof(string, ...any)        {}
func (l quietLogger) Errorf(f string, a ...any) { l.logf("pebble: "+f, a...) }
func (l quietLogger) Fatalf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }

func (s *Store) openVolume(v *volume) error {
	root := filepath.Join(v.path, "basalt")
	if err := mkdirAllSync(v.fs, filepath.Join(root, "meta")); err != nil {
		return err
	}
	files, err := s.opts.NewBackend(v.fs, filepath.Join(root, "containers"))
	if err != nil {
		return err
	}
	v.files = files
	db, err := pebble.Open(filepath.Join(root, "meta"), &pebble.Options{
		FS:     v.fs,
		Logger: quietLogger{s.opts.Logf},
	})
	if err != nil {
		return err
	}
	v.db = db
	return s.recoverVolume(v)
}

func (s *Store) recoverVolume(v *volume) error {
	it, err := v.db.NewIter(nil)
	if err != nil {
		return err
	}
	found := map[ContainerID]*container{}
	blocks := map[ContainerID]map[LocalID]int64{}
	for ok := it.First(); ok; ok = it.Next() {
		cid, kind, id, okk := parseKey(it.Key())
		if !okk {
			it.Close()
			return fmt.Errorf("volume %s: bad metadata key %x", v.path, it.Key())
		}
		c := found[cid]
		if c == nil {
			c = &container{id: cid, vol: v, open: map[LocalID]*openBlock{}}
			found[cid] = c
		}
		val, err := it.ValueAndErr()
		if err != nil {
			it.Close()
			return err
		}
		switch {
		case kind == kindContainer && id == idRecord:
			c.rec, err = decodeContainerRecord(val)
		case kind == kindContainer && id == idCounters:
			c.cnt, err = decodeCounters(val)
		case kind == kindBlock:
			var bd BlockData
			bd, err = decodeBlock(val)
			if blocks[cid] == nil {
				blocks[cid] = map[LocalID]int64{}
			}
			blocks[cid][LocalID(id)] = bd.Length
		}
		if err != nil {
			it.Close()
			return fmt.Errorf("volume %s container %d: %w", v.path, cid, err)
		}
	}
	if err := it.Close(); err != nil {
		return err
	}
	onDisk, err := v.files.ListContainers()
	if err != nil {
		return err
	}
	for _, cid := range onDisk {
		if _, ok := found[cid]; !ok {
			s.opts.Logf("storage: volume %s: removing orphan container directory %d", v.path, cid)
			if err := v.files.RemoveContainer(cid); err != nil {
				return err
			}
		}
	}
	for cid, c := range found {
		if c.rec.MaxSize == 0 {
			return fmt.Errorf("volume %s: container %d has keys but no record", v.path, cid)
		}
		if err := s.recoverContainer(c, blocks[cid]); err != nil {
			return err
		}
		if other, dup := s.containers[cid]; dup {
			return cErr("open", ErrContainerExists, cid, "on volumes "+other.vol.path+" and "+v.path, nil)
		}
		s.containers[cid] = c
	}
	return nil
}

// recoverContainer reconciles block files with committed metadata.
func (s *Store) recoverContainer(c *container, committed map[LocalID]int64) error {
	files, err := c.vol.files.ListBlocks(c.id)
	if errors.Is(err, unix.ENOENT) {
		if len(committed) > 0 {
			return s.markUnhealthyLocked(c, "container directory missing")
		}
		return c.vol.files.CreateContainer(c.id)
	}
	if err != nil {
		return err
	}
	changed := false
	have := map[LocalID]bool{}
	for _, f := range files {
		want, ok := committed[f.LocalID]
		have[f.LocalID] = true
		switch {
		case !ok && s.opts.KeepUncommitted:
			c.open[f.LocalID] = &openBlock{written: []span{{0, f.Size, ChecksumData{}}}, hwm: f.Size}
			c.pending += f.Size
			s.openBlocks.Add(1)
		case !ok:
			s.opts.Logf("storage: container %d: removing uncommitted block %d (%d bytes)", c.id, f.LocalID, f.Size)
			if err := c.vol.files.Remove(c.id, f.LocalID); err != nil {
				return err
			}
			changed = true
		case f.Size > want && s.opts.KeepUncommitted:
			bd, err := s.getBlock(c, f.LocalID)
			if err != nil {
				return err
			}
			c.open[f.LocalID] = &openBlock{committed: bd, exists: true, written: []span{{want, f.Size - want, ChecksumData{}}}, hwm: f.Size}
			c.pending += f.Size - want
			s.openBlocks.Add(1)
		case f.Size > want:
			if err := c.vol.files.Truncate(c.id, f.LocalID, want); err != nil {
				return err
			}
		case f.Size < want:
			if err := s.markUnhealthyLocked(c, fmt.Sprintf("block %d has %d of %d committed bytes", f.LocalID, f.Size, want)); err != nil {
				return err
			}
		}
	}
	for lid, n := range committed {
		if n > 0 && !have[lid] {
			if err := s.markUnhealthyLocked(c, fmt.Sprintf("block %d file missing", lid)); err != nil {
				return err
			}
		}
	}
	if changed {
		return c.vol.files.SyncContainer(c.id)
	}
	return nil
}

func (s *Store) markUnhealthyLocked(c *container, why string) error {
	s.opts.Logf("storage: container %d UNHEALTHY: %s", c.id, why)
	if c.rec.State == StateUnhealthy {
		return nil
	}
	c.rec.State = StateUnhealthy
	return c.vol.db.Set(makeKey(c.id, kindContainer, idRecord), c.rec.encode(), pebble.Sync)
}

// Close releases files and databases. Uncommitted block data stays on disk
// and is cleaned up by the next Open.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var first error
	for _, c := range s.containers {
		c.mu.Lock()
		for _, ob := range c.open {
			ob.mu.Lock()
			if ob.w != nil {
				ob.w.Close()
				ob.w = nil
			}
			ob.mu.Unlock()
		}
		c.mu.Unlock()
	}
	for _, v := range s.volumes {
		if v.db != nil {
			if err := v.db.Close(); err != nil && first == nil && !v.failed.Load() {
				first = err
			}
		}
	}
	return first
}

func (v *volume) fail(err error, logf func(string, ...any)) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.failErr == nil {
		v.failErr = err
		logf("storage: volume %s FAILED: %v", v.path, err)
	}
	v.failed.Store(true)
}

// diskUsage reports the bytes available to us and the file system's size.
func (v *volume) diskUsage() (avail, total int64, err error) {
	du, err := v.fs.GetDiskUsage(v.path)
	if err != nil {
		return 0, 0, err
	}
	return int64(min(du.AvailBytes, 1<<62)), int64(min(du.TotalBytes, 1<<62)), nil
}

func (v *volume) err() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.failErr
}

// ioErr classifies an I/O error from volume v: disk full is the caller's
// problem (ErrDiskFull, the volume stays healthy); anything else fails the
// volume so no more data goes to a disk that misbehaves.
func (s *Store) ioErr(op string, c *container, lid LocalID, off int64, err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return oErr(op, ErrDiskFull, c.id, lid, off, "", err).withVolume(c.vol.path)
	}
	c.vol.fail(err, s.opts.Logf)
	return oErr(op, ErrVolumeFailed, c.id, lid, off, "", err).withVolume(c.vol.path)
}

func (e *Error) withVolume(p string) *Error { e.Volume = p; return e }

func (s *Store) container(op string, cid ContainerID) (*container, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return nil, cErr(op, ErrClosed, cid, "", nil)
	}
	c := s.containers[cid]
	if c == nil {
		return nil, cErr(op, ErrContainerNotFound, cid, "", nil)
	}
	c.mu.Lock()
	importing := c.importing
	c.mu.Unlock()
	if importing {
		return nil, cErr(op, ErrContainerNotFound, cid, "import in progress", nil)
	}
	if c.vol.failed.Load() {
		return nil, cErr(op, ErrVolumeFailed, cid, "", c.vol.err()).withVolume(c.vol.path)
	}
	return c, nil
}

// CreateOptions are per-container settings.
type CreateOptions struct {
	MaxSize int64 // 0: Options.ContainerSize
}

// CreateContainer creates an empty OPEN container on the healthy volume with
// the most free space beyond the reserve, among those with room for a full
// container. It is durable when it returns.
func (s *Store) CreateContainer(cid ContainerID, o CreateOptions) (ContainerReport, error) {
	if o.MaxSize <= 0 {
		o.MaxSize = s.opts.ContainerSize
	}
	c, err := s.reserveID("create", cid)
	if err != nil {
		return ContainerReport{}, err
	}
	v, err := s.pickVolume(o.MaxSize)
	if err != nil {
		s.dropID(cid)
		return ContainerReport{}, cErr("create", ErrNoVolume, cid, "", err)
	}
	c.vol = v
	c.rec = containerRecord{State: StateOpen, MaxSize: o.MaxSize}
	if err := v.files.CreateContainer(cid); err != nil {
		s.dropID(cid)
		return ContainerReport{}, s.ioErr("create", c, 0, 0, err)
	}
	b := v.db.NewBatch()
	b.Set(makeKey(cid, kindContainer, idRecord), c.rec.encode(), nil)
	b.Set(makeKey(cid, kindContainer, idCounters), counters{}.encode(), nil)
	if err := b.Commit(s.metaSync()); err != nil {
		s.dropID(cid)
		return ContainerReport{}, s.ioErr("create", c, 0, 0, err)
	}
	c.mu.Lock()
	c.importing = false
	c.mu.Unlock()
	return c.report(), nil
}

// reserveID registers cid as in progress (invisible to other calls) so two
// creates or imports of one ID cannot race.
func (s *Store) reserveID(op string, cid ContainerID) (*container, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, cErr(op, ErrClosed, cid, "", nil)
	}
	if _, ok := s.containers[cid]; ok {
		return nil, cErr(op, ErrContainerExists, cid, "", nil)
	}
	c := &container{id: cid, open: map[LocalID]*openBlock{}, importing: true}
	s.containers[cid] = c
	return c, nil
}

func (s *Store) dropID(cid ContainerID) {
	s.mu.Lock()
	delete(s.containers, cid)
	s.mu.Unlock()
}

func (s *Store) metaSync() *pebble.WriteOptions {
	if s.opts.Sync == SyncNone {
		return pebble.NoSync
	}
	return pebble.Sync
}

func (s *Store) pickVolume(need int64) (*volume, error) {
	var best *volume
	var bestFree int64
	var reasons []string
	for _, v := range s.volumes {
		if v.failed.Load() {
			reasons = append(reasons, v.path+": failed")
			continue
		}
		avail, _, err := v.diskUsage()
		if err != nil {
			v.fail(err, s.opts.Logf)
			reasons = append(reasons, v.path+": "+err.Error())
			continue
		}
		free := avail - s.opts.ReservedBytes
		if free < need {
			reasons = append(reasons, fmt.Sprintf("%s: %d bytes free beyond reserve, need %d", v.path, free, need))
			continue
		}
		if best == nil || free > bestFree {
			best, bestFree = v, free
		}
	}
	if best == nil {
		return nil, fmt.Errorf("%v", reasons)
	}
	return best, nil
}

// getOpen returns the open state of a block, creating it from the
// committed metadata if needed. The caller locks ob.mu and checks ob.dead.
func (s *Store) getOpen(op string, c *container, lid LocalID) (*openBlock, error) {
	c.mu.Lock()
	ob := c.open[lid]
	c.mu.Unlock()
	if ob != nil {
		return ob, nil
	}
	bd, err := s.getBlock(c, lid)
	if err != nil && !errors.Is(err, ErrBlockNotFound) {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if ob := c.open[lid]; ob != nil {
		return ob, nil
	}
	if s.openBlocks.Add(1) > int64(s.opts.MaxOpenBlocks) {
		s.openBlocks.Add(-1)
		return nil, bErr(op, ErrTooManyOpenBlocks, c.id, lid, fmt.Sprintf("limit %d", s.opts.MaxOpenBlocks), nil)
	}
	ob = &openBlock{committed: bd, hwm: bd.Length, dirSync: err != nil, exists: err == nil}
	c.open[lid] = ob
	return ob, nil
}

// dropOpen forgets a block's open state; caller holds ob.mu.
func (s *Store) dropOpen(c *container, lid LocalID, ob *openBlock) {
	if ob.w != nil {
		ob.w.Close()
		ob.w = nil
	}
	ob.dead = true
	c.mu.Lock()
	if c.open[lid] == ob {
		delete(c.open, lid)
		s.openBlocks.Add(-1)
	}
	c.pending -= ob.hwm - ob.committed.Length
	c.mu.Unlock()
}

// unlockOpen unlocks ob, first dropping it if it holds no uncommitted
// data, so failed or finished operations do not pin a MaxOpenBlocks slot.
func (s *Store) unlockOpen(c *container, lid LocalID, ob *openBlock) {
	if !ob.dead && len(ob.written) == 0 {
		s.dropOpen(c, lid, ob)
	}
	ob.mu.Unlock()
}

// lockOpen returns the block's open state, locked and live.
func (s *Store) lockOpen(op string, c *container, lid LocalID) (*openBlock, error) {
	for range 100 {
		ob, err := s.getOpen(op, c, lid)
		if err != nil {
			return nil, err
		}
		ob.mu.Lock()
		if !ob.dead {
			return ob, nil
		}
		ob.mu.Unlock()
	}
	return nil, bErr(op, ErrInvalidArgument, c.id, lid, "block state churned; retry", nil)
}

func writable(st State) bool { return st == StateOpen || st == StateClosing }

// WriteChunk writes data at offset off of an uncommitted part of block lid.
// sum, if its Type is not NONE, must hold the chunk's checksums; with verify
// the data is checked against them first. The data is not visible to
// readers until PutBlock names it. Writing the same offset and length again
// (a Raft re-delivery) is allowed while uncommitted, and is a no-op if the
// chunk is already committed with the same checksums.
func (s *Store) WriteChunk(cid ContainerID, lid LocalID, off int64, data []byte, sum ChecksumData, verify bool) error {
	const op = "write chunk"
	n := int64(len(data))
	switch {
	case off < 0 || n == 0:
		return oErr(op, ErrInvalidArgument, cid, lid, off, fmt.Sprintf("length %d", n), nil)
	case n > s.opts.MaxChunkSize:
		return oErr(op, ErrChunkTooLarge, cid, lid, off, fmt.Sprintf("length %d > %d", n, s.opts.MaxChunkSize), nil)
	case off+n > s.opts.MaxBlockSize:
		return oErr(op, ErrBlockTooLarge, cid, lid, off, fmt.Sprintf("end %d > %d", off+n, s.opts.MaxBlockSize), nil)
	}
	if sum.Type != ChecksumNone || len(sum.Sums) > 0 {
		if err := sum.validate(n); err != nil {
			return oErr(op, ErrBadChecksum, cid, lid, off, err.Error(), nil)
		}
		if verify {
			if bad := sum.Verify(data); bad >= 0 {
				return oErr(op, ErrChecksumMismatch, cid, lid, off+bad, "data sent does not match its checksum", nil)
			}
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
	return s.writeLocked(op, c, lid, ob, off, data, sum)
}

func (s *Store) writeLocked(op string, c *container, lid LocalID, ob *openBlock, off int64, data []byte, sum ChecksumData) error {
	n := int64(len(data))
	end := off + n
	if off < ob.committed.Length {
		for _, ch := range ob.committed.Chunks {
			if ch.Offset == off && ch.Length == n && sum.Type != ChecksumNone && ch.Checksum.equal(sum) {
				return nil // re-delivery of a committed chunk
			}
		}
		return oErr(op, ErrChunkOverlap, c.id, lid, off, fmt.Sprintf("range [%d,%d) overlaps committed length %d", off, end, ob.committed.Length), nil)
	}
	// Find the first written span ending after off.
	i := sort.Search(len(ob.written), func(i int) bool { return ob.written[i].off+ob.written[i].n > off })
	rewrite := false
	if i < len(ob.written) && ob.written[i].off < end {
		w := ob.written[i]
		if w.off != off || w.n != n {
			return oErr(op, ErrChunkOverlap, c.id, lid, off, fmt.Sprintf("range [%d,%d) partly overlaps written [%d,%d)", off, end, w.off, w.off+w.n), nil)
		}
		if w.sum.Type != ChecksumNone && sum.Type != ChecksumNone && !w.sum.equal(sum) {
			return oErr(op, ErrChunkOverlap, c.id, lid, off, "rewrite with different checksums", nil)
		}
		rewrite = true
	} else if !s.opts.OutOfOrderWrites && off != ob.hwm {
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
	c.pending += grow // reserve; released below on failure
	c.mu.Unlock()
	release := func() {
		c.mu.Lock()
		c.pending -= grow
		c.mu.Unlock()
	}

	if grow > 0 {
		avail, _, err := c.vol.diskUsage()
		if err != nil {
			release()
			return s.ioErr(op, c, lid, off, err)
		}
		if avail-s.opts.ReservedBytes < grow {
			release()
			return oErr(op, ErrDiskFull, c.id, lid, off, fmt.Sprintf("%d bytes available beyond reserve %d, need %d", avail-s.opts.ReservedBytes, s.opts.ReservedBytes, grow), nil).withVolume(c.vol.path)
		}
	}
	if ob.w == nil {
		w, err := c.vol.files.OpenWriter(c.id, lid)
		if err != nil {
			release()
			return s.ioErr(op, c, lid, off, err)
		}
		ob.w = w
	}
	if rewrite {
		// Until the rewrite lands the old span may be torn: forget it.
		ob.written = slices.Delete(ob.written, i, i+1)
	}
	if _, err := ob.w.WriteAt(data, off); err != nil {
		release()
		return s.ioErr(op, c, lid, off, err)
	}
	if s.opts.Sync == SyncAlways {
		if err := ob.w.Sync(); err != nil {
			release()
			return s.ioErr(op, c, lid, off, err)
		}
	}
	ob.written = slices.Insert(ob.written, i, span{off, n, sum})
	ob.hwm = max(ob.hwm, end)
	return nil
}

// PutBlock commits a block: its chunk list, length and checksums become
// visible, durably under SyncOnCommit. The chunks must cover [0, Length)
// contiguously; those beyond the block's previous commit must have been
// written. Re-committing with a longer chunk list that starts with the
// committed one extends the block; repeating a commit is a no-op.
func (s *Store) PutBlock(cid ContainerID, bd BlockData) error {
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
		if len(ob.written) == 0 {
			s.dropOpen(c, lid, ob)
		}
		return nil // repeated commit (Raft re-apply)
	}
	// Every byte in [old.Length, bd.Length) must have been written.
	pos := old.Length
	for _, w := range ob.written {
		if pos >= bd.Length {
			break
		}
		if w.off > pos {
			break
		}
		pos = max(pos, w.off+w.n)
	}
	if pos < bd.Length {
		return oErr(op, ErrBadBlockData, cid, lid, pos, fmt.Sprintf("length %d but data written only to offset %d", bd.Length, pos), nil)
	}
	if s.opts.Sync != SyncNone && bd.Length > 0 {
		if ob.w == nil {
			w, err := c.vol.files.OpenWriter(c.id, lid)
			if err != nil {
				return s.ioErr(op, c, lid, 0, err)
			}
			ob.w = w
		}
		if err := ob.w.Sync(); err != nil {
			return s.ioErr(op, c, lid, 0, err)
		}
		if ob.dirSync {
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
	b := c.vol.db.NewBatch()
	b.Set(makeKey(cid, kindBlock, uint64(lid)), encodeBlock(&bd), nil)
	b.Set(makeKey(cid, kindContainer, idCounters), cnt.encode(), nil)
	if err := b.Commit(s.metaSync()); err != nil {
		return s.ioErr(op, c, lid, 0, err)
	}
	c.mu.Lock()
	c.cnt = cnt
	c.pending -= grow
	c.mu.Unlock()
	ob.committed, ob.exists = bd, true
	// Keep only written data beyond the new commit.
	keep := ob.written[:0]
	for _, w := range ob.written {
		if w.off+w.n <= bd.Length {
			continue
		}
		if w.off < bd.Length {
			w = span{bd.Length, w.off + w.n - bd.Length, ChecksumData{}}
		}
		keep = append(keep, w)
	}
	ob.written = keep
	if len(ob.written) == 0 {
		s.dropOpen(c, lid, ob)
	}
	return nil
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
		if ch.Offset != pos || ch.Length <= 0 {
			return oErr(op, ErrBadBlockData, cid, lid, ch.Offset, fmt.Sprintf("chunk [%d,+%d) does not start at %d", ch.Offset, ch.Length, pos), nil)
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

// GetBlock returns the committed description of a block.
func (s *Store) GetBlock(cid ContainerID, lid LocalID) (BlockData, error) {
	c, err := s.container("get block", cid)
	if err != nil {
		return BlockData{}, err
	}
	return s.getBlock(c, lid)
}

func (s *Store) getBlock(c *container, lid LocalID) (BlockData, error) {
	val, closer, err := c.vol.db.Get(makeKey(c.id, kindBlock, uint64(lid)))
	if errors.Is(err, pebble.ErrNotFound) {
		return BlockData{}, bErr("get block", ErrBlockNotFound, c.id, lid, "", nil)
	}
	if err != nil {
		return BlockData{}, s.ioErr("get block", c, lid, 0, err)
	}
	defer closer.Close()
	bd, err := decodeBlock(val)
	if err != nil {
		return BlockData{}, bErr("get block", ErrCorruption, c.id, lid, "metadata: "+err.Error(), nil)
	}
	return bd, nil
}

// ListBlocks returns the committed blocks of a container with local IDs in
// [start, ∞), at most limit of them (limit ≤ 0: 1000).
func (s *Store) ListBlocks(cid ContainerID, start LocalID, limit int) ([]BlockData, error) {
	if limit <= 0 {
		limit = 1000
	}
	c, err := s.container("list blocks", cid)
	if err != nil {
		return nil, err
	}
	it, err := c.vol.db.NewIter(&pebble.IterOptions{
		LowerBound: makeKey(cid, kindBlock, uint64(start)),
		UpperBound: makeKey(cid, kindBlock+1, 0),
	})
	if err != nil {
		return nil, s.ioErr("list blocks", c, 0, 0, err)
	}
	defer it.Close()
	var out []BlockData
	for ok := it.First(); ok && len(out) < limit; ok = it.Next() {
		v, err := it.ValueAndErr()
		if err != nil {
			return nil, s.ioErr("list blocks", c, 0, 0, err)
		}
		bd, err := decodeBlock(v)
		if err != nil {
			_, _, id, _ := parseKey(it.Key())
			return nil, bErr("list blocks", ErrCorruption, cid, LocalID(id), "metadata: "+err.Error(), nil)
		}
		out = append(out, bd)
	}
	return out, it.Error()
}

func isEOF(err error) bool { return errors.Is(err, io.EOF) }
