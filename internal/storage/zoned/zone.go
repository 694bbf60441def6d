package zoned

import (
	"errors"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// zone is one sequential zone file. Appends go into an aligned staging
// buffer; whole blocks of it are written at the write pointer with O_DIRECT
// while the next appends fill a second buffer (so a writer's copy overlaps
// the previous buffer's I/O, and only one write per zone is ever in
// flight, in order). The unaligned remainder stays in memory until Sync
// saves it in the Pebble DB.
//
// Locks: amu serializes appenders (an extent must be contiguous), mu
// guards the buffers and pointers (readers take only mu), smu serializes
// fdatasyncs. Order: amu, then mu; smu alone.
type zone struct {
	id   int
	path string
	cap  int64
	al   int // write unit

	amu  sync.Mutex
	mu   sync.Mutex
	cond sync.Cond // on mu: writing ended

	wp       int64 // on the device (aligned)
	cur      []byte
	curLen   int
	curStart int64 // zone offset of cur[0]; == wp when nothing is in flight
	spare    []byte
	out      []byte // in flight, zone bytes [outStart, outStart+len(out))
	outStart int64
	writing  bool
	err      error // sticky write error: the zone takes no more data

	w vfs.File // O_DIRECT write handle while the zone is being filled
	r vfs.File // read handle (O_DIRECT when the FS takes it)

	smu      sync.Mutex   // serializes fdatasyncs
	syncedWP atomic.Int64 // zone bytes known flushed to stable media

	// Under Backend.mu.
	state   zstate
	live    int64    // bytes referenced by extents (committed or not)
	users   int      // streams appending here
	pins    int      // open readers
	tails   [][]byte // keys of tail records saved for this zone
	mark    int64    // durable mark last saved for this zone
	resetOK bool     // queued for reset
}

type zstate int

const (
	zEmpty zstate = iota
	zActive
	zFull
)

// end is the zone offset the next append lands at. Caller holds mu.
func (z *zone) end() int64 { return z.curStart + int64(z.curLen) }

func alignedBuf(n, al int) []byte {
	b := make([]byte, n+al)
	a := int(uintptr(unsafe.Pointer(&b[0])) & uintptr(al-1))
	if a != 0 {
		a = al - a
	}
	return b[a : a+n : a+n]
}

// activate gives the zone its buffers and write handle. Caller holds amu
// and mu.
func (z *zone) activate(fs vfs.FS, stage int) error {
	if z.w == nil {
		w, err := fs.OpenFile(z.path, os.O_WRONLY|unix.O_DIRECT, 0)
		if err != nil {
			return err
		}
		z.w = w
	}
	if z.cur == nil {
		z.cur = alignedBuf(stage, z.al)
		z.spare = alignedBuf(stage, z.al)
	}
	return nil
}

// append adds up to len(p) bytes at the zone's end and returns where they
// went and how many fit (0: the zone is full). If the staging buffer fills,
// its write is started; the call waits only for a write whose buffer it
// needs back (at most one write per zone is in flight).
func (z *zone) append(p []byte) (off int64, n int, err error) {
	z.amu.Lock()
	z.mu.Lock()
	if z.err != nil {
		z.mu.Unlock()
		z.amu.Unlock()
		return 0, 0, z.err
	}
	off = z.end()
	n = int(min(int64(len(p)), z.cap-off))
	p = p[:n]
	for len(p) > 0 {
		if z.curLen == len(z.cur) {
			if err := z.flushLocked(true); err != nil {
				z.mu.Unlock()
				z.amu.Unlock()
				return 0, 0, err
			}
			continue
		}
		c := copy(z.cur[z.curLen:], p)
		z.curLen += c
		p = p[c:]
	}
	var job *flushJob
	if z.curLen == len(z.cur) || z.end() == z.cap {
		job = z.startFlushLocked()
	}
	z.mu.Unlock()
	z.amu.Unlock()
	if job != nil {
		// The write goes on while the caller computes its CRC and the
		// next append fills the other buffer; a failure is sticky (z.err)
		// and reaches the next append or sync.
		go z.finishFlush(job)
	}
	return off, n, nil
}

type flushJob struct {
	buf   []byte // whole staging buffer, returned as spare when done
	n     int    // bytes to write from buf
	start int64
}

// startFlushLocked waits for the write in flight, then hands the aligned
// prefix of cur to a new one (moving the remainder into the other
// buffer). Caller holds amu and mu; mu may be released while waiting.
func (z *zone) startFlushLocked() *flushJob {
	for z.writing {
		z.cond.Wait()
	}
	if z.err != nil {
		return nil
	}
	n := z.curLen &^ (z.al - 1)
	if n == 0 {
		return nil
	}
	buf := z.cur
	z.cur, z.spare = z.spare, nil
	z.curLen = copy(z.cur, buf[n:z.curLen])
	z.out, z.outStart = buf[:n], z.curStart
	z.curStart += int64(n)
	z.writing = true
	return &flushJob{buf: buf, n: n, start: z.outStart}
}

// finishFlush does a started write (without the zone's locks, so appends
// and reads go on) and publishes the new write pointer.
func (z *zone) finishFlush(j *flushJob) error {
	n, err := z.w.WriteAt(j.buf[:j.n], j.start)
	if err == nil && n != j.n {
		err = io.ErrShortWrite
	}
	z.mu.Lock()
	defer z.mu.Unlock()
	z.writing = false
	z.out = nil
	z.spare = j.buf
	if err != nil {
		z.err = errorf("zone %d: write at %d: %w", z.id, j.start, err)
		z.cond.Broadcast()
		return z.err
	}
	z.wp = j.start + int64(j.n)
	z.cond.Broadcast()
	return nil
}

// flushLocked is startFlushLocked and finishFlush in one, releasing mu
// (not amu) during the write. Caller holds amu and mu.
func (z *zone) flushLocked(wait bool) error {
	j := z.startFlushLocked()
	if j == nil {
		return z.err
	}
	z.mu.Unlock()
	err := z.finishFlush(j)
	z.mu.Lock()
	return err
}

// tail is a zone's unaligned remainder, saved at Sync.
type tail struct {
	zone       int
	start, end int64
	data       []byte
}

// sync makes zone bytes [0, need) durable: it writes the aligned part of
// what is staged, fdatasyncs the zone and returns the unaligned remainder
// (nil if need lies before it), which the caller saves in its Pebble batch.
func (z *zone) sync(need int64) (*tail, error) {
	t, target, err := z.prepare(need)
	if err != nil {
		return nil, err
	}
	return t, z.fsync(target)
}

// prepare is the first half of sync: the whole blocks below need are on
// the device (written, not yet flushed) when it returns; target is how
// far the zone must be fdatasynced, t the remainder to save.
func (z *zone) prepare(need int64) (t *tail, target int64, err error) {
	z.mu.Lock()
	if z.err != nil {
		z.mu.Unlock()
		return nil, 0, z.err
	}
	if need <= z.syncedWPLocked() {
		z.mu.Unlock()
		return nil, 0, nil
	}
	z.mu.Unlock()
	z.amu.Lock()
	z.mu.Lock()
	var j *flushJob
	if need > z.curStart {
		j = z.startFlushLocked()
	}
	if need > z.curStart && z.curLen > 0 {
		t = &tail{zone: z.id, start: z.curStart, end: z.end(), data: append([]byte(nil), z.cur[:z.curLen]...)}
	}
	target = min(need, z.curStart)
	z.mu.Unlock()
	z.amu.Unlock()
	if j != nil {
		if err := z.finishFlush(j); err != nil {
			return nil, 0, err
		}
	}
	z.mu.Lock()
	for z.wp < target && z.err == nil {
		z.cond.Wait()
	}
	err = z.err
	z.mu.Unlock()
	return t, target, err
}

// fsync makes zone bytes [0, target) durable (one fdatasync shared by the
// callers that need no more than it covers).
func (z *zone) fsync(target int64) error {
	if target <= 0 {
		return nil
	}
	// The read handle serves (fdatasync needs no write access, and it
	// stays open while the zone holds data).
	z.mu.Lock()
	wp := z.wp
	z.mu.Unlock()
	z.smu.Lock()
	defer z.smu.Unlock()
	if z.syncedWP.Load() >= target {
		return nil
	}
	if err := z.r.SyncData(); err != nil {
		return errorf("zone %d: fdatasync: %w", z.id, err)
	}
	if wp > z.syncedWP.Load() {
		z.syncedWP.Store(wp)
	}
	return nil
}

func (z *zone) syncedWPLocked() int64 { return z.syncedWP.Load() }

// read copies zone bytes [off, off+len(p)) into p: those still in memory
// from the staging buffers, the rest from the zone file.
func (z *zone) read(p []byte, off int64, direct bool) error {
	z.mu.Lock()
	disk := z.wp
	end := off + int64(len(p))
	copyFrom := func(buf []byte, start int64) {
		lo, hi := max(off, start), min(end, start+int64(len(buf)))
		if lo < hi {
			copy(p[lo-off:hi-off], buf[lo-start:hi-start])
		}
	}
	if z.writing {
		copyFrom(z.out, z.outStart)
	}
	if z.cur != nil {
		copyFrom(z.cur[:z.curLen], z.curStart)
	}
	memEnd := z.end()
	z.mu.Unlock()
	if end > memEnd {
		return errorf("zone %d: read [%d,%d) past its end %d", z.id, off, end, memEnd)
	}
	if off >= disk {
		return nil
	}
	return z.readDisk(p[:min(end, disk)-off], off, direct)
}

var bouncePool = sync.Pool{New: func() any { b := alignedBuf(1<<20, 4096); return &b }}

func (z *zone) readDisk(p []byte, off int64, direct bool) error {
	al := int64(z.al)
	if !direct {
		return fullRead(z.r, p, off)
	}
	if off%al == 0 && int64(len(p))%al == 0 && aligned(p, z.al) {
		return fullRead(z.r, p, off)
	}
	bp := bouncePool.Get().(*[]byte)
	defer bouncePool.Put(bp)
	b := *bp
	for len(p) > 0 {
		start := off &^ (al - 1)
		skip := off - start
		n := min(int64(len(b)), (skip+int64(len(p))+al-1)&^(al-1))
		if err := fullRead(z.r, b[:n], start); err != nil {
			return err
		}
		c := copy(p, b[skip:n])
		p = p[c:]
		off += int64(c)
	}
	return nil
}

func fullRead(f vfs.File, p []byte, off int64) error {
	for len(p) > 0 {
		n, err := f.ReadAt(p, off)
		p = p[n:]
		off += int64(n)
		if err != nil {
			if errors.Is(err, io.EOF) && len(p) == 0 {
				return nil
			}
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
	}
	return nil
}

// release drops the buffers and write handle of a zone that is full or no
// longer written. Caller holds amu and mu, and nothing is in flight.
func (z *zone) release() {
	if z.w != nil && z.wp >= z.cap {
		// A full zone needs its handle only for the last fdatasync; the
		// read handle serves that.
		z.w.Close()
		z.w = nil
	}
	if z.curLen == 0 && !z.writing {
		z.cur, z.spare = nil, nil
	}
}
