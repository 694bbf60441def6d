package datanode

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// containerSM is the state machine of one pipeline (Ozone's
// ContainerStateMachine). Every replica of the pipeline runs one.
//
// WriteChunk: the chunk's data reaches WriteData on every replica before
// the entry is acknowledged there, and goes straight into the block file;
// the log holds only the command. Applying a WriteChunk does nothing more.
// PutBlock: applying it commits the block in storage with BCSID = the
// entry's index, durably (storage syncs on commit). So once a PutBlock is
// applied on all replicas, the block is on three disks.
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
// harmlessly).
type containerSM struct {
	pipeline uint64
	store    *storage.Store
	file     string // applied index
	log      *slog.Logger
	stats    *stats
	isLeader func() bool

	applied     atomic.Uint64
	durable     atomic.Uint64
	lastPersist time.Time

	// lost records chunks whose data this replica never got (the leader had
	// lost it); a PutBlock needing them fails here.
	mu   sync.Mutex
	lost map[blockKey]bool
}

type blockKey struct{ cid, lid uint64 }

const persistEvery = time.Second

type stats struct {
	chunksWritten   atomic.Uint64
	bytesWritten    atomic.Uint64
	blocksCommitted atomic.Uint64
	smallFiles      atomic.Uint64 // blocks committed by PutSmallFile
	bytesRead       atomic.Uint64
}

