package zoned

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"

	"github.com/cockroachdb/pebble/v2"
	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/storage"
)

func (b *Backend) CreateContainer(cid storage.ContainerID) error {
	return b.set(containerKey(cid), nil, pebble.Sync)
}

func (b *Backend) RemoveContainer(cid storage.ContainerID) error {
	keys, err := b.blockKeys(cid)
	if err != nil {
		return err
	}
	for _, k := range keys {
		if err := b.remove(k, pebble.NoSync); err != nil {
			return err
		}
	}
	if err := b.del(containerKey(cid), pebble.Sync); err != nil {
		return err
	}
	b.kickCleaner()
	return nil
}

func (b *Backend) ListContainers() (_ []storage.ContainerID, err error) {
	defer b.log.Catch(&err) // a Fatalf while iterating (corruption)
	it, err := b.newIter(&pebble.IterOptions{LowerBound: []byte{kContainer}, UpperBound: []byte{kContainer + 1}})
	if err != nil {
		return nil, err
	}
	defer it.Close()
	var out []storage.ContainerID
	for ok := it.First(); ok; ok = it.Next() {
		if k := it.Key(); len(k) == 9 {
			out = append(out, storage.ContainerID(binary.BigEndian.Uint64(k[1:])))
		}
	}
	return out, it.Error()
}

func (b *Backend) hasContainer(cid storage.ContainerID) (bool, error) {
	_, c, err := b.get(containerKey(cid))
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	c.Close()
	return true, nil
}

func (b *Backend) blockKeys(cid storage.ContainerID) (_ []bkey, err error) {
	defer b.log.Catch(&err) // a Fatalf while iterating (corruption)
	lo := blockKey(bkey{cid, 0})
	hi := blockKey(bkey{cid + 1, 0})
	if cid+1 == 0 {
		hi = []byte{kBlock + 1}
	}
	it, err := b.newIter(&pebble.IterOptions{LowerBound: lo, UpperBound: hi})
	if err != nil {
		return nil, err
	}
	defer it.Close()
	var out []bkey
	for ok := it.First(); ok; ok = it.Next() {
		if k, ok := parseBlockKey(it.Key()); ok {
			out = append(out, k)
		}
	}
	return out, it.Error()
}

func (b *Backend) ListBlocks(cid storage.ContainerID) ([]storage.BlockFileInfo, error) {
	ok, err := b.hasContainer(cid)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, pathErr("list", fmt.Sprintf("container %d", cid), unix.ENOENT)
	}
	keys, err := b.blockKeys(cid)
	if err != nil {
		return nil, err
	}
	var out []storage.BlockFileInfo
	for _, k := range keys {
		r, ok, err := b.load(k)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, storage.BlockFileInfo{LocalID: k.lid, Size: r.size})
		}
	}
	return out, nil
}

// load returns a block's committed record. Caller holds its stripe.
func (b *Backend) load(k bkey) (record, bool, error) {
	val, c, err := b.get(blockKey(k))
	if errors.Is(err, pebble.ErrNotFound) {
		return record{}, false, nil
	}
	if err != nil {
		return record{}, false, err
	}
	defer c.Close()
	r, err := decodeRecord(val)
	if err != nil {
		return record{}, false, fmt.Errorf("container %d block %d: %w", k.cid, k.lid, err)
	}
	return r, true, nil
}

// current returns a block's current record: the open state's, else the
// committed one. Caller holds its stripe.
func (b *Backend) current(k bkey) (record, bool, error) {
	b.mu.Lock()
	st := b.open[k]
	b.mu.Unlock()
	if st != nil {
		return st.rec.clone(), true, nil
	}
	return b.load(k)
}

func (b *Backend) OpenWriter(cid storage.ContainerID, lid storage.LocalID) (storage.BlockWriter, error) {
	k := bkey{cid, lid}
	mu := b.stripe(k)
	mu.Lock()
	defer mu.Unlock()
	b.mu.Lock()
	st := b.open[k]
	b.mu.Unlock()
	if st == nil {
		r, _, err := b.load(k)
		if err != nil {
			return nil, err
		}
		st = &blockState{key: k, rec: r, touched: map[*zone]int64{}}
		b.mu.Lock()
		b.open[k] = st
		b.mu.Unlock()
	}
	st.writers++
	return &writer{b: b, st: st}, nil
}

type writer struct {
	b      *Backend
	st     *blockState
	z      *zone
	closed bool
}

