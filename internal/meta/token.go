package meta

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/vfs"
)

// The cluster service token guards the RPCs that hand out or change S3
// secrets: without it, anyone who reaches the meta gRPC port could read
// every access key's secret. Datanodes and ordinary clients never call
// these RPCs and need no token; S3 gateways and `basalt admin s3` present
// it as "authorization: Bearer <token>" gRPC metadata (metaclient does
// that when given Config.ServiceToken).
//
// The cluster's token is recorded in the replicated namespace state: the
// first namespace leader records its configured token, or a new random one
// (establishToken), and every node without a configured token adopts it
// and writes it to its data directory (service-token, 0600) for admin
// tools. A node given a token (Config.ServiceToken, or an existing token
// file) serves that one: give every node the same, or none.

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

// loadServiceToken reads the token file; "" if there is none.
func loadServiceToken(fs vfs.FS, path string) (string, error) {
	b, err := vfs.ReadFile(fs, path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("meta: service token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < 16 {
		return "", fmt.Errorf("meta: service token file %s holds %d characters, want at least 16", path, len(tok))
	}
	return tok, nil
}

// writeServiceToken writes tok to path (0600), aside, synced, renamed and
// the directory synced, so a crash leaves the old file or the whole new
// one, and a written token stays written.
func writeServiceToken(fs vfs.FS, path, tok string) error {
	dir := filepath.Dir(path)
	if err := fs.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("meta: service token: %w", err)
	}
	tmp := path + ".tmp"
	f, err := fs.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("meta: service token: %w", err)
	}
	_, err = f.Write([]byte(tok + "\n"))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fs.Rename(tmp, path)
	}
	if err != nil {
		_ = fs.Remove(tmp)
		return fmt.Errorf("meta: service token: %w", err)
	}
	if err := vfs.SyncDir(fs, dir); err != nil {
		return fmt.Errorf("meta: service token: sync %s: %w", dir, err)
	}
	return nil
}

func newServiceToken() (string, error) {
	raw := make([]byte, tokenBytes)
	if _, err := rand.Read(raw); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(raw), nil
}

// establishToken makes every node serve one token. The namespace state
// records the cluster's token (the first SetServiceToken wins): the leader
// proposes one if none is recorded — its configured token, or a new random
// one — and a node without a configured token adopts the recorded one and
// writes it to its token file for admin tools. It returns once the state
// has a token.
func (s *Server) establishToken(ctx context.Context) {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		tok, err := s.nsState.ServiceToken()
		if err == nil && tok != "" {
			if s.token.Load() == nil {
				if err := writeServiceToken(s.cfg.FS, s.cfg.ServiceTokenFile, tok); err != nil {
					s.log.Warn("meta: writing the service token file", "err", err)
				}
				s.token.Store(&tok)
			}
			return
		}
		if s.nsGroup.IsLeader() {
			mine := ""
			if p := s.token.Load(); p != nil {
				mine = *p
			} else if mine, err = newServiceToken(); err != nil {
				s.log.Warn("meta: making a service token", "err", err)
			}
			if mine != "" {
				cmd, _ := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_SetServiceToken{SetServiceToken: &metapb.SetServiceTokenOp{Token: mine}}})
				pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				_, err := (&nsRaft{s}).Propose(pctx, cmd) // halted: refused; ErrHalted: outcome unknown
				cancel()
				if err != nil && ctx.Err() == nil {
					s.log.Debug("meta: proposing the service token", "err", err)
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// currentToken is the token this node checks, "" while it is not known.
func (s *Server) currentToken() string {
	if p := s.token.Load(); p != nil {
		return *p
	}
	return ""
}

// checkServiceToken lets a call to a guarded method through only with the
// service token in its metadata.
func (s *Server) checkServiceToken(ctx context.Context, method string) error {
	if !serviceTokenMethods[method] {
		return nil
	}
	vals := metadata.ValueFromIncomingContext(ctx, metaclient.AuthorizationHeader)
	if len(vals) == 0 {
		where := "the token the meta nodes were given"
		if s.cfg.ServiceTokenFile != "" {
			where = "the meta node's " + s.cfg.ServiceTokenFile
		}
		return status.Errorf(codes.Unauthenticated, "meta node %d: %s requires the cluster service token (gRPC metadata %q: \"Bearer <token>\"); "+
			"give the S3 gateway or admin tool --service-token-file (%s)", s.cfg.NodeID, methodName(method),
			metaclient.AuthorizationHeader, where)
	}
	want := s.currentToken()
	if want == "" {
		st, _ := status.Newf(codes.Unavailable, "meta node %d: %s: the cluster service token is not established yet (no namespace leader has recorded one); retry", s.cfg.NodeID, methodName(method)).
			WithDetails(&errdetails.ErrorInfo{Reason: metapb.ReasonNotApplied, Domain: metapb.ReasonDomain})
		return st.Err()
	}
	tok, ok := strings.CutPrefix(vals[0], "Bearer ")
	if !ok || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(tok)), []byte(want)) != 1 {
		return status.Errorf(codes.PermissionDenied, "meta node %d: %s: the service token does not match this cluster's", s.cfg.NodeID, methodName(method))
	}
	return nil
}

func methodName(method string) string { return method[strings.LastIndexByte(method, '/')+1:] }

// ServiceToken is the cluster service token (for wiring in-process
// gateways and tools).
// It waits (up to 30 s) for a replicated token to be established.
func (s *Server) ServiceToken() string {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if tok := s.currentToken(); tok != "" {
			return tok
		}
	}
	return s.currentToken()
}
