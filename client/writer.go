package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	crcc "github.com/basalt-store/basalt/internal/crc32c"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// errPipelineFailed stops a writer waiting for a buffer when its pipeline
// failed: the failed pipeline will not release buffers on its own.
var errPipelineFailed = errors.New("write pipeline failed")

// PutOptions tune one PutKey.
type PutOptions struct {
	// SizeHint is the expected size (0 = unknown); the namespace manager
	// pre-allocates blocks for it.
	SizeHint int64
	// Replication overrides the bucket's.
	Replication Replication
	// Progress, if set, is called on the calling goroutine with the total
	// bytes read from the reader so far.
	Progress func(read int64)
	// BeforeCommit, if set, is called once the data is on every replica,
	// just before the key is committed. Gateways use it to add what only
	// the data decides (an S3 ETag, attributes, a multipart part) to the
	// commit, or to refuse it: an error is returned by PutKey and the key
	// stays uncommitted (its open key expires).
	BeforeCommit func(req *metapb.CommitKeyRequest) error
	// Pipeline overrides Config.Pipeline for this key.
	Pipeline Pipeline
	// DataCRC32C, if set, is called once the data is on every replica,
	// just before BeforeCommit, with the CRC32C (Castagnoli) of the whole
	// key, combined from the chunk checksums the write computed anyway:
	// no second pass over the data. Gateways use it for S3's CRC32C
	// checksum.
	DataCRC32C func(crc uint32)
	// BufferBudget, if set, is shared by the write buffers of every PutKey
	// given it (see BufferBudget): a gateway's bound on its uploads'
	// memory. The PutKey waits for its reserve before reading data.
	BufferBudget *BufferBudget
}

