package meta

import (
	"context"
	"testing"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// A whole meta node runs on one file system (Config.FS): after a crash
// that keeps only what was synced, everything it acknowledged is there.
func TestNodeCrashKeepsAcknowledged(t *testing.T) {
	mem := crashFS{pvfs.NewCrashableMem()}
	start := func(fs crashFS) *Server {
		t.Helper()
		s, err := New(Config{
			NodeID: 1, DataDir: "/data/meta", FS: fs, TLS: nodeCreds(1), Admins: testAdmins,
			TickInterval: 20 * time.Millisecond, ElectionTicks: 10,
			SCM:       scm.Config{LoopInterval: 20 * time.Millisecond},
			Namespace: namespace.Config{ServiceInterval: 50 * time.Millisecond},
			Logger:    quiet,
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "leader", func() bool { return s.nsGroup.IsLeader() && s.ServiceToken() != "" })
		return s
	}
	client := func(s *Server) *metaclient.Client {
		cl, err := metaclient.New(metaclient.Config{Addrs: []string{s.GRPCAddr()}, CallTimeout: 10 * time.Second, DialOptions: clientDial()})
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	ctx := context.Background()
	s := start(mem)
	cl := client(s)
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bkt1"}); err != nil {
		t.Fatal(err)
	}
	tok := s.ServiceToken()
	crashed := crashFS{mem.CrashClone(pvfs.CrashCloneCfg{})}
	cl.Close()
	s.Close()

	s = start(crashed)
	defer s.Close()
	cl = client(s)
	defer cl.Close()
	if _, err := cl.Namespace.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol1", Name: "bkt1"}); err != nil {
		t.Fatalf("acknowledged bucket after a crash: %v", err)
	}
	if got := s.ServiceToken(); got != tok {
		t.Fatalf("service token after a crash %q, want %q", got, tok)
	}
}
