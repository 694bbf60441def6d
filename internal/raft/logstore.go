package raft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/basalt-store/basalt/internal/storage"
	bvfs "github.com/basalt-store/basalt/internal/vfs"
	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	etcdraft "go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"google.golang.org/protobuf/proto"
)

// logStore holds the Raft logs, HardStates and truncation points of every
// group placed on one log directory, in one Pebble DB. All groups share
// Pebble's WAL, so one synced batch (one fdatasync) makes the appends of
// every group in it durable: that is the group commit.
//
// Key layout (group IDs and indexes big-endian so that a group's entries
// are contiguous and ordered):
//
//	'e' group index -> term(8) type(1) data   one log entry
//	'h' group       -> term(8) vote(8) commit(8)
//	't' group       -> index(8) term(8)       last truncated entry
//	'c' group       -> ConfState (protobuf)   latest applied membership
//	'g' group       -> (empty)                the group lives here
type logStore struct {
	dir   string
	db    *pebble.DB
	syncs atomic.Int64 // fsyncs issued by Pebble on this directory
	// space keeps LogReserveBytes free for Pebble and the ballast.
	space *bvfs.Space
	// fatal fails this directory alone on a fatal I/O error (logfatal.go):
	// every call into db goes through its guard.
	*fatal

	mu     sync.Mutex
	groups map[uint64]*groupLog
}

const (
	keyEntry     = 'e'
	keyHardState = 'h'
	keyTrunc     = 't'
	keyConf      = 'c'
	keyGroup     = 'g'
)

func groupKey(kind byte, group uint64) []byte {
	k := make([]byte, 9)
	k[0] = kind
	binary.BigEndian.PutUint64(k[1:], group)
	return k
}

func entryKey(group, index uint64) []byte {
	k := make([]byte, 17)
	k[0] = keyEntry
	binary.BigEndian.PutUint64(k[1:], group)
	binary.BigEndian.PutUint64(k[9:], index)
	return k
}

// spaceOptions are the headroom settings of every log store of h.
func (h *Host) spaceOptions() bvfs.SpaceOptions {
	return bvfs.SpaceOptions{
		Reserve: max(0, h.cfg.LogReserveBytes),
		Ballast: h.cfg.LogBallastBytes,
		Logf:    func(f string, a ...any) { h.log.Warn(fmt.Sprintf(f, a...)) },
	}
}

// CheckLogSpace reports whether n more bytes may go into the group's log:
// nil, or an error wrapping ErrLogDiskFull once the log directory's disk is
// below HostConfig.LogReserveBytes (a cached figure, cheap to ask per
// request). Raft itself never refuses: heartbeats, votes and the entries
// already proposed must still be written; callers refuse new data.
func (g *Group) CheckLogSpace(n int) error {
	if g.loop == nil || g.loop.store.space == nil {
		return nil
	}
	sp := g.loop.store.space
	if err := sp.Admit(int64(n)); err != nil {
		if errors.Is(err, bvfs.ErrNoSpace) {
			return fmt.Errorf("raft: group %d: %w: %w", g.id, ErrLogDiskFull, err)
		}
		return fmt.Errorf("raft: group %d: %w", g.id, err)
	}
	return nil
}

// logHasRoom reports whether n more bytes of entry data may go into this
// group's log: false once its disk is below the reserve. Then a
// DataLogger's data goes to the state machine's storage as for any entry
// (WriteData, SyncData before the append, the log keeping it elided), so a
// replica whose log disk is nearly full (a follower: only the leader
// checks CheckLogSpace before proposing) logs no more than before
// DataLogger.
func (g *Group) logHasRoom(n int) bool {
	if g.loop == nil || g.loop.store.space == nil {
		return true
	}
	return g.loop.store.space.Check(int64(n)) == nil
}

// openLogStore opens a log store without a reserve or ballast.
func openLogStore(dir string, fs vfs.FS) (*logStore, error) {
	return openLogStoreSpace(dir, fs, bvfs.SpaceOptions{})
}

