package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// recoverRow is one replica of `basalt admin container recover` (--json).
type recoverRow struct {
	Datanode          uint64 `json:"datanode"`
	Status            string `json:"status"`
	Reported          string `json:"reported_state,omitempty"`
	BCSID             uint64 `json:"bcsid"`
	RecordedUnhealthy bool   `json:"recorded_unhealthy"`
	Reason            string `json:"reason,omitempty"`
}

func recoverRows(r *metapb.RecoverContainerResponse) []recoverRow {
	var out []recoverRow
	for _, x := range r.GetReplicas() {
		rep := ""
		if x.ReportedState != metapb.ContainerState_CONTAINER_STATE_UNSPECIFIED {
			rep = stateName(x.ReportedState.String())
		}
		out = append(out, recoverRow{x.DatanodeId, x.Status, rep, x.Bcsid, x.RecordedUnhealthy, x.Reason})
	}
	return out
}

func recoverJSON(r *metapb.RecoverContainerResponse) map[string]any {
	out := map[string]any{"container": r.GetContainer().GetId(), "state": stateName(r.GetContainer().GetState().String()),
		"done": r.GetDone(), "running": r.GetRunning(), "newest_bcsid": r.GetNewestBcsid(),
		"accept_missing_replicas": r.GetAcceptMissingReplicas(), "accepted_dropped_floor": r.GetAcceptedDroppedFloor(), "replicas": recoverRows(r)}
	if f := r.GetBcsidFloor(); f != nil {
		fl := map[string]any{"bcsid": f.GetBcsid(), "reason": f.GetReason()}
		if f.GetDatanodeId() != 0 {
			fl["dropped_datanode"] = f.GetDatanodeId()
		}
		if f.GetUnixMs() != 0 {
			fl["set"] = time.UnixMilli(f.GetUnixMs()).UTC().Format(time.RFC3339)
		}
		out["bcsid_floor"] = fl
	}
	return out
}

// floorLine says what set the container's BCSID floor ("" for none).
func floorLine(f *metapb.BcsidFloor) string {
	if f.GetBcsid() == 0 {
		return ""
	}
	at := time.UnixMilli(f.GetUnixMs()).UTC().Format(time.RFC3339)
	if f.GetDatanodeId() != 0 {
		return fmt.Sprintf("BCSID floor %d: set when the replica on datanode %d was dropped at %s (%s)", f.GetBcsid(), f.GetDatanodeId(), at, f.GetReason())
	}
	return fmt.Sprintf("BCSID floor %d, set at %s (%s)", f.GetBcsid(), at, f.GetReason())
}

func printRecover(w io.Writer, r *metapb.RecoverContainerResponse) error {
	fmt.Fprintf(w, "container %d: %s, newest BCSID %d, done: %v\n", r.GetContainer().GetId(), stateName(r.GetContainer().GetState().String()), r.GetNewestBcsid(), r.GetDone())
	if l := floorLine(r.GetBcsidFloor()); l != "" {
		fmt.Fprintln(w, l)
	}
	t := newTable(w, "REPLICA ON", "STATUS", "REPORTED", "BCSID", "REASON")
	for _, x := range recoverRows(r) {
		t.row(x.Datanode, x.Status, dash(x.Reported), x.BCSID, dash(x.Reason))
	}
	return t.flush()
}

// recoverPending reports whether a replica of r may still be recovered
// or counted without the operator doing anything.
func recoverPending(r *metapb.RecoverContainerResponse) bool {
	closed := r.GetContainer().GetState() == metapb.ContainerState_CONTAINER_CLOSED
	for _, x := range r.GetReplicas() {
		switch x.Status {
		case "waiting", "recovered", "not started":
			// ("blocked", "missing": the operator decides: bring the
			// missing replicas back or accept their loss)
			return true
		case "healthy":
			if !closed {
				return true // counted; the container closes next
			}
		}
	}
	return false
}

// recoverWaitDefault bounds `recover --wait` unless --timeout says
// otherwise.
const recoverWaitDefault = 30 * time.Minute

