package webhdfs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/pki"
)

// Defaults and limits.
const (
	// DefaultPort is the NameNode's HTTP port, where Hadoop users look for
	// WebHDFS.
	DefaultPort = 9870
	// Prefix is the path every WebHDFS request starts with.
	Prefix = "/webhdfs/v1"
	// DefaultMaxTransfers bounds the OPEN and CREATE requests moving data
	// at once; each holds at most the client's write buffer or a few read
	// chunks.
	DefaultMaxTransfers = 16
	DefaultTransferWait = 10 * time.Second
	// listPage is the entries one LISTSTATUS_BATCH returns and one page of
	// a streamed LISTSTATUS (the NameNode's dfs.ls.limit).
	listPage = 1000
	// maxSummaryEntries bounds the entries one GETCONTENTSUMMARY visits.
	maxSummaryEntries = 10_000_000
	// maxDeleteBuckets bounds the buckets a recursive DELETE of a volume
	// deletes.
	maxDeleteBuckets = 10_000
	// The defaults reported for entries with nothing stored.
	defaultGroup     = "supergroup"
	defaultDirPerm   = "755"
	defaultFilePerm  = "644"
	defaultBlockSize = 256 << 20
)

// Config configures a Gateway. Zero values take the defaults noted.
type Config struct {
	// MetaAddrs are the metadata service's gRPC addresses (ignored when
	// Client is set).
	MetaAddrs []string
	// Client is the Basalt client to share; nil: New makes one from
	// MetaAddrs and Close closes it.
	Client *client.Client
	// Credentials authenticate the client New makes (client.Config).
	Credentials *pki.Credentials
	// Listen is the HTTP address ("127.0.0.1:9870"; ":0" picks a port).
	Listen string
	// MaxTransfers bounds the data-moving requests (OPEN, CREATE's data
	// step) served at once (default 16); more wait up to TransferWait, then
	// get a RetriableException (503).
	MaxTransfers int
	TransferWait time.Duration
	// UploadBufferBytes is the write buffer of the client the gateway
	// makes (default 16 MiB; ignored when Client is set).
	UploadBufferBytes int64
	// BlockSize is the block size reported in file statuses and server
	// defaults (default 256 MiB, Basalt's default block size).
	BlockSize int64
	Logger    *slog.Logger
}

