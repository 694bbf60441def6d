package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
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
	// SyncOnCommit (the default): written chunks become durable at Sync (or
	// at the PutBlock or BlockStream.Close that needs them), which
	// fdatasyncs the block files, syncs new directory entries and commits
	// the chunk records in one synced Pebble batch; PutBlock commits in a
	// synced batch. Callers batch many writes per Sync (group commit).
	SyncOnCommit SyncPolicy = iota
	// SyncAlways makes every WriteChunk durable before it returns, as if
	// each were followed by Sync.
	SyncAlways
	// SyncNone never fsyncs: a crash may lose acknowledged chunks and
	// committed blocks (tests and benchmarks of the page cache only).
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
	// Inline: the block's data is kept in the volume's metadata store
	// beside its record, without a file (inline.go). Set by storage.
	Inline bool
}

// Hard limits. A store never takes a chunk or block larger than these;
// Options may only lower them. They are exported so a datanode can refuse an
// oversized request before it enters a replicated log (ValidateChunk), where
// a refusal by storage would come too late.
const (
	MaxChunkSize = 16 << 20  // largest WriteChunk
	MaxBlockSize = 256 << 20 // largest block
)

// Defaults of Options.
const (
	DefaultContainerSize = 5 << 30
	DefaultMaxBlockSize  = MaxBlockSize
	DefaultChunkSize     = 4 << 20
	DefaultMaxChunkSize  = MaxChunkSize
	DefaultMaxOpenBlocks = 1024
	maxDeleteBatch       = 1 << 16
	// maxSyncParallel bounds the fdatasyncs one Sync runs at once.
	maxSyncParallel = 16
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
	// MetaReserveBytes is left free on every volume, beyond ReservedBytes,
	// for the volume's Pebble DB: block data is refused (ErrDiskFull) before
	// it eats into it, because Pebble treats a failed WAL write as fatal.
	// Default DefaultMetaReserve; negative: none.
	MetaReserveBytes int64
	// BallastBytes is the size of the emergency ballast file kept beside
	// each volume's Pebble DB (<volume>/basalt/meta.ballast). Open removes
	// it when the disk is below the reserve, so the DB can replay its WAL
	// and the volume comes up with writes refused instead of hanging; it
	// is recreated once there is room. 0: none (the basalt binary sets
	// DefaultBallast).
	BallastBytes  int64
	ContainerSize int64 // default 5 GiB
	MaxBlockSize  int64 // default and at most MaxBlockSize
	MaxChunkSize  int64 // largest WriteChunk; default and at most MaxChunkSize
	Sync          SyncPolicy
	// OutOfOrderWrites lets chunks of a block arrive at any non-overlapping
	// offset. Off by default: chunks must extend the block's written data
	// (or repeat an earlier chunk exactly), which append-only backends need.
	OutOfOrderWrites bool
	// KeepUncommitted keeps the durable written chunks of uncommitted
	// blocks at Open (exactly those with a chunk record) instead of
	// deleting them, for a caller that will replay their PutBlock.
	KeepUncommitted bool
	// MaxOpenBlocks bounds the blocks with uncommitted writes (each holds
	// file descriptors and per-chunk state); default 1024.
	MaxOpenBlocks int
	// AvoidVolume, if set, names volumes (as given in Volumes) that get no
	// new container while another volume has room (a slow disk,
	// internal/slowdisk). Must be cheap.
	AvoidVolume func(path string) bool
	// Logf reports volume failures and recovery actions; default discard.
	Logf func(format string, args ...any)
	// DeferredMax: a checksummed chunk of at most this many bytes that is
	// all of its block's unsynced data is made durable by Sync in the
	// volume's Pebble WAL, its file synced later in the background
	// (deferred writes, deferred.go; posix backend only). 0: default
	// DefaultDeferredMax; negative: off.
	DeferredMax int64
}

