package zoned

import (
	"fmt"
	"runtime/debug"
	"slices"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/storage"
)

// cleaner resets zones left without live data and, while few zones are
// empty, moves the live extents out of mostly dead full zones so they can
// be reset. It is throttled to CleanerRate bytes per second.
func (b *Backend) cleaner() {
	defer close(b.done)
	// A panic here (a bug, or a Fatalf of the DB on this goroutine that
	// a call did not catch) fails the volume, not the process.
	defer func() {
		if p := recover(); p != nil {
			b.wedge(&storage.FatalError{Msg: fmt.Sprintf("panic in the zoned cleaner: %v", p)})
			b.cfg.Logf("zoned: %s: panic in the cleaner: %v\n%s", b.cfg.Mount, p, debug.Stack())
		}
	}()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-b.kick:
		case <-t.C:
			b.saveMarks(pebble.NoSync)
		}
		b.resetPending()
		for b.needsCleaning() {
			v := b.pickVictim()
			if v == nil {
				break
			}
			if err := b.clean(v); err != nil {
				b.cfg.Logf("zoned: cleaning zone %d: %v", v.id, err)
				b.mu.Lock()
				b.cleanErr = err
				b.mu.Unlock()
				break
			}
			b.resetPending()
			select {
			case <-b.stop:
				return
			default:
			}
		}
	}
}

func (b *Backend) needsCleaning() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !b.closed && b.emptyLocked() < b.cfg.LowZones
}

// pickVictim returns the full zone with the least live data, if it is
// worth cleaning.
func (b *Backend) pickVictim() *zone {
	b.mu.Lock()
	defer b.mu.Unlock()
	var v *zone
	for _, z := range b.zones {
		if z.state == zFull && !z.resetOK && z.live > 0 && (v == nil || z.live < v.live) {
			v = z
		}
	}
	if v == nil || float64(v.live) > b.cfg.CleanLive*float64(v.cap) {
		return nil
	}
	return v
}

// resetPending resets the queued zones that still hold no live data and
// nobody appends to or reads: first a WAL sync makes the removals that
// emptied them durable, then their saved tails are deleted, then the zone
// file is truncated to 0.
func (b *Backend) resetPending() {
	b.mu.Lock()
	cand := b.pending
	b.pending = nil
	b.mu.Unlock()
	if len(cand) == 0 {
		return
	}
	slices.Sort(cand)
	cand = slices.Compact(cand)
	if err := b.logData(pebble.Sync); err != nil {
		b.cfg.Logf("zoned: sync before reset: %v", err)
		return
	}
	for _, zi := range cand {
		b.mu.Lock()
		z := b.zones[zi]
		if z == b.cleanZ && z.live == 0 && z.pins == 0 {
			// Only the cleaner (this goroutine) appends there: let go.
			b.cleanZ = nil
			z.users--
		}
		if z.live != 0 || z.users != 0 || z.pins != 0 || z.state == zEmpty || z.resetOK || z == b.cleanZ {
			b.mu.Unlock()
			continue
		}
		z.resetOK = true // no allocation picks it now
		tails := z.tails
		b.mu.Unlock()
		err := b.reset(z, tails)
		b.mu.Lock()
		z.resetOK = false
		if err == nil {
			if z.state == zActive {
				b.active--
			}
			z.state = zEmpty
			z.tails = nil
			b.resets.Add(1)
			b.cond.Broadcast()
		} else {
			b.cfg.Logf("zoned: reset zone %d: %v", z.id, err)
		}
		b.mu.Unlock()
	}
}

