package datanode

import (
	"github.com/prometheus/client_golang/prometheus"

	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// containerSM is the state machine of one pipeline (Ozone's
// ContainerStateMachine). Every replica of the pipeline runs one.
//
// WriteChunk: the chunk's data reaches WriteData on every replica before
// the entry is acknowledged there, and goes straight into the block file;
// the log holds only the command. Applying a WriteChunk does nothing more.
// PutBlock: applying it commits the block in storage with BCSID = the
// entry's index, durably: the batch's commits are written without a sync
// each (storage.PutBlockDeferred) and made durable together by one WAL
// flush per volume (storage.SyncCommitsFor) before any entry of the batch
// counts as applied here. So once a PutBlock is applied on all replicas,
// the block is on three disks, and a crash right after Apply returns loses
// none of the batch's commits. If that flush fails, the entries fail and
// their containers are marked UNHEALTHY here.
// PutSmallFile: both in one entry. Its data is the block's only chunk and
// goes through WriteData exactly like a WriteChunk's; applying it commits
// the block exactly like a PutBlock. A replica therefore holds the same
// thing as after the two-entry sequence, and replay, resends (ReadData)
// and lost data behave the same.
//
// The applied index is persisted in a small file, at most every
// persistEvery; the host truncates the log only up to it, and entries
// after it are applied again after a restart (every command is idempotent:
// PutBlock of a committed block is a no-op, close and delete repeat
// harmlessly; a PutBlock, PutSmallFile or WriteChunk replayed into a
// container whose BCSID is at or past it changes nothing, see
// appliedBefore; a deleted container is never replayed into, see
// Datanode.persistOwners). The persisted index never goes backwards
// (persist refuses to), and a snapshot at or below it is ignored. Every
// storage change of an applied entry is durable before the applied index
// (in memory) passes it: block commits by Apply's batch flush, every
// other change (container creation, close, delete, UNHEALTHY marks) when
// it is made. The persisted index therefore only bounds replay; it never
// covers an effect a crash could lose.
//
// The state machine knows which containers are this pipeline's (a second
// small file, written before a container is created): a pipeline snapshot
// lists only those, and restoring one touches only those, never the
// containers of the datanode's other pipelines.
//
// A third small file, <id>.unhealthy, lists the containers of this
// pipeline that this replica does not fully hold (it missed their entries
// by a snapshot, or failed to store an entry's data), with the highest
// snapshot index restored here. It is the durable truth the storage mark
// (UNHEALTHY) is derived from: the storage mark cannot be set on a
// container that does not exist here, nor on a volume that failed, and a
// failed volume comes back after a restart with the container as it was.
// The rule: a replica that lacks data records it here before its applied
// index moves past the entry (Restore fails, and the snapshot is not
// acknowledged, if it cannot; a failure recorded only in memory holds the
// persisted applied index below its entry, so a restart replays the entry
// and finds the loss again). A container in the list is never created
// fresh or closed here, ApplyStatus fails every entry into it, and a
// restart marks it UNHEALTHY in storage again.
type containerSM struct {
	pipeline  uint64
	dataInLog bool            // Config.SmallDataInLog: WriteDataLogged may keep data in the log
	unsynced  []unsyncedChunk // written by WriteData, not yet made durable by SyncData
	store     *storage.Store
	fs        vfs.FS
	file      string // applied index
	contsFile string // this pipeline's containers
	sickFile  string // containers this replica does not fully hold
	log       *slog.Logger
	stats     *stats
	isLeader  func() bool
	// onDeleted, if set, is told the outcome of each delete-blocks entry
	// applied, to acknowledge its transaction to SCM.
	onDeleted func(deleteAck)
	// onUnhealthy, if set, is told a container went UNHEALTHY here (the
	// datanode reports it to SCM in the next heartbeat).
	onUnhealthy func()
	// owner, if set, says which other pipeline holds a container on this
	// datanode (Datanode.ownerError): such a container is never adopted
	// (see owner.go).
	owner func(cid uint64) error
	// applyHook, if set (tests only), runs before each command's apply,
	// inside its guard (applyGuarded).
	applyHook func(raft.Entry, *datanodepb.ContainerCommand)
	// writeHook, readHook and restoreHook, if set (tests only), run
	// inside the guards of WriteData (after the command is decoded),
	// ReadData and Restore (see dataGuard).
	writeHook func(index uint64, cmd *datanodepb.ContainerCommand)
	// storedHook, if set (tests only), runs in WriteData's guard right
	// after storage stored the chunk, before it is listed for SyncData.
	storedHook  func(index uint64)
	syncHook    func()
	readHook    func(index uint64)
	restoreHook func(index uint64)
	// readPanicLog limits ReadData's ERROR lines (see ReadData).
	readPanicLog rateLog
	// restorePanicLog limits Restore's ERROR lines (see Restore).
	restorePanicLog rateLog

	applied atomic.Uint64
	durable atomic.Uint64
	// applyMu is held by Apply for a whole batch, so that applied covers
	// every entry whose effects storage shows (Datanode.persistOwners).
	applyMu sync.Mutex

	// deferred: the block commits of the Apply batch in progress, made
	// durable together at its end (apply goroutine only); pos is the
	// position in the batch of the entry being applied.
	deferred []deferredCommit
	pos      int

	persistMu   sync.Mutex // persist: one writer of file, durable only grows
	lastPersist time.Time
	// now is the clock that paces persisting (at most every persistEvery);
	// nil (the simulator's state machines) paces by entries instead
	// (every persistEveryEntries), so a seed replays exactly.
	now func() time.Time

	// lost records chunks whose data this replica never got (the leader had
	// lost it, or storage refused it); a PutBlock needing them fails here.
	mu         sync.Mutex
	lost       map[blockKey]error // why a chunk of the block is missing
	lostOrder  []blockKey         // oldest first, for the bound
	containers map[uint64]bool
	// failed: entries this replica could not apply (newest
	// maxFailedEntries), so the leader's wait for all replicas can tell
	// "applied" from "applied and failed" (see service.waitAll).
	failed     map[uint64]string
	failedRing []uint64
	// sick: containers of this pipeline this replica does not fully hold
	// (cid → why), with restored, the highest snapshot index restored
	// here; durable in sickFile (see containerSM) unless sickPending is
	// set: then the lowest entry whose loss is recorded only here, and
	// the persisted applied index stays below it.
	sick        map[uint64]string
	restored    uint64
	sickPending uint64

	// decoded hands the command WriteData decoded to the Apply of the
	// same entry (same index and term), so a data entry's command is
	// decoded once per replica instead of twice (issue 15: the decode
	// was a fifth of a small write's allocations here). At most
	// maxDecoded; Apply drops what it has passed.
	decMu   sync.Mutex
	decoded map[uint64]decodedCmd
	// decSwept: the applied index of the last sweep of decoded (a sweep
	// walks the map; at most one per maxDecoded/4 applied entries).
	decSwept uint64
}

type decodedCmd struct {
	term uint64
	cmd  *datanodepb.ContainerCommand
}

// maxDecoded bounds containerSM.decoded (entries written but not yet
// applied; more are simply decoded again by Apply).
const maxDecoded = 4096

// keepDecoded keeps cmd, decoded by WriteData for entry index of term,
// for its Apply. The command is only read from then on.
func (sm *containerSM) keepDecoded(index, term uint64, cmd *datanodepb.ContainerCommand) {
	sm.decMu.Lock()
	defer sm.decMu.Unlock()
	if sm.decoded == nil {
		sm.decoded = map[uint64]decodedCmd{}
	}
	if len(sm.decoded) < maxDecoded {
		sm.decoded[index] = decodedCmd{term, cmd}
	}
}

// takeDecoded returns the command WriteData decoded for e, or decodes
// e.Meta. Commands kept for entries at or below e (replaced, or skipped
// by a snapshot) are dropped on the way.
func (sm *containerSM) takeDecoded(e raft.Entry) (*datanodepb.ContainerCommand, error) {
	if d, ok := sm.takeKept(e.Index); ok && d.term == e.Term {
		return d.cmd, nil
	}
	return decodeCommand(e.Meta)
}

// takeKept removes and returns the command kept for index, if any.
func (sm *containerSM) takeKept(index uint64) (decodedCmd, bool) {
	sm.decMu.Lock()
	defer sm.decMu.Unlock() // panic-safe: Apply's guard recovers (applyGuarded)
	d, ok := sm.decoded[index]
	if ok {
		delete(sm.decoded, index)
	}
	if len(sm.decoded) >= maxDecoded/2 && index >= sm.decSwept+maxDecoded/4 {
		// Many kept: drop those at or below e (their entries were
		// replaced or skipped by a snapshot). Not on every Apply: a
		// follower whose applies run 2,048+ entries behind its writes
		// keeps that many legitimately, and walking them per entry would
		// cost O(n) each.
		sm.decSwept = index
		for i := range sm.decoded {
			if i <= index {
				delete(sm.decoded, i)
			}
		}
	}
	return d, ok
}

// sickRecord is the content of sickFile.
type sickRecord struct {
	Restored   uint64            `json:"restored,omitempty"`
	Containers map[uint64]string `json:"containers"`
}

type blockKey struct{ cid, lid uint64 }

// deferredCommit is a block committed by an entry of the Apply batch in
// progress whose record is not yet durable.
type deferredCommit struct {
	pos   int // in the batch
	index uint64
	cid   storage.ContainerID
}

const (
	persistEvery        = time.Second
	persistEveryEntries = 64
	// maxFailedEntries bounds the failed entries remembered per pipeline. A
	// failure that matters also leaves the container UNHEALTHY, which is
	// durable; the record only names the entry.
	maxFailedEntries = 4096
	// maxLostBlocks bounds the blocks whose missing chunks are remembered.
	maxLostBlocks = 4096
)

type stats struct {
	chunksWritten   atomic.Uint64
	bytesWritten    atomic.Uint64
	blocksCommitted atomic.Uint64
	smallFiles      atomic.Uint64 // blocks committed by PutSmallFile
	applyStatus     atomic.Uint64 // ApplyStatus calls served
	smallBatches    atomic.Uint64 // PutSmallFiles calls with a file to propose
	smallBatchFiles atomic.Uint64 // files those calls proposed
	// smallStage times a PutSmallFiles call's stages on the leader (set
	// with the small-file collectors; nil before).
	smallStage atomic.Pointer[prometheus.HistogramVec]
	bytesRead  atomic.Uint64
	// applyPanics: committed entries whose apply met a runtime error
	// (applyGuarded): a bug, each one left its container UNHEALTHY.
	applyPanics atomic.Uint64
	// writePanics, readPanics, restorePanics: the same in WriteData (the
	// chunk counts as lost here, its container UNHEALTHY), ReadData (the
	// entry goes out without its data) and Restore (the snapshot is
	// refused); see dataGuard.
	writePanics   atomic.Uint64
	syncPanics    atomic.Uint64 // SyncData: the batch's chunks count as lost
	readPanics    atomic.Uint64
	restorePanics atomic.Uint64
}

// NewContainerStateMachine is the state machine of one pipeline's Raft
// group over store (see containerSM), for hosts other than a Datanode
// (the deterministic simulator). Its small files (applied index, the
// pipeline's containers) live in dir on fs. Every replica verifies chunk
// checksums itself, and it reads no clock: the applied index is persisted
// every persistEveryEntries entries.
func NewContainerStateMachine(pipelineID uint64, store *storage.Store, fs vfs.FS, dir string, logger *slog.Logger) (raft.DataStateMachine, error) {
	if logger == nil {
		logger = slog.Default()
	}
	return newContainerSM(pipelineID, store, fs, dir, &stats{}, logger)
}

func newContainerSM(pipeline uint64, store *storage.Store, fs vfs.FS, dir string, st *stats, log *slog.Logger) (*containerSM, error) {
	// Durably: a crash must not take the directory, and the applied
	// index and unhealthy list in it, away after they were synced.
	if err := vfs.MkdirAllSync(fs, dir); err != nil {
		return nil, err
	}
	sm := &containerSM{pipeline: pipeline, store: store, fs: fs,
		file:      filepath.Join(dir, fmt.Sprintf("%d.applied", pipeline)),
		contsFile: filepath.Join(dir, fmt.Sprintf("%d.containers", pipeline)),
		sickFile:  filepath.Join(dir, fmt.Sprintf("%d.unhealthy", pipeline)),
		log:       log, stats: st, lost: map[blockKey]error{}, containers: map[uint64]bool{}, failed: map[uint64]string{},
		sick: map[uint64]string{}}
	b, err := vfs.ReadFile(fs, sm.file)
	switch {
	case err == nil && len(b) == 8:
		sm.applied.Store(binary.BigEndian.Uint64(b))
		sm.durable.Store(binary.BigEndian.Uint64(b))
	case err == nil:
		return nil, fmt.Errorf("datanode: pipeline %d: corrupt applied-index file %s", pipeline, sm.file)
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}
	b, err = vfs.ReadFile(fs, sm.contsFile)
	switch {
	case err == nil:
		var ids []uint64
		if err := json.Unmarshal(b, &ids); err != nil {
			return nil, fmt.Errorf("datanode: pipeline %d: corrupt container list %s: %w", pipeline, sm.contsFile, err)
		}
		for _, id := range ids {
			sm.containers[id] = true
		}
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}
	b, err = vfs.ReadFile(fs, sm.sickFile)
	switch {
	case err == nil:
		var rec sickRecord
		if err := json.Unmarshal(b, &rec); err != nil {
			return nil, fmt.Errorf("datanode: pipeline %d: corrupt unhealthy-container list %s: %w", pipeline, sm.sickFile, err)
		}
		sm.restored = rec.Restored
		maps.Copy(sm.sick, rec.Containers)
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}
	// The storage mark of a listed container may not have stuck (its
	// volume had failed, or the process stopped in between): set it again
	// before any entry is applied. A CLOSED copy is one re-replication put
	// here after the lacking one was deleted, and an absent one was
	// deleted: neither is touched.
	for _, cid := range slices.Sorted(maps.Keys(sm.sick)) {
		rep, err := store.Container(storage.ContainerID(cid))
		if err == nil && (rep.State == storage.StateOpen || rep.State == storage.StateClosing) {
			if err := store.MarkUnhealthy(storage.ContainerID(cid), sm.sick[cid]); err != nil {
				log.Error("cannot mark container UNHEALTHY", "pipeline", pipeline, "container", cid, "why", sm.sick[cid], "err", err)
			}
		}
	}
	return sm, nil
}

// removeFiles deletes the state machine's files (the pipeline is gone).
func (sm *containerSM) removeFiles() {
	for _, f := range []string{sm.file, sm.contsFile, sm.sickFile} {
		if err := sm.fs.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			sm.log.Warn("cannot remove pipeline file", "pipeline", sm.pipeline, "file", f, "err", err)
		}
	}
}

