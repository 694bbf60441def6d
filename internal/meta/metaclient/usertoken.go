package metaclient

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// User tokens (docs/ARCHITECTURE.md, "User tokens"): a client without a
// certificate proves an S3 key to the metadata service once
// (GetUserToken, signed with the secret, never sending it), gets a token
// valid for an hour, sends it with every call as gRPC metadata
// UserTokenHeader, and renews it before it expires. The connection is
// still TLS: the client checks the meta nodes' certificates against the
// cluster CA.

// UserTokenHeader is the gRPC metadata key of a user token: the caller of
// a connection without a client certificate, or (from a gateway's
// certificate) the end user a WebHDFS delegation token names.
const UserTokenHeader = "basalt-user-token"

// UserTokenAlgorithm opens the string a GetUserToken request signs.
const UserTokenAlgorithm = "BASALT-USER-TOKEN-HMAC-SHA256"

// UserTokenStringToSign is what a GetUserToken request's signature covers:
//
//	BASALT-USER-TOKEN-HMAC-SHA256 \n GetUserToken \n access key \n
//	timestamp (unix ms, decimal) \n nonce \n renewer
func UserTokenStringToSign(accessKey string, timestampMs int64, nonce, renewer string) []byte {
	return []byte(UserTokenAlgorithm + "\nGetUserToken\n" + accessKey + "\n" + strconv.FormatInt(timestampMs, 10) + "\n" + nonce + "\n" + renewer)
}

// SignUserToken returns the HMAC-SHA256 of UserTokenStringToSign under
// secret.
func SignUserToken(secret, accessKey string, timestampMs int64, nonce, renewer string) []byte {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write(UserTokenStringToSign(accessKey, timestampMs, nonce, renewer))
	return m.Sum(nil)
}

// NewUserTokenRequest is a signed GetUserToken request for now, with a
// fresh random nonce.
func NewUserTokenRequest(accessKey, secret, renewer string, now time.Time) (*metapb.GetUserTokenRequest, error) {
	raw := make([]byte, 18)
	if _, err := rand.Read(raw); err != nil {
		return nil, err
	}
	nonce := base64.RawURLEncoding.EncodeToString(raw)
	ts := now.UnixMilli()
	return &metapb.GetUserTokenRequest{AccessKeyId: accessKey, TimestampUnixMs: ts, Nonce: nonce, Renewer: renewer,
		Signature: SignUserToken(secret, accessKey, ts, nonce, renewer)}, nil
}

// WithUserToken returns ctx whose outgoing calls carry tok (a gateway
// acting for the user a delegation token names).
func WithUserToken(ctx context.Context, tok string) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Set(UserTokenHeader, tok)
	return metadata.NewOutgoingContext(ctx, md)
}

// tokenSource keeps a client's user token: fetched on first use, renewed
// once three quarters of its validity have passed, fetched anew when
// renewal is refused (the max date came, or it was cancelled) or final:
// the answer says capped (the token's key retires: a removed meta node
// held it), or extends the token by less than half its lifetime (a
// server without the flag; near the max date). Before, a capped renewal
// was renewed again at three quarters of what was left, ever more often,
// until the token expired.
type tokenSource struct {
	c                   *Client
	accessKey, secret   string
	mu                  sync.Mutex
	tok                 *metapb.UserTokenResponse
	renewAt, validUntil time.Time
	maxUntil            time.Time     // the token's max date: no renewal goes past it
	lifetime            time.Duration // the token's first validity (expiry − issue)
}

// renewFraction: a token is renewed once this fraction of its validity
// has passed.
const renewFraction = 0.75

func (ts *tokenSource) set(t *metapb.UserTokenResponse, expiryMs int64, now time.Time) {
	ts.tok = t
	ts.validUntil = time.UnixMilli(expiryMs)
	ts.maxUntil = time.UnixMilli(t.MaxUnixMs)
	ts.lifetime = time.Duration(t.ExpiryUnixMs-t.IssueUnixMs) * time.Millisecond
	ts.renewAt = now.Add(time.Duration(float64(ts.validUntil.Sub(now)) * renewFraction))
}

// token returns a token valid now, fetching or renewing it as needed.
// A renewal that fails for another reason than the token (the service is
// unavailable) keeps the token until it expires.
func (ts *tokenSource) token(ctx context.Context) (string, error) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	now := time.Now()
	if ts.tok != nil && now.Before(ts.renewAt) {
		return ts.tok.Token, nil
	}
	// Renew while that extends the token; once it cannot (the max date
	// is its expiry), get a new one.
	if ts.tok != nil && now.Before(ts.validUntil) && ts.validUntil.Before(ts.maxUntil) {
		old := ts.tok.Token
		rctx := WithUserToken(ctx, old)
		r, err := ts.c.UserToken.RenewUserToken(rctx, &metapb.RenewUserTokenRequest{Token: old})
		if err == nil {
			ts.set(ts.tok, r.ExpiryUnixMs, now)
			if !r.Capped && ts.validUntil.Sub(now) >= ts.lifetime/2 {
				return old, nil
			}
			// Final: no later renewal extends it much. Get a new token;
			// if that fails, the renewed one serves until its renewAt.
			if tok, err := ts.fetch(ctx, now); err == nil {
				return tok, nil
			}
			return old, nil
		}
		if st, _ := status.FromError(err); st.Code() != codes.Unauthenticated && st.Code() != codes.PermissionDenied {
			// A failed renewal leaves the token as good as it was.
			return old, nil
		}
	}
	return ts.fetch(ctx, now)
}

// fetch gets a new token (ts.mu held).
func (ts *tokenSource) fetch(ctx context.Context, now time.Time) (string, error) {
	req, err := NewUserTokenRequest(ts.accessKey, ts.secret, "", now)
	if err != nil {
		return "", err
	}
	r, err := ts.c.UserToken.GetUserToken(ctx, req)
	if err != nil {
		return "", fmt.Errorf("metaclient: getting a user token with access key %s: %w", ts.accessKey, err)
	}
	ts.set(r, r.ExpiryUnixMs, now)
	return r.Token, nil
}

// invalidate drops tok (refused by a server) so the next call fetches a
// new token.
func (ts *tokenSource) invalidate(tok string) {
	ts.mu.Lock()
	if ts.tok != nil && ts.tok.Token == tok {
		ts.tok = nil
	}
	ts.mu.Unlock()
}

// Token returns the client's current user token ("" without an access
// key), fetching or renewing it as needed.
func (c *Client) Token(ctx context.Context) (string, error) {
	if c.tokens == nil {
		return "", nil
	}
	return c.tokens.token(ctx)
}

// withToken attaches the client's user token to a call (not to the token
// calls themselves, which carry their own proof).
func (c *Client) withToken(ctx context.Context, method string) (context.Context, string, error) {
	if c.tokens == nil || method == metapb.UserToken_GetUserToken_FullMethodName || method == metapb.UserToken_RenewUserToken_FullMethodName {
		return ctx, "", nil
	}
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get(UserTokenHeader)) > 0 {
		return ctx, "", nil
	}
	tok, err := c.tokens.token(ctx)
	if err != nil {
		return ctx, "", err
	}
	return WithUserToken(ctx, tok), tok, nil
}
