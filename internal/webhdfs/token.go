package webhdfs

import (
	"errors"
	"net/http"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Delegation tokens (docs/WEBHDFS.md, "Delegation tokens"). They are the
// metadata service's user tokens (internal/meta/usertoken.go): issued to
// the request's user for a renewer, renewed by the renewer, cancelled by
// the owner or the renewer, HMAC-signed with keys kept in Raft. The URL
// string is Hadoop's Token encoding with kind "WEBHDFS delegation", so
// Hadoop's client stores and sends it back as it does the NameNode's.
//
// A request with delegation=<token> runs as the token's user: the gateway
// passes the token to the metadata service with every call, which verifies
// it (key, MAC, expiry, cancellation) and acts for its user instead of
// user.name. Without one, user.name is believed as HttpFS does with
// simple authentication.

// classInvalidToken is what Hadoop's client expects for a refused
// delegation token (it may then fetch a new one).
const classInvalidToken = "org.apache.hadoop.security.token.SecretManager$InvalidToken"

// getDelegationToken is GETDELEGATIONTOKEN: a token for the request's
// user, renewable by renewer (default the user).
func (g *Gateway) getDelegationToken(q *request) error {
	if q.delegation != "" {
		return remote(classIO, "Delegation Token can be issued only with kerberos or web authentication (this request was authenticated with a delegation token)")
	}
	r, err := g.cl.UserTokens().GetUserToken(q.ctx, &metapb.GetUserTokenRequest{Renewer: q.param("renewer")})
	if err != nil {
		return tokenErr(err)
	}
	parts, err := metaclient.DecodeTokenURL(r.Token)
	if err != nil {
		return err
	}
	parts.Kind = metaclient.WebHDFSTokenKind
	parts.Service = q.param("service")
	writeJSON(q.w, http.StatusOK, map[string]any{"Token": map[string]string{"urlString": metaclient.EncodeTokenURL(parts)}})
	return nil
}

// renewDelegationToken is RENEWDELEGATIONTOKEN: the new expiry (ms).
func (g *Gateway) renewDelegationToken(q *request) error {
	tok, err := tokenParam(q)
	if err != nil {
		return err
	}
	r, err := g.cl.UserTokens().RenewUserToken(q.ctx, &metapb.RenewUserTokenRequest{Token: tok})
	if err != nil {
		return tokenErr(err)
	}
	writeJSON(q.w, http.StatusOK, map[string]int64{"long": r.ExpiryUnixMs})
	return nil
}

// cancelDelegationToken is CANCELDELEGATIONTOKEN.
func (g *Gateway) cancelDelegationToken(q *request) error {
	tok, err := tokenParam(q)
	if err != nil {
		return err
	}
	if _, err := g.cl.UserTokens().CancelUserToken(q.ctx, &metapb.CancelUserTokenRequest{Token: tok}); err != nil {
		return tokenErr(err)
	}
	q.w.Header().Set("Content-Length", "0")
	q.w.WriteHeader(http.StatusOK)
	return nil
}

func tokenParam(q *request) (string, error) {
	tok := q.param("token")
	if tok == "" {
		return "", badParam("Required param token for op: %s is null", q.op)
	}
	if len(tok) > metaclient.MaxTokenURLBytes {
		return "", badParam("token of %d characters", len(tok))
	}
	return tok, nil
}

// tokenErr maps a refused token to Hadoop's InvalidToken (403) and a
// caller who may not get, renew or cancel it to AccessControlException.
func tokenErr(err error) error {
	if re := delegationErr(err); re != nil {
		return re
	}
	switch status.Code(err) {
	case codes.PermissionDenied:
		return remote(classAccessControl, "%v", err)
	case codes.Unavailable:
		return remote(classRetriable, "%v", err)
	case codes.InvalidArgument:
		return badParam("%v", err)
	}
	return err
}

// delegationErr is InvalidToken for an error that says the metadata
// service refused the token (nil for any other error).
func delegationErr(err error) *remoteError {
	var ce *client.Error
	if (errors.As(err, &ce) && ce.Code == codes.Unauthenticated) || status.Code(err) == codes.Unauthenticated {
		return remote(classInvalidToken, "%v", err)
	}
	return nil
}
