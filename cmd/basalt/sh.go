package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
)

// shCmd is the client shell: volumes, buckets and keys with Ozone-style
// paths (/volume/bucket/key).
func shCmd() *cobra.Command {
	f := &connFlags{}
	var showProgress bool
	root := &cobra.Command{
		Use:   "sh",
		Short: "Client shell: volumes, buckets and keys (paths /volume/bucket/key)",
		Long: `Client shell for volumes, buckets and keys, with Ozone-style paths:
/volume, /volume/bucket, /volume/bucket/key (a key may contain "/").

Examples:
  basalt sh volume create /vol1
  basalt sh bucket create /vol1/b1 --layout object --replication 3
  basalt sh key put /vol1/b1/dir/file.bin ./file.bin
  cat data | basalt sh key put /vol1/b1/k -
  basalt sh key get /vol1/b1/dir/file.bin ./copy.bin
  basalt sh key cat /vol1/b1/k | head
  basalt sh key ls /vol1/b1 --prefix dir/ --delimiter /
  basalt sh key info /vol1/b1/k --json
  basalt sh key mv /vol1/b1/k k2
  basalt sh key rm /vol1/b1/k2
  basalt sh fs ls -R /vol1/fsb        (fs buckets; see "basalt sh fs --help")
  basalt sh bucket addacl /vol1/b1 --acl user:bob:rl,group:etl:r
  basalt sh key getacl /vol1/b1/k --json
  basalt sh bucket policy set /vol1/b1 policy.json
  basalt sh bucket public-access-block set /vol1/b1 --block-public-acls
` + exitCodesHelp,
	}
	f.register(root)
	root.PersistentFlags().BoolVar(&showProgress, "progress", false, "show a progress bar even when stderr is not a terminal")
	progressOn := func() bool { return showProgress || isTerminal(os.Stderr) }
	root.AddCommand(shVolumeCmd(f), shBucketCmd(f), shKeyCmd(f, progressOn), shFsCmd(f))
	return root
}

func shVolumeCmd(f *connFlags) *cobra.Command {
	cmd := &cobra.Command{Use: "volume", Short: "Create, inspect, list and delete volumes"}
	var owner, prefix string
	create := &cobra.Command{
		Use: "create /volume", Short: "Create a volume",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthVolume, func(ctx context.Context, c *client.Client, p objPath) error {
				v, err := c.CreateVolume(ctx, p.Volume, owner)
				if err != nil {
					return err
				}
				return printVolumes(f, cmd.OutOrStdout(), []client.Volume{v}, true)
			})
		}),
	}
	create.Flags().StringVar(&owner, "owner", os.Getenv("USER"), "owner of the volume")
	info := &cobra.Command{
		Use: "info /volume", Short: "Show a volume",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthVolume, func(ctx context.Context, c *client.Client, p objPath) error {
				v, err := c.VolumeInfo(ctx, p.Volume)
				if err != nil {
					return err
				}
				return printVolumes(f, cmd.OutOrStdout(), []client.Volume{v}, true)
			})
		}),
	}
	list := &cobra.Command{
		Use: "list [/]", Aliases: []string{"ls"}, Short: "List volumes",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if len(args) > 1 || len(args) == 1 && args[0] != "/" {
				return usagef("volume list takes no path or \"/\", got %q", args)
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			vs, err := c.ListVolumes(cmd.Context(), client.ListOptions{Prefix: prefix})
			if err != nil {
				return err
			}
			return printVolumes(f, cmd.OutOrStdout(), vs, false)
		}),
	}
	list.Flags().StringVar(&prefix, "prefix", "", "only volumes starting with this")
	del := &cobra.Command{
		Use: "delete /volume", Aliases: []string{"rm"}, Short: "Delete an empty volume",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthVolume, func(ctx context.Context, c *client.Client, p objPath) error {
				if err := c.DeleteVolume(ctx, p.Volume); err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "deleted", p)
			})
		}),
	}
	cmd.AddCommand(create, info, list, del)
	cmd.AddCommand(aclCmds(f, depthVolume)...)
	return cmd
}