// recoverCall is the SCM RecoverContainer RPC (a fake in tests).
type recoverCall func(ctx context.Context, req *metapb.RecoverContainerRequest) (*metapb.RecoverContainerResponse, error)

// recoverRetryable: an error --wait rides out (no SCM leader for the
// moment, a failover, a connection lost); any other ends the wait.
func recoverRetryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return false
}

// waitRecover polls the recovery r started until it is done, nothing is
// left to wait for, ctx ends or SCM answers an error other than a
// failover's. A new SCM leader (or one that forgot the recovery after an
// hour) is asked to start it again; its refusal because a replica
// already counts is no error (the status says when it is done). Progress
// goes to progress: every change of a replica's status, every error, and
// a line every minute anyway.
// restart is the request that starts the recovery again (its flags).
func waitRecover(ctx context.Context, call recoverCall, r *metapb.RecoverContainerResponse, restart *metapb.RecoverContainerRequest, progress io.Writer, poll time.Duration) (*metapb.RecoverContainerResponse, error) {
	id := restart.GetContainerId()
	what := fmt.Sprintf("recover container %d", id)
	last, lastAt, lastErr := "", time.Time{}, ""
	say := func(s string) {
		fmt.Fprintf(progress, "%s  container %d: %s\n", time.Now().Format("15:04:05"), id, s)
	}
	for {
		var parts []string
		for _, x := range r.GetReplicas() {
			parts = append(parts, fmt.Sprintf("%d:%s", x.DatanodeId, x.Status))
		}
		if s := fmt.Sprintf("%s  %s", stateName(r.GetContainer().GetState().String()), strings.Join(parts, " ")); s != last || time.Since(lastAt) >= time.Minute {
			say(s)
			last, lastAt = s, time.Now()
		}
		if r.GetDone() {
			return r, nil
		}
		if !recoverPending(r) {
			// Nothing left to wait for: every replica failed, is stale,
			// gone, or blocked by a missing one (the reasons say why).
			for _, x := range r.GetReplicas() {
				if f := r.GetBcsidFloor().GetBcsid(); x.Status == "blocked" && r.GetNewestBcsid() < f && r.GetAcceptedDroppedFloor() < f {
					return r, fmt.Errorf("%s: recovered replicas are not counted: their BCSID %d is below the container's floor (%s); %sor, to accept losing BCSIDs %d to %d, run it again with --accept-dropped-replicas=%d",
						what, r.GetNewestBcsid(), floorLine(r.GetBcsidFloor()), bringBack(r.GetBcsidFloor()), r.GetNewestBcsid()+1, f, f)
				}
				if x.Status == "blocked" {
					return r, fmt.Errorf("%s: recovered replicas are not counted while replicas their live datanodes no longer list may have held newer blocks: bring those back, or run it again with --accept-missing-replicas to accept losing what only they held", what)
				}
			}
			return r, fmt.Errorf("%s: no replica left to recover (see the reasons; run it again to retry)", what)
		}
		for {
			select {
			case <-ctx.Done():
				return r, fmt.Errorf("%s: not done: %w", what, ctx.Err())
			case <-time.After(poll):
			}
			nr, err := call(ctx, &metapb.RecoverContainerRequest{ContainerId: id, StatusOnly: true})
			if err == nil && !nr.GetDone() && !nr.GetRunning() && recoverPending(nr) {
				// A new SCM leader knows nothing of it (or it expired):
				// start it there, with the floor the operator accepted
				// (never one it did not see).
				if a, fl := restart.GetAcceptDroppedFloor(), nr.GetBcsidFloor().GetBcsid(); a != 0 && fl > a {
					return nr, fmt.Errorf("%s: not started again: the container's BCSID floor is now %d (%s), above the accepted --accept-dropped-replicas=%d; look at the status again", what, fl, floorLine(nr.GetBcsidFloor()), a)
				}
				sr, serr := call(ctx, restart)
				if serr == nil {
					serr = droppedEchoed(what, restart, sr)
					if serr != nil {
						return nr, serr
					}
				}
				switch {
				case serr == nil:
					say("started again on the current SCM leader")
					nr = sr
				case status.Code(serr) == codes.FailedPrecondition:
					// A replica already counts (recorded before the
					// failover): nothing to start; the status tells when
					// the container is back.
					err = nil
					if m := serr.Error(); m != lastErr {
						say("not started again: " + status.Convert(serr).Message())
						lastErr = m
					}
				default:
					err = serr
				}
			}
			if err != nil {
				if ctx.Err() != nil {
					return r, fmt.Errorf("%s: not done: %w", what, ctx.Err())
				}
				if !recoverRetryable(err) {
					return r, client.FromRPC(what, err)
				}
				if m := err.Error(); m != lastErr {
					say("retrying: " + m)
					lastErr = m
				}
				continue
			}
			r = nr
			break
		}
	}
}

