package meta

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The cluster service token guards the RPCs that hand out or change S3
// secrets: without it, anyone who reaches the meta gRPC port could read
// every access key's secret. Datanodes and ordinary clients never call
// these RPCs and need no token; S3 gateways and `basalt admin s3` present
// it as "authorization: Bearer <token>" gRPC metadata (metaclient does
// that when given Config.ServiceToken).
//
// The token is a file in the meta node's data directory, made on first
// start (0600). Every node of a multi-node service must hold the same
// token: make it on one node and copy the file (or pass
// Config.ServiceToken / --service-token-file) to the others.

// ServiceTokenFile is the token's file name in Config.DataDir.
const ServiceTokenFile = "service-token"

// tokenBytes is the token's entropy (base64url: 43 characters).
const tokenBytes = 32

// serviceTokenMethods are the RPCs that require the token.
var serviceTokenMethods = map[string]bool{
	metapb.Namespace_GetS3Secret_FullMethodName:    true,
	metapb.Namespace_CreateS3Secret_FullMethodName: true,
	metapb.Namespace_DeleteS3Secret_FullMethodName: true,
}

// loadServiceToken reads the token file, creating it with a new random
// token if it does not exist.
func loadServiceToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		tok := strings.TrimSpace(string(b))
		if len(tok) < 16 {
			return "", fmt.Errorf("meta: service token file %s holds %d characters, want at least 16", path, len(tok))
		}
		return tok, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("meta: service token: %w", err)
	}
	raw := make([]byte, tokenBytes)
	if _, err := rand.Read(raw); err != nil {
		return "", err
	}
	tok := base64.RawURLEncoding.EncodeToString(raw)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", fmt.Errorf("meta: service token: %w", err)
	}
	// Written aside and renamed, so a crash never leaves a partial token.
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return "", fmt.Errorf("meta: service token: %w", err)
	}
	_, err = f.WriteString(tok + "\n")
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("meta: service token: %w", err)
	}
	return tok, nil
}

// checkServiceToken lets a call to a guarded method through only with the
// service token in its metadata.
func (s *Server) checkServiceToken(ctx context.Context, method string) error {
	if !serviceTokenMethods[method] {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get(metaclient.AuthorizationHeader)
	if len(vals) == 0 {
		where := "the token the meta nodes were given"
		if s.cfg.ServiceTokenFile != "" {
			where = "the meta node's " + s.cfg.ServiceTokenFile
		}
		return status.Errorf(codes.Unauthenticated, "meta node %d: %s requires the cluster service token (gRPC metadata %q: \"Bearer <token>\"); "+
			"give the S3 gateway or admin tool --service-token-file (%s)", s.cfg.NodeID, methodName(method),
			metaclient.AuthorizationHeader, where)
	}
	tok, ok := strings.CutPrefix(vals[0], "Bearer ")
	if !ok || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(tok)), []byte(s.token)) != 1 {
		return status.Errorf(codes.PermissionDenied, "meta node %d: %s: the service token does not match this cluster's", s.cfg.NodeID, methodName(method))
	}
	return nil
}

func methodName(method string) string { return method[strings.LastIndexByte(method, '/')+1:] }

// ServiceToken is the cluster service token (for wiring in-process
// gateways and tools).
func (s *Server) ServiceToken() string { return s.token }
