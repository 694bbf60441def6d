package main

// `basalt sh fs`: file-system commands on fs buckets (directories keyed by
// their parent: a directory mv or rm -r is one metadata operation whatever
// it holds), showing the same owners, groups and permissions as WebHDFS.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/user"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/webhdfs"
)

// fsEntry is one file or directory as `sh fs` prints it.
type fsEntry struct {
	Path        string    `json:"path"`
	Type        string    `json:"type"` // "file" or "dir"
	Size        uint64    `json:"size"`
	Owner       string    `json:"owner"`
	Group       string    `json:"group"`
	Permission  string    `json:"permission"` // octal, as WebHDFS
	Modified    time.Time `json:"modified"`
	Accessed    time.Time `json:"accessed,omitzero"`
	Replication string    `json:"replication,omitempty"`
	ObjectID    uint64    `json:"object_id,omitempty"`
	DirID       uint64    `json:"dir_id,omitempty"`
}

// parseFsPath parses /volume/bucket[/path] (the bucket's root when no path).
func parseFsPath(s string) (objPath, error) {
	t := strings.TrimRight(s, "/")
	if strings.Count(t, "/") <= 2 {
		p, err := parsePath(s, depthBucket)
		if err != nil {
			return objPath{}, usagef("path %q: want /volume/bucket[/path]", s)
		}
		return p, nil
	}
	p, err := parsePath(t, depthKey)
	if err != nil {
		return objPath{}, usagef("path %q: want /volume/bucket[/path]", s)
	}
	return p, nil
}

// fsLister turns file statuses into entries with the volume's defaults.
type fsLister struct {
	c        *client.Client
	defOwner string
}

func newFsLister(ctx context.Context, c *client.Client, volume string) *fsLister {
	l := &fsLister{c: c, defOwner: "basalt"}
	if v, err := c.VolumeInfo(ctx, volume); err == nil && v.Owner != "" {
		l.defOwner = v.Owner
	}
	return l
}

func (l *fsLister) entry(bucket objPath, s *client.FileStatus) fsEntry {
	e := fsEntry{Path: objPath{bucket.Volume, bucket.Bucket, s.Path}.String(), Type: "dir", Owner: l.defOwner,
		Group: "supergroup", Permission: "755", Modified: s.Modified, DirID: s.DirID}
	if !s.IsDir && s.File != nil {
		e.Type, e.Size, e.Permission = "file", s.File.Size, "644"
		e.Replication, e.ObjectID, e.Modified = s.File.ReplicationName, s.File.ObjectID, s.File.Modified
	}
	if a := webhdfs.Attrs(s); a != nil {
		if a.Owner != "" {
			e.Owner = a.Owner
		}
		if a.Group != "" {
			e.Group = a.Group
		}
		if a.Permission != nil {
			e.Permission = strconv.FormatUint(uint64(*a.Permission), 8)
		}
		if a.MtimeUnixMs != 0 {
			e.Modified = time.UnixMilli(a.MtimeUnixMs).UTC()
		}
		if a.AtimeUnixMs != 0 {
			e.Accessed = time.UnixMilli(a.AtimeUnixMs).UTC()
		}
	}
	return e
}

// stat returns p's entry; a bucket's root carries the bucket's own
// attributes.
func (l *fsLister) stat(ctx context.Context, p objPath) (fsEntry, *client.FileStatus, error) {
	s, err := l.c.GetFileStatus(ctx, p.Volume, p.Bucket, p.Key)
	if err != nil {
		return fsEntry{}, nil, err
	}
	if p.Key == "" {
		if b, err := l.c.BucketInfo(ctx, p.Volume, p.Bucket); err == nil {
			s.Attrs = b.Attrs
		}
	}
	return l.entry(p, &s), &s, nil
}

// walk calls fn for each child of directory p in name order, one page at a
// time, descending into directories when recursive (depth first, as
// `hadoop fs -ls -R`).
func (l *fsLister) walk(ctx context.Context, p objPath, recursive bool, fn func(fsEntry) error) error {
	after := ""
	for {
		pg, err := l.c.ListStatus(ctx, p.Volume, p.Bucket, p.Key, after, 1000)
		if err != nil {
			return err
		}
		for i := range pg.Entries {
			s := &pg.Entries[i]
			if err := fn(l.entry(p, s)); err != nil {
				return err
			}
			if recursive && s.IsDir {
				if err := l.walk(ctx, objPath{p.Volume, p.Bucket, s.Path}, true, fn); err != nil {
					return err
				}
			}
			after = path.Base(s.Path)
		}
		if !pg.Truncated || len(pg.Entries) == 0 {
			return nil
		}
	}
}

