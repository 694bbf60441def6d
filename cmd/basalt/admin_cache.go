package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// adminCacheCmd is `basalt admin cache pool|directive ...`: centralized
// cache management (docs/CACHE.md), as `hdfs cacheadmin`.
func adminCacheCmd(f *connFlags) *cobra.Command {
	root := &cobra.Command{Use: "cache", Short: "Cache pools and directives: pin hot data in the datanodes' cache tier",
		Long: `Cache pools and directives (docs/CACHE.md). Pools are added, modified and
removed by admins; directives by admins and by users with write on the
pool (its owner under the default mode 0755; anyone under 0777).

Examples:
  basalt admin cache pool add hot --owner etl --limit 64GiB --max-ttl 168h
  basalt admin cache directive add /vol/bucket/tables/2026/ --pool hot --replication 2 --ttl 24h
  basalt admin cache directive list --stats
  basalt admin cache directive remove 3
`}
	root.AddCommand(cachePoolCmd(f), cacheDirectiveCmd(f))
	return root
}

func parseLimit(s string) (uint64, error) {
	if s == "" || s == "0" || s == "unlimited" {
		return 0, nil
	}
	n, err := parseSize(s)
	if err != nil || n < 0 {
		return 0, usagef("size %q: want a byte count such as 512MiB, 64GiB", s)
	}
	return uint64(n), nil
}

func parseTTL(s string) (int64, error) {
	if s == "" || s == "0" || s == "never" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, usagef("TTL %q: want a duration such as 30m, 24h, or never", s)
	}
	return d.Milliseconds(), nil
}

func fmtTTL(ms int64) string {
	if ms == 0 {
		return "never"
	}
	return (time.Duration(ms) * time.Millisecond).String()
}

func fmtLimit(n uint64) string {
	if n == 0 {
		return "unlimited"
	}
	return fmtBytes(n)
}

func cachePoolCmd(f *connFlags) *cobra.Command {
	pc := &cobra.Command{Use: "pool", Short: "Cache pools: owner, byte limit, maximum TTL"}
	var owner, group, mode, limit, maxTTL string
	mk := func(use, short string, modify bool) *cobra.Command {
		cmd := &cobra.Command{Use: use + " NAME", Short: short,
			RunE: runE(func(cmd *cobra.Command, args []string) error {
				if err := exactArgs(args, 1, "pool name"); err != nil {
					return err
				}
				p := &metapb.CachePool{Name: args[0], Owner: owner, Group: group}
				var err error
				if mode != "" {
					m, err := strconv.ParseUint(mode, 8, 32)
					if err != nil || m > 0o777 {
						return usagef("--mode %q: want octal permission bits such as 0755", mode)
					}
					p.Mode = uint32(m)
				}
				if p.LimitBytes, err = parseLimit(limit); err != nil {
					return err
				}
				if p.MaxTtlMs, err = parseTTL(maxTTL); err != nil {
					return err
				}
				fl := cmd.Flags()
				p.SetOwner, p.SetLimit, p.SetMaxTtl = fl.Changed("owner"), fl.Changed("limit"), fl.Changed("max-ttl")
				p.SetGroup, p.SetMode = fl.Changed("group"), fl.Changed("mode")
				c, err := f.client(nil)
				if err != nil {
					return err
				}
				defer c.Close()
				var got *metapb.CachePool
				if modify {
					got, err = c.Scm().ModifyCachePool(cmd.Context(), p)
				} else {
					got, err = c.Scm().AddCachePool(cmd.Context(), p)
				}
				if err != nil {
					return client.FromRPC(use+" cache pool", err)
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), poolRow(got))
				}
				fmt.Fprintf(cmd.OutOrStdout(), "pool %s: owner %s, group %s, mode %04o, limit %s, max TTL %s\n", got.Name, dash(got.Owner), dash(got.Group), scm.PoolMode(got), fmtLimit(got.LimitBytes), fmtTTL(got.MaxTtlMs))
				return nil
			})}
		cmd.Flags().StringVar(&owner, "owner", "", "owner of the pool (default: you); with write in --mode the owner may add, modify and remove the pool's directives")
		cmd.Flags().StringVar(&group, "group", "", "group of the pool (recorded; group bits grant nothing yet)")
		cmd.Flags().StringVar(&mode, "mode", "", "permission bits in octal (default 0755): w lets the owner (owner bits) or anyone (other bits) change directives")
		cmd.Flags().StringVar(&limit, "limit", "", "byte limit of the pool's directives (bytes × cache replication), e.g. 64GiB; 0: unlimited")
		cmd.Flags().StringVar(&maxTTL, "max-ttl", "", "longest TTL a directive may have, e.g. 168h; never: no maximum")
		return cmd
	}
	rm := &cobra.Command{Use: "remove NAME", Aliases: []string{"rm"}, Short: "Remove a pool and its directives",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "pool name"); err != nil {
				return err
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			if _, err := c.Scm().RemoveCachePool(cmd.Context(), &metapb.RemoveCachePoolRequest{Name: args[0]}); err != nil {
				return client.FromRPC("remove cache pool", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "removed pool %s\n", args[0])
			return nil
		})}
	ls := &cobra.Command{Use: "list", Aliases: []string{"ls"}, Short: "List pools with the bytes their directives need and have cached",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Scm().ListCachePools(cmd.Context(), &metapb.ListCachePoolsRequest{})
			if err != nil {
				return client.FromRPC("list cache pools", err)
			}
			if f.json {
				out := []map[string]any{}
				for _, p := range r.Pools {
					out = append(out, poolRow(p))
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			t := newTable(cmd.OutOrStdout(), "NAME", "OWNER", "GROUP", "MODE", "LIMIT", "MAX TTL", "BYTES NEEDED", "BYTES CACHED", "FILES")
			for _, p := range r.Pools {
				t.row(p.Name, dash(p.Owner), dash(p.Group), fmt.Sprintf("%04o", scm.PoolMode(p)), fmtLimit(p.LimitBytes), fmtTTL(p.MaxTtlMs), fmtBytes(p.BytesNeeded), fmtBytes(p.BytesCached), p.Files)
			}
			return t.flush()
		})}
	pc.AddCommand(mk("add", "Add a pool", false), mk("modify", "Change a pool's owner, group, mode, limit or maximum TTL", true), rm, ls)
	return pc
}

