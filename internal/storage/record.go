package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Keys of the per-volume Pebble DB are
//
//	containerID (8, big-endian) | kind (1) | id (8, big-endian)
//
// (17 bytes), and for a written chunk that no PutBlock committed yet
//
//	containerID (8) | kindChunk (1) | localID (8) | offset (8)
//
// (25 bytes), so all of a container's keys share an 8-byte prefix (one
// prefix seek lists its blocks, one DeleteRange drops it), blocks sort by
// local ID and a block's written chunks by offset.
const (
	keyLen          = 17
	chunkKeyLen     = 25
	kindContainer   = 0x00 // id 0: container record, id 1: counters
	kindBlock       = 0x01 // id: local block ID
	kindChunk       = 0x02 // id: local block ID, then the chunk's offset
	idRecord        = 0
	idCounters      = 1
	blockRecVersion = 1
	chunkRecVersion = 1
	// chunkRecVersionSmall: the same record for the chunk of a block
	// written by WriteSmallChunk (span.small), so a replica that restarts
	// before the block's commit still refuses other commit shapes
	// (smallCommitOK) and further chunks, as its peers do.
	chunkRecVersionSmall = 2
	// maxChunksPerBlock bounds the metadata of one block (and the memory a
	// decoder allocates for a hostile record).
	maxChunksPerBlock = 1 << 16
	maxSumsPerChunk   = 1 << 20 // bytes of checksums in one chunk
)

func makeKey(cid ContainerID, kind byte, id uint64) []byte {
	k := make([]byte, keyLen)
	binary.BigEndian.PutUint64(k, uint64(cid))
	k[8] = kind
	binary.BigEndian.PutUint64(k[9:], id)
	return k
}

func parseKey(k []byte) (cid ContainerID, kind byte, id uint64, ok bool) {
	if len(k) != keyLen {
		return 0, 0, 0, false
	}
	return ContainerID(binary.BigEndian.Uint64(k)), k[8], binary.BigEndian.Uint64(k[9:]), true
}

func makeChunkKey(cid ContainerID, lid LocalID, off int64) []byte {
	k := make([]byte, chunkKeyLen)
	binary.BigEndian.PutUint64(k, uint64(cid))
	k[8] = kindChunk
	binary.BigEndian.PutUint64(k[9:], uint64(lid))
	binary.BigEndian.PutUint64(k[17:], uint64(off))
	return k
}

func parseChunkKey(k []byte) (cid ContainerID, lid LocalID, off int64, ok bool) {
	if len(k) != chunkKeyLen || k[8] != kindChunk {
		return 0, 0, 0, false
	}
	off = int64(binary.BigEndian.Uint64(k[17:]))
	if off < 0 {
		return 0, 0, 0, false
	}
	return ContainerID(binary.BigEndian.Uint64(k)), LocalID(binary.BigEndian.Uint64(k[9:])), off, true
}

// chunkRange returns [lo, hi) covering every chunk record of one block.
func chunkRange(cid ContainerID, lid LocalID) (lo, hi []byte) {
	lo = makeChunkKey(cid, lid, 0)
	hi = makeChunkKey(cid, lid, 0)
	binary.BigEndian.PutUint64(hi[17:], ^uint64(0))
	return lo, append(hi, 0) // past the largest offset key
}

// containerBounds returns [lo, hi) covering every key of cid.
func containerBounds(cid ContainerID) (lo, hi []byte) {
	lo = make([]byte, 8)
	binary.BigEndian.PutUint64(lo, uint64(cid))
	hi = make([]byte, 8)
	binary.BigEndian.PutUint64(hi, uint64(cid)+1)
	if cid == ^ContainerID(0) {
		hi = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	}
	return lo, hi
}

// containerRecord is the persistent description of a container. Counters
// live in a separate key so that a PutBlock rewrites 24 bytes, not this.
type containerRecord struct {
	State   State
	MaxSize int64
}

func (r containerRecord) encode() []byte {
	b := []byte{1, byte(r.State)}
	return binary.BigEndian.AppendUint64(b, uint64(r.MaxSize))
}

func decodeContainerRecord(b []byte) (containerRecord, error) {
	if len(b) != 10 || b[0] != 1 {
		return containerRecord{}, fmt.Errorf("bad container record (%d bytes)", len(b))
	}
	r := containerRecord{State: State(b[1]), MaxSize: int64(binary.BigEndian.Uint64(b[2:]))}
	if r.State > StateUnhealthy {
		return r, fmt.Errorf("bad container state %d", b[1])
	}
	return r, nil
}

type counters struct {
	Used   int64
	Blocks int64
	BCSID  uint64
}

