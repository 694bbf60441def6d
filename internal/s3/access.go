package s3

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// What a request may ask for, and who may ask: every sub-resource is
// served or refused (never served as something else), headers asking for
// features the gateway lacks are refused, and a bucket is its owner's.

// subResources are S3's sub-resources: query parameters that select what
// a request acts on rather than tune it. A request naming one its
// operation does not serve is refused with NotImplemented, so that (for
// example) GET /bucket?policyStatus is never answered with a listing.
var subResources = map[string]bool{
	"accelerate": true, "acl": true, "analytics": true, "attributes": true, "cors": true, "delete": true,
	"encryption": true, "intelligent-tiering": true, "inventory": true, "legal-hold": true, "lifecycle": true,
	"location": true, "logging": true, "metadataConfiguration": true, "metadataTable": true, "metrics": true,
	"notification": true, "object-lock": true, "ownershipControls": true, "partNumber": true, "policy": true,
	"policyStatus": true, "publicAccessBlock": true, "renameObject": true, "replication": true,
	"requestPayment": true, "restore": true, "retention": true, "select": true, "select-type": true,
	"session": true, "tagging": true, "torrent": true, "uploadId": true, "uploads": true, "versionId": true,
	"versioning": true, "versions": true, "website": true, "abac": true, "inventoryConfiguration": true,
}

// opSubResources are the sub-resources each operation serves.
var opSubResources = map[string][]string{
	"GetBucketLocation":       {"location"},
	"GetBucketVersioning":     {"versioning"},
	"ListMultipartUploads":    {"uploads"},
	"DeleteObjects":           {"delete"},
	"UploadPart":              {"uploadId", "partNumber"},
	"UploadPartCopy":          {"uploadId", "partNumber"},
	"ListParts":               {"uploadId"},
	"AbortMultipartUpload":    {"uploadId"},
	"CompleteMultipartUpload": {"uploadId"},
	"CreateMultipartUpload":   {"uploads"},
	"PutObjectTagging":        {"tagging", "versionId"},
	"GetObjectTagging":        {"tagging", "versionId"},
	"DeleteObjectTagging":     {"tagging", "versionId"},
	"GetObject":               {"versionId", "partNumber"},
	"HeadObject":              {"versionId", "partNumber"},
	"DeleteObject":            {"versionId"},
	"GetBucketAcl":            {"acl"},
	"PutBucketAcl":            {"acl"},
	"GetObjectAcl":            {"acl", "versionId"},
	"PutObjectAcl":            {"acl", "versionId"},
	"GetBucketPolicy":         {"policy"},
	"PutBucketPolicy":         {"policy"},
	"DeleteBucketPolicy":      {"policy"},
	"GetBucketPolicyStatus":   {"policyStatus"},
	"GetPublicAccessBlock":    {"publicAccessBlock"},
	"PutPublicAccessBlock":    {"publicAccessBlock"},
	"DeletePublicAccessBlock": {"publicAccessBlock"},
}

// aclHeaderOps are the operations that take x-amz-acl and x-amz-grant-*
// (acl.go); elsewhere they are refused.
var aclHeaderOps = map[string]bool{"CreateBucket": true, "PutObject": true, "CopyObject": true, "CreateMultipartUpload": true,
	"PutBucketAcl": true, "PutObjectAcl": true}

// ordinaryParams are the query parameters that tune an operation; they
// may be sent empty ("prefix=").
var ordinaryParams = map[string]bool{
	"prefix": true, "delimiter": true, "marker": true, "max-keys": true, "encoding-type": true, "list-type": true,
	"continuation-token": true, "fetch-owner": true, "start-after": true, "key-marker": true, "upload-id-marker": true,
	"max-uploads": true, "max-parts": true, "part-number-marker": true, "x-id": true,
}

// unservedSubResource returns the first sub-resource of the query that op
// does not serve: a known one, or any other parameter without a value
// ("?foo", "?foo="), which only sub-resources are. "" if none. Other
// unknown parameters with values are ignored, as S3 ignores them.
func unservedSubResource(op, rawQuery string) string {
	if rawQuery == "" {
		return ""
	}
	var found []string
	for _, part := range strings.Split(rawQuery, "&") {
		if part == "" {
			continue
		}
		k, v, _ := strings.Cut(part, "=")
		if dk, err := url.QueryUnescape(k); err == nil {
			k = dk
		}
		lk := strings.ToLower(k)
		if subResources[k] || (v == "" && !ordinaryParams[k] && !strings.HasPrefix(lk, "x-amz-") && !strings.HasPrefix(lk, "response-")) {
			found = append(found, k)
		}
	}
	sort.Strings(found)
	for _, k := range found {
		if !contains(opSubResources[op], k) {
			return k
		}
	}
	return ""
}

