package s3

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/guard"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// Defaults and limits.
const (
	DefaultVolume       = "s3v"
	DefaultRegion       = "us-east-1"
	DefaultMaxClockSkew = 15 * time.Minute
	DefaultSecretTTL    = 10 * time.Second
	DefaultMinPartSize  = 5 << 20
	DefaultUploadWait   = 10 * time.Second
	DefaultOwnerTTL     = 2 * time.Second
	// DefaultBodyIdleTimeout bounds how long a request body (or a GET's
	// reader) may make no progress.
	DefaultBodyIdleTimeout   = 30 * time.Second
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultMaxHeaderBytes    = 64 << 10
	DefaultMaxUploadBytes    = 512 << 20
	// MaxObjectSize is S3's limit for one PUT (and one part).
	MaxObjectSize = 5 << 30
	// maxXMLBody bounds request documents (DeleteObjects with 1000 keys of
	// 1 KiB, CompleteMultipartUpload with 10000 parts).
	maxXMLBody = 2 << 20
)

// Config configures a Gateway. Zero values take the defaults noted.
type Config struct {
	// MetaAddrs are the metadata service's gRPC addresses (ignored when
	// Client is set).
	MetaAddrs []string
	// ServiceToken is the cluster service token the metadata service
	// requires for reading access keys' secrets (ignored when Client is
	// set: give that client the token).
	ServiceToken string
	// Client is the Basalt client to share (e.g. with other gateways in
	// one process); nil: New makes one from MetaAddrs and Close closes it.
	Client *client.Client
	// Credentials authenticate the client New makes (client.Config).
	Credentials *pki.Credentials
	// Listen is the HTTP address ("127.0.0.1:9878"; ":0" picks a port).
	Listen string
	// Region is the gateway's region (default us-east-1). As S3's
	// regional endpoints, it accepts only signatures whose credential
	// scope names it (AuthorizationHeaderMalformed otherwise, with the
	// region expected, which SDKs use to correct themselves), reports it
	// in GetBucketLocation and HeadBucket, and accepts CreateBucket
	// location constraints that name it.
	Region string
	// Domains enable virtual-host-style requests: a Host of
	// "<bucket>.<domain>" (port ignored) addresses bucket. Other hosts are
	// path-style.
	Domains []string
	// Volume holds the S3 buckets (default s3v; created on first use).
	Volume string
	// MaxClockSkew bounds the difference between a request's signing time
	// and the gateway's clock (default 15 minutes, as S3).
	MaxClockSkew time.Duration
	// SecretTTL is how long an access key is cached (default 10s): the
	// delay before a deleted key stops working on this gateway.
	SecretTTL time.Duration
	// MinPartSize is the smallest part but the last of a multipart upload
	// (default 5 MiB, as S3).
	MinPartSize int64
	// MaxUploads bounds the PUT requests (objects, parts, copies) that move
	// data at once; more wait for a slot, without reading their bodies.
	// With MaxUploadBytes it bounds the gateway's memory whatever the
	// load (default 32).
	MaxUploads int
	// MaxUploadBytes is the write buffers all uploads hold together
	// (default 512 MiB; UploadBufferBytes bounds each one's): buffers are
	// taken from it as data arrives and given back as it is committed.
	// Each upload reserves two chunks of it when it starts (waiting for
	// them if need be); past the budget, an upload commits what it holds
	// and goes on with those. The first chunk of a key (read to choose its
	// path, at most 4 MiB) is outside it.
	MaxUploadBytes int64
	// UploadWait bounds a PUT's wait for a slot (default 10s); past it the
	// gateway answers SlowDown (503), which S3 clients retry with backoff.
	UploadWait time.Duration
	// BucketOwnerTTL is how long a bucket's owner is cached (default 2s).
	BucketOwnerTTL time.Duration
	// BodyIdleTimeout fails a request whose body sends nothing for this
	// long with RequestTimeout, freeing its upload slot, and cuts a
	// response its client does not read for this long (default 30s).
	BodyIdleTimeout time.Duration
	// ReadHeaderTimeout bounds reading a request's headers (default 10s);
	// MaxHeaderBytes bounds their size (default 64 KiB).
	ReadHeaderTimeout time.Duration
	MaxHeaderBytes    int
	// UploadBufferBytes is the write buffer of the client the gateway makes
	// (default 64 MiB, the native client's; ignored when Client is set). A
	// V2 write pauses to commit each buffer's worth, so a smaller buffer
	// costs large PUTs throughput; buffers are pooled and taken as data
	// arrives.
	UploadBufferBytes int64
	// TLSCertFile and TLSKeyFile (PEM) make the gateway serve HTTPS only;
	// TLSConfig does the same with a ready configuration (it wins).
	// Without either it serves plain HTTP.
	TLSCertFile, TLSKeyFile string
	TLSConfig               *tls.Config
	// TrustedProxies are the addresses (CIDRs or single IPs) of reverse
	// proxies whose X-Forwarded-For is believed for the client's address
	// (bucket policies' aws:SourceIp). Empty: the connection's peer is
	// the client, whatever the header says.
	TrustedProxies []string
	// Registerer receives the gateway's metrics (nil: none registered).
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	Now        func() time.Time
}

