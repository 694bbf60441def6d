package s3

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// AWS Signature Version 4 verification
// (https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-authenticating-requests.html):
// the Authorization header, presigned query parameters, and the seed of
// chunk-signed payloads (chunked.go). An unsigned request is anonymous
// (requester.go): served only where an ACL or a bucket policy grants
// anonymous access.

const (
	algorithm       = "AWS4-HMAC-SHA256"
	amzDateFormat   = "20060102T150405Z"
	unsignedPayload = "UNSIGNED-PAYLOAD"
	// Payload modes of x-amz-content-sha256 for aws-chunked bodies.
	streamingSigned         = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
	streamingSignedTrailer  = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
	streamingUnsignedTrailr = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
	emptySHA256             = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
	maxPresignExpiry        = 7 * 24 * time.Hour
)

// auth is a verified request's identity and what a chunked body needs to
// verify its chunks.
type auth struct {
	accessKey string
	// owner is the user the access key belongs to (the key itself when
	// none is recorded): buckets belong to users.
	owner string
	// admin keys act on every user's buckets.
	admin bool
	// anonymous: an unsigned request (requester.go); owner is "".
	anonymous bool
	payload   string // x-amz-content-sha256 (UNSIGNED-PAYLOAD for presigned URLs)
	// Chunk signing (streaming payloads).
	signingKey []byte
	key        *derivedKey // signingKey with its HMAC pads; nil: derived on first use
	amzDate    string
	scope      string
	seedSig    string
}

// sigParams are the parts of a signature, from the header or the query.
type sigParams struct {
	accessKey, date, region, service string
	// scope is "date/region/service/aws4_request", the credential after
	// the access key.
	scope         string
	signedHeaders []string
	signature     string
}

// parseCredential reads "AK/date/region/service/aws4_request": exactly
// five parts separated by "/", the first not empty (cut without a slice
// of parts: issue 15, allocations per request).
func parseCredential(cred string) (sigParams, bool) {
	var parts [5]string
	rest := cred
	for i := range 4 {
		var ok bool
		if parts[i], rest, ok = strings.Cut(rest, "/"); !ok {
			return sigParams{}, false
		}
	}
	parts[4] = rest
	if parts[4] != "aws4_request" || parts[0] == "" {
		return sigParams{}, false
	}
	return sigParams{accessKey: parts[0], date: parts[1], region: parts[2], service: parts[3], scope: cred[len(parts[0])+1:]}, true
}

// parseAuthorization reads
// "AWS4-HMAC-SHA256 Credential=AK/20130524/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-date, Signature=hex".
func parseAuthorization(h string) (sigParams, *Error) {
	bad := func(msg string) (sigParams, *Error) {
		return sigParams{}, errorf("AuthorizationHeaderMalformed", 400, "The authorization header is malformed; %s", msg)
	}
	alg, rest, ok := strings.Cut(h, " ")
	if !ok || alg != algorithm {
		if strings.HasPrefix(h, "AWS ") {
			return sigParams{}, errorf("InvalidRequest", 400, "The authorization mechanism you have provided is not supported. Please use AWS4-HMAC-SHA256.")
		}
		return bad("the algorithm must be " + algorithm)
	}
	var p sigParams
	var haveCred, haveSig, haveHeaders bool
	for rest != "" {
		var f string
		f, rest, _ = strings.Cut(rest, ",")
		k, v, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok {
			continue
		}
		switch k {
		case "Credential":
			c, ok := parseCredential(v)
			if !ok {
				return bad("the Credential is malformed: " + v)
			}
			sig, hdrs := p.signature, p.signedHeaders
			p = c
			p.signature, p.signedHeaders = sig, hdrs
			haveCred = true
		case "SignedHeaders":
			p.signedHeaders = strings.Split(v, ";")
			haveHeaders = true
		case "Signature":
			p.signature = v
			haveSig = true
		}
	}
	if !haveCred || !haveSig || !haveHeaders {
		return bad("Credential, SignedHeaders and Signature are all required")
	}
	return p, nil
}

