package datanode

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// PutSmallFiles: several small files of one pipeline in one call (the
// client coalesces the PutSmallFiles that meet at a pipeline leader). Each
// file is checked exactly as its own PutSmallFile would be (checkSmall: its
// own block token, shape, container, room and checksum) before anything is
// proposed; the valid files are then proposed together, each as its own
// log entry with the same metadata and data as a PutSmallFile's entry, so
// the state machine, its replay (appliedBefore, BCSIDs) and crash recovery
// see nothing new. The entries proposed at once land in the same Ready on
// the leader and in the same appends on the followers: one data Sync round
// and one log fsync per replica for the batch. Each file is answered on
// its own once every replica applied its entry (waitAll), so one file's
// failure (a forged token, a closed container, a bad checksum, a replica
// that failed to store it) fails only that file.

// Bounds of one PutSmallFiles call (the client's coalescer stays well
// under them).
const (
	maxSmallFilesPerCall = 1024
	maxSmallFilesBytes   = 16 << 20
)

func (s *service) PutSmallFiles(ctx context.Context, req *datanodepb.PutSmallFilesRequest) (*datanodepb.PutSmallFilesResponse, error) {
	files := req.GetFiles()
	if len(files) == 0 || len(files) > maxSmallFilesPerCall {
		return nil, dnError(codes.InvalidArgument, datanodepb.Error_BAD_REQUEST,
			fmt.Sprintf("PutSmallFiles: %d files, want 1 to %d", len(files), maxSmallFilesPerCall), nil)
	}
	total := 0
	for _, f := range files {
		total += len(f.GetData())
	}
	if total > maxSmallFilesBytes {
		return nil, dnError(codes.InvalidArgument, datanodepb.Error_BAD_REQUEST,
			fmt.Sprintf("PutSmallFiles: %d bytes of data, at most %d", total, maxSmallFilesBytes), nil)
	}
	pipeline := req.GetPipelineId()
	results := make([]*datanodepb.SmallFileResult, len(files))
	type ready struct {
		i    int
		g    *raft.Group
		cid  storage.ContainerID
		meta []byte
	}
	valid := make([]ready, 0, len(files))
	for i, f := range files {
		g, cid, meta, err := s.checkSmall(f.GetToken(), pipeline, f.GetBlock(), f.GetData())
		if err != nil {
			results[i] = smallFileResult(0, err)
			continue
		}
		valid = append(valid, ready{i, g, cid, meta})
	}
	if len(valid) > 0 {
		s.d.stats.smallBatches.Add(1)
		s.d.stats.smallBatchFiles.Add(uint64(len(valid)))
	}
	if len(valid) == 0 {
		return &datanodepb.PutSmallFilesResponse{Results: results}, nil
	}
	// One pipeline: every valid file has the same group.
	g := valid[0].g
	metas, datas := make([][]byte, len(valid)), make([][]byte, len(valid))
	for j, v := range valid {
		metas[j], datas[j] = v.meta, files[v.i].GetData()
	}
	start := time.Now()
	res, errs := g.ProposeMany(ctx, metas, datas)
	proposed := time.Now()
	stage := s.d.stats.smallStage.Load()
	if stage != nil {
		stage.WithLabelValues("applied_local").Observe(proposed.Sub(start).Seconds())
	}
	var ok []int // positions in valid of the files proposed
	for j, v := range valid {
		if errs[j] != nil {
			results[v.i] = smallFileResult(0, s.toStatus(errs[j]))
			continue
		}
		ok = append(ok, j)
	}
	// Every replica's answer for the whole batch at once (waitAllMany);
	// a file it cannot settle waits on its own, as before.
	idxs, cids := make([]uint64, len(ok)), make([]storage.ContainerID, len(ok))
	for k, j := range ok {
		idxs[k], cids[k] = res[j].Index, valid[j].cid
	}
	// One timeout for the whole wait (waitAllMany, then the files it left
	// to wait on their own): a follower that stops answering must not make
	// the client wait twice WaitTimeoutMs.
	timeout := waitTimeout(req.GetWaitTimeoutMs())
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	settled := s.waitAllMany(wctx, g, idxs, cids, req.GetWaitTimeoutMs(), stage)
	var wg sync.WaitGroup
	for k, j := range ok {
		v := valid[j]
		if settled != nil && settled[k].done {
			if settled[k].err != nil {
				results[v.i] = smallFileResult(0, settled[k].err)
			} else {
				results[v.i] = &datanodepb.SmallFileResult{Index: res[j].Index}
			}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.waitAllTimed(wctx, g, res[j].Index, v.cid, req.GetWaitTimeoutMs(), stage); err != nil {
				results[v.i] = smallFileResult(0, err)
				return
			}
			results[v.i] = &datanodepb.SmallFileResult{Index: res[j].Index}
		}()
	}
	wg.Wait()
	if stage != nil {
		stage.WithLabelValues("total").Observe(time.Since(start).Seconds())
	}
	return &datanodepb.PutSmallFilesResponse{Results: results}, nil
}