// check asserts what every change of the counters keeps: no negative
// usage or count, and blocks only when bytes or empty blocks exist.
func (c counters) check(cid ContainerID) {
	if c.Used < 0 || c.Blocks < 0 || (c.Used > 0 && c.Blocks == 0) {
		panic(fmt.Sprintf("storage: container %d: counters out of range: %+v", cid, c))
	}
}

func (c counters) encode() []byte {
	b := make([]byte, 24)
	binary.BigEndian.PutUint64(b, uint64(c.Used))
	binary.BigEndian.PutUint64(b[8:], uint64(c.Blocks))
	binary.BigEndian.PutUint64(b[16:], c.BCSID)
	return b
}

func decodeCounters(b []byte) (counters, error) {
	if len(b) != 24 {
		return counters{}, fmt.Errorf("bad counters record (%d bytes)", len(b))
	}
	c := counters{
		Used:   int64(binary.BigEndian.Uint64(b)),
		Blocks: int64(binary.BigEndian.Uint64(b[8:])),
		BCSID:  binary.BigEndian.Uint64(b[16:]),
	}
	if c.Used < 0 || c.Blocks < 0 || (c.Used > 0 && c.Blocks == 0) {
		return counters{}, fmt.Errorf("counters out of range: %d bytes in %d blocks", c.Used, c.Blocks)
	}
	return c, nil
}

// encodeBlock is a compact binary form: the 64 checksums of a 4 MiB chunk
// make a 256 MiB block's record about 16 KiB, decoded on every read.
func encodeBlock(bd *BlockData) []byte {
	n := 1 + 3*binary.MaxVarintLen64 + 4
	for _, c := range bd.Chunks {
		n += 4*binary.MaxVarintLen64 + 1 + len(c.Checksum.Sums)
	}
	b := make([]byte, 0, n)
	if bd.Inline {
		b = append(b, blockRecVersionInline)
	} else {
		b = append(b, blockRecVersion)
	}
	b = binary.AppendUvarint(b, uint64(bd.LocalID))
	b = binary.AppendUvarint(b, uint64(bd.Length))
	b = binary.AppendUvarint(b, bd.BCSID)
	b = binary.AppendUvarint(b, uint64(len(bd.Chunks)))
	for _, c := range bd.Chunks {
		b = binary.AppendUvarint(b, uint64(c.Offset))
		b = binary.AppendUvarint(b, uint64(c.Length))
		b = append(b, byte(c.Checksum.Type))
		b = binary.AppendUvarint(b, uint64(c.Checksum.BytesPerChecksum))
		b = binary.AppendUvarint(b, uint64(len(c.Checksum.Sums)))
		b = append(b, c.Checksum.Sums...)
	}
	return b
}

// encodeChunk is the record of a written chunk not yet committed by a
// PutBlock (the key holds container, block and offset):
//
//	version (1) | length (uvarint) | checksum type (1) |
//	bytes per checksum (uvarint) | sums length (uvarint) | sums
//
// It is written only after the chunk's data was synced, so its presence
// means "these bytes are on disk with these checksums" and its absence
// means the chunk is not on this replica (a hole PutBlock refuses).
//
// The version says whether the chunk is a small block's (version 2,
// encodeChunkRec with small) or any other (version 1).
func encodeChunk(n int64, sum ChecksumData) []byte { return encodeChunkRec(n, sum, false) }

// encodeChunkRec is encodeChunk that records span.small.
func encodeChunkRec(n int64, sum ChecksumData, small bool) []byte {
	b := make([]byte, 0, 1+3*binary.MaxVarintLen64+1+len(sum.Sums))
	if small {
		b = append(b, chunkRecVersionSmall)
	} else {
		b = append(b, chunkRecVersion)
	}
	b = binary.AppendUvarint(b, uint64(n))
	b = append(b, byte(sum.Type))
	b = binary.AppendUvarint(b, uint64(sum.BytesPerChecksum))
	b = binary.AppendUvarint(b, uint64(len(sum.Sums)))
	return append(b, sum.Sums...)
}

// decodeChunk decodes a chunk record and checks it describes a chunk of at
// most MaxChunkSize bytes whose checksums cover it exactly.
func decodeChunk(b []byte) (n int64, sum ChecksumData, err error) {
	n, sum, _, err = decodeChunkRec(b)
	return n, sum, err
}

// decodeChunkRec is decodeChunk that also reports whether the record is
// a small block's chunk (encodeChunkRec).
func decodeChunkRec(b []byte) (n int64, sum ChecksumData, small bool, err error) {
	if len(b) == 0 || (b[0] != chunkRecVersion && b[0] != chunkRecVersionSmall) {
		return 0, sum, false, fmt.Errorf("unknown chunk record version")
	}
	small = b[0] == chunkRecVersionSmall
	n, sum, err = decodeChunkBody(b[1:])
	return n, sum, small, err
}

