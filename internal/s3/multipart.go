package s3

import (
	"crypto/md5"
	"encoding/hex"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

// Multipart uploads: the namespace manager keeps the upload and its parts;
// each part is written like a key (its own blocks) and committed into the
// upload, or copied from a key (sharing its blocks where it can), and
// Complete makes the parts' blocks the object's, in order, without moving
// data.

func (g *Gateway) createMultipartUpload(req *request) *Error {
	if e := checkKey(req.key); e != nil {
		return e
	}
	meta, e := metaFromHeaders(req.r.Header)
	if e != nil {
		return e
	}
	// The ACL waits in the upload (ObjectMeta.upload_acls) for Complete,
	// which commits it with the object.
	acls, _, e := g.aclFromRequest(req, false)
	if e != nil {
		return e
	}
	meta.UploadAcls = acls
	if len(acls) > 0 {
		// Complete reads the ACL back with ListParts as the requester:
		// one who may not list parts (a policy granting s3:PutObject
		// alone) could not find it then, so such an upload is refused
		// now rather than completed without its ACL. The namespace
		// decides the right on the bucket before looking for the upload.
		err := req.meta(func() error {
			_, err := g.ns.ListParts(req.r.Context(), &metapb.ListPartsRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key,
				UploadId: "acl-probe", MaxParts: 1})
			return err
		})
		if err != nil && errors.Is(client.FromRPC("list parts", err), client.ErrPermissionDenied) {
			return errAccessDenied("Access Denied: an ACL on CreateMultipartUpload needs the right to list the upload's parts (s3:ListMultipartUploadParts); set the ACL with PutObjectAcl after CompleteMultipartUpload")
		}
	}
	var u *metapb.MultipartUpload
	err := req.meta(func() (err error) {
		u, err = g.ns.CreateMultipartUpload(req.r.Context(), &metapb.CreateMultipartUploadRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key, Meta: meta})
		return err
	})
	if err != nil {
		return fromBasalt(err, req.bucket, "")
	}
	type result struct {
		XMLName  xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ InitiateMultipartUploadResult"`
		Bucket   string   `xml:"Bucket"`
		Key      string   `xml:"Key"`
		UploadID string   `xml:"UploadId"`
	}
	return writeXML(req, result{Bucket: req.bucket, Key: req.key, UploadID: u.UploadId})
}

func partRef(req *request) (*metapb.PartRef, *Error) {
	q := req.r.URL.Query()
	n, err := strconv.Atoi(q.Get("partNumber"))
	if err != nil || n < 1 || n > namespace.MaxPartNumber {
		return nil, errInvalidArgument("Part number must be an integer between 1 and %d, inclusive", namespace.MaxPartNumber)
	}
	return &metapb.PartRef{UploadId: q.Get("uploadId"), PartNumber: uint32(n)}, nil
}

func (g *Gateway) uploadPart(req *request) *Error {
	part, e := partRef(req)
	if e != nil {
		return e
	}
	b, e := newBody(req.r, req.auth, MaxObjectSize, true)
	if e != nil {
		return e
	}
	defer b.close()
	if _, err := g.putData(req, req.key, b, b.want, nil, part, nil, b.etag); err != nil {
		e := bodyOr(b, err, req)
		if e.Code == "NoSuchUpload" {
			e = errNoSuchUpload(part.UploadId)
		}
		return e
	}
	req.w.Header().Set("ETag", `"`+part.Etag+`"`)
	if alg, v := b.checksum(); alg != "" {
		req.w.Header().Set("X-Amz-Checksum-"+alg, v)
	}
	req.w.WriteHeader(http.StatusOK)
	return nil
}

