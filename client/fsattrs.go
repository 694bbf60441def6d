package client

import (
	"context"
	"fmt"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// CreateVolumeAttrs creates a volume with Hadoop-style attributes (its
// owner is attrs.Owner).
func (c *Client) CreateVolumeAttrs(ctx context.Context, name string, attrs *metapb.FileAttrs) (Volume, error) {
	v, err := c.ns.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: name, Owner: attrs.GetOwner(), Attrs: attrs})
	if err != nil {
		return Volume{}, wrapErr(fmt.Sprintf("create volume %q", name), err)
	}
	return volumeOf(v), nil
}

// CreateDirectoryAttrs is CreateDirectory giving the directories it
// creates attrs (the parents made on the way also get owner write and
// search permission, as HDFS gives them).
func (c *Client) CreateDirectoryAttrs(ctx context.Context, volume, bucket, path string, attrs *metapb.FileAttrs) (FileStatus, error) {
	s, err := c.ns.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: volume, Bucket: bucket, Path: path, Attrs: attrs})
	if err != nil {
		return FileStatus{}, wrapErr(fmt.Sprintf("create directory %s", keyPath(volume, bucket, path)), err)
	}
	return fileStatusOf(s), nil
}

// SetFileAttrs changes the Hadoop-style attributes of a volume (bucket ""),
// a bucket (path "") or a file or directory of an fs bucket: the fields
// set in attrs replace the stored ones. It returns the stored attributes.
func (c *Client) SetFileAttrs(ctx context.Context, volume, bucket, path string, attrs *metapb.FileAttrs) (*metapb.FileAttrs, error) {
	r, err := c.ns.SetFileAttrs(ctx, &metapb.SetFileAttrsRequest{Volume: volume, Bucket: bucket, Path: path, Attrs: attrs})
	if err != nil {
		return nil, wrapErr(fmt.Sprintf("set attributes of %s", keyPath(volume, bucket, path)), err)
	}
	return r.Attrs, nil
}

// RenameKeyOverwrite renames key to newKey replacing an existing newKey in
// the same metadata operation: a file by a file, an empty directory by a
// directory (else ErrPrecondition).
func (c *Client) RenameKeyOverwrite(ctx context.Context, volume, bucket, key, newKey string) error {
	_, err := c.ns.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: volume, Bucket: bucket, Key: key, NewKey: newKey, Overwrite: true})
	return wrapErr(fmt.Sprintf("rename key %s to %q (overwrite)", keyPath(volume, bucket, key), newKey), err)
}
