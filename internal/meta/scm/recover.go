package scm

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Recovering a container after a deterministic apply bug (basalt admin
// container recover; docs/ARCHITECTURE.md, "Operator path for a
// deterministic apply bug"). Such a bug marks the container UNHEALTHY on
// every replica, so it is MISSING: no healthy replica to copy from. After
// the operator deploys the fixed binary, RecoverContainer (admins only)
// starts a recovery on this leader (soft state, like every command: a new
// leader knows nothing of it until asked again):
//   - each datanode reporting its replica UNHEALTHY, and no longer
//     running the container's pipeline (SCM closes the pipeline of a
//     replica it records unhealthy; the datanode would refuse while the
//     pipeline may still write it), gets a RecoverContainerCommand in
//     its heartbeat, with SCM's record of why
//     (the datanode decides whether the replica may come back, and
//     verifies it: datanode/recover.go); once per request, again only if
//     it neither recovered nor reported a failure within recoverResend;
//   - a replica its datanode then reports CLOSED is taken off the
//     container's unhealthy replicas (ReplicaRecoveredOp, through Raft)
//     only once every replica's datanode has reported in full under this
//     leader and its BCSID is the highest any of them reports: a replica
//     that stopped earlier (a bug that hit it alone, or a write it lacks)
//     may miss blocks a later entry committed and acknowledged on
//     another, so it stays recorded unhealthy ("stale") and is replaced;
//   - nor below the container's BCSID floor (Container.bcsid_floor: set
//     at close to the lowest BCSID its healthy closed replicas reported,
//     raised by a drop at most to the highest healthy replica it keeps,
//     and to the dropped replica's own BCSID only when it keeps no healthy
//     one: the recover case), which the BCSIDs reported now cannot show:
//     a dropped replica may have held acknowledged writes the recovered
//     ones lack. The status says which replica set the
//     floor and when; only --accept-dropped-replicas (logged at ERROR,
//     recorded in the ReplicaRecoveredOp, which lowers the floor to the
//     recovered BCSID) counts a replica below it;
//   - the existing paths do the rest: closedReports closes a CLOSING
//     container once its counted replicas report CLOSED, the replication
//     manager copies it back to its factor from the recovered replicas
//     and then drops the replicas that stay unhealthy.
//
// A container with a replica that counts (healthy, lagging, in
// maintenance...) is refused: the replication manager repairs it from
// that replica.

// recovery is one container's recovery on this leader.
type recovery struct {
	started time.Time
	sent    map[uint64]time.Time // datanode → when its command went out
	// acceptMissing: the operator accepted losing what replicas no longer
	// listed by their live datanodes held (--accept-missing-replicas).
	acceptMissing bool
	// acceptedFloor: the container's BCSID floor the operator saw and
	// accepted counting below (--accept-dropped-replicas=FLOOR; 0: none;
	// a floor raised above it is not accepted).
	acceptedFloor uint64
}

// recoverFailedPrefix starts the reported reason of a replica whose last
// recovery failed on its datanode (datanode.RecoverFailedPrefix).
const recoverFailedPrefix = "recover failed: "

// recoverKeep: how long a recovery is kept after it started (progress
// answers, resends); asking again restarts it.
const recoverKeep = time.Hour

// recoverResend: a command not answered by a recovery (CLOSED) or a
// failure within this long (lost with its heartbeat response, or its
// datanode restarted meanwhile) goes again.
func (m *Manager) recoverResend() time.Duration { return 4 * m.cfg.CommandRetryInterval }

func recoverKey(cid uint64) string { return "rc" + strconv.FormatUint(cid, 10) }

// RecoverContainer starts (or, with status_only, only reports) the
// recovery of a container all of whose replicas are UNHEALTHY. Starting
// it again sends every UNHEALTHY replica its command again.
func (m *Manager) RecoverContainer(ctx context.Context, req *metapb.RecoverContainerRequest) (*metapb.RecoverContainerResponse, error) {
	cid := req.GetContainerId()
	now := m.cfg.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.syncLeadership() {
		return nil, notLeader()
	}
	c := m.st.Container(cid)
	if c == nil {
		return nil, status.Errorf(codes.NotFound, "container %d not found", cid)
	}
	if m.recov == nil {
		m.recov = map[uint64]*recovery{}
	}
	r := m.recov[cid]
	if !req.GetStatusOnly() {
		if a, floor := req.GetAcceptDroppedFloor(), bcsidFloor(c); a != 0 && floor > a {
			// Only a floor the operator saw: one raised since (or
			// re-bound on a restart after a failover) is not accepted.
			return nil, status.Errorf(codes.FailedPrecondition,
				"container %d: --accept-dropped-replicas=%d accepts floor %d, but the container's BCSID floor is now %d (%s): look at the status again before accepting",
				cid, a, a, floor, floorText(c))
		}
		if r == nil {
			if err := m.recoverableLocked(c); err != nil {
				return nil, err
			}
			r = &recovery{started: now}
			m.recov[cid] = r
			m.log.Warn("scm: container recovery started (basalt admin container recover)", "container", cid, "replicas", c.Replicas, "unhealthy", c.UnhealthyReplicas)
		}
		r.started = now
		r.sent = map[uint64]time.Time{}
		r.acceptMissing = req.GetAcceptMissingReplicas()
		if r.acceptMissing {
			m.log.Warn("scm: container recovery ACCEPTS LOSING what replicas its live datanodes no longer list held (--accept-missing-replicas)", "container", cid, "replicas", c.Replicas)
		}
		r.acceptedFloor = req.GetAcceptDroppedFloor()
		if r.acceptedFloor != 0 {
			f := c.GetBcsidFloor()
			if newest, _, _ := m.newestAnyLocked(c); newest < f.GetBcsid() {
				m.log.Error("scm: container recovery ACCEPTS LOSING BCSIDs above the newest reported up to the container's BCSID floor: recovered replicas below it may be counted (--accept-dropped-replicas)",
					"container", cid, "accepted_floor", r.acceptedFloor, "floor", f.GetBcsid(), "newest", newest, "floor_datanode", f.GetDatanodeId(), "floor_set", floorTime(f), "floor_reason", f.GetReason())
			} else {
				m.log.Info("scm: container recovery may accept its BCSID floor (--accept-dropped-replicas); nothing below it is reported now, so nothing is accepted yet",
					"container", cid, "accepted_floor", r.acceptedFloor, "floor", f.GetBcsid(), "newest", newest)
			}
		}
		for _, dn := range c.Replicas {
			if n := m.nodes[dn]; n != nil {
				delete(n.sent, recoverKey(cid))
			}
		}
	}
	return m.recoverProgressLocked(c, r), nil
}

// recoverableLocked checks that c is a container only a recovery brings
// back: not OPEN, some replica unhealthy, none that counts. Callers hold
// m.mu.
func (m *Manager) recoverableLocked(c *metapb.Container) error {
	if c.State == metapb.ContainerState_CONTAINER_OPEN {
		return status.Errorf(codes.FailedPrecondition, "container %d is OPEN: no replica of it is recorded unhealthy", c.Id)
	}
	var counts, unhealthy []uint64
	for _, dn := range c.Replicas {
		switch m.replicaStatusLocked(c, dn) {
		case ReplicaUnhealthy:
			unhealthy = append(unhealthy, dn)
		case ReplicaDead, ReplicaMissing:
		case ReplicaLagging:
			// Below the newest: repaired from it. Below the floor: no
			// source for anything (replication.go), so it is no reason
			// to refuse.
			if rep := m.nodes[dn].containers[c.Id]; rep == nil || rep.Bcsid >= bcsidFloor(c) {
				counts = append(counts, dn)
			}
		default:
			counts = append(counts, dn)
		}
	}
	if len(counts) > 0 {
		return status.Errorf(codes.FailedPrecondition,
			"container %d has replicas that count (or whose datanodes have not reported yet) on datanodes %v: the replication manager repairs it from them; recover is for a container with no healthy replica", c.Id, counts)
	}
	if len(unhealthy) == 0 {
		return status.Errorf(codes.FailedPrecondition, "container %d has no UNHEALTHY replica to recover (replicas %v: dead or missing)", c.Id, c.Replicas)
	}
	return nil
}

// newestAnyLocked is the highest BCSID any replica of c reports, in any
// state; all is false while a replica's datanode is dead or has not sent
// this leader a full report (it may hold a newer one). missing lists the
// replicas whose live, fully reported datanode no longer lists the
// container: it may have held a newer replica too (lost since: a replaced
// volume...), so it blocks counting unless the operator accepts the loss
// (acceptMissing). Callers hold m.mu.
func (m *Manager) newestAnyLocked(c *metapb.Container) (newest uint64, all bool, missing []uint64) {
	all = true
	for _, dn := range c.Replicas {
		n := m.nodes[dn]
		if n == nil || n.state == metapb.NodeState_DEAD || !n.fullReported {
			all = false
			continue
		}
		if rep := n.containers[c.Id]; rep != nil {
			newest = max(newest, rep.Bcsid)
		} else {
			missing = append(missing, dn)
		}
	}
	return newest, all, missing
}

// floorTime is when f was set (RFC 3339 UTC; "" for no floor).
func floorTime(f *metapb.BcsidFloor) string {
	if f.GetUnixMs() == 0 {
		return ""
	}
	return time.UnixMilli(f.GetUnixMs()).UTC().Format(time.RFC3339)
}

// floorText says what set c's BCSID floor, for statuses and reasons.
func floorText(c *metapb.Container) string {
	f := c.GetBcsidFloor()
	if f.GetDatanodeId() != 0 {
		return fmt.Sprintf("set to BCSID %d when the replica on datanode %d was dropped from the container at %s (%s)", f.GetBcsid(), f.GetDatanodeId(), floorTime(f), f.GetReason())
	}
	return fmt.Sprintf("SCM recorded BCSID %d for the container at %s (%s)", f.GetBcsid(), floorTime(f), f.GetReason())
}

// bringBackText is the first thing to try for c below its floor: bring
// back the datanode whose dropped replica set it ("" when the close set
// it).
func bringBackText(c *metapb.Container) string {
	if dn := c.GetBcsidFloor().GetDatanodeId(); dn != 0 {
		return fmt.Sprintf("bring datanode %d back (a copy it reports at or above the floor is adopted), ", dn)
	}
	return ""
}

// belowFloorAccepted: whether r accepts counting c below its floor (asked
// with --accept-dropped-replicas while the floor was what it is now).
func belowFloorAccepted(c *metapb.Container, r *recovery) bool {
	return r != nil && r.acceptedFloor != 0 && r.acceptedFloor >= bcsidFloor(c)
}

// countableLocked: whether recovered replicas of c may be counted now (all
// replicas' datanodes reported, no replica missing unless the operator
// accepted the loss, the newest reported BCSID at or above the container's
// floor unless the operator accepted the loss), the BCSID a recovered
// replica needs, the op reason recording an accepted loss, and the floor
// accepted (ReplicaRecoveredOp.accepted_floor). Callers hold m.mu.
func (m *Manager) countableLocked(c *metapb.Container, r *recovery) (need uint64, ok bool, reason string, acceptedFloor uint64) {
	newest, all, missing := m.newestAnyLocked(c)
	if !all {
		return newest, false, "", 0
	}
	var why []string
	if len(missing) > 0 {
		if r == nil || !r.acceptMissing {
			return newest, false, "", 0
		}
		why = append(why, fmt.Sprintf("operator accepted losing what replicas on datanodes %v held (no longer listed by their live datanodes; --accept-missing-replicas): newest BCSID among the rest %d", missing, newest))
	}
	if floor := bcsidFloor(c); newest < floor {
		if !belowFloorAccepted(c, r) {
			return newest, false, "", 0
		}
		acceptedFloor = floor
		why = append(why, fmt.Sprintf("operator accepted losing BCSIDs %d to %d (--accept-dropped-replicas): %s", newest+1, floor, floorText(c)))
	}
	return newest, true, strings.Join(why, "; "), acceptedFloor
}

// recoverCommandsLocked adds the RecoverContainerCommands datanode dn
// needs (commandsFor). Callers hold m.mu.
func (m *Manager) recoverCommandsLocked(dn uint64, n *nodeSoft, now time.Time, due func(string) bool, cmds []*metapb.DatanodeCommand) []*metapb.DatanodeCommand {
	for cid, r := range m.recov {
		rep := n.containers[cid]
		if rep == nil || rep.State != metapb.ContainerState_CONTAINER_UNHEALTHY {
			continue
		}
		if t, ok := r.sent[dn]; ok && ((strings.HasPrefix(rep.UnhealthyReason, recoverFailedPrefix) && n.fullAt.After(t)) || now.Sub(t) < m.recoverResend()) {
			continue // answered with a failure since (ask again to retry), or still running
		}
		c := m.st.Container(cid)
		if c == nil || !slices.Contains(c.Replicas, dn) || n.pipelines[c.PipelineId] || !due(recoverKey(cid)) {
			continue // (still running the container's pipeline: it would refuse; SCM closes it)
		}
		r.sent[dn] = now
		cmds = append(cmds, &metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_RecoverContainer{RecoverContainer: &metapb.RecoverContainerCommand{
			ContainerId: cid, RecordedReason: m.recordedReasonLocked(cid, dn)}}})
	}
	return cmds
}

