package client

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// Small-file coalescing. With many writers, many small keys go to the same
// pipeline leader at once; each as its own PutSmallFile call costs a gRPC
// call on both sides. putSmall hands its file to the queue of its
// (datanode address, pipeline): while fewer than Config.SmallFilesInFlight
// PutSmallFiles calls of that queue are in flight, a file leaves at once
// in a call of its own (a lone writer pays no latency); beyond that, files
// queue and leave together, bounded in count and bytes, as soon as a call
// returns. Each file carries its own block token and gets its own answer
// (the datanode checks and proposes each on its own), so a file's failure
// reaches only its writer, as the PutSmallFile error it would have got.
// A call runs until the latest deadline of its writers or until all of
// them gave up; a writer that gave up before its file was sent is dropped
// from the batch, one that gives up later stops waiting (its outcome is
// unknown, as when a PutSmallFile call is cancelled). A file's data is its
// writer's pooled buffer: the coalescer holds a reference to it until the
// file is dropped or its call returned, so a writer that gave up may
// release its own at once without the buffer being recycled under a call
// still marshalling it. A datanode without PutSmallFiles (Unimplemented) is
// remembered and its files go as PutSmallFile calls again.

const (
	// maxSmallBatchFiles and maxSmallBatchBytes bound one PutSmallFiles
	// call (the datanode takes up to 1024 files and 16 MiB).
	maxSmallBatchFiles = 128
	maxSmallBatchBytes = 4 << 20
	// maxSmallQueue bounds the files queued per datanode and pipeline;
	// past it a file goes alone as a PutSmallFile.
	maxSmallQueue = 4096
)

// errNoSmallBatch: the datanode does not implement PutSmallFiles.
var errNoSmallBatch = errors.New("datanode does not implement PutSmallFiles")

type smallKey struct {
	addr     string
	pipeline uint64
}

type smallFiles struct {
	mu      sync.Mutex
	queues  map[smallKey]*smallQueue
	noBatch map[string]bool // datanodes that answered Unimplemented
	// Counters (tests): PutSmallFiles calls sent and the files they carried.
	calls, files atomic.Uint64
}

type smallQueue struct {
	pending  []*smallCall
	bytes    int
	inflight int
}

type smallCall struct {
	ctx  context.Context // the writer's: deadline and cancellation
	file *datanodepb.SmallFile
	done chan struct{}
	res  *datanodepb.SmallFileResult
	err  error // the call failed as a whole (transport, Unimplemented, ...)
	// buf, if not nil, holds file.Data: referenced while queued or in a
	// call (the writer may give up, return and release its own
	// reference before the call has marshalled the file).
	buf *buffer
}

// SmallFileBatches reports the PutSmallFiles calls this client sent and the
// files they carried (tests and benchmarks).
func (c *Client) SmallFileBatches() (calls, files uint64) {
	return c.small.calls.Load(), c.small.files.Load()
}

// putSmallBatched sends file (its block token inside) to the leader at
// addr through the coalescer and returns the file's own outcome, or
// errNoSmallBatch when the datanode predates PutSmallFiles. buf, if not
// nil, is the pooled buffer holding file's data: the coalescer keeps a
// reference to it until no call can read the data any more, so the writer
// may release its own as soon as this returns.
func (c *Client) putSmallBatched(ctx context.Context, addr string, cc grpc.ClientConnInterface, pipeline uint64, waitMs uint32, file *datanodepb.SmallFile, buf *buffer) error {
	key := smallKey{addr, pipeline}
	s := &c.small
	call := &smallCall{ctx: ctx, file: file, done: make(chan struct{}), buf: buf}
	call.hold() // before another goroutine can see the call
	s.mu.Lock()
	if s.noBatch[addr] {
		s.mu.Unlock()
		call.unhold()
		return errNoSmallBatch
	}
	if s.queues == nil {
		s.queues = map[smallKey]*smallQueue{}
	}
	q := s.queues[key]
	if q == nil {
		q = &smallQueue{}
		s.queues[key] = q
	}
	var batch []*smallCall
	switch {
	case q.inflight < c.cfg.SmallFilesInFlight:
		q.inflight++
		batch = []*smallCall{call}
	case len(q.pending) >= maxSmallQueue:
		s.mu.Unlock()
		call.unhold()
		return errNoSmallBatch // the queue is full: this file goes alone
	default:
		q.pending = append(q.pending, call)
		q.bytes += len(file.GetData())
	}
	s.mu.Unlock()
	if batch != nil {
		go c.runSmallBatches(key, q, cc, pipeline, waitMs, batch)
	}
	select {
	case <-call.done:
		if call.err != nil {
			return call.err
		}
		return smallFileErr(call.res)
	case <-ctx.Done():
		// As a gRPC call would fail (DeadlineExceeded or Canceled): the
		// file may still be committed, the same unknown outcome as a
		// PutSmallFile call given up.
		return status.FromContextError(ctx.Err()).Err()
	}
}

