// Package metaclient is the client of the metadata service. It takes the
// gRPC addresses of all meta nodes, keeps persistent pooled connections to
// them, and sends each call to the leader of the group the service needs
// (namespace or SCM), following NotLeader hints and retrying on other nodes
// while there is no leader, so callers see one always-available service.
//
// Retries: a call is retried when the server says UNAVAILABLE with proof
// that nothing happened (a NotLeader detail or a NOT_APPLIED reason: not
// the leader, no leader yet, proposal dropped before it entered the log)
// or the connection could not be made. Any other failure of a call that
// changes state (CommitKey, DeleteKey, CreateBucket, ...: everything not in
// retrySafe) is not retried: an UNAVAILABLE from a connection that broke
// after the request went out is returned as UNKNOWN with the
// OUTCOME_UNKNOWN reason, like the server's own "outcome unknown" (a
// proposal that reached the log and may still commit). Read-only calls
// and calls that are harmless to repeat (retrySafe) are retried on any
// UNAVAILABLE. UNKNOWN is never retried.
//
// Gray failures: a node that accepts a call and never answers (a stopped
// or frozen process: its kernel keeps the connection open) is found by
// probing it (Prober) once a call has waited ProbeAfter on it, and the
// call is abandoned when the probe goes unanswered for ProbeTimeout, about
// 2 s in all. The node is then suspect for SuspectFor: calls go to the
// other nodes, and leader hints naming it (followers that have not yet
// noticed) are not followed, so the client finds the new leader as soon
// as one is elected. An abandoned call that is retrySafe goes on to the
// next node; any other comes back as UNKNOWN with the OUTCOME_UNKNOWN
// reason (the hung node may have it), for the caller to settle.
package metaclient

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Config configures a Client. Zero values take the defaults noted.
type Config struct {
	// Addrs are the gRPC addresses of the meta nodes (any order).
	Addrs []string
	// ConnsPerAddr is the number of HTTP/2 connections per node (default
	// 1); several spread many concurrent callers over more sockets.
	ConnsPerAddr int
	// CallTimeout bounds one call including retries when the caller's
	// context has no deadline (default 30s).
	CallTimeout time.Duration
	// MaxAttempts bounds the attempts of one call (default 50).
	MaxAttempts int
	// Backoff between attempts that found no leader (default 50ms,
	// doubling to 1s).
	Backoff time.Duration
	// DialOptions are added to the defaults (insecure credentials).
	DialOptions []grpc.DialOption
	// ProbeAfter, ProbeTimeout: hung-node detection (see the package
	// doc; defaults 1s and 1s). SuspectFor is how long a node found hung
	// is avoided unless a probe of it is answered (default 5s).
	ProbeAfter, ProbeTimeout, SuspectFor time.Duration
	// ServiceToken, if set, goes with every call as "authorization:
	// Bearer <token>": the cluster service token the S3 secret RPCs
	// require (S3 gateways, admin tools). Other callers leave it empty.
	ServiceToken string
	// AccessKey and SecretKey, if set, authenticate the calls with a user
	// token the client gets by proving the S3 key (usertoken.go): for
	// callers without a client certificate, over TLS that checks the meta
	// nodes' certificates (DialOptions).
	AccessKey, SecretKey string
	// LookupsInFlight bounds the LookupKeys batches Lookup keeps in flight
	// per requester (default DefaultLookupsInFlight); calls beyond them
	// queue and leave together in the next batch (lookup.go).
	LookupsInFlight int
	// WritesInFlight bounds the OpenKeys and the CommitKeys batches
	// OpenKeyCoalesced and CommitKeyCoalesced keep in flight per requester
	// (default DefaultWritesInFlight, 1; write.go).
	WritesInFlight int
}

// AuthorizationHeader is the gRPC metadata key of the service token.
const AuthorizationHeader = "authorization"

// bearer attaches the service token to each call. The meta service speaks
// plain gRPC, so it does not require transport security: the token
// protects the secrets from callers that lack it, not from a wiretap.
// bearer's map is built once and shared by every call: gRPC only reads
// what GetRequestMetadata returns.
type bearer struct{ md map[string]string }

func newBearer(token string) bearer {
	return bearer{md: map[string]string{AuthorizationHeader: "Bearer " + token}}
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return b.md, nil
}

func (b bearer) RequireTransportSecurity() bool { return false }

