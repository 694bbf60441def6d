package main

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// adminCmd is for operators: the SCM's view of datanodes, pipelines and
// containers.
func adminCmd() *cobra.Command {
	f := &connFlags{}
	root := &cobra.Command{
		Use:   "admin",
		Short: "Operator commands: datanodes, pipelines, containers",
		Long: `Operator commands over the storage container manager's admin API.

Examples:
  basalt admin datanode list
  basalt admin pipeline list --json
  basalt admin container list --pipeline 3 --state open
  basalt admin container info 17
` + exitCodesHelp,
	}
	f.register(root)

	dn := &cobra.Command{Use: "datanode", Short: "Datanodes"}
	dn.AddCommand(&cobra.Command{
		Use: "list", Aliases: []string{"ls"}, Short: "List datanodes: state, location, capacity, pipelines",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Scm().ListDatanodes(cmd.Context(), &metapb.ListDatanodesRequest{})
			if err != nil {
				return client.FromRPC("list datanodes", err)
			}
			ds := r.Datanodes
			sort.Slice(ds, func(i, j int) bool { return ds[i].GetDetails().GetId() < ds[j].GetDetails().GetId() })
			if f.json {
				type row struct {
					ID            uint64 `json:"id"`
					UUID          string `json:"uuid"`
					Hostname      string `json:"hostname"`
					DataAddr      string `json:"data_addr"`
					RaftAddr      string `json:"raft_addr"`
					Location      string `json:"location"`
					State         string `json:"state"`
					OpState       opJSON `json:"operational"`
					LastHeartbeat string `json:"last_heartbeat,omitempty"`
					Capacity      uint64 `json:"capacity_bytes"`
					Used          uint64 `json:"used_bytes"`
					Volumes       int    `json:"volumes"`
					FailedVolumes int    `json:"failed_volumes"`
					// Raft log directories (0: not reported, an older
					// datanode) and failed ones; all failed: no new
					// pipeline is placed on it.
					LogDirs       uint32             `json:"log_dirs"`
					LogDirsFailed uint32             `json:"log_dirs_failed"`
					Pipelines     uint32             `json:"pipelines"`
					StreamVersion uint32             `json:"stream_version"`
					Cache         *metapb.CacheStats `json:"cache,omitempty"`
					SlowDisks     []slowDiskJSON     `json:"slow_disks,omitempty"`
				}
				out := []row{}
				for _, d := range ds {
					capa, used, failed := volumeTotals(d.Volumes)
					x := d.GetDetails()
					rw := row{ID: x.Id, UUID: x.Uuid, Hostname: x.Hostname, DataAddr: x.DataAddr, RaftAddr: x.RaftAddr, Location: x.Location,
						State: stateName(d.State.String()), OpState: opRow(d), Capacity: capa, Used: used, Volumes: len(d.Volumes), FailedVolumes: failed, LogDirs: d.LogDirs, LogDirsFailed: d.LogDirsFailed, Pipelines: d.Pipelines, Cache: d.Cache,
						SlowDisks: slowDisksJSON(d.SlowDisks), StreamVersion: streamVersion(x)}
					if d.LastHeartbeatUnixMs > 0 {
						rw.LastHeartbeat = time.UnixMilli(d.LastHeartbeatUnixMs).UTC().Format(time.RFC3339Nano)
					}
					out = append(out, rw)
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			t := newTable(cmd.OutOrStdout(), "ID", "STATE", "OP STATE", "HOST", "DATA ADDR", "LOCATION", "CAPACITY", "USED", "USED%", "VOLUMES", "LOGDIRS", "PIPELINES", "STREAM", "LAST HEARTBEAT", "DRAIN", "CACHE")
			for _, d := range ds {
				capa, used, failed := volumeTotals(d.Volumes)
				pct := "-"
				if capa > 0 {
					pct = fmt.Sprintf("%.1f%%", 100*float64(used)/float64(capa))
				}
				vols := strconv.Itoa(len(d.Volumes))
				if failed > 0 {
					vols += fmt.Sprintf(" (%d failed)", failed)
				}
				hb := "-"
				if d.LastHeartbeatUnixMs > 0 {
					hb = time.Since(time.UnixMilli(d.LastHeartbeatUnixMs)).Round(time.Millisecond).String() + " ago"
				}
				x := d.GetDetails()
				t.row(x.Id, stateName(d.State.String()), opStateName(d.OpState), x.Hostname, x.DataAddr, x.Location, fmtBytes(capa), fmtBytes(used), pct, vols, logDirsText(d), d.Pipelines, streamVersion(x), hb, drainText(d), cacheText(d.Cache))
			}
			if err := t.flush(); err != nil {
				return err
			}
			return printSlowDisks(cmd.OutOrStdout(), ds)
		}),
	})

	pl := &cobra.Command{Use: "pipeline", Short: "Pipelines (Raft groups of datanodes)"}
	pl.AddCommand(&cobra.Command{
		Use: "list", Aliases: []string{"ls"}, Short: "List pipelines: replication, members, state",
		Long: `List pipelines. The leader column shows what the datanodes last reported
to SCM, when the SCM API carries it ("-" otherwise).`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Scm().ListPipelines(cmd.Context(), &metapb.ListPipelinesRequest{})
			if err != nil {
				return client.FromRPC("list pipelines", err)
			}
			ps := r.Pipelines
			sort.Slice(ps, func(i, j int) bool { return ps[i].Id < ps[j].Id })
			if f.json {
				type row struct {
					ID          uint64   `json:"id"`
					Replication string   `json:"replication"`
					State       string   `json:"state"`
					Datanodes   []uint64 `json:"datanodes"`
					Created     string   `json:"created,omitempty"`
					Closed      string   `json:"closed,omitempty"`
					CloseReason string   `json:"close_reason,omitempty"`
				}
				out := []row{}
				for _, p := range ps {
					rw := row{ID: p.Id, Replication: p.Replication.String(), State: stateName(p.State.String()), Datanodes: p.Datanodes, CloseReason: p.CloseReason}
					if p.CreatedUnixMs > 0 {
						rw.Created = time.UnixMilli(p.CreatedUnixMs).UTC().Format(time.RFC3339)
					}
					if p.ClosedUnixMs > 0 {
						rw.Closed = time.UnixMilli(p.ClosedUnixMs).UTC().Format(time.RFC3339)
					}
					out = append(out, rw)
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			t := newTable(cmd.OutOrStdout(), "ID", "REPLICATION", "STATE", "MEMBERS", "LEADER", "CREATED", "CLOSE REASON")
			for _, p := range ps {
				created := "-"
				if p.CreatedUnixMs > 0 {
					created = fmtTime(time.UnixMilli(p.CreatedUnixMs))
				}
				t.row(p.Id, p.Replication, stateName(p.State.String()), joinIDs(p.Datanodes), "-", created, dash(p.CloseReason))
			}
			return t.flush()
		}),
	})

	ct := &cobra.Command{Use: "container", Short: "Containers"}
	var pipeline uint64
	var state string
	var limit int
	ctList := &cobra.Command{
		Use: "list", Aliases: []string{"ls"}, Short: "List containers",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			want := strings.ToUpper(state)
			switch want {
			case "", "OPEN", "CLOSING", "CLOSED":
			default:
				return usagef("--state %q: want open, closing or closed", state)
			}
			if limit <= 0 {
				return usagef("--limit must be positive, got %d", limit)
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			var out []*metapb.Container
			var after uint64
			truncated := false
		pages:
			for {
				r, err := c.Scm().ListContainers(cmd.Context(), &metapb.ListContainersRequest{StartAfter: after, PageSize: 1000})
				if err != nil {
					return client.FromRPC("list containers", err)
				}
				for _, ct := range r.Containers {
					after = ct.Id
					if pipeline != 0 && ct.PipelineId != pipeline || want != "" && stateName(ct.State.String()) != want {
						continue
					}
					if len(out) == limit {
						truncated = true
						break pages
					}
					out = append(out, ct)
				}
				if !r.Truncated || len(r.Containers) == 0 {
					break
				}
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"containers": containerRows(out), "truncated": truncated})
			}
			// UNHEALTHY last: scripts reading columns by position keep theirs.
			t := newTable(cmd.OutOrStdout(), "ID", "PIPELINE", "REPLICATION", "STATE", "REPLICAS", "USED", "CREATED", "UNHEALTHY")
			for _, ct := range out {
				t.row(ct.Id, ct.PipelineId, ct.Replication, stateName(ct.State.String()), joinIDs(ct.Replicas), fmtBytes(ct.UsedBytes), fmtTime(time.UnixMilli(ct.CreatedUnixMs)), dash(joinIDs(ct.UnhealthyReplicas)))
			}
			return t.flush()
		}),
	}
	ctList.Flags().Uint64Var(&pipeline, "pipeline", 0, "only containers of this pipeline")
	ctList.Flags().StringVar(&state, "state", "", "only containers in this state: open, closing, closed")
	ctList.Flags().IntVar(&limit, "limit", 100000, "stop after this many containers")
	ctInfo := &cobra.Command{
		Use: "info ID", Short: "Show a container, its replicas and why any is UNHEALTHY",
		Long: `Shows a container, the healthy replicas clients read from (data address,
host, location), and every replica: how SCM counts it (healthy, unhealthy,
dead, missing, lagging, ...), the state and committed index (BCSID) its
datanode last reported, and for an UNHEALTHY replica why: the reason the
datanode gave in its report (what its state machine recorded: an apply or
data-path runtime error, a chunk not stored, a block not committed here;
or its failed volume). When the datanode gives none, or does not know the
cause (storage's own mark, or a mark from before the datanode restarted:
"UNHEALTHY here; cause not known ..."), the reason SCM recorded through
Raft when it recorded the replica unhealthy is shown instead. --json has
both (unhealthy_reason, recorded_reason) and the one shown (reason). If
SCM does not answer for the replicas, the container is still shown and a
warning goes to stderr (JSON: replicas_error). "basalt admin container
replicas ID" adds the reports against each replica.`,
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
			r, err := c.Scm().GetContainers(cmd.Context(), &metapb.GetContainersRequest{ContainerIds: []uint64{id}, ClientLocation: f.location})
			if err != nil {
				return client.FromRPC(fmt.Sprintf("container info %d", id), err)
			}
			if len(r.Containers) != 1 {
				return fmt.Errorf("container info %d: %d answers", id, len(r.Containers))
			}
			cw := r.Containers[0]
			// The replicas are extra: if SCM does not answer (a transient
			// error, a certificate whose role may not call it), the
			// container is still shown, with a warning.
			var cr *metapb.ContainerReplicas
			var repErr error
			rr, err := c.Scm().GetContainerReplicas(cmd.Context(), &metapb.GetContainerReplicasRequest{ContainerId: id})
			if err != nil {
				repErr = client.FromRPC(fmt.Sprintf("container info %d: replicas", id), err)
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: replicas not shown: %v\n", repErr)
			} else if len(rr.Containers) == 1 {
				cr = rr.Containers[0]
			}
			reps := replicaRows(cr)
			if f.json {
				type rep struct {
					ID       uint64 `json:"id"`
					Addr     string `json:"data_addr"`
					Location string `json:"location"`
				}
				var locs []rep
				for _, d := range cw.Datanodes {
					locs = append(locs, rep{d.Id, d.DataAddr, d.Location})
				}
				out := map[string]any{"container": containerRows([]*metapb.Container{cw.Container})[0], "datanodes": locs, "replicas": reps}
				if repErr != nil {
					delete(out, "replicas")
					out["replicas_error"] = repErr.Error()
				}
				if cr != nil && cr.Health != "" {
					out["health"] = cr.Health
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			ct := cw.Container
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "container:    %d\npipeline:     %d\nreplication:  %s\nstate:        %s\nused:         %s\ncreated:      %s\n",
				ct.Id, ct.PipelineId, ct.Replication, stateName(ct.State.String()), fmtBytes(ct.UsedBytes), fmtTime(time.UnixMilli(ct.CreatedUnixMs)))
			if cr != nil && cr.Health != "" {
				fmt.Fprintf(w, "health:       %s\n", cr.Health)
			}
			fmt.Fprintln(w)
			t := newTable(w, "DATANODE", "DATA ADDR", "HOST", "LOCATION")
			for _, d := range cw.Datanodes {
				t.row(d.Id, d.DataAddr, d.Hostname, d.Location)
			}
			if err := t.flush(); err != nil {
				return err
			}
			if repErr != nil {
				return nil
			}
			fmt.Fprintln(w)
			t = newTable(w, "REPLICA ON", "HEALTH", "REPORTED", "BCSID", "REASON")
			for _, x := range reps {
				t.row(x.Datanode, x.Health, dash(x.Reported), x.BCSID, dash(x.Reason))
			}
			return t.flush()
		}),
	}
	dn.AddCommand(datanodeOpCmds(f)...)
	ct.AddCommand(ctList, ctInfo, containerHealthCmd(f), containerReplicasCmd(f), containerRecoverCmd(f))
	root.AddCommand(dn, pl, ct)
	root.AddCommand(adminS3Cmd(f))
	root.AddCommand(adminCACmd(f))
	root.AddCommand(adminCacheCmd(f))
	root.AddCommand(adminUpgradeCmd(f))
	return root
}

