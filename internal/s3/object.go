package s3

import (
	"crypto/md5"
	"encoding/hex"
	"encoding/xml"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

const (
	maxUserMetaBytes = 2 << 10 // S3: user metadata, names and values
	maxTags          = 10
	maxDeleteObjects = 1000
	deleteWorkers    = 16
	maxKeyBytes      = 1024
)

func checkKey(key string) *Error {
	if len(key) > maxKeyBytes {
		return errorf("KeyTooLongError", 400, "Your key is too long: %d bytes, at most %d", len(key), maxKeyBytes)
	}
	return nil
}

// metaFromHeaders reads what S3 stores with an object from a PUT, a copy
// with REPLACE, or CreateMultipartUpload.
func metaFromHeaders(h http.Header) (*metapb.ObjectMeta, *Error) {
	m := &metapb.ObjectMeta{
		ContentType: h.Get("Content-Type"), ContentDisposition: h.Get("Content-Disposition"),
		ContentLanguage: h.Get("Content-Language"), CacheControl: h.Get("Cache-Control"), Expires: h.Get("Expires"),
	}
	// aws-chunked is how the body travelled, not how it is stored.
	if ce := h.Get("Content-Encoding"); ce != "" {
		var enc []string
		for _, e := range strings.Split(ce, ",") {
			if e = strings.TrimSpace(e); e != "" && !strings.EqualFold(e, "aws-chunked") {
				enc = append(enc, e)
			}
		}
		m.ContentEncoding = strings.Join(enc, ",")
	}
	size := 0
	const metaPrefix = "x-amz-meta-"
	for k, vs := range h {
		// Only user metadata headers are lowered (the others would each
		// cost an allocation).
		if len(k) < len(metaPrefix) || !strings.EqualFold(k[:len(metaPrefix)], metaPrefix) {
			continue
		}
		name := strings.ToLower(k[len(metaPrefix):])
		if m.User == nil {
			m.User = map[string]string{}
		}
		v := strings.Join(vs, ",")
		m.User[name] = v
		size += len(name) + len(v)
	}
	if size > maxUserMetaBytes {
		return nil, errorf("MetadataTooLarge", 400, "Your metadata headers are %d bytes; at most %d are allowed", size, maxUserMetaBytes)
	}
	if t := h.Get("X-Amz-Tagging"); t != "" {
		vals, err := url.ParseQuery(t)
		if err != nil {
			return nil, errorf("InvalidTag", 400, "The x-amz-tagging header is not a valid query string: %v", err)
		}
		m.Tags = map[string]string{}
		for k, vs := range vals {
			if len(vs) != 1 {
				return nil, errorf("InvalidTag", 400, "Cannot provide multiple Tags with the same key: %q", k)
			}
			m.Tags[k] = vs[0]
		}
		if e := validTags(m.Tags); e != nil {
			return nil, e
		}
	}
	return m, nil
}

func validTags(tags map[string]string) *Error {
	if len(tags) > maxTags {
		return errorf("BadRequest", 400, "Object tags cannot be greater than %d", maxTags)
	}
	for k, v := range tags {
		if k == "" || len(k) > 128 {
			return errorf("InvalidTag", 400, "The TagKey you have provided is invalid: %q", k)
		}
		if len(v) > 256 {
			return errorf("InvalidTag", 400, "The TagValue you have provided is too long: %d characters", len(v))
		}
	}
	return nil
}

func etagOf(m *metapb.ObjectMeta) string { return `"` + m.GetEtag() + `"` }

// setObjectHeaders sets the headers GET and HEAD return.
func setObjectHeaders(h http.Header, ki *client.KeyInfo) {
	m := ki.Meta
	ct := m.GetContentType()
	if ct == "" {
		ct = "binary/octet-stream"
	}
	// As h.Set with the keys in canonical form, the four values in one
	// array (issue 15: allocations per HEAD).
	vals := [...]string{etagOf(m), ki.Modified.UTC().Format(http.TimeFormat), "bytes", ct}
	vs := vals[:]
	h["Etag"] = vs[0:1:1]
	h["Last-Modified"] = vs[1:2:2]
	h["Accept-Ranges"] = vs[2:3:3]
	h["Content-Type"] = vs[3:4:4]
	for _, f := range [...]struct{ name, v string }{{"Content-Encoding", m.GetContentEncoding()}, {"Content-Disposition", m.GetContentDisposition()},
		{"Content-Language", m.GetContentLanguage()}, {"Cache-Control", m.GetCacheControl()}, {"Expires", m.GetExpires()}} {
		if f.v != "" {
			h.Set(f.name, f.v)
		}
	}
	for k, v := range m.GetUser() {
		h["X-Amz-Meta-"+k] = []string{v}
	}
	if n := len(m.GetTags()); n > 0 {
		h.Set("X-Amz-Tagging-Count", strconv.Itoa(n))
	}
	if n := m.GetPartsCount(); n > 0 {
		h.Set("X-Amz-Mp-Parts-Count", strconv.Itoa(int(n)))
	}
}

// etagMatches implements If-Match / If-None-Match lists ("*" matches any).
func etagMatches(list, etag string) bool {
	for _, e := range strings.Split(list, ",") {
		e = strings.TrimSpace(e)
		if e == "*" || strings.Trim(strings.TrimPrefix(e, "W/"), `"`) == etag {
			return true
		}
	}
	return false
}

// conditions evaluates the conditional headers (RFC 9110 §13.2.2 order,
// as S3 does): a true If-Match overrides If-Unmodified-Since, a false
// If-None-Match overrides If-Modified-Since. notModified is the 304 case.
func conditions(h http.Header, prefix, etag string, mod time.Time) (notModified bool, e *Error) {
	mod = mod.Truncate(time.Second)
	im, inm := h.Get(prefix+"If-Match"), h.Get(prefix+"If-None-Match")
	if im != "" {
		if !etagMatches(im, etag) {
			return false, errPreconditionFailed
		}
	} else if v := h.Get(prefix + "If-Unmodified-Since"); v != "" {
		if t, err := http.ParseTime(v); err == nil && mod.After(t) {
			return false, errPreconditionFailed
		}
	}
	if inm != "" {
		if etagMatches(inm, etag) {
			return true, nil
		}
	} else if v := h.Get(prefix + "If-Modified-Since"); v != "" {
		if t, err := http.ParseTime(v); err == nil && !mod.After(t) {
			return true, nil
		}
	}
	return false, nil
}

// parseRange reads "bytes=a-b", "bytes=a-" and "bytes=-n". ok=false means
// the header is ignored (as S3 ignores ranges it cannot parse); e is
// InvalidRange when nothing of the object is in it.
func parseRange(v string, size int64) (start, length int64, ok bool, e *Error) {
	spec, found := strings.CutPrefix(v, "bytes=")
	if !found || strings.Contains(spec, ",") {
		return 0, 0, false, nil
	}
	a, b, found := strings.Cut(strings.TrimSpace(spec), "-")
	if !found {
		return 0, 0, false, nil
	}
	invalid := errorf("InvalidRange", 416, "The requested range %q is not satisfiable for an object of %d bytes", v, size)
	if a == "" {
		n, err := strconv.ParseInt(b, 10, 64)
		if err != nil || n < 0 {
			return 0, 0, false, nil
		}
		if n == 0 || size == 0 {
			return 0, 0, false, invalid
		}
		n = min(n, size)
		return size - n, n, true, nil
	}
	s, err := strconv.ParseInt(a, 10, 64)
	if err != nil || s < 0 {
		return 0, 0, false, nil
	}
	end := size - 1
	if b != "" {
		if end, err = strconv.ParseInt(b, 10, 64); err != nil || end < s {
			return 0, 0, false, nil
		}
		end = min(end, size-1)
	}
	if s >= size {
		return 0, 0, false, invalid
	}
	return s, end - s + 1, true, nil
}

func (g *Gateway) getObject(req *request) *Error  { return g.readObject(req, false) }
func (g *Gateway) headObject(req *request) *Error { return g.readObject(req, true) }

// readObject serves GET and HEAD: one metadata call (the reader's lookup),
// then the data streams from the datanodes to the socket.
// responseOverrides are GET's and HEAD's response-* query parameters and
// the headers they set.
var responseOverrides = [...]struct{ param, header string }{{"response-content-type", "Content-Type"}, {"response-content-language", "Content-Language"},
	{"response-expires", "Expires"}, {"response-cache-control", "Cache-Control"}, {"response-content-disposition", "Content-Disposition"},
	{"response-content-encoding", "Content-Encoding"}}

func (g *Gateway) readObject(req *request, head bool) *Error {
	if e := checkKey(req.key); e != nil {
		return e
	}
	ctx := req.r.Context()
	var kr *client.KeyReader
	var ki client.KeyInfo
	err := req.meta(func() (err error) {
		if head {
			ki, err = g.cl.HeadKey(ctx, g.cfg.Volume, req.bucket, req.key)
			return err
		}
		kr, err = g.cl.GetKey(ctx, g.cfg.Volume, req.bucket, req.key)
		if err == nil {
			ki = kr.Info()
		}
		return err
	})
	if err != nil {
		return fromBasalt(err, req.bucket, req.key)
	}
	if kr != nil {
		defer kr.Close()
	}
	q := query(req.r)
	if e := checkPartNumber(q, ki.Meta); e != nil {
		return e
	}
	h := req.w.Header()
	notModified, e := conditions(req.r.Header, "", ki.Meta.GetEtag(), ki.Modified)
	if e != nil {
		return e
	}
	if notModified {
		h.Set("ETag", etagOf(ki.Meta))
		h.Set("Last-Modified", ki.Modified.UTC().Format(http.TimeFormat))
		req.w.WriteHeader(http.StatusNotModified)
		return nil
	}
	size := int64(ki.Size)
	start, length, ranged := int64(0), size, false
	if v := req.r.Header.Get("Range"); v != "" {
		var e *Error
		if start, length, ranged, e = parseRange(v, size); e != nil {
			h.Set("Content-Range", fmt.Sprintf("bytes */%d", size))
			return e
		}
		if !ranged {
			start, length = 0, size
		}
	}
	setObjectHeaders(h, &ki)
	for _, o := range responseOverrides {
		if v := q.Get(o.param); v != "" {
			h.Set(o.header, v)
		}
	}
	if !ranged && strings.EqualFold(req.r.Header.Get("X-Amz-Checksum-Mode"), "ENABLED") {
		for alg, v := range ki.Meta.GetChecksums() {
			h.Set("X-Amz-Checksum-"+alg, v)
		}
	}
	h.Set("Content-Length", strconv.FormatInt(length, 10))
	status := http.StatusOK
	if ranged {
		h.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, start+length-1, size))
		status = http.StatusPartialContent
	}
	req.w.WriteHeader(status)
	if head || length == 0 {
		return nil
	}
	t := time.Now()
	defer func() { req.stages.data += time.Since(t) }()
	if _, err := kr.Seek(start, io.SeekStart); err != nil {
		panic(http.ErrAbortHandler)
	}
	iw := newIdleWriter(req.w, g.cfg.BodyIdleTimeout)
	iw.inPlace = req.r.ProtoMajor == 1
	defer iw.stop()
	if err := writeObjectBody(iw, kr, start, length); err != nil {
		// The status is sent; cutting the connection is the only way to
		// tell the client the body is incomplete.
		if ctx.Err() == nil {
			g.cfg.Logger.Debug("s3: GET body failed", "bucket", req.bucket, "key", req.key, "err", err)
		}
		panic(http.ErrAbortHandler)
	}
	return nil
}