func openLogStoreSpace(dir string, fs vfs.FS, space bvfs.SpaceOptions) (*logStore, error) {
	if fs == nil {
		fs = vfs.Default
	}
	s := &logStore{dir: dir, groups: make(map[uint64]*groupLog), fatal: newFatal(dir)}
	opts := &pebble.Options{
		// The fatal wrapper outermost: Pebble calls it directly, so a
		// Fatalf it raises has no frame of ours below it on Pebble's
		// goroutines (see storage.FatalLogger).
		FS: s.flog.WrapFS(countingFS{FS: fs, syncs: &s.syncs}),
		// Raft entries are written once, read rarely and deleted soon:
		// a large memtable lets most of them die before any flush.
		MemTableSize:                64 << 20,
		MemTableStopWritesThreshold: 4,
		Logger:                      s.flog,
		EventListener:               &pebble.EventListener{BackgroundError: s.backgroundError},
	}
	if err := fs.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("raft: log dir %s: %w", dir, err)
	}
	// Before Pebble opens: on a full disk its open waits forever for a
	// flush it cannot write, so the ballast goes first.
	sp, err := bvfs.OpenSpace(fs, dir, space)
	if err != nil {
		return nil, fmt.Errorf("raft: log dir %s: %w", dir, err)
	}
	s.space = sp
	db, err := openPebble(dir, opts, s.fatal)
	if err != nil {
		return nil, fmt.Errorf("raft: open log store %s: %w", dir, err)
	}
	if e := s.failed(); e != nil {
		// Failed while opening (after Pebble's own open returned): the
		// DB is not to be called, nor closed.
		return nil, fmt.Errorf("raft: open log store %s: %w", dir, e)
	}
	s.flog.SetDB(db)
	s.db = db
	return s, nil
}

// openPebble opens the DB. A fatal error during the open (a disk still bad
// at restart: a failed WAL or MANIFEST write or sync) is its error; the
// open runs aside because Pebble's Open then waits forever for the flush
// that the Fatalf ended (its goroutine is left behind, with the directory's
// LOCK: the host does not start, and the process is expected to exit).
func openPebble(dir string, opts *pebble.Options, f *fatal) (*pebble.DB, error) {
	type result struct {
		db  *pebble.DB
		err error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() { done <- r }()
		defer f.flog.Catch(&r.err)
		r.db, r.err = pebble.Open(dir, opts)
	}()
	select {
	case r := <-done:
		// A Fatalf on the open goroutine itself is caught into r.err (a
		// *storage.FatalError) after it marked the directory: the
		// directory's failure is the error (ErrLogDirFailed, naming it).
		if e := f.failed(); e != nil {
			return nil, e
		}
		if r.err != nil {
			return nil, f.after(r.err)
		}
		return r.db, nil
	case <-f.failc:
		return nil, f.failed()
	}
}

// close closes the DB unless the directory failed (a wedged DB's Close
// waits forever for the flush or compaction that Fatalf ended).
func (s *logStore) close() error {
	if s.db == nil {
		return nil
	}
	return storage.CloseDB(s.db, s.flog, func() bool { return s.failed() != nil })
}

// get is db.Get behind the guard: a read error other than not-found fails
// the directory (EIO on an SST: nothing on it is to be trusted).
func (s *logStore) get(k []byte) (v []byte, c io.Closer, err error) {
	if err := s.usable(); err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil && !errors.Is(err, pebble.ErrNotFound) {
			err = s.failWith("read", err)
		}
	}()
	defer s.flog.Catch(&err)
	return s.db.Get(k)
}

// commit commits b behind the guard: any error fails the directory (a
// failed WAL write or sync leaves nothing on it trustworthy: fsyncgate).
func (s *logStore) commit(b *pebble.Batch, wo *pebble.WriteOptions) (err error) {
	if err := s.usable(); err != nil {
		return err
	}
	defer func() { err = s.failWith("commit", err) }()
	defer s.flog.Catch(&err)
	return b.Commit(wo)
}