func (c *Config) setDefaults() error {
	if c.Client == nil && len(c.MetaAddrs) == 0 {
		return errors.New("webhdfs: no metadata service addresses (Config.MetaAddrs)")
	}
	if c.MaxTransfers == 0 {
		c.MaxTransfers = DefaultMaxTransfers
	}
	if c.MaxTransfers < 0 {
		return fmt.Errorf("webhdfs: MaxTransfers %d is negative", c.MaxTransfers)
	}
	if c.TransferWait == 0 {
		c.TransferWait = DefaultTransferWait
	}
	if c.UploadBufferBytes == 0 {
		c.UploadBufferBytes = 16 << 20
	}
	if c.BlockSize == 0 {
		c.BlockSize = defaultBlockSize
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Gateway is a WebHDFS gateway. It keeps no state of its own.
type Gateway struct {
	cfg       Config
	cl        *client.Client
	ownCl     bool
	ln        net.Listener
	srv       *http.Server
	transfers chan struct{}
}

// New makes a gateway and opens its listener (so Addr is known before
// Serve). It does not contact the metadata service.
func New(cfg Config) (*Gateway, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, cl: cfg.Client, transfers: make(chan struct{}, cfg.MaxTransfers)}
	if g.cl == nil {
		cl, err := client.New(client.Config{MetaAddrs: cfg.MetaAddrs, Logger: cfg.Logger, MaxBufferBytes: cfg.UploadBufferBytes, Credentials: cfg.Credentials})
		if err != nil {
			return nil, fmt.Errorf("webhdfs: %w", err)
		}
		g.cl, g.ownCl = cl, true
	}
	if cfg.Listen != "" {
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			g.Close()
			return nil, fmt.Errorf("webhdfs: listen on %s: %w", cfg.Listen, err)
		}
		g.ln = ln
	}
	g.srv = &http.Server{Handler: g, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute,
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

// Serve serves HTTP on the listener until Close; it returns nil after
// Close.
func (g *Gateway) Serve() error {
	if g.ln == nil {
		return errors.New("webhdfs: no listener (Config.Listen is empty); use the gateway as an http.Handler")
	}
	err := g.srv.Serve(g.ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops serving and closes the client if the gateway made it.
func (g *Gateway) Close() error {
	var err error
	if g.srv != nil {
		err = g.srv.Close()
	}
	if g.ln != nil {
		g.ln.Close()
	}
	if g.ownCl {
		if cerr := g.cl.Close(); err == nil {
			err = cerr
		}
	}
	return err
}

// fsPath is a WebHDFS path split the ofs way.
type fsPath struct {
	volume, bucket, key string
}

// depth: 0 the root, 1 a volume, 2 a bucket's root, 3 inside a bucket.
func (p fsPath) depth() int {
	switch {
	case p.volume == "":
		return 0
	case p.bucket == "":
		return 1
	case p.key == "":
		return 2
	}
	return 3
}

func (p fsPath) String() string {
	s := "/"
	for _, c := range []string{p.volume, p.bucket, p.key} {
		if c == "" {
			break
		}
		if s != "/" {
			s += "/"
		}
		s += c
	}
	return s
}

// name is the last component ("" for the root).
func (p fsPath) name() string {
	switch p.depth() {
	case 0:
		return ""
	case 1:
		return p.volume
	case 2:
		return p.bucket
	}
	return p.key[strings.LastIndexByte(p.key, '/')+1:]
}

// child is p's child called name.
func (p fsPath) child(name string) fsPath {
	switch p.depth() {
	case 0:
		return fsPath{volume: name}
	case 1:
		return fsPath{volume: p.volume, bucket: name}
	case 2:
		return fsPath{volume: p.volume, bucket: p.bucket, key: name}
	}
	return fsPath{volume: p.volume, bucket: p.bucket, key: p.key + "/" + name}
}

// parsePath splits an absolute path; "." and ".." components and empty
// ones (other than a trailing slash) are refused, as HDFS does.
func parsePath(s string) (fsPath, error) {
	if !strings.HasPrefix(s, "/") {
		return fsPath{}, remote(classInvalidPathExcept, "Invalid path name %q: not absolute", s)
	}
	s = strings.TrimRight(s, "/")
	if s == "" {
		return fsPath{}, nil
	}
	parts := strings.Split(s[1:], "/")
	for _, c := range parts {
		if c == "" || c == "." || c == ".." {
			return fsPath{}, remote(classInvalidPathExcept, "Invalid path name %q: empty, \".\" or \"..\" component", s)
		}
	}
	p := fsPath{volume: parts[0]}
	if len(parts) > 1 {
		p.bucket = parts[1]
	}
	if len(parts) > 2 {
		p.key = strings.Join(parts[2:], "/")
	}
	return p, nil
}

// request is one WebHDFS call.
type request struct {
	ctx  context.Context
	w    http.ResponseWriter
	r    *http.Request
	op   string
	path fsPath
	user string
	// delegation is the request's delegation token ("" for none): the
	// request runs as its user (token.go).
	delegation string
}

// param is a query parameter by name, matched without regard to case as
// the NameNode does: Hadoop's Java client sends some names in lower case
// (StartAfterParam.NAME is "startafter" in 3.4.1, where the REST
// documentation writes startAfter).
func (q *request) param(name string) string {
	vs := q.r.URL.Query()
	if v, ok := vs[name]; ok && len(v) > 0 {
		return v[0]
	}
	for k, v := range vs {
		if len(v) > 0 && strings.EqualFold(k, name) {
			return v[0]
		}
	}
	return ""
}

// ServeHTTP serves WebHDFS under Prefix. A panic in a handler becomes a
// 500 IOException for that request only.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			g.cfg.Logger.Error("webhdfs: handler panic", "method", r.Method, "url", r.URL.String(), "panic", v, "stack", string(debug.Stack()))
			writeRemote(w, &remoteError{status: http.StatusInternalServerError, class: classIO, msg: fmt.Sprintf("internal error serving %s %s: %v", r.Method, r.URL.Path, v)})
		}
	}()
	if err := g.serve(w, r); err != nil {
		re := toRemote(fsPath{}, err)
		if re.status >= 500 {
			g.cfg.Logger.Warn("webhdfs: request failed", "method", r.Method, "url", r.URL.String(), "err", err)
		}
		writeRemote(w, re)
	}
}

func (g *Gateway) serve(w http.ResponseWriter, r *http.Request) error {
	rest, ok := strings.CutPrefix(r.URL.Path, Prefix)
	if !ok || (rest != "" && rest[0] != '/') {
		return &remoteError{status: http.StatusNotFound, class: classFileNotFound, msg: fmt.Sprintf("%s is not a WebHDFS path (want %s/...)", r.URL.Path, Prefix)}
	}
	if rest == "" {
		rest = "/"
	}
	p, err := parsePath(rest)
	if err != nil {
		return err
	}
	q := &request{ctx: r.Context(), w: w, r: r, op: strings.ToUpper(r.URL.Query().Get("op")), path: p, user: r.URL.Query().Get("user.name")}
	if d := r.URL.Query().Get("doas"); d != "" {
		q.user = d // a proxy user acting for doas (nothing is authenticated yet)
	}
	if q.user == "" {
		q.user = "dr.who" // HDFS's anonymous user
	}
	// The metadata service authorizes every call for q.user. Hadoop's
	// simple authentication does not prove it: as HttpFS with simple
	// auth, this gateway is trusted to assert users (see
	// docs/ARCHITECTURE.md, Security).
	q.ctx = metaclient.WithUser(q.ctx, q.user, false)
	if d := q.param("delegation"); d != "" {
		// The metadata service verifies the token on every call and acts
		// for its user; the gateway reads the name only to record owners.
		u, err := metaclient.UserTokenOwner(d)
		if err != nil {
			return remote(classInvalidToken, "delegation token: %v", err)
		}
		q.user, q.delegation = u, d
		q.ctx = metaclient.WithUserToken(metaclient.WithUser(q.ctx, u, false), d)
	}
	h, ok := ops[r.Method+" "+q.op]
	if !ok {
		if _, known := knownOps[q.op]; known {
			return unsupported("WebHDFS operation %s (%s) is not supported by Basalt", q.op, r.Method)
		}
		return badParam("Invalid value for webhdfs parameter \"op\": %q with method %s", q.op, r.Method)
	}
	err = h(g, q)
	if q.delegation != "" {
		if re := delegationErr(err); re != nil {
			return re
		}
	}
	return err
}

var ops map[string]func(*Gateway, *request) error

func init() {
	ops = map[string]func(*Gateway, *request) error{
		"GET OPEN":                  (*Gateway).open,
		"GET GETFILESTATUS":         (*Gateway).getFileStatus,
		"GET LISTSTATUS":            (*Gateway).listStatus,
		"GET LISTSTATUS_BATCH":      (*Gateway).listStatusBatch,
		"GET GETCONTENTSUMMARY":     (*Gateway).contentSummary,
		"GET GETFILECHECKSUM":       (*Gateway).fileChecksum,
		"GET GETFILEBLOCKLOCATIONS": (*Gateway).blockLocations,
		"GET GETHOMEDIRECTORY":      (*Gateway).homeDirectory,
		"GET GETTRASHROOT":          (*Gateway).trashRoot,
		"GET GETSERVERDEFAULTS":     (*Gateway).serverDefaults,
		"GET CHECKACCESS":           (*Gateway).checkAccess,
		"PUT CREATE":                (*Gateway).create,
		"PUT MKDIRS":                (*Gateway).mkdirs,
		"PUT RENAME":                (*Gateway).rename,
		"PUT SETPERMISSION":         (*Gateway).setPermission,
		"PUT SETOWNER":              (*Gateway).setOwner,
		"PUT SETTIMES":              (*Gateway).setTimes,
		"PUT SETREPLICATION":        (*Gateway).setReplication,
		"DELETE DELETE":             (*Gateway).delete,
		"GET GETDELEGATIONTOKEN":    (*Gateway).getDelegationToken,
		"PUT RENEWDELEGATIONTOKEN":  (*Gateway).renewDelegationToken,
		"PUT CANCELDELEGATIONTOKEN": (*Gateway).cancelDelegationToken,
		"POST APPEND":               (*Gateway).appendOp,
		"POST CONCAT":               (*Gateway).concat,
		"POST TRUNCATE":             (*Gateway).truncate,
	}
}

// knownOps are WebHDFS operations Basalt does not implement: they answer
// UnsupportedOperationException rather than "invalid op".
var knownOps = map[string]struct{}{
	"GET_BLOCK_LOCATIONS": {}, "GETACLSTATUS": {}, "GETXATTRS": {}, "LISTXATTRS": {},
	"GETDELEGATIONTOKEN": {}, "RENEWDELEGATIONTOKEN": {}, "CANCELDELEGATIONTOKEN": {}, "GETQUOTAUSAGE": {},
	"GETSTORAGEPOLICY": {}, "GETALLSTORAGEPOLICY": {}, "GETSNAPSHOTDIFF": {}, "GETSNAPSHOTTABLEDIRECTORYLIST": {},
	"GETSNAPSHOTLIST": {}, "GETECPOLICY": {}, "GETSTATUS": {}, "GETLINKTARGET": {}, "GETFILELINKSTATUS": {},
	"CREATESYMLINK": {}, "SETACL": {}, "MODIFYACLENTRIES": {}, "REMOVEACLENTRIES": {}, "REMOVEDEFAULTACL": {},
	"REMOVEACL": {}, "SETXATTR": {}, "REMOVEXATTR": {}, "CREATESNAPSHOT": {}, "RENAMESNAPSHOT": {},
	"DELETESNAPSHOT": {}, "ALLOWSNAPSHOT": {}, "DISALLOWSNAPSHOT": {}, "SETSTORAGEPOLICY": {},
	"UNSETSTORAGEPOLICY": {}, "SATISFYSTORAGEPOLICY": {}, "SETQUOTA": {}, "SETQUOTABYSTORAGETYPE": {},
	"ENABLEECPOLICY": {}, "DISABLEECPOLICY": {}, "SETECPOLICY": {}, "UNSETECPOLICY": {},
	"OPEN": {}, "CREATE": {}, "APPEND": {}, "CONCAT": {}, "TRUNCATE": {}, "DELETE": {}, "MKDIRS": {}, "RENAME": {},
}

// transfer takes a data slot, waiting at most TransferWait.
func (g *Gateway) transfer(ctx context.Context) (func(), error) {
	t := time.NewTimer(g.cfg.TransferWait)
	defer t.Stop()
	select {
	case g.transfers <- struct{}{}:
		return func() { <-g.transfers }, nil
	case <-t.C:
		return nil, remote(classRetriable, "the gateway is moving %d files' data already; retry", cap(g.transfers))
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