// checkPartNumber accepts GET and HEAD ?partNumber=N where the answer is
// the whole object: part 1 of an object not uploaded in parts. Parts of a
// multipart object are not served one by one (their boundaries are not
// kept), so that is refused rather than answered with the whole object.
func checkPartNumber(q url.Values, m *metapb.ObjectMeta) *Error {
	v, ok := q["partNumber"]
	if !ok {
		return nil
	}
	n, err := strconv.Atoi(v[0])
	if len(v) != 1 || err != nil || n < 1 || n > namespace.MaxPartNumber {
		return errInvalidArgument("Part number must be an integer between 1 and %d, inclusive", namespace.MaxPartNumber)
	}
	if m.GetPartsCount() > 0 {
		return errNotImplemented("GET or HEAD of one part of a multipart object (?partNumber)")
	}
	if n != 1 {
		return errorf("InvalidPartNumber", 416, "The requested partnumber is not satisfiable")
	}
	return nil
}

// putData streams a body into key and commits it with meta (ETag and
// checksum filled in from the data). part, if set, commits it as a part.
// pre, if set, is decided in the commit's Raft entry. When r is a request
// *body whose CRC32C checksum comes from the write path, the client
// reports it and it is verified before the commit.
func (g *Gateway) putData(req *request, key string, r io.Reader, sizeHint int64, meta *metapb.ObjectMeta, part *metapb.PartRef, pre *metapb.KeyPrecondition, etag func() string) (client.KeyInfo, error) {
	t := time.Now()
	var committing time.Time
	b, _ := r.(*body)
	var dataCRC func(uint32)
	if b != nil && b.crcFromWrite {
		dataCRC = b.setWriteCRC
	}
	if b != nil {
		b.late = true // its digests are checked in BeforeCommit
		b.deepen()    // it holds an upload slot (hashBufs)
	}
	ki, err := g.cl.PutKey(req.r.Context(), g.cfg.Volume, req.bucket, key, r, client.PutOptions{
		SizeHint:     max(sizeHint, 0),
		DataCRC32C:   dataCRC,
		BufferBudget: g.budget,
		BeforeCommit: func(c *metapb.CommitKeyRequest) error {
			if b != nil {
				// Late digests: checked here, so a mismatch leaves the
				// key uncommitted (the wait counts in data_tail).
				if err := b.settle(); err != nil {
					return err
				}
			}
			committing = time.Now()
			if b != nil {
				// A CRC32C checksum the write path summed: checked here,
				// so a mismatch leaves the key uncommitted.
				if err := b.verifyWriteCRC(); err != nil {
					return err
				}
			}
			if part != nil {
				part.Etag = etag()
				c.Part = part
				return nil
			}
			meta.Etag = etag()
			c.Meta = meta
			c.Precondition = pre
			c.Acls = req.acls // the new version's own ACL, in its commit
			return nil
		},
	})
	if err != nil && b != nil && b.late && b.eof && !b.settled {
		// The write path failed after the body's end, before
		// BeforeCommit: its digests are still checked, so a bad one is
		// the client's BadDigest (400, as when checked at EOF), not the
		// write path's retryable error (bodyOr prefers the body's).
		b.settle()
	}
	if b != nil {
		b.timeline(&req.stages, committing)
	}
	if committing.IsZero() {
		req.stages.data += time.Since(t)
	} else {
		req.stages.data += committing.Sub(t)
		req.stages.meta += time.Since(committing)
	}
	return ki, err
}

