package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// opStateName is a datanode's operational state for tables and JSON.
func opStateName(s metapb.NodeOpState) string {
	if s == metapb.NodeOpState_NODE_OP_STATE_UNSPECIFIED {
		s = metapb.NodeOpState_IN_SERVICE
	}
	return s.String()
}

// drainText is a datanode's drain progress, "-" when in service.
func drainText(d *metapb.DatanodeStatus) string {
	switch d.OpState {
	case metapb.NodeOpState_DECOMMISSIONING, metapb.NodeOpState_ENTERING_MAINTENANCE:
		return fmt.Sprintf("%d containers, %d short (%s)", d.DrainContainers, d.DrainLeft, fmtBytes(d.DrainBytesLeft))
	}
	return "-"
}

// datanodeOpCmds are `basalt admin datanode decommission|maintenance|
// recommission`.
func datanodeOpCmds(f *connFlags) []*cobra.Command {
	var wait bool
	var timeout time.Duration
	var end string
	mk := func(use, short, long string, state metapb.NodeOpState, done func(metapb.NodeOpState) bool) *cobra.Command {
		cmd := &cobra.Command{
			Use: use + " ID", Short: short, Long: long,
			RunE: runE(func(cmd *cobra.Command, args []string) error {
				if err := exactArgs(args, 1, "datanode ID"); err != nil {
					return err
				}
				id, err := strconv.ParseUint(args[0], 10, 64)
				if err != nil || id == 0 {
					return usagef("datanode ID %q: want a positive number (see `basalt admin datanode list`)", args[0])
				}
				req := &metapb.SetDatanodeOpStateRequest{DatanodeId: id, State: state}
				if end != "" && state == metapb.NodeOpState_ENTERING_MAINTENANCE {
					t, err := parseEnd(end, time.Now())
					if err != nil {
						return usagef("--end %q: %v", end, err)
					}
					req.MaintenanceEndUnixMs = t.UnixMilli()
				}
				c, err := f.client(nil)
				if err != nil {
					return err
				}
				defer c.Close()
				resp, err := c.Scm().SetDatanodeOpState(cmd.Context(), req)
				if err != nil {
					return client.FromRPC(use+" datanode", err)
				}
				w := cmd.OutOrStdout()
				d := resp.GetDatanode()
				if !wait {
					if f.json {
						return printJSON(w, opRow(d))
					}
					printOp(w, d)
					return nil
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
						if s := fmt.Sprintf("%s  %s", opStateName(d.OpState), drainText(d)); s != last {
							fmt.Fprintf(w, "%s  datanode %d: %s\n", time.Now().Format("15:04:05"), id, s)
							last = s
						}
					}
					if done(d.OpState) {
						if f.json {
							return printJSON(w, opRow(d))
						}
						return nil
					}
					select {
					case <-ctx.Done():
						return fmt.Errorf("datanode %d still %s: %w", id, opStateName(d.OpState), ctx.Err())
					case <-time.After(time.Second):
					}
					r, err := c.Scm().ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
					if err != nil {
						continue // a failover: ask again
					}
					for _, x := range r.Datanodes {
						if x.GetDetails().GetId() == id {
							d = x
						}
					}
				}
			}),
		}
		cmd.Flags().BoolVar(&wait, "wait", false, "wait until done, showing progress")
		cmd.Flags().DurationVar(&timeout, "timeout", 0, "with --wait: give up after this long (0: never)")
		return cmd
	}
	decom := mk("decommission", "Drain a datanode for good: its containers get their full replica count elsewhere",
		`Decommission a datanode: it gets no new pipelines or blocks, its pipelines
close (their open containers close first), and every container it holds is
copied until it has its full replica count on other datanodes (its replicas
serve as copy sources meanwhile). Then it is DECOMMISSIONED and can be
switched off. --wait shows the containers still short of replicas.`,
		metapb.NodeOpState_DECOMMISSIONING, func(s metapb.NodeOpState) bool { return s == metapb.NodeOpState_DECOMMISSIONED })
	maint := mk("maintenance", "Put a datanode into maintenance: keep 2 replicas of each container elsewhere",
		`Put a datanode into maintenance: like decommission, but only until each of its
containers has min(2, factor) replicas on other datanodes; then it is
IN_MAINTENANCE and may be stopped without repairs. It returns to service at
--end (RFC 3339 time, or a duration from now such as 2h) or on recommission.`,
		metapb.NodeOpState_ENTERING_MAINTENANCE, func(s metapb.NodeOpState) bool { return s == metapb.NodeOpState_IN_MAINTENANCE })
	maint.Flags().StringVar(&end, "end", "", "end of the maintenance: RFC 3339 time or a duration from now (default: until recommission)")
	recom := mk("recommission", "Return a datanode to service (ends decommission or maintenance)", "",
		metapb.NodeOpState_IN_SERVICE, func(s metapb.NodeOpState) bool { return s == metapb.NodeOpState_IN_SERVICE })
	return []*cobra.Command{decom, maint, recom}
}

