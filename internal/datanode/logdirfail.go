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
//     (lostMembers: "holds an unhealthy replica"), the other replicas
//     close the containers through the pipeline's log, and the replication
//     manager rebuilds the third replica elsewhere; SCM's ClosePipeline
//     then removes the pipeline here (leavePipeline: its log's removal on
//     the failed directory fails and is left: see leavePipeline);
//   - each such pipeline's report names the directory as its slow disk
//     (PipelineReport.slow_disk): a pipeline with no container to report
//     is closed by SCM's slow-disk rule, one per its interval;
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

// reportFailedLogDirs names, in a heartbeat's pipeline reports, the failed
// log directory of each pipeline stopped by one (as a slow disk: SCM
// closes the pipeline even if it has no container to report).
func (d *Datanode) reportFailedLogDirs(req *metapb.HeartbeatRequest) {
	d.logFail.mu.Lock()
	defer d.logFail.mu.Unlock()
	if len(d.logFail.done) == 0 {
		return
	}
	for _, p := range req.Pipelines {
		if dir, ok := d.logFail.done[p.PipelineId]; ok && p.SlowDisk == "" {
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
