package client

import (
	"context"
	"fmt"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Access control: ACLs, bucket policies and Block Public Access (see
// docs/SECURITY.md). The namespace checks them on every operation; these
// calls read and change them.

// GetAcl returns the ACL and effective owner of a volume (bucket ""), a
// bucket (key "") or a key.
func (c *Client) GetAcl(ctx context.Context, volume, bucket, key string) (*metapb.AclList, error) {
	r, err := c.ns.GetAcl(ctx, &metapb.GetAclRequest{Ref: &metapb.ObjectRef{Volume: volume, Bucket: bucket, Key: key}})
	if err != nil {
		return nil, wrapErr(fmt.Sprintf("get ACL of %s", keyPath(volume, bucket, key)), err)
	}
	return r, nil
}

// SetAcl replaces, adds to or removes from the ACL of a volume, bucket or
// key, returning the stored ACL.
func (c *Client) SetAcl(ctx context.Context, volume, bucket, key string, op metapb.AclOp, acls []*metapb.Acl) (*metapb.AclList, error) {
	r, err := c.ns.SetAcl(ctx, &metapb.SetAclRequest{Ref: &metapb.ObjectRef{Volume: volume, Bucket: bucket, Key: key}, Op: op, Acls: acls})
	if err != nil {
		return nil, wrapErr(fmt.Sprintf("set ACL of %s", keyPath(volume, bucket, key)), err)
	}
	return r, nil
}

// GetBucketPolicy returns the bucket's policy document ("" if none).
func (c *Client) GetBucketPolicy(ctx context.Context, volume, bucket string) (string, error) {
	r, err := c.ns.GetBucketPolicy(ctx, &metapb.BucketRef{Volume: volume, Bucket: bucket})
	if err != nil {
		return "", wrapErr(fmt.Sprintf("get policy of %s", keyPath(volume, bucket, "")), err)
	}
	return r.Policy, nil
}

// SetBucketPolicy stores a bucket policy; "" deletes it.
func (c *Client) SetBucketPolicy(ctx context.Context, volume, bucket, policy string) error {
	_, err := c.ns.SetBucketPolicy(ctx, &metapb.BucketPolicy{Volume: volume, Bucket: bucket, Policy: policy})
	if err != nil {
		return wrapErr(fmt.Sprintf("set policy of %s", keyPath(volume, bucket, "")), err)
	}
	return nil
}

// GetBucketPolicyStatus reports whether the bucket's policy makes it public.
func (c *Client) GetBucketPolicyStatus(ctx context.Context, volume, bucket string) (bool, error) {
	r, err := c.ns.GetBucketPolicyStatus(ctx, &metapb.BucketRef{Volume: volume, Bucket: bucket})
	if err != nil {
		return false, wrapErr(fmt.Sprintf("get policy status of %s", keyPath(volume, bucket, "")), err)
	}
	return r.IsPublic, nil
}

// GetPublicAccessBlock returns the bucket's Block Public Access settings
// (nil if none).
func (c *Client) GetPublicAccessBlock(ctx context.Context, volume, bucket string) (*metapb.PublicAccessBlock, error) {
	r, err := c.ns.GetPublicAccessBlock(ctx, &metapb.BucketRef{Volume: volume, Bucket: bucket})
	if err != nil {
		return nil, wrapErr(fmt.Sprintf("get public access block of %s", keyPath(volume, bucket, "")), err)
	}
	return r.Config, nil
}

// SetPublicAccessBlock stores the bucket's Block Public Access settings;
// nil deletes them.
func (c *Client) SetPublicAccessBlock(ctx context.Context, volume, bucket string, cfg *metapb.PublicAccessBlock) error {
	_, err := c.ns.SetPublicAccessBlock(ctx, &metapb.PublicAccessBlockConfig{Volume: volume, Bucket: bucket, Config: cfg})
	if err != nil {
		return wrapErr(fmt.Sprintf("set public access block of %s", keyPath(volume, bucket, "")), err)
	}
	return nil
}