// WriteAt appends p to the stream's zone (moving to another when it
// fills) and records where each piece went. Offsets need not follow each
// other: a rewrite or a hole only changes the extent map.
func (w *writer) WriteAt(p []byte, off int64) (int, error) {
	b := w.b
	if w.closed {
		return 0, errorf("write after close")
	}
	if off < 0 || off+int64(len(p)) > storage.MaxBlockSize {
		return 0, pathErr("write", "zoned block", unix.EINVAL)
	}
	mu := b.stripe(w.st.key)
	mu.Lock()
	defer mu.Unlock()
	st := w.st
	done := 0
	for done < len(p) {
		if w.z == nil {
			z, err := b.allocZone(false)
			if err != nil {
				return done, err
			}
			w.z = z
		}
		z := w.z
		zoff, n, err := z.append(p[done:])
		if err != nil {
			return done, err
		}
		if n == 0 {
			b.dropZone(z)
			w.z = nil
			continue
		}
		e := extent{loff: off + int64(done), n: int64(n), zone: z.id, zoff: zoff, crc: crc(p[done : done+n])}
		b.mu.Lock()
		z.live += int64(n)
		b.mu.Unlock()
		st.rec.put(e, b.subLive)
		st.touched[z] = max(st.touched[z], zoff+int64(n))
		st.dirty = true
		done += n
		if zoff+int64(n) == z.cap {
			b.dropZone(z)
			w.z = nil
		}
	}
	b.userBytes.Add(int64(len(p)))
	return len(p), nil
}

func (w *writer) Sync() error {
	mu := w.b.stripe(w.st.key)
	mu.Lock()
	defer mu.Unlock()
	return w.b.syncBlock(w.st)
}

// Close syncs what the writer left unsynced (so the block reads the same
// after as before) and ends its stream.
func (w *writer) Close() error {
	if w.closed {
		return nil
	}
	w.closed = true
	b := w.b
	mu := b.stripe(w.st.key)
	mu.Lock()
	defer mu.Unlock()
	err := b.syncBlock(w.st)
	if w.z != nil {
		b.dropZone(w.z)
		w.z = nil
	}
	w.st.writers--
	if w.st.writers == 0 {
		b.mu.Lock()
		if b.open[w.st.key] == w.st {
			delete(b.open, w.st.key)
		}
		b.mu.Unlock()
	}
	return err
}

// syncBlock makes a block's extents durable: each zone it wrote is
// flushed up to its bytes and fdatasynced, then the extent list and the
// zones' unaligned tails are committed in one synced batch. Caller holds
// the block's stripe.
func (b *Backend) syncBlock(st *blockState) error {
	if !st.dirty {
		return nil
	}
	batch := b.db.NewBatch()
	defer b.gdb.CloseBatch(batch)
	type saved struct {
		z    *zone
		key  []byte
		drop [][]byte
	}
	var tails []saved
	targets := map[*zone]int64{}
	for z, need := range st.touched {
		t, target, err := z.prepare(need)
		if err != nil {
			return err
		}
		targets[z] = target
		s := saved{z: z}
		synced := z.syncedWPLocked()
		b.mu.Lock()
		for _, k := range z.tails {
			_, start, end, _ := parseTailKey(k)
			// Superseded: on disk and synced, or a shorter tail of the
			// same start.
			if end <= synced || (t != nil && start == t.start && end <= t.end) {
				s.drop = append(s.drop, k)
			}
		}
		if synced > z.mark {
			batch.Set(durableKey(z.id), u64(synced), nil)
			z.mark = synced
		}
		b.mu.Unlock()
		for _, k := range s.drop {
			batch.Delete(k, nil)
		}
		if t != nil {
			s.key = tailKey(t.zone, t.start, t.end)
			batch.Set(s.key, t.data, nil)
		}
		tails = append(tails, s)
	}
	batch.Set(blockKey(st.key), st.rec.encode(), nil)
	// The zones' flushes and the commit run at once (one device flush's
	// wait instead of two): a record may reach disk before the bytes it
	// names, but only bytes past the zone's durable mark saved with it,
	// and recovery checks those against their CRCs.
	errs := make(chan error, len(targets))
	for z, target := range targets {
		go func() {
			err := errorf("panic in a zone flush")
			defer func() {
				if p := recover(); p != nil {
					b.wedge(&storage.FatalError{Msg: fmt.Sprintf("panic in a zone flush: %v", p)})
					b.cfg.Logf("zoned: %s: panic in a zone flush: %v\n%s", b.cfg.Mount, p, debug.Stack())
				}
				errs <- err
			}()
			err = z.fsync(target)
		}()
	}
	cerr := b.commit(batch, pebble.Sync)
	for range targets {
		if err := <-errs; err != nil && cerr == nil {
			cerr = err
		}
	}
	if cerr != nil {
		return cerr
	}
	b.mu.Lock()
	for _, s := range tails {
		s.z.tails = slices.DeleteFunc(s.z.tails, func(k []byte) bool {
			return slices.ContainsFunc(s.drop, func(d []byte) bool { return string(d) == string(k) })
		})
		if s.key != nil {
			s.z.tails = append(s.z.tails, s.key)
		}
	}
	b.mu.Unlock()
	st.dirty = false
	clear(st.touched)
	return nil
}