func shBucketCmd(f *connFlags) *cobra.Command {
	cmd := &cobra.Command{Use: "bucket", Short: "Create, inspect, list and delete buckets"}
	var layout, repl, prefix string
	create := &cobra.Command{
		Use: "create /volume/bucket", Short: "Create a bucket",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			l, err := client.ParseLayout(layout)
			if err != nil {
				return usagef("--layout: %v", err)
			}
			r, err := client.ParseReplication(repl)
			if err != nil {
				return usagef("--replication: %v", err)
			}
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				b, err := c.CreateBucket(ctx, p.Volume, p.Bucket, client.BucketOptions{Layout: l, Replication: r})
				if err != nil {
					return err
				}
				return printBuckets(f, cmd.OutOrStdout(), []client.Bucket{b}, true)
			})
		}),
	}
	create.Flags().StringVar(&layout, "layout", "object", "object (flat keys) or fs (directory tree)")
	create.Flags().StringVar(&repl, "replication", "3", "replication factor: 3 or 1")
	info := &cobra.Command{
		Use: "info /volume/bucket", Short: "Show a bucket",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				b, err := c.BucketInfo(ctx, p.Volume, p.Bucket)
				if err != nil {
					return err
				}
				return printBuckets(f, cmd.OutOrStdout(), []client.Bucket{b}, true)
			})
		}),
	}
	list := &cobra.Command{
		Use: "list /volume", Aliases: []string{"ls"}, Short: "List the buckets of a volume",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthVolume, func(ctx context.Context, c *client.Client, p objPath) error {
				bs, err := c.ListBuckets(ctx, p.Volume, client.ListOptions{Prefix: prefix})
				if err != nil {
					return err
				}
				return printBuckets(f, cmd.OutOrStdout(), bs, false)
			})
		}),
	}
	list.Flags().StringVar(&prefix, "prefix", "", "only buckets starting with this")
	del := &cobra.Command{
		Use: "delete /volume/bucket", Aliases: []string{"rm"}, Short: "Delete an empty bucket",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				if err := c.DeleteBucket(ctx, p.Volume, p.Bucket); err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "deleted", p)
			})
		}),
	}
	cmd.AddCommand(create, info, list, del)
	cmd.AddCommand(aclCmds(f, depthBucket)...)
	cmd.AddCommand(bucketPolicyCmds(f)...)
	return cmd
}