// smallFileResult is one file's answer: its index, or the status its own
// PutSmallFile would have failed with (code, message, Error detail).
func smallFileResult(index uint64, err error) *datanodepb.SmallFileResult {
	if err == nil {
		return &datanodepb.SmallFileResult{Index: index}
	}
	st := status.Convert(err)
	r := &datanodepb.SmallFileResult{Code: uint32(st.Code()), Message: st.Message()}
	if r.Code == 0 {
		r.Code = uint32(codes.Internal)
	}
	for _, d := range st.Details() {
		if e, ok := d.(*datanodepb.Error); ok {
			r.Error = e
			break
		}
	}
	return r
}

// smallFileCollectors count the PutSmallFiles calls this datanode led and
// the files they proposed (files per call: how well writers coalesce).
func (d *Datanode) smallFileCollectors() []prometheus.Collector {
	counter := func(name, help string, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: name, Help: help},
			func() float64 { return float64(f()) })
	}
	stage := prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "basalt", Subsystem: "datanode", Name: "small_batch_stage_seconds",
		Help:    "Stages of a PutSmallFiles call on the pipeline leader: applied_local (ProposeMany until every file applied here), applied_all (then until every voter reported applying the batch; per file for a file waited for on its own), apply_status (then until the replicas' ApplyStatus answers were in), total (the call).",
		Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16)}, []string{"stage"})
	d.stats.smallStage.Store(stage)
	return []prometheus.Collector{
		stage,
		counter("small_file_batches_total", "PutSmallFiles calls that proposed at least one file.", d.stats.smallBatches.Load),
		counter("small_file_batch_files_total", "Files proposed by PutSmallFiles calls.", d.stats.smallBatchFiles.Load),
	}
}

// waitAllTimed is waitAll observing its two stages in stage (if not nil).
func (s *service) waitAllTimed(ctx context.Context, g *raft.Group, index uint64, cid storage.ContainerID, timeoutMs uint32, stage *prometheus.HistogramVec) error {
	timeout := waitTimeout(timeoutMs)
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t0 := time.Now()
	if err := g.WaitAppliedAll(wctx, index); err != nil {
		return s.toStatus(err)
	}
	t1 := time.Now()
	err := s.d.checkReplicas(wctx, g.ID(), g.Voters(), index, cid)
	if stage != nil {
		stage.WithLabelValues("applied_all").Observe(t1.Sub(t0).Seconds())
		stage.WithLabelValues("apply_status").Observe(time.Since(t1).Seconds())
	}
	return s.toStatus(err)
}

// maxApplyStatusWaitMs bounds ApplyStatusRequest.wait_ms on the replica.
const maxApplyStatusWaitMs = 30_000

// maxApplyStatusAhead: ApplyStatus waits (wait_ms) only for an index at
// most this many entries past the replica's last log index (the leader
// asks right after its own apply, so a follower may not have the entries
// yet); past that it answers at once.
const maxApplyStatusAhead = 4096

// fileSettled is one file's outcome from waitAllMany: done with err (nil:
// every replica applied it successfully), or not done (asked on its own).
type fileSettled struct {
	done bool
	err  error
}

