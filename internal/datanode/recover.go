package datanode

import (
	"errors"
	"fmt"
	"regexp"
	"sync"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// Recovering a container after a deterministic apply bug (basalt admin
// container recover; docs/ARCHITECTURE.md, "Operator path for a
// deterministic apply bug"). Every replica of the pipeline met the bug at
// the same committed entry, so each holds exactly the blocks its pipeline
// committed before that entry (every later entry into the container failed
// on it: the lacking list), and the entry's own client got an error. After
// the operator deploys the fixed binary, SCM sends each datanode holding
// an UNHEALTHY replica a RecoverContainerCommand; the datanode makes the
// replica CLOSED (read only, never writable again) only when:
//   - no pipeline on this datanode still holds the container (its
//     pipeline was closed by SCM, which closes the pipeline of any replica
//     it records unhealthy, and left here): nothing can write into it any
//     more, and the pipeline's lacking list went with it, so no restart
//     marks it again (a CLOSED container is never marked again anyway:
//     newContainerSM marks only OPEN and CLOSING ones);
//   - it is UNHEALTHY because of a runtime error the guards recovered (an
//     apply, WriteData or SyncData panic: recoverableReason), as this
//     datanode recorded it (its left pipelines' reasons), or, when it no
//     longer knows the cause (restarted since), as SCM recorded it. Any
//     other cause (a failed volume, a lost or unstored chunk, a snapshot
//     this replica missed, damaged data) has its own repair path
//     (re-replication from a healthy replica) and is refused;
//   - its volume has not failed, and every committed block verifies in
//     full against its stored checksums (storage.RecoverUnhealthy): a
//     failure leaves it UNHEALTHY, the reason naming the block;
//   - the CLOSED state is durable (a synced Pebble commit) before the
//     datanode reports it.
// Whether the replica then counts is SCM's call: only if its BCSID is the
// newest any replica of the container reports (scm/recover.go).

// recoverableReasons match the reasons the guards record (applyPanicked,
// writePanicked, syncPanicked) for a runtime error, alone, in SCM's
// record ("datanode N reports its replica UNHEALTHY: ..."), or after a
// failed recovery's note (recoveries.note). Anchored at the start: the
// guard's text after any other prefix (a checksum report, a delete tx
// status wrapping a datanode's message) is not an apply bug.
//
// The same holds for a replica whose pipeline a failed raft log directory
// stopped (logDirFailedReason, logdirfail.go): its applied state is whole,
// its pipeline left, and the verification and SCM's BCSID check apply as
// for an apply bug.
var recoverableReasons = regexp.MustCompile(`^(datanode \d+ reports its replica UNHEALTHY: )?(` + regexp.QuoteMeta(RecoverFailedPrefix) + `.*; was: )?(entry \d+( \([A-Za-z]+\) failed in apply| \([A-Za-z]+\): chunk of block \d+ not stored: WriteData failed|: chunk at \d+ of block \d+ not made durable: SyncData failed): runtime error|raft log directory .+ failed; this replica's pipeline \d+ stopped$)`)

// maxRecoveries bounds the recoveries (full verifications) a datanode
// runs at once; more commands wait their turn.
const maxRecoveries = 2

// errRecoverStopping: the datanode is shutting down; the verification
// stopped and the replica stays UNHEALTHY (SCM resends the command).
var errRecoverStopping = errors.New("datanode stopping: recovery interrupted")

// recoverableReason reports whether why is a guard's record of a runtime
// error (a bug in Basalt) or of a failed raft log directory, the only
// causes RecoverContainer clears.
func recoverableReason(why string) bool { return recoverableReasons.MatchString(why) }

// recoveries are the recoveries running on a datanode and the last
// failure of each container's (in memory; the reports show them).
type recoveries struct {
	mu      sync.Mutex
	running map[uint64]bool
	failed  map[uint64]string
	sem     chan struct{} // maxRecoveries slots
}

// start marks cid's recovery running (false: one already runs) and clears
// its last failure: the new attempt's outcome is reported, not the old
// one's (SCM shows the replica "waiting" meanwhile).
func (r *recoveries) start(cid uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running[cid] {
		return false
	}
	if r.running == nil {
		r.running = map[uint64]bool{}
	}
	r.running[cid] = true
	delete(r.failed, cid)
	return true
}

// slots is the semaphore bounding concurrent recoveries.
func (r *recoveries) slots() chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sem == nil {
		r.sem = make(chan struct{}, maxRecoveries)
	}
	return r.sem
}

func (r *recoveries) finish(cid uint64, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.running, cid)
	if err == nil {
		delete(r.failed, cid)
		return
	}
	if r.failed == nil {
		r.failed = map[uint64]string{}
	}
	if len(r.failed) >= maxLeftReasons {
		clear(r.failed)
	}
	r.failed[cid] = err.Error()
}

// note prefixes an UNHEALTHY replica's reported reason with why its last
// recovery failed, if it did.
func (r *recoveries) note(cid uint64, why string) string {
	r.mu.Lock()
	f, ok := r.failed[cid]
	r.mu.Unlock()
	if !ok {
		return why
	}
	return boundReason(RecoverFailedPrefix + f + "; was: " + why)
}

