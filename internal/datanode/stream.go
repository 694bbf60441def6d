package datanode

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/internal/guard"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
)

// streamBackend admits V2 streams (package stream) to this datanode's
// storage. The stream only writes the block file; the block becomes
// visible when the client's PutBlock goes through the pipeline's log.
type streamBackend struct{ d *Datanode }

func (b streamBackend) Open(h *stream.Header) (stream.Sink, error) {
	d := b.d
	id := d.ident.ID
	if err := d.checkStreamToken(h); err != nil {
		return nil, err
	}
	members, err := d.awaitPipeline(h.Pipeline)
	if err != nil {
		return nil, err
	}
	for _, t := range h.Route {
		if !slices.Contains(members, t.ID) {
			return nil, &stream.Error{Code: stream.CodeBadHeader, Datanode: id,
				Reason: fmt.Sprintf("route names datanode %d, not a member of pipeline %d %v", t.ID, h.Pipeline, members)}
		}
	}
	if err := d.checkStreamOwner(h); err != nil {
		return nil, err
	}
	cid, lid := storage.ContainerID(h.Block.Container), storage.LocalID(h.Block.Local)
	d.mu.Lock()
	sm := d.sms[h.Pipeline]
	d.mu.Unlock()
	if sm != nil {
		// The container is this pipeline's: its snapshots list it.
		if err := sm.track(uint64(cid)); err != nil {
			return nil, streamError(id, err)
		}
	}
	rep, err := d.store.Container(cid)
	if errors.Is(err, storage.ErrContainerNotFound) {
		// SCM allocated the container to this pipeline; like the first V1
		// write, the first stream creates it on each replica.
		if rep, err = d.store.CreateContainer(cid, storage.CreateOptions{}); errors.Is(err, storage.ErrContainerExists) {
			rep, err = d.store.Container(cid)
		}
		if err != nil {
			return nil, &stream.Error{Code: stream.CodeNoSuchContainer, Datanode: id,
				Reason: fmt.Sprintf("container %d does not exist and cannot be created: %v", cid, err)}
		}
	} else if err != nil {
		return nil, streamError(id, err)
	}
	if rep.State != storage.StateOpen {
		return nil, &stream.Error{Code: stream.CodeContainerNotOpen, Datanode: id,
			Reason: fmt.Sprintf("container %d is %s", cid, rep.State)}
	}
	bd, err := d.store.GetBlock(cid, lid)
	switch {
	case err == nil && uint64(bd.Length) != h.Offset:
		return nil, &stream.Error{Code: stream.CodeBlockCommitted, Datanode: id,
			Reason: fmt.Sprintf("block %v is committed with length %d; a stream may only extend it from there, not from %d", h.Block, bd.Length, h.Offset)}
	case errors.Is(err, storage.ErrBlockNotFound) && h.Offset != 0:
		return nil, &stream.Error{Code: stream.CodeBadHeader, Datanode: id,
			Reason: fmt.Sprintf("block %v is not committed; its stream must start at 0, not %d", h.Block, h.Offset)}
	case err != nil && !errors.Is(err, storage.ErrBlockNotFound):
		return nil, streamError(id, err)
	}
	return streamSink{id: id, BlockStream: d.store.OpenStream(cid, lid, int64(h.Offset))}, nil
}

// maxStreamJoinWait bounds how long a stream waits for this datanode to
// join a pipeline it has not heard of (awaitPipeline).
const maxStreamJoinWait = 3 * time.Second

