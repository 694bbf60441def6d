package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
)

// StreamInfo describes a V2 stream as it opens (Config.OnStream).
type StreamInfo struct {
	ContainerID, LocalID uint64
	PipelineID           uint64
	// Offset is where the stream starts in the block: 0, or the length
	// already committed when a block is extended segment by segment.
	Offset uint64
	// Route is the chain of datanode IDs, nearest to Config.Location
	// first: the client sends to Route[0], which forwards to Route[1], ...
	Route []uint64
}

// streamable reports whether every datanode of the key's first block
// serves V2 streams.
func streamable(blocks []*metapb.BlockLocation) bool {
	if len(blocks) == 0 {
		return false
	}
	for _, d := range blocks[0].GetDatanodes() {
		if d.GetStreamAddr() == "" {
			return false
		}
	}
	return true
}

// streamPacketSize picks the stream's packet payload: the stream default
// (1 MiB) when it divides the chunk, else the largest divisor of the chunk
// that is a whole number of checksum windows and fits a packet. A chunk is
// a whole number of packets so that the stream's chunk list cuts the block
// exactly where V1's WriteChunks would.
func streamPacketSize(chunk, bpc int) int {
	if chunk%stream.DefaultPacketSize == 0 && stream.DefaultPacketSize%bpc == 0 {
		return stream.DefaultPacketSize
	}
	for k := 1; ; k++ {
		if p := chunk / k; chunk%k == 0 && p%bpc == 0 && p <= stream.MaxPacketSize {
			return p
		}
	}
}

// piece is read data waiting to be committed: a slice of a pooled buffer.
type piece struct {
	buf  *buffer
	data []byte
}

// streamBlock is the block a V2 writer is filling.
type streamBlock struct {
	loc   *metapb.BlockLocation
	route []stream.Target
	// length and chunks are what every replica committed (PutBlock with
	// wait_all returned); a new segment's stream starts at length.
	length int64
	chunks []*datanodepb.ChunkInfo
}

// streamWriter is one PutKey on the V2 path (seed 000, Ozone's
// BlockDataStreamOutput). It runs on the caller's goroutine:
//
//	read a chunk into a pooled buffer → stream.Writer.Write (the chain
//	acks it, bounded by the stream's window) → … → at the segment's end
//	Close (every datanode synced) → PutBlock wait_all through the
//	pipeline's leader → release the segment's buffers.
//
// A segment is what the buffer pool holds (Config.MaxBufferBytes, whole
// chunks) or the rest of the block, whichever is smaller: until PutBlock
// commits it, a segment's data exists on no replica for certain (a failed
// stream discards its partial block everywhere), so the client must keep
// it to resend. A block longer than a segment is extended by the next
// segment's stream from its committed length.
//
// On a failure the stream is aborted, the datanode it names (or the
// pipeline or container) goes on the key's exclude list, the block keeps
// the length last committed on all its replicas, and the segment is
// written again from the buffers to a new block; at most
// Config.MaxBlockRetries times per key, as in V1. A kept connection that
// ended before the stream's header was answered (stream.CodeStale: a
// datanode closed it idle as the header crossed) excludes nothing and
// spends no retry, at most once per segment and once per datanode per key
// (recover).
type streamWriter struct {
	c         *Client
	ctx       context.Context
	op        string
	blocks    *blockSource
	blockSize int64
	segMax    int64
	pool      *bufPool
	opts      stream.Options
	progress  func(int64)

	cur    *streamBlock
	w      *stream.Writer // open on cur; nil between segments
	seg    []piece        // the segment's data, uncommitted, in order
	segLen int64
	// snd, while not nil, is the segment's sender: a goroutine that opens
	// the stream on cur and writes the segment's pieces to it as they are
	// read. The reading goes on meanwhile (into the segment's buffers,
	// bounded as always by the pool and the segment), so neither the
	// connection and handshake of every hop (tens of ms each on a busy
	// host) nor sealing and writing to the first hop stop it. commit
	// waits for the sender to have written everything, then closes w.
	snd *sender

	committed  []*metapb.KeyBlock
	chunkLists [][]*datanodepb.ChunkInfo // per committed block

	// staleRetried: the segment was already sent again after a
	// stream.CodeStale failure (a kept connection that ended before the
	// header was answered); a second one is a failure like any other.
	staleRetried bool
	// staleFrom: the datanodes (0: none named) a CodeStale of this key
	// named; a second one naming the same datanode is a failure like any
	// other, so a datanode cannot dodge exclusion by ending every kept
	// connection as the header crosses.
	staleFrom map[uint64]bool
	// freshRoutes: the routes (routeKey) a CodeStale of this key came
	// from; every later stream of the key on one of them opens on new
	// connections (Options.Fresh), where "stale" cannot be said.
	freshRoutes map[string]bool
	// fresh: the next stream (the stale one's retry, whatever its route)
	// opens on new connections.
	fresh bool
}