// set is db.Set behind the guard (as commit).
func (s *logStore) set(k, v []byte, wo *pebble.WriteOptions) (err error) {
	if err := s.usable(); err != nil {
		return err
	}
	defer func() { err = s.failWith("write", err) }()
	defer s.flog.Catch(&err)
	return s.db.Set(k, v, wo)
}

// scan runs fn over the keys in [lo, hi) behind the guard (Pebble may
// raise a Fatalf inside any iterator step). fn returns false to stop.
// A read error fails the directory; fn's own error is returned as is.
func (s *logStore) scan(lo, hi []byte, reverse bool, fn func(k, v []byte) (bool, error)) (err error) {
	if err := s.usable(); err != nil {
		return err
	}
	var fnErr error
	defer func() {
		if fnErr != nil {
			err = fnErr
			return
		}
		err = s.failWith("read", err)
	}()
	defer s.flog.Catch(&err)
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
	if err != nil {
		return err
	}
	valid := it.First
	next := it.Next
	if reverse {
		valid, next = it.Last, it.Prev
	}
	for ok := valid(); ok; ok = next() {
		var more bool
		more, fnErr = fn(it.Key(), it.Value())
		if fnErr != nil || !more {
			break
		}
	}
	if fnErr != nil {
		it.Close()
		return nil
	}
	if err := it.Error(); err != nil {
		it.Close()
		return err
	}
	return it.Close()
}

// groupIDs lists the groups whose state is in this store.
func (s *logStore) groupIDs() ([]uint64, error) {
	var ids []uint64
	err := s.scan([]byte{keyGroup}, []byte{keyGroup + 1}, false, func(k, _ []byte) (bool, error) {
		ids = append(ids, binary.BigEndian.Uint64(k[1:]))
		return true, nil
	})
	return ids, err
}

func (s *logStore) numGroups() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.groups)
}

// load opens (or creates) the log of group id.
func (s *logStore) load(id uint64) (*groupLog, error) {
	g := &groupLog{store: s, id: id, hs: &pb.HardState{}, cs: &pb.ConfState{}}
	if v, closer, err := s.get(groupKey(keyHardState, id)); err == nil {
		if len(v) != 24 {
			closer.Close()
			return nil, fmt.Errorf("raft: group %d: corrupt hard state (%d bytes)", id, len(v))
		}
		g.hs = &pb.HardState{
			Term:   proto.Uint64(binary.BigEndian.Uint64(v)),
			Vote:   proto.Uint64(binary.BigEndian.Uint64(v[8:])),
			Commit: proto.Uint64(binary.BigEndian.Uint64(v[16:])),
		}
		closer.Close()
	} else if !errors.Is(err, pebble.ErrNotFound) {
		return nil, err
	}
	if v, closer, err := s.get(groupKey(keyTrunc, id)); err == nil {
		g.truncIndex = binary.BigEndian.Uint64(v)
		g.truncTerm = binary.BigEndian.Uint64(v[8:])
		closer.Close()
	} else if !errors.Is(err, pebble.ErrNotFound) {
		return nil, err
	}
	if v, closer, err := s.get(groupKey(keyConf, id)); err == nil {
		cs := &pb.ConfState{}
		uerr := proto.Unmarshal(v, cs)
		closer.Close()
		if uerr != nil {
			return nil, fmt.Errorf("raft: group %d: corrupt conf state: %w", id, uerr)
		}
		g.cs = cs
	} else if !errors.Is(err, pebble.ErrNotFound) {
		return nil, err
	}
	// The last index is the highest entry key of the group.
	g.last = g.truncIndex
	if err := s.scan(entryKey(id, 0), entryKey(id+1, 0), true, func(k, _ []byte) (bool, error) {
		g.last = binary.BigEndian.Uint64(k[9:])
		return false, nil
	}); err != nil {
		return nil, err
	}
	if err := s.set(groupKey(keyGroup, id), nil, pebble.Sync); err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.groups[id] = g
	s.mu.Unlock()
	return g, nil
}