func shKeyCmd(f *connFlags, progressOn func() bool) *cobra.Command {
	cmd := &cobra.Command{Use: "key", Short: "Put, get, list, inspect, rename and delete keys"}
	var repl, pipeline string
	put := &cobra.Command{
		Use: "put /volume/bucket/key FILE", Short: `Write a key from FILE ("-" = stdin)`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 2, "/volume/bucket/key FILE"); err != nil {
				return err
			}
			r, err := client.ParseReplication(repl)
			if err != nil {
				return usagef("--replication: %v", err)
			}
			pl, err := client.ParsePipeline(pipeline)
			if err != nil {
				return usagef("--pipeline %q: want v1, v2 or auto", pipeline)
			}
			p, err := parsePath(args[0], depthKey)
			if err != nil {
				return err
			}
			var in io.Reader = os.Stdin
			size := int64(-1)
			if args[1] != "-" {
				fh, err := os.Open(args[1])
				if err != nil {
					return err
				}
				defer fh.Close()
				if st, err := fh.Stat(); err == nil && st.Mode().IsRegular() {
					size = st.Size()
				}
				in = fh
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			bar := newProgress(progressOn(), "put "+p.String(), size, "bytes")
			ki, err := c.PutKey(cmd.Context(), p.Volume, p.Bucket, p.Key, in, client.PutOptions{
				SizeHint: max(size, 0), Replication: r, Pipeline: pl, Progress: bar.set})
			bar.finish()
			if err != nil {
				return err
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), ki)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "put %s: %d bytes in %d block(s) via %s\n", p, ki.Size, len(ki.Blocks), ki.Pipeline)
			return nil
		}),
	}
	put.Flags().StringVar(&repl, "replication", "", "replication factor 3 or 1 (default: the bucket's)")
	put.Flags().StringVar(&pipeline, "pipeline", "auto", "write path: v1 (Raft), v2 (streaming chain) or auto (v1 below 4 MiB, else v2)")

	get := &cobra.Command{
		Use: "get /volume/bucket/key FILE", Short: `Read a key into FILE ("-" = stdout)`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 2, "/volume/bucket/key FILE"); err != nil {
				return err
			}
			return getKey(cmd, f, args[0], args[1], progressOn())
		}),
	}
	cat := &cobra.Command{
		Use: "cat /volume/bucket/key", Short: "Write a key to stdout",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "/volume/bucket/key"); err != nil {
				return err
			}
			return getKey(cmd, f, args[0], "-", false)
		}),
	}
	var prefix, delim, startAfter string
	var limit int
	ls := &cobra.Command{
		Use: "ls /volume/bucket", Aliases: []string{"list"}, Short: "List keys",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthBucket, func(ctx context.Context, c *client.Client, p objPath) error {
				if limit <= 0 {
					return usagef("--limit must be positive, got %d", limit)
				}
				type entry struct {
					Prefix string          `json:"prefix,omitempty"`
					Key    *client.KeyInfo `json:"key,omitempty"`
				}
				var out []entry
				truncated := false
				for e, err := range c.Keys(ctx, p.Volume, p.Bucket, client.ListKeysOptions{Prefix: prefix, Delimiter: delim, StartAfter: startAfter}) {
					if err != nil {
						return err
					}
					if len(out) == limit {
						truncated = true
						break
					}
					out = append(out, entry{Prefix: e.Prefix, Key: e.Key})
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), map[string]any{"entries": out, "truncated": truncated})
				}
				t := newTable(cmd.OutOrStdout(), "SIZE", "MODIFIED", "REPL", "NAME")
				for _, e := range out {
					if e.Key == nil {
						t.row("-", "-", "-", e.Prefix)
						continue
					}
					t.row(e.Key.Size, fmtTime(e.Key.Modified), e.Key.ReplicationName, e.Key.Name)
				}
				if err := t.flush(); err != nil {
					return err
				}
				if truncated {
					fmt.Fprintf(os.Stderr, "basalt: listing stopped at --limit %d entries\n", limit)
				}
				return nil
			})
		}),
	}
	ls.Flags().StringVar(&prefix, "prefix", "", "only keys starting with this")
	ls.Flags().StringVar(&delim, "delimiter", "", `group keys by the part up to this after the prefix (e.g. "/")`)
	ls.Flags().StringVar(&startAfter, "start-after", "", "only entries after this")
	ls.Flags().IntVar(&limit, "limit", 100000, "stop after this many entries")

	info := &cobra.Command{
		Use: "info /volume/bucket/key", Short: "Show a key: size, checksum, blocks and their replicas",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthKey, func(ctx context.Context, c *client.Client, p objPath) error {
				ki, err := c.StatKey(ctx, p.Volume, p.Bucket, p.Key)
				if err != nil {
					return err
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), ki)
				}
				w := cmd.OutOrStdout()
				fmt.Fprintf(w, "key:          %s\nsize:         %d (%s)\nreplication:  %s\nchecksum:     %s every %d bytes\ncreated:      %s\nmodified:     %s\nobject id:    %d\nblocks:       %d\n\n",
					p, ki.Size, fmtBytes(ki.Size), ki.ReplicationName, ki.ChecksumType, ki.BytesPerChecksum, fmtTime(ki.Created), fmtTime(ki.Modified), ki.ObjectID, len(ki.Blocks))
				t := newTable(w, "BLOCK", "CONTAINER/LOCAL", "OFFSET", "LENGTH", "PIPELINE", "STATE", "REPLICAS (nearest first)")
				for i, b := range ki.Blocks {
					var reps []string
					for _, r := range b.Replicas {
						reps = append(reps, fmt.Sprintf("dn%d %s %s", r.ID, r.Addr, r.Location))
					}
					t.row(i, fmt.Sprintf("%d/%d", b.ContainerID, b.LocalID), b.Offset, b.Length, b.PipelineID, b.ContainerState, strings.Join(reps, ", "))
				}
				return t.flush()
			})
		}),
	}
	var recursive bool
	rm := &cobra.Command{
		Use: "rm /volume/bucket/key", Aliases: []string{"delete"}, Short: "Delete a key",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			return withPath(f, args, depthKey, func(ctx context.Context, c *client.Client, p objPath) error {
				if err := c.DeleteKey(ctx, p.Volume, p.Bucket, p.Key, recursive); err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "deleted", p)
			})
		}),
	}
	rm.Flags().BoolVarP(&recursive, "recursive", "r", false, "fs buckets: delete a directory and everything under it")
	mv := &cobra.Command{
		Use: "mv /volume/bucket/key NEWKEY", Aliases: []string{"rename"}, Short: "Rename a key within its bucket",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 2, "/volume/bucket/key NEWKEY"); err != nil {
				return err
			}
			p, err := parsePath(args[0], depthKey)
			if err != nil {
				return err
			}
			newKey := args[1]
			// Accept the full path form too, within the same bucket.
			if strings.HasPrefix(newKey, "/") {
				np, err := parsePath(newKey, depthKey)
				if err != nil {
					return err
				}
				if np.Volume != p.Volume || np.Bucket != p.Bucket {
					return usagef("mv: %s is in another bucket than %s; keys are renamed within their bucket", np, p)
				}
				newKey = np.Key
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			if err := c.RenameKey(cmd.Context(), p.Volume, p.Bucket, p.Key, newKey); err != nil {
				return err
			}
			return printDone(f, cmd.OutOrStdout(), "renamed", objPath{p.Volume, p.Bucket, newKey})
		}),
	}
	cp := &cobra.Command{
		Use: "cp /volume/bucket/key /volume/bucket/newkey", Short: "Copy a key within its volume by sharing its blocks (no data moves)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 2, "/volume/bucket/key /volume/bucket/newkey"); err != nil {
				return err
			}
			p, err := parsePath(args[0], depthKey)
			if err != nil {
				return err
			}
			np, err := parsePath(args[1], depthKey)
			if err != nil {
				return err
			}
			if np.Volume != p.Volume {
				return usagef("cp: %s is in another volume than %s; keys are copied within their volume", np, p)
			}
			c, err := f.client(nil)
			if err != nil {
				return err
			}
			defer c.Close()
			if _, err := c.CopyKey(cmd.Context(), p.Volume, p.Bucket, p.Key, np.Bucket, np.Key, client.CopyOptions{}); err != nil {
				return err
			}
			return printDone(f, cmd.OutOrStdout(), "copied", np)
		}),
	}
	cmd.AddCommand(put, get, cat, ls, info, rm, mv, cp)
	cmd.AddCommand(aclCmds(f, depthKey)...)
	return cmd
}