// secrets caches access keys from the namespace manager so that a request
// costs no metadata call for its credentials. A deleted key keeps working
// on a gateway for at most the TTL.
type secrets struct {
	ns  metapb.NamespaceClient
	ttl time.Duration
	now func() time.Time

	mu sync.Mutex
	m  map[string]secretEntry
	// derived SigV4 signing keys (four HMACs each) by secret and scope; a
	// key is valid for one day, so a client's requests share one.
	derived map[derivedID]*derivedKey
}

type derivedID struct{ secret, date, region, service string }

// derivedKey is a signing key with its HMAC pads, so that verifying a
// request's signature costs two SHA-256 sums and no allocation.
type derivedKey struct {
	key        []byte
	ipad, opad [sha256.BlockSize]byte
}

func newDerivedKey(k []byte) *derivedKey {
	d := &derivedKey{key: k}
	// A signing key is 32 bytes, shorter than the block: the pads are
	// the key zero-padded, XOR 0x36 and 0x5c (RFC 2104).
	copy(d.ipad[:], k)
	copy(d.opad[:], k)
	for i := range d.ipad {
		d.ipad[i] ^= 0x36
		d.opad[i] ^= 0x5c
	}
	return d
}

// signatureOf is the hex SigV4 signature of a request whose canonical
// request hashes to canonHash: HMAC-SHA256 of the string to sign
// (stringToSign), built in buf (a caller's stack buffer) and written to
// dst.
func (d *derivedKey) signatureOf(dst *[64]byte, buf []byte, amzDate, scope string, canonHash *[32]byte) {
	buf = append(buf[:0], d.ipad[:]...)
	buf = append(buf, algorithm...)
	buf = append(buf, '\n')
	buf = append(buf, amzDate...)
	buf = append(buf, '\n')
	buf = append(buf, scope...)
	buf = append(buf, '\n')
	buf = hex.AppendEncode(buf, canonHash[:])
	d.finish(dst, buf)
}

// finish writes the hex HMAC of a message to dst, given buf = the key's
// inner pad followed by the message.
func (d *derivedKey) finish(dst *[64]byte, buf []byte) {
	inner := sha256.Sum256(buf)
	var outer [sha256.BlockSize + sha256.Size]byte
	copy(outer[:], d.opad[:])
	copy(outer[sha256.BlockSize:], inner[:])
	mac := sha256.Sum256(outer[:])
	hex.Encode(dst[:], mac[:])
}

// chunkSignature is the hex signature of an aws-chunked chunk whose data
// hashes to chunkHash, chained from prev: HMAC-SHA256 of
// "AWS4-HMAC-SHA256-PAYLOAD\n" date, scope, prev, the empty string's hash
// and the chunk's, built in buf (a caller's stack buffer), written to dst.
func (d *derivedKey) chunkSignature(dst *[64]byte, buf []byte, amzDate, scope string, prev *[64]byte, chunkHash *[32]byte) {
	buf = append(buf[:0], d.ipad[:]...)
	buf = append(buf, "AWS4-HMAC-SHA256-PAYLOAD\n"...)
	buf = append(buf, amzDate...)
	buf = append(buf, '\n')
	buf = append(buf, scope...)
	buf = append(buf, '\n')
	buf = append(buf, prev[:]...)
	buf = append(buf, '\n')
	buf = append(buf, emptySHA256...)
	buf = append(buf, '\n')
	buf = hex.AppendEncode(buf, chunkHash[:])
	d.finish(dst, buf)
}

// signingKey returns the SigV4 signing key of secret for the scope,
// derived once per scope.
func (s *secrets) signingKey(secret, date, region, service string) *derivedKey {
	id := derivedID{secret, date, region, service}
	s.mu.Lock()
	k, ok := s.derived[id]
	s.mu.Unlock()
	if ok {
		return k
	}
	k = newDerivedKey(signingKey(secret, date, region, service))
	s.mu.Lock()
	if s.derived == nil || len(s.derived) >= maxCachedSecrets {
		s.derived = map[derivedID]*derivedKey{}
	}
	s.derived[id] = k
	s.mu.Unlock()
	return k
}

type secretEntry struct {
	s       *metapb.S3Secret // nil: no such key
	fetched time.Time
}

