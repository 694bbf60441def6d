package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// adminMetaCmd: meta membership (docs/ARCHITECTURE.md, "Meta membership").
// It has its own connection flags (the same names as admin's, which it
// shadows) so that admin.go need not know it.
func adminMetaCmd() *cobra.Command {
	f := &connFlags{}
	root := &cobra.Command{Use: "meta", Short: "Meta node membership: list, add, remove (replace a meta node)",
		Long: `Meta node membership. Every meta Raft group (members, namespace, SCM, CA,
user tokens) has the same voters; add and remove change all of them, one
membership change per group, and keep the node's addresses in the replicated
member table. A retry completes an interrupted change.

Replacing a meta node whose disk died (docs/ARCHITECTURE.md):
  1. basalt admin meta remove 3             # the dead node; its ID never returns
  2. basalt admin ca token create --role meta --id 4
  3. basalt meta --join --id 4 --bootstrap-token T --peers <current members> ...
  4. basalt admin meta add 4 10.0.0.4:9863/10.0.0.4:9862
  5. basalt admin meta members              # wait until node 4 caught up

Examples:
  basalt admin meta members --json
  basalt admin meta add 4 10.0.0.4:9863/10.0.0.4:9862
  basalt admin meta remove 3
` + exitCodesHelp}
	f.register(root)

	members := &cobra.Command{
		Use: "members", Short: "The member table and each meta group's voters, as the node first in --meta sees them (admins only)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			var r *metapb.ListMembersResponse
			err := callMembers(cmd.Context(), f, false, func(ctx context.Context, c metapb.MembersClient) (err error) {
				r, err = c.ListMembers(ctx, &metapb.ListMembersRequest{})
				return err
			})
			if err != nil {
				return client.FromRPC("meta members", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), r)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "as seen by meta node %d\n", r.GetNodeId())
			t := newTable(w, "ID", "RAFT", "GRPC", "STATE", "SOURCE")
			for _, m := range r.GetMembers() {
				st := "member"
				switch {
				case m.GetRevoked():
					st = "removed, certificates revoked"
				case m.GetRemoved():
					// Not "pending": the answering node may not know
					// (a binary without the field, a halted CA replica).
					st = fmt.Sprintf("removed, revocation not confirmed by node %d", r.GetNodeId())
				}
				switch {
				case m.GetKeysRotated():
					st += ", token keys rotated"
				case m.GetRemoved():
					st += fmt.Sprintf(", token key rotation not confirmed by node %d", r.GetNodeId())
				}
				t.row(m.GetId(), m.GetRaftAddr(), m.GetGrpcAddr(), st, m.GetSource())
			}
			if err := t.flush(); err != nil {
				return err
			}
			fmt.Fprintln(w)
			t = newTable(w, "GROUP", "LEADER", "VOTERS", "COMMIT", "APPLIED HERE", "FOLLOWERS (ID:MATCH/APPLIED, * = not heard from)")
			for _, g := range r.GetGroups() {
				var fs []string
				for _, m := range g.GetMembers() {
					s := fmt.Sprintf("%d:%d/%d", m.GetId(), m.GetMatch(), m.GetApplied())
					if !m.GetActive() {
						s += "*"
					}
					fs = append(fs, s)
				}
				t.row(g.GetName(), g.GetLeader(), fmtIDs(g.GetVoters()), g.GetCommit(), g.GetApplied(), strings.Join(fs, " "))
			}
			return t.flush()
		}),
	}
	add := &cobra.Command{
		Use: "add ID RAFT_ADDR/GRPC_ADDR", Short: "Add a meta node (started with basalt meta --join) to every meta group (admins only)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 2, "ID RAFT_ADDR/GRPC_ADDR"); err != nil {
				return err
			}
			id, err := parseMetaID(args[0])
			if err != nil {
				return err
			}
			raftAddr, grpcAddr, ok := strings.Cut(args[1], "/")
			if !ok || raftAddr == "" || grpcAddr == "" {
				return usagef("addresses %q: want RAFT_ADDR/GRPC_ADDR (host:port/host:port)", args[1])
			}
			var r *metapb.MemberChangeResponse
			err = callMembers(cmd.Context(), f, true, func(ctx context.Context, c metapb.MembersClient) (err error) {
				r, err = c.AddMember(ctx, &metapb.AddMemberRequest{Id: id, RaftAddr: raftAddr, GrpcAddr: grpcAddr})
				return err
			})
			if err != nil {
				return client.FromRPC("meta add", err)
			}
			return printChange(cmd, f, r)
		}),
	}
	remove := &cobra.Command{
		Use: "remove ID", Short: "Remove a meta node from every meta group; its ID may never be added again (admins only)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "ID"); err != nil {
				return err
			}
			id, err := parseMetaID(args[0])
			if err != nil {
				return err
			}
			var r *metapb.MemberChangeResponse
			err = callMembers(cmd.Context(), f, true, func(ctx context.Context, c metapb.MembersClient) (err error) {
				r, err = c.RemoveMember(ctx, &metapb.RemoveMemberRequest{Id: id})
				return err
			})
			if err != nil {
				return client.FromRPC("meta remove", err)
			}
			return printChange(cmd, f, r)
		}),
	}
	root.AddCommand(members, add, remove)
	return root
}