// withPath parses the one path argument, connects and runs fn.
func withPath(f *connFlags, args []string, depth int, fn func(context.Context, *client.Client, objPath) error) error {
	what := [...]string{"", "/volume", "/volume/bucket", "/volume/bucket/key"}[depth]
	if err := exactArgs(args, 1, what); err != nil {
		return err
	}
	p, err := parsePath(args[0], depth)
	if err != nil {
		return err
	}
	c, err := f.client(nil)
	if err != nil {
		return err
	}
	defer c.Close()
	return fn(context.Background(), c, p)
}

func getKey(cmd *cobra.Command, f *connFlags, path, file string, bar bool) (err error) {
	p, err := parsePath(path, depthKey)
	if err != nil {
		return err
	}
	c, err := f.client(nil)
	if err != nil {
		return err
	}
	defer c.Close()
	r, err := c.GetKey(cmd.Context(), p.Volume, p.Bucket, p.Key)
	if err != nil {
		return err
	}
	defer r.Close()
	var out io.Writer = cmd.OutOrStdout()
	if file != "-" {
		// Write to a temporary file and rename, so a failed read never
		// leaves a truncated FILE behind.
		tmp, err := os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".basalt-*")
		if err != nil {
			return err
		}
		defer func() {
			if err != nil {
				tmp.Close()
				os.Remove(tmp.Name())
			}
		}()
		out = tmp
		defer func() {
			if err == nil {
				if err = tmp.Close(); err == nil {
					err = os.Rename(tmp.Name(), file)
				}
			}
		}()
	}
	pb := newProgress(bar && file != "-" || bar && !isTerminal(os.Stdout), "get "+p.String(), r.Size(), "bytes")
	n, err := r.WriteTo(progressWriter{out, pb})
	pb.finish()
	if err != nil {
		return err
	}
	if n != r.Size() {
		return errors.New("short read")
	}
	if f.json && file != "-" {
		return printJSON(cmd.OutOrStdout(), map[string]any{"key": p.String(), "file": file, "bytes": n})
	}
	return nil
}

type progressWriter struct {
	w io.Writer
	p *progress
}

func (pw progressWriter) Write(b []byte) (int, error) {
	n, err := pw.w.Write(b)
	pw.p.add(int64(n))
	return n, err
}

func printDone(f *connFlags, w io.Writer, what string, p objPath) error {
	if f.json {
		return printJSON(w, map[string]string{"result": what, "path": p.String()})
	}
	_, err := fmt.Fprintf(w, "%s %s\n", what, p)
	return err
}

func printVolumes(f *connFlags, w io.Writer, vs []client.Volume, single bool) error {
	if f.json {
		if single && len(vs) == 1 {
			return printJSON(w, vs[0])
		}
		return printJSON(w, vs)
	}
	t := newTable(w, "VOLUME", "OWNER", "CREATED")
	for _, v := range vs {
		t.row(v.Name, v.Owner, fmtTime(v.Created))
	}
	return t.flush()
}

func printBuckets(f *connFlags, w io.Writer, bs []client.Bucket, single bool) error {
	if f.json {
		if single && len(bs) == 1 {
			return printJSON(w, bs[0])
		}
		return printJSON(w, bs)
	}
	t := newTable(w, "VOLUME", "BUCKET", "LAYOUT", "REPLICATION", "ID", "CREATED")
	for _, b := range bs {
		t.row(b.Volume, b.Name, b.LayoutName, b.ReplicationName, b.ID, fmtTime(b.Created))
	}
	return t.flush()
}
