package datanode_test

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
	"github.com/basalt-store/basalt/internal/vfs"
)

// failedOf returns the replicas a REPLICA_FAILED error names.
func failedOf(err error) []uint64 {
	if e := dnErrorOf(err); e != nil && e.GetKind() == datanodepb.Error_REPLICA_FAILED {
		return e.GetFailed()
	}
	return nil
}

// TestWaitAllFailsWhenAFollowerCannotStore (scenario 1): a follower whose
// disk refuses block writes (ENOSPC, EIO) used to acknowledge and apply
// the entries anyway ("lost" in memory), so PutSmallFile and PutBlock with
// wait_all succeeded with two copies, and the container was reported to
// SCM as CLOSED. A block file whose fsync fails is the same: the chunk is
// not durable, so the entry must not count as stored. Now the wait fails with REPLICA_FAILED naming that
// follower, and the follower reports the container UNHEALTHY.
func TestWaitAllFailsWhenAFollowerCannotStore(t *testing.T) {
	for _, c := range []struct {
		name, op string
		err      error
	}{{"ENOSPC", "write", syscall.ENOSPC}, {"EIO", "write", syscall.EIO}, {"fsync EIO", "sync", syscall.EIO}} {
		t.Run(c.name, func(t *testing.T) {
			ff := vfs.NewFaultFS(vfs.Default)
			e := startEnvWith(t, func(cfg *cluster.Config) { cfg.Storage.FS = ff })
			ctx := testCtx(t)
			b := e.block()
			leader := e.leaderClient(b.GetPipelineId())
			var fid uint64
			for _, d := range b.GetDatanodes() {
				if _, dn := e.byID(d.GetId()); !dn.IsPipelineLeader(b.GetPipelineId()) {
					fid = d.GetId()
					break
				}
			}
			fi, follower := e.byID(fid)
			fdir := filepath.Join(e.dir, fmt.Sprintf("dn%d", fi+1)) + string(filepath.Separator)
			ff.SetInject(func(op, path string) error {
				if op == c.op && strings.HasPrefix(path, fdir) && strings.HasSuffix(path, ".block") {
					return c.err
				}
				return nil
			})

			// PutSmallFile always waits for every replica. Larger than
			// storage.DefaultDeferredMax: a smaller chunk is durable in
			// the storage WAL, its block file synced in the background
			// (a failed fsync there fails the volume, not this write).
			data := randBytes(storage.DefaultDeferredMax+10_000, 1)
			_, err := leader.PutSmallFile(ctx, &datanodepb.PutSmallFileRequest{PipelineId: b.GetPipelineId(), Block: smallBlock(b, data), Data: data, WaitTimeoutMs: 10000})
			if got := failedOf(err); !slices.Equal(got, []uint64{fid}) {
				t.Fatalf("PutSmallFile with follower %d unable to store: %v (failed %v), want REPLICA_FAILED naming %d", fid, err, got, fid)
			}

			// WriteChunk + PutBlock with wait_all, into the same container
			// (SCM allocates no more blocks there once it hears the
			// container is UNHEALTHY; datanodes do not check allocations).
			id := &datanodepb.BlockID{ContainerId: b.GetId().GetContainerId(), LocalId: b.GetId().GetLocalId() + 1<<20}
			e.mint(stream.BlockID{Container: id.ContainerId, Local: id.LocalId}, b.GetPipelineId())
			ci := chunkOf(0, data)
			if _, err := leader.WriteChunk(ctx, &datanodepb.WriteChunkRequest{PipelineId: b.GetPipelineId(), Block: id, Chunk: ci, Data: data}); err != nil {
				t.Fatalf("WriteChunk (the leader stores it): %v", err)
			}
			_, err = leader.PutBlock(ctx, &datanodepb.PutBlockRequest{PipelineId: b.GetPipelineId(), WaitAll: true, WaitTimeoutMs: 10000,
				Block: &datanodepb.BlockData{Id: id, Length: uint64(len(data)), Chunks: []*datanodepb.ChunkInfo{ci}}})
			// By now SCM may have heard of the UNHEALTHY replica and closed
			// the pipeline (a pipeline closes on an unhealthy member), so
			// another replica may have left it and be named too; the
			// follower that cannot store must be among those named.
			if got := failedOf(err); !slices.Contains(got, fid) {
				t.Fatalf("PutBlock wait_all with follower %d unable to store: %v (failed %v), want REPLICA_FAILED naming %d", fid, err, got, fid)
			}

			// The follower reports the container UNHEALTHY to SCM.
			cid := b.GetId().GetContainerId()
			var st metapb.ContainerState
			for _, r := range follower.ContainerReports() {
				if r.GetContainerId() == cid {
					st = r.GetState()
				}
			}
			if st != metapb.ContainerState_CONTAINER_UNHEALTHY {
				t.Fatalf("follower %d reports container %d as %v, want CONTAINER_UNHEALTHY", fid, cid, st)
			}
		})
	}
}
