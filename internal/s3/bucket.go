package s3

import (
	"context"
	"encoding/xml"
	"errors"
	"net/http"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

const s3TimeFormat = "2006-01-02T15:04:05.000Z"

func s3Time(ms int64) string { return time.UnixMilli(ms).UTC().Format(s3TimeFormat) }

type owner struct {
	ID          string `xml:"ID"`
	DisplayName string `xml:"DisplayName"`
}

func (req *request) owner() owner {
	o := req.auth.owner
	return owner{ID: o, DisplayName: o}
}

// ensureVolume creates the S3 volume the first time a bucket is created.
func (g *Gateway) ensureVolume(ctx context.Context) error {
	g.volOnce.Lock()
	defer g.volOnce.Unlock()
	if g.volOK {
		return nil
	}
	// In the gateway's own name (a volume is an admin's or a gateway's to
	// create), writable by every user (1777: each may create buckets, and
	// only a bucket's owner deletes it).
	mode := uint32(0o1777)
	_, err := g.cl.CreateVolumeAttrs(metaclient.WithoutUser(ctx), g.cfg.Volume, &metapb.FileAttrs{Permission: &mode})
	if err != nil && !errors.Is(err, client.ErrExists) {
		return err
	}
	g.volOK = true
	return nil
}

func validBucket(name string) *Error {
	if err := namespace.ValidateBucketName("bucket", name); err != nil {
		return errorf("InvalidBucketName", 400, "The specified bucket is not valid: %s", message(err))
	}
	return nil
}

func (g *Gateway) listBuckets(req *request) *Error {
	type bucket struct {
		Name         string `xml:"Name"`
		CreationDate string `xml:"CreationDate"`
	}
	type result struct {
		XMLName xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ ListAllMyBucketsResult"`
		Owner   owner    `xml:"Owner"`
		Buckets []bucket `xml:"Buckets>Bucket"`
	}
	res := result{Owner: req.owner(), Buckets: []bucket{}}
	var bs []client.Bucket
	err := req.meta(func() (err error) {
		bs, err = g.listBucketsOf(req.r.Context(), req.auth)
		return err
	})
	if err != nil && !errors.Is(err, client.ErrNotFound) {
		return fromBasalt(err, "", "")
	}
	for _, b := range bs {
		res.Buckets = append(res.Buckets, bucket{Name: b.Name, CreationDate: b.Created.UTC().Format(s3TimeFormat)})
	}
	return writeXML(req, res)
}

// listBucketsOf lists the buckets the caller owns (every bucket for an
// admin).
func (g *Gateway) listBucketsOf(ctx context.Context, a *auth) ([]client.Bucket, error) {
	if a.admin {
		return g.cl.ListBuckets(ctx, g.cfg.Volume, client.ListOptions{Limit: 100000})
	}
	var out []client.Bucket
	after := ""
	for {
		resp, err := g.ns.ListBuckets(ctx, &metapb.ListBucketsRequest{Volume: g.cfg.Volume, StartAfter: after, Owner: a.owner, PageSize: 1000})
		if err != nil {
			return out, client.FromRPC("list buckets", err)
		}
		for _, b := range resp.Buckets {
			out = append(out, client.Bucket{Name: b.Name, Created: time.UnixMilli(b.CreatedUnixMs)})
		}
		if !resp.Truncated || len(resp.Buckets) == 0 || len(out) >= 100000 {
			return out, nil
		}
		after = resp.Buckets[len(resp.Buckets)-1].Name
	}
}

func (g *Gateway) createBucket(req *request) *Error {
	if e := validBucket(req.bucket); e != nil {
		return e
	}
	// The body may carry a CreateBucketConfiguration: its location must
	// be this gateway's region, as on an S3 regional endpoint.
	if req.r.ContentLength > 0 {
		loc, e := parseCreateBucketConfiguration(req)
		if e != nil {
			return e
		}
		if !g.inRegion(loc) {
			return errorf("IllegalLocationConstraintException", 400,
				"The %s location constraint is incompatible for the region specific endpoint this request was sent to (this gateway's region is %s).",
				loc, g.cfg.Region)
		}
	}
	acls, _, e := g.aclFromRequest(req, true)
	if e != nil {
		return e
	}
	ctx := req.r.Context()
	err := req.meta(func() error {
		if err := g.ensureVolume(ctx); err != nil {
			return err
		}
		_, err := g.ns.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: g.cfg.Volume, Name: req.bucket, Owner: req.auth.owner, Acls: acls})
		return client.FromRPC("create bucket", err)
	})
	g.owners.forget(req.bucket)
	if errors.Is(err, client.ErrExists) {
		// Whose is it? S3 tells the owner apart from everyone else.
		owner, exists, oerr := g.owners.get(ctx, g.cfg.Volume, req.bucket)
		if oerr == nil && exists && !req.auth.mayAccess(owner) {
			return errorf("BucketAlreadyExists", 409, "The requested bucket name is not available. The bucket namespace is shared by all users of the system. Please select a different name and try again.")
		}
	}
	if err != nil {
		return fromBasalt(err, req.bucket, "")
	}
	req.w.Header().Set("Location", "/"+req.bucket)
	req.w.WriteHeader(http.StatusOK)
	return nil
}

