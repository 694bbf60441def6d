package webhdfs

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"path"
	"regexp"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func booleanResult(w http.ResponseWriter, ok bool) {
	writeJSON(w, http.StatusOK, map[string]bool{"boolean": ok})
}

func (g *Gateway) getFileStatus(q *request) error {
	st, _, err := g.stat(q.ctx, q.path)
	if err != nil {
		return err
	}
	writeJSON(q.w, http.StatusOK, map[string]fileStatus{"FileStatus": st})
	return nil
}

// page is one page of a directory's children, whatever its depth.
func (g *Gateway) page(ctx context.Context, p fsPath, after string, owner string) ([]fileStatus, bool, error) {
	var out []fileStatus
	switch p.depth() {
	case 0:
		vs, err := g.cl.ListVolumes(ctx, client.ListOptions{StartAfter: after, PageSize: listPage + 1, Limit: listPage + 1})
		if err != nil {
			return nil, false, toRemote(p, err)
		}
		for _, v := range vs[:min(len(vs), listPage)] {
			out = append(out, dirStatus(v.Name, v.Owner, 0, v.Created, v.Attrs))
		}
		return out, len(vs) > listPage, nil
	case 1:
		bs, err := g.cl.ListBuckets(ctx, p.volume, client.ListOptions{StartAfter: after, PageSize: listPage + 1, Limit: listPage + 1})
		if err != nil {
			if errors.Is(err, client.ErrNotFound) {
				return nil, false, notFound(p)
			}
			return nil, false, toRemote(p, err)
		}
		for _, b := range bs[:min(len(bs), listPage)] {
			out = append(out, dirStatus(b.Name, owner, b.ID, b.Created, b.Attrs))
		}
		return out, len(bs) > listPage, nil
	}
	pg, err := g.cl.ListStatus(ctx, p.volume, p.bucket, p.key, after, listPage)
	if err != nil {
		switch {
		case errors.Is(err, client.ErrNotFound):
			return nil, false, notFound(p)
		case errors.Is(err, client.ErrPrecondition) && isNotDirectory(err):
			// A file: HDFS lists it as itself.
			return nil, false, errIsFile
		case errors.Is(err, client.ErrPrecondition):
			return nil, false, remote(classIO, "%s: %v (WebHDFS serves buckets with the FS layout)", p, err)
		}
		return nil, false, toRemote(p, err)
	}
	for i := range pg.Entries {
		e := &pg.Entries[i]
		out = append(out, g.entryStatus(path.Base(e.Path), e, owner))
	}
	return out, pg.Truncated, nil
}

var errIsFile = errors.New("listing a file")

// listStatus streams the whole listing page by page, so a huge directory
// costs one page of memory. An error after the first page aborts the
// response (the client sees a broken body, not a wrong listing).
func (g *Gateway) listStatus(q *request) error {
	owner := g.volumeOwner(q.ctx, q.path)
	first, more, err := g.page(q.ctx, q.path, "", owner)
	if err == errIsFile {
		st, _, err := g.stat(q.ctx, q.path)
		if err != nil {
			return err
		}
		writeJSON(q.w, http.StatusOK, map[string]any{"FileStatuses": map[string]any{"FileStatus": []fileStatus{st}}})
		return nil
	}
	if err != nil {
		return err
	}
	if first == nil {
		// An empty directory, or a path whose depth lists by name only:
		// make sure it exists.
		if _, _, err := g.stat(q.ctx, q.path); err != nil {
			return err
		}
	}
	w := q.w
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write([]byte(`{"FileStatuses":{"FileStatus":[`))
	n := 0
	emit := func(sts []fileStatus) {
		for _, st := range sts {
			b, _ := json.Marshal(st)
			if n > 0 {
				w.Write([]byte{','})
			}
			w.Write(b)
			n++
		}
	}
	emit(first)
	for more {
		after := first[len(first)-1].PathSuffix
		first, more, err = g.page(q.ctx, q.path, after, owner)
		if err != nil || len(first) == 0 {
			if err != nil {
				g.cfg.Logger.Warn("webhdfs: listing failed after the first page", "path", q.path.String(), "err", err)
				panic(http.ErrAbortHandler)
			}
			break
		}
		emit(first)
	}
	w.Write([]byte(`]}}`))
	return nil
}

