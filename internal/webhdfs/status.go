package webhdfs

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Names of the HDFS attributes CREATE records in a new file's key
// attributes (ObjectMeta.user), because CommitKey has no FileAttrs field.
// Attributes set later (SETOWNER, SETPERMISSION, SETTIMES) are the
// namespace's FileAttrs (KeyInfo.Attrs), which take precedence; files
// written before FileAttrs existed may also carry hdfs-mtime/hdfs-atime.
const (
	attrOwner = "hdfs-owner"
	attrGroup = "hdfs-group"
	attrPerm  = "hdfs-permission"
	attrMtime = "hdfs-mtime" // unix ms
	attrAtime = "hdfs-atime" // unix ms
)

// fileStatus is WebHDFS's FileStatus JSON object.
type fileStatus struct {
	AccessTime       int64  `json:"accessTime"`
	BlockSize        int64  `json:"blockSize"`
	FileID           uint64 `json:"fileId"`
	Group            string `json:"group"`
	Length           uint64 `json:"length"`
	ModificationTime int64  `json:"modificationTime"`
	Owner            string `json:"owner"`
	PathSuffix       string `json:"pathSuffix"`
	Permission       string `json:"permission"`
	Replication      int    `json:"replication"`
	StoragePolicy    int    `json:"storagePolicy"`
	Type             string `json:"type"`
}