// track records cid as one of this pipeline's containers, durably, before
// the container is created or written through the pipeline.
func (sm *containerSM) track(cids ...uint64) error {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	n := len(sm.containers)
	for _, cid := range cids {
		sm.containers[cid] = true
	}
	if len(sm.containers) == n {
		return nil
	}
	if err := vfs.WriteFileAtomic(sm.fs, sm.contsFile, mustJSON(sm.containerListLocked())); err != nil {
		for _, cid := range cids {
			delete(sm.containers, cid)
		}
		return fmt.Errorf("datanode: pipeline %d: recording containers %v: %w", sm.pipeline, cids, err)
	}
	return nil
}

func (sm *containerSM) containerListLocked() []uint64 {
	ids := make([]uint64, 0, len(sm.containers))
	for id := range sm.containers {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// hasContainer reports whether cid is one of this pipeline's containers.
func (sm *containerSM) hasContainer(cid uint64) bool {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return sm.containers[cid]
}

// recordFailure remembers that this replica failed entry index.
func (sm *containerSM) recordFailure(index uint64, err error) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	if _, ok := sm.failed[index]; ok {
		return
	}
	if len(sm.failedRing) >= maxFailedEntries {
		delete(sm.failed, sm.failedRing[0])
		sm.failedRing = sm.failedRing[1:]
	}
	sm.failed[index] = err.Error()
	sm.failedRing = append(sm.failedRing, index)
}

// failure returns why this replica failed entry index, if it did.
func (sm *containerSM) failure(index uint64) (string, bool) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	why, ok := sm.failed[index]
	return why, ok
}

