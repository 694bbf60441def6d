package client

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/crc32c"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// errRealign: the range read from a replica did not cover whole checksum
// windows of the range wanted (the block's chunk layout was not known when
// the request was made); read again with the layout.
var errRealign = errors.New("range not aligned to checksum windows")

// corruptError is a replica whose data does not match its checksums.
type corruptError struct{ msg string }

func (e *corruptError) Error() string { return e.msg }

// KeyReader reads one committed version of a key: the one LookupKey found
// when GetKey was called. It is an io.ReadSeeker, io.ReaderAt (safe for
// concurrent ReadAt calls), io.WriterTo and io.Closer. Every read uses the
// context given to GetKey.
type KeyReader struct {
	c    *Client
	ctx  context.Context
	raw  *metapb.KeyInfo
	info KeyInfo
	op   string

	mu  sync.Mutex
	bad map[uint64]bool // datanodes that failed a read of this reader
	// reported: corrupt replicas already reported (concurrent reads of one
	// block would otherwise report the same replica several times).
	reported map[[3]uint64]bool
	layout   map[int]*datanodepb.BlockData
	closed   bool
	// tokens: fresh block tokens by block index, from a lookup made when
	// a datanode found a token expired (refreshMu serializes lookups).
	tokens    map[int][]byte
	refreshMu sync.Mutex
	// scb: local block files (short-circuit reads, shortcircuit_block.go).
	scb scBlocks

	// Read and Seek state (not for concurrent use, as with any io.Reader).
	pos     int64
	buf     []byte
	bufOff  int64
	bufFill int
}

// GetKey looks the key up (one metadata call) and returns a reader.
func (c *Client) GetKey(ctx context.Context, volume, bucket, key string) (*KeyReader, error) {
	k, err := c.lookup(ctx, volume, bucket, key)
	if err != nil {
		return nil, err
	}
	var off uint64
	for i, l := range k.Locations {
		if l.Offset != off {
			return nil, &Error{Op: "get key " + keyPath(volume, bucket, key), Code: codes.Internal, kind: ErrCorrupt,
				Msg: fmt.Sprintf("block %d starts at %d, want %d (inconsistent key metadata)", i, l.Offset, off)}
		}
		off += l.Length
	}
	if off != k.Size {
		return nil, &Error{Op: "get key " + keyPath(volume, bucket, key), Code: codes.Internal, kind: ErrCorrupt,
			Msg: fmt.Sprintf("blocks hold %d bytes but the key's size is %d", off, k.Size)}
	}
	return &KeyReader{c: c, ctx: ctx, raw: k, info: keyInfoOf(k), op: "read key " + keyPath(volume, bucket, key),
		bad: map[uint64]bool{}, reported: map[[3]uint64]bool{}, layout: map[int]*datanodepb.BlockData{}}, nil
}

// Info returns the key's metadata with its blocks and replicas.
func (r *KeyReader) Info() KeyInfo { return r.info }

// Size is the key's length.
func (r *KeyReader) Size() int64 { return int64(r.raw.Size) }

// Close releases the reader; it does not close the client's connections.
func (r *KeyReader) Close() error {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.scb.close()
	r.buf = nil
	return nil
}

// Seek implements io.Seeker.
func (r *KeyReader) Seek(offset int64, whence int) (int64, error) {
	var abs int64
	switch whence {
	case io.SeekStart:
		abs = offset
	case io.SeekCurrent:
		abs = r.pos + offset
	case io.SeekEnd:
		abs = r.Size() + offset
	default:
		return r.pos, fmt.Errorf("%s: seek: invalid whence %d", r.op, whence)
	}
	if abs < 0 {
		return r.pos, fmt.Errorf("%s: seek to negative offset %d", r.op, abs)
	}
	r.pos = abs
	return abs, nil
}