func poolRow(p *metapb.CachePool) map[string]any {
	return map[string]any{"name": p.Name, "owner": p.Owner, "group": p.Group, "mode": fmt.Sprintf("%04o", scm.PoolMode(p)), "limit_bytes": p.LimitBytes, "max_ttl_ms": p.MaxTtlMs,
		"bytes_needed": p.BytesNeeded, "bytes_cached": p.BytesCached, "files": p.Files}
}

// parseCachePath parses /volume/bucket[/key], /volume/bucket/prefix/ or
// /volume/bucket/prefix* (a trailing * or / caches every key under it;
// /volume/bucket alone, the whole bucket).
func parseCachePath(s string) (*metapb.CacheDirective, error) {
	if !strings.HasPrefix(s, "/") {
		return nil, usagef("path %q must start with \"/\" (want /volume/bucket[/key-or-prefix])", s)
	}
	parts := strings.SplitN(s[1:], "/", 3)
	if len(parts) < 2 || parts[0] == "" || parts[1] == "" {
		return nil, usagef("path %q: want /volume/bucket[/key-or-prefix]", s)
	}
	d := &metapb.CacheDirective{Volume: parts[0], Bucket: parts[1]}
	if len(parts) == 3 {
		d.Path = parts[2]
	}
	switch {
	case d.Path == "":
		d.Prefix = true
	case strings.HasSuffix(d.Path, "*"):
		d.Path, d.Prefix = strings.TrimSuffix(d.Path, "*"), true
	case strings.HasSuffix(d.Path, "/"):
		d.Prefix = true
	}
	return d, nil
}