// routeKey names a route (its datanodes in order, as the stream pool
// keys connections) for streamWriter.freshRoutes.
func routeKey(route []stream.Target) string {
	var b strings.Builder
	for _, t := range route {
		fmt.Fprintf(&b, "%d@%s|", t.ID, t.Addr)
	}
	return b.String()
}

// sender opens one stream and writes a segment's pieces to it, in order,
// on a goroutine of its own (streamWriter.snd).
type sender struct {
	pieces chan []byte    // closed by finish: nothing more to write
	stop   chan struct{}  // closed by halt: stop between pieces
	done   chan struct{}  // closed when the goroutine ended
	w      *stream.Writer // set before done; nil if the stream did not open
	err    error          // set before done: why it ended early

	mu     sync.Mutex
	live   *stream.Writer // = w once open, for halt to interrupt
	halted bool
	// cancel ends the dial's context: halt interrupts a dial under way
	// (connection, handshakes, the header's exchange along the chain).
	cancel context.CancelFunc
}

func (s *sender) run(dial func() (*stream.Writer, error)) {
	defer close(s.done)
	sw, err := dial()
	s.cancel() // Dial uses its context only until it returns
	if err != nil {
		s.err = err
		return
	}
	s.w = sw
	s.mu.Lock()
	s.live = sw
	stopped := s.halted
	s.mu.Unlock()
	if stopped {
		return
	}
	for {
		select {
		case <-s.stop:
			return
		case b, ok := <-s.pieces:
			if !ok {
				return
			}
			if _, err := sw.Write(b); err != nil {
				s.err = err
				return
			}
		}
	}
}

// streamDial is stream.Dial; tests hold it.
var streamDial = stream.Dial

// queue hands b to the sender, or returns why it ended early.
func (s *sender) queue(b []byte) error {
	select {
	case s.pieces <- b:
		return nil
	case <-s.done:
		return s.err
	}
}

func newStreamWriter(ctx context.Context, c *Client, op string, blocks *blockSource, blockSize int64, progress func(int64)) *streamWriter {
	n := c.cfg.MaxBufferBytes / int64(c.cfg.ChunkSize)
	return &streamWriter{
		c: c, ctx: ctx, op: op, blocks: blocks, blockSize: blockSize,
		segMax: n * int64(c.cfg.ChunkSize), pool: newBufPool(c.cfg.ChunkSize, int(n)), progress: progress,
		opts: stream.Options{
			PacketSize: streamPacketSize(c.cfg.ChunkSize, c.cfg.BytesPerChecksum), ChunkSize: c.cfg.ChunkSize,
			BytesPerChecksum: c.cfg.BytesPerChecksum, Timeout: c.cfg.StreamTimeout, TLS: c.streamTLS,
			Watch: c.streamWatch, Pool: c.streamPool,
		},
	}
}

// room is how many more bytes the current segment may take: it ends at
// segMax or at the end of its block (the next block's, when the current
// one is full).
func (w *streamWriter) room() int64 {
	var base int64
	if w.cur != nil && w.cur.length < w.blockSize {
		base = w.cur.length
	}
	return min(w.segMax, w.blockSize-base) - w.segLen
}

