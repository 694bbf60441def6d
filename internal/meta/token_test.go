package meta

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/vfs"
)

// The S3 secret RPCs answer only callers that present the service token;
// everything else works without it.
func TestServiceToken(t *testing.T) {
	c := newCluster(t, 1, scm.Config{})
	s := c.servers[1]
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// The token was made on first start, recorded in the replicated state
	// and written to the data directory, 0600.
	served := s.ServiceToken()
	path := filepath.Join(c.dir, "1", ServiceTokenFile)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("token file mode %v, want 0600", fi.Mode().Perm())
	}
	b, _ := os.ReadFile(path)
	tok := strings.TrimSpace(string(b))
	if tok != served || len(tok) < 40 {
		t.Fatalf("token file holds %q, server uses %q", tok, served)
	}
	if rec, err := s.nsState.ServiceToken(); err != nil || rec != tok {
		t.Fatalf("replicated token %q (%v), want %q", rec, err, tok)
	}

	dial := func(token string) *metaclient.Client {
		mc, err := metaclient.New(metaclient.Config{Addrs: c.addrs(), ServiceToken: token, DialOptions: clientDial()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { mc.Close() })
		return mc
	}
	none, wrong, right := dial(""), dial("not-the-token-not-the-token"), dial(tok)
	waitFor(t, 10*time.Second, "namespace leader", func() bool {
		_, err := none.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol1"})
		return err == nil
	})

	calls := map[string]func(*metaclient.Client) error{
		"CreateS3Secret": func(mc *metaclient.Client) error {
			_, err := mc.Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "AKIDTOKEN"})
			return err
		},
		"GetS3Secret": func(mc *metaclient.Client) error {
			_, err := mc.Namespace.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: "AKIDTOKEN"})
			return err
		},
		"DeleteS3Secret": func(mc *metaclient.Client) error {
			_, err := mc.Namespace.DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: "AKIDTOKEN"})
			return err
		},
	}
	for _, name := range []string{"CreateS3Secret", "GetS3Secret", "DeleteS3Secret"} {
		call := calls[name]
		err := call(none)
		if status.Code(err) != codes.Unauthenticated || !strings.Contains(status.Convert(err).Message(), "service token") {
			t.Fatalf("%s without a token: %v, want Unauthenticated naming the service token", name, err)
		}
		err = call(wrong)
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "does not match") {
			t.Fatalf("%s with a wrong token: %v, want PermissionDenied", name, err)
		}
		if err := call(right); err != nil {
			t.Fatalf("%s with the token: %v", name, err)
		}
	}
	// Nothing was created or deleted by the refused calls: the key the
	// token's create made is gone only after the token's delete.
	if _, err := right.Namespace.GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: "AKIDTOKEN"}); status.Code(err) != codes.NotFound {
		t.Fatalf("get after delete: %v", err)
	}
	// Ordinary calls need no token.
	if _, err := none.Namespace.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "vol1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := none.Scm.GetSafeMode(ctx, &metapb.GetSafeModeRequest{}); err != nil {
		t.Fatal(err)
	}

	// A restart keeps the token.
	s.Close()
	s2 := c.newServer(1)
	defer s2.Close()
	if s2.ServiceToken() != tok {
		t.Fatalf("token after restart %q, want %q", s2.ServiceToken(), tok)
	}
}

func TestLoadServiceTokenRejectsShortFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tok")
	os.WriteFile(path, []byte("short\n"), 0o600)
	if _, err := loadServiceToken(vfs.Default, path); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("short token file: %v", err)
	}
}

// TestServiceTokenReplicated: the nodes of a 3-node service given no token
// all serve the one the first leader recorded, and each writes it to its
// data directory.
func TestServiceTokenReplicated(t *testing.T) {
	c := newCluster(t, 3, scm.Config{})
	var first string
	for id, s := range c.servers {
		tok := s.ServiceToken()
		if tok == "" {
			t.Fatalf("node %d has no service token", id)
		}
		if first == "" {
			first = tok
		} else if tok != first {
			t.Fatalf("node %d serves token %q, another %q", id, tok, first)
		}
		b, err := os.ReadFile(filepath.Join(c.dir, fmt.Sprint(id), ServiceTokenFile))
		if err != nil || strings.TrimSpace(string(b)) != first {
			t.Fatalf("node %d token file: %q, %v", id, b, err)
		}
	}
	// Any node accepts it (a follower answers or forwards; it never
	// refuses the cluster's token).
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	mc, err := metaclient.New(metaclient.Config{Addrs: c.addrs(), ServiceToken: first, DialOptions: clientDial()})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	if _, err := mc.Namespace.CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "AKIDREPL", Owner: "t"}); err != nil {
		t.Fatal(err)
	}
}

// crashFS is Pebble's crashable MemFS as a vfs.FS (OpenFile: create or
// open for writing through Create/OpenReadWrite, enough for small files).
type crashFS struct{ *pvfs.MemFS }

func (fs crashFS) OpenFile(name string, flag int, perm os.FileMode) (vfs.File, error) {
	if flag&os.O_CREATE == 0 || flag&os.O_TRUNC == 0 {
		return nil, &os.PathError{Op: "open", Path: name, Err: unix.ENOTSUP}
	}
	f, err := fs.Create(name, vfs.WriteCategory)
	if err != nil {
		return nil, err
	}
	return memFile{f}, nil
}

type memFile struct{ pvfs.File }

func (memFile) Truncate(int64) error { return unix.ENOTSUP }

// A token written to the data directory is there after a crash right
// after the write returns (file synced, then its directory).
func TestServiceTokenFileSurvivesCrash(t *testing.T) {
	mem := crashFS{pvfs.NewCrashableMem()}
	if err := mem.MkdirAll("/data", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := vfs.SyncDir(mem, "/"); err != nil {
		t.Fatal(err)
	}
	const tok = "0123456789abcdef0123456789abcdef"
	path := "/data/" + ServiceTokenFile
	if err := writeServiceToken(mem, path, tok); err != nil {
		t.Fatal(err)
	}
	crashed := crashFS{mem.CrashClone(pvfs.CrashCloneCfg{})}
	got, err := loadServiceToken(crashed, path)
	if err != nil || got != tok {
		t.Fatalf("token after crash %q, %v; want %q", got, err, tok)
	}
}