// recordedReasonLocked is SCM's record of why dn's replica of cid is
// unhealthy ("" if none).
func (m *Manager) recordedReasonLocked(cid, dn uint64) string {
	for _, r := range m.st.ReplicaReports(cid) {
		if r.GetBlock().GetLocalId() == 0 && r.GetDatanodeId() == dn && r.GetReporter() == "scm" {
			return r.GetReason()
		}
	}
	return ""
}

// recoverRound records the replicas recovered since the last round
// (Tick). A recovery is forgotten recoverKeep after it was last asked for,
// or when its container is gone.
func (m *Manager) recoverRound(ctx context.Context) error {
	now := m.cfg.Now()
	m.mu.Lock()
	var ops []*metapb.ReplicaRecoveredOp
	for cid, r := range m.recov {
		c := m.st.Container(cid)
		if c == nil || now.Sub(r.started) >= recoverKeep {
			delete(m.recov, cid)
			continue
		}
		newest, ok, reason, accepted := m.countableLocked(c, r)
		if !ok {
			continue
		}
		for _, dn := range c.UnhealthyReplicas {
			if rep := m.nodes[dn].containers[cid]; rep != nil && rep.State == metapb.ContainerState_CONTAINER_CLOSED && rep.Bcsid >= newest {
				op := &metapb.ReplicaRecoveredOp{ContainerId: cid, DatanodeId: dn, Bcsid: rep.Bcsid, Reason: reason}
				if rep.Bcsid < accepted {
					op.AcceptedFloor = accepted
				}
				ops = append(ops, op)
			}
		}
	}
	m.mu.Unlock()
	for _, op := range ops {
		// The floor check is the leader's (Apply refuses nothing on its
		// account: recover_state.go): re-read the committed floor just
		// before proposing, so only a floor raised between this check
		// and the apply slips through (then the replica stays below the
		// floor, lagging: never a source, never counted).
		m.mu.Lock()
		floor := bcsidFloor(m.st.Container(op.ContainerId))
		m.mu.Unlock()
		if op.Bcsid < floor && op.AcceptedFloor < floor {
			m.log.Warn("scm: replica recovered: not proposed, the container's BCSID floor rose", "container", op.ContainerId, "datanode", op.DatanodeId, "bcsid", op.Bcsid, "floor", floor, "accepted_floor", op.AcceptedFloor)
			continue
		}
		res, err := m.propose(ctx, &metapb.ScmCommand{Op: &metapb.ScmCommand_ReplicaRecovered{ReplicaRecovered: op}})
		if status.Code(err) == codes.FailedPrecondition {
			// Apply refused it (the container moved on): the next
			// round decides again.
			m.log.Warn("scm: replica recovered: refused", "container", op.ContainerId, "datanode", op.DatanodeId, "err", err)
			continue
		}
		if err != nil {
			return err
		}
		m.mu.Lock()
		if u := m.unhealthy[op.ContainerId]; u != nil {
			delete(u, op.DatanodeId)
			if len(u) == 0 {
				delete(m.unhealthy, op.ContainerId)
			}
		}
		m.mu.Unlock()
		if changed, _ := res.(bool); changed {
			if op.Reason != "" {
				m.log.Error("scm: replica recovered: counted again, ACCEPTING A POSSIBLE LOSS", "container", op.ContainerId, "datanode", op.DatanodeId, "bcsid", op.Bcsid, "reason", op.Reason)
			} else {
				m.log.Warn("scm: replica recovered: counted again", "container", op.ContainerId, "datanode", op.DatanodeId, "bcsid", op.Bcsid)
			}
		}
	}
	return nil
}