// Client is safe for concurrent use.
type Client struct {
	cfg   Config
	conns map[string][]*grpc.ClientConn
	rr    atomic.Uint64

	prober *Prober

	mu      sync.Mutex
	next    uint64               // rotation over Addrs when no leader is known
	leader  map[string]string    // service name → leader address
	suspect map[string]time.Time // address → avoided until

	tokens *tokenSource // nil without Config.AccessKey

	lookups coalescer // Lookup (lookup.go)
	// OpenKeyCoalesced, CommitKeyCoalesced (write.go)
	opens   writeCoalescer[*metapb.OpenKeyRequest, *metapb.OpenKeyResponse]
	commits writeCoalescer[*metapb.CommitKeyRequest, *metapb.KeyInfo]
	// TakeReserved (reserve.go)
	reserves reservePools

	Namespace metapb.NamespaceClient
	Scm       metapb.ScmClient
	Ca        metapb.CaClient // the cluster CA (routed to the CA group's leader)
	UserToken metapb.UserTokenClient
	Upgrade   metapb.UpgradeClient // layout versions (routed to the namespace leader)
}

// New returns a client; connections are made lazily.
func New(cfg Config) (*Client, error) {
	if len(cfg.Addrs) == 0 {
		return nil, errors.New("metaclient: no meta addresses")
	}
	if cfg.ConnsPerAddr <= 0 {
		cfg.ConnsPerAddr = 1
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = 50
	}
	if cfg.Backoff == 0 {
		cfg.Backoff = 50 * time.Millisecond
	}
	if cfg.SuspectFor <= 0 {
		cfg.SuspectFor = DefaultSuspectFor
	}
	c := &Client{cfg: cfg, conns: map[string][]*grpc.ClientConn{}, leader: map[string]string{}, suspect: map[string]time.Time{},
		prober: NewProber(ProberConfig{ProbeAfter: cfg.ProbeAfter, ProbeTimeout: cfg.ProbeTimeout})}
	opts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, cfg.DialOptions...)
	if cfg.ServiceToken != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(newBearer(cfg.ServiceToken)))
	}
	for _, a := range cfg.Addrs {
		if _, dup := c.conns[a]; dup {
			continue
		}
		for range cfg.ConnsPerAddr {
			cc, err := grpc.NewClient(a, opts...)
			if err != nil {
				c.Close()
				return nil, fmt.Errorf("metaclient: connect %s: %w", a, err)
			}
			c.conns[a] = append(c.conns[a], cc)
		}
	}
	if cfg.LookupsInFlight <= 0 {
		cfg.LookupsInFlight = DefaultLookupsInFlight
	}
	c.lookups.c, c.lookups.maxInflight = c, cfg.LookupsInFlight
	if cfg.WritesInFlight <= 0 {
		cfg.WritesInFlight = DefaultWritesInFlight
	}
	c.initWrites(cfg.WritesInFlight)
	c.Namespace = metapb.NewNamespaceClient(&router{c: c})
	c.Scm = metapb.NewScmClient(&router{c: c})
	c.Ca = metapb.NewCaClient(&router{c: c})
	c.UserToken = metapb.NewUserTokenClient(&router{c: c})
	c.Upgrade = metapb.NewUpgradeClient(&router{c: c})
	if cfg.AccessKey != "" {
		if cfg.SecretKey == "" {
			c.Close()
			return nil, fmt.Errorf("metaclient: access key %s without a secret key", cfg.AccessKey)
		}
		c.tokens = &tokenSource{c: c, accessKey: cfg.AccessKey, secret: cfg.SecretKey}
	}
	return c, nil
}

// Close closes every connection.
func (c *Client) Close() error {
	var errs []error
	for _, ccs := range c.conns {
		for _, cc := range ccs {
			errs = append(errs, cc.Close())
		}
	}
	return errors.Join(errs...)
}

// Leader returns the address the client currently sends a service's calls
// to ("" if none known). service is "Namespace" or "Scm".
func (c *Client) Leader(service string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.leader[service]
}

func serviceOf(method string) string {
	// "/basalt.meta.v1.Namespace/LookupKey" → "Namespace"
	s := strings.TrimPrefix(method, "/")
	if i := strings.IndexByte(s, '/'); i >= 0 {
		s = s[:i]
	}
	if i := strings.LastIndexByte(s, '.'); i >= 0 {
		s = s[i+1:]
	}
	return s
}

// router is a grpc.ClientConnInterface that routes each call to the
// current leader and retries.
type router struct{ c *Client }

func (r *router) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, status.Error(codes.Unimplemented, "metaclient: streams are not routed")
}