// drop deletes everything of group id from the store.
func (s *logStore) drop(id uint64) error {
	b := s.db.NewBatch()
	defer b.Close()
	for _, k := range []byte{keyHardState, keyTrunc, keyConf, keyGroup} {
		if err := b.Delete(groupKey(k, id), nil); err != nil {
			return err
		}
	}
	if err := b.DeleteRange(entryKey(id, 0), entryKey(id+1, 0), nil); err != nil {
		return err
	}
	if err := s.commit(b, pebble.Sync); err != nil {
		return err
	}
	s.mu.Lock()
	delete(s.groups, id)
	s.mu.Unlock()
	return nil
}

// groupLog is one group's view of a logStore; it implements etcd raft's
// Storage. raft calls it with the group's lock held; the store loop changes
// it while holding mu.
type groupLog struct {
	store *logStore
	id    uint64

	mu         sync.Mutex
	hs         *pb.HardState
	cs         *pb.ConfState
	truncIndex uint64 // entries <= truncIndex are gone
	truncTerm  uint64
	last       uint64
	// tail caches the newest entries (metadata only, so small) so that
	// Term lookups and resends rarely touch Pebble.
	tail      []*pb.Entry
	tailBytes int
}

const (
	maxTailEntries = 1024
	maxTailBytes   = 4 << 20
)

var _ etcdraft.Storage = (*groupLog)(nil)

func (g *groupLog) InitialState() (*pb.HardState, *pb.ConfState, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return proto.Clone(g.hs).(*pb.HardState), proto.Clone(g.cs).(*pb.ConfState), nil
}

func (g *groupLog) FirstIndex() (uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.truncIndex + 1, nil
}

func (g *groupLog) LastIndex() (uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.last, nil
}

func (g *groupLog) Term(i uint64) (uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case i == g.truncIndex:
		return g.truncTerm, nil
	case i < g.truncIndex:
		return 0, etcdraft.ErrCompacted
	case i > g.last:
		return 0, etcdraft.ErrUnavailable
	}
	if e := g.tailEntry(i); e != nil {
		return e.GetTerm(), nil
	}
	e, err := g.readEntry(i)
	if err != nil {
		return 0, err
	}
	return e.GetTerm(), nil
}

func (g *groupLog) Entries(lo, hi, maxSize uint64) ([]*pb.Entry, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if lo <= g.truncIndex {
		return nil, etcdraft.ErrCompacted
	}
	if hi > g.last+1 {
		return nil, fmt.Errorf("raft: group %d: entries [%d,%d) past last index %d: %w", g.id, lo, hi, g.last, etcdraft.ErrUnavailable)
	}
	if len(g.tail) > 0 && lo >= g.tail[0].GetIndex() {
		off := lo - g.tail[0].GetIndex()
		return limitSize(append([]*pb.Entry(nil), g.tail[off:off+(hi-lo)]...), maxSize), nil
	}
	var out []*pb.Entry
	var size uint64
	next := lo
	if err := g.store.scan(entryKey(g.id, lo), entryKey(g.id, hi), false, func(k, v []byte) (bool, error) {
		idx := binary.BigEndian.Uint64(k[9:])
		if idx != next {
			return false, fmt.Errorf("raft: group %d: log hole at index %d (found %d)", g.id, next, idx)
		}
		e, err := decodeStoredEntry(idx, v)
		if err != nil {
			return false, fmt.Errorf("raft: group %d: %w", g.id, err)
		}
		size += uint64(proto.Size(e))
		if len(out) > 0 && size > maxSize {
			return false, nil
		}
		out = append(out, e)
		next++
		return true, nil
	}); err != nil {
		return nil, err
	}
	if len(out) == 0 || (next < hi && size <= maxSize) {
		return nil, fmt.Errorf("raft: group %d: entries [%d,%d) missing from %d: %w", g.id, lo, hi, next, etcdraft.ErrUnavailable)
	}
	return out, nil
}

func limitSize(ents []*pb.Entry, maxSize uint64) []*pb.Entry {
	if len(ents) == 0 {
		return ents
	}
	size := uint64(proto.Size(ents[0]))
	for i := 1; i < len(ents); i++ {
		size += uint64(proto.Size(ents[i]))
		if size > maxSize {
			return ents[:i]
		}
	}
	return ents
}