func cacheDirectiveCmd(f *connFlags) *cobra.Command {
	dc := &cobra.Command{Use: "directive", Short: "Cache directives: paths to keep in the cache tier"}
	var pool, ttl string
	var repl uint32
	var prefix bool
	add := &cobra.Command{Use: "add PATH", Short: "Cache a key, a key prefix (trailing / or *) or an fs directory",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "path"); err != nil {
				return err
			}
			d, err := parseCachePath(args[0])
			if err != nil {
				return err
			}
			d.Prefix = d.Prefix || prefix
			d.Pool, d.Replication = pool, repl
			if d.TtlMs, err = parseTTL(ttl); err != nil {
				return err
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			got, err := c.Scm().AddCacheDirective(cmd.Context(), d)
			if err != nil {
				return client.FromRPC("add cache directive", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), directiveRow(got))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "added cache directive %d: %s\n", got.Id, scm.DirectivePath(got))
			return nil
		})}
	add.Flags().StringVar(&pool, "pool", "", "cache pool (required)")
	add.Flags().Uint32Var(&repl, "replication", 1, "replicas of each block to cache (1..3)")
	add.Flags().StringVar(&ttl, "ttl", "", "time to live, e.g. 24h (default: the pool's maximum, or never)")
	add.Flags().BoolVar(&prefix, "prefix", false, "cache every key starting with the path")
	modify := &cobra.Command{Use: "modify ID", Short: "Change a directive's replication, pool or TTL",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "directive ID"); err != nil {
				return err
			}
			id, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || id == 0 {
				return usagef("directive ID %q: want a positive number", args[0])
			}
			d := &metapb.CacheDirective{Id: id, Pool: pool, Replication: repl}
			if d.TtlMs, err = parseTTL(ttl); err != nil {
				return err
			}
			fl := cmd.Flags()
			d.SetPool, d.SetReplication, d.SetTtl = fl.Changed("pool"), fl.Changed("replication"), fl.Changed("ttl")
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			got, err := c.Scm().ModifyCacheDirective(cmd.Context(), d)
			if err != nil {
				return client.FromRPC("modify cache directive", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), directiveRow(got))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "modified cache directive %d: %s\n", got.Id, scm.DirectivePath(got))
			return nil
		})}
	modify.Flags().StringVar(&pool, "pool", "", "move to this pool")
	modify.Flags().Uint32Var(&repl, "replication", 1, "replicas of each block to cache (1..3)")
	modify.Flags().StringVar(&ttl, "ttl", "", "new time to live from now, e.g. 24h, or never")
	rm := &cobra.Command{Use: "remove ID", Aliases: []string{"rm"}, Short: "Remove a directive (its blocks are uncached)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "directive ID"); err != nil {
				return err
			}
			id, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || id == 0 {
				return usagef("directive ID %q: want a positive number", args[0])
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			if _, err := c.Scm().RemoveCacheDirective(cmd.Context(), &metapb.RemoveCacheDirectiveRequest{Id: id}); err != nil {
				return client.FromRPC("remove cache directive", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "removed cache directive %d\n", id)
			return nil
		})}
	var lsPool string
	ls := &cobra.Command{Use: "list", Aliases: []string{"ls"}, Short: "List directives with bytes needed and cached and files covered (-stats)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Scm().ListCacheDirectives(cmd.Context(), &metapb.ListCacheDirectivesRequest{Pool: lsPool})
			if err != nil {
				return client.FromRPC("list cache directives", err)
			}
			if f.json {
				out := []map[string]any{}
				for _, d := range r.Directives {
					out = append(out, directiveRow(d))
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			t := newTable(cmd.OutOrStdout(), "ID", "POOL", "REPL", "EXPIRY", "PATH", "BYTES NEEDED", "BYTES CACHED", "FILES NEEDED", "FILES CACHED", "NOTE")
			for _, d := range r.Directives {
				exp := "never"
				if d.ExpiryUnixMs != 0 {
					exp = fmtTime(time.UnixMilli(d.ExpiryUnixMs))
					if d.Expired {
						exp += " (expired)"
					}
				}
				t.row(d.Id, d.Pool, d.Replication, exp, scm.DirectivePath(d), fmtBytes(d.BytesNeeded), fmtBytes(d.BytesCached), d.FilesNeeded, d.FilesCached, dash(d.Note))
			}
			return t.flush()
		})}
	ls.Flags().StringVar(&lsPool, "pool", "", "only this pool's directives")
	ls.Flags().Bool("stats", true, "show statistics (always on; accepted for hdfs cacheadmin habits)")
	dc.AddCommand(add, modify, rm, ls)
	return dc
}

func directiveRow(d *metapb.CacheDirective) map[string]any {
	return map[string]any{"id": d.Id, "path": scm.DirectivePath(d), "volume": d.Volume, "bucket": d.Bucket, "key": d.Path, "prefix": d.Prefix,
		"pool": d.Pool, "replication": d.Replication, "ttl_ms": d.TtlMs, "expiry_unix_ms": d.ExpiryUnixMs, "expired": d.Expired,
		"bytes_needed": d.BytesNeeded, "bytes_cached": d.BytesCached, "files_needed": d.FilesNeeded, "files_cached": d.FilesCached, "note": d.Note}
}