// PutKey writes a key from r, read to EOF, and commits it (replacing any
// key of that name atomically). Nothing is visible until it returns
// without error; on error the key is unchanged.
//
// The write path is o.Pipeline, else Config.Pipeline. With PipelineAuto,
// PutKey first reads up to Config.StreamThreshold bytes: a key that ends
// before that goes through V1, a longer one through V2.
func (c *Client) PutKey(ctx context.Context, volume, bucket, key string, r io.Reader, o PutOptions) (KeyInfo, error) {
	op := "put key " + keyPath(volume, bucket, key)
	if o.SizeHint < 0 {
		return KeyInfo{}, invalidf(op, "size hint %d is negative", o.SizeHint)
	}
	path := o.Pipeline
	switch path {
	case PipelineDefault:
		path = c.cfg.Pipeline
	case PipelineAuto, PipelineV1, PipelineV2:
	default:
		return KeyInfo{}, invalidf(op, "pipeline %d: want auto, v1 or v2", o.Pipeline)
	}
	if path == PipelineV2 && c.noStreams {
		return KeyInfo{}, invalidf(op, "pipeline v2 needs a client certificate (streams); this client authenticates with an access key: use auto or v1")
	}
	auto := path == PipelineAuto
	// small: the whole key, known before anything is written, fits in one
	// chunk: it goes as one PutSmallFile (one call, one pipeline Raft
	// entry) instead of WriteChunk + PutBlock.
	var small []byte
	var smallBuf *buffer // small's pooled buffer
	newOpenReq := func() *metapb.OpenKeyRequest {
		return &metapb.OpenKeyRequest{
			Volume: volume, Bucket: bucket, Key: key, SizeHint: uint64(o.SizeHint),
			Replication: o.Replication.pb(), ChecksumType: metapb.ChecksumType_CRC32C,
			BytesPerChecksum: uint32(c.cfg.BytesPerChecksum), ClientLocation: c.cfg.Location,
		}
	}
	openKey := func(ctx context.Context, req *metapb.OpenKeyRequest) (*metapb.OpenKeyResponse, error) {
		var open *metapb.OpenKeyResponse
		err := c.allocating(ctx, op, func(level int) error {
			req.Exclude = nil
			if level == 0 {
				ex := c.excl.snapshot()
				req.Exclude = ex.proto()
			}
			var err error
			open, err = c.meta.OpenKeyCoalesced(ctx, req)
			return err
		})
		return open, err
	}
	type opened struct {
		open *metapb.OpenKeyResponse
		err  error
	}
	var early chan opened
	var first func() // for peek: starts the early open
	if auto && o.SizeHint >= c.cfg.StreamThreshold {
		// The size hint says V2: the key is opened while the rest of the
		// peek is read, once its first chunk has been read (not before:
		// nothing can give an open key and its blocks back, so a body
		// that fails at once must not have opened one). A body that
		// then ends short uses this open for V1 all the same; one that
		// fails cancels it (an open granted by then expires, as one
		// does when a body fails later).
		openCtx, cancelOpen := context.WithCancel(ctx)
		defer cancelOpen()
		first = func() {
			early = make(chan opened, 1)
			req := newOpenReq()
			go func() {
				open, err := openKey(openCtx, req)
				early <- opened{open, err}
			}()
		}
	}
	if auto {
		pr, short, err := c.peek(ctx, r, first)
		if err != nil {
			return KeyInfo{}, fmt.Errorf("%s: %w", op, err)
		}
		defer pr.release()
		r = pr
		path = PipelineV2
		if short {
			path = PipelineV1
			if early == nil {
				o.SizeHint = int64(len(pr.data))
			}
			if len(pr.data) > 0 && len(pr.data) <= c.cfg.ChunkSize {
				small, smallBuf = pr.data, pr.buf
			}
		}
	}
	var open *metapb.OpenKeyResponse
	var err error
	reserved := false // open is a reserved block (reserve.go)
	if early != nil {
		// The same request as the one below would be (a short body
		// keeps the hint it opened with), so its answer, error
		// included, stands.
		e := <-early
		if e.err != nil {
			return KeyInfo{}, e.err
		}
		open = e.open
	} else if small != nil && c.cfg.ReserveBlocks > 0 {
		open, err = c.takeReserved(ctx, volume, bucket, o.Replication, len(small))
		if err != nil {
			return KeyInfo{}, wrapErr(op, err)
		}
		reserved = open != nil
	}
	if open == nil {
		if open, err = openKey(ctx, newOpenReq()); err != nil {
			return KeyInfo{}, err
		}
	}
	bs := int64(open.BlockSize)
	if c.cfg.BlockSize > 0 && (bs == 0 || c.cfg.BlockSize < bs) {
		bs = c.cfg.BlockSize
	}
	if bs < int64(c.cfg.ChunkSize) {
		return KeyInfo{}, &Error{Op: op, Code: codes.Internal, Msg: fmt.Sprintf("server block size %d is smaller than the chunk size %d", open.BlockSize, c.cfg.ChunkSize), kind: ErrPrecondition}
	}
	// Auto never fails a write for want of streams: datanodes that predate
	// V2 (no stream address) still take V1. An explicit v2 reports them.
	if auto && path == PipelineV2 && (c.noStreams || !streamable(open.Blocks)) {
		path = PipelineV1
	}
	blocks := &blockSource{c: c, op: op, openID: open.OpenId, spares: open.Blocks}
	var committed []*metapb.KeyBlock
	var chunkLists [][]*datanodepb.ChunkInfo // per committed block, for DataCRC32C
	done := false
	if small != nil && int64(len(small)) <= bs {
		committed, err = c.putSmall(ctx, op, blocks, small, smallBuf)
		switch {
		case err == nil:
			done = true
			if o.DataCRC32C != nil {
				o.DataCRC32C(crcc.Checksum(small)) // at most one chunk
			}
			if o.Progress != nil {
				o.Progress(int64(len(small)))
			}
		case !errors.Is(err, errNoSmallFile):
			return KeyInfo{}, err
		}
		// errNoSmallFile: a datanode without PutSmallFile; the usual
		// path below, from the untouched reader.
	}
	switch {
	case done:
	case path == PipelineV2:
		w := newStreamWriter(ctx, c, op, blocks, bs, o.Progress)
		if err := w.pool.admit(ctx, o.BufferBudget); err != nil {
			return KeyInfo{}, fmt.Errorf("%s: waiting for write buffers: %w", op, err)
		}
		defer w.pool.close()
		if err := w.run(r); err != nil {
			return KeyInfo{}, err
		}
		committed, chunkLists = w.committed, w.chunkLists
	default:
		w := newKeyWriter(ctx, c, op, blocks, bs, o.Progress)
		defer w.cancel()
		if err := w.pool.admit(ctx, o.BufferBudget); err != nil {
			return KeyInfo{}, fmt.Errorf("%s: waiting for write buffers: %w", op, err)
		}
		defer w.pool.close()
		if err := w.run(r); err != nil {
			return KeyInfo{}, err
		}
		committed, chunkLists = w.committed, w.chunkLists
	}
	if o.DataCRC32C != nil && !done {
		crc, err := keyCRC32C(committed, chunkLists)
		if err != nil {
			return KeyInfo{}, &Error{Op: op, Code: codes.Internal, Msg: err.Error(), kind: ErrInternal}
		}
		o.DataCRC32C(crc)
	}
	commit := &metapb.CommitKeyRequest{OpenId: open.OpenId, Blocks: committed}
	if reserved {
		commit.Key, commit.Volume, commit.Bucket = key, volume, bucket
	}
	if o.BeforeCommit != nil {
		if err := o.BeforeCommit(commit); err != nil {
			return KeyInfo{}, fmt.Errorf("%s: %w", op, err)
		}
	}
	ki, err := c.meta.CommitKeyCoalesced(ctx, commit)
	if err != nil && ctx.Err() == nil && errors.Is(wrapErr(op, err), ErrOutcomeUnknown) {
		ki, err = c.settleCommit(ctx, op, volume, bucket, key, commit, err)
	}
	if err != nil {
		return KeyInfo{}, wrapErr(op, err)
	}
	info := keyInfoOf(ki)
	info.Pipeline = path.String()
	return info, nil
}