// listStatusBatch returns one page after startAfter. remainingEntries is
// 1 when more follow (the count is not known without reading them; the
// client only checks it for > 0) and 0 at the end.
func (g *Gateway) listStatusBatch(q *request) error {
	owner := g.volumeOwner(q.ctx, q.path)
	sts, more, err := g.page(q.ctx, q.path, q.param("startAfter"), owner)
	if err == errIsFile {
		var st fileStatus
		st, _, err = g.stat(q.ctx, q.path)
		sts, more = []fileStatus{st}, false
	}
	if err != nil {
		return err
	}
	if sts == nil {
		if _, _, err := g.stat(q.ctx, q.path); err != nil {
			return err
		}
		sts = []fileStatus{}
	}
	remaining := 0
	if more {
		remaining = 1
	}
	writeJSON(q.w, http.StatusOK, map[string]any{"DirectoryListing": map[string]any{
		"partialListing":   map[string]any{"FileStatuses": map[string]any{"FileStatus": sts}},
		"remainingEntries": remaining,
	}})
	return nil
}

// contentSummary walks the tree under the path, page by page, visiting at
// most maxSummaryEntries entries.
func (g *Gateway) contentSummary(q *request) error {
	var files, dirs, length, consumed int64
	visited := 0
	st, _, err := g.stat(q.ctx, q.path)
	if err != nil {
		return err
	}
	if st.Type == "FILE" {
		files, length, consumed = 1, int64(st.Length), int64(st.Length)*int64(max(st.Replication, 1))
	} else {
		dirs = 1
		stack := []fsPath{q.path}
		for len(stack) > 0 {
			d := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			if d.depth() == 2 {
				b, err := g.cl.BucketInfo(q.ctx, d.volume, d.bucket)
				if err == nil && b.Layout != client.LayoutFS {
					continue // object buckets have no directory tree to walk
				}
			}
			after := ""
			for {
				sts, more, err := g.page(q.ctx, d, after, "")
				if err != nil {
					return err
				}
				for _, s := range sts {
					visited++
					if visited > maxSummaryEntries {
						return remote(classIO, "content summary of %s: more than %d entries", q.path, maxSummaryEntries)
					}
					if s.Type == "DIRECTORY" {
						dirs++
						stack = append(stack, d.child(s.PathSuffix))
					} else {
						files++
						length += int64(s.Length)
						consumed += int64(s.Length) * int64(max(s.Replication, 1))
					}
				}
				if !more || len(sts) == 0 {
					break
				}
				after = sts[len(sts)-1].PathSuffix
			}
		}
	}
	writeJSON(q.w, http.StatusOK, map[string]any{"ContentSummary": map[string]any{
		"directoryCount": dirs, "fileCount": files, "length": length, "quota": -1,
		"spaceConsumed": consumed, "spaceQuota": -1, "typeQuota": map[string]any{},
	}})
	return nil
}

func (g *Gateway) homeDirectory(q *request) error {
	writeJSON(q.w, http.StatusOK, map[string]string{"Path": "/user/" + q.user})
	return nil
}

// trashRoot: inside a bucket the trash is the bucket's own (a rename
// cannot leave a bucket), as Ozone's ofs does.
func (g *Gateway) trashRoot(q *request) error {
	p := "/user/" + q.user + "/.Trash"
	if q.path.depth() >= 2 {
		p = "/" + q.path.volume + "/" + q.path.bucket + "/.Trash/" + q.user
	}
	writeJSON(q.w, http.StatusOK, map[string]string{"Path": p})
	return nil
}

func (g *Gateway) serverDefaults(q *request) error {
	writeJSON(q.w, http.StatusOK, map[string]any{"FsServerDefaults": map[string]any{
		"blockSize": g.cfg.BlockSize, "bytesPerChecksum": client.DefaultBytesPerChecksum, "writePacketSize": 1 << 20,
		"replication": 3, "fileBufferSize": 4096, "encryptDataTransfer": false, "trashInterval": 0,
		"checksumType": 2, // DataChecksum.Type.CRC32C
	}})
	return nil
}