func decodeChunkBody(b []byte) (n int64, sum ChecksumData, err error) {
	ln, k := binary.Uvarint(b)
	if k <= 0 || len(b) < k+1 {
		return 0, sum, errShortChunk
	}
	b = b[k:]
	sum.Type = ChecksumType(b[0])
	b = b[1:]
	bpc, k := binary.Uvarint(b)
	if k <= 0 {
		return 0, sum, errShortChunk
	}
	b = b[k:]
	ns, k := binary.Uvarint(b)
	if k <= 0 {
		return 0, sum, errShortChunk
	}
	b = b[k:]
	if ln == 0 || ln > MaxChunkSize || bpc > MaxBytesPerChecksum || ns > maxSumsPerChunk || uint64(len(b)) != ns {
		return 0, sum, fmt.Errorf("chunk record out of range: length %d, %d bytes per checksum, %d bytes of sums for %d present", ln, bpc, ns, len(b))
	}
	sum.BytesPerChecksum = uint32(bpc)
	if ns > 0 {
		sum.Sums = append([]byte(nil), b...)
	}
	if err := sum.validate(int64(ln)); err != nil {
		return 0, sum, fmt.Errorf("chunk record: %w", err)
	}
	return int64(ln), sum, nil
}

var (
	errShortRecord = errors.New("truncated block record")
	errShortChunk  = errors.New("truncated chunk record")
)

func decodeBlock(b []byte) (BlockData, error) {
	var bd BlockData
	if len(b) == 0 || (b[0] != blockRecVersion && b[0] != blockRecVersionInline) {
		return bd, fmt.Errorf("unknown block record version")
	}
	bd.Inline = b[0] == blockRecVersionInline
	b = b[1:]
	next := func() (uint64, error) {
		v, n := binary.Uvarint(b)
		if n <= 0 {
			return 0, errShortRecord
		}
		b = b[n:]
		return v, nil
	}
	var v [4]uint64
	for i := range v {
		x, err := next()
		if err != nil {
			return bd, err
		}
		v[i] = x
	}
	if v[1] > 1<<62 || v[3] > maxChunksPerBlock {
		return bd, fmt.Errorf("block record out of range: length %d, %d chunks", v[1], v[3])
	}
	bd.LocalID, bd.Length, bd.BCSID = LocalID(v[0]), int64(v[1]), v[2]
	bd.Chunks = make([]ChunkInfo, v[3])
	for i := range bd.Chunks {
		c := &bd.Chunks[i]
		off, err := next()
		if err != nil {
			return bd, err
		}
		ln, err := next()
		if err != nil {
			return bd, err
		}
		if len(b) < 1 {
			return bd, errShortRecord
		}
		c.Checksum.Type = ChecksumType(b[0])
		b = b[1:]
		bpc, err := next()
		if err != nil {
			return bd, err
		}
		ns, err := next()
		if err != nil {
			return bd, err
		}
		if off > 1<<62 || ln > 1<<62 || bpc > MaxBytesPerChecksum || ns > maxSumsPerChunk || uint64(len(b)) < ns {
			return bd, errShortRecord
		}
		c.Offset, c.Length, c.Checksum.BytesPerChecksum = int64(off), int64(ln), uint32(bpc)
		c.Checksum.Sums = append([]byte(nil), b[:ns]...)
		b = b[ns:]
	}
	if len(b) != 0 {
		return bd, fmt.Errorf("%d trailing bytes in block record", len(b))
	}
	if err := checkChunks(&bd); err != nil {
		return bd, err
	}
	return bd, nil
}

// checkChunks checks the invariant of a committed block: chunks contiguous
// from offset 0, each with checksums that cover exactly its length, summing
// to Length. Reads index checksums by window, so a record that breaks this
// must never be used.
func checkChunks(bd *BlockData) error {
	var pos int64
	for _, ch := range bd.Chunks {
		if ch.Offset != pos || ch.Length <= 0 || ch.Length > bd.Length-pos {
			return fmt.Errorf("chunk [%d,+%d) does not continue the block at %d (length %d)", ch.Offset, ch.Length, pos, bd.Length)
		}
		if err := ch.Checksum.validate(ch.Length); err != nil {
			return fmt.Errorf("chunk at %d: %w", ch.Offset, err)
		}
		pos += ch.Length
	}
	if pos != bd.Length {
		return fmt.Errorf("chunks sum to %d, length %d", pos, bd.Length)
	}
	return nil
}