// logDirsText is a datanode's LOGDIRS column: "-" when it does not
// report them (an older datanode), the count when none failed, "1/2
// failed", and "2/2 failed, no new pipelines" when none is healthy (SCM
// places no new pipeline on it and closes the open ones it is in, so
// PIPELINES may show a few until the next tick; its closed containers
// still serve).
func logDirsText(d *metapb.DatanodeStatus) string {
	switch {
	case d.LogDirs == 0:
		return "-"
	case d.LogDirsFailed == 0:
		return strconv.FormatUint(uint64(d.LogDirs), 10)
	case d.LogDirsFailed >= d.LogDirs:
		return fmt.Sprintf("%d/%d failed, no new pipelines", d.LogDirsFailed, d.LogDirs)
	}
	return fmt.Sprintf("%d/%d failed", d.LogDirsFailed, d.LogDirs)
}

func volumeTotals(vs []*metapb.VolumeReport) (capa, used uint64, failed int) {
	for _, v := range vs {
		if v.Failed {
			failed++
			continue
		}
		capa += v.CapacityBytes
		used += v.UsedBytes
	}
	return
}

// stateName strips the enum prefixes ("PIPELINE_OPEN" → "OPEN").
func stateName(s string) string {
	for _, p := range []string{"PIPELINE_", "CONTAINER_", "NODE_STATE_"} {
		s = strings.TrimPrefix(s, p)
	}
	return s
}