// recoverProgressLocked answers RecoverContainer. Callers hold m.mu.
func (m *Manager) recoverProgressLocked(c *metapb.Container, r *recovery) *metapb.RecoverContainerResponse {
	newest, all, missing := m.newestAnyLocked(c)
	resp := &metapb.RecoverContainerResponse{Container: proto.Clone(c).(*metapb.Container), Running: r != nil, NewestBcsid: newest,
		AcceptMissingReplicas: r != nil && r.acceptMissing}
	if r != nil {
		resp.AcceptedDroppedFloor = r.acceptedFloor
	}
	if f := c.GetBcsidFloor(); f != nil {
		resp.BcsidFloor = proto.Clone(f).(*metapb.BcsidFloor)
	}
	blocked := len(missing) > 0 && !resp.AcceptMissingReplicas
	floor := bcsidFloor(c)
	belowFloor := newest < floor && !belowFloorAccepted(c, r)
	done := c.State == metapb.ContainerState_CONTAINER_CLOSED
	counted := 0
	for _, dn := range c.Replicas {
		ri := &metapb.RecoverReplica{DatanodeId: dn, RecordedUnhealthy: slices.Contains(c.UnhealthyReplicas, dn)}
		n := m.nodes[dn]
		var rep *metapb.ContainerReport
		if n != nil && n.fullReported {
			rep = n.containers[c.Id]
		}
		if rep != nil {
			ri.ReportedState, ri.Bcsid, ri.Reason = rep.State, rep.Bcsid, rep.UnhealthyReason
		}
		// A failure counts only if reported after the last command went
		// out: until then the reported "recover failed" is the previous
		// attempt's, and the retry runs.
		var sentAt time.Time
		var sent bool
		if r != nil {
			sentAt, sent = r.sent[dn]
		}
		switch {
		case n == nil || n.state == metapb.NodeState_DEAD:
			ri.Status = "dead"
			done = false
		case !n.fullReported:
			ri.Status, ri.Reason = "waiting", "its datanode has not sent this SCM leader a full report yet"
			done = false
		case !ri.RecordedUnhealthy:
			st := m.replicaStatusLocked(c, dn)
			ri.Status = st.String()
			if st == ReplicaHealthy {
				counted++
			}
		case rep == nil:
			ri.Status = "missing"
			if resp.AcceptMissingReplicas {
				ri.Reason = "its datanode no longer lists the container; the operator accepted losing what only it held (--accept-missing-replicas)"
			} else {
				ri.Reason = "its datanode no longer lists the container, which may have held a newer replica: no replica is counted unless the recovery is run with --accept-missing-replicas (accepting that loss)"
			}
		case r == nil:
			// No recovery runs on this leader (never started, failover,
			// expired): nothing happens to this replica until asked; a
			// container already counted elsewhere is done without it
			// (the replication manager replaces it).
			ri.Status = "not started"
		case rep.State == metapb.ContainerState_CONTAINER_UNHEALTHY && strings.HasPrefix(rep.UnhealthyReason, recoverFailedPrefix) && sent && n.fullAt.After(sentAt):
			ri.Status = "failed"
		case rep.State == metapb.ContainerState_CONTAINER_UNHEALTHY && n.pipelines[c.PipelineId]:
			ri.Status = "waiting"
			ri.Reason = fmt.Sprintf("its datanode still runs pipeline %d, which may write the container: sent once it left it (SCM closes the pipeline of an unhealthy replica); was: %s", c.PipelineId, rep.UnhealthyReason)
			done = false
		case rep.State == metapb.ContainerState_CONTAINER_UNHEALTHY:
			ri.Status = "waiting"
			done = false
		case rep.State == metapb.ContainerState_CONTAINER_CLOSED && rep.Bcsid < newest:
			ri.Status = "stale"
			ri.Reason = fmt.Sprintf("BCSID %d is below the newest replica's %d: it may lack acknowledged blocks; replaced by a copy of a newest one", rep.Bcsid, newest)
		case rep.State == metapb.ContainerState_CONTAINER_CLOSED && !all:
			ri.Status, ri.Reason = "waiting", "recovered; counted once every replica's datanode has reported (one may hold a newer replica)"
			done = false
		case rep.State == metapb.ContainerState_CONTAINER_CLOSED && blocked:
			ri.Status = "blocked"
			ri.Reason = fmt.Sprintf("recovered, not counted: the live datanodes %v no longer list their replicas, which may have held newer blocks; bring them back, or run again with --accept-missing-replicas to accept losing what only they held", missing)
			done = false
		case rep.State == metapb.ContainerState_CONTAINER_CLOSED && belowFloor:
			ri.Status = "blocked"
			ri.Reason = fmt.Sprintf("recovered, not counted: BCSID %d is below the container's floor %d: %s; it may lack acknowledged blocks; %sor run again with --accept-dropped-replicas=%d to accept losing BCSIDs %d to %d", rep.Bcsid, floor, floorText(c), bringBackText(c), floor, newest+1, floor)
			done = false
		case rep.State == metapb.ContainerState_CONTAINER_CLOSED:
			ri.Status = "recovered"
			done = false // recorded in the next round
		default:
			ri.Status = strings.ToLower(strings.TrimPrefix(rep.State.String(), "CONTAINER_"))
		}
		resp.Replicas = append(resp.Replicas, ri)
	}
	resp.Done = done && counted > 0
	return resp
}