func newContainerSM(pipeline uint64, store *storage.Store, dir string, st *stats, log *slog.Logger) (*containerSM, error) {
	sm := &containerSM{pipeline: pipeline, store: store, file: filepath.Join(dir, fmt.Sprintf("%d.applied", pipeline)), log: log, stats: st, lost: map[blockKey]bool{}}
	b, err := os.ReadFile(sm.file)
	switch {
	case err == nil && len(b) == 8:
		sm.applied.Store(binary.BigEndian.Uint64(b))
		sm.durable.Store(binary.BigEndian.Uint64(b))
	case err == nil:
		return nil, fmt.Errorf("datanode: pipeline %d: corrupt applied-index file %s", pipeline, sm.file)
	case !errors.Is(err, os.ErrNotExist):
		return nil, err
	}
	return sm, nil
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
func (sm *containerSM) ensureContainer(cid storage.ContainerID) error {
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

// WriteData stores a chunk (of a WriteChunk or a PutSmallFile). A failure
// must not stop the pipeline for everyone (raft would stop the group): the
// replica records the failure, and the PutBlock (or the PutSmallFile's
// apply) that needs the chunk fails here, marking the container unhealthy,
// while the client learns of it from the leader or from REPLICAS_LAG.
func (sm *containerSM) WriteData(index, term uint64, meta, data []byte) error {
	cmd, err := decodeCommand(meta)
	if err != nil {
		return err
	}
	blk, c, err := dataChunk(index, cmd)
	if err != nil {
		return err
	}
	cid := storage.ContainerID(blk.GetContainerId())
	lid := storage.LocalID(blk.GetLocalId())
	if data == nil {
		sm.markLost(cid, lid, fmt.Errorf("entry %d: the leader no longer had the data", index))
		return nil
	}
	if err := sm.ensureContainer(cid); err != nil {
		sm.markLost(cid, lid, err)
		return nil
	}
	// The leader verified the chunk when the client sent it (service.
	// WriteChunk, PutSmallFile) and hands WriteData those same bytes;
	// followers got them over the network and verify.
	verify := sm.isLeader == nil || !sm.isLeader()
	if err := sm.store.WriteChunk(cid, lid, int64(c.GetOffset()), data, toChecksum(c.GetChecksum()), verify); err != nil {
		sm.markLost(cid, lid, err)
		return nil
	}
	sm.stats.chunksWritten.Add(1)
	sm.stats.bytesWritten.Add(uint64(len(data)))
	return nil
}

func (sm *containerSM) markLost(cid storage.ContainerID, lid storage.LocalID, err error) {
	sm.log.Warn("chunk not stored on this replica", "pipeline", sm.pipeline, "container", cid, "block", lid, "err", err)
	sm.mu.Lock()
	sm.lost[blockKey{uint64(cid), uint64(lid)}] = true
	sm.mu.Unlock()
}

// ReadData reads a chunk back for a resend to a follower.
func (sm *containerSM) ReadData(index, term uint64, meta []byte) ([]byte, error) {
	cmd, err := decodeCommand(meta)
	if err != nil {
		return nil, err
	}
	blk, c, err := dataChunk(index, cmd)
	if err != nil {
		return nil, err
	}
	cid := storage.ContainerID(blk.GetContainerId())
	lid := storage.LocalID(blk.GetLocalId())
	data, err := sm.store.ReadWritten(cid, lid, int64(c.GetOffset()), int64(c.GetLength()), toChecksum(c.GetChecksum()))
	if errors.Is(err, storage.ErrBlockNotFound) || errors.Is(err, storage.ErrContainerNotFound) {
		return nil, fmt.Errorf("%w: %v", raft.ErrDataLost, err)
	}
	return data, err
}

func (sm *containerSM) Apply(ents []raft.Entry) []any {
	out := make([]any, len(ents))
	for i, e := range ents {
		if e.Kind != raft.EntryNormal {
			continue
		}
		cmd, err := decodeCommand(e.Meta)
		if err != nil {
			out[i] = err
			continue
		}
		out[i] = sm.apply(e, cmd)
	}
	last := ents[len(ents)-1].Index
	sm.applied.Store(last)
	if time.Since(sm.lastPersist) >= persistEvery {
		sm.persist(last)
	}
	return out
}

func (sm *containerSM) apply(e raft.Entry, cmd *datanodepb.ContainerCommand) any {
	switch c := cmd.GetCmd().(type) {
	case *datanodepb.ContainerCommand_WriteChunk:
		k := blockKey{c.WriteChunk.GetBlock().GetContainerId(), c.WriteChunk.GetBlock().GetLocalId()}
		sm.mu.Lock()
		lost := sm.lost[k]
		sm.mu.Unlock()
		if lost {
			return fmt.Errorf("datanode: container %d block %d: chunk at %d not stored on this replica: %w",
				k.cid, k.lid, c.WriteChunk.GetChunk().GetOffset(), storage.ErrVolumeFailed)
		}
		return nil
	case *datanodepb.ContainerCommand_PutBlock:
		return sm.commitBlock(e.Index, c.PutBlock.GetBlock(), c.PutBlock.GetCloseContainer())
	case *datanodepb.ContainerCommand_PutSmallFile:
		// WriteData put the chunk in the block file before this entry was
		// acknowledged here; committing it is a PutBlock.
		if err := sm.commitBlock(e.Index, c.PutSmallFile.GetBlock(), false); err != nil {
			return err
		}
		sm.stats.smallFiles.Add(1)
		return nil
	case *datanodepb.ContainerCommand_CloseContainer:
		return sm.closeContainer(storage.ContainerID(c.CloseContainer.GetContainerId()))
	case *datanodepb.ContainerCommand_DeleteBlocks:
		lids := make([]storage.LocalID, len(c.DeleteBlocks.GetLocalIds()))
		for i, l := range c.DeleteBlocks.GetLocalIds() {
			lids[i] = storage.LocalID(l)
		}
		err := sm.store.DeleteBlocks(storage.ContainerID(c.DeleteBlocks.GetContainerId()), lids)
		if errors.Is(err, storage.ErrContainerNotFound) {
			return nil
		}
		return err
	default:
		return fmt.Errorf("datanode: unknown container command at %d", e.Index)
	}
}

// commitBlock applies a PutBlock (or the commit half of a PutSmallFile)
// at log index: the block is committed with BCSID = index, durably.
func (sm *containerSM) commitBlock(index uint64, b *datanodepb.BlockData, closeContainer bool) error {
	cid := storage.ContainerID(b.GetId().GetContainerId())
	bd := toBlockData(b)
	bd.BCSID = index
	k := blockKey{uint64(cid), uint64(bd.LocalID)}
	sm.mu.Lock()
	lost := sm.lost[k]
	delete(sm.lost, k)
	sm.mu.Unlock()
	if lost {
		sm.store.MarkUnhealthy(cid, fmt.Sprintf("block %d committed without all its chunks on this replica", bd.LocalID))
		return fmt.Errorf("datanode: container %d block %d: chunks missing on this replica", cid, bd.LocalID)
	}
	if err := sm.ensureContainer(cid); err != nil {
		return err
	}
	if err := sm.store.PutBlock(cid, bd); err != nil {
		return err
	}
	sm.stats.blocksCommitted.Add(1)
	if closeContainer {
		sm.closeContainer(cid)
	}
	return nil
}

func (sm *containerSM) closeContainer(cid storage.ContainerID) error {
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

// persist writes the applied index durably. Storage made every applied
// PutBlock durable already, so the index only needs to be as durable as
// what it covers.
func (sm *containerSM) persist(index uint64) {
	sm.lastPersist = time.Now()
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], index)
	tmp := sm.file + ".tmp"
	f, err := os.Create(tmp)
	if err == nil {
		_, err = f.Write(b[:])
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = os.Rename(tmp, sm.file)
	}
	if err != nil {
		sm.log.Warn("cannot persist applied index", "pipeline", sm.pipeline, "err", err)
		return
	}
	sm.durable.Store(index)
}

func (sm *containerSM) AppliedIndex() uint64 { return sm.durable.Load() }

// A pipeline snapshot carries the applied index and the containers this
// replica holds, not their data: a replica that needs a snapshot has missed
// chunks, and its containers are repaired by re-replication of closed
// containers (Ozone does the same), not through the Raft log.
type smSnapshot struct {
	Index      uint64   `json:"index"`
	Containers []uint64 `json:"containers"`
}

func (sm *containerSM) Snapshot() (uint64, io.ReadCloser, error) {
	idx := sm.applied.Load()
	snap := smSnapshot{Index: idx}
	for _, c := range sm.store.ListContainers() {
		snap.Containers = append(snap.Containers, uint64(c.ID))
	}
	b, err := json.Marshal(snap)
	if err != nil {
		return 0, nil, err
	}
	return idx, io.NopCloser(bytesReader(b)), nil
}

func (sm *containerSM) Restore(index uint64, r io.Reader) error {
	var snap smSnapshot
	if err := json.NewDecoder(r).Decode(&snap); err != nil {
		return fmt.Errorf("datanode: pipeline %d: bad snapshot: %w", sm.pipeline, err)
	}
	if snap.Index != index {
		return fmt.Errorf("datanode: pipeline %d: snapshot says index %d, raft says %d", sm.pipeline, snap.Index, index)
	}
	// Open containers we hold did not get the entries the snapshot covers.
	for _, cid := range snap.Containers {
		if rep, err := sm.store.Container(storage.ContainerID(cid)); err == nil && rep.State == storage.StateOpen {
			sm.store.MarkUnhealthy(storage.ContainerID(cid), fmt.Sprintf("pipeline %d caught up by snapshot at %d", sm.pipeline, index))
		}
	}
	sm.applied.Store(index)
	sm.persist(index)
	return nil
}
