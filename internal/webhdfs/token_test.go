package webhdfs_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
)

// TestDelegationTokens: GETDELEGATIONTOKEN, RENEWDELEGATIONTOKEN and
// CANCELDELEGATIONTOKEN through HTTP, and requests with delegation=
// running as the token's user whatever user.name says; forged,
// cancelled and token-begotten tokens refused. Fails on the old code,
// which answered UnsupportedOperationException to all three operations.
func TestDelegationTokens(t *testing.T) {
	e := shared
	as := func(user string, kv ...string) url.Values {
		v := url.Values{"user.name": {user}}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}
	expect(t, "alice's private directory", e.do(t, "PUT", "/dtvol/dtb/private", "MKDIRS", as("alice", "permission", "700"), nil), 200, "")

	r := e.do(t, "GET", "/", "GETDELEGATIONTOKEN", as("alice", "renewer", "carol", "service", "127.0.0.1:9870"), nil)
	expect(t, "GETDELEGATIONTOKEN", r, 200, "")
	tok, _ := r.json(t)["Token"].(map[string]any)["urlString"].(string)
	parts, err := metaclient.DecodeTokenURL(tok)
	if err != nil || parts.Kind != metaclient.WebHDFSTokenKind || parts.Service != "127.0.0.1:9870" {
		t.Fatalf("token %q: %+v, %v", tok, parts, err)
	}
	if u, err := metaclient.UserTokenOwner(tok); err != nil || u != "alice" {
		t.Fatalf("token owner %q, %v", u, err)
	}

	// delegation= runs as alice, whatever user.name says.
	expect(t, "bob without a token lists private", e.do(t, "GET", "/dtvol/dtb/private", "LISTSTATUS", as("bob"), nil), 403, "org.apache.hadoop.security.AccessControlException")
	expect(t, "with alice's token, user.name=bob", e.do(t, "GET", "/dtvol/dtb/private", "LISTSTATUS", as("bob", "delegation", tok), nil), 200, "")
	if r := e.create(t, "/dtvol/dtb/private/f", []byte("by token"), as("bob", "delegation", tok)); r.code != http.StatusCreated {
		t.Fatalf("CREATE with the token: %d %s", r.code, r.body)
	}
	st := e.do(t, "GET", "/dtvol/dtb/private/f", "GETFILESTATUS", as("alice"), nil).json(t)
	if owner := st["FileStatus"].(map[string]any)["owner"]; owner != "alice" {
		t.Fatalf("file created with alice's token: owner %v", owner)
	}
	if r := e.do(t, "GET", "/dtvol/dtb/private/f", "OPEN", as("nobody", "delegation", tok), nil); r.code != 200 || string(r.body) != "by token" {
		t.Fatalf("OPEN with the token: %d %q", r.code, r.body)
	}
	expect(t, "a token from a token", e.do(t, "GET", "/", "GETDELEGATIONTOKEN", as("alice", "delegation", tok), nil), 403, "java.io.IOException")

	// Forged.
	bad := parts
	bad.Password = append([]byte(nil), parts.Password...)
	bad.Password[3] ^= 0x40
	forged := metaclient.EncodeTokenURL(bad)
	expect(t, "a forged token", e.do(t, "GET", "/dtvol/dtb/private", "LISTSTATUS", as("alice", "delegation", forged), nil), 403, "org.apache.hadoop.security.token.SecretManager$InvalidToken")
	expect(t, "garbage", e.do(t, "GET", "/dtvol/dtb/private", "LISTSTATUS", as("alice", "delegation", "xyz"), nil), 403, "org.apache.hadoop.security.token.SecretManager$InvalidToken")

	// Renewal: by the renewer only.
	expect(t, "alice renews (carol is the renewer)", e.do(t, "PUT", "/", "RENEWDELEGATIONTOKEN", as("alice", "token", tok), nil), 403, "org.apache.hadoop.security.AccessControlException")
	r = e.do(t, "PUT", "/", "RENEWDELEGATIONTOKEN", as("carol", "token", tok), nil)
	expect(t, "carol renews", r, 200, "")
	exp, _ := r.json(t)["long"].(float64)
	if d := time.Until(time.UnixMilli(int64(exp))); d < 50*time.Minute || d > 61*time.Minute {
		t.Fatalf("renewed expiry %v from now, want about an hour", d)
	}
	expect(t, "RENEW without a token", e.do(t, "PUT", "/", "RENEWDELEGATIONTOKEN", as("carol"), nil), 400, "java.lang.IllegalArgumentException")

	// Cancellation: bob may not; alice may; then the token is refused.
	expect(t, "bob cancels", e.do(t, "PUT", "/", "CANCELDELEGATIONTOKEN", as("bob", "token", tok), nil), 403, "org.apache.hadoop.security.AccessControlException")
	expect(t, "alice cancels", e.do(t, "PUT", "/", "CANCELDELEGATIONTOKEN", as("alice", "token", tok), nil), 200, "")
	r = e.do(t, "GET", "/dtvol/dtb/private", "LISTSTATUS", as("alice", "delegation", tok), nil)
	expect(t, "the cancelled token", r, 403, "org.apache.hadoop.security.token.SecretManager$InvalidToken")
	if !strings.Contains(string(r.body), "cancelled") {
		t.Fatalf("cancelled token: %s", r.body)
	}
	expect(t, "renewing the cancelled token", e.do(t, "PUT", "/", "RENEWDELEGATIONTOKEN", as("carol", "token", tok), nil), 403, "org.apache.hadoop.security.token.SecretManager$InvalidToken")
}