func (c *Config) setDefaults() error {
	if c.Client == nil && len(c.MetaAddrs) == 0 {
		return errors.New("s3: no metadata service addresses (Config.MetaAddrs)")
	}
	if c.Region == "" {
		c.Region = DefaultRegion
	}
	if c.Volume == "" {
		c.Volume = DefaultVolume
	}
	if c.MaxClockSkew == 0 {
		c.MaxClockSkew = DefaultMaxClockSkew
	}
	if c.SecretTTL == 0 {
		c.SecretTTL = DefaultSecretTTL
	}
	if c.MinPartSize == 0 {
		c.MinPartSize = DefaultMinPartSize
	}
	if c.MaxUploads == 0 {
		c.MaxUploads = 32
	}
	if c.MaxUploads < 0 {
		return fmt.Errorf("s3: MaxUploads %d is negative", c.MaxUploads)
	}
	if c.UploadWait == 0 {
		c.UploadWait = DefaultUploadWait
	}
	if c.BucketOwnerTTL == 0 {
		c.BucketOwnerTTL = DefaultOwnerTTL
	}
	if c.BodyIdleTimeout == 0 {
		c.BodyIdleTimeout = DefaultBodyIdleTimeout
	}
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if c.UploadBufferBytes == 0 {
		c.UploadBufferBytes = 64 << 20
	}
	if c.MaxUploadBytes == 0 {
		c.MaxUploadBytes = DefaultMaxUploadBytes
	}
	if c.MaxUploadBytes < 0 {
		return fmt.Errorf("s3: MaxUploadBytes %d is negative", c.MaxUploadBytes)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	for i, d := range c.Domains {
		c.Domains[i] = strings.ToLower(strings.Trim(d, "."))
	}
	return nil
}

// Gateway is an S3 REST gateway. It keeps no state of its own: any number
// of gateways may serve the same cluster.
type Gateway struct {
	cfg     Config
	cl      *client.Client
	ownCl   bool
	budget  *client.BufferBudget // Config.MaxUploadBytes
	ns      metapb.NamespaceClient
	secrets *secrets
	owners  *ownerCache
	metrics *metrics
	ln      net.Listener
	srv     *http.Server
	tls     bool
	proxies []netip.Prefix
	// guarded is the gateway's handler behind its panic guard.
	guarded http.Handler
	guard   *guard.Guard

	volOnce sync.Mutex
	volOK   bool

	uploads chan struct{} // one slot per PUT moving data

	// requesters caches the metadata calls' gRPC metadata by requester
	// (see requesterContext).
	requesters requesterCache
}

// New makes a gateway and opens its listener (so Addr is known before
// Serve). It does not contact the metadata service.
func New(cfg Config) (*Gateway, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, cl: cfg.Client, uploads: make(chan struct{}, cfg.MaxUploads), budget: client.NewBufferBudget(cfg.MaxUploadBytes)}
	var err error
	if g.proxies, err = parseProxies(cfg.TrustedProxies); err != nil {
		return nil, fmt.Errorf("s3: trusted proxies: %w", err)
	}
	tlsCfg := cfg.TLSConfig
	if tlsCfg == nil && (cfg.TLSCertFile != "" || cfg.TLSKeyFile != "") {
		if cfg.TLSCertFile == "" || cfg.TLSKeyFile == "" {
			return nil, errors.New("s3: TLS needs both a certificate and a key")
		}
		cert, err := tls.LoadX509KeyPair(cfg.TLSCertFile, cfg.TLSKeyFile)
		if err != nil {
			return nil, fmt.Errorf("s3: TLS certificate: %w", err)
		}
		tlsCfg = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	if g.cl == nil {
		cl, err := client.New(client.Config{MetaAddrs: cfg.MetaAddrs, Logger: cfg.Logger, MaxBufferBytes: cfg.UploadBufferBytes,
			ServiceToken: cfg.ServiceToken, Credentials: cfg.Credentials})
		if err != nil {
			return nil, fmt.Errorf("s3: %w", err)
		}
		g.cl, g.ownCl = cl, true
	}
	g.ns = g.cl.Namespace()
	g.secrets = &secrets{ns: g.ns, ttl: cfg.SecretTTL, now: cfg.Now, m: map[string]secretEntry{}}
	g.owners = &ownerCache{ns: g.ns, ttl: cfg.BucketOwnerTTL, now: cfg.Now, m: map[string]ownerEntry{}}
	g.metrics = newMetrics(cfg.Registerer)
	g.guard = guard.New(cfg.Registerer, cfg.Logger)
	g.guarded = g.guard.HTTP("s3", http.HandlerFunc(g.serve), g.panicked)
	if cfg.Listen != "" {
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			g.Close()
			return nil, fmt.Errorf("s3: listen on %s: %w", cfg.Listen, err)
		}
		g.ln = ln
		if tlsCfg != nil {
			c := tlsCfg.Clone()
			if len(c.NextProtos) == 0 {
				c.NextProtos = []string{"http/1.1"}
			}
			g.ln, g.tls = tls.NewListener(ln, c), true
		}
	}
	g.srv = &http.Server{Handler: g, ReadHeaderTimeout: cfg.ReadHeaderTimeout, MaxHeaderBytes: cfg.MaxHeaderBytes, IdleTimeout: 2 * time.Minute,
		ErrorLog: slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug)}
	return g, nil
}

