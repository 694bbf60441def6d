package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

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
	return map[string]any{"container": r.GetContainer().GetId(), "state": stateName(r.GetContainer().GetState().String()),
		"done": r.GetDone(), "running": r.GetRunning(), "newest_bcsid": r.GetNewestBcsid(), "replicas": recoverRows(r)}
}

func printRecover(w io.Writer, r *metapb.RecoverContainerResponse) error {
	fmt.Fprintf(w, "container %d: %s, newest BCSID %d, done: %v\n", r.GetContainer().GetId(), stateName(r.GetContainer().GetState().String()), r.GetNewestBcsid(), r.GetDone())
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
			return true
		case "healthy":
			if !closed {
				return true // counted; the container closes next
			}
		}
	}
	return false
}

// containerRecoverCmd is `basalt admin container recover ID`.
func containerRecoverCmd(f *connFlags) *cobra.Command {
	var wait bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "recover ID",
		Short: "Bring back a container made MISSING by a deterministic apply bug (admins only)",
		Long: `After a bug made a committed entry fail in apply (or in WriteData, SyncData)
on every replica, its container is UNHEALTHY everywhere and MISSING, though
the blocks it committed before that entry are intact on every disk. Deploy
the fixed binary first, then run this: SCM sends each datanode holding an
UNHEALTHY replica a recover command. A datanode brings its replica back
CLOSED (read only) only if the replica is UNHEALTHY because of such a
runtime error (its own record, or SCM's if it restarted since), no pipeline
on it still holds the container, its volume has not failed, and every
committed block verifies against its checksums; otherwise it stays
UNHEALTHY and the reason says why (a damaged block is named). SCM counts a
recovered replica again only if its BCSID is the newest any replica
reports; then the container closes and is copied back to its replication
factor. Refused for a container that still has a replica that counts
(re-replication repairs it).

Statuses: waiting (command sent), recovered (being recorded), healthy
(counted), failed (see reason; run again to retry), stale (a lower BCSID
than the newest: replaced by a copy), dead (datanode not heard: the
recovery waits for it), not started. --wait polls until done.`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "container ID"); err != nil {
				return err
			}
			id, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || id == 0 {
				return usagef("container ID %q: want a positive integer", args[0])
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			what := fmt.Sprintf("recover container %d", id)
			r, err := c.Scm().RecoverContainer(cmd.Context(), &metapb.RecoverContainerRequest{ContainerId: id})
			if err != nil {
				return client.FromRPC(what, err)
			}
			w := cmd.OutOrStdout()
			if !wait {
				if f.json {
					return printJSON(w, recoverJSON(r))
				}
				return printRecover(w, r)
			}
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			last := ""
			for {
				if !f.json {
					var parts []string
					for _, x := range r.GetReplicas() {
						parts = append(parts, fmt.Sprintf("%d:%s", x.DatanodeId, x.Status))
					}
					if s := fmt.Sprintf("%s  %s", stateName(r.GetContainer().GetState().String()), strings.Join(parts, " ")); s != last {
						fmt.Fprintf(w, "%s  container %d: %s\n", time.Now().Format("15:04:05"), id, s)
						last = s
					}
				}
				if r.GetDone() {
					if f.json {
						return printJSON(w, recoverJSON(r))
					}
					return printRecover(w, r)
				}
				if !recoverPending(r) {
					// Nothing left to wait for: every replica failed, is
					// stale or gone (the reasons say why).
					if f.json {
						printJSON(w, recoverJSON(r))
					} else {
						printRecover(w, r)
					}
					return fmt.Errorf("%s: no replica left to recover (see the reasons; run it again to retry)", what)
				}
				select {
				case <-ctx.Done():
					if !f.json {
						printRecover(w, r)
					}
					return fmt.Errorf("%s: not done: %w", what, ctx.Err())
				case <-time.After(time.Second):
				}
				nr, err := c.Scm().RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: id, StatusOnly: true})
				if err != nil {
					continue // a failover: ask again
				}
				if !nr.GetRunning() {
					// A new SCM leader knows nothing of it: start it there.
					if nr, err = c.Scm().RecoverContainer(ctx, &metapb.RecoverContainerRequest{ContainerId: id}); err != nil {
						continue
					}
				}
				r = nr
			}
		}),
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "wait until done, showing progress")
	cmd.Flags().DurationVar(&timeout, "timeout", 0, "with --wait: give up after this long (0: never)")
	return cmd
}