func (g *Gateway) putObject(req *request) *Error {
	if e := checkKey(req.key); e != nil {
		return e
	}
	b, e := newBody(req.r, req.auth, MaxObjectSize, true)
	if e != nil {
		return e
	}
	defer b.close()
	meta, e := metaFromHeaders(req.r.Header)
	if e != nil {
		return e
	}
	pre, e := writePrecondition(req.r.Header)
	if e != nil {
		return e
	}
	if req.acls, _, e = g.aclFromRequest(req, false); e != nil {
		return e
	}
	if pre != nil {
		// Decided early too, so that a write bound to fail sends no data.
		if e := g.precheck(req, pre); e != nil {
			return e
		}
	}
	_, err := g.putData(req, req.key, b, b.want, meta, nil, pre, func() string {
		if alg, v := b.checksum(); alg != "" {
			meta.Checksums = map[string]string{alg: v}
		}
		return b.etag()
	})
	if err != nil {
		e := bodyOr(b, err, req)
		if pre != nil && (e.Code == "PreconditionFailed" || e.Code == "NoSuchKey") {
			// It held when the upload started: another write got in.
			e = errConditionalConflict
		}
		return e
	}
	h := req.w.Header()
	h.Set("ETag", etagOf(meta))
	if alg, v := b.checksum(); alg != "" {
		h.Set("X-Amz-Checksum-"+alg, v)
	}
	req.w.WriteHeader(http.StatusOK)
	return nil
}

