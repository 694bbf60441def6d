package namespace

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// File attributes: the Hadoop-style owner, group, permission and times of
// files, directories, buckets and volumes (WebHDFS, `basalt sh fs`).
// Directories keep them in their FsEntry, files in their KeyInfo (so a
// rename moves them with the row), buckets and volumes in their own rows.
// They are recorded, not enforced: the access checks come with users.

// MaxPermission is the largest mode a FileAttrs may hold (sticky bit plus
// rwxrwxrwx).
const MaxPermission = 0o1777

// validateAttrs bounds the attributes a request may store.
func validateAttrs(a *metapb.FileAttrs) error {
	if a == nil {
		return nil
	}
	if len(a.Owner) > MaxOwnerBytes {
		return invalid("owner is %d bytes, at most %d", len(a.Owner), MaxOwnerBytes)
	}
	if len(a.Group) > MaxOwnerBytes {
		return invalid("group is %d bytes, at most %d", len(a.Group), MaxOwnerBytes)
	}
	if a.Permission != nil && *a.Permission > MaxPermission {
		return invalid("permission %o is more than %o", *a.Permission, MaxPermission)
	}
	if a.MtimeUnixMs < 0 || a.AtimeUnixMs < 0 {
		return invalid("times must not be negative (0 = unchanged)")
	}
	return nil
}

// mergeAttrs returns old with the fields set in change replaced; nil when
// nothing is recorded.
func mergeAttrs(old, change *metapb.FileAttrs) *metapb.FileAttrs {
	out := &metapb.FileAttrs{}
	if old != nil {
		out = proto.Clone(old).(*metapb.FileAttrs)
	}
	if change == nil {
		return out
	}
	if change.Owner != "" {
		out.Owner = change.Owner
	}
	if change.Group != "" {
		out.Group = change.Group
	}
	if change.Permission != nil {
		p := *change.Permission
		out.Permission = &p
	}
	if change.MtimeUnixMs != 0 {
		out.MtimeUnixMs = change.MtimeUnixMs
	}
	if change.AtimeUnixMs != 0 {
		out.AtimeUnixMs = change.AtimeUnixMs
	}
	return out
}

// setFileAttrs applies a SetFileAttrsRequest: a volume (bucket ""), a
// bucket (path ""), or a file or directory of an fs bucket.
func (t *tx) setFileAttrs(req *metapb.SetFileAttrsRequest) any {
	if err := validateAttrs(req.Attrs); err != nil {
		return err
	}
	if req.Bucket == "" {
		v := &metapb.Volume{}
		if !t.get(volumeKey(req.Volume), v) {
			return noSuchVolume(req.Volume)
		}
		v.Attrs = mergeAttrs(v.Attrs, req.Attrs)
		if v.Attrs.Owner != "" {
			v.Owner = v.Attrs.Owner
		}
		t.put(volumeKey(req.Volume), v)
		return &metapb.SetFileAttrsResponse{Attrs: v.Attrs}
	}
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if req.Path == "" {
		b.Attrs = mergeAttrs(b.Attrs, req.Attrs)
		t.put(bucketKey(req.Volume, req.Bucket), b)
		t.bucketsChanged = true
		return &metapb.SetFileAttrsResponse{Attrs: b.Attrs}
	}
	if b.Layout != metapb.BucketLayout_FS {
		return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q has layout OBJECT; file attributes need an FS bucket", req.Bucket, req.Volume)
	}
	parts, err := SplitPath(req.Path, false)
	if err != nil {
		return err
	}
	parent, e, err := resolve(t.b, b, parts, req.Path)
	if err != nil {
		return err
	}
	if e == nil {
		return notFound("%q not found in bucket %q", req.Path, req.Bucket)
	}
	var out *metapb.FileAttrs
	if e.IsDir {
		e.Attrs = mergeAttrs(e.Attrs, req.Attrs)
		out = e.Attrs
	} else {
		e.File.Attrs = mergeAttrs(e.File.Attrs, req.Attrs)
		out = e.File.Attrs
	}
	t.put(fsKey(b.Id, parent, parts[len(parts)-1]), e)
	return &metapb.SetFileAttrsResponse{Attrs: out}
}