func (w *streamWriter) run(r io.Reader) error {
	defer w.drop()
	var read int64
	for {
		// Only a segment's last piece is short (room or EOF cut it, and
		// the segment is committed right after), so a segment never needs
		// more buffers than the pool has.
		buf, err := w.pool.tryGet()
		if errors.Is(err, errBudgetFull) && w.segLen > 0 {
			// No buffer free (the shared budget): commit the segment so
			// far (its buffers come back); the next one extends the block.
			if err := w.commit(); err != nil {
				return err
			}
		}
		if err != nil {
			buf, err = w.pool.get(w.ctx, nil)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", w.op, err)
		}
		n, eof, rerr := readFull(r, buf.data[:min(int64(len(buf.data)), w.room())])
		if rerr != nil {
			buf.unref()
			return fmt.Errorf("%s: reading the data at offset %d: %w", w.op, read, rerr)
		}
		if n == 0 {
			buf.unref()
		} else {
			read += int64(n)
			if err := w.write(piece{buf: buf, data: buf.data[:n]}); err != nil {
				return err
			}
			if w.progress != nil {
				w.progress(read)
			}
		}
		if w.segLen > 0 && (eof || w.room() == 0) {
			if err := w.commit(); err != nil {
				return err
			}
		}
		if eof {
			w.endBlock()
			return nil
		}
	}
}

// write adds p to the segment and sends what the open stream has not yet
// had; while the stream is still being opened it returns at once (the
// caller reads on). On a failure it moves the segment to a new block.
func (w *streamWriter) write(p piece) error {
	w.seg = append(w.seg, p)
	w.segLen += int64(len(p.data))
	var err error
	if w.snd == nil {
		err = w.open() // queues the whole segment, p included
	} else {
		err = w.snd.queue(p.data)
	}
	if err != nil {
		return w.recover(err)
	}
	return nil
}

// finish waits until the sender wrote every piece queued and hands its
// stream to w.w (for Close, or for recover to abort it).
func (w *streamWriter) finish() error {
	s := w.snd
	w.snd = nil
	close(s.pieces)
	<-s.done
	w.w = s.w
	if s.err == nil && s.w == nil {
		s.err = errors.New("stream: sender ended without a stream")
	}
	return s.err
}

// halt stops the sender, if any: a dial under way is cancelled, a Write
// under way is interrupted (Writer.Interrupt: one waiting for acks or
// window returns at once; one that only fills the packet buffer completes,
// the stream is aborted after), and the sender stops between pieces. It
// hands the stream, if it opened, to w.w for the caller to abort. Only
// drop (the body's read failed, or the put ended otherwise) halts a live
// sender; recover halts one that already ended.
func (w *streamWriter) halt() {
	s := w.snd
	if s == nil {
		return
	}
	w.snd = nil
	close(s.stop)
	// The stream is to be aborted: a write waiting for acks (a stalled
	// chain) ends now rather than at its timeout.
	s.mu.Lock()
	s.halted = true
	s.cancel()
	if s.live != nil {
		s.live.Interrupt()
	}
	s.mu.Unlock()
	<-s.done
	if s.w != nil {
		if w.w != nil {
			w.w.Abort()
		}
		w.w = s.w
	}
}