func (b *Backend) reset(z *zone, tails [][]byte) error {
	// The zone's tails and durable mark go first: after a crash between
	// the two steps, an empty zone has nothing stale to take back.
	batch := b.db.NewBatch()
	for _, k := range tails {
		batch.Delete(k, nil)
	}
	batch.Delete(durableKey(z.id), nil)
	err := b.commit(batch, pebble.Sync)
	b.gdb.CloseBatch(batch)
	if err != nil {
		return err
	}
	b.mu.Lock()
	z.mark = 0
	b.mu.Unlock()
	z.amu.Lock()
	defer z.amu.Unlock()
	z.mu.Lock()
	defer z.mu.Unlock()
	for z.writing {
		z.cond.Wait()
	}
	if z.w == nil {
		if err := z.activate(b.fs, b.cfg.StageBytes); err != nil {
			return err
		}
	}
	if err := z.w.Truncate(0); err != nil {
		return err
	}
	z.w.Close()
	z.w = nil
	z.wp, z.curStart, z.curLen, z.err = 0, 0, 0, nil
	z.cur, z.spare = nil, nil
	z.syncedWP.Store(0)
	return nil
}

// cleanGroup bounds the data moved under one set of block locks (and
// committed in one batch).
const cleanGroup = 16 << 20

// clean moves every live extent out of zone v: each is read and checked
// against its CRC, appended to the cleaner's zone, and the blocks' extent
// lists are switched in one synced batch per group of blocks once the new
// copies are durable. Blocks being written are left alone (the zone is
// then not emptied this time).
func (b *Backend) clean(v *zone) error {
	// Blocks with extents in v, from a scan of the extent map.
	it, err := b.newIter(&pebble.IterOptions{LowerBound: []byte{kBlock}, UpperBound: []byte{kBlock + 1}})
	if err != nil {
		return err
	}
	type cand struct {
		k bkey
		n int64
	}
	var cands []cand
	for ok := it.First(); ok; ok = it.Next() {
		k, okk := parseBlockKey(it.Key())
		val, err := it.ValueAndErr()
		if !okk || err != nil {
			continue
		}
		r, err := decodeRecord(val)
		if err != nil {
			continue
		}
		var n int64
		for _, e := range r.exts {
			if e.zone == v.id {
				n += e.n
			}
		}
		if n > 0 {
			cands = append(cands, cand{k, n})
		}
	}
	if err := it.Close(); err != nil {
		return err
	}
	for len(cands) > 0 {
		var group []bkey
		var size int64
		for len(cands) > 0 && (len(group) == 0 || size+cands[0].n <= cleanGroup) {
			group = append(group, cands[0].k)
			size += cands[0].n
			cands = cands[1:]
		}
		moved, err := b.moveGroup(v, group)
		if err != nil {
			return err
		}
		if moved == 0 {
			continue
		}
		if b.cfg.CleanerRate > 0 {
			d := time.Duration(float64(moved) / float64(b.cfg.CleanerRate) * float64(time.Second))
			select {
			case <-b.stop:
				return nil
			case <-time.After(d):
			}
		}
	}
	b.mu.Lock()
	if v.live == 0 {
		b.cleaned.Add(1)
	}
	b.mu.Unlock()
	return nil
}