// bringBack is the first thing to try for a container below its floor:
// bring back the datanode whose dropped replica set it (its copy at the
// floor is adopted). "" when the close set the floor.
func bringBack(f *metapb.BcsidFloor) string {
	if f.GetDatanodeId() == 0 {
		return ""
	}
	return fmt.Sprintf("bring datanode %d back (a copy it reports at or above the floor is adopted), ", f.GetDatanodeId())
}

// droppedEchoed: an SCM leader that ignores accept_dropped_floor (an older
// version: unknown fields are dropped) does not echo it; the acceptance
// was then silently ignored, which is an error.
func droppedEchoed(what string, req *metapb.RecoverContainerRequest, r *metapb.RecoverContainerResponse) error {
	if a := req.GetAcceptDroppedFloor(); a != 0 && r.GetAcceptedDroppedFloor() != a {
		return fmt.Errorf("%s: the SCM leader did not confirm --accept-dropped-replicas=%d (it answered %d: an older version ignores it); nothing below the floor is accepted", what, a, r.GetAcceptedDroppedFloor())
	}
	return nil
}

// droppedWarning is the CLI's warning once the server confirmed an
// accepted floor: worded from what set the floor, and only when a floor is
// actually being accepted (the newest reported BCSID is below it).
func droppedWarning(what string, r *metapb.RecoverContainerResponse) string {
	f := r.GetBcsidFloor()
	if r.GetAcceptedDroppedFloor() == 0 {
		return ""
	}
	if r.GetNewestBcsid() >= f.GetBcsid() {
		return fmt.Sprintf("%s --accept-dropped-replicas=%d: nothing accepted now: the newest reported BCSID %d is not below the container's floor %d\n", what, r.GetAcceptedDroppedFloor(), r.GetNewestBcsid(), f.GetBcsid())
	}
	return fmt.Sprintf("WARNING: %s --accept-dropped-replicas=%d: %s; counting recovered replicas at BCSID %d LOSES BCSIDs %d to %d\n",
		what, r.GetAcceptedDroppedFloor(), floorLine(f), r.GetNewestBcsid(), r.GetNewestBcsid()+1, f.GetBcsid())
}