// waitAllMany is waitAll for the files of one PutSmallFiles batch (entries
// idxs into containers cids, all applied here already), with the same
// promise per file: every voter applied it, and none failed it. Instead of
// asking the followers (ApplyStatus) only after raft reported that every
// voter applied, it asks each follower once for the whole batch, beside
// that wait, with wait_ms: the follower answers right after its apply. A
// file is settled only when raft reported every voter past it AND every
// follower's answer covers it (applied at or past it); any other file (a
// follower that could not be asked, predates wait_ms, or answered early;
// raft's wait failed) is left not done, for the caller's per-file waitAll.
func (s *service) waitAllMany(ctx context.Context, g *raft.Group, idxs []uint64, cids []storage.ContainerID, timeoutMs uint32, stage *prometheus.HistogramVec) []fileSettled {
	if len(idxs) == 0 {
		return nil
	}
	timeout := waitTimeout(timeoutMs)
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	high := slices.Max(idxs)
	voters := g.Voters()
	type answer struct {
		id      uint64
		applied uint64
		why     []string // per file; "" = fine (if applied covers it)
		err     error
	}
	ch := make(chan answer, len(voters))
	t0 := time.Now()
	self := false
	for _, v := range voters {
		if v == s.d.ident.ID {
			self = true // answered below, on this goroutine
			continue
		}
		s.d.statusCalls.run(s.d.stopc, func() {
			a := answer{id: v, why: make([]string, len(idxs))}
			c, err := s.d.peerClient(v)
			if err != nil {
				a.err = err
				ch <- a
				return
			}
			req := &datanodepb.ApplyStatusRequest{PipelineId: g.ID(), Index: idxs[0], ContainerId: uint64(cids[0]),
				WaitMs: uint32(min(timeout.Milliseconds(), maxApplyStatusWaitMs))}
			for k := 1; k < len(idxs); k++ {
				req.More = append(req.More, &datanodepb.ApplyStatusEntry{Index: idxs[k], ContainerId: uint64(cids[k])})
			}
			r, err := c.ApplyStatus(wctx, req)
			switch {
			case err != nil:
				a.err = err
			case len(r.GetMore()) != len(idxs)-1:
				a.err = errNoBatch
			default:
				a.applied = r.GetApplied()
				a.why[0] = failedWhy(r.GetFailed(), r.GetReason())
				for k, m := range r.GetMore() {
					a.why[k+1] = failedWhy(m.GetFailed(), m.GetReason())
				}
			}
			ch <- a
		})
	}
	if self {
		// This replica applied every file already (applied_local): its
		// own answer needs no goroutine of its own.
		a := answer{id: s.d.ident.ID, why: make([]string, len(idxs))}
		for k := range idxs {
			var err error
			a.applied, a.why[k], err = s.d.applyStatus(g.ID(), idxs[k], cids[k])
			if err != nil {
				a.err = err
				break
			}
		}
		ch <- a
	}
	rerr := g.WaitAppliedAll(wctx, high)
	t1 := time.Now()
	out := make([]fileSettled, len(idxs))
	if rerr != nil {
		// The wait's own error for every file raft has not seen applied
		// everywhere (the laggards named as for the highest); the others
		// are asked on their own.
		cancel()
		for k := range idxs {
			if ok, _ := g.AppliedAll(idxs[k]); !ok {
				out[k] = fileSettled{done: true, err: s.toStatus(rerr)}
			}
		}
		return out
	}
	answers := make([]answer, 0, len(voters))
	for range voters {
		answers = append(answers, <-ch)
	}
	if stage != nil {
		stage.WithLabelValues("applied_all").Observe(t1.Sub(t0).Seconds())
		stage.WithLabelValues("apply_status").Observe(time.Since(t1).Seconds())
	}
	for k := range idxs {
		failed := map[uint64]string{}
		done := true
		for _, a := range answers {
			switch {
			case a.err != nil:
				done = false
			case a.why[k] != "":
				failed[a.id] = a.why[k]
			case a.applied < idxs[k]:
				done = false // "not yet": asked again on its own
			}
		}
		if !done {
			continue
		}
		out[k].done = true
		if len(failed) > 0 {
			out[k].err = s.toStatus(&replicaFailedError{pipeline: g.ID(), index: idxs[k], failed: failed})
		}
	}
	return out
}

// waitTimeout is a PutSmallFiles wait's timeout: WaitTimeoutMs, or 30 s
// when it is 0.
func waitTimeout(ms uint32) time.Duration {
	if ms == 0 {
		return 30 * time.Second
	}
	return time.Duration(ms) * time.Millisecond
}

// callPool runs functions on long-lived goroutines: a follower's batched
// ApplyStatus call (a gRPC client call) on a goroutine started for it grew
// that goroutine's fresh stack every time (runtime.copystack, ~0.8% of a
// small-PUT server's CPU, issue 15); a pool goroutine keeps a grown stack
// until the garbage collector shrinks it while idle.
// When no pool goroutine is idle the function gets a goroutine of its own,
// so a call never waits for another to end.
type callPool struct {
	once sync.Once
	ch   chan func()
}

// callPoolSize: two followers per pipeline, a few pipelines' batches at
// once.
const callPoolSize = 8

// run runs f on an idle pool goroutine, else on a new one. The pool's
// goroutines end when stop is closed.
func (p *callPool) run(stop <-chan struct{}, f func()) {
	p.once.Do(func() {
		p.ch = make(chan func())
		for range callPoolSize {
			go func() {
				for {
					select {
					case <-stop:
						return
					case g := <-p.ch:
						g()
					}
				}
			}()
		}
	})
	select {
	case p.ch <- f:
	default:
		go f()
	}
}