// precheck decides a write precondition against the key as it is now.
func (g *Gateway) precheck(req *request, pre *metapb.KeyPrecondition) *Error {
	var ki client.KeyInfo
	err := req.meta(func() (err error) {
		ki, err = g.cl.HeadKey(req.r.Context(), g.cfg.Volume, req.bucket, req.key)
		return err
	})
	exists := err == nil
	if err != nil && !errors.Is(err, client.ErrKeyNotFound) {
		return fromBasalt(err, req.bucket, req.key)
	}
	return checkPrecondition(pre, exists, ki.Meta.GetEtag(), req.key)
}

// bodyOr prefers the body's own failure (bad signature, digest, short
// body) over the write error it caused.
func bodyOr(b *body, err error, req *request) *Error {
	if b.err != nil {
		var se *Error
		if errors.As(b.err, &se) {
			return se
		}
	}
	return fromBasalt(err, req.bucket, req.key)
}

func (g *Gateway) deleteObject(req *request) *Error {
	for _, c := range []string{"If-Match", "X-Amz-If-Match-Last-Modified-Time", "X-Amz-If-Match-Size"} {
		if req.r.Header.Get(c) != "" {
			return errNotImplemented("conditional deletes (" + c + ")")
		}
	}
	var e *Error
	req.meta(func() error { e = g.deleteOne(req, req.key); return nil })
	if e != nil {
		return e
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}

// deleteOne deletes a key; a missing key is success, as in S3. It may
// run on several goroutines of one request, so it records no stages.
func (g *Gateway) deleteOne(req *request, key string) *Error {
	if e := checkKey(key); e != nil {
		return e
	}
	if err := g.cl.DeleteKey(req.r.Context(), g.cfg.Volume, req.bucket, key, false); err != nil {
		e := fromBasalt(err, req.bucket, key)
		if e.Code == "NoSuchKey" || (e.Code == "InvalidArgument" && key == "") {
			return nil
		}
		return e
	}
	return nil
}

// deleteRequest is a DeleteObjects body.
type deleteRequest struct {
	XMLName xml.Name `xml:"Delete"`
	Quiet   bool     `xml:"Quiet"`
	Objects []struct {
		Key string `xml:"Key"`
	} `xml:"Object"`
}

// parseDeleteObjects reads a DeleteObjects body: 1 to 1,000 keys.
func parseDeleteObjects(req *request) (*deleteRequest, *Error) {
	var in deleteRequest
	if e := readXML(req, &in); e != nil {
		return nil, e
	}
	if len(in.Objects) == 0 || len(in.Objects) > maxDeleteObjects {
		return nil, errMalformedXML(fmt.Errorf("%d objects; 1 to %d allowed", len(in.Objects), maxDeleteObjects))
	}
	return &in, nil
}

func (g *Gateway) deleteObjects(req *request) *Error {
	in, e := parseDeleteObjects(req)
	if e != nil {
		return e
	}
	if e := g.bucketExists(req); e != nil {
		return e
	}
	type deleted struct {
		Key string `xml:"Key"`
	}
	type delErr struct {
		Key     string `xml:"Key"`
		Code    string `xml:"Code"`
		Message string `xml:"Message"`
	}
	errs := make([]*Error, len(in.Objects))
	// Bounded parallelism: each delete is one Raft entry on the namespace
	// manager, which batches concurrent entries.
	var wg sync.WaitGroup
	sem := make(chan struct{}, deleteWorkers)
	var mu sync.Mutex
	t := time.Now()
	for i, o := range in.Objects {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			e := g.deleteOne(req, o.Key)
			mu.Lock()
			errs[i] = e
			mu.Unlock()
		}()
	}
	wg.Wait()
	req.stages.meta += time.Since(t)
	type result struct {
		XMLName xml.Name  `xml:"http://s3.amazonaws.com/doc/2006-03-01/ DeleteResult"`
		Deleted []deleted `xml:"Deleted"`
		Errors  []delErr  `xml:"Error"`
	}
	var res result
	for i, o := range in.Objects {
		if e := errs[i]; e != nil {
			res.Errors = append(res.Errors, delErr{Key: o.Key, Code: e.Code, Message: e.Message})
		} else if !in.Quiet {
			res.Deleted = append(res.Deleted, deleted{Key: o.Key})
		}
	}
	return writeXML(req, res)
}