// Read implements io.Reader. It reads ahead one chunk so that small reads
// do not each cost a round trip.
func (r *KeyReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if r.pos >= r.Size() {
		return 0, io.EOF
	}
	if r.pos < r.bufOff || r.pos >= r.bufOff+int64(r.bufFill) {
		if len(p) >= r.c.cfg.ChunkSize {
			n, err := r.ReadAt(p[:min(int64(len(p)), r.Size()-r.pos)], r.pos)
			r.pos += int64(n)
			if err == io.EOF {
				err = nil
			}
			return n, err
		}
		if r.buf == nil {
			r.buf = make([]byte, r.c.cfg.ChunkSize)
		}
		n, err := r.ReadAt(r.buf[:min(int64(len(r.buf)), r.Size()-r.pos)], r.pos)
		r.bufOff, r.bufFill = r.pos, n
		if err != nil && err != io.EOF {
			return 0, err
		}
	}
	n := copy(p, r.buf[r.pos-r.bufOff:r.bufFill])
	r.pos += int64(n)
	return n, nil
}

// WriteTo implements io.WriterTo: it copies from the current position to
// the end with read-ahead (see WriteRange).
func (r *KeyReader) WriteTo(w io.Writer) (int64, error) {
	if r.pos >= r.Size() {
		return 0, nil
	}
	n, err := r.WriteRange(w, r.pos, r.Size()-r.pos)
	r.pos += n
	return n, err
}

// ReadAt implements io.ReaderAt.
func (r *KeyReader) ReadAt(p []byte, off int64) (int, error) {
	return r.readAt(r.ctx, p, off)
}

// maxSpan bounds one ReadBlock call (and its temporary buffer).
const maxSpan = 8 << 20

