package scm

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// A member's replica of a pipeline can stop for good: its Raft log
// directory failed (internal/datanode/logdirfail.go). The datanode then
// reports the pipeline failed (PipelineReport.failed, with the reason,
// naming the directory) in every heartbeat until it leaves it. That is a
// fact, not a suspicion like a slow disk: SCM closes the pipeline at the
// next Tick, on the first such report of any member, without the slow-disk
// rule's rate limit, minimum age or minimum of open pipelines; until that
// Tick, allocation neither hands it out nor creates a container on it.
// Its open containers go CLOSING in the same entry (as for any pipeline
// close) and createPipelines replaces it. A report of a pipeline the datanode is not
// a member of changes nothing (logged once per datanode and pipeline, for
// at most 64 pipelines per datanode, then one line saying further ones
// are not logged); a report of a pipeline already closed changes nothing.
//
// The heartbeat also tells how many Raft log directories the datanode has
// and how many failed (HeartbeatRequest.log_dirs, log_dirs_failed). A
// datanode with none healthy cannot start a pipeline (its raft host places
// no group on a failed directory): createPipelines places none there until
// it reports a healthy one (after a restart), allocation skips the open
// pipelines it is a member of, and Tick closes them ("failed on datanode
// N: every raft log directory failed"), including one the datanode never
// started and so never reports (placed there just before the failure).
// It stays HEALTHY: its CLOSED containers keep serving reads and it stays
// a replication target. An older datanode tells no count (0): it is
// placed as before.

// maxFailedReasonBytes bounds a datanode's failed-pipeline reason as SCM
// keeps it.
const maxFailedReasonBytes = 256

// maxFailWarned bounds nodeSoft.failWarned: the non-member reports logged
// per datanode (one more line says that further ones are not).
const maxFailWarned = 64

// pipeFailure is a member's report that its replica of an open pipeline
// stopped for good, not yet acted on (Tick closes the pipeline).
type pipeFailure struct {
	dn     uint64
	reason string // the datanode's, cleaned and bounded
}

// noLogDirs: the datanode reported Raft log directories and every one of
// them failed. Callers hold m.mu.
func (n *nodeSoft) noLogDirs() bool {
	return n != nil && n.logDirs > 0 && n.logDirsFailed >= n.logDirs
}

// pipelineFailuresLocked records a heartbeat's log directory counts and
// its failed-pipeline reports. Callers hold m.mu.
func (m *Manager) pipelineFailuresLocked(n *nodeSoft, req *metapb.HeartbeatRequest) {
	dn := req.DatanodeId
	total, failed := req.LogDirs, req.LogDirsFailed
	if failed > total {
		m.log.Warn("scm: heartbeat reports more failed log directories than it has; taken as all failed", "datanode", dn, "log_dirs", total, "failed", failed)
		failed = total
	}
	if n.noLogDirs() && !(total > 0 && failed >= total) {
		m.log.Info("scm: datanode has a healthy raft log directory again; it takes pipelines", "datanode", dn, "log_dirs", total, "failed", failed)
	} else if !n.noLogDirs() && total > 0 && failed >= total {
		m.log.Warn("scm: every raft log directory of the datanode failed; no new pipeline goes there (its closed containers still serve)", "datanode", dn, "log_dirs", total)
	}
	n.logDirs, n.logDirsFailed = total, failed
	for _, r := range req.Pipelines {
		if r.Failed == "" {
			continue
		}
		if _, ok := m.pipeFailed[r.PipelineId]; ok {
			continue
		}
		p := m.st.Pipeline(r.PipelineId)
		if p == nil || !slices.Contains(p.Datanodes, dn) {
			switch {
			case n.failWarned[r.PipelineId]:
			case len(n.failWarned) < maxFailWarned:
				if n.failWarned == nil {
					n.failWarned = map[uint64]bool{}
				}
				n.failWarned[r.PipelineId] = true
				m.log.Warn("scm: datanode reports failed a pipeline it is not a member of; ignored", "datanode", dn, "pipeline", r.PipelineId, "known", p != nil)
			case !n.failWarnedFull:
				n.failWarnedFull = true
				m.log.Warn("scm: datanode reports failed too many pipelines it is not a member of; further ones are ignored without a log line", "datanode", dn, "logged", maxFailWarned, "pipeline", r.PipelineId)
			}
			continue
		}
		if p.State != metapb.PipelineState_PIPELINE_OPEN {
			continue
		}
		if m.pipeFailed == nil {
			m.pipeFailed = map[uint64]pipeFailure{}
		}
		why := cleanReason(r.Failed, maxFailedReasonBytes)
		m.pipeFailed[p.Id] = pipeFailure{dn: dn, reason: why}
		m.log.Warn("scm: a member reports its replica of the pipeline failed; closing it", "pipeline", p.Id, "datanode", dn, "reason", why)
	}
}

// noLogDirsReason is the failure of a pipeline closed because a member
// reported every Raft log directory failed.
const noLogDirsReason = "every raft log directory failed"

// failedCloseReason is the close reason of a pipeline a member reported
// failed (scmserver.go hides the part after the colon from non-admins).
func failedCloseReason(dn uint64, reason string) string {
	return fmt.Sprintf("failed on datanode %d: %s", dn, reason)
}

// closeFailedPipelines closes every open pipeline a member reported failed
// (Tick): one entry per datanode and reason, so a failed directory holding
// many pipelines closes them together.
func (m *Manager) closeFailedPipelines(ctx context.Context) error {
	m.mu.Lock()
	groups := map[pipeFailure][]uint64{}
	for id, f := range m.pipeFailed {
		if p := m.st.Pipeline(id); p == nil || p.State != metapb.PipelineState_PIPELINE_OPEN {
			delete(m.pipeFailed, id)
			continue
		}
		groups[f] = append(groups[f], id)
	}
	// An open pipeline with a member whose every log directory failed:
	// its replica there cannot run, whether or not the datanode lists the
	// pipeline (one placed there just before the failure, or before its
	// counts arrived, never started, so it is never reported failed).
	var noLog []uint64
	for id, n := range m.nodes {
		if n.noLogDirs() {
			noLog = append(noLog, id)
		}
	}
	if len(noLog) > 0 {
		slices.Sort(noLog)
		for _, repl := range []metapb.Replication{metapb.Replication_ONE, metapb.Replication_THREE} {
			for _, p := range m.st.OpenPipelines(repl) {
				if _, ok := m.pipeFailed[p.Id]; ok {
					continue // already grouped, with the member's own reason
				}
				for _, dn := range noLog {
					if slices.Contains(p.Datanodes, dn) {
						f := pipeFailure{dn: dn, reason: noLogDirsReason}
						groups[f] = append(groups[f], p.Id)
						break
					}
				}
			}
		}
	}
	m.mu.Unlock()
	keys := make([]pipeFailure, 0, len(groups))
	for f, ids := range groups {
		slices.Sort(ids)
		keys = append(keys, f)
	}
	slices.SortFunc(keys, func(a, b pipeFailure) int { return cmp.Compare(groups[a][0], groups[b][0]) })
	for _, f := range keys {
		ids := groups[f]
		why := failedCloseReason(f.dn, f.reason)
		if _, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ClosePipelines{ClosePipelines: &metapb.ClosePipelinesOp{PipelineIds: ids, Reason: why}}}); err != nil {
			return err
		}
		m.mu.Lock()
		for _, id := range ids {
			delete(m.pipeFailed, id)
		}
		m.mu.Unlock()
		m.log.Warn("scm: pipelines closed: a member reported them failed", "pipelines", ids, "reason", why)
	}
	return nil
}