// runSmallBatches sends batch, then, while files are pending, the next
// batch of them, in the in-flight slot it holds; it frees the slot when
// nothing is pending.
func (c *Client) runSmallBatches(key smallKey, q *smallQueue, cc grpc.ClientConnInterface, pipeline uint64, waitMs uint32, batch []*smallCall) {
	s := &c.small
	for {
		c.sendSmallBatch(key.addr, cc, pipeline, waitMs, batch)
		s.mu.Lock()
		batch = nil
		n, bytes := 0, 0
		for n < len(q.pending) && n < maxSmallBatchFiles {
			b := len(q.pending[n].file.GetData())
			if n > 0 && bytes+b > maxSmallBatchBytes {
				break
			}
			bytes += b
			n++
		}
		if n == 0 {
			q.inflight--
			if q.inflight == 0 && s.queues[key] == q {
				delete(s.queues, key)
			}
			s.mu.Unlock()
			return
		}
		batch = append(batch, q.pending[:n]...)
		q.pending = append(q.pending[:0], q.pending[n:]...)
		q.bytes -= bytes
		s.mu.Unlock()
	}
}

// sendSmallBatch sends one PutSmallFiles with the files of batch whose
// writers still wait, until the latest of their deadlines, and hands each
// its answer.
func (c *Client) sendSmallBatch(addr string, cc grpc.ClientConnInterface, pipeline uint64, waitMs uint32, batch []*smallCall) {
	live := batch[:0:0]
	var deadline time.Time
	for _, call := range batch {
		if err := call.ctx.Err(); err != nil {
			call.err = err
			close(call.done)
			call.unhold()
			continue
		}
		d, ok := call.ctx.Deadline()
		if !ok {
			d = time.Now().Add(time.Duration(waitMs)*time.Millisecond + c.cfg.RPCTimeout)
		}
		if d.After(deadline) {
			deadline = d
		}
		live = append(live, call)
	}
	if len(live) == 0 {
		return
	}
	req := &datanodepb.PutSmallFilesRequest{PipelineId: pipeline, WaitTimeoutMs: waitMs, Files: make([]*datanodepb.SmallFile, len(live))}
	for i, call := range live {
		req.Files[i] = call.file
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	// Once every writer of the batch gave up (a hung datanode the prober
	// saw, deadlines), so does the call: the queue's slot is free again.
	returned := make(chan struct{})
	go func() {
		for _, call := range live {
			select {
			case <-call.ctx.Done():
			case <-returned:
				return
			}
		}
		cancel()
	}()
	c.small.calls.Add(1)
	c.small.files.Add(uint64(len(live)))
	resp, err := datanodepb.NewDatanodeClient(cc).PutSmallFiles(ctx, req)
	close(returned)
	cancel()
	switch {
	case err != nil && status.Code(err) == codes.Unimplemented:
		c.small.mu.Lock()
		if c.small.noBatch == nil {
			c.small.noBatch = map[string]bool{}
		}
		// Unimplemented says nothing was written: the files go again alone.
		c.small.noBatch[addr] = true
		c.small.mu.Unlock()
		err = errNoSmallBatch
	case err == nil && len(resp.GetResults()) != len(live):
		err = status.Errorf(codes.Internal, "PutSmallFiles: %d results for %d files", len(resp.GetResults()), len(live))
	}
	for i, call := range live {
		if err != nil {
			call.err = err
		} else {
			call.res = resp.GetResults()[i]
		}
		close(call.done)
		call.unhold() // the call returned: nothing reads the data any more
	}
}

// hold and unhold take and drop the coalescer's reference to the file's
// buffer.
func (call *smallCall) hold() {
	if call.buf != nil {
		call.buf.ref()
	}
}

func (call *smallCall) unhold() {
	if call.buf != nil {
		call.buf.unref()
	}
}

// smallFileErr turns a PutSmallFiles result back into the error (a gRPC
// status with its Error detail) the file's own PutSmallFile call would
// have returned; nil when the file was committed.
func smallFileErr(r *datanodepb.SmallFileResult) error {
	if r == nil {
		return status.Error(codes.Internal, "PutSmallFiles: no result for the file")
	}
	if r.GetCode() == 0 {
		return nil
	}
	st := status.New(codes.Code(r.GetCode()), r.GetMessage())
	if r.GetError() != nil {
		if d, err := st.WithDetails(r.GetError()); err == nil {
			st = d
		}
	}
	return st.Err()
}
