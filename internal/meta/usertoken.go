package meta

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
)

// User tokens: the S3 access keys authenticate `basalt sh`, `basalt
// bench`, the Go client and WebHDFS delegation tokens to the metadata
// service, without a client certificate.
//
// A client proves an S3 key once (GetUserToken: HMAC-SHA256 with the
// secret over the method, access key, a timestamp within ±5 minutes and
// a nonce; the secret never travels) and gets a token; a client
// certificate (a gateway's: for its end user) may ask too. The token is
//
//	identifier: version u8 (2) | flags u8 (1: admin, 2: certificate) |
//	            user length u8 | renewer length u8 | key ID u64 |
//	            sequence u64 | issue, expiry, max date (unix ms, i64) |
//	            user | renewer | binding length u8 |
//	            access key creation (unix ms, i64; 0 for a certificate) |
//	            binding (the access key, or the certificate's serial)
//	password:   HMAC-SHA256(user-token key, identifier)
//
// A token issued against an S3 key names it (and its creation time): a
// token is good only while that very key exists with the same owner and
// admin flag, so deleting the key (or re-creating it without the admin
// flag) ends every token issued from it, renewals included. A
// certificate caller's token names the certificate's serial (flag 2): it
// is good only while that serial is not in the revoked set this node
// holds (pki.Credentials.SetRevoked), so revoking the certificate ends
// its tokens too. A token bound to neither is refused.
//
// in Hadoop's Token URL-string form (metaclient.EncodeTokenURL), sent as
// gRPC metadata basalt-user-token. The keys are the user-token Raft
// group's own (group 3; utState), generated and rotated by its leader as
// SCM rotates the block token keys (a new key signs only after an
// activation delay, old keys verify until every token they signed passed
// its max date, or until their retire time after a removed meta node
// forced a rotation: members_keyrotate.go), and never the block token
// keys.
//
// Every meta node verifies a token on its own: the key must be recorded,
// the MAC equal (constant time), the max date and the expiry (the
// token's, or a renewal recorded through Raft) not passed, and the
// sequence number not cancelled (recorded through Raft until the max
// date). Issuing goes through Raft too: it assigns the sequence number
// and records the request's nonce, so a replayed signature is refused by
// every node.
//
// The gRPC port accepts TLS connections without a client certificate
// (the client checks the server's against the cluster CA); on those,
// only GetUserToken and calls carrying a valid token are served, and a
// token's caller is an ordinary client user with the token's name: never
// a gateway, never acting for anyone else. Everything else is refused
// (Unauthenticated) as before.

// UserTokenGroup is the Raft group of the user-token state.
const UserTokenGroup uint64 = 4

// UserTokenConfig tunes user tokens. Zero values take the defaults noted.
type UserTokenConfig struct {
	// Lifetime: a token is valid this long after it is issued or renewed
	// (default 1h).
	Lifetime time.Duration
	// MaxLifetime: no renewal goes past issue + MaxLifetime (default 7
	// days, Hadoop's dfs.namenode.delegation.token.max-lifetime).
	MaxLifetime time.Duration
	// Skew: a GetUserToken request's timestamp may be this far from the
	// server's clock (default 5 minutes, as S3's).
	Skew time.Duration
	// KeyRotation: a new key is generated when the newest is this old
	// (default 24h); ActivationDelay: it signs only this long after it is
	// recorded, so every meta node holds it first (default 10s).
	KeyRotation     time.Duration
	ActivationDelay time.Duration
	// AttemptsPerSecond and AttemptBurst bound the GetUserToken requests
	// with an S3 key proof (a caller without a certificate) a meta node
	// serves per source address and, separately, per access key (token
	// buckets; defaults 20/s and 100). Beyond them: ResourceExhausted,
	// before any work (a read barrier, an HMAC) is done. A source is an
	// IPv4 address or an IPv6 /64. Every request is charged to its
	// source; an access key's bucket is charged only by failed proofs (a
	// successful issuance is bounded by utMaxNoncesPerKey), and while it
	// is empty only the sources without a recent failed proof for that
	// key are heard: whoever guesses at a key ID does not lock its owner
	// out.
	AttemptsPerSecond float64
	AttemptBurst      int
}

func (c UserTokenConfig) withDefaults() UserTokenConfig {
	if c.Lifetime <= 0 {
		c.Lifetime = time.Hour
	}
	if c.MaxLifetime <= 0 {
		c.MaxLifetime = 7 * 24 * time.Hour
	}
	c.MaxLifetime = max(c.MaxLifetime, c.Lifetime)
	if c.Skew <= 0 {
		c.Skew = 5 * time.Minute
	}
	if c.KeyRotation <= 0 {
		c.KeyRotation = 24 * time.Hour
	}
	if c.ActivationDelay <= 0 {
		c.ActivationDelay = 10 * time.Second
	}
	if c.AttemptsPerSecond <= 0 {
		c.AttemptsPerSecond = 20
	}
	if c.AttemptBurst <= 0 {
		c.AttemptBurst = 100
	}
	return c
}

// ---------------------------------------------------------------- attempt limits

// utLimiter is a set of token buckets by name (a source address, an
// access key), bounded in size: when full, buckets that have refilled
// (idle callers) go; if none has, new names are refused until one does.
type utLimiter struct {
	mu sync.Mutex
	m  map[string]*utBucket
}