// uploadPartCopy copies a source object, or a range of it, into a part.
// When the range starts where one of the source's blocks does, the part
// holds the source's blocks (the last one possibly a prefix of a block)
// and no data moves. Otherwise the range cannot be expressed as whole
// source blocks, and the bytes stream through the gateway into blocks of
// the part's own: correct, just slower.
func (g *Gateway) uploadPartCopy(req *request) *Error {
	part, e := partRef(req)
	if e != nil {
		return e
	}
	srcBucket, srcKey, src, e := g.openSource(req)
	if e != nil {
		return e
	}
	start, length := int64(0), int64(src.Size)
	if v := req.r.Header.Get("X-Amz-Copy-Source-Range"); v != "" {
		s, n, ok, e := parseRange(v, length)
		if e != nil || !ok || s+n > length {
			return errInvalidArgument("The x-amz-copy-source-range value %q must be of the form bytes=first-last within the source object of %d bytes", v, src.Size)
		}
		start, length = s, n
	}
	if length > MaxObjectSize {
		return errInvalidRequest("The specified copy source is larger than the maximum allowable size for a copy source: %d", MaxObjectSize)
	}
	noUpload := func(e *Error) *Error {
		if e.Code == "NoSuchUpload" {
			return errNoSuchUpload(part.UploadId)
		}
		return e
	}
	var modified time.Time
	var err error
	shared := false
	if startsBlock(src.Blocks, uint64(start)) {
		// The namespace manager names the part's ETag: the source's for a
		// whole single-part source, otherwise one derived from the
		// source's ETag and the range (S3 returns the MD5 of the range's
		// bytes, which cannot be known without reading them).
		var r *metapb.KeyInfo
		r, shared, err = g.shareCopy(req, &metapb.CopyKeyRequest{Volume: g.cfg.Volume, SrcBucket: srcBucket, SrcKey: srcKey, ExpectObjectId: src.ObjectID,
			Bucket: req.bucket, Key: req.key, Part: part, Offset: uint64(start), Length: uint64(length)})
		if shared {
			part.Etag, modified = r.Meta.GetEtag(), time.UnixMilli(r.ModifiedUnixMs)
		}
	}
	if err == nil && !shared {
		kr, e := g.readSource(req, srcBucket, srcKey, src.ObjectID)
		if e != nil {
			return e
		}
		defer kr.Close()
		if _, err := kr.Seek(start, io.SeekStart); err != nil {
			return fromBasalt(err, req.bucket, req.key)
		}
		mr := &md5Reader{r: io.LimitReader(kr, length), h: md5.New()}
		var ki client.KeyInfo
		ki, err = g.putData(req, req.key, mr, length, nil, part, nil, func() string { return hex.EncodeToString(mr.h.Sum(nil)) })
		modified = ki.Modified
	}
	if err != nil {
		return noUpload(fromBasalt(err, req.bucket, req.key))
	}
	how := "streamed"
	if shared {
		how = "shared"
	}
	g.metrics.copied.WithLabelValues(how).Add(float64(length))
	type result struct {
		XMLName      xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ CopyPartResult"`
		LastModified string   `xml:"LastModified"`
		ETag         string   `xml:"ETag"`
	}
	return writeXML(req, result{LastModified: modified.UTC().Format(s3TimeFormat), ETag: `"` + part.Etag + `"`})
}

// startsBlock reports whether off is where one of blocks starts (or the
// start of an empty source).
func startsBlock(blocks []client.BlockInfo, off uint64) bool {
	if off == 0 {
		return true
	}
	for _, b := range blocks {
		if b.Offset == off && b.Length > 0 {
			return true
		}
	}
	return false
}

// parseCompleteMultipartUpload reads a CompleteMultipartUpload body: 1 to
// 10,000 parts, numbered 1 to 10,000 in ascending order (checked here,
// before the request reaches the namespace manager's log).
func parseCompleteMultipartUpload(req *request) ([]*metapb.CompletedPart, *Error) {
	var in struct {
		XMLName xml.Name `xml:"CompleteMultipartUpload"`
		Parts   []struct {
			PartNumber uint32 `xml:"PartNumber"`
			ETag       string `xml:"ETag"`
		} `xml:"Part"`
	}
	if e := readXML(req, &in); e != nil {
		return nil, e
	}
	if len(in.Parts) == 0 || len(in.Parts) > namespace.MaxPartNumber {
		return nil, errMalformedXML(fmt.Errorf("%d parts; 1 to %d allowed", len(in.Parts), namespace.MaxPartNumber))
	}
	parts := make([]*metapb.CompletedPart, 0, len(in.Parts))
	for i, p := range in.Parts {
		if p.PartNumber < 1 || p.PartNumber > namespace.MaxPartNumber {
			return nil, errInvalidArgument("Part number must be an integer between 1 and %d, inclusive (got %d)", namespace.MaxPartNumber, p.PartNumber)
		}
		if i > 0 && p.PartNumber <= in.Parts[i-1].PartNumber {
			return nil, errorf("InvalidPartOrder", 400, "The list of parts was not in ascending order. The parts list must be specified in order by part number (part %d follows part %d).", p.PartNumber, in.Parts[i-1].PartNumber)
		}
		parts = append(parts, &metapb.CompletedPart{PartNumber: p.PartNumber, Etag: p.ETag})
	}
	return parts, nil
}