func (r *KeyReader) readAt(ctx context.Context, p []byte, off int64) (int, error) {
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return 0, fmt.Errorf("%s: reader is closed", r.op)
	}
	if off < 0 {
		return 0, fmt.Errorf("%s: negative offset %d", r.op, off)
	}
	size := r.Size()
	if off >= size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	want := p[:min(int64(len(p)), size-off)]
	locs := r.raw.Locations
	// First block that holds off.
	bi := sort.Search(len(locs), func(i int) bool { return int64(locs[i].Offset+locs[i].Length) > off })
	n := 0
	for n < len(want) && bi < len(locs) {
		l := locs[bi]
		bOff := off + int64(n) - int64(l.Offset)
		span := min(int64(len(want)-n), int64(l.Length)-bOff, maxSpan)
		if err := r.readBlock(ctx, bi, l, bOff, want[n:n+int(span)]); err != nil {
			return n, err
		}
		n += int(span)
		if bOff+span == int64(l.Length) {
			bi++
		}
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// readBlock fills dst from block bi at off, trying replicas nearest first;
// replicas that failed before for this reader go last.
func (r *KeyReader) readBlock(ctx context.Context, bi int, l *metapb.BlockLocation, off int64, dst []byte) error {
	if len(l.Datanodes) == 0 {
		return &Error{Op: r.op, Code: codes.Unavailable, kind: ErrUnavailable,
			Msg: fmt.Sprintf("block %d/%d (container state %s) has no known replicas", l.Id.GetContainerId(), l.Id.GetLocalId(), containerStateName(l.ContainerState))}
	}
	order := make([]*metapb.DatanodeDetails, 0, len(l.Datanodes))
	var uncached, later []*metapb.DatanodeDetails
	r.mu.Lock()
	for _, d := range l.Datanodes {
		switch {
		case r.bad[d.Id]:
			later = append(later, d)
		case slices.Contains(l.CachedDatanodes, d.Id):
			// Replicas holding the block in their cache tier first
			// (docs/CACHE.md), nearest first among them.
			order = append(order, d)
		default:
			uncached = append(uncached, d)
		}
	}
	r.mu.Unlock()
	if !r.c.cfg.NoShortCircuit {
		r.c.sc.cachedFirst(l, uncached) // shortcircuit_cache.go
	}
	order = append(append(order, uncached...), later...)
	var errs []string
	corrupt := 0
	refreshed := false
	for i := 0; i < len(order); i++ {
		d := order[i]
		tok := r.token(bi, l)
		if r.c.shortCircuit(l, d, tok, off, dst) {
			return nil // a local cached replica, mapped (shortcircuit.go)
		}
		err := r.readLocal(bi, l, d, tok, off, dst) // shortcircuit_block.go
		if errors.Is(err, errNoLocal) {
			err = r.readReplica(ctx, bi, l, d, tok, off, dst)
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w", r.op, ctx.Err())
		}
		if !refreshed && tokenExpired(err) {
			// Once per block read: look the key up for fresh tokens and
			// ask the same replica again.
			refreshed = true
			if r.refreshTokens(ctx, bi, tok) {
				i--
				continue
			}
		}
		var ce *corruptError
		isCorrupt := errors.As(err, &ce)
		rk := [3]uint64{l.Id.GetContainerId(), l.Id.GetLocalId(), d.Id}
		r.mu.Lock()
		r.bad[d.Id] = true
		first := isCorrupt && !r.reported[rk]
		if first {
			r.reported[rk] = true
		}
		r.mu.Unlock()
		if isCorrupt {
			corrupt++
		}
		if first {
			rep := CorruptReport{ContainerID: l.Id.GetContainerId(), LocalID: l.Id.GetLocalId(), DatanodeID: d.Id, DatanodeAddr: d.DataAddr, Reason: ce.msg}
			if rerr := r.c.reportCorrupt(ctx, rep); rerr != nil {
				r.c.log.Warn("basalt client: reporting a corrupt replica failed", "datanode", d.Id, "err", rerr)
			}
			// The client's own check found it (client_verifies): have the
			// datanode that holds the replica judge it too.
			go r.c.askVerify(l.Id, tok, d.DataAddr, off, int64(len(dst)))
		}
		errs = append(errs, fmt.Sprintf("datanode %d (%s): %v", d.Id, d.DataAddr, err))
	}
	kind := ErrUnavailable
	if corrupt == len(order) {
		kind = ErrCorrupt
	}
	return &Error{Op: r.op, Code: codes.Unavailable, kind: kind,
		Msg: fmt.Sprintf("block %d/%d bytes [%d, %d): all %d replicas failed: %s", l.Id.GetContainerId(), l.Id.GetLocalId(), off, off+int64(len(dst)), len(order), strings.Join(errs, "; "))}
}

func (r *KeyReader) readReplica(ctx context.Context, bi int, l *metapb.BlockLocation, d *metapb.DatanodeDetails, tok []byte, off int64, dst []byte) error {
	r.mu.Lock()
	layout := r.layout[bi]
	r.mu.Unlock()
	for attempt := 0; attempt < 2; attempt++ {
		bpc := int64(r.raw.BytesPerChecksum)
		rs, re := alignRange(layout, bpc, int64(l.Length), off, off+int64(len(dst)))
		// When the range wanted is whole checksum windows, the replica's
		// bytes land in dst itself: no temporary buffer, no extra copy.
		var into []byte
		if rs == off && re == off+int64(len(dst)) {
			into = dst
		}
		data, bd, err := r.c.readSpan(ctx, d.DataAddr, l.Id, tok, rs, re, into)
		if err != nil {
			return err
		}
		if layout == nil {
			r.mu.Lock()
			r.layout[bi] = bd
			r.mu.Unlock()
		}
		err = verifyRange(bd, rs, data, off, off+int64(len(dst)))
		if errors.Is(err, errRealign) && layout == nil {
			layout = bd
			continue
		}
		if err != nil {
			return err
		}
		if into == nil {
			copy(dst, data[off-rs:])
		}
		return nil
	}
	return fmt.Errorf("block %d/%d: %w even with its chunk layout", l.Id.GetContainerId(), l.Id.GetLocalId(), errRealign)
}

// token is block bi's token: a fresh one if a lookup refreshed it.
func (r *KeyReader) token(bi int, l *metapb.BlockLocation) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	if t, ok := r.tokens[bi]; ok {
		return t
	}
	return l.Token
}

// tokenExpired reports whether a datanode refused a call for an expired
// block token.
func tokenExpired(err error) bool {
	e := dnErrorOf(err)
	return e != nil && e.Kind == datanodepb.Error_TOKEN_EXPIRED
}

