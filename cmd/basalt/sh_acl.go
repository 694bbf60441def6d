package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// ACL commands of `basalt sh volume|bucket|key` (docs/SECURITY.md), with
// Ozone's ACL strings: TYPE:NAME:RIGHTS[,...], TYPE user, group, world or
// anonymous (world and anonymous take no name: "world::r"), RIGHTS
// letters r (read) w (write) c (create) l (list) d (delete) x (read_acl)
// y (write_acl) a (all) n (none). An "[ACCESS]" suffix is accepted (the
// only scope); "[DEFAULT]" is refused (a bucket's ACL is what its keys
// inherit).

// aclLetters are Ozone's right letters in display order.
var aclLetters = []struct {
	c     byte
	right metapb.AclRight
}{
	{'r', metapb.AclRight_ACL_READ}, {'w', metapb.AclRight_ACL_WRITE}, {'c', metapb.AclRight_ACL_CREATE},
	{'l', metapb.AclRight_ACL_LIST}, {'d', metapb.AclRight_ACL_DELETE}, {'x', metapb.AclRight_ACL_READ_ACL},
	{'y', metapb.AclRight_ACL_WRITE_ACL},
}

var aclTypeNames = map[string]metapb.AclType{
	"user": metapb.AclType_ACL_USER, "group": metapb.AclType_ACL_GROUP,
	"world": metapb.AclType_ACL_WORLD, "anonymous": metapb.AclType_ACL_ANONYMOUS,
}

func aclTypeString(t metapb.AclType) string {
	for n, v := range aclTypeNames {
		if v == t {
			return n
		}
	}
	return fmt.Sprintf("type-%d", t)
}

// parseAcls parses "user:alice:rwl,world::r".
func parseAcls(s string) ([]*metapb.Acl, error) {
	var out []*metapb.Acl
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if base, scope, ok := strings.Cut(item, "["); ok {
			switch strings.ToUpper(strings.TrimSuffix(scope, "]")) {
			case "ACCESS":
				item = base
			case "DEFAULT":
				return nil, usagef("ACL %q: DEFAULT scope is not supported: keys inherit their bucket's ACL", item)
			default:
				return nil, usagef("ACL %q: unknown scope [%s]", item, scope)
			}
		}
		parts := strings.Split(item, ":")
		if len(parts) != 3 {
			return nil, usagef("ACL %q: want TYPE:NAME:RIGHTS, e.g. user:alice:rwl or world::r", item)
		}
		typ, ok := aclTypeNames[strings.ToLower(parts[0])]
		if !ok {
			return nil, usagef("ACL %q: type %q: want user, group, world or anonymous", item, parts[0])
		}
		name := parts[1]
		if (typ == metapb.AclType_ACL_USER || typ == metapb.AclType_ACL_GROUP) && name == "" {
			return nil, usagef("ACL %q: a %s entry needs a name", item, parts[0])
		}
		if (typ == metapb.AclType_ACL_WORLD || typ == metapb.AclType_ACL_ANONYMOUS) && name != "" {
			return nil, usagef("ACL %q: %s entries take no name (%s::RIGHTS)", item, parts[0], parts[0])
		}
		rights, err := parseRights(parts[2])
		if err != nil {
			return nil, usagef("ACL %q: %v", item, err)
		}
		out = append(out, &metapb.Acl{Type: typ, Name: name, Rights: rights})
	}
	if len(out) == 0 {
		return nil, usagef("no ACL entries in %q", s)
	}
	return out, nil
}

func parseRights(s string) (uint32, error) {
	if s == "" {
		return 0, fmt.Errorf("no rights (letters r w c l d x y, a for all)")
	}
	var r uint32
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case 'a':
			r |= uint32(metapb.AclRight_ACL_ALL)
		case 'n':
		default:
			found := false
			for _, l := range aclLetters {
				if l.c == c {
					r |= uint32(l.right)
					found = true
				}
			}
			if !found {
				return 0, fmt.Errorf("right %q: want letters r w c l d x y, a (all) or n (none)", string(c))
			}
		}
	}
	if r == 0 {
		return 0, fmt.Errorf("no rights")
	}
	return r, nil
}

// formatRights is Ozone's letters for rights ("a" for all).
func formatRights(r uint32) string {
	if r == uint32(metapb.AclRight_ACL_ALL) {
		return "a"
	}
	var b strings.Builder
	for _, l := range aclLetters {
		if r&uint32(l.right) != 0 {
			b.WriteByte(l.c)
		}
	}
	return b.String()
}

