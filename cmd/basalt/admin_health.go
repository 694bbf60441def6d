package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// healthClasses is the order counts are shown in.
var healthClasses = []string{"healthy", "under_replicated", "over_replicated", "mis_replicated", "missing", "unhealthy_replicas", "closing", "open"}

// containerHealthCmd is `basalt admin container health`: the replication
// manager's last round on the SCM leader.
func containerHealthCmd(f *connFlags) *cobra.Command {
	var worst int
	cmd := &cobra.Command{
		Use:   "health",
		Short: "Container replica health: counts by class, the worst containers, copies in flight",
		Long: `Shows the replication manager's last round (SCM leader): closed containers by
class (healthy, under_replicated, over_replicated, missing: no healthy replica
left), how many have a replica recorded unhealthy, the worst containers, and
the copies in flight. Alert on under_replicated > 0 for long and on missing > 0
(Prometheus: basalt_scm_containers{health=...}).`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			if worst < 0 || worst > 1000 {
				return usagef("--worst %d: want 0..1000", worst)
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			h, err := c.Scm().GetContainerHealth(cmd.Context(), &metapb.GetContainerHealthRequest{Worst: uint32(max(worst, 1))})
			if err != nil {
				return client.FromRPC("container health", err)
			}
			if worst == 0 {
				h.Worst = nil
			}
			if f.json {
				type worstRow struct {
					ID        uint64   `json:"id"`
					State     string   `json:"state"`
					Health    string   `json:"health"`
					Healthy   uint32   `json:"healthy_replicas"`
					Want      uint32   `json:"want_replicas"`
					Replicas  []uint64 `json:"replicas"`
					Unhealthy []uint64 `json:"unhealthy"`
					UsedBytes uint64   `json:"used_bytes"`
					Copy      uint64   `json:"copy_target,omitempty"`
				}
				type copyRow struct {
					Container uint64    `json:"container"`
					Target    uint64    `json:"target"`
					Sources   []uint64  `json:"sources"`
					Started   time.Time `json:"started"`
				}
				out := struct {
					Counts       map[string]uint64 `json:"counts"`
					Worst        []worstRow        `json:"worst"`
					Copies       []copyRow         `json:"copies_in_flight"`
					CopiesDone   uint64            `json:"copies_done"`
					CopiesFailed uint64            `json:"copies_failed"`
					BytesLeft    uint64            `json:"bytes_left"`
					BytesFlight  uint64            `json:"bytes_in_flight"`
					Rate         float64           `json:"rate_bytes_per_sec"`
					ETASeconds   float64           `json:"eta_seconds,omitempty"`
					Round        *time.Time        `json:"round,omitempty"`
				}{Counts: h.Counts, Worst: []worstRow{}, Copies: []copyRow{}, CopiesDone: h.CopiesDone, CopiesFailed: h.CopiesFailed,
					BytesLeft: h.BytesLeft, BytesFlight: h.BytesInFlight, Rate: h.RateBytesPerSec, ETASeconds: float64(h.EtaMs) / 1000}
				if h.RoundUnixMs != 0 {
					t := time.UnixMilli(h.RoundUnixMs)
					out.Round = &t
				}
				for _, w := range h.Worst {
					out.Worst = append(out.Worst, worstRow{w.ContainerId, stateName(w.State.String()), w.Health, w.HealthyReplicas, w.WantReplicas, w.Replicas, w.Unhealthy, w.UsedBytes, w.CopyTarget})
				}
				for _, cp := range h.Copies {
					out.Copies = append(out.Copies, copyRow{cp.ContainerId, cp.Target, cp.Sources, time.UnixMilli(cp.StartedUnixMs)})
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			w := cmd.OutOrStdout()
			if h.RoundUnixMs == 0 {
				fmt.Fprintln(w, "no replication round yet under this SCM leader (safe mode, or just elected)")
			} else {
				fmt.Fprintf(w, "last round: %s\n", fmtTime(time.UnixMilli(h.RoundUnixMs)))
			}
			t := newTable(w, "CLASS", "CONTAINERS")
			for _, k := range healthClasses {
				t.row(k, h.Counts[k])
			}
			if err := t.flush(); err != nil {
				return err
			}
			fmt.Fprintf(w, "\ncopies in flight: %d (%s)   done: %d   failed: %d\n", len(h.Copies), fmtBytes(h.BytesInFlight), h.CopiesDone, h.CopiesFailed)
			eta := "-"
			if h.EtaMs > 0 {
				eta = (time.Duration(h.EtaMs) * time.Millisecond).Round(time.Second).String()
			}
			fmt.Fprintf(w, "bytes left: %s   rate: %s/s   ETA: %s\n", fmtBytes(h.BytesLeft), fmtBytes(uint64(h.RateBytesPerSec)), eta)
			if len(h.Copies) > 0 {
				fmt.Fprintln(w)
				t := newTable(w, "CONTAINER", "TARGET", "SOURCES", "RUNNING")
				for _, cp := range h.Copies {
					t.row(cp.ContainerId, cp.Target, joinIDs(cp.Sources), time.Since(time.UnixMilli(cp.StartedUnixMs)).Round(time.Second))
				}
				if err := t.flush(); err != nil {
					return err
				}
			}
			if len(h.Worst) > 0 {
				fmt.Fprintln(w)
				t := newTable(w, "CONTAINER", "STATE", "HEALTH", "HEALTHY", "REPLICAS", "NOT COUNTED", "USED", "COPY TO")
				for _, c := range h.Worst {
					cp := "-"
					if c.CopyTarget != 0 {
						cp = fmt.Sprint(c.CopyTarget)
					}
					t.row(c.ContainerId, stateName(c.State.String()), c.Health, fmt.Sprintf("%d/%d", c.HealthyReplicas, c.WantReplicas),
						joinIDs(c.Replicas), dash(joinIDs(c.Unhealthy)), fmtBytes(c.UsedBytes), cp)
				}
				return t.flush()
			}
			return nil
		}),
	}
	cmd.Flags().IntVar(&worst, "worst", 20, "list this many of the worst containers (0: none)")
	return cmd
}