// keyCRC32C combines the CRC32C of a key from the chunk lists of its
// committed blocks (lists[i] holds at least the chunks of blocks[i] up to
// its committed length, in order from offset 0).
func keyCRC32C(blocks []*metapb.KeyBlock, lists [][]*datanodepb.ChunkInfo) (uint32, error) {
	if len(lists) != len(blocks) {
		return 0, fmt.Errorf("key CRC32C: %d chunk lists for %d blocks", len(lists), len(blocks))
	}
	var crc uint32
	for i, b := range blocks {
		var off uint64
		for _, ch := range lists[i] {
			if off == b.Length {
				break
			}
			ck := ch.GetChecksum()
			if ch.Offset != off || off+ch.Length > b.Length || ck.GetType() != datanodepb.ChecksumType_CHECKSUM_CRC32C {
				return 0, fmt.Errorf("key CRC32C: block %v: chunk at %d+%d (checksum %v) does not continue at %d of %d", b.Id, ch.Offset, ch.Length, ck.GetType(), off, b.Length)
			}
			c, ok := crcc.Windows(ck.Sums, int64(ck.BytesPerChecksum), int64(ch.Length))
			if !ok {
				return 0, fmt.Errorf("key CRC32C: block %v: chunk at %d has %d bytes of sums for %d bytes in windows of %d", b.Id, ch.Offset, len(ck.Sums), ch.Length, ck.BytesPerChecksum)
			}
			crc = crcc.Combine(crc, c, int64(ch.Length))
			off += ch.Length
		}
		if off != b.Length {
			return 0, fmt.Errorf("key CRC32C: block %v: chunks cover %d of %d bytes", b.Id, off, b.Length)
		}
	}
	return crc, nil
}

// errNoSmallFile: the pipeline's leader does not implement PutSmallFile.
var errNoSmallFile = errors.New("datanode does not implement PutSmallFile")

// putSmall writes data, a whole key of at most one chunk, as one block with
// one PutSmallFile call: the datanode writes and commits it with a single
// Raft entry and answers once every replica has it. Failures are handled
// like the other paths' (classify, exclude, next block, bounded retries).
// It returns errNoSmallFile, with the block given back to blocks, if the
// datanode predates PutSmallFile. buf, if not nil, is data's pooled
// buffer: the coalescer holds a reference to it while a PutSmallFiles call
// may still read data, after this writer gave up and released its own.
func (c *Client) putSmall(ctx context.Context, op string, blocks *blockSource, data []byte, buf *buffer) ([]*metapb.KeyBlock, error) {
	cks := storage.Checksum{Type: storage.ChecksumCRC32C, BytesPerChecksum: c.cfg.BytesPerChecksum}
	sums := cks.Compute(data)
	n := uint64(len(data))
	chunk := &datanodepb.ChunkInfo{Offset: 0, Length: n, Checksum: &datanodepb.ChecksumData{
		Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: sums.BytesPerChecksum, Sums: sums.Sums}}
	wait := c.cfg.WaitAllTimeout
	for {
		loc, err := blocks.next(ctx)
		if err != nil {
			return nil, err
		}
		req := &datanodepb.PutSmallFileRequest{
			PipelineId: loc.PipelineId, WaitTimeoutMs: uint32(wait / time.Millisecond), Data: data,
			Block: &datanodepb.BlockData{Id: dnBlockID(loc.Id), Length: n, Chunks: []*datanodepb.ChunkInfo{chunk}},
		}
		_, err = c.callLeaderAt(ctx, loc, wait+c.cfg.RPCTimeout, func(ctx context.Context, addr string, cc *grpc.ClientConn) error {
			if c.cfg.SmallFilesInFlight > 0 {
				file := &datanodepb.SmallFile{Block: req.Block, Data: data, Token: loc.Token}
				err := c.putSmallBatched(ctx, addr, cc, loc.PipelineId, req.WaitTimeoutMs, file, buf)
				if !errors.Is(err, errNoSmallBatch) {
					return err
				}
			}
			_, err := datanodepb.NewDatanodeClient(cc).PutSmallFile(ctx, req)
			return err
		})
		if err == nil {
			return []*metapb.KeyBlock{{Id: loc.Id, Length: n}}, nil
		}
		if status.Code(err) == codes.Unimplemented {
			blocks.spares = append([]*metapb.BlockLocation{loc}, blocks.spares...)
			return nil, errNoSmallFile
		}
		err = fmt.Errorf("put small file %d/%d of %d bytes: %w", loc.Id.GetContainerId(), loc.Id.GetLocalId(), n, err)
		if ferr := blocks.failed(ctx, classify(ctx, loc, err)); ferr != nil {
			return nil, ferr
		}
	}
}