type utBucket struct {
	tokens float64
	last   time.Time
}

const utLimiterMax = 8192

// allow takes one attempt from name's bucket (rate per second, burst).
func (l *utLimiter) allow(name string, now time.Time, rate float64, burst int) bool {
	return l.use(name, now, rate, burst, true)
}

// available reports whether name's bucket holds an attempt, taking none.
func (l *utLimiter) available(name string, now time.Time, rate float64, burst int) bool {
	return l.use(name, now, rate, burst, false)
}

// clean reports whether name has no bucket short of full (no recent
// charge).
func (l *utLimiter) clean(name string, now time.Time, rate float64, burst int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.m[name]
	if b == nil {
		return true
	}
	return min(float64(burst), b.tokens+now.Sub(b.last).Seconds()*rate) >= float64(burst)
}

func (l *utLimiter) use(name string, now time.Time, rate float64, burst int, take bool) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	fill := func(b *utBucket) {
		b.tokens = min(float64(burst), b.tokens+now.Sub(b.last).Seconds()*rate)
		b.last = now
	}
	b := l.m[name]
	if b == nil {
		if l.m == nil {
			l.m = make(map[string]*utBucket)
		}
		if len(l.m) >= utLimiterMax {
			for k, o := range l.m {
				if fill(o); o.tokens >= float64(burst) {
					delete(l.m, k)
				}
			}
			if len(l.m) >= utLimiterMax {
				return false
			}
		}
		b = &utBucket{tokens: float64(burst), last: now}
		l.m[name] = b
	}
	fill(b)
	if b.tokens < 1 {
		return false
	}
	if take {
		b.tokens--
	}
	return true
}

// sourceHost is the caller's source for the attempt limits: its IPv4
// address, or the /64 of its IPv6 address (one host commonly holds a
// whole /64); "" if unknown.
func sourceHost(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	h, _, err := net.SplitHostPort(p.Addr.String())
	if err != nil {
		h = p.Addr.String()
	}
	return sourcePrefix(h)
}

// sourcePrefix is sourceHost's form of the address h.
func sourcePrefix(h string) string {
	ip := net.ParseIP(h)
	if ip == nil || ip.To4() != nil {
		return h
	}
	return (&net.IPNet{IP: ip.Mask(net.CIDRMask(64, 128)), Mask: net.CIDRMask(64, 128)}).String()
}

// peerCertSerial is the serial (pki.SerialString) of the call's client
// certificate ("" without one).
func peerCertSerial(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return ""
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.PeerCertificates) == 0 {
		return ""
	}
	return pki.SerialString(ti.State.PeerCertificates[0].SerialNumber)
}

// ---------------------------------------------------------------- token

const (
	utVersion   = 2
	utFlagAdmin = 1
	utFlagCert  = 2
	utFixed     = 4 + 8 + 8 + 3*8
	utBindFixed = 1 + 8
)

// userToken is a token's identifier.
type userToken struct {
	Admin         bool
	User, Renewer string
	KeyID, Seq    uint64
	IssueMs       int64
	ExpiryMs      int64
	MaxMs         int64
	// AccessKey is the S3 key the token was issued against ("" for a
	// certificate caller) and KeyCreatedMs that key's creation time.
	AccessKey    string
	KeyCreatedMs int64
	// CertSerial is the serial (pki.SerialString) of the client
	// certificate the token was issued to ("" for an S3 key caller).
	CertSerial string
}

func (t userToken) marshal() []byte {
	bind := t.AccessKey
	b := make([]byte, utFixed, utFixed+len(t.User)+len(t.Renewer)+utBindFixed+len(bind)+len(t.CertSerial))
	b[0] = utVersion
	if t.Admin {
		b[1] = utFlagAdmin
	}
	if t.CertSerial != "" {
		b[1] |= utFlagCert
		bind = t.CertSerial
	}
	b[2], b[3] = byte(len(t.User)), byte(len(t.Renewer))
	binary.BigEndian.PutUint64(b[4:], t.KeyID)
	binary.BigEndian.PutUint64(b[12:], t.Seq)
	binary.BigEndian.PutUint64(b[20:], uint64(t.IssueMs))
	binary.BigEndian.PutUint64(b[28:], uint64(t.ExpiryMs))
	binary.BigEndian.PutUint64(b[36:], uint64(t.MaxMs))
	b = append(append(b, t.User...), t.Renewer...)
	b = append(b, byte(len(bind)))
	b = binary.BigEndian.AppendUint64(b, uint64(t.KeyCreatedMs))
	return append(b, bind...)
}