// modeString is the permission as `ls -l` and `hadoop fs -ls` print it.
func modeString(e fsEntry) string {
	p, err := strconv.ParseUint(e.Permission, 8, 32)
	if err != nil {
		return "?" + e.Permission
	}
	b := []byte("-rwxrwxrwx")
	if e.Type == "dir" {
		b[0] = 'd'
	}
	for i := 0; i < 9; i++ {
		if p&(1<<(8-i)) == 0 {
			b[i+1] = '-'
		}
	}
	if p&0o1000 != 0 {
		if b[9] == 'x' {
			b[9] = 't'
		} else {
			b[9] = 'T'
		}
	}
	return string(b)
}

func printFsEntries(f *connFlags, w io.Writer, es []fsEntry) error {
	if f.json {
		if es == nil {
			es = []fsEntry{}
		}
		return printJSON(w, map[string]any{"entries": es})
	}
	t := newTable(w, "PERMISSION", "OWNER", "GROUP", "SIZE", "MODIFIED", "REPL", "PATH")
	for _, e := range es {
		repl := e.Replication
		if repl == "" {
			repl = "-"
		}
		t.row(modeString(e), e.Owner, e.Group, e.Size, fmtTime(e.Modified), repl, e.Path)
	}
	return t.flush()
}

// currentUser is the owner `sh fs mkdir` records (as `hadoop fs -mkdir`
// records the caller).
func currentUser() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	return "basalt"
}