// awaitPipeline returns the members of pipeline id once this datanode is
// in it. SCM tells a pipeline's members at their next heartbeat, and may
// hand out a new pipeline before each has joined (the only pipeline of a
// small cluster): a stream for a pipeline this datanode never knew waits
// for it to be joined, at most two heartbeat intervals and
// maxStreamJoinWait, or until the datanode closes. One it left (closed)
// is refused at once. The refusal is CodeNotInPipeline, which the client
// takes as V1's PIPELINE_NOT_FOUND: not ready yet, ask again shortly.
func (d *Datanode) awaitPipeline(pid uint64) ([]uint64, error) {
	id := d.ident.ID
	var timeout <-chan time.Time
	start := time.Now()
	for {
		d.mu.Lock()
		p, in := d.pipelines[pid]
		left, joined := d.pipesLeft.has(pid), d.pipeJoined
		d.mu.Unlock()
		if in {
			if _, err := d.host.Group(pid); err != nil {
				return nil, &stream.Error{Code: stream.CodeNotInPipeline, Datanode: id,
					Reason: fmt.Sprintf("datanode %d is leaving pipeline %d: %v", id, pid, err)}
			}
			return p.GetDatanodes(), nil
		}
		if left {
			return nil, &stream.Error{Code: stream.CodeNotInPipeline, Datanode: id,
				Reason: fmt.Sprintf("datanode %d is not in pipeline %d (closed)", id, pid)}
		}
		if timeout == nil {
			t := time.NewTimer(d.streamJoinWait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-joined:
		case <-timeout:
			return nil, &stream.Error{Code: stream.CodeNotInPipeline, Datanode: id,
				Reason: fmt.Sprintf("datanode %d is not in pipeline %d (unknown; not joined after %v)", id, pid, time.Since(start).Round(time.Millisecond))}
		case <-d.stopc:
			return nil, &stream.Error{Code: stream.CodeNotInPipeline, Datanode: id,
				Reason: fmt.Sprintf("datanode %d is not in pipeline %d (unknown; datanode closing)", id, pid)}
		}
	}
}

// pipelineJoinedLocked wakes the streams waiting for a pipeline (d.mu held).
func (d *Datanode) pipelineJoinedLocked(pid uint64) {
	d.pipesLeft.remove(pid)
	close(d.pipeJoined)
	d.pipeJoined = make(chan struct{})
}

// leftPipelines remembers the newest maxLeftPipelines pipelines a
// datanode left, so that a stream for one is refused at once rather
// than waited for (awaitPipeline). Guarded by Datanode.mu.
type leftPipelines struct {
	set   map[uint64]bool
	order []uint64
}

const maxLeftPipelines = 4096

func (l *leftPipelines) has(pid uint64) bool { return l.set[pid] }

func (l *leftPipelines) add(pid uint64) {
	if l.set == nil {
		l.set = map[uint64]bool{}
	}
	if l.set[pid] {
		return
	}
	if len(l.order) >= maxLeftPipelines {
		delete(l.set, l.order[0])
		l.order = l.order[1:]
	}
	l.set[pid] = true
	l.order = append(l.order, pid)
}

func (l *leftPipelines) remove(pid uint64) {
	if !l.set[pid] {
		return
	}
	delete(l.set, pid)
	l.order = slices.DeleteFunc(l.order, func(x uint64) bool { return x == pid })
}

// streamSink turns storage errors into stream errors with a code.
type streamSink struct {
	id uint64
	*storage.BlockStream
}

func (s streamSink) Write(p []byte) (int, error) {
	n, err := s.BlockStream.Write(p)
	if err != nil {
		return n, streamError(s.id, err)
	}
	return n, nil
}

func (s streamSink) Close() error {
	if err := s.BlockStream.Close(); err != nil {
		return streamError(s.id, err)
	}
	return nil
}

func streamError(id uint64, err error) *stream.Error {
	code := stream.CodeIO
	switch {
	case errors.Is(err, storage.ErrContainerNotOpen):
		code = stream.CodeContainerNotOpen
	case errors.Is(err, storage.ErrContainerNotFound):
		code = stream.CodeNoSuchContainer
	}
	return &stream.Error{Code: code, Datanode: id, Reason: err.Error()}
}

// startStream serves V2 streams on the listener New opened.
func (d *Datanode) startStream() {
	d.streamJoinWait = maxStreamJoinWait
	if d.hbInterval > 0 {
		d.streamJoinWait = min(2*d.hbInterval, maxStreamJoinWait)
	}
	d.streamSrv = stream.NewServer(stream.ServerConfig{ID: d.ident.ID, Backend: streamBackend{d}, Logger: d.log.With("part", "stream"), Guard: guard.New(d.cfg.Registerer, d.log.With("part", "stream")),
		Security: d.streamSecurity(), OnlyVersion: d.cfg.StreamOnlyVersion})
	// (The small-file batch counters and the apply guard's counter share
	// the stream metrics' life.)
	d.streamMetrics = append(append(streamCollectors(d.streamSrv), d.smallFileCollectors()...), d.applyCollectors()...)
	if d.cfg.Registerer != nil {
		for _, c := range d.streamMetrics {
			// Another datanode with the same labels on this registry
			// (tests restarting one): keep serving, export once.
			d.cfg.Registerer.Register(c)
		}
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.streamSrv.Serve(d.streamLis)
	}()
}

func (d *Datanode) stopStream() {
	if d.streamSrv == nil {
		d.streamLis.Close()
		return
	}
	d.streamSrv.Close()
	if d.cfg.Registerer != nil {
		for _, c := range d.streamMetrics {
			d.cfg.Registerer.Unregister(c)
		}
	}
}

func streamCollectors(s *stream.Server) []prometheus.Collector {
	counter := func(name, help string, f func(stream.Stats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode_stream", Name: name, Help: help},
			func() float64 { return float64(f(s.Stats())) })
	}
	return []prometheus.Collector{
		counter("first_hop_total", "V2 streams accepted from a client (first hop of the route).", func(st stream.Stats) uint64 { return st.FirstHop }),
		counter("downstream_total", "V2 streams accepted from another datanode.", func(st stream.Stats) uint64 { return st.Downstream }),
		counter("received_bytes_total", "Payload bytes received on V2 streams.", func(st stream.Stats) uint64 { return st.BytesReceived }),
		counter("failed_total", "V2 streams that ended in an error (their data discarded).", func(st stream.Stats) uint64 { return st.Failed }),
		counter("connections_total", "Connections accepted on the V2 stream port.", func(st stream.Stats) uint64 { return st.Accepted }),
		counter("reused_total", "V2 streams opened on a connection that carried a stream before.", func(st stream.Stats) uint64 { return st.Reused }),
		counter("down_dials_total", "Connections this datanode opened to the next datanode of a V2 route.", func(st stream.Stats) uint64 { return st.DownDials }),
		counter("down_stale_total", "Kept connections to the next datanode found closed, expired or failing the header's write before a next header (then dialed anew).", func(st stream.Stats) uint64 { return st.DownStale }),
		counter("down_stale_headers_total", "V2 streams failed as stale: a kept connection to the next datanode ended before it answered the header (the client writes a new block on new connections, blaming nobody).", func(st stream.Stats) uint64 { return st.DownStaleHeaders }),
		counter("v4_streams_total", "V2 streams served at protocol version 4 (by a client or datanode of the previous release, or a route with one on it; not those refused as busy): still counting means a rolling upgrade is not finished.", func(st stream.Stats) uint64 { return st.V4Streams }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode_stream", Name: "active", Help: "V2 streams open now."},
			func() float64 { return float64(s.Stats().Active) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode_stream", Name: "idle_connections", Help: "Connections waiting for a next V2 stream header now."},
			func() float64 { return float64(s.Stats().Idle) }),
	}
}

// StreamAddr is the V2 streaming address.
func (d *Datanode) StreamAddr() string { return d.streamLis.Addr().String() }

// StreamStats are the V2 streaming counters (zero before Start).
func (d *Datanode) StreamStats() stream.Stats {
	if d.streamSrv == nil {
		return stream.Stats{}
	}
	return d.streamSrv.Stats()
}
