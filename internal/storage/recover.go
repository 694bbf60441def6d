package storage

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"
)

// Recovery at Open reconciles each volume's block files with its metadata.
// What the metadata says is the truth, because it is written only after the
// data it names is durable:
//   - a committed block (block record) must have at least its length on
//     disk, else its container is UNHEALTHY; bytes past it that no chunk
//     record names are truncated;
//   - an uncommitted block keeps exactly its recorded chunks (with
//     KeepUncommitted): its file is truncated to the end of the last one,
//     and a range without a record is a hole that PutBlock refuses; a
//     recorded chunk with checksums is checked against its bytes before it
//     is first used (its record may have reached disk before its data);
//     without records (or without KeepUncommitted) the file is removed;
//   - a chunk record whose bytes are not in the file (external damage) or
//     that overlaps committed data is dropped, as is a record whose block
//     file is gone;
//   - a container directory without a record is removed.
// Every removal is followed by a sync of the directory, and every kept
// uncommitted block file has its directory entry synced before Open
// returns, so nothing recovery decided can be undone by a later crash.

type recChunk struct {
	off, n int64
	sum    ChecksumData
	small  bool // written by WriteSmallChunk (chunkRecVersionSmall)
}

func (s *Store) recoverVolume(v *volume) error {
	it, err := v.newIter(nil)
	if err != nil {
		return err
	}
	found := map[ContainerID]*container{}
	blocks := map[ContainerID]map[LocalID]int64{}
	chunks := map[ContainerID]map[LocalID][]recChunk{}
	get := func(cid ContainerID) *container {
		c := found[cid]
		if c == nil {
			c = &container{id: cid, vol: v, open: map[LocalID]*openBlock{}}
			found[cid] = c
		}
		return c
	}
	var defKeys, defVals [][]byte
	// Inline blocks (inline.go): records that say inline, and inline keys.
	inlineRecs := map[ContainerID]map[LocalID]bool{}
	inlineKeys := map[ContainerID]map[LocalID]bool{}
	for ok := it.First(); ok; ok = it.Next() {
		val, err := it.ValueAndErr()
		if err != nil {
			it.Close()
			return err
		}
		if dcid, dlid, doff, okd := parseDeferredKey(it.Key()); okd {
			// A container's block records sort before its deferred keys.
			if doff == 0 && inlineRecs[dcid][dlid] {
				if inlineKeys[dcid] == nil {
					inlineKeys[dcid] = map[LocalID]bool{}
				}
				inlineKeys[dcid][dlid] = true // an inline block's data (inline.go)
				continue
			}
			defKeys = append(defKeys, slices.Clone(it.Key()))
			defVals = append(defVals, slices.Clone(val))
			continue
		}
		if cid, lid, off, okc := parseChunkKey(it.Key()); okc {
			get(cid)
			n, sum, small, err := decodeChunkRec(val)
			if err != nil {
				it.Close()
				return fmt.Errorf("volume %s container %d block %d chunk at %d: %w", v.path, cid, lid, off, err)
			}
			if chunks[cid] == nil {
				chunks[cid] = map[LocalID][]recChunk{}
			}
			chunks[cid][lid] = append(chunks[cid][lid], recChunk{off, n, sum, small && off == 0})
			continue
		}
		cid, kind, id, okk := parseKey(it.Key())
		if !okk {
			it.Close()
			return fmt.Errorf("volume %s: bad metadata key %x", v.path, it.Key())
		}
		c := get(cid)
		switch {
		case kind == kindContainer && id == idRecord:
			c.rec, err = decodeContainerRecord(val)
		case kind == kindContainer && id == idCounters:
			c.cnt, err = decodeCounters(val)
		case kind == kindBlock:
			var bd BlockData
			bd, err = decodeBlock(val)
			if err == nil && bd.LocalID != LocalID(id) {
				err = fmt.Errorf("block record under key %d names block %d", id, bd.LocalID)
			}
			c.noteBlock(LocalID(id))
			if err == nil && bd.Inline {
				// No file to reconcile.
				if inlineRecs[cid] == nil {
					inlineRecs[cid] = map[LocalID]bool{}
				}
				inlineRecs[cid][LocalID(id)] = true
				break
			}
			if blocks[cid] == nil {
				blocks[cid] = map[LocalID]int64{}
			}
			blocks[cid][LocalID(id)] = bd.Length

		default:
			err = fmt.Errorf("unknown metadata key %x", it.Key())
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
	// Deferred writes go back into their files before anything looks at
	// the files (deferred.go).
	if err := s.replayDeferred(v, defKeys, defVals); err != nil {
		return err
	}
	for cid, c := range found {
		if c.rec.MaxSize == 0 {
			return fmt.Errorf("volume %s: container %d has keys but no record", v.path, cid)
		}
		if err := s.recoverContainer(c, blocks[cid], chunks[cid]); err != nil {
			return err
		}
		if err := s.recoverInline(c, inlineRecs[cid], inlineKeys[cid]); err != nil {
			return err
		}
		if other, dup := s.containers[cid]; dup {
			return cErr("open", ErrContainerExists, cid, "on volumes "+other.vol.path+" and "+v.path, nil)
		}
		s.containers[cid] = c
	}
	return nil
}

// recoverContainer reconciles block files with committed metadata and
// chunk records (see the comment at the top of this file).
func (s *Store) recoverContainer(c *container, committed map[LocalID]int64, recs map[LocalID][]recChunk) error {
	drop := c.vol.db.NewBatch()
	defer c.vol.closeBatch(drop)
	dropAll := func(lid LocalID, why string) {
		for _, r := range recs[lid] {
			s.opts.Logf("storage: container %d block %d: dropping chunk record [%d,+%d): %s", c.id, lid, r.off, r.n, why)
			drop.Delete(makeChunkKey(c.id, lid, r.off), nil)
		}
	}
	files, err := c.vol.files.ListBlocks(c.id)
	if errors.Is(err, unix.ENOENT) {
		for lid := range recs {
			dropAll(lid, "container directory missing")
		}
		if err := c.vol.commit(drop, pebble.Sync); err != nil {
			return err
		}
		if len(committed) > 0 {
			return s.markUnhealthyLocked(c, "container directory missing")
		}
		return c.vol.files.CreateContainer(c.id)
	}
	if err != nil {
		return err
	}
	removed, kept := false, false
	have := map[LocalID]bool{}
	for _, f := range files {
		have[f.LocalID] = true
		want, ok := committed[f.LocalID]
		if ok && f.Size < want {
			dropAll(f.LocalID, "committed data missing")
			if err := s.markUnhealthyLocked(c, fmt.Sprintf("block %d has %d of %d committed bytes", f.LocalID, f.Size, want)); err != nil {
				return err
			}
			continue
		}
		// The recorded chunks that are really there, past committed data.
		var spans []span
		pos := want
		if !s.opts.KeepUncommitted {
			dropAll(f.LocalID, "uncommitted data not kept")
		} else {
			for _, r := range recs[f.LocalID] {
				switch {
				case r.off < pos:
					s.opts.Logf("storage: container %d block %d: dropping chunk record [%d,+%d) below %d", c.id, f.LocalID, r.off, r.n, pos)
					drop.Delete(makeChunkKey(c.id, f.LocalID, r.off), nil)
				case r.off+r.n > f.Size:
					s.opts.Logf("storage: container %d block %d: dropping chunk record [%d,+%d): file has %d bytes", c.id, f.LocalID, r.off, r.n, f.Size)
					drop.Delete(makeChunkKey(c.id, f.LocalID, r.off), nil)
				default:
					// A checksummed chunk's record may have reached
					// disk before its bytes: checked before first use.
					spans = append(spans, span{off: r.off, n: r.n, sum: r.sum, durable: true, unverified: r.sum.Type != ChecksumNone, small: r.small})
					pos = r.off + r.n
				}
			}
		}
		end := want
		if len(spans) > 0 {
			end = spans[len(spans)-1].end()
		}
		switch {
		case !ok && len(spans) == 0:
			s.opts.Logf("storage: container %d: removing uncommitted block %d (%d bytes, no durable chunk)", c.id, f.LocalID, f.Size)
			if err := c.vol.files.Remove(c.id, f.LocalID); err != nil {
				return err
			}
			removed = true
			continue
		case f.Size > end:
			if err := c.vol.files.Truncate(c.id, f.LocalID, end); err != nil {
				return err
			}
		}
		if len(spans) == 0 {
			continue
		}
		ob := &openBlock{written: spans, hwm: end, exists: ok}
		if ok {
			bd, err := s.getBlock(c, f.LocalID)
			if err != nil {
				return err
			}
			ob.committed = bd
		}
		s.checkOpen(c, ob)
		c.open[f.LocalID] = ob
		c.pending += end - want
		s.openBlocks.Add(1)
		kept = true
	}
	for lid, n := range committed {
		if n > 0 && !have[lid] {
			if err := s.markUnhealthyLocked(c, fmt.Sprintf("block %d file missing", lid)); err != nil {
				return err
			}
		}
	}
	for lid := range recs {
		if !have[lid] {
			dropAll(lid, "block file missing")
		}
	}
	if !drop.Empty() {
		if err := c.vol.commit(drop, pebble.Sync); err != nil {
			return err
		}
	}
	if removed || kept {
		// Removals must stay removed; kept files must stay (their entries
		// were synced before their records were written, unless an older
		// version wrote them: sync once more, it is one fsync per Open).
		return c.vol.files.SyncContainer(c.id)
	}
	return nil
}

// recoverInline checks a container's inline blocks (inline.go): a record
// without its data makes the container UNHEALTHY (the two are written in
// one batch, so only damage does this).
func (s *Store) recoverInline(c *container, recs, keys map[LocalID]bool) error {
	for lid := range recs {
		if !keys[lid] {
			if err := s.markUnhealthyLocked(c, fmt.Sprintf("inline block %d: data missing", lid)); err != nil {
				return err
			}
		}
	}
	return nil
}