func parseUserToken(b []byte) (userToken, error) {
	if len(b) < utFixed || b[0] != utVersion || b[1]&^(utFlagAdmin|utFlagCert) != 0 {
		return userToken{}, errors.New("not a Basalt user token (or one of an older format: get a new one)")
	}
	nu, nr := int(b[2]), int(b[3])
	end := utFixed + nu + nr
	if len(b) < end+utBindFixed || len(b) != end+utBindFixed+int(b[end]) {
		return userToken{}, errors.New("token identifier of the wrong length")
	}
	t := userToken{Admin: b[1]&utFlagAdmin != 0,
		KeyID: binary.BigEndian.Uint64(b[4:]), Seq: binary.BigEndian.Uint64(b[12:]),
		IssueMs: int64(binary.BigEndian.Uint64(b[20:])), ExpiryMs: int64(binary.BigEndian.Uint64(b[28:])), MaxMs: int64(binary.BigEndian.Uint64(b[36:])),
		User: string(b[utFixed : utFixed+nu]), Renewer: string(b[utFixed+nu : end]),
		KeyCreatedMs: int64(binary.BigEndian.Uint64(b[end+1:])), AccessKey: string(b[end+utBindFixed:])}
	if b[1]&utFlagCert != 0 {
		if t.KeyCreatedMs != 0 {
			return userToken{}, errors.New("certificate token with an access key creation time")
		}
		t.CertSerial, t.AccessKey = t.AccessKey, ""
	}
	if t.AccessKey == "" && t.CertSerial == "" {
		return userToken{}, errors.New("token bound to neither an access key nor a certificate (an older format: get a new one)")
	}
	if !validUserName(t.User) || (t.Renewer != "" && !validUserName(t.Renewer)) {
		return userToken{}, errors.New("token names an invalid user")
	}
	return t, nil
}

func validUserName(u string) bool {
	return u != "" && len(u) <= maxUserBytes && utf8.ValidString(u) && !strings.ContainsFunc(u, unicode.IsControl)
}

func utMAC(secret, id []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write(id)
	return m.Sum(nil)
}

// signUserToken signs t with key and returns its URL string.
func signUserToken(key *metapb.SecretKey, t userToken) string {
	t.KeyID = key.Id
	id := t.marshal()
	return metaclient.EncodeTokenURL(metaclient.TokenParts{Identifier: id, Password: utMAC(key.Secret, id), Kind: metaclient.UserTokenKind})
}

// verifyUserToken checks a token URL string (see the top of this file)
// and returns what it names. now is this node's clock; ctx is the call's
// (it bounds the wait for a fresh access key).
func (s *Server) verifyUserToken(ctx context.Context, tok string, now time.Time) (userToken, error) {
	refuse := func(format string, a ...any) (userToken, error) {
		return userToken{}, status.Errorf(codes.Unauthenticated, "meta node %d: user token refused: "+format, append([]any{s.cfg.NodeID}, a...)...)
	}
	// A halted replica may miss a cancellation or a key retirement.
	if err := s.utHaltedErr(); err != nil {
		return userToken{}, err
	}
	ms := now.UnixMilli()
	var retire int64 // the key's forced retire time, 0: none
	t, ok := s.utCache.get(tok)
	if !ok {
		parts, err := metaclient.DecodeTokenURL(strings.TrimSpace(tok))
		if err != nil {
			return refuse("%v", err)
		}
		if t, err = parseUserToken(parts.Identifier); err != nil {
			return refuse("%v", err)
		}
		var secret []byte
		secret, retire = s.ut.keyFor(t.KeyID)
		if secret == nil {
			return refuse("key %d is unknown (retired, or the token is forged)", t.KeyID)
		}
		if len(parts.Password) != sha256.Size || subtle.ConstantTimeCompare(parts.Password, utMAC(secret, parts.Identifier)) != 1 {
			return refuse("bad signature (forged or altered)")
		}
		s.utCache.put(tok, t)
	} else if secret, r := s.ut.keyFor(t.KeyID); secret == nil {
		return refuse("key %d is retired", t.KeyID)
	} else {
		retire = r
	}
	// A key past its forced retire time (a removed meta node held it)
	// verifies nothing, by this node's clock, whether or not the
	// user-token leader's loop has dropped it yet (it cannot without a
	// quorum). Every token it signed for a client expired or was renewed
	// up to the retire time at most (RenewUserToken), so what is left is
	// forged, most likely with the removed node's copy.
	if retire != 0 && ms >= retire {
		return refuse("key %d retired at %s (a forced rotation after a meta node was removed)", t.KeyID, time.UnixMilli(retire).UTC().Format(time.RFC3339))
	}
	if ms >= t.MaxMs {
		return refuse("token %d of %s passed its max date %s", t.Seq, t.User, time.UnixMilli(t.MaxMs).UTC().Format(time.RFC3339))
	}
	cancelled, renewed := s.ut.status(t.Seq)
	if cancelled {
		return refuse("token %d of %s was cancelled", t.Seq, t.User)
	}
	if t.CertSerial != "" && s.cfg.TLS.IsRevokedSerial(t.CertSerial) {
		return refuse("token %d of %s: certificate %s was revoked", t.Seq, t.User, t.CertSerial)
	}
	if t.AccessKey != "" {
		k := s.s3Keys.get(s, t.AccessKey)
		if !k.exists && ms-t.KeyCreatedMs < utFreshKeyMs && s.nsGroup != nil {
			// A key created moments ago may not be applied on this node
			// yet (the token was issued after a read barrier on the
			// leader): wait for what the leader has committed, briefly.
			rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			if s.nsGroup.ReadIndex(rctx) == nil {
				k = s.s3Keys.get(s, t.AccessKey)
			}
			cancel()
		}
		if !k.exists || k.owner != t.User || k.admin != t.Admin || k.createdMs != t.KeyCreatedMs {
			return refuse("token %d of %s: access key %s was deleted or changed since the token was issued", t.Seq, t.User, clip(t.AccessKey))
		}
	}
	if exp := max(t.ExpiryMs, renewed); ms >= exp {
		return refuse("token %d of %s expired at %s", t.Seq, t.User, time.UnixMilli(exp).UTC().Format(time.RFC3339))
	}
	return t, nil
}