// checkVersionID accepts a versionId only where it names the current
// object: buckets are never versioned, so their objects' only version is
// "null", and S3 refuses any other ID for them.
func checkVersionID(q url.Values) *Error {
	vs, ok := q["versionId"]
	if !ok {
		return nil
	}
	if len(vs) != 1 || vs[0] != "null" {
		if len(vs) == 1 && vs[0] == "" {
			return errInvalidArgument("Version id cannot be the empty string")
		}
		return errInvalidArgument("Invalid version id specified")
	}
	return nil
}

// unsupportedHeaders refuses headers that ask for what the gateway does
// not do (Object Lock, server-side encryption, storage classes, website
// redirects, ACLs on operations that do not set one): accepting and
// ignoring them would tell the client its object is protected,
// encrypted or shared when it is not.
func unsupportedHeaders(op string, h http.Header) *Error {
	for k, vs := range h {
		if !isAmzHeader(k) {
			continue
		}
		// Most x-amz-* headers (the date, the payload hash, metadata) are
		// none of those below: found without lower-casing their names
		// (issue 15: allocations per request).
		if !refusableAmzHeader(k) {
			continue
		}
		lk := strings.ToLower(k)
		v := strings.TrimSpace(strings.Join(vs, ","))
		switch {
		case strings.HasPrefix(lk, "x-amz-object-lock-"):
			return errInvalidRequest("Bucket is missing Object Lock Configuration (%s: Object Lock is not implemented by this gateway)", lk)
		case lk == "x-amz-bucket-object-lock-enabled":
			if strings.EqualFold(v, "true") {
				return errNotImplemented("Object Lock (x-amz-bucket-object-lock-enabled)")
			}
		case lk == "x-amz-bypass-governance-retention":
			// Nothing is ever retained, so there is nothing to bypass.
		case strings.HasPrefix(lk, "x-amz-server-side-encryption"), strings.HasPrefix(lk, "x-amz-copy-source-server-side-encryption"):
			return errNotImplemented("server-side encryption (" + lk + ")")
		case lk == "x-amz-acl", strings.HasPrefix(lk, grantHeaderStart):
			if !aclHeaderOps[op] {
				return errNotImplemented(lk + " on " + op)
			}
		case lk == "x-amz-storage-class":
			if v != "STANDARD" {
				return errNotImplemented("storage class " + v)
			}
		case lk == "x-amz-website-redirect-location":
			return errNotImplemented("website redirects")
		}
	}
	return nil
}

// refusableAmzHeader tells, in any case, the x-amz-* names
// unsupportedHeaders looks at (the prefixes and names of its cases).
func refusableAmzHeader(k string) bool {
	for i := 0; i < len(k); i++ {
		if k[i] >= 0x80 {
			// strings.ToLower folds some non-ASCII letters to ASCII
			// (the Kelvin sign to k): let the full check decide.
			return true
		}
	}
	for _, p := range [...]string{"x-amz-object-lock-", "x-amz-bucket-object-lock-enabled", "x-amz-bypass-governance-retention",
		"x-amz-server-side-encryption", "x-amz-copy-source-server-side-encryption", "x-amz-acl", grantHeaderStart,
		"x-amz-storage-class", "x-amz-website-redirect-location"} {
		if len(k) >= len(p) && strings.EqualFold(k[:len(p)], p) {
			return true
		}
	}
	return false
}

// writePrecondition reads the conditional headers of a write (PutObject,
// CopyObject's destination, CompleteMultipartUpload): If-None-Match: *
// (create only) or If-Match: "etag" (replace only that version). They are
// decided by the namespace manager in the write's own Raft entry.
func writePrecondition(h http.Header) (*metapb.KeyPrecondition, *Error) {
	im, inm := strings.TrimSpace(h.Get("If-Match")), strings.TrimSpace(h.Get("If-None-Match"))
	switch {
	case im == "" && inm == "":
		return nil, nil
	case im != "" && inm != "":
		return nil, errNotImplemented("If-Match together with If-None-Match on a write")
	case inm != "":
		if inm != "*" {
			return nil, errNotImplemented("If-None-Match with an ETag on a write (only * is supported)")
		}
		return &metapb.KeyPrecondition{ExpectAbsent: true}, nil
	}
	if im == "*" || strings.Contains(im, ",") {
		return nil, errNotImplemented("If-Match with * or a list of ETags on a write")
	}
	etag := strings.Trim(strings.TrimPrefix(im, "W/"), `"`)
	if etag == "" {
		return nil, errInvalidArgument("If-Match names an empty ETag")
	}
	return &metapb.KeyPrecondition{ExpectEtag: etag}, nil
}

// checkPrecondition decides p against the key as the gateway read it
// (exists, etag): the early answer a write gets before it sends data.
func checkPrecondition(p *metapb.KeyPrecondition, exists bool, etag, key string) *Error {
	switch {
	case p == nil:
		return nil
	case p.ExpectAbsent && exists:
		return errPreconditionFailed
	case p.ExpectEtag != "" && !exists:
		return errNoSuchKey(key)
	case p.ExpectEtag != "" && p.ExpectEtag != etag:
		return errPreconditionFailed
	}
	return nil
}