// copySource parses x-amz-copy-source: "[/]bucket/key[?versionId=...]",
// URL-encoded.
func copySource(v string) (bucket, key string, e *Error) {
	v, version, _ := strings.Cut(v, "?")
	if version != "" && version != "versionId=null" {
		return "", "", errInvalidArgument("Invalid version id specified in the copy source: %q", version)
	}
	d, err := url.PathUnescape(v)
	if err != nil {
		return "", "", errInvalidArgument("Invalid copy source encoding: %q", v)
	}
	bucket, key, ok := strings.Cut(strings.TrimPrefix(d, "/"), "/")
	if !ok || bucket == "" || key == "" {
		return "", "", errInvalidArgument("Copy Source must mention the source bucket and key: sourcebucket/sourcekey")
	}
	return bucket, key, nil
}

// md5Reader computes the ETag of data copied through the gateway.
type md5Reader struct {
	r io.Reader
	h hash.Hash
}

func (m *md5Reader) Read(p []byte) (int, error) {
	n, err := m.r.Read(p)
	m.h.Write(p[:n])
	return n, err
}

// openSource looks up the copy source and checks the copy-source
// conditions against that version.
func (g *Gateway) openSource(req *request) (srcBucket, srcKey string, ki client.KeyInfo, e *Error) {
	srcBucket, srcKey, e = copySource(req.r.Header.Get("X-Amz-Copy-Source"))
	if e != nil {
		return
	}
	if e = g.authorizeBucket(req, srcBucket); e != nil {
		return
	}
	err := req.meta(func() (err error) {
		ki, err = g.cl.StatKey(req.r.Context(), g.cfg.Volume, srcBucket, srcKey)
		return err
	})
	if err != nil {
		e = fromBasalt(err, srcBucket, srcKey)
		return
	}
	notModified, e := conditions(req.r.Header, "X-Amz-Copy-Source-", ki.Meta.GetEtag(), ki.Modified)
	if e == nil && notModified {
		e = errPreconditionFailed
	}
	return
}