func joinIDs(ids []uint64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatUint(id, 10)
	}
	return strings.Join(s, ",")
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

type containerRow struct {
	ID          uint64   `json:"id"`
	Pipeline    uint64   `json:"pipeline"`
	Replication string   `json:"replication"`
	State       string   `json:"state"`
	Replicas    []uint64 `json:"replicas"`
	// Replicas SCM recorded unhealthy (through Raft).
	Unhealthy []uint64 `json:"unhealthy_replicas,omitempty"`
	UsedBytes uint64   `json:"used_bytes"`
	Created   string   `json:"created,omitempty"`
}

func containerRows(cs []*metapb.Container) []containerRow {
	out := []containerRow{}
	for _, c := range cs {
		r := containerRow{ID: c.Id, Pipeline: c.PipelineId, Replication: c.Replication.String(), State: stateName(c.State.String()), Replicas: c.Replicas, Unhealthy: c.UnhealthyReplicas, UsedBytes: c.UsedBytes}
		if c.CreatedUnixMs > 0 {
			r.Created = time.UnixMilli(c.CreatedUnixMs).UTC().Format(time.RFC3339)
		}
		out = append(out, r)
	}
	return out
}

// cacheText is a datanode's cache tier for tables: used/capacity, blocks,
// hits and misses (docs/CACHE.md).
func cacheText(c *metapb.CacheStats) string {
	if c == nil || c.CapacityBytes == 0 {
		return "-"
	}
	kind := "pmem"
	if !c.Persistent {
		kind = "dram"
	}
	return fmt.Sprintf("%s/%s %s, %d blocks, %d hits, %d misses", fmtBytes(c.UsedBytes), fmtBytes(c.CapacityBytes), kind, c.Blocks, c.Hits, c.Misses)
}