// containerRecoverCmd is `basalt admin container recover ID`.
func containerRecoverCmd(f *connFlags) *cobra.Command {
	var wait, acceptMissing bool
	var acceptDropped uint64
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "recover ID",
		Short: "Bring back a container made MISSING by a deterministic apply bug (admins only)",
		Long: `After a bug made a committed entry fail in apply (or in WriteData, SyncData)
on every replica, its container is UNHEALTHY everywhere and MISSING, though
the blocks it committed before that entry are intact on every disk. Deploy
the fixed binary first, on every meta node too (SCM records a recovered
replica with a Raft op older binaries do not know: a meta node still on one
halts its SCM replica), then run this: SCM sends each datanode holding an
UNHEALTHY replica a recover command. A datanode brings its replica back
CLOSED (read only) only if the replica is UNHEALTHY because of such a
runtime error, or because its pipeline stopped when the datanode's raft log
directory failed (a single-replica pipeline, or every replica's log disk:
no healthy replica to close on; its own record, or SCM's if it restarted
since), no pipeline
on it still holds the container, its volume has not failed, and every
committed block verifies against its checksums; otherwise it stays
UNHEALTHY and the reason says why (a damaged block is named). SCM counts a
recovered replica again only if its BCSID is the newest any replica
reports, and only once every replica's datanode has reported: a dead one,
or a live one that no longer lists the container (it may have held a newer
replica), blocks counting. --accept-missing-replicas accepts losing what
such missing replicas held (logged, and recorded in SCM's log); never a
dead or unheard one. Nor is a replica counted below the container's BCSID
floor: the BCSID SCM recorded for it when it closed (the lowest of its
healthy closed replicas) or when a replica was dropped from its replica
list; the status shows the floor, the dropped replica's datanode and when.
First bring that datanode back if you can (a copy at the floor is
adopted). --accept-dropped-replicas=FLOOR, with the floor the status
shows, accepts losing the BCSIDs above the recovered replicas up to it
(logged at ERROR and recorded in SCM's log; the floor is lowered to the
recovered BCSID); refused if the floor is higher by then, and an error if
the SCM leader does not confirm it (an older version ignores it). Then the container closes and is copied
back to its replication factor. Refused for a container that still has a replica that
counts (re-replication repairs it).

Statuses: waiting (command sent or retry running), recovered (being
recorded), healthy (counted), failed (see reason; run again to retry),
stale (a lower BCSID than the newest: replaced by a copy), dead (datanode
not heard: the recovery waits for it), missing (its live datanode no longer
lists it), blocked (recovered, not counted because of a missing replica
or the BCSID floor),
not started. --wait polls until done, printing every change (and a line a
minute), restarts the recovery on a new SCM leader, rides out failovers,
and gives up after --timeout (default 30m) or on any other error.`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "container ID"); err != nil {
				return err
			}
			id, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || id == 0 {
				return usagef("container ID %q: want a positive integer", args[0])
			}
			if timeout < 0 {
				return usagef("--timeout %v: want a duration (0: no limit)", timeout)
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			what := fmt.Sprintf("recover container %d", id)
			if acceptMissing {
				fmt.Fprintf(cmd.ErrOrStderr(), "WARNING: %s --accept-missing-replicas: replicas whose live datanodes no longer list the container may have held newer blocks; counting the recovered ones LOSES whatever only they held\n", what)
			}
			req := &metapb.RecoverContainerRequest{ContainerId: id, AcceptMissingReplicas: acceptMissing, AcceptDroppedFloor: acceptDropped}
			call := func(ctx context.Context, req *metapb.RecoverContainerRequest) (*metapb.RecoverContainerResponse, error) {
				return c.Scm().RecoverContainer(ctx, req)
			}
			r, err := call(cmd.Context(), req)
			if err != nil {
				return client.FromRPC(what, err)
			}
			if err := droppedEchoed(what, req, r); err != nil {
				return err
			}
			fmt.Fprint(cmd.ErrOrStderr(), droppedWarning(what, r))
			w := cmd.OutOrStdout()
			if wait {
				ctx, cancel := context.WithCancel(cmd.Context())
				if timeout > 0 {
					ctx, cancel = context.WithTimeout(cmd.Context(), timeout)
				}
				defer cancel()
				progress := w
				if f.json {
					progress = cmd.ErrOrStderr()
				}
				r, err = waitRecover(ctx, call, r, req, progress, time.Second)
				if errors.Is(err, context.DeadlineExceeded) && timeout > 0 {
					err = fmt.Errorf("%w (--timeout %v)", err, timeout)
				}
			}
			var perr error
			if f.json {
				perr = printJSON(w, recoverJSON(r))
			} else {
				perr = printRecover(w, r)
			}
			if err != nil {
				return err
			}
			return perr
		}),
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "wait until done, showing progress")
	cmd.Flags().DurationVar(&timeout, "timeout", recoverWaitDefault, "with --wait: give up after this long (0: no limit)")
	cmd.Flags().BoolVar(&acceptMissing, "accept-missing-replicas", false, "count recovered replicas even though live datanodes no longer list other replicas, which may have held newer blocks (ACCEPTS LOSING them)")
	cmd.Flags().Uint64Var(&acceptDropped, "accept-dropped-replicas", 0, "=FLOOR: count recovered replicas below the container's BCSID floor FLOOR, as the status shows it (ACCEPTS LOSING the BCSIDs above them up to it); refused if the floor is now higher")
	return cmd
}
