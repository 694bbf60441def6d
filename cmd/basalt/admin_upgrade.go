package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// adminUpgradeCmd is `basalt admin upgrade status|finalize`: layout
// versions of the metadata service (docs/ARCHITECTURE.md, "Upgrades").
func adminUpgradeCmd(f *connFlags) *cobra.Command {
	metaClient := func() (*metaclient.Client, error) {
		cfg, err := f.config()
		if err != nil {
			return nil, err
		}
		return metaclient.New(metaclient.Config{Addrs: cfg.MetaAddrs, CallTimeout: 30 * time.Second,
			DialOptions: []grpc.DialOption{cfg.Credentials.GRPCDialOption(pki.RoleMeta)}})
	}
	root := &cobra.Command{Use: "upgrade", Short: "Rolling upgrades of the metadata service: layout versions, finalize",
		Long: `A meta binary supports a layout version (its set of log commands); the
cluster runs at its finalized version, and the leader refuses commands of a
newer layout until every member supports it and an operator finalized:

  1. replace the meta binaries one at a time (restart each, wait for it to
     catch up: basalt admin upgrade status);
  2. basalt admin upgrade finalize   # refused while a member lacks the version

A replica that meets a log entry its binary cannot apply halts there (it is
shown HALTED with the entry and why; the SCM, CA and user-token groups halt
alike, shown as GROUP HALTED): upgrade its binary and restart it; it
resumes from that entry.`}
	status := &cobra.Command{
		Use: "status", Short: "Each meta replica's supported layout version and apply state, the finalized version, features waiting",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := metaClient()
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Upgrade.GetLayoutStatus(cmd.Context(), &metapb.GetLayoutStatusRequest{All: true})
			if err != nil {
				return client.FromRPC("upgrade status", err)
			}
			return printLayoutStatus(cmd, f, r)
		}),
	}
	var version uint32
	finalize := &cobra.Command{
		Use: "finalize", Short: "Finalize the layout version every member supports (admins only)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := metaClient()
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Upgrade.FinalizeLayout(cmd.Context(), &metapb.FinalizeLayoutRequest{Version: version})
			if err != nil {
				return client.FromRPC("upgrade finalize", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"finalized_version": r.FinalizedVersion})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "finalized at layout version %d\n", r.FinalizedVersion)
			return nil
		}),
	}
	finalize.Flags().Uint32Var(&version, "version", 0, "layout version to finalize (default: the leader binary's)")
	root.AddCommand(status, finalize)
	return root
}

type groupHalt struct {
	Group  string `json:"group"`
	Index  uint64 `json:"index"`
	Op     int32  `json:"op,omitempty"`
	Reason string `json:"reason"`
}

func printLayoutStatus(cmd *cobra.Command, f *connFlags, r *metapb.GetLayoutStatusResponse) error {
	type replica struct {
		Node         uint64 `json:"node"`
		Addr         string `json:"addr"`
		Software     uint32 `json:"software_version"`
		Finalized    uint32 `json:"finalized_version"`
		Applied      uint64 `json:"applied_index"`
		State        string `json:"state"`
		HaltedIndex  uint64 `json:"halted_index,omitempty"`
		HaltedReason string `json:"halted_reason,omitempty"`
		// Other groups (scm, ca, usertoken) halted on the replica.
		GroupHalts []groupHalt `json:"group_halts,omitempty"`
		Error      string      `json:"error,omitempty"`
	}
	type feature struct {
		Name        string `json:"name"`
		Version     uint32 `json:"version"`
		Description string `json:"description,omitempty"`
		Finalized   bool   `json:"finalized"`
	}
	out := struct {
		Finalized uint32    `json:"finalized_version"`
		Replicas  []replica `json:"replicas"`
		Features  []feature `json:"features"`
		Waiting   []string  `json:"features_waiting"`
	}{Finalized: r.FinalizedVersion, Replicas: []replica{}, Features: []feature{}, Waiting: []string{}}
	for _, p := range r.Replicas {
		st := "applying"
		switch {
		case p.Error != "":
			st = "unknown"
		case p.HaltedIndex != 0:
			st = "HALTED"
		case len(p.GroupHalts) > 0:
			st = "GROUP HALTED"
		}
		rep := replica{Node: p.NodeId, Addr: p.Addr, Software: p.SoftwareVersion, Finalized: p.FinalizedVersion,
			Applied: p.AppliedIndex, State: st, HaltedIndex: p.HaltedIndex, HaltedReason: p.HaltedReason, Error: p.Error}
		for _, h := range p.GroupHalts {
			rep.GroupHalts = append(rep.GroupHalts, groupHalt{Group: h.Group, Index: h.Index, Op: h.Op, Reason: h.Reason})
		}
		out.Replicas = append(out.Replicas, rep)
	}
	for _, ft := range r.Features {
		out.Features = append(out.Features, feature{Name: ft.Name, Version: ft.Version, Description: ft.Description, Finalized: ft.Finalized})
		if !ft.Finalized {
			out.Waiting = append(out.Waiting, ft.Name)
		}
	}
	if f.json {
		return printJSON(cmd.OutOrStdout(), out)
	}
	w := cmd.OutOrStdout()
	fmt.Fprintf(w, "finalized layout version: %d\n", out.Finalized)
	t := newTable(w, "NODE", "ADDR", "SOFTWARE", "FINALIZED", "APPLIED", "STATE", "DETAIL")
	for _, p := range out.Replicas {
		detail := p.Error
		if p.HaltedIndex != 0 {
			detail = fmt.Sprintf("halted at entry %d: %s", p.HaltedIndex, p.HaltedReason)
		}
		for _, h := range p.GroupHalts {
			if detail != "" {
				detail += "; "
			}
			detail += fmt.Sprintf("%s halted at entry %d: %s", h.Group, h.Index, h.Reason)
		}
		t.row(p.Node, p.Addr, p.Software, p.Finalized, p.Applied, p.State, detail)
	}
	if err := t.flush(); err != nil {
		return err
	}
	for _, ft := range out.Features {
		state := "finalized"
		if !ft.Finalized {
			state = "waiting for finalize"
		}
		fmt.Fprintf(w, "feature %s (layout %d): %s\n", ft.Name, ft.Version, state)
	}
	return nil
}