// maxCachedSecrets bounds the cache; past it the cache starts over.
const maxCachedSecrets = 10000

func (s *secrets) get(ctx context.Context, id string) (*metapb.S3Secret, error) {
	now := s.now()
	s.mu.Lock()
	e, ok := s.m[id]
	s.mu.Unlock()
	if ok && now.Sub(e.fetched) < s.ttl {
		return e.s, nil
	}
	sec, err := s.ns.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: id})
	if err != nil {
		if errors.Is(client.FromRPC("get s3 secret", err), client.ErrNotFound) {
			sec = nil
		} else {
			return nil, client.FromRPC("get s3 secret", err)
		}
	}
	s.mu.Lock()
	if len(s.m) >= maxCachedSecrets {
		s.m = map[string]secretEntry{}
	}
	s.m[id] = secretEntry{s: sec, fetched: now}
	s.mu.Unlock()
	return sec, nil
}

func hmacSHA256(key []byte, data string) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(data))
	return h.Sum(nil)
}

func signingKey(secret, date, region, service string) []byte {
	k := hmacSHA256([]byte("AWS4"+secret), date)
	k = hmacSHA256(k, region)
	k = hmacSHA256(k, service)
	return hmacSHA256(k, "aws4_request")
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// uriEncode is SigV4's encoding: everything but unreserved characters is
// %XX (upper case); '/' too unless it is a path.
func uriEncode(s string, path bool) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == '~' || (path && c == '/') {
			b.WriteByte(c)
			continue
		}
		const hexd = "0123456789ABCDEF"
		b.WriteByte('%')
		b.WriteByte(hexd[c>>4])
		b.WriteByte(hexd[c&15])
	}
	return b.String()
}

// canonicalQuery sorts the query's parameters by encoded name and value,
// leaving out the signature itself (presigned URLs).
func canonicalQuery(raw string) string {
	type kv struct{ k, v string }
	var kvs []kv
	for _, part := range strings.Split(raw, "&") {
		if part == "" {
			continue
		}
		k, v, _ := strings.Cut(part, "=")
		dk, err1 := url.QueryUnescape(k)
		dv, err2 := url.QueryUnescape(v)
		if err1 != nil || err2 != nil {
			dk, dv = k, v
		}
		if dk == "X-Amz-Signature" {
			continue
		}
		kvs = append(kvs, kv{uriEncode(dk, false), uriEncode(dv, false)})
	}
	sort.Slice(kvs, func(i, j int) bool {
		if kvs[i].k != kvs[j].k {
			return kvs[i].k < kvs[j].k
		}
		return kvs[i].v < kvs[j].v
	})
	var b strings.Builder
	for i, e := range kvs {
		if i > 0 {
			b.WriteByte('&')
		}
		b.WriteString(e.k)
		b.WriteByte('=')
		b.WriteString(e.v)
	}
	return b.String()
}

// headerValue is a signed header's canonical value. net/http moves Host,
// and Transfer-Encoding out of the header map, so they come from the
// request's fields.
func headerValue(r *http.Request, name string) string {
	var vals []string
	switch name {
	case "host":
		vals = []string{r.Host}
	case "transfer-encoding":
		vals = r.TransferEncoding
	default:
		vals = r.Header.Values(name)
		if len(vals) == 0 && name == "content-length" && r.ContentLength >= 0 {
			vals = []string{strconv.FormatInt(r.ContentLength, 10)}
		}
	}
	out := make([]string, len(vals))
	for i, v := range vals {
		out[i] = strings.Join(strings.Fields(v), " ")
	}
	return strings.Join(out, ",")
}

// appendCanonicalRequest appends the canonical request to b.
func appendCanonicalRequest(b []byte, r *http.Request, uri string, signed []string, payload string) []byte {
	b = append(b, r.Method...)
	b = append(b, '\n')
	b = append(b, uri...)
	b = append(b, '\n')
	if r.URL.RawQuery != "" {
		b = append(b, canonicalQuery(r.URL.RawQuery)...)
	}
	b = append(b, '\n')
	for _, h := range signed {
		b = append(b, h...)
		b = append(b, ':')
		b = appendHeaderValue(b, r, h)
		b = append(b, '\n')
	}
	b = append(b, '\n')
	for i, h := range signed {
		if i > 0 {
			b = append(b, ';')
		}
		b = append(b, h...)
	}
	b = append(b, '\n')
	b = append(b, payload...)
	return b
}