// open starts a sender: it opens a stream on the current block at its
// committed length and writes the segment's pieces (all those read so
// far are queued now).
func (w *streamWriter) open() error {
	if w.cur == nil || w.cur.length == w.blockSize {
		w.endBlock()
		loc, err := w.blocks.next(w.ctx)
		if err != nil {
			return err
		}
		route, err := stream.Route(loc.GetDatanodes(), w.c.cfg.Location)
		if err != nil {
			// A datanode without a stream address: nothing to retry.
			return &failure{err: err, fatal: true}
		}
		w.cur = &streamBlock{loc: loc, route: route}
	}
	b := w.cur
	opts := w.opts
	opts.Fresh = w.fresh || len(w.freshRoutes) > 0 && w.freshRoutes[routeKey(b.route)]
	w.fresh = false
	opts.Offset = uint64(b.length)
	opts.Token = b.loc.GetToken()
	opts.Version = w.c.routeVersion(b.loc.GetDatanodes())
	if h := w.c.cfg.OnStream; h != nil {
		ids := make([]uint64, len(b.route))
		for i, t := range b.route {
			ids[i] = t.ID
		}
		h(StreamInfo{ContainerID: b.loc.GetId().GetContainerId(), LocalID: b.loc.GetId().GetLocalId(),
			PipelineID: b.loc.GetPipelineId(), Offset: opts.Offset, Route: ids})
	}
	// A segment holds at most the pool's buffers, one piece each, so
	// queueing never waits for the sender.
	ctx, cancel := context.WithCancel(w.ctx)
	s := &sender{pieces: make(chan []byte, max(cap(w.pool.slots), len(w.seg))+1), stop: make(chan struct{}), done: make(chan struct{}), cancel: cancel}
	for _, p := range w.seg {
		s.pieces <- p.data
	}
	w.snd = s
	route, pipeline, id := b.route, b.loc.GetPipelineId(), streamBlockID(b.loc)
	c := w.c
	go s.run(func() (*stream.Writer, error) {
		sw, err := streamDial(ctx, route, pipeline, id, opts)
		if sw != nil && sw.Version() < stream.Version {
			c.streamV4.Add(1)
			if sw.Downgraded() {
				c.streamDowngrades.Add(1)
				c.noteOldStream(sw.RefusedBy())
			}
		}
		return sw, err
	})
	return nil
}

// oldStreamMemory is how long the client opens routes through a datanode
// at stream version 4 after it refused version 5 though registered as 5:
// a binary of the previous release under a registration not yet updated
// would otherwise cost every stream through it a refused header (a TLS
// handshake on each hop up to it: BenchmarkVersionSecureChain). An upgrade
// of it back is seen when the memory ends.
const oldStreamMemory = time.Minute

// routeVersion is the stream protocol version a route opens at: the whole
// stream runs at one version, so the lowest its datanodes advertise
// (DatanodeDetails.stream_version; 0, a datanode of the previous release
// that predates the field, speaks only 4), or 4 if one of them refused 5
// within oldStreamMemory. All of this release: 0, which is
// stream.Version, once more at 4 if a datanode refuses it as an old
// binary does (its registration stale: replaced by an old binary under
// the same ID); that refusal excludes nothing (stream.Dial) and is
// remembered (noteOldStream).
func (c *Client) routeVersion(dns []*metapb.DatanodeDetails) uint8 {
	for _, d := range dns {
		if d.GetStreamVersion() < uint32(stream.Version) {
			return stream.MinVersion
		}
	}
	c.oldStreamMu.Lock()
	defer c.oldStreamMu.Unlock()
	now := time.Now()
	for _, d := range dns {
		if t, ok := c.oldStream[d.GetId()]; ok {
			if now.Sub(t) < oldStreamMemory {
				return stream.MinVersion
			}
			delete(c.oldStream, d.GetId())
		}
	}
	return 0
}

// noteOldStream remembers that datanode id refused stream version 5 as
// a version 4 datanode does (routeVersion). The memory is bounded: at
// most one entry per datanode that did so, each forgotten after
// oldStreamMemory once looked at.
func (c *Client) noteOldStream(id uint64) {
	if id == 0 {
		return
	}
	c.oldStreamMu.Lock()
	defer c.oldStreamMu.Unlock()
	if c.oldStream == nil {
		c.oldStream = map[uint64]time.Time{}
	}
	if len(c.oldStream) >= 4096 {
		clear(c.oldStream)
	}
	c.oldStream[id] = time.Now()
}

// commit ends the segment: Close (every datanode of the route synced it),
// then PutBlock with the block's whole chunk list through the pipeline's
// Raft leader, waiting for every replica; then its buffers are free.
func (w *streamWriter) commit() error {
	for {
		var err error
		if w.snd != nil {
			err = w.finish()
		}
		if err == nil {
			err = w.commitOnce()
		}
		if err == nil {
			w.releaseSeg()
			return nil
		}
		if err := w.recover(err); err != nil {
			return err
		}
	}
}