var fsActionRE = regexp.MustCompile(`^[r-][w-][x-]$`)

// checkAccess: nothing is enforced yet, so every action is allowed on an
// existing path.
func (g *Gateway) checkAccess(q *request) error {
	a := q.param("fsaction")
	if a == "" {
		a = "---"
	}
	if !fsActionRE.MatchString(a) {
		return badParam("Invalid value for webhdfs parameter \"fsaction\": %q", a)
	}
	if _, _, err := g.stat(q.ctx, q.path); err != nil {
		return err
	}
	q.w.WriteHeader(http.StatusOK)
	return nil
}

// mkdirs creates the directory and its parents; volumes and buckets (FS
// layout) on the way are created too.
func (g *Gateway) mkdirs(q *request) error {
	p := q.path
	if p.depth() == 0 {
		booleanResult(q.w, true)
		return nil
	}
	attrs, err := newAttrs(q, 0o755)
	if err != nil {
		return err
	}
	if err := g.ensureBucket(q.ctx, p, attrs); err != nil {
		return err
	}
	if p.depth() == 3 {
		// A file at the path itself is FileAlreadyExistsException; one
		// above it ParentNotDirectoryException.
		if e, err := g.cl.GetFileStatus(q.ctx, p.volume, p.bucket, p.key); err == nil && !e.IsDir {
			return remote(classAlreadyExists, "Path is not a directory: %s", p)
		}
		if _, err := g.cl.CreateDirectoryAttrs(q.ctx, p.volume, p.bucket, p.key, attrs); err != nil {
			return toRemote(p, err)
		}
	}
	booleanResult(q.w, true)
	return nil
}

// ensureBucket creates p's volume and, for depth 2 and more, its bucket
// (FS layout) if missing, as ofs does. Paths inside a bucket need the FS
// layout. What it creates gets attrs (its owner and permission) when it
// is p itself; as a parent on the way, owner write and search permission
// are added, as HDFS's mkdirs gives implicit parents.
func (g *Gateway) ensureBucket(ctx context.Context, p fsPath, attrs *metapb.FileAttrs) error {
	// Reads first: creating is a Raft round even when the name exists, and
	// this runs on every CREATE.
	if p.depth() >= 2 {
		b, err := g.cl.BucketInfo(ctx, p.volume, p.bucket)
		if err == nil {
			if b.Layout != client.LayoutFS && p.depth() == 3 {
				return remote(classIO, "%s: bucket /%s/%s has layout %v; WebHDFS serves FS buckets", p, p.volume, p.bucket, b.Layout)
			}
			return nil
		}
		if !errors.Is(err, client.ErrNotFound) {
			return toRemote(p, err)
		}
	} else if _, err := g.cl.VolumeInfo(ctx, p.volume); err == nil {
		return nil
	}
	parent := proto.Clone(attrs).(*metapb.FileAttrs)
	if parent.Permission != nil {
		*parent.Permission |= 0o300
	}
	va, ba := parent, parent
	if p.depth() == 1 {
		va = attrs
	} else if p.depth() == 2 {
		ba = attrs
	}
	if _, err := g.cl.CreateVolumeAttrs(ctx, p.volume, va); err != nil && !errors.Is(err, client.ErrExists) {
		return toRemote(p, err)
	}
	if p.depth() < 2 {
		return nil
	}
	_, err := g.cl.CreateBucket(ctx, p.volume, p.bucket, client.BucketOptions{Layout: client.LayoutFS, Attrs: ba})
	if errors.Is(err, client.ErrExists) {
		// made meanwhile, maybe with another layout
		return g.ensureBucket(ctx, p, attrs)
	}
	if err != nil {
		return toRemote(p, err)
	}
	return nil
}

// destination parses RENAME's destination (an absolute path, possibly a
// full URI's path).
func destination(q *request) (fsPath, error) {
	d := q.param("destination")
	if d == "" {
		return fsPath{}, badParam("RENAME needs the \"destination\" parameter")
	}
	if u, err := url.Parse(d); err == nil && u.Scheme != "" {
		d = u.Path
	}
	return parsePath(d)
}

