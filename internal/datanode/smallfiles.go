package datanode

import (
	"context"
	"fmt"
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
	var wg sync.WaitGroup
	for j, v := range valid {
		if errs[j] != nil {
			results[v.i] = smallFileResult(0, s.toStatus(errs[j]))
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.waitAllTimed(ctx, g, res[j].Index, v.cid, req.GetWaitTimeoutMs(), stage); err != nil {
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
		Help:    "Stages of a PutSmallFiles call on the pipeline leader: applied_local (ProposeMany until every file applied here), applied_all (per file, then until every voter reported applying it), apply_status (per file, then the replicas' ApplyStatus answers), total (the call).",
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
	timeout := time.Duration(timeoutMs) * time.Millisecond
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
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