func (w *streamWriter) commitOnce() error {
	b := w.cur
	sw := w.w
	w.w = nil
	length, chunks, err := sw.Close()
	if err != nil {
		return err
	}
	if want := uint64(b.length + w.segLen); length != want {
		// The Writer counts what it sent; a mismatch is a bug here.
		return &failure{fatal: true, err: fmt.Errorf("stream of block %v closed at length %d, want %d", streamBlockID(b.loc), length, want)}
	}
	infos := make([]*datanodepb.ChunkInfo, 0, len(b.chunks)+len(chunks))
	infos = append(infos, b.chunks...)
	for _, ch := range chunks {
		infos = append(infos, ch.Proto())
	}
	wait := w.c.cfg.WaitAllTimeout
	req := &datanodepb.PutBlockRequest{
		PipelineId: b.loc.GetPipelineId(), WaitAll: true, WaitTimeoutMs: uint32(wait / time.Millisecond),
		Block: &datanodepb.BlockData{Id: dnBlockID(b.loc.GetId()), Length: length, Chunks: infos},
	}
	_, err = w.c.callLeader(w.ctx, b.loc, wait+w.c.cfg.RPCTimeout, func(ctx context.Context, dn datanodepb.DatanodeClient) error {
		_, err := dn.PutBlock(ctx, req)
		return err
	})
	if err != nil {
		return fmt.Errorf("put block %d/%d at length %d: %w", b.loc.GetId().GetContainerId(), b.loc.GetId().GetLocalId(), length, err)
	}
	b.length, b.chunks = int64(length), infos
	return nil
}

// recover handles cause, a failure of the segment on the current block:
// it aborts the stream, excludes what failed, ends the block at its
// committed length, and writes the whole segment again to a new block
// (repeating while that fails, within the retry budget). The segment stays
// open on the new block: the caller goes on adding to it or commits it.
//
// A stream.CodeStale failure (a kept connection, the client's or a
// datanode's down the route, ended before the header was answered: most
// likely closed idle as the header crossed) excludes nothing and spends
// no retry, at most once per segment and once per datanode named per key:
// the stream is abandoned (no header ack, so nothing of it can be
// committed; the datanode may have opened it, so never the same block
// again), and the segment goes to a new block; every later stream of the
// key on that route (the retry first) opens on new connections
// (Options.Fresh: every hop's connections are then new too), where
// "stale" cannot be said and a datanode that really failed shows as such
// and is excluded. A second CodeStale naming the same datanode in the key
// (on another route, or a datanode that ends kept connections as headers
// cross on purpose) is a failure like any other: that datanode is
// excluded.
func (w *streamWriter) recover(cause error) error {
	for {
		w.halt()
		if w.w != nil {
			w.w.Abort()
			w.w = nil
		}
		f := classifyStream(w.ctx, w.cur, cause)
		if f.stale && !w.staleRetried && !w.staleFrom[staleDatanode(f)] && w.cur != nil {
			w.staleRetried, w.fresh = true, true
			if w.staleFrom == nil {
				w.staleFrom, w.freshRoutes = map[uint64]bool{}, map[string]bool{}
			}
			w.staleFrom[staleDatanode(f)] = true
			w.freshRoutes[routeKey(w.cur.route)] = true
			w.c.streamStaleRetries.Add(1)
			w.c.log.Info("basalt client: a kept stream connection ended before the header was answered; writing the segment again as a new block on new connections",
				"key", w.op, "err", f.err)
		} else if err := w.blocks.failed(w.ctx, f); err != nil {
			return err
		}
		w.endBlock()
		w.cur = nil
		cause = w.resend()
		if cause == nil {
			return nil
		}
	}
}

// staleDatanode is the datanode a stale failure names (0: none).
func staleDatanode(f *failure) uint64 {
	if len(f.datanodes) == 1 {
		return f.datanodes[0]
	}
	return 0
}

