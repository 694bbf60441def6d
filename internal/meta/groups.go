package meta

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

// Group membership for ACL entries of type GROUP and policy principals
// "group:<name>" (docs/SECURITY.md): a static mapping given to every meta
// node (basalt meta --groups 'alice=analysts,etl;bob=etl' or
// --groups-file, one "user=group,group" per line, # comments). Each node
// resolves its callers' groups itself, so every node needs the same map.

// Bounds of the mapping.
const (
	maxGroupUsers    = 100_000
	maxGroupsPerUser = 64
)

// ParseGroups reads "user=g1,g2;user2=g3" (newlines also separate users).
func ParseGroups(spec string) (map[string][]string, error) {
	out := map[string][]string{}
	for i, line := range strings.FieldsFunc(spec, func(r rune) bool { return r == ';' || r == '\n' }) {
		if c := strings.IndexByte(line, '#'); c >= 0 {
			line = line[:c]
		}
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		user, groups, ok := strings.Cut(line, "=")
		user = strings.TrimSpace(user)
		if !ok || !validName(user) {
			return nil, fmt.Errorf("groups: entry %d %.64q: want user=group,group", i+1, line)
		}
		for _, g := range strings.Split(groups, ",") {
			g = strings.TrimSpace(g)
			if g == "" {
				continue
			}
			if !validName(g) {
				return nil, fmt.Errorf("groups: entry %d: group %.64q: want 1 to %d bytes without spaces, ':', ',' or ';'", i+1, g, namespace.MaxAclNameBytes)
			}
			if !slices.Contains(out[user], g) {
				out[user] = append(out[user], g)
			}
		}
		if len(out[user]) > maxGroupsPerUser {
			return nil, fmt.Errorf("groups: user %q is in %d groups, at most %d", user, len(out[user]), maxGroupsPerUser)
		}
		if len(out) > maxGroupUsers {
			return nil, fmt.Errorf("groups: more than %d users", maxGroupUsers)
		}
	}
	return out, nil
}

// LoadGroupsFile reads a groups file (ParseGroups' syntax, a user a line).
func LoadGroupsFile(path string) (map[string][]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(b) > 64<<20 {
		return nil, fmt.Errorf("groups file %s: %d bytes, at most 64 MiB", path, len(b))
	}
	return ParseGroups(string(b))
}

func validName(s string) bool {
	return s != "" && len(s) <= namespace.MaxAclNameBytes && utf8.ValidString(s) &&
		!strings.ContainsFunc(s, func(r rune) bool {
			return unicode.IsControl(r) || unicode.IsSpace(r) || r == ':' || r == ',' || r == ';' || r == '='
		})
}

// requestInfo is what a call says about its request, for bucket policy
// conditions: from a gateway its headers (metaclient.WithRequestInfo),
// from anyone else the connection's own address over TLS.
func requestInfo(ctx context.Context, gateway bool) *namespace.RequestInfo {
	if gateway {
		first := func(k string) string {
			v := metadata.ValueFromIncomingContext(ctx, k)
			if len(v) == 0 || len(v[0]) > metaclient.MaxRequestInfoBytes || !utf8.ValidString(v[0]) {
				return ""
			}
			return v[0]
		}
		if ip := first(metaclient.SourceIPHeader); ip != "" || first(metaclient.SecureTransportHeader) != "" {
			if net.ParseIP(ip) == nil {
				ip = ""
			}
			return &namespace.RequestInfo{SourceIP: ip, SecureTransport: first(metaclient.SecureTransportHeader) == "true",
				UserAgent: first(metaclient.UserAgentHeader), Referer: first(metaclient.RefererHeader)}
		}
	}
	ri := &namespace.RequestInfo{SecureTransport: true}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		if host, _, err := net.SplitHostPort(p.Addr.String()); err == nil {
			ri.SourceIP = host
		}
	}
	return ri
}