func shFsCmd(f *connFlags) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fs",
		Short: "File-system commands on fs buckets: ls, mkdir, mv, rm, stat",
		Long: `File-system commands on buckets with the FS layout (create one with
"basalt sh bucket create /vol/b --layout fs"). Paths are
/volume/bucket[/path]; owners, groups and permissions are those WebHDFS
shows. A directory mv or rm -r is one metadata operation, whatever the
directory holds.

Examples:
  basalt sh fs mkdir -p /vol1/fsb/a/b
  basalt sh fs ls -R /vol1/fsb
  basalt sh fs mv /vol1/fsb/a /vol1/fsb/c
  basalt sh fs stat /vol1/fsb/c/b --json
  basalt sh fs rm -r /vol1/fsb/c
` + exitCodesHelp,
	}
	var recursive bool
	ls := &cobra.Command{
		Use: "ls [-R] /volume/bucket[/path]", Short: "List a directory (or show a file)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "/volume/bucket[/path]"); err != nil {
				return err
			}
			p, err := parseFsPath(args[0])
			if err != nil {
				return err
			}
			return withClient(f, func(ctx context.Context, c *client.Client) error {
				l := newFsLister(ctx, c, p.Volume)
				self, s, err := l.stat(ctx, p)
				if err != nil {
					return err
				}
				if !s.IsDir {
					return printFsEntries(f, cmd.OutOrStdout(), []fsEntry{self})
				}
				var es []fsEntry
				if err := l.walk(ctx, p, recursive, func(e fsEntry) error { es = append(es, e); return nil }); err != nil {
					return err
				}
				return printFsEntries(f, cmd.OutOrStdout(), es)
			})
		}),
	}
	ls.Flags().BoolVarP(&recursive, "recursive", "R", false, "list subdirectories too")

	var parents bool
	mkdir := &cobra.Command{
		Use: "mkdir [-p] /volume/bucket/path", Short: "Make a directory (owner: you, permission 755)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "/volume/bucket/path"); err != nil {
				return err
			}
			p, err := parsePath(strings.TrimRight(args[0], "/"), depthKey)
			if err != nil {
				return err
			}
			return withClient(f, func(ctx context.Context, c *client.Client) error {
				if !parents {
					// As mkdir(1): the parent must exist, the path must not.
					if s, err := c.GetFileStatus(ctx, p.Volume, p.Bucket, p.Key); err == nil {
						what := "a file"
						if s.IsDir {
							what = "a directory"
						}
						return fmt.Errorf("mkdir %s: it exists, as %s: %w", p, what, client.ErrExists)
					}
					if dir := path.Dir(p.Key); dir != "." {
						s, err := c.GetFileStatus(ctx, p.Volume, p.Bucket, dir)
						if err != nil {
							return fmt.Errorf("mkdir %s (without -p the parent must exist): %w", p, err)
						}
						if !s.IsDir {
							return fmt.Errorf("mkdir %s: %s is a file", p, objPath{p.Volume, p.Bucket, dir})
						}
					}
				}
				perm := uint32(0o755)
				if _, err := c.CreateDirectoryAttrs(ctx, p.Volume, p.Bucket, p.Key, &metapb.FileAttrs{Owner: currentUser(), Permission: &perm}); err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "created", p)
			})
		}),
	}
	mkdir.Flags().BoolVarP(&parents, "parents", "p", false, "make missing parents; an existing directory is no error")

	mv := &cobra.Command{
		Use: "mv /volume/bucket/src /volume/bucket/dst", Short: "Move a file or directory within its bucket (one metadata operation)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 2, "/volume/bucket/src /volume/bucket/dst"); err != nil {
				return err
			}
			src, err := parsePath(strings.TrimRight(args[0], "/"), depthKey)
			if err != nil {
				return err
			}
			dst, err := parsePath(strings.TrimRight(args[1], "/"), depthKey)
			if err != nil {
				return err
			}
			if src.Volume != dst.Volume || src.Bucket != dst.Bucket {
				return usagef("mv: %s is in another bucket than %s; files and directories move within their bucket", dst, src)
			}
			return withClient(f, func(ctx context.Context, c *client.Client) error {
				// As mv(1): onto an existing directory moves into it.
				if s, err := c.GetFileStatus(ctx, dst.Volume, dst.Bucket, dst.Key); err == nil && s.IsDir {
					dst.Key += "/" + path.Base(src.Key)
				}
				if err := c.RenameKey(ctx, src.Volume, src.Bucket, src.Key, dst.Key); err != nil {
					return err
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), map[string]string{"result": "renamed", "path": src.String(), "to": dst.String()})
				}
				_, err := fmt.Fprintf(cmd.OutOrStdout(), "renamed %s to %s\n", src, dst)
				return err
			})
		}),
	}

	var rmRecursive bool
	rm := &cobra.Command{
		Use: "rm [-r] /volume/bucket/path", Short: "Delete a file, or a directory (-r: with everything under it, one metadata operation)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "/volume/bucket/path"); err != nil {
				return err
			}
			p, err := parsePath(strings.TrimRight(args[0], "/"), depthKey)
			if err != nil {
				return usagef("rm: %q: want /volume/bucket/path (delete a bucket with \"sh bucket delete\")", args[0])
			}
			return withClient(f, func(ctx context.Context, c *client.Client) error {
				err := c.DeleteKey(ctx, p.Volume, p.Bucket, p.Key, rmRecursive)
				if errors.Is(err, client.ErrNotEmpty) || (errors.Is(err, client.ErrPrecondition) && strings.Contains(err.Error(), "not empty")) {
					return fmt.Errorf("rm %s: the directory is not empty (use -r): %w", p, err)
				}
				if err != nil {
					return err
				}
				return printDone(f, cmd.OutOrStdout(), "deleted", p)
			})
		}),
	}
	rm.Flags().BoolVarP(&rmRecursive, "recursive", "r", false, "delete a directory and everything under it")

	stat := &cobra.Command{
		Use: "stat /volume/bucket[/path]", Short: "Show a file or directory: type, size, owner, group, permission, times",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "/volume/bucket[/path]"); err != nil {
				return err
			}
			p, err := parseFsPath(args[0])
			if err != nil {
				return err
			}
			return withClient(f, func(ctx context.Context, c *client.Client) error {
				e, _, err := newFsLister(ctx, c, p.Volume).stat(ctx, p)
				if err != nil {
					return err
				}
				if f.json {
					return printJSON(cmd.OutOrStdout(), e)
				}
				w := cmd.OutOrStdout()
				fmt.Fprintf(w, "path:         %s\ntype:         %s\nsize:         %d (%s)\nowner:        %s\ngroup:        %s\npermission:   %s (%s)\nmodified:     %s\n",
					e.Path, e.Type, e.Size, fmtBytes(e.Size), e.Owner, e.Group, e.Permission, modeString(e), fmtTime(e.Modified))
				if !e.Accessed.IsZero() {
					fmt.Fprintf(w, "accessed:     %s\n", fmtTime(e.Accessed))
				}
				if e.Type == "file" {
					fmt.Fprintf(w, "replication:  %s\nobject id:    %d\n", e.Replication, e.ObjectID)
				} else {
					fmt.Fprintf(w, "dir id:       %d\n", e.DirID)
				}
				return nil
			})
		}),
	}
	cmd.AddCommand(ls, mkdir, mv, rm, stat)
	return cmd
}

// withClient connects and runs fn.
func withClient(f *connFlags, fn func(context.Context, *client.Client) error) error {
	c, err := f.client(nil)
	if err != nil {
		return err
	}
	defer c.Close()
	return fn(context.Background(), c)
}