// appendHeaderValue appends headerValue(r, name); a single value that
// needs no whitespace folding (the usual case) is appended as it is.
func appendHeaderValue(b []byte, r *http.Request, name string) []byte {
	var v string
	switch name {
	case "host":
		v = r.Host
	case "transfer-encoding", "content-length":
		return append(b, headerValue(r, name)...)
	default:
		vals := headerValues(r.Header, name)
		if len(vals) != 1 {
			return append(b, headerValue(r, name)...)
		}
		v = vals[0]
	}
	if !plainValue(v) {
		return append(b, headerValue(r, name)...)
	}
	return append(b, v...)
}

// headerValues is h.Values(name) for a signed header's name (lower case
// as signed), canonicalised in a stack buffer rather than by
// textproto.CanonicalMIMEHeaderKey, which allocates for every name not
// already canonical, as x-amz-date (issue 15: allocations per request).
func headerValues(h http.Header, name string) []string {
	var buf [64]byte
	if len(name) > len(buf) {
		return h[textproto.CanonicalMIMEHeaderKey(name)]
	}
	b := buf[:len(name)]
	upper := true
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !validHeaderNameByte(c) {
			// As CanonicalMIMEHeaderKey: a name with other bytes is
			// looked up as it is.
			return h[textproto.CanonicalMIMEHeaderKey(name)]
		}
		if upper && 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		} else if !upper && 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		b[i] = c
		upper = c == '-'
	}
	return h[string(b)] // (no allocation for the lookup)
}

// validHeaderNameByte tells the bytes textproto accepts in a header
// name it canonicalises (RFC 7230 token characters).
func validHeaderNameByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// plainValue reports whether strings.Join(strings.Fields(v), " ") == v:
// no leading, trailing or repeated ASCII space, and no other white space.
func plainValue(v string) bool {
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == ' ':
			if i == 0 || i == len(v)-1 || v[i+1] == ' ' {
				return false
			}
		case c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r' || c >= 0x80:
			return false // (non-ASCII: strings.Fields knows Unicode spaces)
		}
	}
	return true
}