func (g *groupLog) Snapshot() (*pb.Snapshot, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.truncIndex == 0 {
		return nil, etcdraft.ErrSnapshotTemporarilyUnavailable
	}
	// The snapshot's data is produced by the state machine when it is
	// sent (see Host.sendSnapshot); raft only needs to know it exists.
	return &pb.Snapshot{Metadata: &pb.SnapshotMetadata{
		Index: proto.Uint64(g.truncIndex), Term: proto.Uint64(g.truncTerm),
		ConfState: proto.Clone(g.cs).(*pb.ConfState),
	}}, nil
}

func (g *groupLog) tailEntry(i uint64) *pb.Entry {
	if len(g.tail) == 0 || i < g.tail[0].GetIndex() || i > g.tail[len(g.tail)-1].GetIndex() {
		return nil
	}
	return g.tail[i-g.tail[0].GetIndex()]
}

func (g *groupLog) readEntry(i uint64) (*pb.Entry, error) {
	v, closer, err := g.store.get(entryKey(g.id, i))
	if err != nil {
		if errors.Is(err, pebble.ErrNotFound) {
			return nil, fmt.Errorf("raft: group %d: entry %d missing: %w", g.id, i, etcdraft.ErrUnavailable)
		}
		return nil, err
	}
	defer closer.Close()
	return decodeStoredEntry(i, v)
}

func encodeStoredEntry(e *pb.Entry) []byte {
	v := make([]byte, 9+len(e.GetData()))
	binary.BigEndian.PutUint64(v, e.GetTerm())
	v[8] = byte(e.GetType())
	copy(v[9:], e.GetData())
	return v
}

func decodeStoredEntry(index uint64, v []byte) (*pb.Entry, error) {
	if len(v) < 9 {
		return nil, fmt.Errorf("corrupt entry %d (%d bytes)", index, len(v))
	}
	typ := pb.EntryType(v[8])
	e := &pb.Entry{Index: proto.Uint64(index), Term: proto.Uint64(binary.BigEndian.Uint64(v)), Type: &typ}
	if len(v) > 9 {
		e.Data = append([]byte(nil), v[9:]...)
	}
	return e, nil
}