// createDirectory is CreateDirectory's apply: mkdir -p, the directories it
// creates getting req.Attrs (the parents it creates on the way also get
// owner write and search permission, as HDFS gives them, so the caller can
// create the last one). Existing directories keep theirs.
func (t *tx) createDirectory(req *metapb.CreateDirectoryRequest) any {
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if b.Layout != metapb.BucketLayout_FS {
		return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q has layout OBJECT; directories need an FS bucket", req.Bucket, req.Volume)
	}
	if err := validateAttrs(req.Attrs); err != nil {
		return err
	}
	parts, err := SplitPath(req.Path, false)
	if err != nil {
		return err
	}
	parent := uint64(0)
	i := 0
	var last *metapb.FsEntry
	for ; i < len(parts); i++ {
		e := &metapb.FsEntry{}
		if !t.get(fsKey(b.Id, parent, parts[i]), e) {
			break
		}
		if !e.IsDir {
			return status.Errorf(codes.FailedPrecondition, "%q is a file, not a directory", joinPath(parts[:i+1]))
		}
		parent, last = e.DirId, e
	}
	if i == len(parts) {
		return &metapb.FileStatus{Path: req.Path, IsDir: true, DirId: parent, ModifiedUnixMs: last.ModifiedUnixMs, Attrs: last.Attrs}
	}
	var parentAttrs *metapb.FileAttrs
	if req.Attrs != nil {
		parentAttrs = proto.Clone(req.Attrs).(*metapb.FileAttrs)
		if parentAttrs.Permission != nil {
			p := *parentAttrs.Permission | 0o300
			parentAttrs.Permission = &p
		}
	}
	for ; i < len(parts); i++ {
		id := t.id()
		e := &metapb.FsEntry{IsDir: true, DirId: id, ModifiedUnixMs: t.now, Attrs: parentAttrs}
		if i == len(parts)-1 {
			e.Attrs = req.Attrs
		}
		t.put(fsKey(b.Id, parent, parts[i]), e)
		parent, last = id, e
	}
	return &metapb.FileStatus{Path: req.Path, IsDir: true, DirId: parent, ModifiedUnixMs: t.now, Attrs: last.Attrs}
}

// replaceForRename validates that dst (entry de, in directory dp of b) may
// be replaced by src (entry se) in a rename with overwrite, as HDFS's
// rename(src, dst, OVERWRITE) allows: a file by a file, an empty directory
// by a directory. It writes nothing when it fails; when it succeeds it has
// released the replaced file's blocks, and the caller's write of the
// source's row at dst's key replaces dst's row in the same batch.
func (t *tx) replaceForRename(b *metapb.Bucket, req *metapb.RenameKeyRequest, se, de *metapb.FsEntry) error {
	if se.IsDir != de.IsDir {
		kind := "files"
		if se.IsDir {
			kind = "directories"
		}
		return status.Errorf(codes.FailedPrecondition, "rename %q onto %q: source and destination must both be %s", req.Key, req.NewKey, kind)
	}
	if de.IsDir {
		nonEmpty, _, err := hasPrefix(t.b, fsPrefix(b.Id, de.DirId))
		if err != nil {
			panic(err)
		}
		if nonEmpty {
			return status.Errorf(codes.FailedPrecondition, "rename %q onto %q: destination directory is not empty", req.Key, req.NewKey)
		}
		return nil
	}
	t.release(keyBlockIDs(de.File), "overwritten by rename: "+req.NewKey)
	return nil
}

// entryAttrs is the attributes a FileStatus of e carries itself
// (directories; a file's are in its KeyInfo).
func entryAttrs(e *metapb.FsEntry) *metapb.FileAttrs {
	if e.IsDir {
		return e.Attrs
	}
	return nil
}

// SetFileAttrs changes the Hadoop-style attributes of a volume (bucket ""),
// a bucket (path "") or an fs bucket's file or directory.
func (s *Service) SetFileAttrs(ctx context.Context, req *metapb.SetFileAttrsRequest) (*metapb.SetFileAttrsResponse, error) {
	if err := checkNameBound("volume", req.Volume, 63); err != nil {
		return nil, err
	}
	if req.Bucket == "" && req.Path != "" {
		return nil, invalid("set file attributes: a path needs a bucket")
	}
	if req.Bucket != "" {
		if err := checkNameBound("bucket", req.Bucket, 63); err != nil {
			return nil, err
		}
	}
	if req.Path != "" {
		if _, err := SplitPath(req.Path, false); err != nil {
			return nil, err
		}
	}
	if req.Attrs == nil {
		return nil, invalid("set file attributes: no attributes given")
	}
	if err := validateAttrs(req.Attrs); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).SetFileAttrs(req); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_SetFileAttrs{SetFileAttrs: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.SetFileAttrsResponse), nil
}