// formatAcl is one entry in Ozone's syntax.
func formatAcl(e *metapb.Acl) string {
	return aclTypeString(e.Type) + ":" + e.Name + ":" + formatRights(e.Rights)
}

type aclJSON struct {
	Type   string `json:"type"`
	Name   string `json:"name"`
	Rights string `json:"rights"`
}

func printAcl(f *connFlags, w io.Writer, p objPath, l *metapb.AclList) error {
	if f.json {
		out := struct {
			Path  string    `json:"path"`
			Owner string    `json:"owner"`
			Acls  []aclJSON `json:"acls"`
		}{Path: p.String(), Owner: l.Owner, Acls: []aclJSON{}}
		for _, e := range l.Acls {
			out.Acls = append(out.Acls, aclJSON{Type: aclTypeString(e.Type), Name: e.Name, Rights: formatRights(e.Rights)})
		}
		return printJSON(w, out)
	}
	if _, err := fmt.Fprintf(w, "%s  owner %s\n", p, l.Owner); err != nil {
		return err
	}
	t := newTable(w, "TYPE", "NAME", "RIGHTS", "ACL")
	for _, e := range l.Acls {
		t.row(aclTypeString(e.Type), e.Name, formatRights(e.Rights), formatAcl(e))
	}
	return t.flush()
}

// aclCmds are getacl, setacl, addacl and removeacl for paths of depth.
func aclCmds(f *connFlags, depth int) []*cobra.Command {
	what := [...]string{"", "/volume", "/volume/bucket", "/volume/bucket/key"}[depth]
	get := &cobra.Command{
		Use: "getacl " + what, Short: "Show the ACL and owner",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depth, func(ctx context.Context, c *client.Client, p objPath) error {
				l, err := c.GetAcl(ctx, p.Volume, p.Bucket, p.Key)
				if err != nil {
					return err
				}
				return printAcl(f, cmd.OutOrStdout(), p, l)
			})
		}),
	}
	change := func(name, short string, op metapb.AclOp) *cobra.Command {
		var spec string
		cmd := &cobra.Command{
			Use: name + " " + what + " --acl TYPE:NAME:RIGHTS[,...]", Short: short,
			Example: fmt.Sprintf("  basalt sh %s %s %s --acl user:alice:rwl,group:etl:rl,world::l",
				map[int]string{depthVolume: "volume", depthBucket: "bucket", depthKey: "key"}[depth], name, map[int]string{depthVolume: "/vol1", depthBucket: "/vol1/b1", depthKey: "/vol1/b1/k"}[depth]),
			RunE: runE(func(cmd *cobra.Command, args []string) error {
				if spec == "" {
					return usagef("--acl is required (e.g. --acl user:alice:rwl,world::r; rights r w c l d x y a)")
				}
				acls, err := parseAcls(spec)
				if err != nil {
					return err
				}
				return withPath(f, args, depth, func(ctx context.Context, c *client.Client, p objPath) error {
					l, err := c.SetAcl(ctx, p.Volume, p.Bucket, p.Key, op, acls)
					if err != nil {
						return err
					}
					return printAcl(f, cmd.OutOrStdout(), p, l)
				})
			}),
		}
		cmd.Flags().StringVarP(&spec, "acl", "a", "", "ACL entries: TYPE:NAME:RIGHTS,... (TYPE user|group|world|anonymous; RIGHTS r w c l d x(read_acl) y(write_acl) a(all))")
		return cmd
	}
	return []*cobra.Command{get,
		change("setacl", "Replace the ACL", metapb.AclOp_ACL_REPLACE),
		change("addacl", "Add rights to the ACL", metapb.AclOp_ACL_ADD),
		change("removeacl", "Remove rights from the ACL (entries left with none go)", metapb.AclOp_ACL_REMOVE),
	}
}