// peek reads up to StreamThreshold bytes of r into a pooled buffer and
// returns a reader that yields them and then the rest of r; short says r
// ended before the threshold (so the whole key is in the buffer).
//
// first, if not nil, is called once the first chunk (ChunkSize bytes, or
// all of them if StreamThreshold is smaller) has been read whole and more
// is to be read; not on a failure or a body that ends within it.
func (c *Client) peek(ctx context.Context, r io.Reader, first func()) (pr *prefixReader, short bool, err error) {
	buf, err := newBufPool(int(c.cfg.StreamThreshold), 1).get(ctx, nil)
	if err != nil {
		return nil, false, err
	}
	head := min(len(buf.data), c.cfg.ChunkSize)
	n, eof, err := readFull(r, buf.data[:head])
	if err == nil && !eof {
		if first != nil && head < len(buf.data) {
			first()
		}
		var m int
		m, eof, err = readFull(r, buf.data[head:])
		n += m
	}
	switch {
	case err != nil:
		buf.unref()
		return nil, false, fmt.Errorf("reading the data at offset %d: %w", n, err)
	case eof:
		// Do not read r again: the key is complete.
		return &prefixReader{buf: buf, data: buf.data[:n], r: eofReader{}}, true, nil
	}
	return &prefixReader{buf: buf, data: buf.data[:n], r: r}, false, nil
}

// readFull reads into b until b is full or r ends; eof says r returned
// io.EOF (n may then be short of len(b)). Any other error of r is
// returned as such, io.ErrUnexpectedEOF included: io.ReadFull turns a
// short last read into that error too, so with it a reader's own
// (net/http's body of a truncated upload) looked like the end of the
// data, and a truncated key was committed.
func readFull(r io.Reader, b []byte) (n int, eof bool, err error) {
	for n < len(b) {
		m, err := r.Read(b[n:])
		n += m
		if err == io.EOF {
			return n, true, nil
		}
		if err != nil {
			return n, false, err
		}
	}
	return n, false, nil
}

// prefixReader yields data, then r. It returns its buffer to the pool as
// soon as the prefix has been read, so a long V2 write does not hold it.
type prefixReader struct {
	buf  *buffer
	data []byte
	r    io.Reader
}

func (p *prefixReader) Read(b []byte) (int, error) {
	if p.buf == nil {
		return p.r.Read(b)
	}
	n := copy(b, p.data)
	p.data = p.data[n:]
	if len(p.data) == 0 {
		p.release()
	}
	return n, nil
}