var errConditionalConflict = errorf("ConditionalRequestConflict", 409,
	"A conditional request cannot succeed due to a conflicting operation against this resource.")

// ---------------------------------------------------------------- owners

// ownerCache caches buckets' owners so that the access check costs no
// metadata call per request. An owner never changes while its bucket
// lives; the TTL bounds how long a bucket deleted and re-created by
// another user (through another gateway) still looks like the old one's
// here. This gateway forgets a bucket it deletes or creates at once.
type ownerCache struct {
	ns  metapb.NamespaceClient
	ttl time.Duration
	now func() time.Time

	mu sync.Mutex
	m  map[string]ownerEntry
}

type ownerEntry struct {
	owner   string
	fetched time.Time
}

// get returns the owner of bucket in volume; exists is false when there
// is no such bucket (not cached: it may be created at any moment).
func (c *ownerCache) get(ctx context.Context, volume, bucket string) (owner string, exists bool, err error) {
	now := c.now()
	c.mu.Lock()
	e, ok := c.m[bucket]
	c.mu.Unlock()
	if ok && now.Sub(e.fetched) < c.ttl {
		return e.owner, true, nil
	}
	b, err := c.ns.GetBucket(ctx, &metapb.GetBucketRequest{Volume: volume, Name: bucket})
	if err != nil {
		err = client.FromRPC("get bucket", err)
		if errors.Is(err, client.ErrNotFound) {
			return "", false, nil
		}
		return "", false, err
	}
	c.mu.Lock()
	if len(c.m) >= maxCachedSecrets {
		c.m = map[string]ownerEntry{}
	}
	c.m[bucket] = ownerEntry{owner: b.Owner, fetched: now}
	c.mu.Unlock()
	return b.Owner, true, nil
}

func (c *ownerCache) forget(bucket string) {
	c.mu.Lock()
	delete(c.m, bucket)
	c.mu.Unlock()
}

// mayAccess reports whether the request's user may act on a bucket owned
// by owner: its owner, or an admin. Buckets made before owners were
// recorded (owner "") are the admins'.
func (a *auth) mayAccess(owner string) bool {
	return !a.anonymous && (a.admin || (owner != "" && owner == a.owner))
}

// bucketRecordOps read only the bucket's record, which the namespace
// shows every authenticated user: for anyone but the owner the gateway
// first checks that the requester may list the bucket (S3 asks for
// s3:ListBucket on HeadBucket).
var bucketRecordOps = map[string]bool{"HeadBucket": true, "GetBucketLocation": true, "GetBucketVersioning": true}

// authorizeBucket checks what the gateway checks itself before serving a
// request for bucket: X-Amz-Expected-Bucket-Owner, and, for anyone but
// the owner, the right to list a bucket whose record is read. Everything
// else (owners, ACLs, bucket policies, Block Public Access) the
// namespace decides on the calls the operation makes, for the requester.
// A bucket that does not exist passes: the operation itself answers
// NoSuchBucket.
func (g *Gateway) authorizeBucket(req *request, bucket string) *Error {
	if validBucket(bucket) != nil {
		return nil
	}
	var owner string
	var exists bool
	err := req.meta(func() (err error) {
		owner, exists, err = g.owners.get(req.r.Context(), g.cfg.Volume, bucket)
		return err
	})
	if err != nil {
		return fromBasalt(err, bucket, "")
	}
	if !exists {
		return nil
	}
	// X-Amz-Expected-Bucket-Owner: a mismatch is refused. For a
	// requester who is neither the owner nor an admin (anonymous ones
	// included) every refusal of this request reads the same plain
	// "Access Denied", the mismatch's and the namespace's alike, so that
	// the header cannot be used to probe owner names: as with S3, only a
	// requester the bucket serves learns whether the owner matched.
	if want := req.r.Header.Get("X-Amz-Expected-Bucket-Owner"); want != "" && bucket == req.bucket {
		if !req.auth.mayAccess(owner) {
			req.plainDenials = true
		}
		if want != owner {
			if req.plainDenials {
				return errAccessDenied("Access Denied")
			}
			return errAccessDenied("Access Denied: the bucket's owner is not the expected bucket owner")
		}
	}
	if req.auth.mayAccess(owner) || !bucketRecordOps[req.op] {
		return nil
	}
	err = req.meta(func() error {
		_, err := g.ns.ListKeys(req.r.Context(), &metapb.ListKeysRequest{Volume: g.cfg.Volume, Bucket: bucket, PageSize: 1})
		return err
	})
	if err != nil {
		return fromBasalt(client.FromRPC("list keys", err), bucket, "")
	}
	return nil
}