// parseCreateBucketConfiguration reads a CreateBucket body: its location
// constraint.
func parseCreateBucketConfiguration(req *request) (string, *Error) {
	var conf struct {
		XMLName            xml.Name `xml:"CreateBucketConfiguration"`
		LocationConstraint string   `xml:"LocationConstraint"`
	}
	if e := readXML(req, &conf); e != nil {
		return "", e
	}
	return conf.LocationConstraint, nil
}

// inRegion reports whether a CreateBucket location constraint names the
// gateway's region (S3's legacy names too). An empty one is accepted
// whatever the region, as clients configured for another S3 send it.
func (g *Gateway) inRegion(loc string) bool {
	switch loc {
	case "":
		return true
	case "US":
		loc = "us-east-1"
	case "EU":
		loc = "eu-west-1"
	}
	return loc == g.cfg.Region
}

func (g *Gateway) headBucket(req *request) *Error {
	if e := g.bucketExists(req); e != nil {
		return e
	}
	req.w.Header().Set("x-amz-bucket-region", g.cfg.Region)
	req.w.WriteHeader(http.StatusOK)
	return nil
}

func (g *Gateway) bucketExists(req *request) *Error {
	if e := validBucket(req.bucket); e != nil {
		return errNoSuchBucket(req.bucket)
	}
	err := req.meta(func() error {
		_, err := g.ns.GetBucket(req.r.Context(), &metapb.GetBucketRequest{Volume: g.cfg.Volume, Name: req.bucket})
		return client.FromRPC("get bucket", err)
	})
	if err != nil {
		return fromBasalt(err, req.bucket, "")
	}
	return nil
}

func (g *Gateway) deleteBucket(req *request) *Error {
	err := req.meta(func() error { return g.cl.DeleteBucket(req.r.Context(), g.cfg.Volume, req.bucket) })
	g.owners.forget(req.bucket)
	if err != nil {
		return fromBasalt(err, req.bucket, "")
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}

func (g *Gateway) getBucketLocation(req *request) *Error {
	if e := g.bucketExists(req); e != nil {
		return e
	}
	type result struct {
		XMLName xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ LocationConstraint"`
		Value   string   `xml:",chardata"`
	}
	// S3 answers an empty constraint for us-east-1.
	loc := g.cfg.Region
	if loc == "us-east-1" {
		loc = ""
	}
	return writeXML(req, result{Value: loc})
}

// getBucketVersioning answers "never enabled": tools ask before listing.
func (g *Gateway) getBucketVersioning(req *request) *Error {
	if e := g.bucketExists(req); e != nil {
		return e
	}
	type result struct {
		XMLName xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ VersioningConfiguration"`
	}
	return writeXML(req, result{})
}