// refreshTokens looks the key up again and keeps the new tokens of the
// blocks it still has, when a datanode found block bi's token (used)
// expired. It reports whether block bi has a token other than used now;
// false if the key changed (another version: this reader's blocks may be
// gone) or the lookup failed.
func (r *KeyReader) refreshTokens(ctx context.Context, bi int, used []byte) bool {
	r.refreshMu.Lock()
	defer r.refreshMu.Unlock()
	if !bytes.Equal(r.token(bi, r.raw.Locations[bi]), used) {
		return true // another read refreshed it meanwhile
	}
	k, err := r.c.lookup(ctx, r.raw.Volume, r.raw.Bucket, r.raw.Name)
	if err != nil || k.ObjectId != r.raw.ObjectId || len(k.Locations) != len(r.raw.Locations) {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tokens == nil {
		r.tokens = map[int][]byte{}
	}
	for i, l := range k.Locations {
		if proto.Equal(l.Id, r.raw.Locations[i].Id) {
			r.tokens[i] = l.Token
		}
	}
	return !bytes.Equal(r.tokens[bi], used)
}

// readSpan reads [rs, re) of a block from one datanode with the block's
// token; it returns the data (in into when into is not nil; it must hold
// re-rs bytes) and the replica's BlockData. The datanode does not verify
// the bytes (client_verifies): the caller must verify them with
// verifyRange.
func (c *Client) readSpan(ctx context.Context, addr string, id *metapb.BlockID, tok []byte, rs, re int64, into []byte) ([]byte, *datanodepb.BlockData, error) {
	dn, err := c.dns.get(addr)
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(blocktoken.WithToken(ctx, tok), c.cfg.RPCTimeout)
	defer cancel()
	st, err := dn.ReadBlock(ctx, &datanodepb.ReadBlockRequest{Block: dnBlockID(id), Offset: uint64(rs), Length: uint64(re - rs), ClientVerifies: true})
	if err != nil {
		return nil, nil, err
	}
	data := into
	if int64(len(data)) != re-rs {
		data = make([]byte, re-rs)
	}
	// Each reply's data is decoded straight into data (readSink).
	sink := &readSink{base: uint64(rs), dst: data}
	if err := st.RecvMsg(sink); err != nil {
		return nil, nil, dnReadErr(err)
	}
	bd := sink.block
	if bd == nil {
		return nil, nil, errors.New("first message of ReadBlock carries no BlockData")
	}
	got := int64(sink.n)
	for {
		sink.base, sink.dst = uint64(rs+got), data[got:]
		err := st.RecvMsg(sink)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, nil, dnReadErr(err)
		}
		got += int64(sink.n)
	}
	if got != int64(len(data)) {
		return nil, nil, fmt.Errorf("ReadBlock returned %d of %d bytes at %d (replica shorter than the key says?)", got, len(data), rs)
	}
	return data, bd, nil
}

// askVerify has the datanode at addr read [off, off+n) of a block with its
// own checksum verification (no client_verifies), so a replica this client
// found corrupt is judged by the datanode that holds it: if the datanode's
// verified read fails too, it marks the container UNHEALTHY, re-verifies
// the block and reports it to SCM itself (SCM condemns a replica on its
// datanode's word, not on a client's, whose memory or network may be what
// is broken). Best effort, in the background, bounded by RPCTimeout.
func (c *Client) askVerify(id *metapb.BlockID, tok []byte, addr string, off, n int64) {
	dn, err := c.dns.get(addr)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(blocktoken.WithToken(context.Background(), tok), c.cfg.RPCTimeout)
	defer cancel()
	st, err := dn.ReadBlock(ctx, &datanodepb.ReadBlockRequest{Block: dnBlockID(id), Offset: uint64(off), Length: uint64(n)})
	if err != nil {
		return
	}
	for {
		if _, err := st.Recv(); err != nil {
			return
		}
	}
}

// dnReadErr turns a datanode's CHECKSUM_MISMATCH (it found its copy
// corrupt) into a corruptError so the replica is reported.
func dnReadErr(err error) error {
	if e := dnErrorOf(err); e != nil && e.Kind == datanodepb.Error_CHECKSUM_MISMATCH {
		return &corruptError{msg: err.Error()}
	}
	return err
}