// append stages ents (already stripped of out-of-log data) into b and
// updates the in-memory view. Entries from ents[0].Index on replace what
// was there (raft overwrote a conflicting suffix).
func (g *groupLog) append(b *pebble.Batch, ents []*pb.Entry) error {
	if len(ents) == 0 {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	first := ents[0].GetIndex()
	if first <= g.truncIndex {
		return fmt.Errorf("raft: group %d: append at %d at or below truncation point %d", g.id, first, g.truncIndex)
	}
	if first > g.last+1 {
		return fmt.Errorf("raft: group %d: append at %d leaves a gap after %d", g.id, first, g.last)
	}
	if first <= g.last {
		if err := b.DeleteRange(entryKey(g.id, first), entryKey(g.id, g.last+1), nil); err != nil {
			return err
		}
		// Drop the overwritten part of the cache.
		if len(g.tail) > 0 && first <= g.tail[len(g.tail)-1].GetIndex() {
			if first <= g.tail[0].GetIndex() {
				g.tail, g.tailBytes = nil, 0
			} else {
				g.tail = g.tail[:first-g.tail[0].GetIndex()]
				g.tailBytes = 0
				for _, e := range g.tail {
					g.tailBytes += len(e.GetData())
				}
			}
		}
	}
	for _, e := range ents {
		if err := b.Set(entryKey(g.id, e.GetIndex()), encodeStoredEntry(e), nil); err != nil {
			return err
		}
	}
	g.last = ents[len(ents)-1].GetIndex()
	if len(g.tail) > 0 && g.tail[len(g.tail)-1].GetIndex()+1 != first {
		g.tail, g.tailBytes = nil, 0
	}
	for _, e := range ents {
		g.tail = append(g.tail, e)
		g.tailBytes += len(e.GetData())
	}
	for len(g.tail) > maxTailEntries || (len(g.tail) > 1 && g.tailBytes > maxTailBytes) {
		g.tailBytes -= len(g.tail[0].GetData())
		g.tail[0] = nil
		g.tail = g.tail[1:]
	}
	return nil
}

func (g *groupLog) setHardState(b *pebble.Batch, hs *pb.HardState) error {
	v := make([]byte, 24)
	binary.BigEndian.PutUint64(v, hs.GetTerm())
	binary.BigEndian.PutUint64(v[8:], hs.GetVote())
	binary.BigEndian.PutUint64(v[16:], hs.GetCommit())
	g.mu.Lock()
	g.hs = proto.Clone(hs).(*pb.HardState)
	g.mu.Unlock()
	return b.Set(groupKey(keyHardState, g.id), v, nil)
}

func truncValue(index, term uint64) []byte {
	v := make([]byte, 16)
	binary.BigEndian.PutUint64(v, index)
	binary.BigEndian.PutUint64(v[8:], term)
	return v
}

// applySnapshot replaces the whole log with the snapshot's position: the
// state machine has already restored the snapshot's data.
func (g *groupLog) applySnapshot(b *pebble.Batch, snap *pb.Snapshot) error {
	md := snap.GetMetadata()
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := b.DeleteRange(entryKey(g.id, 0), entryKey(g.id+1, 0), nil); err != nil {
		return err
	}
	if err := b.Set(groupKey(keyTrunc, g.id), truncValue(md.GetIndex(), md.GetTerm()), nil); err != nil {
		return err
	}
	csb, err := proto.Marshal(md.GetConfState())
	if err != nil {
		return err
	}
	if err := b.Set(groupKey(keyConf, g.id), csb, nil); err != nil {
		return err
	}
	g.truncIndex, g.truncTerm, g.last = md.GetIndex(), md.GetTerm(), md.GetIndex()
	g.cs = proto.Clone(md.GetConfState()).(*pb.ConfState)
	g.tail, g.tailBytes = nil, 0
	return nil
}

// setConfState records the membership after an applied conf change, so a
// restart that resumes after it starts with the right voters.
func (g *groupLog) setConfState(cs *pb.ConfState) error {
	csb, err := proto.Marshal(cs)
	if err != nil {
		return err
	}
	g.mu.Lock()
	g.cs = proto.Clone(cs).(*pb.ConfState)
	g.mu.Unlock()
	return g.store.set(groupKey(keyConf, g.id), csb, pebble.Sync)
}

// compact drops entries up to and including index (the state machine has
// durably applied them and followers have them or will get a snapshot).
func (g *groupLog) compact(index uint64) error {
	g.mu.Lock()
	if index <= g.truncIndex || index > g.last {
		g.mu.Unlock()
		return nil
	}
	var term uint64
	if e := g.tailEntry(index); e != nil {
		term = e.GetTerm()
	} else {
		e, err := g.readEntry(index)
		if err != nil {
			g.mu.Unlock()
			return err
		}
		term = e.GetTerm()
	}
	from := g.truncIndex + 1
	g.mu.Unlock()

	b := g.store.db.NewBatch()
	defer b.Close()
	if err := b.DeleteRange(entryKey(g.id, from), entryKey(g.id, index+1), nil); err != nil {
		return err
	}
	if err := b.Set(groupKey(keyTrunc, g.id), truncValue(index, term), nil); err != nil {
		return err
	}
	// No sync: losing a truncation in a crash only means the entries are
	// truncated again later.
	if err := g.store.commit(b, pebble.NoSync); err != nil {
		return err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if index > g.truncIndex {
		g.truncIndex, g.truncTerm = index, term
		for len(g.tail) > 0 && g.tail[0].GetIndex() <= index {
			g.tailBytes -= len(g.tail[0].GetData())
			g.tail = g.tail[1:]
		}
	}
	return nil
}

func (g *groupLog) bounds() (first, last uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.truncIndex + 1, g.last
}