// Addr is the listening address ("" without Config.Listen).
func (g *Gateway) Addr() string {
	if g.ln == nil {
		return ""
	}
	return g.ln.Addr().String()
}

// TLS reports whether the gateway serves HTTPS.
func (g *Gateway) TLS() bool { return g.tls }

// Serve serves HTTP (HTTPS with a certificate) on the listener until
// Close; it returns nil after Close.
func (g *Gateway) Serve() error {
	if g.ln == nil {
		return errors.New("s3: no listener (Config.Listen is empty); use the gateway as an http.Handler")
	}
	err := g.srv.Serve(g.ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops serving (requests in progress are cut off) and closes the
// client if the gateway made it.
func (g *Gateway) Close() error {
	var errs []error
	if g.srv != nil {
		errs = append(errs, g.srv.Close())
	}
	if g.ownCl {
		errs = append(errs, g.cl.Close())
	}
	return errors.Join(errs...)
}

// Shutdown stops accepting requests and waits for those in progress.
func (g *Gateway) Shutdown(ctx context.Context) error { return g.srv.Shutdown(ctx) }

// request is one S3 request being served.
type request struct {
	w      http.ResponseWriter
	r      *http.Request
	id     string
	bucket string
	key    string
	auth   *auth
	op     string
	// acls is the ACL a write's headers ask for (x-amz-acl,
	// x-amz-grant-*), committed with the new object.
	acls   []*metapb.Acl
	stages stageTimer
	// plainDenials: the requester is anonymous, or names an expected
	// bucket owner and is neither the owner nor an admin: every
	// AccessDenied it gets says only "Access Denied" (see
	// authorizeBucket).
	plainDenials bool
}

func requestID() string {
	var b [8]byte
	rand.Read(b[:])
	// Upper-case hex in one allocation (was hex, then strings.ToUpper:
	// two; issue 15: CPU per HEAD).
	const digits = "0123456789ABCDEF"
	var out [16]byte
	for i, c := range b {
		out[2*i], out[2*i+1] = digits[c>>4], digits[c&0xf]
	}
	return string(out[:])
}

// query is r's query parameters, or nil when it has none: most requests
// (GET, HEAD, PUT of an object) have none, and parsing an empty query
// still allocates a map. The nil map reads as empty; it is never written.
func query(r *http.Request) url.Values {
	if r.URL.RawQuery == "" {
		return nil
	}
	return r.URL.Query()
}

// ServeHTTP serves one S3 request. A panic while serving it (a bug) is
// recovered: that request gets a 500 InternalError, the gateway serves
// on, and the panic is logged with its stack and counted in
// basalt_panics_recovered_total{where="s3"}.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) { g.guarded.ServeHTTP(w, r) }

// panicked answers a request whose handler panicked before it started its
// response. The client learns nothing of the panic but the request ID,
// which finds it in the log.
func (g *Gateway) panicked(w http.ResponseWriter, r *http.Request, pe *guard.PanicError) {
	id := w.Header().Get("x-amz-request-id")
	g.cfg.Logger.Error("s3: request failed with a recovered panic", "request_id", id, "method", r.Method, "path", r.URL.Path, "err", pe)
	writeError(w, r, errorf("InternalError", 500, "We encountered an internal error. Please try again."), id)
	g.metrics.requests.WithLabelValues("Unknown", "InternalError").Inc()
}

// serve authenticates, routes and records metrics.
func (g *Gateway) serve(w http.ResponseWriter, r *http.Request) {
	req := &request{w: w, r: r, id: requestID()}
	req.stages.start = time.Now()
	// As Header.Set with the keys in canonical form (no canonicalisation,
	// which allocates for x-amz-request-id), the values in one array.
	hv := &[2]string{"Basalt", req.id}
	h := w.Header()
	h["Server"] = hv[0:1:1]
	h["X-Amz-Request-Id"] = hv[1:2:2]
	var err *Error
	req.bucket, req.key, err = g.address(r)
	if err == nil {
		t := time.Now()
		req.auth, err = g.authenticate(r)
		req.stages.auth += time.Since(t)
	}
	if err == nil {
		// Every call to the metadata service for this request acts for
		// the key's user, or for an anonymous requester (believed from a
		// gateway certificate only), and says where the request came from.
		r = r.WithContext(g.requesterContext(r.Context(), r, req.auth))
		req.r = r
	}
	// Routed after authentication: a presigned request's signed x-amz-*
	// query parameters (a copy source) are its headers by then.
	handler := g.route(req)
	if err == nil && req.auth.anonymous {
		// An anonymous requester learns nothing from a refusal (the
		// namespace's name owners and modes).
		req.plainDenials = true
		err = anonymousAllowed(req.op)
	}
	if err == nil && req.bucket != "" && req.op != "CreateBucket" && req.op != "Unsupported" {
		err = g.authorizeBucket(req, req.bucket)
	}
	if err == nil && r.Body != nil && r.Body != http.NoBody {
		r.Body = newIdleBody(w, r.Body, g.cfg.BodyIdleTimeout)
	}
	if err == nil && movesData(req.op) {
		var gone bool
		if err, gone = g.acquireUpload(r.Context()); gone {
			return // the client gave up while waiting
		}
		if err == nil {
			defer g.releaseUpload()
		}
	}
	if err == nil {
		err = handler(req)
	}
	code := "OK"
	if err != nil && req.plainDenials && err.Code == "AccessDenied" {
		err = errAccessDenied("Access Denied")
	}
	if err != nil {
		code = err.Code
		writeError(w, r, err, req.id)
	}
	g.metrics.observe(req.op, code, &req.stages)
}

// movesData tells the operations that stream a body (or a copy source)
// through the client's write buffer: they take an upload slot.
func movesData(op string) bool {
	switch op {
	case "PutObject", "UploadPart", "CopyObject", "UploadPartCopy":
		return true
	}
	return false
}

// acquireUpload takes an upload slot, waiting at most UploadWait: past
// that the answer is SlowDown. gone: the client went away meanwhile.
func (g *Gateway) acquireUpload(ctx context.Context) (e *Error, gone bool) {
	select {
	case g.uploads <- struct{}{}:
		g.metrics.uploadsInFlight.Inc()
		return nil, false
	default:
	}
	g.metrics.uploadsWaiting.Inc()
	defer g.metrics.uploadsWaiting.Dec()
	t := time.NewTimer(g.cfg.UploadWait)
	defer t.Stop()
	select {
	case g.uploads <- struct{}{}:
		g.metrics.uploadsInFlight.Inc()
		return nil, false
	case <-t.C:
		return errorf("SlowDown", 503, "Please reduce your request rate: all %d upload slots of this gateway stayed busy for %v", g.cfg.MaxUploads, g.cfg.UploadWait), false
	case <-ctx.Done():
		return nil, true
	}
}

func (g *Gateway) releaseUpload() {
	g.metrics.uploadsInFlight.Dec()
	<-g.uploads
}

// address finds the bucket and key: virtual-host style when the Host is
// "<bucket>.<domain>" of a configured domain, path style otherwise.
func (g *Gateway) address(r *http.Request) (bucket, key string, err *Error) {
	host := strings.ToLower(r.Host)
	if strings.IndexByte(host, ':') >= 0 { // (SplitHostPort's error allocates)
		if h, _, e := net.SplitHostPort(host); e == nil {
			host = h
		}
	}
	path := r.URL.Path
	for _, d := range g.cfg.Domains {
		if b, ok := strings.CutSuffix(host, "."+d); ok && b != "" {
			return b, strings.TrimPrefix(path, "/"), nil
		}
	}
	path = strings.TrimPrefix(path, "/")
	bucket, key, _ = strings.Cut(path, "/")
	return bucket, key, nil
}

type handlerFunc func(*request) *Error

// route picks the operation from method, bucket, key and sub-resources.
// A request is refused, never served as another operation, when it names
// a sub-resource its operation does not serve, a header asking for what
// the gateway does not implement, or a version other than "null".
func (g *Gateway) route(req *request) handlerFunc {
	r := req.r
	q := query(r)
	has := func(k string) bool { _, ok := q[k]; return ok }
	set := func(op string, h handlerFunc) handlerFunc { req.op = op; return h }
	unsupported := func(what string) handlerFunc {
		return set("Unsupported", func(*request) *Error { return errNotImplemented(what) })
	}
	var h handlerFunc
	switch {
	case req.bucket != "":
		h = g.routeOp(req, q, has, set)
	case r.Method == http.MethodGet:
		h = set("ListBuckets", g.listBuckets)
	default:
		h = set("Unsupported", func(*request) *Error { return errMethodNotAllowed })
	}
	if sub := unservedSubResource(req.op, r.URL.RawQuery); sub != "" {
		what := "the ?" + sub + " sub-resource"
		if req.op != "Unsupported" {
			what += " on " + req.op
		}
		return unsupported(what)
	}
	if e := unsupportedHeaders(req.op, r.Header); e != nil {
		return set("Unsupported", func(*request) *Error { return e })
	}
	if e := checkVersionID(q); e != nil {
		return set(req.op, func(*request) *Error { return e })
	}
	return h
}

// routeOp picks the operation of a request for a bucket.
func (g *Gateway) routeOp(req *request, q url.Values, has func(string) bool, set func(string, handlerFunc) handlerFunc) handlerFunc {
	r := req.r
	if req.key == "" {
		switch r.Method {
		case http.MethodPut:
			switch {
			case has("acl"):
				return set("PutBucketAcl", g.putBucketACL)
			case has("policy"):
				return set("PutBucketPolicy", g.putBucketPolicy)
			case has("publicAccessBlock"):
				return set("PutPublicAccessBlock", g.putPublicAccessBlock)
			}
			return set("CreateBucket", g.createBucket)
		case http.MethodHead:
			return set("HeadBucket", g.headBucket)
		case http.MethodDelete:
			switch {
			case has("policy"):
				return set("DeleteBucketPolicy", g.deleteBucketPolicy)
			case has("publicAccessBlock"):
				return set("DeletePublicAccessBlock", g.deletePublicAccessBlock)
			}
			return set("DeleteBucket", g.deleteBucket)
		case http.MethodGet:
			switch {
			case has("acl"):
				return set("GetBucketAcl", g.getBucketACL)
			case has("policy"):
				return set("GetBucketPolicy", g.getBucketPolicy)
			case has("policyStatus"):
				return set("GetBucketPolicyStatus", g.getBucketPolicyStatus)
			case has("publicAccessBlock"):
				return set("GetPublicAccessBlock", g.getPublicAccessBlock)
			case has("location"):
				return set("GetBucketLocation", g.getBucketLocation)
			case has("versioning"):
				return set("GetBucketVersioning", g.getBucketVersioning)
			case has("uploads"):
				return set("ListMultipartUploads", g.listMultipartUploads)
			case q.Get("list-type") == "2":
				return set("ListObjectsV2", g.listObjectsV2)
			}
			return set("ListObjects", g.listObjectsV1)
		case http.MethodPost:
			if has("delete") {
				return set("DeleteObjects", g.deleteObjects)
			}
		}
		return set("Unsupported", func(*request) *Error { return errMethodNotAllowed })
	}
	switch r.Method {
	case http.MethodPut:
		switch {
		case has("uploadId") && r.Header.Get("X-Amz-Copy-Source") != "":
			return set("UploadPartCopy", g.uploadPartCopy)
		case has("uploadId"):
			return set("UploadPart", g.uploadPart)
		case has("tagging"):
			return set("PutObjectTagging", g.putObjectTagging)
		case has("acl"):
			return set("PutObjectAcl", g.putObjectACL)
		case r.Header.Get("X-Amz-Copy-Source") != "":
			return set("CopyObject", g.copyObject)
		}
		return set("PutObject", g.putObject)
	case http.MethodGet:
		switch {
		case has("uploadId"):
			return set("ListParts", g.listParts)
		case has("tagging"):
			return set("GetObjectTagging", g.getObjectTagging)
		case has("acl"):
			return set("GetObjectAcl", g.getObjectACL)
		}
		return set("GetObject", g.getObject)
	case http.MethodHead:
		return set("HeadObject", g.headObject)
	case http.MethodDelete:
		switch {
		case has("uploadId"):
			return set("AbortMultipartUpload", g.abortMultipartUpload)
		case has("tagging"):
			return set("DeleteObjectTagging", g.deleteObjectTagging)
		}
		return set("DeleteObject", g.deleteObject)
	case http.MethodPost:
		switch {
		case has("uploads"):
			return set("CreateMultipartUpload", g.createMultipartUpload)
		case has("uploadId"):
			return set("CompleteMultipartUpload", g.completeMultipartUpload)
		}
	}
	return set("Unsupported", func(*request) *Error { return errMethodNotAllowed })
}

// writeXML sends a 200 response document.
func writeXML(req *request, v any) *Error {
	out, err := xml.Marshal(v)
	if err != nil {
		return errInternal(err)
	}
	req.w.Header().Set("Content-Type", "application/xml")
	req.w.WriteHeader(http.StatusOK)
	req.w.Write([]byte(xml.Header))
	req.w.Write(out)
	return nil
}

// readXML decodes a bounded request document.
func readXML(req *request, v any) *Error {
	a := req.auth
	b, e := newBody(req.r, a, maxXMLBody, false)
	if e != nil {
		return e
	}
	defer b.close()
	dec := xml.NewDecoder(b)
	bodyErr := func(err error) *Error {
		if b.err != nil {
			var se *Error
			if errors.As(b.err, &se) {
				return se
			}
		}
		return errMalformedXML(err)
	}
	if err := dec.Decode(v); err != nil {
		return bodyErr(err)
	}
	// One document, one root: after it only comments, processing
	// instructions and white space (a second root, or text, is not what
	// the client meant to send, and S3 refuses it too).
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			return bodyErr(err)
		}
		switch t := tok.(type) {
		case xml.StartElement:
			return errMalformedXML(fmt.Errorf("element <%s> after the document's root", t.Name.Local))
		case xml.CharData:
			if len(bytes.TrimSpace(t)) > 0 {
				return errMalformedXML(fmt.Errorf("text after the document's root"))
			}
		}
	}
	// Drain to EOF so the digests and signatures of the body are checked.
	var buf [512]byte
	for {
		_, err := b.Read(buf[:])
		if err != nil {
			if b.err != nil {
				var se *Error
				if errors.As(b.err, &se) {
					return se
				}
				return errorf("IncompleteBody", 400, "%v", b.err)
			}
			break
		}
	}
	return nil
}

// meta runs a metadata call, timing it as the metadata stage.
func (req *request) meta(f func() error) error {
	t := time.Now()
	err := f()
	req.stages.meta += time.Since(t)
	return err
}
