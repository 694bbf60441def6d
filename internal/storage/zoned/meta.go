package zoned

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"

	"github.com/basalt-store/basalt/internal/storage"
)

// Keys of a zoned volume's Pebble DB (see docs/ZONED.md):
//
//	'c' cid(8)                   a container exists
//	'b' cid(8) lid(8)            a block's extent list
//	't' zone(4) start(8) end(8)  a zone's unaligned tail [start,end), saved at Sync
//	'd' zone(4)                  bytes of the zone known flushed (8, big-endian)
const (
	kContainer = 'c'
	kBlock     = 'b'
	kTail      = 't'
	kDurable   = 'd'
)

func durableKey(zone int) []byte {
	b := make([]byte, 5)
	b[0] = kDurable
	binary.BigEndian.PutUint32(b[1:], uint32(zone))
	return b
}

func u64(v int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(v)) }

func containerKey(cid storage.ContainerID) []byte {
	k := make([]byte, 9)
	k[0] = kContainer
	binary.BigEndian.PutUint64(k[1:], uint64(cid))
	return k
}

type bkey struct {
	cid storage.ContainerID
	lid storage.LocalID
}

func blockKey(k bkey) []byte {
	b := make([]byte, 17)
	b[0] = kBlock
	binary.BigEndian.PutUint64(b[1:], uint64(k.cid))
	binary.BigEndian.PutUint64(b[9:], uint64(k.lid))
	return b
}

func parseBlockKey(b []byte) (bkey, bool) {
	if len(b) != 17 || b[0] != kBlock {
		return bkey{}, false
	}
	return bkey{storage.ContainerID(binary.BigEndian.Uint64(b[1:])), storage.LocalID(binary.BigEndian.Uint64(b[9:]))}, true
}

func tailKey(zone int, start, end int64) []byte {
	b := make([]byte, 21)
	b[0] = kTail
	binary.BigEndian.PutUint32(b[1:], uint32(zone))
	binary.BigEndian.PutUint64(b[5:], uint64(start))
	binary.BigEndian.PutUint64(b[13:], uint64(end))
	return b
}

func parseTailKey(b []byte) (zone int, start, end int64, ok bool) {
	if len(b) != 21 || b[0] != kTail {
		return 0, 0, 0, false
	}
	return int(binary.BigEndian.Uint32(b[1:])), int64(binary.BigEndian.Uint64(b[5:])), int64(binary.BigEndian.Uint64(b[13:])), true
}

// extent is a piece of a block stored contiguously in one zone: block
// bytes [loff, loff+n) are zone bytes [zoff, zoff+n), with CRC32C crc.
type extent struct {
	loff, n int64
	zone    int
	zoff    int64
	crc     uint32
}

func (e extent) end() int64 { return e.loff + e.n }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func crc(p []byte) uint32 { return crc32.Checksum(p, castagnoli) }

// record is a block's stored form: its size and its extents, sorted by
// loff and not overlapping (bytes not covered read as zeros).
type record struct {
	size int64
	exts []extent
}

const recordVersion = 1

// Bounds on decoded records: nothing read from disk can make us allocate
// more than a block can hold.
const maxExtents = storage.MaxBlockSize / 512

func (r record) encode() []byte {
	b := make([]byte, 0, 16+len(r.exts)*24)
	b = append(b, recordVersion)
	b = binary.AppendUvarint(b, uint64(r.size))
	b = binary.AppendUvarint(b, uint64(len(r.exts)))
	for _, e := range r.exts {
		b = binary.AppendUvarint(b, uint64(e.loff))
		b = binary.AppendUvarint(b, uint64(e.n))
		b = binary.AppendUvarint(b, uint64(e.zone))
		b = binary.AppendUvarint(b, uint64(e.zoff))
		b = binary.LittleEndian.AppendUint32(b, e.crc)
	}
	return b
}

var errBadRecord = errors.New("zoned: malformed block record")

func decodeRecord(b []byte) (record, error) {
	var r record
	if len(b) < 1 || b[0] != recordVersion {
		return r, errBadRecord
	}
	b = b[1:]
	next := func(limit uint64) (uint64, bool) {
		v, n := binary.Uvarint(b)
		if n <= 0 || v > limit {
			return 0, false
		}
		b = b[n:]
		return v, true
	}
	size, ok := next(1 << 50)
	if !ok {
		return r, errBadRecord
	}
	cnt, ok := next(maxExtents)
	if !ok {
		return r, errBadRecord
	}
	r.size = int64(size)
	r.exts = make([]extent, 0, cnt)
	var prevEnd int64
	for range cnt {
		var v [4]uint64
		for i, lim := range [4]uint64{1 << 50, 1 << 40, 1 << 31, 1 << 50} {
			if v[i], ok = next(lim); !ok {
				return r, errBadRecord
			}
		}
		if len(b) < 4 {
			return r, errBadRecord
		}
		e := extent{loff: int64(v[0]), n: int64(v[1]), zone: int(v[2]), zoff: int64(v[3]), crc: binary.LittleEndian.Uint32(b)}
		b = b[4:]
		if e.n <= 0 || e.loff < prevEnd || e.end() > r.size {
			return r, errBadRecord
		}
		prevEnd = e.end()
		r.exts = append(r.exts, e)
	}
	if len(b) != 0 {
		return r, errBadRecord
	}
	return r, nil
}

// put records that block bytes [e.loff, e.end()) now live at e, cutting
// whatever covered them before; cut receives the bytes that lost their
// place (zone, length) so live counts can drop.
func (r *record) put(e extent, cut func(zone int, n int64)) {
	r.cut(e.loff, e.end(), cut)
	i := 0
	for i < len(r.exts) && r.exts[i].loff < e.loff {
		i++
	}
	r.exts = append(r.exts, extent{})
	copy(r.exts[i+1:], r.exts[i:])
	r.exts[i] = e
	r.size = max(r.size, e.end())
}

// cut removes block bytes [from, to) from the extents. Extents cut in two
// keep their CRC only where whole; a partial extent gets crc recomputed by
// the caller (fix), which is told its index.
func (r *record) cut(from, to int64, cut func(zone int, n int64)) (partial []int) {
	var out []extent
	for _, e := range r.exts {
		if e.end() <= from || e.loff >= to {
			out = append(out, e)
			continue
		}
		lo, hi := max(e.loff, from), min(e.end(), to)
		if cut != nil {
			cut(e.zone, hi-lo)
		}
		if e.loff < lo {
			out = append(out, extent{loff: e.loff, n: lo - e.loff, zone: e.zone, zoff: e.zoff})
			partial = append(partial, len(out)-1)
		}
		if hi < e.end() {
			d := hi - e.loff
			out = append(out, extent{loff: hi, n: e.end() - hi, zone: e.zone, zoff: e.zoff + d})
			partial = append(partial, len(out)-1)
		}
	}
	r.exts = out
	return partial
}

func (r record) clone() record {
	return record{size: r.size, exts: append([]extent(nil), r.exts...)}
}

func pathErr(op, path string, err error) error { return &os.PathError{Op: op, Path: path, Err: err} }

func errorf(format string, a ...any) error { return fmt.Errorf("zoned: "+format, a...) }
