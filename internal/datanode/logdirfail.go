package datanode

import (
	"errors"
	"fmt"
	"sync"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// A failed Raft log directory (a fatal I/O error on its disk, see
// internal/raft/logfatal.go) stops the pipelines whose log is in it, on
// this datanode only; the process and the other log directories' pipelines
// go on. This replica of such a pipeline has stopped at some entry the
// others went past, and applies nothing more, so:
//
//   - each container of the pipeline that is not CLOSED here is marked
//     UNHEALTHY ("raft log directory ... failed"), through the state
//     machine's own record (sickFile, on the data volume, then storage),
//     and a full report goes out at once. SCM records the unhealthy
//     replicas, moves the containers to CLOSING, closes the pipeline
//     (with the `failed` report below in the same heartbeat, the reason
//     is "failed on datanode N: raft log directory ... failed"; an older
//     SCM: lostMembers, "holds an unhealthy replica"), the other replicas
//     close the containers through the pipeline's log, and the replication
//     manager rebuilds the third replica elsewhere; SCM's ClosePipeline
//     then removes the pipeline here (leavePipeline: its log's removal on
//     the failed directory fails and is left: see leavePipeline);
//   - each such pipeline's report says it failed (PipelineReport.failed:
//     "raft log directory ... failed"), in every heartbeat until this
//     datanode leaves it: SCM closes the pipeline at once on the first
//     such report of any member, with no open container needed
//     (scm/pipefail.go). The report also names the directory as its slow
//     disk (PipelineReport.slow_disk), for an older SCM, which ignores
//     `failed` and closes it by its slow-disk rule, one per its interval;
//   - every heartbeat tells how many Raft log directories this datanode
//     has and how many failed (HeartbeatRequest.log_dirs,
//     log_dirs_failed): with none healthy, SCM places no new pipeline
//     here (the host could not start it), closes every open pipeline it
//     is a member of (one placed here just before the failure never
//     started, so it is never reported failed) and `basalt admin datanode
//     list` shows it; the datanode stays HEALTHY for its CLOSED containers;
//   - CLOSED containers are not touched: their data is on the data volumes
//     and they keep serving reads.
//
// When no healthy replica goes on (a single-voter pipeline, RF=ONE, or
// every replica's directory failed, e.g. a cluster-wide full disk), SCM
// finds no healthy replica to close the container on and it stays
// CLOSING. The UNHEALTHY reason above is then recoverable by the operator
// (`basalt admin container recover`, recover.go): once SCM closed the
// pipeline and this datanode left it, the replica's state is whole up to
// its applied index. Everything it applied went through the state machine
// onto the data volume (a different disk from the log), and a failed log
// directory only stops what comes next. An entry committed but not yet
// applied here was never acknowledged: a block is acknowledged only once
// every replica has applied it. RecoverContainer still verifies every
// committed block against its checksums, and SCM counts the CLOSED
// replica only if its BCSID is the newest any replica reports. With RF=3
// and one failed replica, the other two are ahead, so SCM does not count
// it (scm/recover.go).
//
// The raft host never places a new pipeline on the failed directory. A
// restart of the datanode opens the directory again (raft.NewHost fails if
// its disk still fails: the datanode then does not start, and says why).

// logDirFailedReason is the UNHEALTHY reason of a container whose
// pipeline a failed log directory stopped (recoverableReasons matches it).
const logDirFailedReason = "raft log directory %s failed; this replica's pipeline %d stopped"

// logDirFailures remembers which failed pipelines were handled.
type logDirFailures struct {
	mu   sync.Mutex
	done map[uint64]string // pipeline → its failed log directory
}

// onLogDirFailed is the raft host's OnLogDirFailed, on the failed
// directory's loop (whose groups are all stopped: only a RemoveGroup of
// one of them waits for it meanwhile).
func (d *Datanode) onLogDirFailed(dir string, err error, groups []uint64) {
	d.log.Error("raft log directory FAILED: its pipelines stop here and are reported for closing; the datanode goes on",
		"dir", dir, "pipelines", groups, "err", err)
	d.checkLogDirs()
}

// checkLogDirs marks UNHEALTHY the open containers of every pipeline
// whose group stopped for a failed log directory, once per pipeline, and
// asks for a full report. Also run by each heartbeat (a pipeline joined
// while its directory failed is caught there).
func (d *Datanode) checkLogDirs() {
	if d.host == nil {
		return
	}
	d.mu.Lock()
	sms := make(map[uint64]*containerSM, len(d.sms))
	for id, sm := range d.sms {
		sms[id] = sm
	}
	d.mu.Unlock()
	marked := false
	for id, sm := range sms {
		g, err := d.host.Group(id)
		if err != nil {
			continue
		}
		ferr := g.Failure()
		if !errors.Is(ferr, raft.ErrLogDirFailed) {
			continue
		}
		dir := g.Status().LogDir
		d.logFail.mu.Lock()
		if d.logFail.done == nil {
			d.logFail.done = map[uint64]string{}
		}
		_, seen := d.logFail.done[id]
		d.logFail.done[id] = dir
		d.logFail.mu.Unlock()
		if seen {
			continue
		}
		why := fmt.Sprintf(logDirFailedReason, dir, id)
		sm.mu.Lock()
		cids := sm.containerListLocked()
		sm.mu.Unlock()
		index := sm.applied.Load() + 1
		for _, cid := range cids {
			if r, err := d.store.Container(storage.ContainerID(cid)); err == nil && r.State == storage.StateClosed {
				continue // its data is on the data volume: it keeps serving reads
			}
			sm.markUnhealthy(storage.ContainerID(cid), index, why)
			marked = true
		}
		d.log.Warn("pipeline stopped by its failed log directory: open containers reported UNHEALTHY", "pipeline", id, "dir", dir, "containers", len(cids), "cause", ferr)
	}
	if marked {
		d.reportSoon.Store(true)
	}
}

// pipelineFailedReason is a stopped pipeline's PipelineReport.failed.
const pipelineFailedReason = "raft log directory %s failed"

// reportFailedLogDirs fills a heartbeat's log directory counts and marks,
// in its pipeline reports, each pipeline stopped by a failed log
// directory as failed (SCM closes it at once, even with no container to
// report) and names the directory as its slow disk (for an older SCM).
func (d *Datanode) reportFailedLogDirs(req *metapb.HeartbeatRequest) {
	for _, st := range d.LogDirs() {
		req.LogDirs++
		if st.Failed {
			req.LogDirsFailed++
		}
	}
	d.logFail.mu.Lock()
	defer d.logFail.mu.Unlock()
	if len(d.logFail.done) == 0 {
		return
	}
	for _, p := range req.Pipelines {
		dir, ok := d.logFail.done[p.PipelineId]
		if !ok {
			continue
		}
		p.Failed = fmt.Sprintf(pipelineFailedReason, dir)
		if p.SlowDisk == "" {
			p.SlowDisk = dir
		}
	}
}

// LogDirs reports the Raft log directories (failed ones included).
func (d *Datanode) LogDirs() []raft.LogDirStatus {
	if d.host == nil {
		return nil
	}
	return d.host.LogDirs()
}