func (b *Backend) moveGroup(v *zone, keys []bkey) (int64, error) {
	// Lock the blocks' stripes, without waiting: a writer that holds one
	// may itself be waiting for the cleaner to free a zone. Blocks whose
	// stripe is busy are left for the next pass.
	held := map[int]bool{}
	busy := map[int]bool{}
	var mine []bkey
	for _, k := range keys {
		i := b.stripeIndex(k)
		if !held[i] && !busy[i] {
			if b.stripes[i].TryLock() {
				held[i] = true
			} else {
				busy[i] = true
			}
		}
		if held[i] {
			mine = append(mine, k)
		}
	}
	defer func() {
		for i := range held {
			b.stripes[i].Unlock()
		}
	}()
	keys = mine
	type change struct {
		k   bkey
		rec record
	}
	var changes []change
	touched := map[*zone]int64{}
	var moved, freed int64
	var buf []byte
	for _, k := range keys {
		b.mu.Lock()
		busy := b.open[k] != nil
		b.mu.Unlock()
		if busy {
			continue
		}
		r, ok, err := b.load(k)
		if err != nil {
			return moved, err
		}
		if !ok {
			continue
		}
		nr := r.clone()
		var added []extent
		var from int64
		bad := false
		for _, e := range r.exts {
			if e.zone != v.id {
				continue
			}
			if int64(cap(buf)) < e.n {
				buf = make([]byte, e.n)
			}
			p := buf[:e.n]
			if err := v.read(p, e.zoff, b.direct); err != nil {
				return moved, err
			}
			if crc(p) != e.crc {
				b.cfg.Logf("zoned: container %d block %d: extent [%d,+%d) in zone %d fails its CRC; left in place", k.cid, k.lid, e.loff, e.n, v.id)
				bad = true
				break
			}
			for done := int64(0); done < e.n; {
				z, err := b.cleanerZone()
				if err != nil {
					return moved, err
				}
				zoff, n, err := z.append(p[done:])
				if err != nil {
					return moved, err
				}
				if n == 0 {
					b.dropCleanerZone()
					continue
				}
				ne := extent{loff: e.loff + done, n: int64(n), zone: z.id, zoff: zoff, crc: e.crc}
				if int64(n) != e.n {
					ne.crc = crc(p[done : done+int64(n)])
				}
				b.mu.Lock()
				z.live += int64(n)
				b.mu.Unlock()
				added = append(added, ne)
				touched[z] = max(touched[z], zoff+int64(n))
				done += int64(n)
				moved += int64(n)
				if zoff+int64(n) == z.cap {
					b.dropCleanerZone()
				}
			}
			from += e.n
		}
		if bad {
			for _, e := range added {
				b.subLive(e.zone, e.n)
			}
			continue
		}
		for _, e := range added {
			nr.put(e, nil)
		}
		freed += from
		changes = append(changes, change{k, nr})
	}
	if len(changes) == 0 {
		return moved, nil
	}
	batch := b.db.NewBatch()
	defer b.gdb.CloseBatch(batch)
	var newTails [][2]any
	for z, need := range touched {
		t, err := z.sync(need)
		if err != nil {
			return moved, err
		}
		if t != nil {
			key := tailKey(t.zone, t.start, t.end)
			batch.Set(key, t.data, nil)
			newTails = append(newTails, [2]any{z, key})
		}
	}
	for _, c := range changes {
		batch.Set(blockKey(c.k), c.rec.encode(), nil)
	}
	if err := b.commit(batch, pebble.Sync); err != nil {
		return moved, err
	}
	b.mu.Lock()
	for _, nt := range newTails {
		z := nt[0].(*zone)
		z.tails = append(z.tails, nt[1].([]byte))
	}
	b.mu.Unlock()
	// The old copies are dead now.
	if freed > 0 {
		b.subLive(v.id, freed)
	}
	b.movedBytes.Add(moved)
	return moved, nil
}

// cleanerZone returns the zone the cleaner appends to, taking one (the
// reserve included) when it has none.
func (b *Backend) cleanerZone() (*zone, error) {
	b.mu.Lock()
	z := b.cleanZ
	b.mu.Unlock()
	if z != nil {
		return z, nil
	}
	z, err := b.allocZone(true)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.cleanZ = z
	b.mu.Unlock()
	return z, nil
}

func (b *Backend) dropCleanerZone() {
	b.mu.Lock()
	z := b.cleanZ
	b.cleanZ = nil
	b.mu.Unlock()
	if z != nil {
		b.dropZone(z)
	}
}

// saveMarks records how far each zone is known flushed, so recovery has
// only what came after to check.
func (b *Backend) saveMarks(wo *pebble.WriteOptions) error {
	batch := b.db.NewBatch()
	defer b.gdb.CloseBatch(batch)
	b.mu.Lock()
	for _, z := range b.zones {
		if z.resetOK || z.state == zEmpty {
			continue
		}
		if s := z.syncedWPLocked(); s > z.mark {
			batch.Set(durableKey(z.id), u64(s), nil)
			z.mark = s
		}
	}
	b.mu.Unlock()
	if batch.Empty() {
		return nil
	}
	return b.commit(batch, wo)
}