func ms(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

// dirStatus is a directory's (or volume's, bucket's) status: attrs over
// the defaults (owner: defOwner, else "basalt").
func dirStatus(name, defOwner string, id uint64, modified time.Time, attrs *metapb.FileAttrs) fileStatus {
	if defOwner == "" {
		defOwner = "basalt"
	}
	st := fileStatus{PathSuffix: name, Type: "DIRECTORY", Owner: defOwner, Group: defaultGroup, Permission: defaultDirPerm,
		FileID: id, ModificationTime: ms(modified)}
	applyAttrs(&st, attrs)
	return st
}

// applyAttrs puts the recorded attributes over st's defaults.
func applyAttrs(st *fileStatus, a *metapb.FileAttrs) {
	if a == nil {
		return
	}
	if a.Owner != "" {
		st.Owner = a.Owner
	}
	if a.Group != "" {
		st.Group = a.Group
	}
	if a.Permission != nil {
		st.Permission = strconv.FormatUint(uint64(*a.Permission), 8)
	}
	if a.MtimeUnixMs != 0 {
		st.ModificationTime = a.MtimeUnixMs
	}
	if a.AtimeUnixMs != 0 {
		st.AccessTime = a.AtimeUnixMs
	}
}

func replicationNum(r client.Replication) int {
	switch r {
	case client.ReplicationOne:
		return 1
	case client.ReplicationThree:
		return 3
	}
	return 0
}

// fileAttrs reads the HDFS attributes stored with a file.
func fileAttrs(k *client.KeyInfo) map[string]string {
	if k.Meta == nil {
		return nil
	}
	return k.Meta.User
}

func (g *Gateway) fileStatusOf(name string, k *client.KeyInfo, defOwner string) fileStatus {
	a := fileAttrs(k)
	st := fileStatus{PathSuffix: name, Type: "FILE", Length: k.Size, FileID: k.ObjectID, BlockSize: g.cfg.BlockSize,
		Replication: replicationNum(k.Replication), ModificationTime: ms(k.Modified), Owner: defOwner, Group: defaultGroup,
		Permission: defaultFilePerm}
	if st.Owner == "" {
		st.Owner = "basalt"
	}
	if v := a[attrOwner]; v != "" {
		st.Owner = v
	}
	if v := a[attrGroup]; v != "" {
		st.Group = v
	}
	if v := a[attrPerm]; v != "" {
		st.Permission = v
	}
	if v, err := strconv.ParseInt(a[attrMtime], 10, 64); err == nil {
		st.ModificationTime = v
	}
	st.AccessTime = st.ModificationTime
	if v, err := strconv.ParseInt(a[attrAtime], 10, 64); err == nil {
		st.AccessTime = v
	}
	applyAttrs(&st, k.Attrs)
	return st
}

func (g *Gateway) entryStatus(name string, e *client.FileStatus, defOwner string) fileStatus {
	if e.IsDir {
		return dirStatus(name, defOwner, e.DirID, e.Modified, e.Attrs)
	}
	return g.fileStatusOf(name, e.File, defOwner)
}

// volumeOwner is the owner reported for entries of p's volume that store
// none ("" if the volume cannot be read).
func (g *Gateway) volumeOwner(ctx context.Context, p fsPath) string {
	if p.volume == "" {
		return ""
	}
	v, err := g.cl.VolumeInfo(ctx, p.volume)
	if err != nil {
		return ""
	}
	return v.Owner
}

// stat returns p's status, whatever its depth.
func (g *Gateway) stat(ctx context.Context, p fsPath) (fileStatus, *client.FileStatus, error) {
	switch p.depth() {
	case 0:
		return dirStatus("", "basalt", 0, time.Time{}, nil), nil, nil
	case 1:
		v, err := g.cl.VolumeInfo(ctx, p.volume)
		if err != nil {
			if errors.Is(err, client.ErrNotFound) {
				return fileStatus{}, nil, notFound(p)
			}
			return fileStatus{}, nil, toRemote(p, err)
		}
		return dirStatus("", v.Owner, 0, v.Created, v.Attrs), nil, nil
	case 2:
		b, err := g.cl.BucketInfo(ctx, p.volume, p.bucket)
		if err != nil {
			if errors.Is(err, client.ErrNotFound) {
				return fileStatus{}, nil, notFound(p)
			}
			return fileStatus{}, nil, toRemote(p, err)
		}
		return dirStatus("", g.volumeOwner(ctx, p), b.ID, b.Created, b.Attrs), nil, nil
	}
	e, err := g.lookup(ctx, p)
	if err != nil {
		return fileStatus{}, nil, err
	}
	return g.entryStatus("", &e, g.volumeOwner(ctx, p)), &e, nil
}

// lookup returns the entry at p (depth 3). A missing entry, or a file on
// the way to it, is FileNotFoundException, as HDFS's getFileInfo.
func (g *Gateway) lookup(ctx context.Context, p fsPath) (client.FileStatus, error) {
	e, err := g.cl.GetFileStatus(ctx, p.volume, p.bucket, p.key)
	if err != nil {
		if errors.Is(err, client.ErrNotFound) || (errors.Is(err, client.ErrPrecondition) && isNotDirectory(err)) {
			return client.FileStatus{}, notFound(p)
		}
		if errors.Is(err, client.ErrPrecondition) {
			return client.FileStatus{}, remote(classIO, "%s: %v (WebHDFS serves buckets with the FS layout)", p, err)
		}
		return client.FileStatus{}, toRemote(p, err)
	}
	return e, nil
}

// setFileAttrs stores attributes of a volume, bucket, directory or file
// in the namespace (one Raft apply; the file's data and modification time
// are untouched). "/" has nowhere to keep them: UnsupportedOperationException.
func (g *Gateway) setFileAttrs(ctx context.Context, p fsPath, what string, a *metapb.FileAttrs) error {
	if p.depth() == 0 {
		return unsupported("%s of /: the root of the volumes has no attributes in Basalt", what)
	}
	_, err := g.cl.SetFileAttrs(ctx, p.volume, p.bucket, p.key, a)
	if err == nil {
		return nil
	}
	if errors.Is(err, client.ErrNotFound) || (errors.Is(err, client.ErrPrecondition) && isNotDirectory(err)) {
		return notFound(p)
	}
	if errors.Is(err, client.ErrPrecondition) {
		return remote(classIO, "%s of %s: %v (WebHDFS serves buckets with the FS layout)", what, p, err)
	}
	return toRemote(p, err)
}

// Attrs returns the attributes recorded for e (a directory's, or a file's:
// those CREATE put in its key attributes, under those set later), nil if
// none; the gateway shows defaults for the rest. `basalt sh fs` shows the
// same.
func Attrs(e *client.FileStatus) *metapb.FileAttrs {
	if e.IsDir || e.File == nil {
		return e.Attrs
	}
	a := fileAttrs(e.File)
	if len(a) == 0 {
		return e.File.Attrs
	}
	out := &metapb.FileAttrs{Owner: a[attrOwner], Group: a[attrGroup]}
	if v, err := strconv.ParseUint(a[attrPerm], 8, 32); err == nil {
		p := uint32(v)
		out.Permission = &p
	}
	if v, err := strconv.ParseInt(a[attrMtime], 10, 64); err == nil {
		out.MtimeUnixMs = v
	}
	if v, err := strconv.ParseInt(a[attrAtime], 10, 64); err == nil {
		out.AtimeUnixMs = v
	}
	if e.File.Attrs != nil {
		out = mergeAttrs(out, e.File.Attrs)
	}
	return out
}

// mergeAttrs returns a with the fields set in b replacing its own.
func mergeAttrs(a, b *metapb.FileAttrs) *metapb.FileAttrs {
	out := &metapb.FileAttrs{Owner: a.Owner, Group: a.Group, Permission: a.Permission, MtimeUnixMs: a.MtimeUnixMs, AtimeUnixMs: a.AtimeUnixMs}
	if b.Owner != "" {
		out.Owner = b.Owner
	}
	if b.Group != "" {
		out.Group = b.Group
	}
	if b.Permission != nil {
		out.Permission = b.Permission
	}
	if b.MtimeUnixMs != 0 {
		out.MtimeUnixMs = b.MtimeUnixMs
	}
	if b.AtimeUnixMs != 0 {
		out.AtimeUnixMs = b.AtimeUnixMs
	}
	return out
}