func decodeCommand(meta []byte) (*datanodepb.ContainerCommand, error) {
	cmd := &datanodepb.ContainerCommand{}
	if err := proto.Unmarshal(meta, cmd); err != nil {
		return nil, fmt.Errorf("datanode: bad container command: %w", err)
	}
	return cmd, nil
}

// ensureContainer creates a container on its first write: SCM allocated
// the ID and the client is writing into it through this pipeline.
// A container this replica does not fully hold is never created fresh:
// it would look healthy without the data it lacks.
func (sm *containerSM) ensureContainer(cid storage.ContainerID) error {
	if why, ok := sm.lacks(uint64(cid)); ok {
		return fmt.Errorf("datanode: pipeline %d: container %d lacks data on this replica (%s): %w", sm.pipeline, cid, why, storage.ErrContainerNotOpen)
	}
	if sm.owner != nil {
		if err := sm.owner(uint64(cid)); err != nil {
			return err // errOtherPipeline: neither tracked nor marked here
		}
	}
	if err := sm.track(uint64(cid)); err != nil {
		return err
	}
	if _, err := sm.store.Container(cid); err == nil {
		return nil
	} else if !errors.Is(err, storage.ErrContainerNotFound) {
		return err
	}
	_, err := sm.store.CreateContainer(cid, storage.CreateOptions{})
	if errors.Is(err, storage.ErrContainerExists) {
		return nil
	}
	return err
}

// dataChunk returns the block and chunk of an entry that carries data: a
// WriteChunk, or a PutSmallFile (its block's only chunk).
func dataChunk(index uint64, cmd *datanodepb.ContainerCommand) (*datanodepb.BlockID, *datanodepb.ChunkInfo, error) {
	switch c := cmd.GetCmd().(type) {
	case *datanodepb.ContainerCommand_WriteChunk:
		return c.WriteChunk.GetBlock(), c.WriteChunk.GetChunk(), nil
	case *datanodepb.ContainerCommand_PutSmallFile:
		b := c.PutSmallFile.GetBlock()
		if len(b.GetChunks()) != 1 {
			// The leader's service refuses these; a log that holds one
			// came from elsewhere.
			return nil, nil, fmt.Errorf("datanode: entry %d: small file block %v has %d chunks, want 1", index, b.GetId(), len(b.GetChunks()))
		}
		return b.GetId(), b.GetChunks()[0], nil
	}
	return nil, nil, fmt.Errorf("datanode: entry %d carries data but is neither a WriteChunk nor a PutSmallFile", index)
}

// WriteData stores a chunk (of a WriteChunk or a PutSmallFile). An error
// here would stop the group on this replica for good (raft cannot
// acknowledge an entry it could not persist), so a chunk that cannot be
// stored is recorded instead, and the replica says so where it counts:
// the PutBlock (or the PutSmallFile's apply) that needs the chunk fails
// here, the failure is recorded for the leader's wait for all replicas
// (service.waitAll asks every replica), and a failure of this replica's
// disk (not of the request itself, which every replica refuses alike)
// marks the container UNHEALTHY at once: it is reported so to SCM and
// takes no more writes here.
func (sm *containerSM) WriteData(index, term uint64, meta, data []byte) error {
	_, err := sm.writeData(index, term, meta, data, false)
	return err
}

// WriteDataLogged is WriteData that lets raft keep the data of a small
// file in its log entry (raft.DataLogger): when storage holds the chunk
// inline and only in memory (storage.SmallChunkPending), the log entry's
// fsync makes the data durable, so SyncData skips it (one volume flush
// less per replica and batch before the append is acknowledged). The
// entry's apply then writes the bytes with the block record and
// SyncCommitsFor makes both durable; after a restart that lost the memory
// copy, the apply stores the chunk again from the log (Entry.Data).
//
// Only with Config.SmallDataInLog; otherwise it is WriteData.
func (sm *containerSM) WriteDataLogged(index, term uint64, meta, data []byte) (bool, error) {
	return sm.writeData(index, term, meta, data, sm.dataInLog)
}

// writeData is WriteData (WriteDataLogged), guarded: a runtime error in
// it (a bug; every replica of the pipeline would meet it alike, and again
// at every restart when the entry is written again) counts as this
// replica's loss of the chunk, as a failed write does (writePanicked),
// instead of taking the datanode down in a crash loop.
func (sm *containerSM) writeData(index, term uint64, meta, data []byte, logOK bool) (inLog bool, err error) {
	var cmd *datanodepb.ContainerCommand
	defer func() {
		if r := recover(); r != nil {
			inLog, err = false, nil
			sm.writePanicked(index, cmd, runtimeError(r))
		}
	}()
	cmd, err = decodeCommand(meta)
	if err == nil && sm.writeHook != nil {
		sm.writeHook(index, cmd)
	}
	return sm.storeData(index, term, cmd, err, data, logOK)
}

// runtimeError returns r, a recovered runtime error, or panics with r
// again: a panic that is not a runtime error (an I/O failure the code
// chose to panic on: the process cannot go on) is never swallowed.
func runtimeError(r any) runtime.Error {
	re, ok := r.(runtime.Error)
	if !ok {
		panic(r)
	}
	return re
}

// writePanicked handles the data of entry index (cmd, nil if its decode
// panicked), whose WriteData met the runtime error re. The chunk may be
// stored here in part, or not at all: it counts as lost (markLost, so
// the PutBlock or PutSmallFile that needs it fails here and says why)
// and its container is marked UNHEALTHY here, durably (as for a failed
// write: SCM sees it, closes it and re-replicates it from the replicas
// that hold it, or reports it MISSING when every replica met the bug),
// unless it is another pipeline's container or the command names none.
// WriteData still returns nil: an error would stop the group here for
// good. One ERROR line with the stack and
// basalt_datanode_apply_panics_total{stage="write_data"} count it.
func (sm *containerSM) writePanicked(index uint64, cmd *datanodepb.ContainerCommand, re runtime.Error) {
	sm.stats.writePanics.Add(1)
	kind := commandKind(cmd)
	cid := storage.ContainerID(commandContainer(cmd))
	blk, _, _ := dataChunk(index, cmd)
	lid := storage.LocalID(blk.GetLocalId())
	sm.log.Error("datanode: entry's data failed in WriteData (a bug: report it); the chunk counts as lost, its container is marked UNHEALTHY here and the pipeline goes on",
		"pipeline", sm.pipeline, "index", index, "command", kind, "container", cid, "block", lid, "panic", re.Error(), "stack", string(debug.Stack()))
	if cid == 0 {
		return // names no container: its apply fails on every replica
	}
	sm.markLost(cid, lid, fmt.Errorf("entry %d: WriteData failed: %v", index, re))
	if sm.owner != nil && sm.owner(uint64(cid)) != nil {
		return // another pipeline's container: never marked from this log
	}
	sm.markUnhealthy(cid, index, fmt.Sprintf("entry %d (%s): chunk of block %d not stored: WriteData failed: %v", index, kind, lid, re))
}