// rename: a file or directory moves within its bucket with one metadata
// operation (a directory is one row, whatever it holds). Without
// renameoptions it follows FileSystem.rename: a destination that is a
// directory receives the source inside it, and failures answer false.
func (g *Gateway) rename(q *request) error {
	src := q.path
	dst, err := destination(q)
	if err != nil {
		return err
	}
	opts := q.param("renameoptions")
	rename2 := opts != ""
	overwrite := false
	for _, o := range strings.Split(opts, ",") {
		switch strings.ToUpper(strings.TrimSpace(o)) {
		case "", "NONE":
		case "OVERWRITE":
			overwrite = true
		case "TO_TRASH":
		default:
			return badParam("Invalid value for webhdfs parameter \"renameoptions\": %q", opts)
		}
	}
	if src.depth() < 3 || dst.depth() < 3 {
		if !rename2 {
			booleanResult(q.w, false)
			return nil
		}
		return remote(classIO, "rename %s to %s: volumes and buckets cannot be renamed, nor files made volumes or buckets", src, dst)
	}
	if src.volume != dst.volume || src.bucket != dst.bucket {
		if !rename2 {
			booleanResult(q.w, false)
			return nil
		}
		return remote(classIO, "rename %s to %s: a rename cannot leave its bucket", src, dst)
	}
	if !rename2 {
		ok, err := g.renameOld(q.ctx, src, dst)
		if err != nil {
			return err
		}
		booleanResult(q.w, ok)
		return nil
	}
	if _, err := g.lookup(q.ctx, src); err != nil {
		return err
	}
	if dst.key == src.key {
		return remote(classAlreadyExists, "The source %s and destination %s are the same", src, dst)
	}
	// With OVERWRITE the namespace replaces an existing destination (a
	// file by a file, an empty directory by a directory) in the same
	// apply as the move: no moment without either.
	if overwrite {
		err = g.cl.RenameKeyOverwrite(q.ctx, src.volume, src.bucket, src.key, dst.key)
	} else {
		err = g.cl.RenameKey(q.ctx, src.volume, src.bucket, src.key, dst.key)
	}
	if err != nil {
		switch {
		case errors.Is(err, client.ErrNotFound):
			return remote(classFileNotFound, "rename destination parent of %s not found: %v", dst, err)
		case errors.Is(err, client.ErrExists):
			return remote(classAlreadyExists, "rename destination %s already exists", dst)
		case errors.Is(err, client.ErrNotEmpty):
			return remote(classIO, "rename destination directory is not empty: %s", dst)
		case errors.Is(err, client.ErrPrecondition) && !isNotDirectory(err):
			return remote(classIO, "rename %s to %s: %v", src, dst, err)
		}
		return toRemote(src, err)
	}
	booleanResult(q.w, true)
	return nil
}

// renameOld is FileSystem.rename(src, dst) as HDFS does it: false, not an
// exception, when the source is missing, the destination exists as a file,
// its parent is missing, or the source would move into itself.
func (g *Gateway) renameOld(ctx context.Context, src, dst fsPath) (bool, error) {
	if _, err := g.lookup(ctx, src); err != nil {
		var re *remoteError
		if errors.As(err, &re) && re.class == classFileNotFound {
			return false, nil
		}
		return false, err
	}
	if dst.key == src.key {
		// Renaming onto itself: true for a file, as HDFS; a directory
		// would move into itself.
		e, _ := g.lookup(ctx, src)
		return !e.IsDir, nil
	}
	if de, err := g.cl.GetFileStatus(ctx, dst.volume, dst.bucket, dst.key); err == nil {
		if !de.IsDir {
			return false, nil
		}
		dst = dst.child(src.name())
		if dst.key == src.key {
			return true, nil // already there (mv a dir/a into dir): HDFS returns true
		}
	}
	if strings.HasPrefix(dst.key+"/", src.key+"/") {
		return false, nil
	}
	if err := g.cl.RenameKey(ctx, src.volume, src.bucket, src.key, dst.key); err != nil {
		switch {
		case errors.Is(err, client.ErrNotFound), errors.Is(err, client.ErrExists),
			errors.Is(err, client.ErrInvalidArgument), errors.Is(err, client.ErrPrecondition):
			return false, nil
		}
		return false, toRemote(src, err)
	}
	return true, nil
}