// utCache remembers the tokens whose MAC was checked (by their whole
// string, MAC included), so a client's calls pay the HMAC once; what can
// change (the key's retirement, expiry, renewal, cancellation) is checked
// on every call. Bounded: it starts over when full.
type utCache struct {
	mu sync.RWMutex
	m  map[string]userToken
}

const utCacheMax = 16384

func (c *utCache) get(tok string) (userToken, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	t, ok := c.m[tok]
	return t, ok
}

func (c *utCache) put(tok string, t userToken) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= utCacheMax {
		c.m = make(map[string]userToken)
	}
	c.m[tok] = t
}

// utFreshKeyMs: a token whose S3 key is younger than this and not found
// here may be ahead of this node's namespace replica (see
// verifyUserToken); an older missing key is a deleted one.
const utFreshKeyMs = 60_000

// s3KeyInfo is what a token bound to an S3 key checks of it.
type s3KeyInfo struct {
	exists    bool
	owner     string
	admin     bool
	createdMs int64
}

// s3KeyCache remembers S3 keys as this node's namespace replica holds
// them, for the token check on every call. It is valid while the
// namespace state's S3SecretsGen stays (which moves after every applied
// creation or deletion of a key): a deletion ends every token of the key
// on a node as soon as the node applied it. Bounded: it starts over when
// full.
type s3KeyCache struct {
	mu  sync.RWMutex
	gen uint64
	m   map[string]s3KeyInfo
}

const s3KeyCacheMax = 16384

func (c *s3KeyCache) get(s *Server, ak string) s3KeyInfo {
	if s.nsState.Halted() != nil {
		// A halted replica's keys stop at its halt: a key deleted after
		// it would still resolve here (upgrade.go). Refuse.
		return s3KeyInfo{}
	}
	gen := s.nsState.S3SecretsGen()
	c.mu.RLock()
	k, ok := c.m[ak]
	ok = ok && c.gen == gen
	c.mu.RUnlock()
	if ok {
		return k
	}
	// Read after loading gen: a change applied meanwhile moves gen past
	// it, so what is stored below is not used again.
	k = s3KeyInfo{}
	if sec, err := s.nsState.GetS3Secret(ak); err == nil && sec != nil {
		k = s3KeyInfo{exists: true, owner: sec.Owner, admin: sec.Admin, createdMs: sec.CreatedUnixMs}
	} else if status.Code(err) != codes.NotFound {
		return s3KeyInfo{} // unreadable: refuse, do not remember
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen != gen || c.m == nil || len(c.m) >= s3KeyCacheMax {
		if c.gen > gen {
			return k // a newer generation is cached: do not go back
		}
		c.m, c.gen = make(map[string]s3KeyInfo), gen
	}
	c.m[ak] = k
	return k
}

// ---------------------------------------------------------------- authentication

// tokenCallerKey marks a call authenticated by a user token.
type tokenCallerKey struct{}

func tokenCallerOf(ctx context.Context) (userToken, bool) {
	t, ok := ctx.Value(tokenCallerKey{}).(userToken)
	return t, ok
}

func tokenFromMD(ctx context.Context) (string, bool) {
	v := metadata.ValueFromIncomingContext(ctx, metaclient.UserTokenHeader)
	if len(v) == 0 {
		return "", false
	}
	return v[0], true
}

// authorizeByToken authenticates a call that came without a client
// certificate: GetUserToken (it carries its own proof) and calls with a
// valid user token. ok is false when the call has a certificate or no
// token: the certificate path decides (and refuses a call with neither).
func (s *Server) authorizeByToken(ctx context.Context, method string) (_ context.Context, ok bool, _ error) {
	if _, err := pki.FromContext(ctx); err == nil {
		return ctx, false, nil
	}
	if method == metapb.UserToken_GetUserToken_FullMethodName {
		return ctx, true, nil
	}
	tok, has := tokenFromMD(ctx)
	if !has {
		return ctx, false, nil
	}
	t, err := s.verifyUserToken(ctx, tok, time.Now())
	if err != nil {
		return ctx, true, err
	}
	roles, known := methodRoles[method]
	if known && !slices.Contains(roles, pki.RoleClient) {
		return ctx, true, status.Errorf(codes.PermissionDenied, "%s: user %q (token) may not call it (roles allowed: %v)", methodName(method), t.User, roles)
	}
	if certOnlyMethods[method] {
		return ctx, true, status.Errorf(codes.PermissionDenied, "meta node %d: %s needs a client certificate (user %q has a token)", s.cfg.NodeID, methodName(method), t.User)
	}
	c := namespace.Caller{User: t.User, Admin: t.Admin || s.admins[t.User], Groups: s.cfg.Groups[t.User], Request: requestInfo(ctx, false)}
	if adminMethods[method] && !c.Admin {
		return ctx, true, status.Errorf(codes.PermissionDenied, "meta node %d: %s: %s is not an admin (admins: basalt meta --admins)", s.cfg.NodeID, methodName(method), c)
	}
	return context.WithValue(namespace.WithCaller(ctx, c), tokenCallerKey{}, t), true, nil
}

// gatewayTokenCaller is the end user of a gateway's call that carries a
// user token (a WebHDFS request with delegation=): the token's user,
// whatever on-behalf-of user the call names. ok is false without a token.
func (s *Server) gatewayTokenCaller(ctx context.Context) (namespace.Caller, bool, error) {
	tok, has := tokenFromMD(ctx)
	if !has {
		return namespace.Caller{}, false, nil
	}
	t, err := s.verifyUserToken(ctx, tok, time.Now())
	if err != nil {
		return namespace.Caller{}, true, err
	}
	return namespace.Caller{User: t.User, Admin: t.Admin || s.admins[t.User], Groups: s.cfg.Groups[t.User], Request: requestInfo(ctx, true)}, true, nil
}

// ---------------------------------------------------------------- service

type userTokenServer struct {
	metapb.UnimplementedUserTokenServer
	s *Server
}

// utNotLeader is UNAVAILABLE with a NotLeader detail naming the
// user-token group's leader.
func (s *Server) utNotLeader(err error) error {
	nl := &metapb.NotLeader{GroupId: UserTokenGroup}
	if leader := s.utGroup.Leader(); leader != s.cfg.NodeID {
		nl.LeaderId = leader
		if p, ok := s.peer(leader); ok {
			nl.LeaderAddr = p.GRPCAddr
		}
	}
	msg := "not the user-token group's leader"
	if err != nil {
		msg = err.Error()
	}
	st, _ := status.New(codes.Unavailable, fmt.Sprintf("meta node %d: %s", s.cfg.NodeID, msg)).WithDetails(nl)
	return st.Err()
}

// utHaltedErr refuses user-token reads and proposals on a replica whose
// user-token apply halted (upgrade.go).
func (s *Server) utHaltedErr() error { return s.groupHaltedErr("usertoken", s.ut.halt) }

// utPropose proposes cmd to the user-token group and returns Apply's
// result; raft's "not the leader" errors become utNotLeader.
func (s *Server) utPropose(ctx context.Context, cmd *metapb.UserTokenCommand) (any, error) {
	if err := s.utHaltedErr(); err != nil {
		return nil, err
	}
	if !s.utGroup.IsLeader() {
		return nil, s.utNotLeader(nil)
	}
	b, err := proto.Marshal(cmd)
	if err != nil {
		return nil, err
	}
	v, err := proposeUnlessHalted(ctx, s, s.utGroup, b, nil, applyhalt.ErrHalted)
	var nle *raft.NotLeaderError
	if errors.As(err, &nle) || errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrProposalDropped) || errors.Is(err, raft.ErrStopped) {
		return nil, s.utNotLeader(err)
	}
	if err != nil {
		return nil, err
	}
	if e, ok := v.(error); ok {
		return nil, e
	}
	return v, nil
}

