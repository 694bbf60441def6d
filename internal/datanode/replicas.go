package datanode

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
)

// replicaFailedError: replicas applied an entry but failed it (or hold
// its container UNHEALTHY); the wait for all replicas fails naming them.
type replicaFailedError struct {
	pipeline, index uint64
	failed          map[uint64]string // replica → why
}

func (e *replicaFailedError) ids() []uint64 { return slices.Sorted(maps.Keys(e.failed)) }

func (e *replicaFailedError) Error() string {
	var parts []string
	for _, id := range e.ids() {
		parts = append(parts, fmt.Sprintf("replica %d: %s", id, e.failed[id]))
	}
	return fmt.Sprintf("datanode: pipeline %d: entry %d not stored on every replica: %s", e.pipeline, e.index, strings.Join(parts, "; "))
}

// applyStatus says whether this replica of pipeline applied entry index
// successfully, with the container it wrote into still healthy here: it
// returns the replica's applied index and, if not, why ("" if fine).
func (d *Datanode) applyStatus(pipeline, index uint64, cid storage.ContainerID) (uint64, string, error) {
	d.mu.Lock()
	sm := d.sms[pipeline]
	d.mu.Unlock()
	if sm == nil {
		return 0, "", fmt.Errorf("datanode %d is not in pipeline %d", d.ident.ID, pipeline)
	}
	applied := sm.applied.Load()
	if applied < index {
		return applied, "", nil
	}
	if why, ok := sm.failure(index); ok {
		return applied, fmt.Sprintf("entry %d failed: %s", index, why), nil
	}
	// The state machine's durable record (sm.go, containerSM): a container
	// this replica does not fully hold, even if its storage mark did not
	// stick, or it does not exist here.
	if why, ok := sm.lacks(uint64(cid)); ok {
		return applied, fmt.Sprintf("container %d lacks data here: %s", cid, why), nil
	}
	rep, err := d.store.Container(cid)
	// An entry covered by a restored snapshot was never applied here: only
	// a container closed here afterwards (by an entry this replica
	// applied) is known to hold it.
	if r := sm.restoredIndex(); index <= r && (err != nil || rep.State != storage.StateClosed) {
		return applied, fmt.Sprintf("entry %d was skipped by a snapshot at %d restored here, and container %d is not CLOSED here", index, r, cid), nil
	}
	switch {
	case errors.Is(err, storage.ErrContainerNotFound):
		return applied, fmt.Sprintf("container %d does not exist here", cid), nil
	case err != nil:
		return applied, fmt.Sprintf("container %d: %v", cid, err), nil
	case rep.State == storage.StateUnhealthy:
		return applied, fmt.Sprintf("container %d is UNHEALTHY here", cid), nil
	}
	return applied, "", nil
}

// checkReplicas asks every voter of the pipeline (this datanode locally,
// the others by ApplyStatus, in parallel) whether it applied entry index
// successfully; raft already reported that each applied it. A replica
// that cannot be asked counts as failed: an acknowledgement must not rest
// on a replica nobody could confirm.
func (d *Datanode) checkReplicas(ctx context.Context, pipeline uint64, voters []uint64, index uint64, cid storage.ContainerID) error {
	type answer struct {
		id  uint64
		why string
	}
	ch := make(chan answer, len(voters))
	for _, v := range voters {
		go func() { ch <- answer{v, d.askApplied(ctx, v, pipeline, index, cid)} }()
	}
	failed := map[uint64]string{}
	for range voters {
		if a := <-ch; a.why != "" {
			failed[a.id] = a.why
		}
	}
	if len(failed) > 0 {
		return &replicaFailedError{pipeline: pipeline, index: index, failed: failed}
	}
	return nil
}

// askApplied asks one replica (see checkReplicas); "" means it applied the
// entry successfully. A replica whose applied index is behind (it
// restarted since raft heard from it, and replays) is asked again until it
// catches up or ctx ends.
func (d *Datanode) askApplied(ctx context.Context, id, pipeline, index uint64, cid storage.ContainerID) string {
	backoff := 5 * time.Millisecond
	for {
		var applied uint64
		var why string
		if id == d.ident.ID {
			var err error
			if applied, why, err = d.applyStatus(pipeline, index, cid); err != nil {
				return err.Error()
			}
		} else {
			c, err := d.peerClient(id)
			if err != nil {
				return fmt.Sprintf("cannot ask it: %v", err)
			}
			applied, why, err = d.askBatched(ctx, id, pipeline, index, cid)
			if errors.Is(err, errNoBatch) {
				var r *datanodepb.ApplyStatusResponse
				if r, err = c.ApplyStatus(ctx, &datanodepb.ApplyStatusRequest{PipelineId: pipeline, Index: index, ContainerId: uint64(cid)}); err == nil {
					applied, why = r.GetApplied(), failedWhy(r.GetFailed(), r.GetReason())
				}
			}
			if err != nil {
				return fmt.Sprintf("cannot ask it: %v", err)
			}
		}
		if why != "" || applied >= index {
			return why
		}
		select {
		case <-ctx.Done():
			return fmt.Sprintf("applied only %d of %d (it restarted?)", applied, index)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 200*time.Millisecond)
	}
}

// peerClient returns a client of another datanode's gRPC service, kept
// for reuse.
func (d *Datanode) peerClient(id uint64) (datanodepb.DatanodeClient, error) {
	addr := d.peerDataAddr(id)
	if addr == "" {
		d.refreshPeers()
		if addr = d.peerDataAddr(id); addr == "" {
			return nil, fmt.Errorf("no address known for datanode %d", id)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if cc, ok := d.peerConns[addr]; ok {
		return datanodepb.NewDatanodeClient(cc), nil
	}
	if len(d.peerConns) >= maxPeerConns {
		for a, cc := range d.peerConns { // addresses of datanodes that moved
			cc.Close()
			delete(d.peerConns, a)
		}
	}
	cc, err := grpc.NewClient(addr, d.cfg.TLS.GRPCDialOption(pki.RoleDatanode))
	if err != nil {
		return nil, err
	}
	d.peerConns[addr] = cc
	return datanodepb.NewDatanodeClient(cc), nil
}

// maxPeerConns bounds the kept connections to other datanodes.
const maxPeerConns = 1024

func (d *Datanode) closePeerConns() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for a, cc := range d.peerConns {
		cc.Close()
		delete(d.peerConns, a)
	}
}