// parseEnd reads --end: an RFC 3339 time or a duration from now.
func parseEnd(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil {
		if d <= 0 {
			return time.Time{}, fmt.Errorf("duration must be positive")
		}
		return now.Add(d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("want an RFC 3339 time (2026-01-02T15:04:05Z) or a duration (90m)")
	}
	return t, nil
}

type opJSON struct {
	ID              uint64 `json:"id"`
	OpState         string `json:"op_state"`
	State           string `json:"state"`
	Since           string `json:"since,omitempty"`
	MaintenanceEnd  string `json:"maintenance_end,omitempty"`
	DrainContainers uint32 `json:"drain_containers"`
	DrainLeft       uint32 `json:"drain_left"`
	DrainBytesLeft  uint64 `json:"drain_bytes_left"`
}

func opRow(d *metapb.DatanodeStatus) opJSON {
	r := opJSON{ID: d.GetDetails().GetId(), OpState: opStateName(d.OpState), State: stateName(d.State.String()),
		DrainContainers: d.DrainContainers, DrainLeft: d.DrainLeft, DrainBytesLeft: d.DrainBytesLeft}
	if d.OpSinceUnixMs > 0 {
		r.Since = time.UnixMilli(d.OpSinceUnixMs).UTC().Format(time.RFC3339)
	}
	if d.MaintenanceEndUnixMs > 0 {
		r.MaintenanceEnd = time.UnixMilli(d.MaintenanceEndUnixMs).UTC().Format(time.RFC3339)
	}
	return r
}

func printOp(w io.Writer, d *metapb.DatanodeStatus) {
	fmt.Fprintf(w, "datanode %d: %s", d.GetDetails().GetId(), opStateName(d.OpState))
	if d.MaintenanceEndUnixMs > 0 {
		fmt.Fprintf(w, " until %s", fmtTime(time.UnixMilli(d.MaintenanceEndUnixMs)))
	}
	if s := drainText(d); s != "-" {
		fmt.Fprintf(w, " (%s)", s)
	}
	fmt.Fprintln(w)
}

// containerReplicasCmd is `basalt admin container replicas [ID]`.
func containerReplicasCmd(f *connFlags) *cobra.Command {
	var limit int
	cmd := &cobra.Command{
		Use:   "replicas [ID]",
		Short: "Replicas of a container with their health and the reports against them",
		Long: `Shows each replica of a container: how the replication manager counts it
(healthy, unhealthy, dead, missing, lagging, decommissioning, maintenance,
stale), what its datanode last reported (state, committed index BCSID,
size, and for an UNHEALTHY replica the datanode's reason), and the reports against it (corrupt reads, scrubber findings, why it
was recorded unhealthy). Reports are stored through Raft. Without an ID:
the containers that have a report or a replica that does not count.`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if len(args) > 1 {
				return usagef("want at most 1 argument (container ID), got %d", len(args))
			}
			var id uint64
			if len(args) == 1 {
				var err error
				if id, err = strconv.ParseUint(args[0], 10, 64); err != nil || id == 0 {
					return usagef("container ID %q: want a positive number", args[0])
				}
			}
			if limit < 1 || limit > 1000 {
				return usagef("--limit %d: want 1..1000", limit)
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Scm().GetContainerReplicas(cmd.Context(), &metapb.GetContainerReplicasRequest{ContainerId: id, Limit: uint32(limit)})
			if err != nil {
				return client.FromRPC("container replicas", err)
			}
			w := cmd.OutOrStdout()
			if f.json {
				type replica struct {
					Datanode   uint64 `json:"datanode"`
					Health     string `json:"health"`
					NodeState  string `json:"node_state"`
					OpState    string `json:"op_state"`
					Reported   string `json:"reported_state,omitempty"`
					BCSID      uint64 `json:"bcsid"`
					UsedBytes  uint64 `json:"used_bytes"`
					BlockCount uint64 `json:"block_count"`
					Reason     string `json:"unhealthy_reason,omitempty"`
				}
				type report struct {
					Datanode uint64    `json:"datanode"`
					Block    uint64    `json:"block,omitempty"`
					Reason   string    `json:"reason"`
					Reporter string    `json:"reporter"`
					Reports  uint32    `json:"reports"`
					Last     time.Time `json:"last"`
				}
				type container struct {
					ID       uint64    `json:"id"`
					State    string    `json:"state"`
					Health   string    `json:"health,omitempty"`
					Replicas []replica `json:"replicas"`
					Reports  []report  `json:"reports"`
				}
				out := struct {
					Containers []container `json:"containers"`
					Truncated  bool        `json:"truncated"`
				}{Containers: []container{}, Truncated: r.Truncated}
				for _, cr := range r.Containers {
					ct := container{ID: cr.Container.GetId(), State: stateName(cr.Container.GetState().String()), Health: cr.Health, Replicas: []replica{}, Reports: []report{}}
					for _, x := range cr.Replicas {
						rp := replica{x.DatanodeId, x.Health, stateName(x.NodeState.String()), opStateName(x.OpState), "", x.Bcsid, x.UsedBytes, x.BlockCount, x.UnhealthyReason}
						if x.ReportedState != metapb.ContainerState_CONTAINER_STATE_UNSPECIFIED {
							rp.Reported = stateName(x.ReportedState.String())
						}
						ct.Replicas = append(ct.Replicas, rp)
					}
					for _, x := range cr.Reports {
						ct.Reports = append(ct.Reports, report{x.DatanodeId, x.GetBlock().GetLocalId(), x.Reason, x.Reporter, x.Reports, time.UnixMilli(x.ReportedUnixMs)})
					}
					out.Containers = append(out.Containers, ct)
				}
				return printJSON(w, out)
			}
			if len(r.Containers) == 0 {
				fmt.Fprintln(w, "no container has a report or a replica that does not count")
				return nil
			}
			for i, cr := range r.Containers {
				if i > 0 {
					fmt.Fprintln(w)
				}
				fmt.Fprintf(w, "container %d  %s  %s\n", cr.Container.GetId(), stateName(cr.Container.GetState().String()), dash(cr.Health))
				t := newTable(w, "DATANODE", "HEALTH", "NODE", "OP STATE", "REPORTED", "BCSID", "USED", "BLOCKS", "UNHEALTHY REASON")
				for _, x := range cr.Replicas {
					rep := "-"
					if x.ReportedState != metapb.ContainerState_CONTAINER_STATE_UNSPECIFIED {
						rep = stateName(x.ReportedState.String())
					}
					t.row(x.DatanodeId, x.Health, stateName(x.NodeState.String()), opStateName(x.OpState), rep, x.Bcsid, fmtBytes(x.UsedBytes), x.BlockCount, dash(x.UnhealthyReason))
				}
				if err := t.flush(); err != nil {
					return err
				}
				if len(cr.Reports) > 0 {
					t := newTable(w, "  REPORT ON", "BLOCK", "REPORTER", "TIMES", "LAST", "REASON")
					for _, x := range cr.Reports {
						blk := "-"
						if x.GetBlock().GetLocalId() != 0 {
							blk = strconv.FormatUint(x.GetBlock().GetLocalId(), 10)
						}
						t.row(fmt.Sprintf("  datanode %d", x.DatanodeId), blk, x.Reporter, x.Reports, fmtTime(time.UnixMilli(x.ReportedUnixMs)), x.Reason)
					}
					if err := t.flush(); err != nil {
						return err
					}
				}
			}
			if r.Truncated {
				fmt.Fprintf(w, "\n(more containers: raise --limit)\n")
			}
			return nil
		}),
	}
	cmd.Flags().IntVar(&limit, "limit", 100, "without an ID: list at most this many containers")
	return cmd
}