// readSource opens a reader on version objectID of the copy source, the
// one openSource checked the conditions against.
func (g *Gateway) readSource(req *request, bucket, key string, objectID uint64) (*client.KeyReader, *Error) {
	var kr *client.KeyReader
	err := req.meta(func() (err error) {
		kr, err = g.cl.GetKey(req.r.Context(), g.cfg.Volume, bucket, key)
		return err
	})
	if err != nil {
		return nil, fromBasalt(err, bucket, key)
	}
	if id := kr.Info().ObjectID; id != objectID {
		kr.Close()
		return nil, errorf("OperationAborted", 409, "A conflicting conditional operation is in progress against this resource: copy source %s/%s changed while being copied (object %d, expected %d)", bucket, key, id, objectID)
	}
	return kr, nil
}

// shareCopy asks the namespace manager for a copy that shares the
// source's blocks (CopyKey). shared is false, with no error, when the
// blocks cannot be shared (NOT_SHAREABLE) and the caller must stream.
func (g *Gateway) shareCopy(req *request, creq *metapb.CopyKeyRequest) (ki *metapb.KeyInfo, shared bool, err error) {
	err = req.meta(func() (err error) {
		ki, err = g.ns.CopyKey(req.r.Context(), creq)
		return err
	})
	if namespace.Reason(err) == namespace.ReasonNotShareable {
		g.cfg.Logger.Debug("s3: copy streams the data", "bucket", creq.SrcBucket, "key", creq.SrcKey, "why", message(err))
		return nil, false, nil
	}
	return ki, err == nil, err
}