// delete removes a file, or a directory with everything under it when
// recursive (one metadata operation: the children are reclaimed in the
// background). A missing path answers false, as HDFS. Deleting a bucket
// or volume recursively is one operation per child, not atomic.
func (g *Gateway) delete(q *request) error {
	p := q.path
	recursive, err := boolParam(q, "recursive", false)
	if err != nil {
		return err
	}
	switch p.depth() {
	case 0:
		booleanResult(q.w, false) // HDFS never deletes the root
		return nil
	case 1:
		err = g.deleteVolume(q.ctx, p, recursive)
	case 2:
		err = g.deleteBucket(q.ctx, p, recursive)
	default:
		err = g.cl.DeleteKey(q.ctx, p.volume, p.bucket, p.key, recursive)
		if errors.Is(err, client.ErrPrecondition) && isNotDirectory(err) {
			err = notFound(p)
		}
	}
	if err != nil {
		re := toRemote(p, err)
		if re.class == classFileNotFound {
			booleanResult(q.w, false)
			return nil
		}
		if re.class == classIO && errors.Is(err, client.ErrPrecondition) {
			// a bucket or volume that is not empty
			re = remote(classNotEmpty, "%s is non empty: %v", p, err)
		}
		return re
	}
	booleanResult(q.w, true)
	return nil
}