// release returns the buffer if the prefix was not read to its end.
func (p *prefixReader) release() {
	if p.buf != nil {
		p.buf.unref()
		p.buf, p.data = nil, nil
	}
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

// blockSource hands a key's writer its blocks: the pre-allocated ones that
// avoid the exclude list, then new ones from AllocateBlock. It also keeps
// the key's retry budget: both write paths retry the same way.
type blockSource struct {
	c       *Client
	op      string
	openID  uint64
	spares  []*metapb.BlockLocation // allocated, not yet used
	exclude excludeList
	retries int
	// notReadySince: the first pipeline-not-ready failure of the key.
	notReadySince time.Time
}

// next returns the next block to write, avoiding what this key and the
// whole client (Client.Excluded) found failing.
func (s *blockSource) next(ctx context.Context) (*metapb.BlockLocation, error) {
	shared := s.c.excl.snapshot()
	for len(s.spares) > 0 {
		b := s.spares[0]
		s.spares = s.spares[1:]
		if !s.exclude.excludes(b) && !shared.excludes(b) && len(b.Datanodes) > 0 {
			return b, nil
		}
	}
	var r *metapb.AllocateBlockResponse
	err := s.c.allocating(ctx, s.op, func(level int) error {
		var ex excludeList
		switch level {
		case 0:
			ex = s.exclude.union(s.c.excl.snapshot())
		case 1:
			ex = s.exclude
		default:
			// Nothing left but the pipelines this key gave up on: try
			// them again (they may have been new, or their leader
			// elected since); failed datanodes and containers stay out.
			ex = excludeList{datanodes: s.exclude.datanodes, containers: s.exclude.containers}
		}
		var err error
		r, err = s.c.ns.AllocateBlock(ctx, &metapb.AllocateBlockRequest{OpenId: s.openID, Exclude: ex.proto(), ClientLocation: s.c.cfg.Location})
		return err
	})
	if err != nil {
		if !s.exclude.empty() {
			err = fmt.Errorf("%w (allocating a block excluding %s after %d failures)", err, &s.exclude, s.retries)
		}
		return nil, err
	}
	if len(r.GetBlock().GetDatanodes()) == 0 {
		return nil, &Error{Op: s.op, Code: codes.Internal, Msg: fmt.Sprintf("allocated block %v has no datanodes", r.GetBlock().GetId()), kind: ErrUnavailable}
	}
	return r.Block, nil
}

// failed takes one retry for f: it returns the error to give up with (f
// is fatal, ctx ended, or the retries are spent), else records what f
// implicates in the exclude list.
func (s *blockSource) failed(ctx context.Context, f *failure) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w", s.op, ctx.Err())
	}
	if f.fatal {
		return wrapErr(s.op, f.err)
	}
	s.exclude.apply(f)
	if f.notReady {
		if s.notReadySince.IsZero() {
			s.notReadySince = time.Now()
		}
		if time.Since(s.notReadySince) < s.c.cfg.AllocateWait {
			s.c.log.Info("basalt client: pipeline not ready; trying another", "key", s.op, "err", f.err)
			if !sleepCtx(ctx, 50*time.Millisecond+rand.N(100*time.Millisecond)) {
				return fmt.Errorf("%s: %w", s.op, ctx.Err())
			}
			return nil
		}
	}
	s.retries++
	if !f.keyOnly {
		s.c.excl.add(f)
	}
	if s.retries > s.c.cfg.MaxBlockRetries {
		return &Error{Op: s.op, Code: codes.Unavailable, kind: ErrWriteFailed,
			Msg: fmt.Sprintf("gave up after %d block re-allocations (excluded %s); last failure: %v", s.c.cfg.MaxBlockRetries, &s.exclude, f.err)}
	}
	s.c.log.Warn("basalt client: write failed; retrying on a new block", "key", s.op, "attempt", s.retries, "err", f.err, "exclude", s.exclude.String())
	return nil
}

// failure is a classified write failure: what to exclude, or fatal.
type failure struct {
	err   error
	fatal bool
	// notReady: the pipeline is not (yet) known to its datanodes, as
	// right after SCM created it; it is avoided for this key, but neither
	// client-wide nor against the retry budget while AllocateWait lasts.
	notReady bool
	// keyOnly: avoided for this key but not client-wide (a refused
	// block token says nothing about the pipeline's health).
	keyOnly bool
	// stale: a V2 stream's kept connection ended before its header was
	// answered (stream.CodeStale); the datanodes are excluded only if the
	// segment's one stale retry is spent (streamWriter.recover).
	stale     bool
	datanodes []uint64
	pipeline  uint64
	container uint64
}

func (f *failure) Error() string { return f.err.Error() }
func (f *failure) Unwrap() error { return f.err }

// classify decides what a failed call on blk implicates (Ozone's
// KeyOutputStream.handleException): a whole pipeline for timeouts, lagging
// replicas and unreachable leaders; a container when it is closed or full;
// the datanodes that were unreachable or lagging.
func classify(ctx context.Context, blk *metapb.BlockLocation, err error) *failure {
	f := &failure{err: err}
	if ctx.Err() != nil {
		f.fatal = true
		return f
	}
	var le *leaderError
	if errors.As(err, &le) {
		f.datanodes = le.unreachable
		f.pipeline = blk.PipelineId
		return f
	}
	if e := dnErrorOf(err); e != nil {
		switch e.Kind {
		case datanodepb.Error_CONTAINER_NOT_OPEN, datanodepb.Error_CONTAINER_FULL, datanodepb.Error_NO_SUCH_CONTAINER:
			f.container = blk.GetId().GetContainerId()
		case datanodepb.Error_REPLICAS_LAG:
			f.datanodes = e.Lagging
			f.pipeline = blk.PipelineId
		case datanodepb.Error_REPLICA_FAILED:
			// Replicas that could not store the block (their container is
			// UNHEALTHY there): write it again elsewhere.
			f.datanodes = e.Failed
			f.pipeline = blk.PipelineId
			f.container = blk.GetId().GetContainerId()
		case datanodepb.Error_DISK_FULL:
			// The answering datanode (the leader) has no room: no
			// pipeline with it will take data, so exclude the datanode,
			// not just this container (a full datanode used to cost a
			// key all its retries).
			f.pipeline = blk.PipelineId
			var a *dnAnswer
			if errors.As(err, &a) && a.datanode != 0 {
				f.datanodes = []uint64{a.datanode}
			}
		case datanodepb.Error_BAD_REQUEST:
			f.fatal = true
		case datanodepb.Error_OUTCOME_UNKNOWN:
			// The entry may still commit: writing the data again elsewhere
			// would hide that from the caller. Fail the key.
			f.fatal = true
		case datanodepb.Error_PIPELINE_NOT_FOUND:
			f.pipeline = blk.PipelineId
			f.notReady = true
		case datanodepb.Error_TOKEN_INVALID, datanodepb.Error_TOKEN_EXPIRED:
			// The block's token, not the pipeline, is at fault (it
			// expired during a long write, or the datanode has not yet
			// received the key that signed it): a new allocation brings
			// a fresh token. Avoid the pipeline for this key only; other
			// keys' tokens are fine.
			f.pipeline = blk.PipelineId
			f.keyOnly = true
		default: // NOT_LEADER with no leader, IO_ERROR, CHECKSUM_MISMATCH, ...
			f.pipeline = blk.PipelineId
		}
		return f
	}
	switch status.Code(err) {
	case codes.DeadlineExceeded, codes.Unavailable, codes.Internal, codes.Unknown, codes.Aborted, codes.ResourceExhausted, codes.Canceled:
		f.pipeline = blk.PipelineId
	default:
		f.fatal = true
	}
	return f
}