// storeData is writeData after the decode (err: the decode's).
func (sm *containerSM) storeData(index, term uint64, cmd *datanodepb.ContainerCommand, err error, data []byte, logOK bool) (inLog bool, _ error) {
	var blk *datanodepb.BlockID
	var c *datanodepb.ChunkInfo
	if err == nil {
		blk, c, err = dataChunk(index, cmd)
	}
	if err == nil {
		sm.keepDecoded(index, term, cmd)
	}
	if err != nil {
		// The leader validates every request before proposing it, so only a
		// damaged or foreign log holds such an entry. Its apply fails on
		// every replica.
		sm.log.Warn("entry with data that no replica can store", "pipeline", sm.pipeline, "index", index, "err", err)
		return false, nil
	}
	cid := storage.ContainerID(blk.GetContainerId())
	lid := storage.LocalID(blk.GetLocalId())
	if data == nil {
		// A re-delivery of an entry whose data this replica may hold
		// already; if not, the entries that need it fail here.
		if ok, _ := sm.store.HasChunk(cid, lid, int64(c.GetOffset()), int64(c.GetLength())); !ok {
			sm.markLost(cid, lid, fmt.Errorf("entry %d: the leader no longer had the data", index))
		}
		return false, nil
	}
	if err := sm.ensureContainer(cid); err != nil {
		sm.markLost(cid, lid, err)
		if !errors.Is(err, errOtherPipeline) {
			sm.markUnhealthy(cid, index, fmt.Sprintf("entry %d: %v", index, err))
		}
		return false, nil
	}
	// The leader verified the chunk when the client sent it (service.
	// WriteChunk, PutSmallFile) and hands WriteData those same bytes;
	// followers got them over the network and verify.
	verify := sm.isLeader == nil || !sm.isLeader()
	// The entry is acknowledged once SyncData (called by the raft host
	// after the WriteData calls of a batch) has made the chunk durable:
	// one storage Sync per batch instead of one per chunk.
	if _, small := cmd.GetCmd().(*datanodepb.ContainerCommand_PutSmallFile); small && c.GetOffset() == 0 {
		// The block's only chunk: small enough, it is kept inline (no
		// block file; storage/inline.go). Raft never modifies an entry's
		// data (DataStateMachine.WriteData), so storage keeps it without
		// a copy until the commit.
		err = sm.store.WriteSmallChunkShared(cid, lid, data, toChecksum(c.GetChecksum()), verify)
	} else {
		err = sm.store.WriteChunk(cid, lid, int64(c.GetOffset()), data, toChecksum(c.GetChecksum()), verify)
	}
	if err == nil && sm.storedHook != nil {
		sm.storedHook(index)
	}
	if err == nil {
		if _, small := cmd.GetCmd().(*datanodepb.ContainerCommand_PutSmallFile); small && logOK && sm.store.SmallChunkPending(cid, lid) {
			inLog = true // durable with the log entry, see WriteDataLogged
		} else {
			sm.unsynced = append(sm.unsynced, unsyncedChunk{index: index, cid: cid, lid: lid, off: int64(c.GetOffset()), n: int64(len(data))})
		}
	}
	if err != nil {
		sm.markLost(cid, lid, err)
		if !refusedAlike(err) {
			sm.markUnhealthy(cid, index, fmt.Sprintf("entry %d: chunk at %d of block %d not stored: %v", index, c.GetOffset(), lid, err))
		}
		return false, nil
	}
	sm.stats.chunksWritten.Add(1)
	sm.stats.bytesWritten.Add(uint64(len(data)))
	return inLog, nil
}

// unsyncedChunk is a chunk WriteData wrote that SyncData has yet to make
// durable.
type unsyncedChunk struct {
	index  uint64
	cid    storage.ContainerID
	lid    storage.LocalID
	off, n int64
}

// SyncData makes the chunks of the batch's WriteData calls durable with
// one storage Sync (raft.DataSyncer), then checks each: a chunk storage
// dropped (this Sync's round failed, or a concurrent caller's failed round
// forgot it) is this replica's loss, recorded as WriteData records a
// failed write, so the entries that need it fail when applied and the
// container goes UNHEALTHY. It returns nil so the group carries on.
//
// A runtime error in it (a bug; every replica would meet it alike) is
// guarded like WriteData's: every chunk of the batch, checked or not,
// counts as lost here and its container is marked UNHEALTHY (none of them
// can be vouched for durable), it still returns nil, and one ERROR line
// and basalt_datanode_apply_panics_total{stage="sync_data"} count it.
// This covers a runtime error inside storage's sync round too: storage
// finishes the round on the way out (blocks unlocked, the round
// unregistered, its unsynced chunks forgotten; storage.syncRound), so the
// volume's later rounds, and the host's raft loop that waits for them, go
// on. (A panic on a goroutine of storage's own, such as a parallel fsync
// or the deferred-write flusher, is not recovered: the process stops as
// before.)
func (sm *containerSM) SyncData() (err error) {
	if len(sm.unsynced) == 0 {
		return nil
	}
	defer func() {
		if r := recover(); r != nil {
			sm.syncPanicked(runtimeError(r))
			err = nil
		}
	}()
	if sm.syncHook != nil {
		sm.syncHook()
	}
	return sm.syncData()
}

// syncPanicked handles the batch whose SyncData met the runtime error re
// (see SyncData).
func (sm *containerSM) syncPanicked(re runtime.Error) {
	sm.stats.syncPanics.Add(1)
	sm.log.Error("datanode: SyncData failed (a bug: report it); the batch's chunks count as lost, their containers are marked UNHEALTHY here and the pipeline goes on",
		"pipeline", sm.pipeline, "chunks", len(sm.unsynced), "panic", re.Error(), "stack", string(debug.Stack()))
	for _, u := range sm.unsynced {
		sm.markLost(u.cid, u.lid, fmt.Errorf("entry %d: SyncData failed: %v", u.index, re))
		sm.markUnhealthy(u.cid, u.index, fmt.Sprintf("entry %d: chunk at %d of block %d not made durable: SyncData failed: %v", u.index, u.off, u.lid, re))
	}
	sm.unsynced = sm.unsynced[:0]
}

func (sm *containerSM) syncData() error {
	// Only the volumes of the batch's containers: a slow disk elsewhere
	// must not hold this pipeline's log (seed 001).
	cids := make([]storage.ContainerID, 0, 4)
	for _, u := range sm.unsynced {
		if !slices.Contains(cids, u.cid) {
			cids = append(cids, u.cid)
		}
	}
	serr := sm.store.SyncContainers(cids)
	for _, u := range sm.unsynced {
		ok, herr := sm.store.HasChunk(u.cid, u.lid, u.off, u.n)
		if ok && herr == nil {
			continue
		}
		err := serr
		if err == nil {
			err = herr
		}
		if err == nil {
			err = fmt.Errorf("dropped by a failed flush")
		}
		sm.markLost(u.cid, u.lid, err)
		sm.markUnhealthy(u.cid, u.index, fmt.Sprintf("entry %d: chunk at %d of block %d not stored: %v", u.index, u.off, u.lid, err))
	}
	sm.unsynced = sm.unsynced[:0]
	return nil
}

// refusedAlike reports whether storage refused a write or commit for what
// the request is (too large, malformed, into a closed container): every
// replica refuses it the same way, so it says nothing about this
// replica's health. Anything else (a full or failed disk, data damaged on
// the way here, a local limit) is this replica's failure.
func refusedAlike(err error) bool {
	for _, k := range []error{storage.ErrChunkTooLarge, storage.ErrBlockTooLarge, storage.ErrBadChecksum,
		storage.ErrInvalidArgument, storage.ErrBadBlockData, storage.ErrChunkOverlap, storage.ErrChunkOutOfOrder,
		storage.ErrContainerNotOpen, storage.ErrContainerFull, storage.ErrOutOfRange} {
		if errors.Is(err, k) {
			return true
		}
	}
	return false
}

// markLost remembers why a chunk of a block is not stored here, to name
// the cause when an entry that needs it fails. Storage keeps the durable
// truth (HasChunk; PutBlock refuses a missing chunk with ErrChunkMissing,
// also after a restart), so this is only an annotation, and bounded.
func (sm *containerSM) markLost(cid storage.ContainerID, lid storage.LocalID, err error) {
	sm.log.Warn("chunk not stored on this replica", "pipeline", sm.pipeline, "container", cid, "block", lid, "err", err)
	k := blockKey{uint64(cid), uint64(lid)}
	sm.mu.Lock()
	defer sm.mu.Unlock()
	if _, ok := sm.lost[k]; !ok {
		if len(sm.lostOrder) >= maxLostBlocks {
			delete(sm.lost, sm.lostOrder[0])
			sm.lostOrder = sm.lostOrder[1:]
		}
		sm.lostOrder = append(sm.lostOrder, k)
	}
	sm.lost[k] = err
}