// authenticate verifies the request's signature (header or presigned).
func (g *Gateway) authenticate(r *http.Request) (*auth, *Error) {
	q := query(r)
	var p sigParams
	var amzDate, payload string
	presigned := q.Get("X-Amz-Algorithm") != ""
	now := g.cfg.Now()
	var t time.Time
	switch {
	case presigned:
		if q.Get("X-Amz-Algorithm") != algorithm {
			return nil, errorf("AuthorizationQueryParametersError", 400, "X-Amz-Algorithm only supports %q", algorithm)
		}
		c, ok := parseCredential(q.Get("X-Amz-Credential"))
		if !ok || q.Get("X-Amz-Signature") == "" || q.Get("X-Amz-SignedHeaders") == "" {
			return nil, errorf("AuthorizationQueryParametersError", 400, "Query-string authentication version 4 requires the X-Amz-Algorithm, X-Amz-Credential, X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, and X-Amz-Expires parameters.")
		}
		p = c
		p.signature = q.Get("X-Amz-Signature")
		p.signedHeaders = strings.Split(q.Get("X-Amz-SignedHeaders"), ";")
		amzDate = q.Get("X-Amz-Date")
		var err error
		if t, err = time.Parse(amzDateFormat, amzDate); err != nil {
			return nil, errorf("AuthorizationQueryParametersError", 400, "X-Amz-Date must be in the ISO8601 Long Format \"yyyyMMdd'T'HHmmss'Z'\"")
		}
		exp, err := strconv.ParseInt(q.Get("X-Amz-Expires"), 10, 64)
		// Compare seconds with seconds: exp·1s overflows a Duration for
		// large exp and can wrap into the allowed range.
		if err != nil || exp < 1 || exp > int64(maxPresignExpiry/time.Second) {
			return nil, errorf("AuthorizationQueryParametersError", 400, "X-Amz-Expires must be a number of seconds from 1 to 604800")
		}
		if now.After(t.Add(time.Duration(exp) * time.Second)) {
			return nil, errAccessDenied("Request has expired")
		}
		if t.After(now.Add(g.cfg.MaxClockSkew)) {
			return nil, errAccessDenied("Request is not valid yet")
		}
		payload = r.Header.Get("X-Amz-Content-Sha256")
		if payload == "" {
			payload = unsignedPayload
		}
	case r.Header.Get("Authorization") != "":
		var e *Error
		if p, e = parseAuthorization(r.Header.Get("Authorization")); e != nil {
			return nil, e
		}
		amzDate = r.Header.Get("X-Amz-Date")
		if amzDate == "" {
			// A signed Date header works as well.
			d, err := http.ParseTime(r.Header.Get("Date"))
			if err != nil {
				return nil, errAccessDenied("AWS authentication requires a valid Date or x-amz-date header")
			}
			amzDate = d.UTC().Format(amzDateFormat)
		}
		var err error
		if t, err = time.Parse(amzDateFormat, amzDate); err != nil {
			return nil, errAccessDenied("AWS authentication requires a valid Date or x-amz-date header")
		}
		if d := now.Sub(t); d > g.cfg.MaxClockSkew || d < -g.cfg.MaxClockSkew {
			return nil, errorf("RequestTimeTooSkewed", 403, "The difference between the request time (%s) and the server's time (%s) is too large.", t.Format(time.RFC3339), now.UTC().Format(time.RFC3339))
		}
		payload = r.Header.Get("X-Amz-Content-Sha256")
		if payload == "" {
			return nil, errInvalidRequest("Missing required header for this request: x-amz-content-sha256")
		}
		if !validPayloadMode(payload) {
			return nil, errorf("InvalidArgument", 400, "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, STREAMING-UNSIGNED-PAYLOAD-TRAILER, STREAMING-AWS4-HMAC-SHA256-PAYLOAD, STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER or a valid sha256 value.")
		}
	case !isAnonymous(r):
		// Part of a presigned query without X-Amz-Algorithm: a broken
		// signature, not an anonymous request.
		return nil, errorf("AuthorizationQueryParametersError", 400, "Query-string authentication version 4 requires the X-Amz-Algorithm, X-Amz-Credential, X-Amz-Signature, X-Amz-Date, X-Amz-SignedHeaders, and X-Amz-Expires parameters.")
	default:
		return anonymousAuth(r)
	}
	if p.service != "s3" {
		return nil, errorf("AuthorizationHeaderMalformed", 400, "The authorization header is malformed; incorrect service %q. This endpoint belongs to \"s3\".", p.service)
	}
	if p.region != g.cfg.Region {
		if presigned {
			return nil, &Error{Code: "AuthorizationQueryParametersError", Status: 400, Region: g.cfg.Region,
				Message: fmt.Sprintf("Error parsing the X-Amz-Credential parameter; the region '%s' is wrong; expecting '%s'", p.region, g.cfg.Region)}
		}
		return nil, &Error{Code: "AuthorizationHeaderMalformed", Status: 400, Region: g.cfg.Region,
			Message: fmt.Sprintf("The authorization header is malformed; the region '%s' is wrong; expecting '%s'", p.region, g.cfg.Region)}
	}
	if p.date != amzDate[:8] {
		return nil, errorf("AuthorizationHeaderMalformed", 400, "The authorization header is malformed; Invalid credential date %q. This date is not the same as X-Amz-Date: %q.", p.date, amzDate[:8])
	}
	if !sort.StringsAreSorted(p.signedHeaders) || !contains(p.signedHeaders, "host") {
		return nil, errAccessDenied("SignedHeaders must be sorted and include host")
	}
	if e := unsignedAmzHeaders(r, p.signedHeaders); e != nil {
		return nil, e
	}
	sec, err := g.secrets.get(r.Context(), p.accessKey)
	if err != nil {
		return nil, fromBasalt(err, "", "")
	}
	if sec == nil {
		return nil, errorf("InvalidAccessKeyId", 403, "The AWS Access Key Id you provided does not exist in our records: %s", p.accessKey)
	}
	key := g.secrets.signingKey(sec.SecretAccessKey, p.date, p.region, p.service)
	scope := p.scope // p.date + "/" + p.region + "/" + p.service + "/aws4_request"
	// Clients encode the path the SigV4 way; try the path as sent first
	// and then the canonical re-encoding of the decoded path, so keys with
	// characters clients escape differently still verify.
	// Both the canonical request and the string to sign are built in
	// stack buffers (issue 15: CPU per HEAD).
	var cbuf, sbuf [512]byte
	var want [64]byte
	verify := func(uri string) bool {
		h := sha256.Sum256(appendCanonicalRequest(cbuf[:0], r, uri, p.signedHeaders, payload))
		key.signatureOf(&want, sbuf[:0], amzDate, scope, &h)
		return len(p.signature) == len(want) && subtle.ConstantTimeCompare(want[:], []byte(p.signature)) == 1
	}
	ok := verify(r.URL.EscapedPath())
	if !ok {
		if uri := uriEncode(r.URL.Path, true); uri != r.URL.EscapedPath() {
			ok = verify(uri)
		}
	}
	if !ok {
		return nil, errorf("SignatureDoesNotMatch", 403, "The request signature we calculated does not match the signature you provided. Check your key and signing method.")
	}
	if presigned {
		if e := hoistQueryHeaders(r); e != nil {
			return nil, e
		}
	}
	owner := sec.Owner
	if owner == "" {
		owner = p.accessKey
	}
	return &auth{accessKey: p.accessKey, owner: owner, admin: sec.Admin, payload: payload,
		signingKey: key.key, key: key, amzDate: amzDate, scope: scope, seedSig: p.signature}, nil
}