// bucketPolicyCmds are `basalt sh bucket policy get|set|delete|status` and
// `basalt sh bucket public-access-block get|set` (docs/SECURITY.md).
func bucketPolicyCmds(f *connFlags) []*cobra.Command {
	pol := &cobra.Command{Use: "policy", Short: "Show, set or delete a bucket's policy (the S3 IAM JSON subset)"}
	pol.AddCommand(&cobra.Command{
		Use: "get /volume/bucket", Short: "Print the bucket's policy (nothing if none)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				doc, err := c.GetBucketPolicy(ctx, p.Volume, p.Bucket)
				if err != nil {
					return err
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), map[string]string{"path": p.String(), "policy": doc})
				}
				if doc != "" {
					_, err = fmt.Fprintln(cmd.OutOrStdout(), doc)
				}
				return err
			})
		}),
	}, &cobra.Command{
		Use: "set /volume/bucket FILE|-", Short: "Set the bucket's policy from a JSON file (- for stdin)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if len(args) != 2 {
				return usagef("want /volume/bucket and a policy file (- for stdin)")
			}
			var r io.Reader = cmd.InOrStdin()
			if args[1] != "-" {
				fh, err := os.Open(args[1])
				if err != nil {
					return err
				}
				defer fh.Close()
				r = fh
			}
			doc, err := io.ReadAll(io.LimitReader(r, 64<<10))
			if err != nil {
				return err
			}
			return withPath(f, args[:1], depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				if err := c.SetBucketPolicy(ctx, p.Volume, p.Bucket, string(doc)); err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "policy set", p)
			})
		}),
	}, &cobra.Command{
		Use: "delete /volume/bucket", Short: "Delete the bucket's policy",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				if err := c.SetBucketPolicy(ctx, p.Volume, p.Bucket, ""); err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "policy deleted", p)
			})
		}),
	}, &cobra.Command{
		Use: "status /volume/bucket", Short: "Whether the policy makes the bucket public",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				public, err := c.GetBucketPolicyStatus(ctx, p.Volume, p.Bucket)
				if err != nil {
					return err
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), map[string]any{"path": p.String(), "is_public": public})
				}
				_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s public=%v\n", p, public)
				return err
			})
		}),
	})

	pab := &cobra.Command{Use: "public-access-block", Short: "Show or set a bucket's Block Public Access settings"}
	pab.AddCommand(&cobra.Command{
		Use: "get /volume/bucket", Short: "Show the settings",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				cfg, err := c.GetPublicAccessBlock(ctx, p.Volume, p.Bucket)
				if err != nil {
					return err
				}
				return printPAB(f, cmd.OutOrStdout(), p, cfg)
			})
		}),
	})
	var blockAcls, ignoreAcls, blockPolicy, restrict bool
	set := &cobra.Command{
		Use:   "set /volume/bucket [--block-public-acls] [--ignore-public-acls] [--block-public-policy] [--restrict-public-buckets]",
		Short: "Replace the settings (no flags: remove them)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				cfg := &metapb.PublicAccessBlock{BlockPublicAcls: blockAcls, IgnorePublicAcls: ignoreAcls, BlockPublicPolicy: blockPolicy, RestrictPublicBuckets: restrict}
				if err := c.SetPublicAccessBlock(ctx, p.Volume, p.Bucket, cfg); err != nil {
					return err
				}
				return printPAB(f, cmd.OutOrStdout(), p, cfg)
			})
		}),
	}
	set.Flags().BoolVar(&blockAcls, "block-public-acls", false, "refuse ACLs that grant WORLD or ANONYMOUS")
	set.Flags().BoolVar(&ignoreAcls, "ignore-public-acls", false, "WORLD and ANONYMOUS ACL entries grant nothing")
	set.Flags().BoolVar(&blockPolicy, "block-public-policy", false, "refuse a public bucket policy")
	set.Flags().BoolVar(&restrict, "restrict-public-buckets", false, "a public policy grants only the owner")
	pab.AddCommand(set)
	return []*cobra.Command{pol, pab}
}

func printPAB(f *connFlags, w io.Writer, p objPath, cfg *metapb.PublicAccessBlock) error {
	if f.json {
		return printJSON(w, map[string]any{"path": p.String(), "block_public_acls": cfg.GetBlockPublicAcls(), "ignore_public_acls": cfg.GetIgnorePublicAcls(),
			"block_public_policy": cfg.GetBlockPublicPolicy(), "restrict_public_buckets": cfg.GetRestrictPublicBuckets()})
	}
	t := newTable(w, "BUCKET", "BLOCK_PUBLIC_ACLS", "IGNORE_PUBLIC_ACLS", "BLOCK_PUBLIC_POLICY", "RESTRICT_PUBLIC_BUCKETS")
	t.row(p.String(), cfg.GetBlockPublicAcls(), cfg.GetIgnorePublicAcls(), cfg.GetBlockPublicPolicy(), cfg.GetRestrictPublicBuckets())
	return t.flush()
}
