package s3

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"

	"google.golang.org/grpc/metadata"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
)

// Who a request comes from, as the namespace sees it: the user of its
// access key, or an anonymous requester (no Authorization header, no
// presigned query), served only where an ACL or the bucket policy grants
// anonymous access; and where it comes from (source IP, TLS or not,
// User-Agent, Referer), which bucket policies' conditions test.

// anonymousAuth is the identity of an unsigned request. Its body is
// unsigned: a payload hash it names is still checked.
func anonymousAuth(r *http.Request) (*auth, *Error) {
	payload := r.Header.Get("X-Amz-Content-Sha256")
	switch {
	case payload == "":
		payload = unsignedPayload
	case payload == streamingSigned || payload == streamingSignedTrailer:
		return nil, errAccessDenied("Access Denied: a signed payload needs a signed request")
	case !validPayloadMode(payload):
		return nil, errorf("InvalidArgument", 400, "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, STREAMING-UNSIGNED-PAYLOAD-TRAILER or a valid sha256 value.")
	}
	return &auth{anonymous: true, payload: payload}, nil
}

// isAnonymous tells an unsigned request.
func isAnonymous(r *http.Request) bool {
	if r.Header.Get("Authorization") != "" {
		return false
	}
	q := query(r)
	for _, k := range []string{"X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Signature"} {
		if q.Has(k) {
			return false
		}
	}
	return true
}

// requesterContext is ctx whose metadata calls act for the request's
// requester and carry where the request came from
// (metaclient.WithRequester). The gRPC metadata of a requester (user,
// admin, anonymity, source address, TLS, User-Agent, Referer) is built
// once and shared by its requests (issue 15: CPU per S3 HEAD): a client
// sends many requests from one address with one User-Agent.
func (g *Gateway) requesterContext(ctx context.Context, r *http.Request, a *auth) context.Context {
	k := requesterKey{anonymous: a.anonymous, owner: a.owner, admin: a.admin, ri: metaclient.RequestInfo{
		SourceIP:        g.clientIP(r),
		SecureTransport: r.TLS != nil,
		UserAgent:       headerText(r.Header.Get("User-Agent")),
		Referer:         headerText(r.Header.Get("Referer")),
	}}
	if _, ok := metadata.FromOutgoingContext(ctx); ok {
		// Metadata of the caller's own to merge with: not cached.
		return metaclient.WithRequester(ctx, k.anonymous, k.owner, k.admin, k.ri)
	}
	return g.requesters.get(k).Context(ctx)
}

// requesterKey is what a request's gRPC metadata is made of.
type requesterKey struct {
	anonymous, admin bool
	owner            string
	ri               metaclient.RequestInfo
}

// requesterCache holds the gRPC metadata of recent requesters, prepared
// for the metadata client (metaclient.Requester: its lookups find their
// coalescing queue without copying the metadata). A cached MD is shared
// by concurrent calls and never written to: gRPC reads outgoing metadata
// in place or through copies, metaclient through copies or in place
// from a Requester's own context.
type requesterCache struct {
	mu sync.RWMutex
	m  map[requesterKey]*metaclient.Requester
}

// maxCachedRequesters bounds the cache; past it the cache starts over.
const maxCachedRequesters = 1024

func (c *requesterCache) get(k requesterKey) *metaclient.Requester {
	c.mu.RLock()
	rq, ok := c.m[k]
	c.mu.RUnlock()
	if ok {
		return rq
	}
	// The key's strings may be cuts of a request's header values (up to
	// the header limit each): keep copies, so that an entry holds the
	// ~1 KiB it uses, not the whole header (review of session 14).
	k.owner = strings.Clone(k.owner)
	k.ri.SourceIP, k.ri.UserAgent, k.ri.Referer = strings.Clone(k.ri.SourceIP), strings.Clone(k.ri.UserAgent), strings.Clone(k.ri.Referer)
	md, _ := metadata.FromOutgoingContext(metaclient.WithRequester(context.Background(), k.anonymous, k.owner, k.admin, k.ri))
	rq = metaclient.NewRequester(md)
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxCachedRequesters {
		c.m = make(map[requesterKey]*metaclient.Requester)
	}
	c.m[k] = rq
	c.mu.Unlock()
	return rq
}

// headerText makes a client's header fit gRPC metadata, which takes
// printable ASCII only (anything else would fail the call): other bytes
// become '?', and it is cut to the metadata service's limit.
func headerText(s string) string {
	if len(s) > metaclient.MaxRequestInfoBytes {
		s = s[:metaclient.MaxRequestInfoBytes]
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if b[j] < 0x20 || b[j] > 0x7e {
					b[j] = '?'
				}
			}
			return string(b)
		}
	}
	return s
}

// clientIP is the address the request came from: the connection's peer,
// or, when that peer is a trusted proxy (Config.TrustedProxies), the
// last address in X-Forwarded-For that is not one.
func (g *Gateway) clientIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	peer, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	is4 := peer.Is4()
	peer = peer.Unmap()
	if !g.trusted(peer) {
		if is4 {
			// A parsed IPv4 address is written as its String (ParseAddr
			// takes no leading zeros): no need to format it again.
			return host
		}
		return peer.String()
	}
	hops := strings.Split(strings.Join(r.Header.Values("X-Forwarded-For"), ","), ",")
	for i := len(hops) - 1; i >= 0; i-- {
		a, err := netip.ParseAddr(strings.TrimSpace(hops[i]))
		if err != nil {
			break // a forged or garbled entry: stop at the last proxy
		}
		a = a.Unmap()
		if !g.trusted(a) {
			return a.String()
		}
		peer = a
	}
	return peer.String()
}

func (g *Gateway) trusted(a netip.Addr) bool {
	for _, p := range g.proxies {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// parseProxies reads CIDRs or single addresses.
func parseProxies(list []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range list {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, err
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
}

// anonymousAllowed refuses what an anonymous requester may never do
// (list the buckets, create one). The rest the namespace decides from
// ACLs and bucket policies.
func anonymousAllowed(op string) *Error {
	switch op {
	case "ListBuckets", "CreateBucket":
		return errAccessDenied("Access Denied: anonymous requests may not " + op)
	}
	return nil
}