// blockState is a block being written.
type blockState struct {
	loc       *metapb.BlockLocation
	written   int64                   // bytes assigned to it
	infos     []*datanodepb.ChunkInfo // every chunk assigned, in order
	acked     int64                   // length committed on all replicas (committer only)
	finalized bool                    // listed in committed (committer, or recovery)
}

// chunk is one WriteChunk: a slice of a pooled buffer.
type chunk struct {
	buf  *buffer
	data []byte
	blk  *blockState
	info *datanodepb.ChunkInfo
	done chan error // one value when the WriteChunk call returned
}

// flushReq asks the committer to PutBlock blk at length, once chunks have
// been acknowledged.
type flushReq struct {
	blk    *blockState
	length int64
	infos  []*datanodepb.ChunkInfo
	chunks []*chunk
	final  bool
}

// keyWriter is one PutKey. The calling goroutine reads, cuts chunks and
// starts their WriteChunk calls; a committer goroutine waits for them in
// order and sends the PutBlocks, releasing buffers as blocks are committed
// on every replica. On a failure the pipeline is stopped and drained, the
// writer excludes what failed, takes a new block and resubmits every
// chunk not yet committed, from its buffers.
type keyWriter struct {
	c         *Client
	ctx       context.Context
	cancel    context.CancelFunc
	op        string
	blockSize int64
	cks       storage.Checksum
	pool      *bufPool
	sem       chan struct{}
	progress  func(int64)

	blocks  *blockSource
	cur     *blockState
	unflush []*chunk // chunks of cur since its last flush request

	// The pipeline; replaced after a failure once everything stopped.
	flushCh   chan *flushReq
	committer sync.WaitGroup
	calls     sync.WaitGroup
	failMu    sync.Mutex
	failure   *failure
	failCh    chan struct{}

	pendMu  sync.Mutex
	pending []*chunk // submitted and not committed, in key order

	committed  []*metapb.KeyBlock // committer (and recovery) only
	chunkLists [][]*datanodepb.ChunkInfo
}

func newKeyWriter(ctx context.Context, c *Client, op string, blocks *blockSource, blockSize int64, progress func(int64)) *keyWriter {
	ctx, cancel := context.WithCancel(ctx)
	n := int(c.cfg.MaxBufferBytes / int64(c.cfg.ChunkSize))
	return &keyWriter{
		c: c, ctx: ctx, cancel: cancel, op: op, blockSize: blockSize,
		cks:  storage.Checksum{Type: storage.ChecksumCRC32C, BytesPerChecksum: c.cfg.BytesPerChecksum},
		pool: newBufPool(c.cfg.ChunkSize, n), sem: make(chan struct{}, c.cfg.MaxInflightChunks),
		progress: progress, blocks: blocks,
	}
}

func (w *keyWriter) start() {
	w.failure = nil
	w.failCh = make(chan struct{})
	// Every request but a final empty one holds a buffer, so this never
	// fills.
	w.flushCh = make(chan *flushReq, cap(w.pool.slots)+2)
	w.committer.Add(1)
	go w.commitLoop(w.flushCh)
}

// stop waits until the committer and every call have finished.
func (w *keyWriter) stop() {
	close(w.flushCh)
	w.committer.Wait()
	w.calls.Wait()
}

func (w *keyWriter) fail(f *failure) {
	w.failMu.Lock()
	defer w.failMu.Unlock()
	if w.failure == nil {
		w.failure = f
		close(w.failCh)
	}
}