func (g *Gateway) completeMultipartUpload(req *request) *Error {
	pre, e := writePrecondition(req.r.Header)
	if e != nil {
		return e
	}
	parts, e := parseCompleteMultipartUpload(req)
	if e != nil {
		return e
	}
	uploadID := req.r.URL.Query().Get("uploadId")
	creq := &metapb.CompleteMultipartUploadRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key, UploadId: uploadID,
		MinPartSize: uint64(g.cfg.MinPartSize), Parts: parts, Precondition: pre}
	var ki *metapb.KeyInfo
	err := req.meta(func() (err error) {
		// The ACL CreateMultipartUpload asked for, committed with the
		// object (a new version never keeps the old one's).
		// A requester who may not list the parts (a policy granting
		// s3:PutObject alone) started the upload without an ACL, as
		// CreateMultipartUpload refuses one to such requesters (or lost
		// the right since): it completes private.
		lp, err := g.ns.ListParts(req.r.Context(), &metapb.ListPartsRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key,
			UploadId: uploadID, MaxParts: 1})
		switch {
		case err == nil:
			creq.Acls = lp.GetUpload().GetMeta().GetUploadAcls()
		case !errors.Is(client.FromRPC("list parts", err), client.ErrPermissionDenied):
			return err
		}
		ki, err = g.ns.CompleteMultipartUpload(req.r.Context(), creq)
		return err
	})
	if err != nil {
		e := fromBasalt(err, req.bucket, req.key)
		if e.Code == "NoSuchUpload" {
			e = errNoSuchUpload(uploadID)
		}
		return e
	}
	type result struct {
		XMLName  xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ CompleteMultipartUploadResult"`
		Location string   `xml:"Location"`
		Bucket   string   `xml:"Bucket"`
		Key      string   `xml:"Key"`
		ETag     string   `xml:"ETag"`
	}
	return writeXML(req, result{Location: "/" + req.bucket + "/" + req.key, Bucket: req.bucket, Key: req.key, ETag: etagOf(ki.Meta)})
}

func (g *Gateway) abortMultipartUpload(req *request) *Error {
	uploadID := req.r.URL.Query().Get("uploadId")
	err := req.meta(func() error {
		_, err := g.ns.AbortMultipartUpload(req.r.Context(), &metapb.AbortMultipartUploadRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key, UploadId: uploadID})
		return err
	})
	if err != nil {
		e := fromBasalt(err, req.bucket, req.key)
		if e.Code == "NoSuchUpload" {
			e = errNoSuchUpload(uploadID)
		}
		return e
	}
	req.w.WriteHeader(http.StatusNoContent)
	return nil
}