// markUnhealthy records that this replica of cid lacks data the pipeline
// has, from entry index on (the snapshot index for a restore): durably in
// sickFile first (see containerSM; if that write fails, the persisted
// applied index stays below index until a later write succeeds), then in
// storage, creating the container UNHEALTHY if it does not exist here; the
// heartbeat reports it to SCM, and the container takes no more writes
// here.
func (sm *containerSM) markUnhealthy(cid storage.ContainerID, index uint64, why string) {
	sm.recordSick(cid, index, why)
	sm.markStorage(cid, why, true)
	if sm.onUnhealthy != nil {
		sm.onUnhealthy()
	}
}

// recordSick records cid in sickFile (markUnhealthy).
func (sm *containerSM) recordSick(cid storage.ContainerID, index uint64, why string) {
	sm.mu.Lock()
	defer sm.mu.Unlock() // panic-safe: the guards recover (applyGuarded, writeData)
	if _, ok := sm.sick[uint64(cid)]; ok && sm.sickPending == 0 {
		return
	} else if !ok {
		sm.sick[uint64(cid)] = why
	}
	if err := sm.saveSickLocked(); err != nil {
		sm.log.Error("cannot record container UNHEALTHY; applied index held below the entry", "pipeline", sm.pipeline, "container", cid, "index", index, "err", err)
		if sm.sickPending == 0 || index < sm.sickPending {
			sm.sickPending = index
		}
	} else {
		sm.sickPending = 0
	}
}

// markStorage sets the storage mark of a container this replica lacks
// data of, creating it UNHEALTHY if create and it does not exist (so the
// heartbeat reports it and SCM stops allocating into it). The durable
// record is sickFile; this is best effort.
func (sm *containerSM) markStorage(cid storage.ContainerID, why string, create bool) {
	err := sm.store.MarkUnhealthy(cid, why)
	if errors.Is(err, storage.ErrContainerNotFound) && create {
		if _, err = sm.store.CreateContainer(cid, storage.CreateOptions{}); err == nil || errors.Is(err, storage.ErrContainerExists) {
			err = sm.store.MarkUnhealthy(cid, why)
		}
	}
	// A container on a failed volume is reported UNHEALTHY already.
	if err != nil && !errors.Is(err, storage.ErrVolumeFailed) {
		sm.log.Error("cannot mark container UNHEALTHY in storage", "pipeline", sm.pipeline, "container", cid, "why", why, "err", err)
	}
}

// savePending saves a loss recorded only in memory (sickPending) and
// returns index, or, if that fails, the highest index that may be
// persisted (below the entry that found the loss).
func (sm *containerSM) savePending(index uint64) uint64 {
	sm.mu.Lock()
	defer sm.mu.Unlock() // panic-safe: Restore's guard recovers
	if sm.sickPending != 0 {
		if err := sm.saveSickLocked(); err == nil {
			sm.sickPending = 0
		} else if index >= sm.sickPending {
			index = sm.sickPending - 1
		}
	}
	return index
}

// saveSickLocked writes sickFile. Caller holds mu.
func (sm *containerSM) saveSickLocked() error {
	b := mustJSON(sickRecord{Restored: sm.restored, Containers: sm.sick})
	if err := vfs.WriteFileAtomic(sm.fs, sm.sickFile, b); err != nil {
		return fmt.Errorf("datanode: pipeline %d: recording unhealthy containers: %w", sm.pipeline, err)
	}
	return nil
}

// lacks reports whether this replica does not fully hold cid, and why.
func (sm *containerSM) lacks(cid uint64) (string, bool) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	why, ok := sm.sick[cid]
	return why, ok
}

// restoredIndex is the highest snapshot index restored here.
func (sm *containerSM) restoredIndex() uint64 {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return sm.restored
}

func (sm *containerSM) lostCause(cid, lid uint64) error {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return sm.lost[blockKey{cid, lid}]
}

// ReadData reads a chunk back for a resend to a follower. Whatever stops
// it (an entry no replica could store, a chunk this replica never stored,
// a failed disk) is reported as raft.ErrDataLost: the entry then goes out
// without its data and the follower records the loss, instead of the
// leader retrying the read forever and the pipeline never moving past the
// entry.
//
// A runtime error in it (a bug) is reported so too (the follower records
// the chunk lost, and the leader keeps serving) and counted, every one
// (basalt_datanode_apply_panics_total{stage="read_data"}): it never takes
// the leader's datanode down. Nothing is marked here: a read changes
// nothing. It is logged as ERROR with the stack at most once a minute per
// pipeline (the line says how many were not logged since the last): a
// resend reads each entry it carries, for each lagging follower, so a bug
// met on every read would flood the log with stacks.
func (sm *containerSM) ReadData(index, term uint64, meta []byte) (data []byte, err error) {
	defer func() {
		if r := recover(); r != nil {
			re := runtimeError(r)
			sm.stats.readPanics.Add(1)
			if ok, quiet := sm.readPanicLog.allow(time.Now()); ok {
				sm.log.Error("datanode: ReadData failed (a bug: report it); the entry goes out without its data",
					"pipeline", sm.pipeline, "index", index, "panic", re.Error(), "not_logged_since_last", quiet, "stack", string(debug.Stack()))
			}
			data, err = nil, fmt.Errorf("%w: entry %d: ReadData failed: %v", raft.ErrDataLost, index, re)
		}
	}()
	if sm.readHook != nil {
		sm.readHook(index)
	}
	return sm.readData(index, meta)
}

// rateLog lets one log line through per rateLogEvery and counts the
// others; safe for concurrent use.
type rateLog struct {
	at    atomic.Int64  // UnixNano of the last line let through; 0: none yet
	quiet atomic.Uint64 // lines held back since
}

const rateLogEvery = time.Minute

// allow reports whether a line may be logged at now, and if so how many
// were held back since the last one.
func (l *rateLog) allow(now time.Time) (ok bool, quiet uint64) {
	last, t := l.at.Load(), now.UnixNano()
	if (last == 0 || t-last >= int64(rateLogEvery)) && l.at.CompareAndSwap(last, t) {
		return true, l.quiet.Swap(0)
	}
	l.quiet.Add(1)
	return false, 0
}

func (sm *containerSM) readData(index uint64, meta []byte) ([]byte, error) {
	cmd, err := decodeCommand(meta)
	if err != nil {
		return nil, fmt.Errorf("%w: entry %d: %v", raft.ErrDataLost, index, err)
	}
	blk, c, err := dataChunk(index, cmd)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", raft.ErrDataLost, err)
	}
	cid := storage.ContainerID(blk.GetContainerId())
	lid := storage.LocalID(blk.GetLocalId())
	data, err := sm.store.ReadWritten(cid, lid, int64(c.GetOffset()), int64(c.GetLength()), toChecksum(c.GetChecksum()))
	if err != nil {
		if lost := sm.lostCause(uint64(cid), uint64(lid)); lost != nil {
			err = fmt.Errorf("%v (earlier: %v)", err, lost)
		}
		return nil, fmt.Errorf("%w: entry %d: %v", raft.ErrDataLost, index, err)
	}
	return data, nil
}