// resend writes the segment to a new stream on a new block.
func (w *streamWriter) resend() error {
	return w.open()
}

// endBlock lists the current block in the key at its committed length;
// it is never written again.
func (w *streamWriter) endBlock() {
	if b := w.cur; b != nil && b.length > 0 {
		w.committed = append(w.committed, &metapb.KeyBlock{Id: b.loc.GetId(), Length: uint64(b.length)})
		w.chunkLists = append(w.chunkLists, b.chunks)
	}
	w.cur = nil
}

func (w *streamWriter) releaseSeg() {
	for _, p := range w.seg {
		p.buf.unref()
	}
	w.seg, w.segLen = nil, 0
	w.staleRetried = false
}

// drop undoes what an unfinished write holds: the stream (its datanodes
// discard the partial block) and the buffers.
func (w *streamWriter) drop() {
	w.halt()
	if w.w != nil {
		w.w.Abort()
		w.w = nil
	}
	w.releaseSeg()
}

// classifyStream decides what a failure of a V2 segment implicates. A
// stream error names the datanode that refused, stalled, died or could
// not be reached: exclude it (every pipeline with it is then avoided). A
// refusal about the pipeline or the container excludes those, as in V1;
// "not in pipeline" is V1's PIPELINE_NOT_FOUND (not ready yet).
// PutBlock's errors are V1's (classify).
func classifyStream(ctx context.Context, b *streamBlock, err error) *failure {
	var f *failure
	if errors.As(err, &f) {
		return f
	}
	if ctx.Err() != nil {
		return &failure{err: err, fatal: true}
	}
	var se *stream.Error
	if !errors.As(err, &se) {
		if b == nil {
			return &failure{err: err, fatal: true}
		}
		return classify(ctx, b.loc, err)
	}
	f = &failure{err: err}
	if b == nil {
		// The stream never had a block: only the datanode can be blamed.
		if se.Datanode == 0 {
			f.fatal = true
		}
		f.datanodes = []uint64{se.Datanode}
		return f
	}
	switch se.Code {
	case stream.CodeStale:
		// Not blamed the first time in a segment (streamWriter.recover);
		// the datanode named if it happens again.
		f.stale = true
		if se.Datanode != 0 {
			f.datanodes = []uint64{se.Datanode}
		} else {
			f.pipeline = b.loc.GetPipelineId()
		}
	case stream.CodeContainerNotOpen, stream.CodeNoSuchContainer:
		f.container = b.loc.GetId().GetContainerId()
		if se.Datanode != 0 && strings.Contains(strings.ToLower(se.Reason), storage.ErrDiskFull.Error()) {
			// A full datanode cannot create or extend any container:
			// exclude it, or every container on it costs a retry.
			f.datanodes = []uint64{se.Datanode}
		}
	case stream.CodeNotInPipeline:
		// A member does not know the pipeline: closed, or (right after
		// SCM created it) not joined yet, as V1's PIPELINE_NOT_FOUND.
		// Not ready: avoided by this key, not client-wide nor against
		// the retry budget while AllocateWait lasts, so that the only
		// pipeline of a small cluster is asked again after a short wait
		// rather than given up on.
		f.pipeline = b.loc.GetPipelineId()
		f.notReady = true
	case stream.CodeBadHeader, stream.CodeBlockCommitted:
		// The pipeline's members disagree with SCM's view: another
		// pipeline will do.
		f.pipeline = b.loc.GetPipelineId()
	default: // unreachable, timeout, connection lost, checksum, I/O, shutdown, busy, protocol
		if se.Datanode != 0 {
			f.datanodes = []uint64{se.Datanode}
		} else {
			f.pipeline = b.loc.GetPipelineId()
		}
	}
	return f
}

func streamBlockID(loc *metapb.BlockLocation) stream.BlockID {
	return stream.BlockID{Container: loc.GetId().GetContainerId(), Local: loc.GetId().GetLocalId()}
}