// alignRange widens [off, end) of a block to whole checksum windows. With
// the block's chunk layout it is exact; without it windows are assumed to
// start at multiples of bpc, which holds for every chunk the client writes
// except after a retry split; verifyRange detects the rest.
//
// blockLen is the block's length in the key, which may be shorter than the
// stored block: a part copied from a range of another key ends with a
// prefix of one of its blocks (CopyKey). The last window of such a prefix
// extends past blockLen; without the layout the guess stops at blockLen,
// verifyRange answers errRealign, and the read is made again with the
// layout, whose windows may run to the stored block's end.
func alignRange(bd *datanodepb.BlockData, bpc, blockLen, off, end int64) (int64, int64) {
	if bd == nil || len(bd.Chunks) == 0 {
		if bpc <= 0 {
			return off, end
		}
		return off - off%bpc, min((end+bpc-1)/bpc*bpc, blockLen)
	}
	rs, re := off, end
	for _, c := range bd.Chunks {
		cs, ce := int64(c.Offset), int64(c.Offset+c.Length)
		w := int64(c.GetChecksum().GetBytesPerChecksum())
		if w <= 0 {
			w = ce - cs
		}
		if cs <= off && off < ce {
			rs = cs + (off-cs)/w*w
		}
		if cs < end && end <= ce {
			re = min(cs+(end-cs+w-1)/w*w, ce)
		}
	}
	return rs, min(re, max(blockLen, int64(bd.Length)))
}

// verifyRange checks every checksum window of bd that overlaps [ns, ne);
// data holds the block from rs.
func verifyRange(bd *datanodepb.BlockData, rs int64, data []byte, ns, ne int64) error {
	re := rs + int64(len(data))
	covered := ns
	chunks := bd.Chunks
	for _, c := range chunks {
		cs, ce := int64(c.Offset), int64(c.Offset+c.Length)
		if ce <= ns || cs >= ne {
			continue
		}
		if cs > covered {
			return fmt.Errorf("block %d/%d has no chunk for bytes [%d, %d)", bd.GetId().GetContainerId(), bd.GetId().GetLocalId(), covered, cs)
		}
		covered = max(covered, ce)
		ck := c.GetChecksum()
		var size int
		switch ck.GetType() {
		case datanodepb.ChecksumType_CHECKSUM_NONE:
			continue
		case datanodepb.ChecksumType_CHECKSUM_CRC32C:
			size = 4
		case datanodepb.ChecksumType_CHECKSUM_SHA256:
			size = sha256.Size
		default:
			return fmt.Errorf("chunk at %d: unknown checksum type %v", cs, ck.GetType())
		}
		w := int64(ck.BytesPerChecksum)
		if w <= 0 {
			return fmt.Errorf("chunk at %d: bytes per checksum is 0", cs)
		}
		i0, i1 := (max(ns, cs)-cs)/w, (min(ne, ce)-1-cs)/w
		for i := i0; i <= i1; i++ {
			ws, we := cs+i*w, min(cs+(i+1)*w, ce)
			if ws < rs || we > re {
				return errRealign
			}
			if int64(len(ck.Sums)) < (i+1)*int64(size) {
				return &corruptError{msg: fmt.Sprintf("chunk at %d has %d bytes of checksums, too few for window %d", cs, len(ck.Sums), i)}
			}
			want := ck.Sums[i*int64(size) : (i+1)*int64(size)]
			p := data[ws-rs : we-rs]
			ok := false
			if size == 4 {
				ok = binary.BigEndian.Uint32(want) == crc32c.Checksum(p)
			} else {
				s := sha256.Sum256(p)
				ok = string(s[:]) == string(want)
			}
			if !ok {
				return &corruptError{msg: fmt.Sprintf("checksum mismatch in block %d/%d window [%d, %d)", bd.GetId().GetContainerId(), bd.GetId().GetLocalId(), ws, we)}
			}
		}
	}
	if covered < ne {
		return fmt.Errorf("block %d/%d has no chunk for bytes [%d, %d) (replica shorter than the key)", bd.GetId().GetContainerId(), bd.GetId().GetLocalId(), covered, ne)
	}
	return nil
}