// Apply applies committed entries. An entry this replica cannot apply
// fails alone (its result is the error, and it is recorded for the
// leader's wait for all replicas); the entries after it still apply, so
// one bad entry never wedges the pipeline.
func (sm *containerSM) Apply(ents []raft.Entry) []any {
	sm.applyMu.Lock()
	defer sm.applyMu.Unlock()
	out := make([]any, len(ents))
	applied := sm.applied.Load()
	for i, e := range ents {
		if e.Index <= applied {
			// Invariant: the applied index only grows. The host never
			// hands an entry twice; a repeat would be a no-op anyway.
			sm.log.Error("entry at or below the applied index; not applied again", "pipeline", sm.pipeline, "index", e.Index, "applied", applied)
			continue
		}
		applied = e.Index
		if e.Kind != raft.EntryNormal {
			continue
		}
		sm.pos = i
		if err := sm.applyGuarded(e, nil); err != nil {
			sm.recordFailure(e.Index, err)
			out[i] = err
		}
	}
	// Block commits were deferred (storage.PutBlockDeferred): one WAL
	// flush makes the whole batch durable before any entry of it counts
	// as applied here, and pipelines that share a volume share flushes.
	// Only the volumes of the batch's containers are flushed: a slow or
	// failed disk elsewhere on the datanode neither delays nor fails it.
	if len(sm.deferred) > 0 {
		var cids []storage.ContainerID
		for _, d := range sm.deferred {
			if !slices.Contains(cids, d.cid) {
				cids = append(cids, d.cid)
			}
		}
		if err := sm.store.SyncCommitsFor(cids); err != nil {
			// Which containers' volumes failed: asking again per
			// container costs nothing for a volume synced just now.
			bad := map[storage.ContainerID]error{}
			for _, cid := range cids {
				if len(cids) == 1 {
					bad[cid] = err
				} else if cerr := sm.store.SyncCommitsFor([]storage.ContainerID{cid}); cerr != nil {
					bad[cid] = cerr
				}
			}
			for _, d := range sm.deferred {
				serr, ok := bad[d.cid]
				if !ok {
					continue
				}
				sm.markUnhealthy(d.cid, d.index, fmt.Sprintf("entry %d: block commit not synced: %v", d.index, serr))
				err := fmt.Errorf("datanode: pipeline %d entry %d: block commit not synced: %w", sm.pipeline, d.index, serr)
				sm.recordFailure(d.index, err)
				out[d.pos] = err
			}
		}
		sm.deferred = sm.deferred[:0]
	}
	sm.applied.Store(applied)
	sm.persistMu.Lock()
	var due bool
	if sm.now != nil {
		due = sm.now().Sub(sm.lastPersist) >= persistEvery
	} else {
		due = applied >= sm.durable.Load()+persistEveryEntries
	}
	sm.persistMu.Unlock()
	if due {
		sm.persist(applied)
	}
	return out
}

// applyGuarded is apply, turning a runtime error (a nil message, an index
// out of range: what the committed command's content causes, so every
// replica of the pipeline meets it the same way, and again at every
// restart when the entry replays) into a failure of that entry alone,
// instead of a panic that takes every datanode of the pipeline down in a
// crash loop. See applyPanicked for what the replica then does. Other
// panics (an I/O failure the code chose to panic on: the process cannot
// go on) go on up.
//
// cmd is e's command; nil: taken from WriteData or decoded here, inside
// the guard.
func (sm *containerSM) applyGuarded(e raft.Entry, cmd *datanodepb.ContainerCommand) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = sm.applyPanicked(e, cmd, runtimeError(r))
		}
	}()
	if cmd == nil {
		if cmd, err = sm.takeDecoded(e); err != nil {
			return err
		}
	}
	if sm.applyHook != nil {
		sm.applyHook(e, cmd)
	}
	return sm.apply(e, cmd)
}

// applyPanicked handles entry e, whose apply met the runtime error re.
// The command may have changed part of its container here before it
// failed, so this replica can no longer vouch for that container: it is
// marked UNHEALTHY with the reason, durably (markUnhealthy, as for an
// entry whose data this replica lacks: SCM sees it in the next heartbeat,
// closes the container and re-replicates it, or reports it MISSING when
// every replica met the same bug), unless it is another pipeline's
// container (never touched from this log) or the command names none.
// The entry fails (its waiter gets the error, ApplyStatus reports it),
// the apply goes on with the next entries, so every replica does the
// same and stays in step. One ERROR line (with the stack, to fix the bug) and
// basalt_datanode_apply_panics_total count it.
func (sm *containerSM) applyPanicked(e raft.Entry, cmd *datanodepb.ContainerCommand, re runtime.Error) error {
	sm.stats.applyPanics.Add(1)
	kind := commandKind(cmd)
	cid := storage.ContainerID(commandContainer(cmd))
	sm.log.Error("datanode: committed entry failed in apply (a bug: report it); its container is marked UNHEALTHY here and the pipeline goes on",
		"pipeline", sm.pipeline, "index", e.Index, "command", kind, "container", cid, "panic", re.Error(), "stack", string(debug.Stack()))
	err := fmt.Errorf("datanode: pipeline %d entry %d (%s, container %d) failed in apply: %v: %w", sm.pipeline, e.Index, kind, cid, re, storage.ErrContainerNotOpen)
	if cid == 0 {
		return err // names no container (0 is never one: SCM's "all")
	}
	if sm.owner != nil {
		if oerr := sm.owner(uint64(cid)); oerr != nil {
			return fmt.Errorf("%w (%v)", err, oerr)
		}
	}
	sm.markUnhealthy(cid, e.Index, fmt.Sprintf("entry %d (%s) failed in apply: %v", e.Index, kind, re))
	return err
}

// applyCollectors count the committed entries whose apply met a runtime
// error (applyGuarded), on every pipeline of d.
// Its stage label says where: apply (the entry failed, its container
// UNHEALTHY here), write_data (the entry's chunk counts as lost here, its
// container UNHEALTHY), sync_data (the same for every chunk of the
// batch), read_data (a resend went out without its data),
// restore (a snapshot install was refused).
func (d *Datanode) applyCollectors() []prometheus.Collector {
	var cs []prometheus.Collector
	for _, s := range []struct {
		stage string
		n     *atomic.Uint64
	}{{"apply", &d.stats.applyPanics}, {"write_data", &d.stats.writePanics}, {"sync_data", &d.stats.syncPanics}, {"read_data", &d.stats.readPanics}, {"restore", &d.stats.restorePanics}} {
		cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "apply_panics_total",
			Help:        "Pipeline entries whose apply (or data write, data sync, data read, snapshot install) met a runtime error (a bug), by stage; each was failed instead of crashing the datanode (apply, write_data, sync_data: the container is UNHEALTHY here).",
			ConstLabels: prometheus.Labels{"stage": s.stage}},
			func() float64 { return float64(s.n.Load()) }))
	}
	return cs
}

// commandKind names cmd's command type (logs, errors).
func commandKind(cmd *datanodepb.ContainerCommand) string {
	switch cmd.GetCmd().(type) {
	case *datanodepb.ContainerCommand_WriteChunk:
		return "WriteChunk"
	case *datanodepb.ContainerCommand_PutBlock:
		return "PutBlock"
	case *datanodepb.ContainerCommand_PutSmallFile:
		return "PutSmallFile"
	case *datanodepb.ContainerCommand_CloseContainer:
		return "CloseContainer"
	case *datanodepb.ContainerCommand_DeleteBlocks:
		return "DeleteBlocks"
	}
	return "none"
}

// commandContainer is the container cmd writes into (0 if none).
func commandContainer(cmd *datanodepb.ContainerCommand) uint64 {
	switch c := cmd.GetCmd().(type) {
	case *datanodepb.ContainerCommand_WriteChunk:
		return c.WriteChunk.GetBlock().GetContainerId()
	case *datanodepb.ContainerCommand_PutBlock:
		return c.PutBlock.GetBlock().GetId().GetContainerId()
	case *datanodepb.ContainerCommand_PutSmallFile:
		return c.PutSmallFile.GetBlock().GetId().GetContainerId()
	case *datanodepb.ContainerCommand_CloseContainer:
		return c.CloseContainer.GetContainerId()
	case *datanodepb.ContainerCommand_DeleteBlocks:
		return c.DeleteBlocks.GetContainerId()
	}
	return 0
}