func (g *Gateway) deleteBucket(ctx context.Context, p fsPath, recursive bool) error {
	if recursive {
		for {
			pg, err := g.cl.ListStatus(ctx, p.volume, p.bucket, "", "", listPage)
			if err != nil {
				if errors.Is(err, client.ErrPrecondition) {
					return remote(classIO, "%s: recursive delete needs an FS bucket: %v", p, err)
				}
				return err
			}
			for _, e := range pg.Entries {
				if err := g.cl.DeleteKey(ctx, p.volume, p.bucket, e.Path, true); err != nil && !errors.Is(err, client.ErrNotFound) {
					return err
				}
			}
			if !pg.Truncated {
				break
			}
		}
	}
	err := g.cl.DeleteBucket(ctx, p.volume, p.bucket)
	// The namespace reclaims the children of deleted directories in the
	// background, and refuses to delete a bucket that still holds them:
	// wait for that (bounded) when the bucket's root is empty.
	for wait := 50 * time.Millisecond; recursive && err != nil && wait < 20*time.Second && (errors.Is(err, client.ErrPrecondition) || errors.Is(err, client.ErrNotEmpty)); wait *= 2 {
		pg, lerr := g.cl.ListStatus(ctx, p.volume, p.bucket, "", "", 1)
		if lerr != nil || len(pg.Entries) > 0 {
			break
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
		err = g.cl.DeleteBucket(ctx, p.volume, p.bucket)
	}
	if errors.Is(err, client.ErrPrecondition) || errors.Is(err, client.ErrNotEmpty) {
		return remote(classNotEmpty, "%s is non empty: %v", p, err)
	}
	return err
}

func (g *Gateway) deleteVolume(ctx context.Context, p fsPath, recursive bool) error {
	if recursive {
		bs, err := g.cl.ListBuckets(ctx, p.volume, client.ListOptions{Limit: maxDeleteBuckets})
		if err != nil {
			return err
		}
		for _, b := range bs {
			if err := g.deleteBucket(ctx, p.child(b.Name), true); err != nil && !errors.Is(err, client.ErrNotFound) {
				return err
			}
		}
	}
	err := g.cl.DeleteVolume(ctx, p.volume)
	if errors.Is(err, client.ErrPrecondition) || errors.Is(err, client.ErrNotEmpty) {
		return remote(classNotEmpty, "%s is non empty: %v", p, err)
	}
	return err
}

func boolParam(q *request, name string, def bool) (bool, error) {
	v := q.param(name)
	if v == "" {
		return def, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, badParam("Invalid value for webhdfs parameter %q: %q", name, v)
	}
	return b, nil
}

var permRE = regexp.MustCompile(`^[0-1]?[0-7]{3}$`)

// permParam is a permission in octal; "" if absent.
func permParam(q *request, name string) (string, error) {
	v := q.param(name)
	if v == "" {
		return "", nil
	}
	if !permRE.MatchString(v) {
		return "", badParam("Invalid value for webhdfs parameter %q: %q (want octal, e.g. 644)", name, v)
	}
	return strings.TrimLeft(v, "0") + strings.Repeat("0", max(0, 3-len(strings.TrimLeft(v, "0")))), nil
}

// permBits is a permission parameter as mode bits; def if absent.
func permBits(q *request, name string, def uint32) (uint32, error) {
	v, err := permParam(q, name)
	if err != nil || v == "" {
		return def, err
	}
	n, err := strconv.ParseUint(v, 8, 32)
	if err != nil {
		return 0, badParam("Invalid value for webhdfs parameter %q: %q", name, v)
	}
	return uint32(n), nil
}

// newAttrs are the attributes MKDIRS and CREATE give what they create:
// the caller as owner and the permission parameter (which the client has
// already masked with its umask), else def.
func newAttrs(q *request, def uint32) (*metapb.FileAttrs, error) {
	perm, err := permBits(q, "permission", def)
	if err != nil {
		return nil, err
	}
	return &metapb.FileAttrs{Owner: q.user, Permission: &perm}, nil
}

func (g *Gateway) setPermission(q *request) error {
	perm, err := permBits(q, "permission", 0o755) // HDFS's default for the parameter
	if err != nil {
		return err
	}
	if err := g.setFileAttrs(q.ctx, q.path, "SETPERMISSION", &metapb.FileAttrs{Permission: &perm}); err != nil {
		return err
	}
	q.w.WriteHeader(http.StatusOK)
	return nil
}

func (g *Gateway) setOwner(q *request) error {
	owner, group := q.param("owner"), q.param("group")
	if owner == "" && group == "" {
		return badParam("SETOWNER needs \"owner\" or \"group\"")
	}
	if err := g.setFileAttrs(q.ctx, q.path, "SETOWNER", &metapb.FileAttrs{Owner: owner, Group: group}); err != nil {
		return err
	}
	q.w.WriteHeader(http.StatusOK)
	return nil
}

// setTimes: -1 (or absent) leaves a time as it is, as HDFS.
func (g *Gateway) setTimes(q *request) error {
	a := &metapb.FileAttrs{}
	for name, dst := range map[string]*int64{"modificationtime": &a.MtimeUnixMs, "accesstime": &a.AtimeUnixMs} {
		v := q.param(name)
		if v == "" || v == "-1" {
			continue
		}
		t, err := strconv.ParseInt(v, 10, 64)
		if err != nil || t < 0 {
			return badParam("Invalid value for webhdfs parameter %q: %q", name, v)
		}
		if t == 0 {
			t = 1 // 0 means "unchanged" to the namespace; the epoch's first millisecond is as old
		}
		*dst = t
	}
	if a.MtimeUnixMs == 0 && a.AtimeUnixMs == 0 {
		// Nothing to change; the path must still exist.
		if _, _, err := g.stat(q.ctx, q.path); err != nil {
			return err
		}
	} else if err := g.setFileAttrs(q.ctx, q.path, "SETTIMES", a); err != nil {
		return err
	}
	q.w.WriteHeader(http.StatusOK)
	return nil
}

// setReplication: a file keeps the replication it was written with (ONE
// or THREE); asking for the one it has is true, another is
// UnsupportedOperationException. Directories answer false, as HDFS.
func (g *Gateway) setReplication(q *request) error {
	v := q.param("replication")
	n, err := strconv.Atoi(v)
	if v != "" && (err != nil || n < 1 || n > 512) {
		return badParam("Invalid value for webhdfs parameter \"replication\": %q", v)
	}
	st, _, err := g.stat(q.ctx, q.path)
	if err != nil {
		return err
	}
	if st.Type != "FILE" {
		booleanResult(q.w, false)
		return nil
	}
	if v == "" || n == st.Replication {
		booleanResult(q.w, true)
		return nil
	}
	return unsupported("SETREPLICATION of %s to %d: Basalt files keep the replication they were written with (%d); rewrite the file to change it", q.path, n, st.Replication)
}