func (g *Gateway) copyObject(req *request) *Error {
	if e := checkKey(req.key); e != nil {
		return e
	}
	h := req.r.Header
	mdir, tdir := strings.ToUpper(h.Get("X-Amz-Metadata-Directive")), strings.ToUpper(h.Get("X-Amz-Tagging-Directive"))
	for _, d := range []string{mdir, tdir} {
		if d != "" && d != "COPY" && d != "REPLACE" {
			return errInvalidArgument("Unknown metadata or tagging directive %q", d)
		}
	}
	srcBucket, srcKey, e := copySource(h.Get("X-Amz-Copy-Source"))
	if e != nil {
		return e
	}
	self := srcBucket == req.bucket && srcKey == req.key
	if self && mdir != "REPLACE" && tdir != "REPLACE" {
		return errInvalidRequest("This copy request is illegal because it is trying to copy an object to itself without changing the object's metadata, storage class, website redirect location or encryption attributes.")
	}
	pre, e := writePrecondition(h)
	if e != nil {
		return e
	}
	acls, withACL, e := g.aclFromRequest(req, false)
	if e != nil {
		return e
	}
	req.acls = acls // a streamed copy commits with it
	_, _, src, e := g.openSource(req)
	if e != nil {
		return e
	}
	if self {
		// The destination is the source as read; the version check below
		// makes the answer hold at the write.
		if e := checkPrecondition(pre, true, src.Meta.GetEtag(), req.key); e != nil {
			return e
		}
	}
	if src.Size > MaxObjectSize {
		return errInvalidRequest("The specified copy source is larger than the maximum allowable size for a copy source: %d", MaxObjectSize)
	}
	meta := proto.Clone(src.Meta).(*metapb.ObjectMeta)
	if meta == nil {
		meta = &metapb.ObjectMeta{}
	}
	replace := mdir == "REPLACE" || tdir == "REPLACE"
	if replace {
		hm, e := metaFromHeaders(h)
		if e != nil {
			return e
		}
		if mdir == "REPLACE" {
			meta.ContentType, meta.ContentEncoding, meta.ContentDisposition = hm.ContentType, hm.ContentEncoding, hm.ContentDisposition
			meta.ContentLanguage, meta.CacheControl, meta.Expires, meta.User = hm.ContentLanguage, hm.CacheControl, hm.Expires, hm.User
		}
		if tdir == "REPLACE" {
			meta.Tags = hm.Tags
		}
	}
	var out client.KeyInfo
	var err error
	shared := false
	switch {
	case self:
		// Only the attributes change: no data moves, the key keeps its
		// blocks and object ID. The version check keeps a concurrent
		// overwrite from getting the old attributes.
		err = req.meta(func() error {
			r, err := g.ns.SetKeyMeta(req.r.Context(), &metapb.SetKeyMetaRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key,
				Meta: meta, ExpectObjectId: src.ObjectID, Touch: true})
			if err == nil {
				out = client.KeyInfo{Modified: time.UnixMilli(r.ModifiedUnixMs).UTC(), Meta: r.Meta}
			}
			return err
		})
		shared = err == nil
	case src.Meta.GetEtag() != "":
		// The copy holds the source's blocks: one Raft entry whatever the
		// size. Its ETag is the source's (the same bytes; for a multipart
		// source S3 would compute a new one, but any ETag naming these
		// bytes is valid).
		var r *metapb.KeyInfo
		r, shared, err = g.shareCopy(req, &metapb.CopyKeyRequest{Volume: g.cfg.Volume, SrcBucket: srcBucket, SrcKey: srcKey, ExpectObjectId: src.ObjectID,
			Bucket: req.bucket, Key: req.key, ReplaceMeta: replace, Meta: meta, Precondition: pre})
		if shared {
			out = client.KeyInfo{Modified: time.UnixMilli(r.ModifiedUnixMs).UTC(), Meta: r.Meta}
		}
	}
	if err == nil && !shared {
		// The source has no ETag (written without S3), or its replication
		// differs from the bucket's: stream the bytes and compute the MD5.
		kr, e := g.readSource(req, srcBucket, srcKey, src.ObjectID)
		if e != nil {
			return e
		}
		defer kr.Close()
		mr := &md5Reader{r: kr, h: md5.New()}
		meta.PartsCount = 0
		out, err = g.putData(req, req.key, mr, int64(src.Size), meta, nil, pre, func() string { return hex.EncodeToString(mr.h.Sum(nil)) })
		out.Meta = meta
	}
	if err != nil {
		return fromBasalt(err, req.bucket, req.key)
	}
	if withACL && (self || (shared && len(acls) > 0)) {
		// S3 gives a copy the ACL the request names (else the default):
		// the source's is never copied. A shared copy starts private; a
		// copy onto itself keeps its ACL unless the request names one.
		if e := g.applyACL(req, req.key, acls); e != nil {
			return e
		}
	}
	how := "streamed"
	if shared {
		how = "shared"
	}
	g.metrics.copied.WithLabelValues(how).Add(float64(src.Size))
	type result struct {
		XMLName      xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ CopyObjectResult"`
		LastModified string   `xml:"LastModified"`
		ETag         string   `xml:"ETag"`
	}
	return writeXML(req, result{LastModified: out.Modified.UTC().Format(s3TimeFormat), ETag: etagOf(out.Meta)})
}