// replicaRow is one replica in `container info`: how SCM counts it, what
// its datanode last reported, and why it is UNHEALTHY.
type replicaRow struct {
	Datanode uint64 `json:"datanode"`
	Health   string `json:"health"`
	Reported string `json:"reported_state,omitempty"` // "": not reported to this SCM leader
	BCSID    uint64 `json:"bcsid"`
	// The datanode's own reason, from its last full report (UNHEALTHY
	// only).
	UnhealthyReason string `json:"unhealthy_reason,omitempty"`
	// Why SCM recorded the replica unhealthy (its record through Raft;
	// it outlives a failover and a datanode that stopped reporting).
	RecordedReason string `json:"recorded_reason,omitempty"`
	// The reason shown: the datanode's own, else (none, or it does not
	// know the cause: storage's own mark, or a mark from before its
	// restart) SCM's record, else the datanode's.
	Reason string `json:"reason,omitempty"`
}

// reason is the reason shown (replicaRow.Reason).
func (r replicaRow) reason() string {
	if r.RecordedReason != "" && (r.UnhealthyReason == "" || strings.HasPrefix(r.UnhealthyReason, datanode.UnknownUnhealthyReason)) {
		return r.RecordedReason
	}
	return r.UnhealthyReason
}

// replicaRows lists cr's replicas (none if cr is nil).
func replicaRows(cr *metapb.ContainerReplicas) []replicaRow {
	out := []replicaRow{}
	if cr == nil {
		return out
	}
	recorded := map[uint64]string{}
	for _, x := range cr.Reports {
		if x.GetBlock().GetLocalId() == 0 && x.Reporter == "scm" {
			recorded[x.DatanodeId] = x.Reason
		}
	}
	for _, x := range cr.Replicas {
		r := replicaRow{Datanode: x.DatanodeId, Health: x.Health, BCSID: x.Bcsid, UnhealthyReason: x.UnhealthyReason, RecordedReason: recorded[x.DatanodeId]}
		r.Reason = r.reason()
		if x.ReportedState != metapb.ContainerState_CONTAINER_STATE_UNSPECIFIED {
			r.Reported = stateName(x.ReportedState.String())
		}
		out = append(out, r)
	}
	return out
}

// streamVersion is the newest V2 stream protocol version datanode d
// speaks: a datanode that predates the field (0) speaks only 4. During a
// rolling upgrade clients open routes at the lowest version on them, so a
// 4 here means that datanode's streams pay a TLS handshake per hop.
func streamVersion(d *metapb.DatanodeDetails) uint32 {
	if v := d.GetStreamVersion(); v != 0 {
		return v
	}
	return 4
}