func (w *keyWriter) failed() bool {
	select {
	case <-w.failCh:
		return true
	default:
		return false
	}
}

func (w *keyWriter) run(r io.Reader) error {
	w.start()
	var read int64
	eof := false
	for !eof {
		if w.failed() {
			w.stop()
			if err := w.recover(); err != nil {
				return err
			}
			continue
		}
		room := int64(w.c.cfg.ChunkSize)
		if w.cur != nil && w.cur.written < w.blockSize {
			room = min(room, w.blockSize-w.cur.written)
		}
		buf, err := w.pool.tryGet()
		if errors.Is(err, errBudgetFull) && len(w.unflush) > 0 && w.cur != nil {
			// No buffer free (the pool's cap, or the shared budget): have
			// what is written committed, so that its buffers come back.
			if err := w.flush(false); err != nil {
				w.stop()
				return err
			}
		}
		if err != nil {
			buf, err = w.pool.get(w.ctx, w.failCh)
		}
		if errors.Is(err, errPipelineFailed) {
			continue
		}
		if err != nil {
			w.stop()
			return fmt.Errorf("%s: %w", w.op, err)
		}
		n, end, rerr := readFull(r, buf.data[:room])
		eof = end
		if rerr != nil {
			buf.unref()
			w.stop()
			return fmt.Errorf("%s: reading the data at offset %d: %w", w.op, read, rerr)
		}
		if n > 0 {
			read += int64(n)
			err = w.submit(buf, buf.data[:n])
		}
		buf.unref()
		if err != nil {
			w.stop()
			return err
		}
		if w.progress != nil && n > 0 {
			w.progress(read)
		}
	}
	for {
		if w.cur != nil {
			if err := w.flush(true); err != nil {
				w.stop()
				return err
			}
		}
		w.stop()
		if w.failure == nil {
			return nil
		}
		if err := w.recover(); err != nil {
			return err
		}
	}
}

