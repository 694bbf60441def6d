package webhdfs

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Names of the HDFS attributes kept in a file's key attributes
// (ObjectMeta.user).
const (
	attrOwner = "hdfs-owner"
	attrGroup = "hdfs-group"
	attrPerm  = "hdfs-permission"
	attrMtime = "hdfs-mtime" // unix ms; set by SETTIMES, kept across attribute changes
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

func dirStatus(name, owner string, id uint64, modified time.Time) fileStatus {
	if owner == "" {
		owner = "basalt"
	}
	return fileStatus{PathSuffix: name, Type: "DIRECTORY", Owner: owner, Group: defaultGroup, Permission: defaultDirPerm,
		FileID: id, ModificationTime: ms(modified)}
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
	return st
}

func (g *Gateway) entryStatus(name string, e *client.FileStatus, defOwner string) fileStatus {
	if e.IsDir {
		return dirStatus(name, defOwner, e.DirID, e.Modified)
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
		return dirStatus("", "basalt", 0, time.Time{}), nil, nil
	case 1:
		v, err := g.cl.VolumeInfo(ctx, p.volume)
		if err != nil {
			if errors.Is(err, client.ErrNotFound) {
				return fileStatus{}, nil, notFound(p)
			}
			return fileStatus{}, nil, toRemote(p, err)
		}
		return dirStatus("", v.Owner, 0, v.Created), nil, nil
	case 2:
		b, err := g.cl.BucketInfo(ctx, p.volume, p.bucket)
		if err != nil {
			if errors.Is(err, client.ErrNotFound) {
				return fileStatus{}, nil, notFound(p)
			}
			return fileStatus{}, nil, toRemote(p, err)
		}
		return dirStatus("", g.volumeOwner(ctx, p), b.ID, b.Created), nil, nil
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

// attrsMeta returns a copy of a file's key attributes with set applied
// (empty values delete), keeping its modification time as the HDFS one:
// the copy that stores them gets a new key modification time.
func attrsMeta(k *client.KeyInfo, set map[string]string) *metapb.ObjectMeta {
	m := &metapb.ObjectMeta{User: map[string]string{}}
	if k.Meta != nil {
		m.ContentType = k.Meta.ContentType
		m.ContentEncoding = k.Meta.ContentEncoding
		m.ContentDisposition = k.Meta.ContentDisposition
		m.ContentLanguage = k.Meta.ContentLanguage
		m.CacheControl = k.Meta.CacheControl
		m.Expires = k.Meta.Expires
		m.Tags = k.Meta.Tags
		for n, v := range k.Meta.User {
			m.User[n] = v
		}
	}
	if _, ok := m.User[attrMtime]; !ok {
		m.User[attrMtime] = strconv.FormatInt(ms(k.Modified), 10)
	}
	for n, v := range set {
		if v == "" {
			delete(m.User, n)
		} else {
			m.User[n] = v
		}
	}
	return m
}

// setFileAttrs stores attributes of the file at p (depth 3). Directories,
// volumes and buckets have nowhere to keep them: UnsupportedOperationException.
func (g *Gateway) setFileAttrs(ctx context.Context, p fsPath, what string, set map[string]string) error {
	if p.depth() < 3 {
		if _, _, err := g.stat(ctx, p); err != nil {
			return err
		}
		return unsupported("%s of %s: volumes and buckets have no HDFS attributes in Basalt yet", what, p)
	}
	e, err := g.lookup(ctx, p)
	if err != nil {
		return err
	}
	if e.IsDir {
		return unsupported("%s of directory %s: Basalt stores HDFS attributes for files only (directories have none yet)", what, p)
	}
	_, err = g.cl.CopyKey(ctx, p.volume, p.bucket, p.key, p.bucket, p.key, client.CopyOptions{
		ExpectObjectID: e.File.ObjectID, ReplaceMeta: true, Meta: attrsMeta(e.File, set)})
	if errors.Is(err, client.ErrPrecondition) {
		return remote(classRetriable, "%s of %s: the file changed meanwhile; retry", what, p)
	}
	if err != nil {
		return toRemote(p, err)
	}
	return nil
}