func (sm *containerSM) apply(e raft.Entry, cmd *datanodepb.ContainerCommand) error {
	switch c := cmd.GetCmd().(type) {
	case *datanodepb.ContainerCommand_WriteChunk:
		// The entry succeeds here only if the chunk is stored here: storage
		// knows durably (HasChunk, also after a restart); the lost record
		// only says why not.
		blk, ch := c.WriteChunk.GetBlock(), c.WriteChunk.GetChunk()
		ok, err := sm.store.HasChunk(storage.ContainerID(blk.GetContainerId()), storage.LocalID(blk.GetLocalId()), int64(ch.GetOffset()), int64(ch.GetLength()))
		if err == nil && !ok && sm.appliedBefore(storage.ContainerID(blk.GetContainerId()), e.Index) {
			return nil // replayed after its block was committed and deleted
		}
		if err == nil && !ok {
			err = fmt.Errorf("chunk [%d, +%d) not stored on this replica: %w", ch.GetOffset(), ch.GetLength(), storage.ErrChunkMissing)
			if lost := sm.lostCause(blk.GetContainerId(), blk.GetLocalId()); lost != nil {
				err = fmt.Errorf("%w (earlier: %v)", err, lost)
			}
		}
		if err != nil {
			return fmt.Errorf("datanode: pipeline %d entry %d: container %d block %d: %w", sm.pipeline, e.Index, blk.GetContainerId(), blk.GetLocalId(), err)
		}
		return nil
	case *datanodepb.ContainerCommand_PutBlock:
		return sm.commitBlock(e.Index, c.PutBlock.GetBlock(), c.PutBlock.GetCloseContainer())
	case *datanodepb.ContainerCommand_PutSmallFile:
		// WriteData put the chunk in the block file before this entry was
		// acknowledged here, or kept it in memory with its bytes in the log
		// entry (WriteDataLogged); committing it is a PutBlock.
		if e.Data != nil {
			sm.restoreLogged(e, c.PutSmallFile.GetBlock())
		}
		if err := sm.commitBlock(e.Index, c.PutSmallFile.GetBlock(), false); err != nil {
			return err
		}
		sm.stats.smallFiles.Add(1)
		return nil
	case *datanodepb.ContainerCommand_CloseContainer:
		return sm.closeContainer(storage.ContainerID(c.CloseContainer.GetContainerId()))
	case *datanodepb.ContainerCommand_DeleteBlocks:
		del := c.DeleteBlocks
		lids := make([]storage.LocalID, len(del.GetLocalIds()))
		for i, l := range del.GetLocalIds() {
			lids[i] = storage.LocalID(l)
		}
		err := deleteBlocks(sm.store, storage.ContainerID(del.GetContainerId()), lids)
		a := deleteOutcome(del.GetTxId(), del.GetContainerId(), err)
		if a != nil && del.GetTxId() != 0 && sm.onDeleted != nil {
			sm.onDeleted(*a)
		}
		if a != nil {
			return nil // done, or can never be done here (acknowledged so)
		}
		return err
	default:
		return fmt.Errorf("datanode: unknown container command at %d", e.Index)
	}
}

// restoreLogged stores again, from the log entry, the chunk of a
// PutSmallFile whose data the log kept (WriteDataLogged) when this replica
// no longer holds it: a restart between the entry's append (durable with
// the data in the log) and its apply lost the memory copy. A chunk this
// replica holds, one recorded lost here (its entry fails as before) and an
// entry applied before the restart are left alone.
func (sm *containerSM) restoreLogged(e raft.Entry, b *datanodepb.BlockData) {
	cid := storage.ContainerID(b.GetId().GetContainerId())
	lid := storage.LocalID(b.GetId().GetLocalId())
	chunks := b.GetChunks()
	if len(chunks) != 1 || chunks[0].GetOffset() != 0 || uint64(len(e.Data)) != chunks[0].GetLength() {
		return
	}
	if ok, err := sm.store.HasChunk(cid, lid, 0, int64(len(e.Data))); err == nil && ok {
		return
	}
	if sm.lostCause(uint64(cid), uint64(lid)) != nil || sm.appliedBefore(cid, e.Index) {
		return
	}
	if err := sm.ensureContainer(cid); err != nil {
		return // commitBlock fails the entry and says why
	}
	if err := sm.store.WriteSmallChunkShared(cid, lid, e.Data, toChecksum(chunks[0].GetChecksum()), true); err != nil {
		sm.markLost(cid, lid, fmt.Errorf("entry %d: chunk not stored again from the log: %w", e.Index, err))
		return
	}
	sm.log.Info("small file stored again from the log", "pipeline", sm.pipeline, "index", e.Index, "container", cid, "block", lid)
}

// commitBlock applies a PutBlock (or the commit half of a PutSmallFile)
// at log index: the block is committed with BCSID = index, durably once
// Apply's batch flush returns.
func (sm *containerSM) commitBlock(index uint64, b *datanodepb.BlockData, closeContainer bool) error {
	cid := storage.ContainerID(b.GetId().GetContainerId())
	bd := toBlockData(b)
	bd.BCSID = index
	if sm.appliedBefore(cid, index) {
		// A replay after a restart: this commit is durable already, and
		// what later entries did to the block (a delete) or the container
		// (a close) may be too; committing again would fail or undo them.
		// The close half of the entry is synced on its own: do it again.
		if closeContainer {
			return sm.closeContainer(cid)
		}
		return nil
	}
	if err := sm.ensureContainer(cid); err != nil {
		if errors.Is(err, errOtherPipeline) {
			// Another pipeline's container: this entry fails here and
			// changes nothing (no BCSID from this log, no UNHEALTHY mark).
			return fmt.Errorf("datanode: pipeline %d entry %d: %w", sm.pipeline, index, err)
		}
		sm.markUnhealthy(cid, index, fmt.Sprintf("entry %d: %v", index, err))
		return err
	}
	if err := sm.store.PutBlockDeferred(cid, bd); err != nil {
		if refusedAlike(err) {
			return err // refused on every replica: the block fails everywhere
		}
		// Storage refuses a block whose chunks are not durably here
		// (ErrChunkMissing: never stored, lost in a crash before its sync,
		// the leader no longer had the data). The other replicas may hold
		// it: this replica is the one that failed.
		if lost := sm.lostCause(uint64(cid), uint64(bd.LocalID)); lost != nil {
			err = fmt.Errorf("%w (earlier: %v)", err, lost)
		}
		sm.markUnhealthy(cid, index, fmt.Sprintf("entry %d: block %d not committed here: %v", index, bd.LocalID, err))
		return fmt.Errorf("datanode: pipeline %d entry %d: %w; container %d is UNHEALTHY here: %w", sm.pipeline, index, err, cid, storage.ErrContainerNotOpen)
	}
	sm.deferred = append(sm.deferred, deferredCommit{pos: sm.pos, index: index, cid: cid})
	sm.stats.blocksCommitted.Add(1)
	if closeContainer {
		sm.closeContainer(cid)
	}
	return nil
}

// appliedBefore reports whether the entry at index, which writes into
// cid, was applied here before a restart and its effects are durable: the
// container's highest commit index (BCSID, in the counters every commit
// batch writes, and DeleteBlocks rewrites) is at or past it. Entries are
// applied in log order, so outside a replay a container's BCSID is always
// below the entry being applied (a container imported from a replica
// further along holds the entry's effects too). The storage WAL is
// sequential, so a durable BCSID at or past index means this entry's
// commit is durable, and what the block lacks now a later entry removed.
// A commit that failed here marked the container UNHEALTHY, in memory at
// once, so no later commit could raise its BCSID past the failed entry.
func (sm *containerSM) appliedBefore(cid storage.ContainerID, index uint64) bool {
	rep, err := sm.store.Container(cid)
	return err == nil && rep.BCSID >= index
}

func (sm *containerSM) closeContainer(cid storage.ContainerID) error {
	if why, ok := sm.lacks(uint64(cid)); ok {
		// Closed, it would be reported as a whole replica.
		if rep, err := sm.store.Container(cid); err == nil && rep.State == storage.StateClosed {
			return nil
		}
		sm.markStorage(cid, why, false)
		return fmt.Errorf("datanode: pipeline %d: container %d not closed: it lacks data on this replica (%s): %w", sm.pipeline, cid, why, storage.ErrContainerNotOpen)
	}
	err := sm.store.CloseContainer(cid)
	if errors.Is(err, storage.ErrContainerNotFound) {
		return nil // never written here: nothing to close
	}
	if err != nil {
		// Already closed is fine: closing is idempotent.
		if rep, rerr := sm.store.Container(cid); rerr == nil && rep.State == storage.StateClosed {
			return nil
		}
	}
	return err
}