func (b *Backend) OpenReader(cid storage.ContainerID, lid storage.LocalID) (storage.BlockReader, error) {
	k := bkey{cid, lid}
	mu := b.stripe(k)
	mu.Lock()
	defer mu.Unlock()
	r, ok, err := b.current(k)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, pathErr("open", fmt.Sprintf("container %d block %d", cid, lid), unix.ENOENT)
	}
	b.pin(r.exts, 1)
	return &reader{b: b, rec: r}, nil
}

// pin keeps the zones of exts from being reset while a reader uses them.
func (b *Backend) pin(exts []extent, d int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, e := range exts {
		z := b.zones[e.zone]
		z.pins += d
		if d < 0 && z.pins == 0 && z.live == 0 {
			b.pending = append(b.pending, z.id)
			b.kickCleaner()
		}
	}
}

type reader struct {
	b      *Backend
	rec    record
	closed bool
}

// ReadAt reads block bytes; bytes no extent covers are zeros.
func (r *reader) ReadAt(p []byte, off int64) (int, error) {
	if off >= r.rec.size {
		return 0, nil
	}
	n := int(min(int64(len(p)), r.rec.size-off))
	p = p[:n]
	end := off + int64(n)
	pos := off
	i, _ := slices.BinarySearchFunc(r.rec.exts, off, func(e extent, o int64) int {
		if e.end() <= o {
			return -1
		}
		return 1
	})
	for ; i < len(r.rec.exts) && r.rec.exts[i].loff < end; i++ {
		e := r.rec.exts[i]
		lo, hi := max(e.loff, off), min(e.end(), end)
		clear(p[pos-off : lo-off])
		if err := r.b.zones[e.zone].read(p[lo-off:hi-off], e.zoff+(lo-e.loff), r.b.direct); err != nil {
			return int(lo - off), err
		}
		pos = hi
	}
	clear(p[pos-off:])
	return n, nil
}

func (r *reader) Close() error {
	if !r.closed {
		r.closed = true
		r.b.pin(r.rec.exts, -1)
	}
	return nil
}

func (b *Backend) Remove(cid storage.ContainerID, lid storage.LocalID) error {
	return b.remove(bkey{cid, lid}, pebble.NoSync)
}

// remove deletes a block's extents; durable at the next SyncContainer (or
// with sync). Its zones are reset only after that.
func (b *Backend) remove(k bkey, sync *pebble.WriteOptions) error {
	mu := b.stripe(k)
	mu.Lock()
	defer mu.Unlock()
	b.mu.Lock()
	st := b.open[k]
	b.mu.Unlock()
	var r record
	if st != nil {
		r = st.rec
		st.rec = record{}
		st.dirty = false
		clear(st.touched)
	} else {
		var ok bool
		var err error
		if r, ok, err = b.load(k); err != nil || !ok {
			return err
		}
	}
	if err := b.del(blockKey(k), sync); err != nil {
		return err
	}
	for _, e := range r.exts {
		b.subLive(e.zone, e.n)
	}
	return nil
}

// Truncate cuts (or extends with zeros) a block and makes that durable.
func (b *Backend) Truncate(cid storage.ContainerID, lid storage.LocalID, size int64) error {
	k := bkey{cid, lid}
	mu := b.stripe(k)
	mu.Lock()
	defer mu.Unlock()
	b.mu.Lock()
	st := b.open[k]
	b.mu.Unlock()
	if st == nil {
		r, ok, err := b.load(k)
		if err != nil {
			return err
		}
		if !ok {
			return pathErr("truncate", fmt.Sprintf("container %d block %d", cid, lid), unix.ENOENT)
		}
		st = &blockState{key: k, rec: r, touched: map[*zone]int64{}}
	}
	partial := st.rec.cut(size, 1<<62, b.subLive)
	for _, i := range partial {
		e := &st.rec.exts[i]
		buf := make([]byte, e.n)
		if err := b.zones[e.zone].read(buf, e.zoff, b.direct); err != nil {
			return err
		}
		e.crc = crc(buf)
	}
	st.rec.size = size
	st.dirty = true
	return b.syncBlock(st)
}

// SyncContainer makes removals durable (creations are durable at once).
func (b *Backend) SyncContainer(cid storage.ContainerID) error {
	if err := b.logData(pebble.Sync); err != nil {
		return err
	}
	b.kickCleaner()
	return nil
}