// minNonceBytes and maxNonceBytes bound a GetUserToken nonce.
const minNonceBytes, maxNonceBytes = 16, 64

func validNonce(n string) bool {
	if len(n) < minNonceBytes || len(n) > maxNonceBytes {
		return false
	}
	for _, c := range n {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

func (u *userTokenServer) GetUserToken(ctx context.Context, req *metapb.GetUserTokenRequest) (*metapb.UserTokenResponse, error) {
	s := u.s
	cfg := s.cfg.UserTokens.withDefaults()
	if _, ok := tokenFromMD(ctx); ok {
		return nil, status.Error(codes.PermissionDenied, "GetUserToken: a token-authenticated call gets no token (prove an S3 key or present a certificate)")
	}
	now := time.Now()
	var user, bindKey, bindSerial string
	var admin bool
	var bindCreated int64
	op := &metapb.UserTokenIssueOp{}
	if req.AccessKeyId != "" {
		bad := func(why string) error {
			return status.Errorf(codes.Unauthenticated, "meta node %d: GetUserToken with access key %q refused: %s", s.cfg.NodeID, clip(req.AccessKeyId), why)
		}
		// Only the user-token leader issues: others send the caller there
		// before doing any work.
		if !s.utGroup.IsLeader() {
			return nil, s.utNotLeader(nil)
		}
		src := sourceHost(ctx)
		if !s.utBySource.allow(src, now, cfg.AttemptsPerSecond, cfg.AttemptBurst) {
			return nil, status.Errorf(codes.ResourceExhausted, "meta node %d: GetUserToken: too many token requests from %s (at most %g/s, bursts of %d); retry later",
				s.cfg.NodeID, src, cfg.AttemptsPerSecond, cfg.AttemptBurst)
		}
		if len(req.AccessKeyId) > 128 || !validNonce(req.Nonce) || len(req.Signature) != sha256.Size || len(req.Renewer) > maxUserBytes {
			return nil, bad("malformed request (nonce of 16 to 64 characters [A-Za-z0-9_-], 32-byte signature)")
		}
		// The key's bucket is charged by failed proofs only (below): a
		// caller who merely knows the key ID cannot spend the owner's
		// attempts. While it is empty, the sources with a recent failed
		// proof for this key are not heard; the others (its owner's) are.
		keySrc := req.AccessKeyId + "\x00" + src
		if !s.utByKey.available(keySrc, now, cfg.AttemptsPerSecond, cfg.AttemptBurst) ||
			!s.utByKey.available(req.AccessKeyId, now, cfg.AttemptsPerSecond, cfg.AttemptBurst) && !s.utByKey.clean(keySrc, now, cfg.AttemptsPerSecond, cfg.AttemptBurst) {
			return nil, status.Errorf(codes.ResourceExhausted, "meta node %d: GetUserToken: too many failed token requests for access key %q from %s (at most %g/s, bursts of %d); retry later",
				s.cfg.NodeID, clip(req.AccessKeyId), src, cfg.AttemptsPerSecond, cfg.AttemptBurst)
		}
		failed := func() error {
			s.utByKey.allow(req.AccessKeyId, now, cfg.AttemptsPerSecond, cfg.AttemptBurst)
			s.utByKey.allow(keySrc, now, cfg.AttemptsPerSecond, cfg.AttemptBurst)
			return bad("unknown access key or bad signature")
		}
		if d := now.Sub(time.UnixMilli(req.TimestampUnixMs)); d > cfg.Skew || d < -cfg.Skew {
			return nil, bad(fmt.Sprintf("the request's time is %v from the server's (at most %v): check the client's clock", d.Round(time.Second), cfg.Skew))
		}
		sec, err := s.s3Secret(ctx, req.AccessKeyId)
		if status.Code(err) == codes.Unavailable {
			return nil, err // no read barrier: retry
		}
		if err != nil || sec == nil {
			return nil, failed()
		}
		want := metaclient.SignUserToken(sec.SecretAccessKey, req.AccessKeyId, req.TimestampUnixMs, req.Nonce, req.Renewer)
		if !hmac.Equal(want, req.Signature) {
			return nil, failed()
		}
		user, admin = sec.Owner, sec.Admin
		bindKey, bindCreated = sec.AccessKeyId, sec.CreatedUnixMs
		nid := sha256.Sum256([]byte(req.AccessKeyId + "\n" + req.Nonce))
		op.NonceId, op.AccessKeyId = nid[:], req.AccessKeyId
		// The nonce is kept while its timestamp is acceptable, twice
		// over: the state's clock is the latest proposer's, which may run
		// ahead of this node's.
		op.NonceUntilUnixMs = req.TimestampUnixMs + 2*cfg.Skew.Milliseconds() + 1
	} else {
		c, ok := namespace.CallerOf(ctx)
		if _, err := pki.FromContext(ctx); err != nil || !ok {
			return nil, status.Errorf(codes.Unauthenticated, "meta node %d: GetUserToken needs an S3 key proof (access key, timestamp, nonce, signature) or a client certificate", s.cfg.NodeID)
		}
		if c.Gateway || c.User == "" {
			return nil, status.Errorf(codes.PermissionDenied, "meta node %d: GetUserToken: a gateway gets tokens only for an end user it names", s.cfg.NodeID)
		}
		user, admin = c.User, c.Admin && !s.admins[c.User]
		if id, _ := pki.FromContext(ctx); id.Role == pki.RoleMeta {
			return nil, status.Errorf(codes.PermissionDenied, "meta node %d: GetUserToken: meta nodes get no user tokens", s.cfg.NodeID)
		}
		// The token lives only as long as the certificate does not get
		// revoked (verifyUserToken).
		if bindSerial = peerCertSerial(ctx); bindSerial == "" || len(bindSerial) > 64 {
			return nil, status.Errorf(codes.Unauthenticated, "meta node %d: GetUserToken: no verified client certificate", s.cfg.NodeID)
		}
	}
	if !validUserName(user) {
		return nil, status.Errorf(codes.InvalidArgument, "meta node %d: GetUserToken: user %q is not a valid token user", s.cfg.NodeID, clip(user))
	}
	renewer := req.Renewer
	if renewer == "" {
		renewer = user
	}
	if !validUserName(renewer) {
		return nil, status.Errorf(codes.InvalidArgument, "meta node %d: GetUserToken: renewer %q: want 1 to %d characters", s.cfg.NodeID, clip(renewer), maxUserBytes)
	}
	key := s.ut.signingKey(now.UnixMilli())
	if key == nil {
		if !s.utGroup.IsLeader() {
			return nil, s.utNotLeader(nil)
		}
		return nil, status.Errorf(codes.Unavailable, "meta node %d: no user-token key is active yet (starting); retry", s.cfg.NodeID)
	}
	v, err := s.utPropose(ctx, &metapb.UserTokenCommand{NowUnixMs: now.UnixMilli(), Op: &metapb.UserTokenCommand_Issue{Issue: op}})
	if err != nil {
		return nil, err
	}
	t := userToken{Admin: admin, User: user, Renewer: renewer, Seq: v.(uint64), IssueMs: now.UnixMilli(),
		ExpiryMs: now.Add(cfg.Lifetime).UnixMilli(), MaxMs: now.Add(cfg.MaxLifetime).UnixMilli(), AccessKey: bindKey, KeyCreatedMs: bindCreated, CertSerial: bindSerial}
	tok := signUserToken(key, t)
	s.log.Info("meta: user token issued", "user", user, "renewer", renewer, "seq", t.Seq, "key", key.Id, "by_access_key", req.AccessKeyId != "")
	return &metapb.UserTokenResponse{Token: tok, User: user, Renewer: renewer, IssueUnixMs: t.IssueMs, ExpiryUnixMs: t.ExpiryMs,
		MaxUnixMs: t.MaxMs, KeyId: key.Id, Sequence: t.Seq, Admin: admin}, nil
}

// s3Secret reads an S3 key from this node's namespace replica after a
// read barrier (raft's read index: on the namespace leader, where
// runUserTokens moves the user-token leadership, one heartbeat round; on
// a follower, until it applied what the leader had committed), bounded
// in time: a key created before the request is found, and no caller
// waits on a key that does not exist.
func (s *Server) s3Secret(ctx context.Context, id string) (*metapb.S3Secret, error) {
	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.haltedErr(); err != nil {
		// Raft's read index passes on a halted replica (its applied
		// index moves on; its state does not): refuse (upgrade.go).
		return nil, err
	}
	if err := s.nsGroup.ReadIndex(bctx); err != nil {
		return nil, status.Errorf(codes.Unavailable, "meta node %d: reading access key %q: %v", s.cfg.NodeID, clip(id), err)
	}
	if err := s.haltedErr(); err != nil {
		return nil, err // halted while waiting
	}
	return s.nsState.GetS3Secret(id)
}

// callerName is who a call runs for ("" for none).
func callerName(ctx context.Context) string {
	if c, ok := namespace.CallerOf(ctx); ok {
		return c.User
	}
	return ""
}

func (u *userTokenServer) RenewUserToken(ctx context.Context, req *metapb.RenewUserTokenRequest) (*metapb.RenewUserTokenResponse, error) {
	s := u.s
	now := time.Now()
	t, err := s.verifyUserToken(ctx, req.Token, now)
	if err != nil {
		return nil, err
	}
	if who := callerName(ctx); who != t.Renewer {
		return nil, status.Errorf(codes.PermissionDenied, "meta node %d: RenewUserToken: %q may not renew token %d (its renewer is %q)", s.cfg.NodeID, clip(who), t.Seq, t.Renewer)
	}
	exp := min(now.Add(s.cfg.UserTokens.withDefaults().Lifetime).UnixMilli(), t.MaxMs)
	capped := false
	if r := s.ut.keyRetire(t.KeyID); r != 0 && r < exp {
		// Its key retires (a removed meta node held it: a forced
		// rotation): no renewal past that; the answer says so and the
		// Go client gets a new token (metaclient tokenSource). A Hadoop
		// delegation token cannot be fetched anew: it ends then.
		exp, capped = r, true
	}
	if _, err := s.utPropose(ctx, &metapb.UserTokenCommand{NowUnixMs: now.UnixMilli(), Op: &metapb.UserTokenCommand_Renew{Renew: &metapb.UserTokenRenewOp{
		Sequence: t.Seq, ExpiryUnixMs: exp, MaxUnixMs: t.MaxMs}}}); err != nil {
		return nil, err
	}
	return &metapb.RenewUserTokenResponse{ExpiryUnixMs: exp, Capped: capped}, nil
}

func (u *userTokenServer) CancelUserToken(ctx context.Context, req *metapb.CancelUserTokenRequest) (*metapb.CancelUserTokenResponse, error) {
	s := u.s
	now := time.Now()
	t, err := s.verifyUserToken(ctx, req.Token, now)
	if err != nil {
		return nil, err
	}
	c, _ := namespace.CallerOf(ctx)
	if c.User != t.User && c.User != t.Renewer && !c.Admin {
		return nil, status.Errorf(codes.PermissionDenied, "meta node %d: CancelUserToken: %q may not cancel token %d of %q (its owner, its renewer or an admin may)", s.cfg.NodeID, clip(c.User), t.Seq, t.User)
	}
	if _, err := s.utPropose(ctx, &metapb.UserTokenCommand{NowUnixMs: now.UnixMilli(), Op: &metapb.UserTokenCommand_Cancel{Cancel: &metapb.UserTokenCancelOp{
		Sequence: t.Seq, MaxUnixMs: t.MaxMs}}}); err != nil {
		return nil, err
	}
	s.log.Info("meta: user token cancelled", "user", t.User, "seq", t.Seq, "by", c.User)
	return &metapb.CancelUserTokenResponse{}, nil
}

// ---------------------------------------------------------------- keys

// runUserTokens rotates the user-token keys while this node leads the
// user-token group (and lets Apply drop expired records), as SCM rotates
// the block token keys.
func (s *Server) runUserTokens(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	kr := newKeyRotateLoop()
	for {
		// Forced rotations for removed meta nodes (members_keyrotate.go),
		// on whichever of SCM and the user-token group this node leads;
		// in this goroutine, so that the user-token key ops are proposed
		// one at a time.
		s.reconcileKeyRotations(ctx, kr)
		if s.utGroup.IsLeader() {
			if err := s.rotateUserTokenKeys(ctx); err != nil && ctx.Err() == nil {
				s.log.Debug("meta: rotating user-token keys", "err", err)
			}
			// Issuing reads S3 keys: best at the namespace leader.
			// Not to a namespace leader whose user-token replica halted:
			// it would hand the leadership back (upgrade.go).
			if ns := s.nsGroup.Leader(); ns != 0 && ns != s.cfg.NodeID && !s.peerHaltedIn(ctx, ns, "usertoken") {
				s.utGroup.TransferLeader(ns)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Server) rotateUserTokenKeys(ctx context.Context) error {
	cfg := s.cfg.UserTokens.withDefaults()
	now := time.Now()
	keys := s.ut.Keys()
	op := &metapb.UserTokenKeysOp{}
	var maxID uint64
	var newest *metapb.SecretKey
	for _, k := range keys {
		maxID = max(maxID, k.Id)
		if newest == nil || k.CreatedUnixMs > newest.CreatedUnixMs {
			newest = k
		}
	}
	if newest == nil || now.Sub(time.UnixMilli(newest.CreatedUnixMs)) >= cfg.KeyRotation {
		secret := make([]byte, utSecretSize)
		if _, err := rand.Read(secret); err != nil {
			return err
		}
		activate := now.Add(cfg.ActivationDelay)
		if newest == nil {
			activate = now // the first key: nobody can be waiting for it
		}
		op.Add = &metapb.SecretKey{Id: maxID + 1, Secret: secret, CreatedUnixMs: now.UnixMilli(), ActivateUnixMs: activate.UnixMilli()}
	}
	// A key is done once a newer one has been signing for longer than a
	// token can live (its max lifetime), plus the activation delay.
	retire := now.Add(-cfg.MaxLifetime - cfg.ActivationDelay).UnixMilli()
	for _, k := range keys {
		if k.RetireUnixMs != 0 && k.RetireUnixMs <= now.UnixMilli() {
			op.Remove = append(op.Remove, k.Id) // a forced rotation's retire time
			continue
		}
		for _, j := range keys {
			if j.ActivateUnixMs > k.ActivateUnixMs && j.ActivateUnixMs <= retire {
				op.Remove = append(op.Remove, k.Id)
				break
			}
		}
	}
	if op.Add == nil && len(op.Remove) == 0 {
		// Still advance the state's clock now and then, so expired
		// nonces and records go.
		return nil
	}
	if _, err := s.utPropose(ctx, &metapb.UserTokenCommand{NowUnixMs: now.UnixMilli(), Op: &metapb.UserTokenCommand_Keys{Keys: op}}); err != nil {
		return fmt.Errorf("recording user-token keys: %w", err)
	}
	if op.Add != nil {
		s.log.Info("meta: user-token key recorded", "key", op.Add.Id, "activates", time.UnixMilli(op.Add.ActivateUnixMs).UTC(), "dropped", op.Remove)
	}
	return nil
}

// rotateUserTokenKeysFor records, on the user-token leader, a new
// user-token key because the meta nodes members were removed, and retires
// every key recorded before it at the new key's activation + Lifetime +
// ActivationDelay: every token an old key signed before the new one took
// over has expired by then, unless renewed (a renewal never goes past
// its key's retire time: RenewUserToken). Members already rotated for
// are left out (nothing if none is left). See members_keyrotate.go.
// runUserTokens's goroutine only (as rotateUserTokenKeys).
func (s *Server) rotateUserTokenKeysFor(ctx context.Context, members []uint64) error {
	var todo []uint64
	for _, id := range members {
		if id != 0 && !slices.Contains(todo, id) && !s.ut.keysRotatedFor(id) {
			todo = append(todo, id)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	cmd, err := forcedUTKeysCmd(s.cfg.UserTokens.withDefaults(), time.Now(), s.ut.Keys(), todo)
	if err != nil {
		return err
	}
	if _, err := s.utPropose(ctx, cmd); err != nil {
		return fmt.Errorf("rotating user-token keys for removed meta nodes %v: %w", todo, err)
	}
	op := cmd.GetForcedKeyRotation()
	s.log.Info("meta: user-token keys rotated for removed meta nodes", "members", todo, "key", op.Add.Id,
		"activates", time.UnixMilli(op.Add.ActivateUnixMs).UTC(), "old keys retire", time.UnixMilli(op.RetireUnixMs).UTC())
	return nil
}

// forcedUTKeysCmd is the forced rotation's command (UserTokenCommand
// forced_key_rotation, a top-level op: a binary that does not know it
// halts at it) at now, given the keys recorded: a new key (ID max+1)
// active after the activation delay, the others retired at its
// activation + Lifetime + ActivationDelay.
func forcedUTKeysCmd(cfg UserTokenConfig, now time.Time, keys []*metapb.SecretKey, members []uint64) (*metapb.UserTokenCommand, error) {
	var maxID uint64
	for _, k := range keys {
		maxID = max(maxID, k.Id)
	}
	secret := make([]byte, utSecretSize)
	if _, err := rand.Read(secret); err != nil {
		return nil, err
	}
	activate := now.Add(cfg.ActivationDelay)
	op := &metapb.ForcedKeyRotationOp{
		Add:          &metapb.SecretKey{Id: maxID + 1, Secret: secret, CreatedUnixMs: now.UnixMilli(), ActivateUnixMs: activate.UnixMilli()},
		Members:      members,
		RetireUnixMs: activate.Add(cfg.Lifetime + cfg.ActivationDelay).UnixMilli(),
	}
	return &metapb.UserTokenCommand{NowUnixMs: now.UnixMilli(), Op: &metapb.UserTokenCommand_ForcedKeyRotation{ForcedKeyRotation: op}}, nil
}