// unsignedAmzHeaders refuses a request carrying an x-amz-* header its
// signature does not cover, as S3 does: such a header could have been
// added by anyone on the way (metadata, tags, a copy source) and would
// act with the signer's authority.
func unsignedAmzHeaders(r *http.Request, signed []string) *Error {
	var bad []string
	for k := range r.Header {
		if isAmzHeader(k) && !containsFold(signed, k) {
			bad = append(bad, strings.ToLower(k))
		}
	}
	if len(bad) == 0 {
		return nil
	}
	sort.Strings(bad)
	return errAccessDenied("There were headers present in the request which were not signed: " + strings.Join(bad, ", "))
}

// isAmzHeader reports whether a header name starts with x-amz- (any case),
// without allocating.
func isAmzHeader(k string) bool { return len(k) > 6 && strings.EqualFold(k[:6], "x-amz-") }

// presignParams are the query parameters of the signature itself.
var presignParams = map[string]bool{"x-amz-algorithm": true, "x-amz-credential": true, "x-amz-date": true, "x-amz-expires": true,
	"x-amz-signedheaders": true, "x-amz-signature": true, "x-amz-security-token": true}

// hoistQueryHeaders makes the x-amz-* query parameters of a verified
// presigned request (metadata, tagging, a copy source, checksums) its
// headers, as S3 does: the signature covers the whole query, so they are
// signed. A parameter also sent as a header is refused.
func hoistQueryHeaders(r *http.Request) *Error {
	q := r.URL.Query()
	for k, vs := range q {
		lk := strings.ToLower(k)
		if !strings.HasPrefix(lk, "x-amz-") || presignParams[lk] {
			continue
		}
		if r.Header.Get(k) != "" {
			return errInvalidRequest("%s is given both as a query parameter and as a header", lk)
		}
		for _, v := range vs {
			r.Header.Add(k, v)
		}
	}
	return nil
}

func validPayloadMode(p string) bool {
	switch p {
	case unsignedPayload, streamingSigned, streamingSignedTrailer, streamingUnsignedTrailr:
		return true
	}
	if len(p) != 64 {
		return false
	}
	for i := 0; i < len(p); i++ { // hex, as hex.DecodeString accepts it, without its copy
		switch c := p[i]; {
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f', 'A' <= c && c <= 'F':
		default:
			return false
		}
	}
	return true
}

func containsFold(ss []string, s string) bool {
	for _, x := range ss {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}