// RecoverFailedPrefix starts the reported reason of an UNHEALTHY replica
// whose last recovery failed (SCM's recover.go reads it: the same text).
const RecoverFailedPrefix = "recover failed: "

// ErrRecoverRefused: the replica is not one RecoverContainer may clear
// (its cause, its pipeline or its state); the error says why.
var ErrRecoverRefused = errors.New("recover refused")

// recoverContainer runs a RecoverContainerCommand from SCM in the
// background (verifying a container reads all of it), at most
// maxRecoveries at once; a repeat while one runs is ignored. The next
// heartbeat carries a full report (the cleared failure at once, then the
// outcome).
func (d *Datanode) recoverContainer(cmd *metapb.RecoverContainerCommand) error {
	cid := cmd.GetContainerId()
	if !d.recov.start(cid) {
		return nil
	}
	d.reportSoon.Store(true)
	sem := d.recov.slots()
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		var err error
		select {
		case sem <- struct{}{}:
			_, err = d.RecoverContainer(cid, cmd.GetRecordedReason())
			<-sem
		case <-d.stopc:
			err = errRecoverStopping
		}
		d.recov.finish(cid, err)
		d.reportSoon.Store(true)
	}()
	return nil
}

// RecoverContainer recovers this datanode's UNHEALTHY replica of cid as
// CLOSED, if it is safe (see above); recorded is SCM's record of why the
// replica is UNHEALTHY, used only when this datanode no longer knows. A
// CLOSED replica is left as it is (a repeat). Errors: ErrRecoverRefused
// (the cause, the pipeline, the state or the volume), or storage's error
// naming the block that failed verification.
func (d *Datanode) RecoverContainer(cid uint64, recorded string) (storage.RecoverStats, error) {
	var st storage.RecoverStats
	rep, err := d.store.Container(storage.ContainerID(cid))
	if err != nil {
		return st, fmt.Errorf("%w: container %d: %v", ErrRecoverRefused, cid, err)
	}
	switch rep.State {
	case storage.StateClosed:
		return st, nil
	case storage.StateUnhealthy:
	default:
		return st, fmt.Errorf("%w: container %d is %v here, not UNHEALTHY", ErrRecoverRefused, cid, rep.State)
	}
	inPipeline := func() error {
		if p := d.pipelineHolding(cid); p != 0 {
			return fmt.Errorf("%w: container %d is still in pipeline %d on this datanode, which may still write it: SCM closes the pipeline of a replica it records unhealthy; retry once this datanode left it", ErrRecoverRefused, cid, p)
		}
		return nil
	}
	if err := inPipeline(); err != nil {
		return st, err
	}
	if why := d.failedVolume(rep.Volume); why != "" {
		return st, fmt.Errorf("%w: container %d: its volume %s failed (%s): re-replication repairs it", ErrRecoverRefused, cid, rep.Volume, why)
	}
	d.mu.Lock()
	why, known := d.leftSick.snapshotOne(cid)
	d.mu.Unlock()
	switch {
	case known && !recoverableReason(why):
		return st, fmt.Errorf("%w: container %d is UNHEALTHY here for another cause than an apply bug (%s): re-replication repairs it", ErrRecoverRefused, cid, why)
	case !known && !recoverableReason(recorded):
		return st, fmt.Errorf("%w: container %d: this datanode no longer knows why it is UNHEALTHY (restarted since) and SCM's record is not an apply bug (%q)", ErrRecoverRefused, cid, recorded)
	case !known:
		why = "SCM's record: " + recorded
	}
	d.log.Warn("recovering container: verifying every committed block", "container", cid, "reason", why, "bcsid", rep.BCSID, "blocks", rep.BlockCount)
	stopping := func(int64) error {
		select {
		case <-d.stopc:
			return errRecoverStopping
		default:
			return nil
		}
	}
	st, err = d.store.RecoverUnhealthy(storage.ContainerID(cid), storage.VerifyOptions{Before: stopping}, inPipeline)
	if err != nil {
		d.log.Error("container not recovered; it stays UNHEALTHY", "container", cid, "err", err)
		return st, err
	}
	d.mu.Lock()
	d.leftSick.drop(cid)
	d.mu.Unlock()
	d.log.Warn("container recovered: CLOSED (read only)", "container", cid, "blocks", st.Blocks, "bytes", st.Bytes, "bcsid", rep.BCSID, "was", why)
	return st, nil
}

// snapshotOne is why a left pipeline's state machine marked cid, if it
// did. Guarded by Datanode.mu.
func (l *leftReasons) snapshotOne(cid uint64) (string, bool) {
	r, ok := l.m[cid]
	return r.why, ok
}

// pipelineHolding is a pipeline on this datanode that tracks cid or only
// marked it (its lacking list: a container created UNHEALTHY by a failed
// write it never held otherwise), 0 if none. Either may still see entries
// into cid.
func (d *Datanode) pipelineHolding(cid uint64) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, sm := range d.sms {
		if sm.hasContainer(cid) {
			return id
		}
		if _, ok := sm.lacks(cid); ok {
			return id
		}
	}
	return 0
}