// DefaultMetaReserve and DefaultBallast are the default headroom kept for
// a volume's Pebble DB and the ballast size the binary configures.
const (
	DefaultMetaReserve = 64 << 20
	DefaultBallast     = 64 << 20
)

func (o *Options) setDefaults() {
	if o.MetaReserveBytes == 0 {
		o.MetaReserveBytes = DefaultMetaReserve
	}
	if o.FS == nil {
		o.FS = vfs.Default
	}
	if o.NewBackend == nil {
		o.NewBackend = defaultBackend(o.DirectIO)
	}
	if o.ContainerSize <= 0 {
		o.ContainerSize = DefaultContainerSize
	}
	if o.MaxBlockSize <= 0 || o.MaxBlockSize > MaxBlockSize {
		o.MaxBlockSize = MaxBlockSize
	}
	if o.MaxChunkSize <= 0 || o.MaxChunkSize > MaxChunkSize {
		o.MaxChunkSize = MaxChunkSize
	}
	if o.MaxOpenBlocks <= 0 {
		o.MaxOpenBlocks = DefaultMaxOpenBlocks
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	if o.DeferredMax == 0 {
		o.DeferredMax = DefaultDeferredMax
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

	// volumeFatals counts the volumes failed by a fatal error of their
	// metadata store or a panic on a storage goroutine (fatal.go).
	volumeFatals atomic.Uint64

	pcache *pebble.Cache // while Open runs: the volumes' shared block cache

	// testHook, if set (tests only), runs at the points testPoint names,
	// some while a lock is held: a panic there checks the lock is
	// released on the way out.
	testHook func(point string)
}

// SetTestHook sets the hook run at the store's test points (see
// testPoint's callers; for other packages' tests, such as the datanode's
// guard tests, only). Set it while no call runs on the store.
func (s *Store) SetTestHook(f func(point string)) { s.testHook = f }

// testPoint runs the test hook, if any, at point.
func (s *Store) testPoint(point string) {
	if s.testHook != nil {
		s.testHook(point)
	}
}

type volume struct {
	path  string
	files BlockFiles
	db    *pebble.DB
	g     GuardedDB // every call into db (fatal.go)
	fs    vfs.FS
	// space admits block data while the volume keeps its reserve free for
	// the Pebble DB, and keeps the emergency ballast.
	space *vfs.Space

	failed  atomic.Bool
	probing atomic.Bool // a health check probe is running (health.go)
	// wedged: the DB met a fatal error (fatal.go) and is never called
	// again, nor closed; set before failed. fatalLogged: the fatal error
	// (or a panic on a storage goroutine of the volume) was logged and
	// counted. log is the DB's logger.
	wedged, fatalLogged atomic.Bool
	// wedgeErr: the cause of the wedge (the first), stored before wedged
	// is set, so whoever sees wedged sees the cause (usable).
	wedgeErr atomic.Pointer[error]
	// wedgedCh is closed (once) when the DB wedges, after wedged is set:
	// a write inside the DB then returns (GuardedDB.Wedged).
	wedgedCh     chan struct{}
	wedgeOnce    sync.Once
	fatalChecked atomic.Bool // a CheckVolumes reported the fatal failure
	log          *FatalLogger
	mu           sync.Mutex
	failErr      error

	// deferredSeq counts the PutBlockDeferred commits made without a WAL
	// sync; syncedSeq is the count a completed SyncCommits covered.
	deferredSeq, syncedSeq atomic.Uint64
	// defer_ flushes deferred writes (nil if the volume takes none).
	defer_ *deferrer

	// Under dmu: dirty holds the blocks with written chunks that are not
	// durable yet; inflight the Sync rounds running (each took its blocks
	// out of dirty, so rounds never share a block); lastSyncErr the last
	// failure of a round, for a writer whose chunk it forgot (see
	// WriteChunkDurable).
	dmu         sync.Mutex
	dirty       map[*openBlock]blockRef
	inflight    map[*round]struct{}
	lastSyncErr error
}

// round is one Sync round of a volume; err is set before done is closed.
type round struct {
	done chan struct{}
	err  error
}

type blockRef struct {
	c   *container
	lid LocalID
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

	// creating is closed when the CreateContainer that reserved this
	// container returns (nil for imports and recovered containers): a
	// concurrent create of the same ID waits for it instead of taking
	// "exists" for "ready" while it is still invisible.
	creating chan struct{}

	// deferredKeys counts this container's deferred writes whose files
	// the flusher has not synced yet (deferred.go).
	deferredKeys atomic.Int64

	// maxBlock is at least the largest local ID of any block record this
	// container has had: raised before a record is written (Open's scan,
	// putBlock, Import), never lowered. SCM hands out local IDs in
	// increasing order, so a new block's first write usually finds its
	// ID above it and skips the record lookup (getOpen), a Pebble miss
	// that cost 4% of a small-PUT profile.
	maxBlock atomic.Uint64
}

// noteBlock raises c.maxBlock to lid; called before lid's record is
// written.
func (c *container) noteBlock(lid LocalID) {
	for {
		cur := c.maxBlock.Load()
		if uint64(lid) <= cur || c.maxBlock.CompareAndSwap(cur, uint64(lid)) {
			return
		}
	}
}

// openBlock is the in-memory state of a block with uncommitted writes.
//
// Invariants (under mu): written is sorted, non-overlapping and lies in
// [committed.Length, hwm); hwm = max(committed.Length, end of the last
// span); a span is durable only if its data was synced and its chunk
// record committed; queued is true while the block is in its volume's
// dirty set, which it is whenever a span is not durable.
type openBlock struct {
	mu        sync.Mutex // held across the block's I/O
	dead      bool       // dropped from container.open; look it up again
	w         BlockWriter
	committed BlockData // Length 0 and no chunks if never committed
	written   []span    // uncommitted chunks, sorted, non-overlapping
	hwm       int64     // end of the highest byte written or committed
	dirSync   bool      // file may be new; its directory entry is not durable yet
	exists    bool      // committed at least once
	queued    bool      // in vol.dirty
}

type span struct {
	off, n  int64
	sum     ChecksumData // Type NONE: unknown, any rewrite allowed
	durable bool         // data synced and chunk record committed
	// unverified: recovered from a chunk record at Open, bytes not yet
	// checked against the record's checksums (the record of a checksummed
	// chunk may reach disk before its data; see persist).
	unverified bool
	// data: a copy of the bytes of a chunk that may be a deferred write,
	// kept until it is durable (deferred.go); for an inline span, until
	// it is committed.
	data []byte
	// inline: the chunk of a small block written by WriteSmallChunk whose
	// bytes are only in data (and, once durable, in its deferred key):
	// no block file was created (inline.go).
	inline bool
	// small: written by WriteSmallChunk (inline or not). Its block may
	// only be committed with exactly this chunk (smallCommitOK): a flag
	// set alike on every replica, whatever its volume's configuration.
	small bool
}

func (sp span) end() int64 { return sp.off + sp.n }

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
	// One block cache for every volume's Pebble store (each DB holds a
	// reference; this one is dropped when Open returns).
	s.pcache = pebble.NewCache(sharedCacheSize(len(opts.Volumes)))
	defer func() { s.pcache.Unref(); s.pcache = nil }()
	healthy := 0
	var firstErr error
	for _, p := range opts.Volumes {
		v := &volume{path: p, fs: opts.FS, dirty: map[*openBlock]blockRef{}, inflight: map[*round]struct{}{}, wedgedCh: make(chan struct{})}
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

// AbandonedWrites counts the writes whose caller returned ErrVolumeFailed
// on its volume's wedge while they were inside the volume's DB (fatal.go,
// GuardedDB), and how many of those are still stuck there (goroutines
// held until the process exits). A zoned backend's own DB counts its own.
func (s *Store) AbandonedWrites() (abandoned uint64, stuck int64) {
	for _, v := range s.volumes { // fixed after Open
		if v.log != nil {
			abandoned += v.log.Abandoned()
			stuck += v.log.Stuck()
		}
	}
	return abandoned, stuck
}

// GuardedWrites counts the calls that entered a volume DB's commit
// pipeline (each a Pebble commit handed to a committer: see GuardedDB)
// since Open, over every volume. A test reads it to count the commits an
// operation costs.
func (s *Store) GuardedWrites() (n uint64) {
	for _, v := range s.volumes { // fixed after Open
		if v.log != nil {
			n += v.log.Writes()
		}
	}
	return n
}

// VolumeFatals counts the volumes failed by a fatal error of their
// metadata store (Pebble's Fatalf) or a panic on one of storage's
// background goroutines since Open: each such volume is failed (reported
// as the health check's failures are) and the others go on.
func (s *Store) VolumeFatals() uint64 { return s.volumeFatals.Load() }

// The volumes' Pebble stores share one block cache: 64 MiB for the
// first volume and 32 MiB for each other, at most 512 MiB (a cache per
// volume cost 64 MiB each: 1.5 GiB on a 24-volume node). Each store has
// its own memtables.
const (
	pebbleCacheSize      = 64 << 20
	pebbleCachePerVolume = 32 << 20
	pebbleCacheMax       = 512 << 20
	pebbleMemTableSize   = 16 << 20
)

// Value separation (Pebble's blob files): small blocks' data lives in the
// volume's store under deferred keys (inline.go, deferred.go) as values
// of up to Options.DeferredMax bytes, permanent for inline blocks.
// Without separation every compaction rewrites those values level after
// level (measured on `basalt dev` with 4 KiB PUTs: compactions wrote 165
// MB per 147 MB taken in, beside the flushes' 135 MB). With it, a flush
// writes each deferred key's value of at least valueSepMinSize bytes once
// into a blob file, and compactions move only the key and a reference.
// Only deferred keys are separated (valueSepSpans): records (container,
// block, chunk; a block record of many chunks passes 1 KiB) always stay
// in the sstables, so point lookups of records never read a blob file.
// Inline and deferred data share the key kind, so a blob file holds both:
// deferred data is garbage once the flusher has written it to its block
// file, inline data once its block is deleted.
//
// Space: Pebble rewrites blob files (one at a time, the file with the
// most garbage first) only while the garbage of ALL the volume's blob
// files together exceeds valueSepGarbage of their bytes, only files older
// than valueSepRewriteAge, and only when its compaction picker runs
// (after a flush or a compaction: a store that takes no writes at all
// reclaims nothing until it does). A compaction whose output would
// reference more than valueSepMaxDepth overlapping blob files rewrites
// the values it moves into a new blob file. A deleted value becomes
// garbage once a compaction drops its key (the tombstone reached the key's
// level: as for values kept in sstables, whose space also comes back only
// then). So deleted small blocks' bytes come back once such garbage is
// more than 5% of the blob bytes, files at least a minute old, at the next
// flush or compaction; up to 5% of the blob bytes (plus files younger than
// a minute) stay garbage.
//
// The store's format is ratcheted to FormatValueSeparation (format 24) at
// Open: a build with an older Pebble that does not know that format
// cannot open the volume; builds with this Pebble open it with or without
// value separation (the values in blob files are read either way).
const (
	valueSepMinSize  = 1 << 10
	valueSepMaxDepth = 10
	valueSepGarbage  = 0.05
)

// valueSepRewriteAge is a variable only for tests.
var valueSepRewriteAge = time.Minute

// valueSeparation is off only in a benchmark that compares both.
var valueSeparation = true

func separateValues(po *pebble.Options) {
	if !valueSeparation {
		return
	}
	po.FormatMajorVersion = pebble.FormatValueSeparation
	po.Experimental.ValueSeparationPolicy = func() pebble.ValueSeparationPolicy {
		return pebble.ValueSeparationPolicy{
			Enabled:               true,
			MinimumSize:           valueSepMinSize,
			MaxBlobReferenceDepth: valueSepMaxDepth,
			RewriteMinimumAge:     valueSepRewriteAge,
			TargetGarbageRatio:    valueSepGarbage,
		}
	}
	po.Experimental.SpanPolicyFunc = valueSepSpans
}

// valueSepSpans is the volume store's SpanPolicyFunc: values may be
// separated only in a container's deferred keys (containerID | kindDeferred
// | ...); every other key of the container (container, block and chunk
// records) keeps its value in the sstable. An sstable written by a flush
// or compaction ends at each such boundary it crosses, so a container's
// records and its deferred keys are in different tables.
func valueSepSpans(start []byte) (pebble.SpanPolicy, []byte, error) {
	inPlace := pebble.SpanPolicy{ValueStoragePolicy: pebble.ValueStorageLowReadLatency}
	var p [8]byte
	copy(p[:], start) // a shorter key sorts before its zero-padded form
	cid := binary.BigEndian.Uint64(p[:])
	kind := byte(0)
	if len(start) > 8 {
		kind = start[8]
	}
	end := func(cid uint64, kind byte) []byte {
		k := make([]byte, 9)
		binary.BigEndian.PutUint64(k, cid)
		k[8] = kind
		return k
	}
	switch {
	case kind < kindDeferred:
		return inPlace, end(cid, kindDeferred), nil
	case kind == kindDeferred:
		return pebble.SpanPolicy{}, end(cid, kindDeferred+1), nil
	case cid == ^uint64(0):
		return inPlace, nil, nil
	default:
		return inPlace, end(cid+1, kindDeferred), nil
	}
}

func sharedCacheSize(volumes int) int64 {
	return min(pebbleCacheSize+int64(max(volumes-1, 0))*pebbleCachePerVolume, pebbleCacheMax)
}

func (s *Store) openVolume(v *volume) (err error) {
	root := filepath.Join(v.path, "basalt")
	if err := vfs.MkdirAllSync(v.fs, filepath.Join(root, "meta")); err != nil {
		return err
	}
	// Before Pebble opens (the volume's, and a backend's own): on a full
	// disk Pebble's open waits forever for a flush it cannot write, so the
	// ballast goes first.
	v.space, err = vfs.OpenSpace(v.fs, root, vfs.SpaceOptions{
		Reserve:     s.reserve(),
		Ballast:     s.opts.BallastBytes,
		BallastPath: filepath.Join(root, "meta.ballast"),
		Logf:        s.opts.Logf,
	})
	if err != nil {
		return err
	}
	files, err := s.opts.NewBackend(v.fs, filepath.Join(root, "containers"))
	if err != nil {
		return err
	}
	v.files = files
	v.log = &FatalLogger{Prefix: "pebble: ", Logf: s.opts.Logf, OnFatal: func(err *FatalError) { s.wedge(v, err) }}
	po := &pebble.Options{
		FS:     v.log.WrapFS(v.fs), // its WAL and MANIFEST errors wedge v first
		Logger: v.log,
	}
	// A Fatalf on this goroutine (Open's WAL replay, recovery's commits and
	// iterators) fails the volume, not the process.
	defer v.log.Catch(&err)
	// Bloom filters: every new block's first write looks its record up
	// (getOpen) and finds nothing; without filters each such miss reads
	// an index block of every table whose key range covers it, and small
	// blocks' deferred and inline data make many tables (inline.go).
	po.Levels[0].FilterPolicy = bloom.FilterPolicy(10) // later levels inherit it
	// Pebble's default 8 MiB block cache is evicted by small blocks'
	// data (inline.go), and every lookup then read index and filter
	// blocks from the file again; a larger memtable makes fewer tables.
	po.Cache = s.pcache // shared by the volumes; the DB holds its own reference
	po.MemTableSize = pebbleMemTableSize
	separateValues(po)
	db, err := pebble.Open(filepath.Join(root, "meta"), po)
	if err != nil {
		return err
	}
	v.db = db
	v.g = GuardedDB{DB: db, Log: v.log, Usable: v.usable, Wedged: v.wedgedCh, Wedge: func(err error) { s.panicVolume(v, err) }}
	v.log.SetDB(db)
	if err := s.recoverVolume(v); err != nil {
		return err
	}
	if err := v.usable(); err != nil {
		return err // wedged by a flush or compaction during recovery
	}
	if s.deferOK(v) {
		s.startDeferrer(v)
	}
	return nil
}

// reserve is the free space block data never eats into.
func (s *Store) reserve() int64 {
	return s.opts.ReservedBytes + max(0, s.opts.MetaReserveBytes)
}

func (s *Store) markUnhealthyLocked(c *container, why string) error {
	s.opts.Logf("storage: container %d UNHEALTHY: %s", c.id, why)
	if c.rec.State == StateUnhealthy {
		return nil
	}
	c.rec.State = StateUnhealthy
	return c.vol.set(makeKey(c.id, kindContainer, idRecord), c.rec.encode(), pebble.Sync)
}

// Close makes written chunks durable (a clean shutdown keeps what the
// page cache would have kept) and releases files and databases. Uncommitted
// blocks stay on disk for the next Open to recover or clean up.
func (s *Store) Close() error {
	s.mu.RLock()
	closed := s.closed
	s.mu.RUnlock()
	if closed {
		return nil
	}
	serr := s.Sync()
	// Deferred writes made after this stay in the WAL for Open to replay.
	for _, v := range s.volumes {
		s.stopDeferrer(v)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	first := serr
	for _, c := range s.containers {
		if c.vol.wedged.Load() {
			// A request stalled inside its wedged DB may hold an
			// ob.mu for good; its files go at the process exit.
			continue
		}
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
	s.mu.Unlock()
	// The DBs are closed outside s.mu (a DB wedged while its Close waits
	// would otherwise hold every s.mu reader for good). A wedged DB is
	// left open: its Close would wait for a flush or compaction that
	// Fatalf ended (fatal.go); its files are released when the process
	// exits.
	for _, v := range s.volumes {
		if v.db != nil {
			v.g.Stop() // its idle committers end
			if err := CloseDB(v.db, v.log, v.wedged.Load); err != nil && first == nil && !v.failed.Load() {
				first = err
			}
		}
		if v.files != nil {
			if err := closeBackend(v.files); err != nil && first == nil && !v.failed.Load() {
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
	if avail, total, ok, err := backendUsage(v.files); ok {
		return avail, total, err
	}
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
	if fe := (*FatalError)(nil); errors.As(err, &fe) {
		s.fatalVolume(c.vol, err) // the backend's metadata store
	} else {
		c.vol.fail(err, s.opts.Logf)
	}
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
	c, err := s.reserveCreate(cid)
	if err != nil {
		return ContainerReport{}, err
	}
	defer close(c.creating)
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
	if err := v.commit(b, s.metaSync()); err != nil {
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

// visibleVol is the container's volume, or nil while it is being created
// or imported: CreateContainer and Import set the volume without c.mu
// while the container is already in the store's map (invisible), and clear
// importing under c.mu afterwards, so reading importing under c.mu first
// orders the read of the volume after its write.
func (c *container) visibleVol() *volume {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.importing {
		return nil
	}
	return c.vol
}

// reserveCreate is reserveID for CreateContainer. If another
// CreateContainer of cid is in progress it waits for that one to finish:
// then cid exists (ErrContainerExists, and the container is visible) or
// that create failed and this one tries again. Without the wait, a second
// writer's create returned "exists" while the first was still syncing its
// record, and the writer's next call found the container "not found".
func (s *Store) reserveCreate(cid ContainerID) (*container, error) {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, cErr("create", ErrClosed, cid, "", nil)
		}
		if other, ok := s.containers[cid]; ok {
			wait := other.creating
			s.mu.Unlock()
			if wait == nil {
				return nil, cErr("create", ErrContainerExists, cid, "", nil)
			}
			<-wait
			s.mu.RLock()
			now, ok := s.containers[cid]
			s.mu.RUnlock()
			if ok && now == other {
				return nil, cErr("create", ErrContainerExists, cid, "", nil)
			}
			continue // it failed (dropped), or was replaced: look again
		}
		c := &container{id: cid, open: map[LocalID]*openBlock{}, importing: true, creating: make(chan struct{})}
		s.containers[cid] = c
		s.mu.Unlock()
		return c, nil
	}
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
	var bestAvoided bool
	var reasons []string
	for _, v := range s.volumes {
		s.checkBackend(v)
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
		free := avail - s.reserve()
		if free < need {
			reasons = append(reasons, fmt.Sprintf("%s: %d bytes free beyond reserve, need %d", v.path, free, need))
			continue
		}
		if best == nil || bestAvoided && !s.avoided(v) || free > bestFree && bestAvoided == s.avoided(v) {
			best, bestFree, bestAvoided = v, free, s.avoided(v)
		}
	}
	if best == nil {
		return nil, fmt.Errorf("%v", reasons)
	}
	return best, nil
}

func (s *Store) avoided(v *volume) bool {
	return s.opts.AvoidVolume != nil && s.opts.AvoidVolume(v.path)
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
	// Every new block's first write lands here and finds nothing: above
	// maxBlock no record can exist, and a miss builds no error.
	var bd BlockData
	var found bool
	if uint64(lid) <= c.maxBlock.Load() {
		var err error
		if bd, found, err = s.lookupBlock(c, lid); err != nil {
			return nil, err
		}
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
	ob = &openBlock{committed: bd, hwm: bd.Length, dirSync: !found, exists: found}
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

// GetBlock returns the committed description of a block.
func (s *Store) GetBlock(cid ContainerID, lid LocalID) (BlockData, error) {
	c, err := s.container("get block", cid)
	if err != nil {
		return BlockData{}, err
	}
	return s.getBlock(c, lid)
}

func (s *Store) getBlock(c *container, lid LocalID) (BlockData, error) {
	bd, found, err := s.lookupBlock(c, lid)
	if err == nil && !found {
		err = bErr("get block", ErrBlockNotFound, c.id, lid, "", nil)
	}
	return bd, err
}

// lookupBlock is getBlock with a missing block reported by found, not by
// an error.
func (s *Store) lookupBlock(c *container, lid LocalID) (bd BlockData, found bool, err error) {
	var key [keyLen]byte
	binary.BigEndian.PutUint64(key[:], uint64(c.id))
	key[8] = kindBlock
	binary.BigEndian.PutUint64(key[9:], uint64(lid))
	val, closer, err := c.vol.get(key[:])
	if errors.Is(err, pebble.ErrNotFound) {
		return BlockData{}, false, nil
	}
	if err != nil {
		return BlockData{}, false, s.ioErr("get block", c, lid, 0, err)
	}
	defer closer.Close()
	bd, err = decodeBlock(val)
	if err != nil {
		return BlockData{}, false, bErr("get block", ErrCorruption, c.id, lid, "metadata: "+err.Error(), nil)
	}
	return bd, true, nil
}

// ListBlocks returns the committed blocks of a container with local IDs in
// [start, ∞), at most limit of them (limit ≤ 0: 1000).
func (s *Store) ListBlocks(cid ContainerID, start LocalID, limit int) (_ []BlockData, err error) {
	if limit <= 0 {
		limit = 1000
	}
	c, err := s.container("list blocks", cid)
	if err != nil {
		return nil, err
	}
	it, err := c.vol.newIter(&pebble.IterOptions{
		LowerBound: makeKey(cid, kindBlock, uint64(start)),
		UpperBound: makeKey(cid, kindBlock+1, 0),
	})
	if err != nil {
		return nil, s.ioErr("list blocks", c, 0, 0, err)
	}
	defer c.vol.log.Catch(&err) // a Fatalf while iterating (corruption)
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
