package faulttest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// PipelineUnwritable: after the cluster settled, an open THREE pipeline
// did not take one small block within the bound (a wedged Raft group, a
// container every write is refused from, ...).
const PipelineUnwritable = "PIPELINE_UNWRITABLE"

// CheckPipelines writes one small block into every open THREE pipeline
// SCM lists (a block allocated with every other pipeline excluded, then a
// PutSmallFile to the members in turn until the leader takes it), retrying
// for up to within. A pipeline that never takes it is a violation: once
// every process is back, the faults must not have left a pipeline that
// SCM still hands out but that cannot be written.
func (ch *Checker) CheckPipelines(ctx context.Context, within time.Duration) {
	s, err := ch.C.scm(ctx)
	if err != nil {
		ch.Logf("pipeline check: %v", err)
		return
	}
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	r, err := s.ListPipelines(lctx, &metapb.ListPipelinesRequest{})
	cancel()
	if err != nil {
		ch.Logf("pipeline check: list pipelines: %v", err)
		return
	}
	var open []*metapb.Pipeline
	for _, p := range r.Pipelines {
		if p.State == metapb.PipelineState_PIPELINE_OPEN && p.Replication == metapb.Replication_THREE {
			open = append(open, p)
		}
	}
	deadline := time.Now().Add(within)
	var wg sync.WaitGroup
	for _, p := range open {
		var others []uint64
		for _, o := range open {
			if o.Id != p.Id {
				others = append(others, o.Id)
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var why string
			for attempt := 1; ; attempt++ {
				var ok bool
				ok, why = ch.writePipeline(ctx, p, others)
				if ok {
					ch.Logf("pipeline check: pipeline %d %s took a block (attempt %d)", p.Id, ch.names(p.Datanodes), attempt)
					return
				}
				if time.Now().Add(2*time.Second).After(deadline) || ctx.Err() != nil {
					break
				}
				time.Sleep(2 * time.Second)
			}
			ch.add(Finding{Class: PipelineUnwritable, Block: fmt.Sprintf("pipeline %d", p.Id),
				Detail: fmt.Sprintf("pipeline %d %s took no block within %v; last attempt: %s", p.Id, ch.names(p.Datanodes), within, why)}, true)
		}()
	}
	wg.Wait()
}

func (ch *Checker) writePipeline(ctx context.Context, p *metapb.Pipeline, others []uint64) (bool, string) {
	const n = 4096
	// Through the namespace (an open key that is never committed and
	// expires), so the block comes with the write token datanodes require.
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	ar, err := ch.Client.Namespace().OpenKey(actx, &metapb.OpenKeyRequest{Volume: ch.Volume, Bucket: ch.Bucket,
		Key: fmt.Sprintf("liveness-%d-%d", p.Id, time.Now().UnixNano()), Replication: metapb.Replication_THREE,
		Exclude: &metapb.ExcludeList{Pipelines: others}, SizeHint: n})
	cancel()
	if err != nil {
		return false, "allocate: " + rpcWhy(err)
	}
	if len(ar.Blocks) == 0 || ar.Blocks[0].PipelineId != p.Id {
		return false, fmt.Sprintf("SCM allocated no block in pipeline %d: %v", p.Id, ar.Blocks)
	}
	loc := ar.Blocks[0]
	data := keyData(loc.Id.GetLocalId(), n, nil)
	sums := storage.Checksum{Type: storage.ChecksumCRC32C, BytesPerChecksum: storage.DefaultBytesPerChecksum}.Compute(data)
	req := &datanodepb.PutSmallFileRequest{PipelineId: loc.PipelineId, WaitTimeoutMs: 10000, Data: data,
		Block: &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: loc.Id.GetContainerId(), LocalId: loc.Id.GetLocalId()}, Length: n,
			Chunks: []*datanodepb.ChunkInfo{{Offset: 0, Length: n, Checksum: &datanodepb.ChecksumData{
				Type: datanodepb.ChecksumType_CHECKSUM_CRC32C, BytesPerChecksum: sums.BytesPerChecksum, Sums: sums.Sums}}}}}
	var errs []string
	for _, d := range loc.Datanodes {
		dn, err := ch.dn(d.DataAddr)
		if err != nil {
			errs = append(errs, d.Hostname+": "+err.Error())
			continue
		}
		pctx, cancel := context.WithTimeout(blocktoken.WithToken(ctx, loc.Token), 20*time.Second)
		_, err = dn.PutSmallFile(pctx, req)
		cancel()
		if err == nil {
			return true, ""
		}
		errs = append(errs, d.Hostname+": "+rpcWhy(err))
	}
	return false, fmt.Sprintf("block c%d/b%d: %s", loc.Id.GetContainerId(), loc.Id.GetLocalId(), strings.Join(errs, "; "))
}