// persist writes the applied index durably. Apply made every applied
// entry's storage changes durable already (block commits by its batch
// flush, everything else when it was made), so the index only needs to
// be as durable as what it covers: it bounds replay, and the host
// truncates the log only up to it (AppliedIndex). A loss recorded only in
// memory (sickPending) is saved first, or the index stays below the
// entry that found it. It never writes a lower index than one already
// durable (Close, the apply goroutine, leaving a pipeline and deleting a
// container may all call it). It returns an error if the durable index
// is below index afterwards (leaving a pipeline or deleting a container
// must not go on then).
func (sm *containerSM) persist(index uint64) error {
	sm.persistMu.Lock()
	defer sm.persistMu.Unlock()
	sm.persistLocked(index)
	if d := sm.durable.Load(); d < index {
		return fmt.Errorf("datanode: pipeline %d: applied index %d not persisted (durable %d)", sm.pipeline, index, d)
	}
	return nil
}

func (sm *containerSM) persistLocked(index uint64) {
	if sm.now != nil {
		sm.lastPersist = sm.now()
	}
	// A loss recorded only in memory: record it now, or keep the entry
	// that found it above the persisted index, so a restart finds it again.
	asked := index
	index = sm.savePending(index)
	if d := sm.durable.Load(); index <= d {
		if asked < d {
			sm.log.Error("applied index would go backwards; not persisted", "pipeline", sm.pipeline, "index", asked, "durable", d)
		}
		return
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], index)
	if err := vfs.WriteFileAtomic(sm.fs, sm.file, b[:]); err != nil {
		sm.log.Warn("cannot persist applied index", "pipeline", sm.pipeline, "err", err)
		return
	}
	sm.durable.Store(index)
}

func (sm *containerSM) AppliedIndex() uint64 { return sm.durable.Load() }

// A pipeline snapshot carries the applied index and this pipeline's
// containers, not their data: a replica that needs a snapshot has missed
// chunks, and those containers are repaired by re-replication of closed
// containers (Ozone does the same), not through the Raft log.
type smSnapshot struct {
	Index uint64 `json:"index"`
	// Pipeline is the group the snapshot belongs to (0 in snapshots from
	// datanodes that listed every container they held: their list is not
	// trusted).
	Pipeline   uint64   `json:"pipeline,omitempty"`
	Containers []uint64 `json:"containers"`
}

func (sm *containerSM) Snapshot() (uint64, io.ReadCloser, error) {
	idx := sm.applied.Load()
	sm.mu.Lock()
	snap := smSnapshot{Index: idx, Pipeline: sm.pipeline, Containers: sm.containerListLocked()}
	sm.mu.Unlock()
	b, err := json.Marshal(snap)
	if err != nil {
		return 0, nil, err
	}
	return idx, io.NopCloser(bytesReader(b)), nil
}

// Restore catches this replica up to index without the entries before it.
// Every container of this pipeline that this replica does not fully hold
// then lacks what those entries wrote: the OPEN and CLOSING ones here, and
// the ones the snapshot (or this replica's own list) names that do not
// exist here at all. They are recorded in sickFile, durably, before the
// restore returns (if that fails, so does the restore, and the snapshot is
// not acknowledged), then the ones here are marked UNHEALTHY in storage
// (an absent one is created UNHEALTHY by the first entry into it);
// ApplyStatus fails the entries the snapshot covers for a container that
// is not CLOSED here. A CLOSED container here was closed by
// an entry this replica applied, after all its writes: it is whole. No
// other pipeline's container is touched. A snapshot at or below the
// applied index is ignored: the applied index never goes backwards.
//
// A runtime error in it (a bug) refuses the snapshot instead of taking
// the datanode down: the error goes back to raft (the snapshot is not
// acknowledged; the leader sends it again later), an ERROR line with the
// stack (at most once a minute per pipeline, naming how many were not
// logged since the last) and basalt_datanode_apply_panics_total{stage="restore"}
// (every one) report it,
// and the state stays as before, or with more containers recorded as
// lacking (never fewer): the applied index does not move, so this
// replica applies nothing past what it holds.
func (sm *containerSM) Restore(index uint64, r io.Reader) (err error) {
	defer func() {
		if p := recover(); p != nil {
			re := runtimeError(p)
			sm.stats.restorePanics.Add(1)
			// The leader sends the snapshot again and again while this
			// replica lags: a bug met on every install would flood the
			// log with stacks (as ReadData's resends could).
			if ok, quiet := sm.restorePanicLog.allow(time.Now()); ok {
				sm.log.Error("datanode: snapshot install failed (a bug: report it); the snapshot is refused",
					"pipeline", sm.pipeline, "snapshot", index, "panic", re.Error(), "not_logged_since_last", quiet, "stack", string(debug.Stack()))
			}
			err = fmt.Errorf("datanode: pipeline %d: snapshot at %d failed to install: %v", sm.pipeline, index, re)
		}
	}()
	return sm.restore(index, r)
}

func (sm *containerSM) restore(index uint64, r io.Reader) error {
	var snap smSnapshot
	if err := json.NewDecoder(io.LimitReader(r, maxSnapshotBytes)).Decode(&snap); err != nil {
		return fmt.Errorf("datanode: pipeline %d: bad snapshot: %w", sm.pipeline, err)
	}
	if snap.Index != index {
		return fmt.Errorf("datanode: pipeline %d: snapshot says index %d, raft says %d", sm.pipeline, snap.Index, index)
	}
	if snap.Pipeline != 0 && snap.Pipeline != sm.pipeline {
		return fmt.Errorf("datanode: pipeline %d: snapshot of pipeline %d", sm.pipeline, snap.Pipeline)
	}
	if applied := sm.applied.Load(); index <= applied {
		sm.log.Warn("snapshot not newer than the applied index; ignored", "pipeline", sm.pipeline, "snapshot", index, "applied", applied)
		return nil
	}
	if snap.Pipeline == sm.pipeline && len(snap.Containers) > 0 {
		if err := sm.track(snap.Containers...); err != nil {
			return err
		}
	}
	mark, err := sm.recordRestore(index)
	if err != nil {
		return err
	}
	for _, cid := range mark {
		if why, ok := sm.lacks(cid); ok {
			// An absent one is not created here: it may be a container
			// deleted since (the list keeps every container the pipeline
			// wrote). The first entry that writes into it creates it
			// UNHEALTHY (markUnhealthy), so it is reported then.
			sm.markStorage(storage.ContainerID(cid), why, false)
		}
	}
	if sm.onUnhealthy != nil && len(mark) > 0 {
		sm.onUnhealthy()
	}
	sm.applied.Store(index)
	sm.persist(index)
	return nil
}

// recordRestore records in sickFile, durably, every container of this
// pipeline not CLOSED here, with index as the highest snapshot restored,
// and returns those that exist here (to mark in storage). If it fails (or
// panics: the lock is released and the memory state rolled back), nothing
// changed in memory.
func (sm *containerSM) recordRestore(index uint64) (mark []uint64, _ error) {
	why := fmt.Sprintf("pipeline %d caught up by snapshot at %d", sm.pipeline, index)
	sm.mu.Lock()
	added := map[uint64]bool{}
	prevRestored := sm.restored
	done := false
	defer func() {
		if !done {
			// Nothing changed: the old state stays, the snapshot is refused.
			for cid := range added {
				delete(sm.sick, cid)
			}
			sm.restored = prevRestored
		}
		sm.mu.Unlock()
	}()
	for _, cid := range sm.containerListLocked() {
		rep, err := sm.store.Container(storage.ContainerID(cid))
		if err == nil && rep.State == storage.StateClosed {
			continue
		}
		if err == nil {
			mark = append(mark, cid)
		}
		if _, ok := sm.sick[cid]; !ok {
			sm.sick[cid] = why
			added[cid] = true
		}
	}
	sm.restored = index
	if sm.restoreHook != nil {
		sm.restoreHook(index) // tests: a panic while mu is held
	}
	if err := sm.saveSickLocked(); err != nil {
		return nil, err
	}
	sm.sickPending = 0
	done = true
	return mark, nil
}

// maxSnapshotBytes bounds what Restore reads: an index and a list of
// container IDs.
const maxSnapshotBytes = 16 << 20