func parseMetaID(s string) (uint64, error) {
	id, err := strconv.ParseUint(s, 10, 64)
	if err != nil || id == 0 {
		return 0, usagef("node ID %q: want a positive integer", s)
	}
	return id, nil
}

func fmtIDs(ids []uint64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatUint(id, 10)
	}
	return strings.Join(s, ",")
}

func printChange(cmd *cobra.Command, f *connFlags, r *metapb.MemberChangeResponse) error {
	if f.json {
		return printJSON(cmd.OutOrStdout(), r)
	}
	w := cmd.OutOrStdout()
	m := r.GetMember()
	fmt.Fprintf(w, "node %d (raft %s, gRPC %s)\n", m.GetId(), m.GetRaftAddr(), m.GetGrpcAddr())
	switch {
	case m.GetRevoked():
		fmt.Fprintf(w, "removed; every certificate of basalt://meta/%d is revoked\n", m.GetId())
	case m.GetRemoved():
		fmt.Fprintf(w, "removed; the revocation of basalt://meta/%d's certificates is not confirmed yet (the CA group's leader makes it: see basalt admin meta members)\n", m.GetId())
	}
	t := newTable(w, "GROUP", "OUTCOME")
	for _, g := range r.GetGroups() {
		t.row(g.GetName(), g.GetOutcome())
	}
	return t.flush()
}

// callMembers calls the Members service: on the first --meta address that
// answers, or (leader) on the members group's leader, following NotLeader
// hints.
func callMembers(ctx context.Context, f *connFlags, leader bool, call func(context.Context, metapb.MembersClient) error) error {
	cfg, err := f.config()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	addrs := append([]string(nil), cfg.MetaAddrs...)
	var last error
	for tries := 0; tries < 50 && ctx.Err() == nil; tries++ {
		addr := addrs[tries%len(addrs)]
		conn, err := grpc.NewClient(addr, cfg.Credentials.GRPCDialOption(pki.RoleMeta))
		if err != nil {
			return err
		}
		err = call(ctx, metapb.NewMembersClient(conn))
		conn.Close()
		if err == nil {
			return nil
		}
		last = err
		st, _ := status.FromError(err)
		if st.Code() != codes.Unavailable {
			return err
		}
		for _, d := range st.Details() {
			if nl, ok := d.(*metapb.NotLeader); ok && nl.GetGroupId() == meta.MembersGroup && nl.GetLeaderAddr() != "" {
				addrs = append([]string{nl.GetLeaderAddr()}, addrs...)
				tries = -1 // the hint first
			}
		}
		if tries >= 0 && !leader && tries+1 >= len(addrs) {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	if last == nil {
		last = errors.New("no meta address answered")
	}
	return last
}
