package datanode

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/stream"
)

// A container belongs to one pipeline: the one SCM allocated it to, whose
// state machine recorded it (containerSM.track, durably) when the first
// write or stream created it here. A write into it through another
// pipeline this datanode is also in is refused, twice over:
//
//   - before it is proposed: the write token names the block's pipeline
//     (blocktoken.Claims.CheckPipeline), and the leader refuses a
//     container another of its pipelines holds (checkOwner; the stream
//     header on every hop likewise);
//   - when it is applied: a state machine never adopts a container that
//     another pipeline's state machine on this datanode holds (it fails
//     the entry, changes nothing in the container and does not mark it
//     UNHEALTHY: the container is healthy, the entry is foreign).
//
// Without both, pipeline P2 = {A,D,E} could take a write for a container
// c of P1 = {A,B,C}: on A, c's blocks would get P2's log indexes as
// BCSIDs (far above P1's), stray copies of c would appear on D and E, and
// once c closed SCM would see B and C as lagging and replace them, with A
// the only source. The apply check reads this datanode's pipelines, which
// differ between replicas; the decision is the same on every replica in
// practice because no entry for another pipeline's container reaches a
// log: the token binding holds on the leader whatever it holds, and the
// apply check only keeps a replica safe should one get there anyway.

// errOtherPipeline: the container belongs to another pipeline here.
var errOtherPipeline = errors.New("container belongs to another pipeline")

// otherOwner returns the pipeline other than pipeline whose state machine
// holds cid on this datanode, if there is one and pipeline's does not.
func (d *Datanode) otherOwner(cid, pipeline uint64) (uint64, bool) {
	d.mu.Lock()
	own := d.sms[pipeline]
	sms := make(map[uint64]*containerSM, len(d.sms))
	for id, sm := range d.sms {
		if id != pipeline {
			sms[id] = sm
		}
	}
	d.mu.Unlock()
	if own != nil && own.hasContainer(cid) {
		return 0, false
	}
	for id, sm := range sms {
		if sm.hasContainer(cid) {
			return id, true
		}
	}
	return 0, false
}

// ownerError says why a write into cid through pipeline is refused.
func (d *Datanode) ownerError(cid, pipeline uint64) error {
	if other, ok := d.otherOwner(cid, pipeline); ok {
		return fmt.Errorf("datanode %d: container %d belongs to pipeline %d, not to pipeline %d: write it through its own pipeline: %w",
			d.ident.ID, cid, other, pipeline, errOtherPipeline)
	}
	return nil
}

// checkOwner refuses (FAILED_PRECONDITION, BAD_REQUEST) a write into a
// container of another pipeline, before it is proposed.
func (s *service) checkOwner(cid, pipeline uint64) error {
	if err := s.d.ownerError(cid, pipeline); err != nil {
		return dnError(codes.FailedPrecondition, datanodepb.Error_BAD_REQUEST, err.Error(), nil)
	}
	return nil
}

// checkStreamOwner is checkOwner for a V2 stream header.
func (d *Datanode) checkStreamOwner(h *stream.Header) *stream.Error {
	if err := d.ownerError(h.Block.Container, h.Pipeline); err != nil {
		return &stream.Error{Code: stream.CodeBadHeader, Datanode: d.ident.ID, Reason: err.Error()}
	}
	return nil
}