func (g *Gateway) listParts(req *request) *Error {
	q := req.r.URL.Query()
	uploadID := q.Get("uploadId")
	marker, maxParts := 0, maxListKeys
	if v := q.Get("part-number-marker"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return errInvalidArgument("Argument part-number-marker must be an integer")
		}
		marker = n
	}
	if v := q.Get("max-parts"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return errInvalidArgument("Argument max-parts must be an integer between 0 and 2147483647")
		}
		maxParts = min(n, maxListKeys)
	}
	var resp *metapb.ListPartsResponse
	err := req.meta(func() (err error) {
		resp, err = g.ns.ListParts(req.r.Context(), &metapb.ListPartsRequest{Volume: g.cfg.Volume, Bucket: req.bucket, Key: req.key,
			UploadId: uploadID, PartNumberMarker: uint32(min(marker, namespace.MaxPartNumber)), MaxParts: uint32(max(maxParts, 1))})
		return err
	})
	if err != nil {
		e := fromBasalt(err, req.bucket, req.key)
		if e.Code == "NoSuchUpload" {
			e = errNoSuchUpload(uploadID)
		}
		return e
	}
	type part struct {
		PartNumber   uint32 `xml:"PartNumber"`
		LastModified string `xml:"LastModified"`
		ETag         string `xml:"ETag"`
		Size         uint64 `xml:"Size"`
	}
	type result struct {
		XMLName              xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ ListPartsResult"`
		Bucket               string   `xml:"Bucket"`
		Key                  string   `xml:"Key"`
		UploadID             string   `xml:"UploadId"`
		Initiator            owner    `xml:"Initiator"`
		Owner                owner    `xml:"Owner"`
		StorageClass         string   `xml:"StorageClass"`
		PartNumberMarker     int      `xml:"PartNumberMarker"`
		NextPartNumberMarker uint32   `xml:"NextPartNumberMarker"`
		MaxParts             int      `xml:"MaxParts"`
		IsTruncated          bool     `xml:"IsTruncated"`
		Parts                []part   `xml:"Part"`
	}
	res := result{Bucket: req.bucket, Key: req.key, UploadID: uploadID, Initiator: req.owner(), Owner: req.owner(), StorageClass: "STANDARD",
		PartNumberMarker: marker, MaxParts: maxParts, IsTruncated: resp.Truncated && maxParts > 0}
	if maxParts > 0 {
		for _, p := range resp.Parts {
			res.Parts = append(res.Parts, part{PartNumber: p.PartNumber, LastModified: s3Time(p.ModifiedUnixMs), ETag: `"` + p.Etag + `"`, Size: p.Size})
			res.NextPartNumberMarker = p.PartNumber
		}
	}
	return writeXML(req, res)
}

func (g *Gateway) listMultipartUploads(req *request) *Error {
	q := req.r.URL.Query()
	if q.Get("delimiter") != "" {
		return errNotImplemented("ListMultipartUploads with a delimiter")
	}
	maxUploads := maxListKeys
	if v := q.Get("max-uploads"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return errInvalidArgument("Argument max-uploads must be an integer between 1 and 2147483647")
		}
		maxUploads = min(n, maxListKeys)
	}
	keyMarker, idMarker := q.Get("key-marker"), q.Get("upload-id-marker")
	var resp *metapb.ListMultipartUploadsResponse
	err := req.meta(func() (err error) {
		resp, err = g.ns.ListMultipartUploads(req.r.Context(), &metapb.ListMultipartUploadsRequest{Volume: g.cfg.Volume, Bucket: req.bucket,
			Prefix: q.Get("prefix"), KeyMarker: keyMarker, UploadIdMarker: idMarker, MaxUploads: uint32(maxUploads)})
		return err
	})
	if err != nil {
		return fromBasalt(err, req.bucket, "")
	}
	type upload struct {
		Key          string `xml:"Key"`
		UploadID     string `xml:"UploadId"`
		Initiator    owner  `xml:"Initiator"`
		Owner        owner  `xml:"Owner"`
		StorageClass string `xml:"StorageClass"`
		Initiated    string `xml:"Initiated"`
	}
	type result struct {
		XMLName            xml.Name `xml:"http://s3.amazonaws.com/doc/2006-03-01/ ListMultipartUploadsResult"`
		Bucket             string   `xml:"Bucket"`
		KeyMarker          string   `xml:"KeyMarker"`
		UploadIDMarker     string   `xml:"UploadIdMarker"`
		NextKeyMarker      string   `xml:"NextKeyMarker"`
		NextUploadIDMarker string   `xml:"NextUploadIdMarker"`
		Prefix             string   `xml:"Prefix"`
		MaxUploads         int      `xml:"MaxUploads"`
		IsTruncated        bool     `xml:"IsTruncated"`
		Uploads            []upload `xml:"Upload"`
	}
	res := result{Bucket: req.bucket, KeyMarker: keyMarker, UploadIDMarker: idMarker, Prefix: q.Get("prefix"), MaxUploads: maxUploads, IsTruncated: resp.Truncated}
	for _, u := range resp.Uploads {
		res.Uploads = append(res.Uploads, upload{Key: u.Key, UploadID: u.UploadId, Initiator: req.owner(), Owner: req.owner(),
			StorageClass: "STANDARD", Initiated: s3Time(u.CreatedUnixMs)})
		res.NextKeyMarker, res.NextUploadIDMarker = u.Key, u.UploadId
	}
	return writeXML(req, res)
}
