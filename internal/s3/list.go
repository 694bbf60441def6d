package s3

import (
	"encoding/base64"
	"encoding/xml"
	"net/url"
	"strconv"
	"strings"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

const maxListKeys = 1000

type listEntry struct {
	Key          string `xml:"Key"`
	LastModified string `xml:"LastModified"`
	ETag         string `xml:"ETag"`
	Size         uint64 `xml:"Size"`
	Owner        *owner `xml:"Owner,omitempty"`
	StorageClass string `xml:"StorageClass"`
}

type commonPrefix struct {
	Prefix string `xml:"Prefix"`
}

// listParams are what V1 and V2 share.
type listParams struct {
	prefix, delimiter, encoding string
	maxKeys                     int
	urlEncode                   func(string) string
}

func parseListParams(req *request) (listParams, *Error) {
	q := req.r.URL.Query()
	p := listParams{prefix: q.Get("prefix"), delimiter: q.Get("delimiter"), encoding: q.Get("encoding-type"), maxKeys: maxListKeys}
	if v := q.Get("max-keys"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return p, errInvalidArgument("Provided max-keys not an integer or within integer range")
		}
		p.maxKeys = min(n, maxListKeys)
	}
	p.urlEncode = func(s string) string { return s }
	switch p.encoding {
	case "":
	case "url":
		// S3 encodes like a form value but leaves '/' readable.
		p.urlEncode = func(s string) string { return strings.ReplaceAll(url.QueryEscape(s), "%2F", "/") }
	default:
		return p, errInvalidArgument("Invalid Encoding Method specified in Request")
	}
	return p, nil
}

// page lists one page strictly after startAfter.
func (g *Gateway) page(req *request, p listParams, startAfter string, withOwner bool) (entries []listEntry, prefixes []commonPrefix, truncated bool, next string, e *Error) {
	entries, prefixes = []listEntry{}, []commonPrefix{}
	if p.maxKeys == 0 {
		if e := g.bucketExists(req); e != nil {
			return nil, nil, false, "", e
		}
		return entries, prefixes, false, "", nil
	}
	var resp *metapb.ListKeysResponse
	err := req.meta(func() (err error) {
		resp, err = g.ns.ListKeys(req.r.Context(), &metapb.ListKeysRequest{Volume: g.cfg.Volume, Bucket: req.bucket,
			Prefix: p.prefix, StartAfter: startAfter, Delimiter: p.delimiter, PageSize: uint32(p.maxKeys)})
		return err
	})
	if err != nil {
		return nil, nil, false, "", fromBasalt(err, req.bucket, "")
	}
	var o *owner
	if withOwner {
		ow := req.owner()
		o = &ow
	}
	for _, k := range resp.Keys {
		entries = append(entries, listEntry{Key: p.urlEncode(k.Name), LastModified: s3Time(k.ModifiedUnixMs),
			ETag: etagOf(k.Meta), Size: k.Size, Owner: o, StorageClass: "STANDARD"})
	}
	for _, cp := range resp.CommonPrefixes {
		prefixes = append(prefixes, commonPrefix{Prefix: p.urlEncode(cp)})
	}
	return entries, prefixes, resp.Truncated, resp.NextStartAfter, nil
}

func (g *Gateway) listObjectsV1(req *request) *Error {
	p, e := parseListParams(req)
	if e != nil {
		return e
	}
	marker := req.r.URL.Query().Get("marker")
	entries, prefixes, truncated, next, e := g.page(req, p, marker, true)
	if e != nil {
		return e
	}
	type result struct {
		XMLName        xml.Name       `xml:"http://s3.amazonaws.com/doc/2006-03-01/ ListBucketResult"`
		Name           string         `xml:"Name"`
		Prefix         string         `xml:"Prefix"`
		Marker         string         `xml:"Marker"`
		NextMarker     string         `xml:"NextMarker,omitempty"`
		MaxKeys        int            `xml:"MaxKeys"`
		Delimiter      string         `xml:"Delimiter,omitempty"`
		IsTruncated    bool           `xml:"IsTruncated"`
		EncodingType   string         `xml:"EncodingType,omitempty"`
		Contents       []listEntry    `xml:"Contents"`
		CommonPrefixes []commonPrefix `xml:"CommonPrefixes"`
	}
	res := result{Name: req.bucket, Prefix: p.urlEncode(p.prefix), Marker: p.urlEncode(marker), MaxKeys: p.maxKeys,
		Delimiter: p.urlEncode(p.delimiter), IsTruncated: truncated, EncodingType: p.encoding, Contents: entries, CommonPrefixes: prefixes}
	if truncated && p.delimiter != "" {
		// As S3: NextMarker only with a delimiter, where it is the last
		// key or common prefix of the page (a common prefix as the next
		// marker skips every key under it). Without a delimiter clients
		// take the last key as the marker.
		res.NextMarker = p.urlEncode(next)
	}
	return writeXML(req, res)
}

func (g *Gateway) listObjectsV2(req *request) *Error {
	p, e := parseListParams(req)
	if e != nil {
		return e
	}
	q := req.r.URL.Query()
	token, startAfter := q.Get("continuation-token"), q.Get("start-after")
	after := startAfter
	if _, ok := q["continuation-token"]; ok {
		d, err := base64.RawURLEncoding.DecodeString(token)
		if err != nil || token == "" {
			return errInvalidArgument("The continuation token provided is incorrect")
		}
		after = string(d)
	}
	entries, prefixes, truncated, next, e := g.page(req, p, after, q.Get("fetch-owner") == "true")
	if e != nil {
		return e
	}
	type result struct {
		XMLName               xml.Name       `xml:"http://s3.amazonaws.com/doc/2006-03-01/ ListBucketResult"`
		Name                  string         `xml:"Name"`
		Prefix                string         `xml:"Prefix"`
		MaxKeys               int            `xml:"MaxKeys"`
		KeyCount              int            `xml:"KeyCount"`
		Delimiter             string         `xml:"Delimiter,omitempty"`
		IsTruncated           bool           `xml:"IsTruncated"`
		ContinuationToken     string         `xml:"ContinuationToken,omitempty"`
		NextContinuationToken string         `xml:"NextContinuationToken,omitempty"`
		StartAfter            string         `xml:"StartAfter,omitempty"`
		EncodingType          string         `xml:"EncodingType,omitempty"`
		Contents              []listEntry    `xml:"Contents"`
		CommonPrefixes        []commonPrefix `xml:"CommonPrefixes"`
	}
	res := result{Name: req.bucket, Prefix: p.urlEncode(p.prefix), MaxKeys: p.maxKeys, KeyCount: len(entries) + len(prefixes),
		Delimiter: p.urlEncode(p.delimiter), IsTruncated: truncated, ContinuationToken: token, StartAfter: p.urlEncode(startAfter),
		EncodingType: p.encoding, Contents: entries, CommonPrefixes: prefixes}
	if truncated {
		res.NextContinuationToken = base64.RawURLEncoding.EncodeToString([]byte(next))
	}
	return writeXML(req, res)
}
