package s3

import (
	"encoding/xml"
	"errors"
	"io"
	"net/http"
	"strconv"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Bucket policies, their status and Block Public Access. The namespace
// keeps, validates and evaluates them (docs/SECURITY.md); the gateway
// carries the documents.

// maxPolicyBytes is S3's limit on a bucket policy (20 KB).
const maxPolicyBytes = 20 << 10

func (g *Gateway) getBucketPolicy(req *request) *Error {
	var p string
	err := req.meta(func() (err error) {
		p, err = g.cl.GetBucketPolicy(req.r.Context(), g.cfg.Volume, req.bucket)
		return err
	})
	if err != nil {
		return aclError(err, req.bucket, "")
	}
	if p == "" {
		return errorf("NoSuchBucketPolicy", 404, "The bucket policy does not exist")
	}
	req.w.Header().Set("Content-Type", "application/json")
	req.w.Header().Set("Content-Length", strconv.Itoa(len(p)))
	req.w.WriteHeader(http.StatusOK)
	io.WriteString(req.w, p)
	return nil
}

func (g *Gateway) putBucketPolicy(req *request) *Error {
	b, e := newBody(req.r, req.auth, maxPolicyBytes, false)
	if e != nil {
		return e
	}
	defer b.close()
	doc, err := io.ReadAll(io.LimitReader(b, maxPolicyBytes+1))
	if err != nil || b.err != nil {
		if b.err != nil {
			err = b.err
		}
		var se *Error
		if errors.As(err, &se) {
			return se
		}
		return errorf("IncompleteBody", 400, "%v", err)
	}
	if len(doc) > maxPolicyBytes {
		return errorf("PolicyTooLarge", 400, "Policies must be no more than %d bytes", maxPolicyBytes)
	}
	if len(doc) == 0 {
		return errorf("MalformedPolicy", 400, "Policies must be valid JSON and the first byte must be '{'")
	}
	err = req.meta(func() error { return g.cl.SetBucketPolicy(req.r.Context(), g.cfg.Volume, req.bucket, string(doc)) })
	if err != nil {
		if errors.Is(err, client.ErrInvalidArgument) {
			return errorf("MalformedPolicy", 400, "%s", message(err))
		}
		return aclError(err, req.bucket, "")
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}

func (g *Gateway) deleteBucketPolicy(req *request) *Error {
	err := req.meta(func() error { return g.cl.SetBucketPolicy(req.r.Context(), g.cfg.Volume, req.bucket, "") })
	if err != nil {
		return aclError(err, req.bucket, "")
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}

func (g *Gateway) getBucketPolicyStatus(req *request) *Error {
	var public bool
	err := req.meta(func() (err error) {
		public, err = g.cl.GetBucketPolicyStatus(req.r.Context(), g.cfg.Volume, req.bucket)
		return err
	})
	if err != nil {
		return aclError(err, req.bucket, "")
	}
	type result struct {
		XMLName  xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ PolicyStatus"`
		IsPublic bool     `xml:"IsPublic"`
	}
	return writeXML(req, result{IsPublic: public})
}

// publicAccessBlockXML is PublicAccessBlockConfiguration.
type publicAccessBlockXML struct {
	XMLName               xml.Name `xml:"PublicAccessBlockConfiguration"`
	BlockPublicAcls       bool     `xml:"BlockPublicAcls"`
	IgnorePublicAcls      bool     `xml:"IgnorePublicAcls"`
	BlockPublicPolicy     bool     `xml:"BlockPublicPolicy"`
	RestrictPublicBuckets bool     `xml:"RestrictPublicBuckets"`
}

func (g *Gateway) getPublicAccessBlock(req *request) *Error {
	var c *metapb.PublicAccessBlock
	err := req.meta(func() (err error) {
		c, err = g.cl.GetPublicAccessBlock(req.r.Context(), g.cfg.Volume, req.bucket)
		return err
	})
	if err != nil {
		return aclError(err, req.bucket, "")
	}
	if c == nil {
		return errorf("NoSuchPublicAccessBlockConfiguration", 404, "The public access block configuration was not found")
	}
	return writeXML(req, struct {
		XMLName               xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ PublicAccessBlockConfiguration"`
		BlockPublicAcls       bool     `xml:"BlockPublicAcls"`
		IgnorePublicAcls      bool     `xml:"IgnorePublicAcls"`
		BlockPublicPolicy     bool     `xml:"BlockPublicPolicy"`
		RestrictPublicBuckets bool     `xml:"RestrictPublicBuckets"`
	}{BlockPublicAcls: c.BlockPublicAcls, IgnorePublicAcls: c.IgnorePublicAcls, BlockPublicPolicy: c.BlockPublicPolicy,
		RestrictPublicBuckets: c.RestrictPublicBuckets})
}

func (g *Gateway) putPublicAccessBlock(req *request) *Error {
	var doc publicAccessBlockXML
	if e := readXML(req, &doc); e != nil {
		return e
	}
	c := &metapb.PublicAccessBlock{BlockPublicAcls: doc.BlockPublicAcls, IgnorePublicAcls: doc.IgnorePublicAcls,
		BlockPublicPolicy: doc.BlockPublicPolicy, RestrictPublicBuckets: doc.RestrictPublicBuckets}
	err := req.meta(func() error { return g.cl.SetPublicAccessBlock(req.r.Context(), g.cfg.Volume, req.bucket, c) })
	if err != nil {
		return aclError(err, req.bucket, "")
	}
	req.w.WriteHeader(http.StatusOK)
	return nil
}

func (g *Gateway) deletePublicAccessBlock(req *request) *Error {
	err := req.meta(func() error { return g.cl.SetPublicAccessBlock(req.r.Context(), g.cfg.Volume, req.bucket, nil) })
	if err != nil {
		return aclError(err, req.bucket, "")
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}