func (r *router) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	c := r.c
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.cfg.CallTimeout)
		defer cancel()
	}
	ctx, tok, err := c.withToken(ctx, method)
	if err != nil {
		return err
	}
	err = r.invoke(ctx, method, args, reply, opts...)
	if tok != "" && status.Code(err) == codes.Unauthenticated {
		// The token expired or was cancelled under us: once more with a
		// new one.
		c.tokens.invalidate(tok)
		if ctx, _, err = c.withToken(metadata.NewOutgoingContext(ctx, withoutToken(ctx)), method); err != nil {
			return err
		}
		err = r.invoke(ctx, method, args, reply, opts...)
	}
	return err
}

func withoutToken(ctx context.Context) metadata.MD {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Delete(UserTokenHeader)
	return md
}

func (r *router) invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	c := r.c
	svc := serviceOf(method)
	backoff := c.cfg.Backoff
	var last error
	for attempt := 0; attempt < c.cfg.MaxAttempts; attempt++ {
		addr := c.pick(svc)
		conns := c.conns[addr]
		if conns == nil {
			// A leader hint naming a node we were not told about (a meta
			// node forwarding for a client is not given its own address,
			// and a stale hint can name it): nothing was sent, so this is
			// an election-like gap — pause and ask the configured nodes
			// again, and if the attempts run out, the caller sees a
			// retryable Unavailable rather than a bare error.
			last = status.Errorf(codes.Unavailable, "metaclient: leader %s is not among the configured addresses %v", addr, c.cfg.Addrs)
			c.forget(svc, addr)
			if err := c.pause(ctx, method, &backoff, last); err != nil {
				return err
			}
			continue
		}
		cc := conns[c.rr.Add(1)%uint64(len(conns))]
		actx, done := c.prober.Watch(ctx, cc)
		err := cc.Invoke(actx, method, args, reply, opts...)
		hung := done()
		if err == nil {
			c.clearSuspect(addr)
			return nil
		}
		if hung {
			// The node took the call and then answered nothing, not even
			// a probe: avoid it, and go on if the call allows.
			c.markSuspect(addr)
			c.forget(svc, addr)
			last = status.Errorf(codes.Unavailable, "metaclient: %s to %s: %v (waited with no answer)", method, addr, ErrHung)
			if !retrySafe[method] {
				return outcomeUnknown(method, addr, last)
			}
			continue
		}
		if ctx.Err() != nil {
			// The caller's own deadline or cancellation, told apart from a
			// server's DeadlineExceeded: errors.Is(err, ctx.Err()) holds,
			// and the status is still there for status.Code.
			return fmt.Errorf("metaclient: %s: %w: %w", method, ctx.Err(), err)
		}
		last = err
		st, _ := status.FromError(err)
		if st.Code() != codes.Unavailable {
			return err
		}
		hint, notApplied := "", false
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *metapb.NotLeader:
				hint, notApplied = d.LeaderAddr, true
			case *errdetails.ErrorInfo:
				// A halted replica refuses before its log (layout.go).
				notApplied = notApplied || d.Reason == metapb.ReasonNotApplied || d.Reason == metapb.ReasonReplicaHalted
			}
		}
		if !notApplied && !retrySafe[method] && !neverSent(st) {
			return outcomeUnknown(method, addr, err)
		}
		if hint != "" && hint != addr && !c.suspected(hint) {
			c.mu.Lock()
			c.leader[svc] = hint
			c.mu.Unlock()
			continue // redirect at once
		}
		// No leader known (election), the hint names a node found hung
		// (this node has not noticed yet), or the node is down: try the
		// next node after a pause.
		c.forget(svc, addr)
		if err := c.pause(ctx, method, &backoff, last); err != nil {
			return err
		}
	}
	return last
}

// pick returns the address to send svc's next call to: the leader last
// seen, else the next configured node in turn that is not suspect (any
// node if all are).
func (c *Client) pick(svc string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if a := c.leader[svc]; a != "" && !c.suspectedLocked(a) {
		return a
	}
	n := len(c.cfg.Addrs)
	start := int(c.next % uint64(n))
	addr := c.cfg.Addrs[start]
	for i := range n {
		if a := c.cfg.Addrs[(start+i)%n]; !c.suspectedLocked(a) {
			addr = a
			break
		}
	}
	c.next++
	c.leader[svc] = addr
	return addr
}

func (c *Client) suspectedLocked(addr string) bool {
	until, ok := c.suspect[addr]
	if ok && time.Now().After(until) {
		delete(c.suspect, addr)
		return false
	}
	return ok
}

func (c *Client) suspected(addr string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.suspectedLocked(addr)
}

