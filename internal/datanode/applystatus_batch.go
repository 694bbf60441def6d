package datanode

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/storage"
)

// A pipeline leader asks each follower, after raft reported that it
// applied an entry, whether the entry failed there (ApplyStatus, see
// waitAll). With many concurrent small writes that was one RPC per write
// per follower. The asks for one follower and pipeline are batched: while
// one ApplyStatus call is in flight, the asks that arrive queue up, and
// the next call carries all of them (ApplyStatusRequest.more), so under
// load a call answers many writes and an idle leader still asks at once.

// maxApplyStatusBatch bounds the entries of one ApplyStatus call beyond
// the first (the server refuses more).
const maxApplyStatusBatch = 4096

// applyStatusTimeout bounds one batched ApplyStatus call (the default
// wait for all replicas).
const applyStatusTimeout = 30 * time.Second

// errNoBatch: the follower answered only the first entry of a batch (it
// predates batching); the entry is asked alone.
var errNoBatch = errors.New("datanode: the replica does not answer batched ApplyStatus")

type statusAnswer struct {
	applied uint64
	why     string
	err     error
}

type statusAsk struct {
	index uint64
	cid   storage.ContainerID
	done  chan statusAnswer // buffered (1)
}

type statusBatch struct {
	mu      sync.Mutex
	queue   []statusAsk
	running bool
}

type statusKey struct{ peer, pipeline uint64 }

// askBatched asks follower peer whether it applied entry index of
// pipeline successfully, in a batch with the other asks pending for that
// follower and pipeline. It returns the follower's applied index (as of
// the call) and why the entry failed there ("" if not, or not yet).
func (d *Datanode) askBatched(ctx context.Context, peer, pipeline, index uint64, cid storage.ContainerID) (uint64, string, error) {
	key := statusKey{peer, pipeline}
	d.statusMu.Lock()
	if d.statusBatches == nil {
		d.statusBatches = map[statusKey]*statusBatch{}
	}
	b := d.statusBatches[key]
	if b == nil {
		b = &statusBatch{}
		d.statusBatches[key] = b
	}
	d.statusMu.Unlock()
	a := statusAsk{index: index, cid: cid, done: make(chan statusAnswer, 1)}
	b.mu.Lock()
	b.queue = append(b.queue, a)
	start := !b.running
	b.running = true
	b.mu.Unlock()
	if start {
		go d.runStatusBatch(key, b)
	}
	select {
	case r := <-a.done:
		return r.applied, r.why, r.err
	case <-ctx.Done():
		return 0, "", ctx.Err()
	}
}

// runStatusBatch sends the queued asks of b, one call at a time, until
// none is left. The peer's client is looked up per call (peerClient): a
// runner lives as long as asks keep coming, and the peer's address may
// change meanwhile.
func (d *Datanode) runStatusBatch(key statusKey, b *statusBatch) {
	for {
		b.mu.Lock()
		q := b.queue
		if len(q) > maxApplyStatusBatch+1 {
			q = q[:maxApplyStatusBatch+1]
		}
		b.queue = b.queue[len(q):]
		if len(q) == 0 {
			b.running = false
			b.queue = nil
			b.mu.Unlock()
			// Forget the idle batch (a pipeline goes away); an ask that
			// already holds it starts it again, and a new one makes
			// another: at worst two calls instead of one.
			d.statusMu.Lock()
			if d.statusBatches[key] == b {
				delete(d.statusBatches, key)
			}
			d.statusMu.Unlock()
			return
		}
		b.mu.Unlock()
		req := &datanodepb.ApplyStatusRequest{PipelineId: key.pipeline, Index: q[0].index, ContainerId: uint64(q[0].cid)}
		if len(q) > 1 {
			req.More = make([]*datanodepb.ApplyStatusEntry, len(q)-1)
			for i, a := range q[1:] {
				req.More[i] = &datanodepb.ApplyStatusEntry{Index: a.index, ContainerId: uint64(a.cid)}
			}
		}
		var r *datanodepb.ApplyStatusResponse
		c, err := d.peerClient(key.peer)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), applyStatusTimeout)
			r, err = c.ApplyStatus(ctx, req)
			cancel()
		}
		for i, a := range q {
			var ans statusAnswer
			switch {
			case err != nil:
				ans.err = err
			case i == 0:
				ans = statusAnswer{applied: r.GetApplied(), why: failedWhy(r.GetFailed(), r.GetReason())}
			case len(r.GetMore()) != len(q)-1:
				ans.err = errNoBatch
			default:
				m := r.GetMore()[i-1]
				ans = statusAnswer{applied: r.GetApplied(), why: failedWhy(m.GetFailed(), m.GetReason())}
			}
			a.done <- ans
		}
	}
}

func failedWhy(failed bool, reason string) string {
	if failed && reason == "" {
		return "failed"
	}
	return reason
}