// submit cuts data (a slice of buf) into chunks of the current blocks and
// starts their WriteChunk calls.
func (w *keyWriter) submit(buf *buffer, data []byte) error {
	for len(data) > 0 {
		if w.cur == nil || w.cur.written == w.blockSize {
			if err := w.nextBlock(); err != nil {
				return err
			}
		}
		b := w.cur
		n := min(int64(len(data)), w.blockSize-b.written)
		ch := &chunk{buf: buf, data: data[:n], blk: b, done: make(chan error, 1),
			info: &datanodepb.ChunkInfo{Offset: uint64(b.written), Length: uint64(n)}}
		buf.ref()
		b.written += n
		b.infos = append(b.infos, ch.info)
		w.unflush = append(w.unflush, ch)
		w.pendMu.Lock()
		w.pending = append(w.pending, ch)
		w.pendMu.Unlock()
		if err := w.send(ch); err != nil {
			return err
		}
		data = data[n:]
		var since int64
		for _, u := range w.unflush {
			since += int64(len(u.data))
		}
		if b.written == w.blockSize || since >= w.c.cfg.FlushBytes {
			if err := w.flush(b.written == w.blockSize); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *keyWriter) send(ch *chunk) error {
	select {
	case w.sem <- struct{}{}:
	case <-w.ctx.Done():
		ch.done <- w.ctx.Err()
		return fmt.Errorf("%s: %w", w.op, w.ctx.Err())
	}
	if w.failed() {
		// Do not load a pipeline known to be failing; recovery resends.
		<-w.sem
		ch.done <- errPipelineFailed
		return nil
	}
	w.calls.Add(1)
	go func() {
		defer w.calls.Done()
		defer func() { <-w.sem }()
		err := w.writeChunk(ch)
		if err != nil {
			w.fail(classify(w.ctx, ch.blk.loc, err))
		}
		ch.done <- err
	}()
	return nil
}

func (w *keyWriter) writeChunk(ch *chunk) error {
	// Checksums are computed here, on the call's goroutine, so several
	// chunks are summed in parallel.
	sums := w.cks.Compute(ch.data)
	ch.info.Checksum = &datanodepb.ChecksumData{Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: sums.BytesPerChecksum, Sums: sums.Sums}
	loc := ch.blk.loc
	req := &datanodepb.WriteChunkRequest{PipelineId: loc.PipelineId, Block: dnBlockID(loc.Id), Chunk: ch.info, Data: ch.data}
	_, err := w.c.callLeader(w.ctx, loc, w.c.cfg.RPCTimeout, func(ctx context.Context, dn datanodepb.DatanodeClient) error {
		_, err := dn.WriteChunk(ctx, req)
		return err
	})
	if err != nil {
		return fmt.Errorf("write chunk at %d of block %d/%d: %w", ch.info.Offset, loc.Id.GetContainerId(), loc.Id.GetLocalId(), err)
	}
	return nil
}

// flush hands the current block's chunks since the last flush to the
// committer; final ends the block.
func (w *keyWriter) flush(final bool) error {
	b := w.cur
	req := &flushReq{blk: b, length: b.written, infos: b.infos[:len(b.infos):len(b.infos)], chunks: w.unflush, final: final}
	w.unflush = nil
	if final {
		w.cur = nil
	}
	select {
	case w.flushCh <- req:
		return nil
	case <-w.ctx.Done():
		return fmt.Errorf("%s: %w", w.op, w.ctx.Err())
	}
}

func (w *keyWriter) commitLoop(reqs <-chan *flushReq) {
	defer w.committer.Done()
	for req := range reqs {
		if w.failed() {
			continue // recovery resends everything still pending
		}
		var err error
		for _, ch := range req.chunks {
			if e := <-ch.done; e != nil && err == nil {
				err = e
			}
		}
		if err != nil {
			continue // the call recorded the failure
		}
		if req.length > req.blk.acked {
			if err := w.putBlock(req); err != nil {
				w.fail(classify(w.ctx, req.blk.loc, err))
				continue
			}
			req.blk.acked = req.length
		}
		if req.final && req.blk.acked > 0 && !req.blk.finalized {
			req.blk.finalized = true
			w.committed = append(w.committed, &metapb.KeyBlock{Id: req.blk.loc.Id, Length: uint64(req.blk.acked)})
			w.chunkLists = append(w.chunkLists, req.infos)
		}
		w.pendMu.Lock()
		if len(w.pending) < len(req.chunks) || (len(req.chunks) > 0 && w.pending[0] != req.chunks[0]) {
			w.pendMu.Unlock()
			panic("client: flush requests out of order with pending chunks")
		}
		done := w.pending[:len(req.chunks)]
		w.pending = w.pending[len(req.chunks):]
		w.pendMu.Unlock()
		for _, ch := range done {
			ch.buf.unref()
		}
	}
}

func (w *keyWriter) putBlock(req *flushReq) error {
	loc := req.blk.loc
	wait := w.c.cfg.WaitAllTimeout
	pb := &datanodepb.PutBlockRequest{
		PipelineId: loc.PipelineId, WaitAll: true, WaitTimeoutMs: uint32(wait / time.Millisecond),
		Block: &datanodepb.BlockData{Id: dnBlockID(loc.Id), Length: uint64(req.length), Chunks: req.infos},
	}
	_, err := w.c.callLeader(w.ctx, loc, wait+w.c.cfg.RPCTimeout, func(ctx context.Context, dn datanodepb.DatanodeClient) error {
		_, err := dn.PutBlock(ctx, pb)
		return err
	})
	if err != nil {
		return fmt.Errorf("put block %d/%d at length %d: %w", loc.Id.GetContainerId(), loc.Id.GetLocalId(), req.length, err)
	}
	return nil
}

// nextBlock makes the next block current.
func (w *keyWriter) nextBlock() error {
	loc, err := w.blocks.next(w.ctx)
	if err != nil {
		return err
	}
	w.cur = &blockState{loc: loc}
	return nil
}

// recover handles the failure that stopped the pipeline (stopped and
// drained by the caller): it excludes what failed, ends the blocks at what
// all their replicas committed, and resubmits the rest on a new block. On
// success the pipeline runs again.
func (w *keyWriter) recover() error {
	f := w.failure
	if f == nil {
		w.start()
		return nil
	}
	if err := w.blocks.failed(w.ctx, f); err != nil {
		w.releasePending()
		return err
	}

	pending := w.pending
	w.pending = nil
	// A block keeps what every replica committed and is never extended:
	// list it at that length (in key order) and write the rest elsewhere.
	end := func(b *blockState) {
		if b != nil && !b.finalized && b.acked > 0 {
			b.finalized = true
			w.committed = append(w.committed, &metapb.KeyBlock{Id: b.loc.Id, Length: uint64(b.acked)})
			w.chunkLists = append(w.chunkLists, b.infos)
		}
	}
	for _, ch := range pending {
		end(ch.blk)
	}
	end(w.cur)
	w.cur, w.unflush = nil, nil
	w.start()
	for i, ch := range pending {
		if err := w.submit(ch.buf, ch.data); err != nil {
			for _, rest := range pending[i:] {
				rest.buf.unref()
			}
			w.stop()
			return err
		}
		ch.buf.unref()
	}
	return nil
}

// releasePending returns the buffers of chunks that will never commit.
func (w *keyWriter) releasePending() {
	for _, ch := range w.pending {
		ch.buf.unref()
	}
	w.pending = nil
}