type tagSet struct {
	XMLName xml.Name `xml:"Tagging"`
	Tags    []struct {
		Key   string `xml:"Key"`
		Value string `xml:"Value"`
	} `xml:"TagSet>Tag"`
}

func (g *Gateway) getObjectTagging(req *request) *Error {
	var ki client.KeyInfo
	err := req.meta(func() (err error) {
		ki, err = g.cl.StatKey(req.r.Context(), g.cfg.Volume, req.bucket, req.key)
		return err
	})
	if err != nil {
		return fromBasalt(err, req.bucket, req.key)
	}
	type tag struct {
		Key   string `xml:"Key"`
		Value string `xml:"Value"`
	}
	type result struct {
		XMLName xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ Tagging"`
		Tags    []tag    `xml:"TagSet>Tag"`
	}
	res := result{Tags: []tag{}}
	keys := make([]string, 0, len(ki.Meta.GetTags()))
	for k := range ki.Meta.GetTags() {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		res.Tags = append(res.Tags, tag{Key: k, Value: ki.Meta.Tags[k]})
	}
	return writeXML(req, res)
}

// parseTagging reads a PutObjectTagging body: valid tags, no key twice.
func parseTagging(req *request) (map[string]string, *Error) {
	var in tagSet
	if e := readXML(req, &in); e != nil {
		return nil, e
	}
	tags := map[string]string{}
	for _, t := range in.Tags {
		if _, dup := tags[t.Key]; dup {
			return nil, errorf("InvalidTag", 400, "Cannot provide multiple Tags with the same key: %q", t.Key)
		}
		tags[t.Key] = t.Value
	}
	if e := validTags(tags); e != nil {
		return nil, e
	}
	return tags, nil
}

func (g *Gateway) putObjectTagging(req *request) *Error {
	tags, e := parseTagging(req)
	if e != nil {
		return e
	}
	if e := g.setTags(req, tags); e != nil {
		return e
	}
	req.w.WriteHeader(http.StatusOK)
	return nil
}

func (g *Gateway) deleteObjectTagging(req *request) *Error {
	if e := g.setTags(req, nil); e != nil {
		return e
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}

// setTags replaces the key's tags, re-reading the key if it changed
// between the read and the write (bounded retries).
func (g *Gateway) setTags(req *request, tags map[string]string) *Error {
	ctx := req.r.Context()
	var err error
	for range 3 {
		var ki client.KeyInfo
		err = req.meta(func() (err error) {
			ki, err = g.cl.StatKey(ctx, g.cfg.Volume, req.bucket, req.key)
			return err
		})
		if err != nil {
			return fromBasalt(err, req.bucket, req.key)
		}
		meta := proto.Clone(ki.Meta).(*metapb.ObjectMeta)
		if meta == nil {
			meta = &metapb.ObjectMeta{}
		}
		meta.Tags = tags
		err = req.meta(func() error {
			_, err := g.ns.SetKeyMeta(ctx, &metapb.SetKeyMetaRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key, Meta: meta, ExpectObjectId: ki.ObjectID})
			return err
		})
		if namespace.Reason(err) != namespace.ReasonVersionChanged {
			break
		}
	}
	if err != nil {
		return fromBasalt(err, req.bucket, req.key)
	}
	return nil
}