func (c *Client) markSuspect(addr string) {
	c.mu.Lock()
	c.suspect[addr] = time.Now().Add(c.cfg.SuspectFor)
	c.mu.Unlock()
}

func (c *Client) clearSuspect(addr string) {
	c.mu.Lock()
	if _, ok := c.suspect[addr]; ok {
		delete(c.suspect, addr)
	}
	c.mu.Unlock()
}

// Suspect reports whether addr was found hung and is being avoided.
func (c *Client) Suspect(addr string) bool { return c.suspected(addr) }

// pause waits out one backoff step (doubling it, up to a second) before the
// next attempt, or returns the context's error.
func (c *Client) pause(ctx context.Context, method string, backoff *time.Duration, last error) error {
	t := time.NewTimer(*backoff)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return fmt.Errorf("metaclient: %s: %w (last error: %v)", method, ctx.Err(), last)
	case <-t.C:
	}
	*backoff = min(2**backoff, time.Second)
	return nil
}

// retrySafe lists the calls that may be sent again after any UNAVAILABLE:
// reads, and writes whose repetition is harmless (a second OpenKey or
// AllocateBlock leaves an unused open key or block that expires; datanode
// registration and heartbeats are idempotent; a block deleted twice is
// deleted).
var retrySafe = map[string]bool{
	metapb.Scm_RegisterDatanode_FullMethodName:     true,
	metapb.Scm_Heartbeat_FullMethodName:            true,
	metapb.Scm_AllocateBlocks_FullMethodName:       true,
	metapb.Scm_DeleteBlocks_FullMethodName:         true,
	metapb.Scm_GetContainers_FullMethodName:        true,
	metapb.Scm_ReportCorruptReplica_FullMethodName: true,
	metapb.Scm_ListCorruptReplicas_FullMethodName:  true,
	metapb.Scm_ListDatanodes_FullMethodName:        true,
	metapb.Scm_ListPipelines_FullMethodName:        true,
	metapb.Scm_ListContainers_FullMethodName:       true,
	metapb.Scm_GetSafeMode_FullMethodName:          true,

	metapb.Namespace_GetVolume_FullMethodName:            true,
	metapb.Namespace_ListVolumes_FullMethodName:          true,
	metapb.Namespace_GetBucket_FullMethodName:            true,
	metapb.Namespace_ListBuckets_FullMethodName:          true,
	metapb.Namespace_OpenKey_FullMethodName:              true,
	metapb.Namespace_OpenKeys_FullMethodName:             true,
	metapb.Namespace_AllocateBlock_FullMethodName:        true,
	metapb.Namespace_LookupKey_FullMethodName:            true,
	metapb.Namespace_LookupKeys_FullMethodName:           true,
	metapb.Namespace_ListKeys_FullMethodName:             true,
	metapb.Namespace_GetFileStatus_FullMethodName:        true,
	metapb.Namespace_ListStatus_FullMethodName:           true,
	metapb.Namespace_ListParts_FullMethodName:            true,
	metapb.Namespace_ListMultipartUploads_FullMethodName: true,
	metapb.Namespace_GetS3Secret_FullMethodName:          true,
	// A second token is harmless; a renewal repeated renews again.
	metapb.UserToken_GetUserToken_FullMethodName:   true,
	metapb.UserToken_RenewUserToken_FullMethodName: true,
	// An extra reservation expires unused, as an extra open key.
	metapb.Namespace_ReserveBlocks_FullMethodName: true,
}

// RetrySafe reports whether method (a full gRPC method name) may be sent
// again whatever happened to an earlier try. The server uses it too: for
// these it reports a lost proposal outcome as a retryable UNAVAILABLE.
func RetrySafe(method string) bool { return retrySafe[method] }

// neverSent reports whether an UNAVAILABLE came from a connection that
// could not be made, so the request never left this process. gRPC says
// so only in the message ("connection error: ... Error while dialing");
// anything else (a reset, EOF, a closing transport) may have come after
// the server got the request.
func neverSent(st *status.Status) bool {
	return strings.Contains(st.Message(), "Error while dialing")
}

func outcomeUnknown(method, addr string, err error) error {
	st, _ := status.Newf(codes.Unknown, "metaclient: %s to %s: outcome unknown, the call may or may not have been applied (the connection failed after it was sent): %v", method, addr, err).
		WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonOutcomeUnknown, Domain: metapb.ReasonDomain})
	return st.Err()
}

func (c *Client) forget(svc, addr string) {
	c.mu.Lock()
	if c.leader[svc] == addr {
		c.leader[svc] = ""
	}
	c.mu.Unlock()
}
