package meta

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestDiskFullRefusesProposals: below the disk reserve a meta node refuses
// state-changing requests with ResourceExhausted before proposing (Pebble
// never meets ENOSPC) and keeps serving reads; once space returns,
// writes work again.
func TestDiskFullRefusesProposals(t *testing.T) {
	_, ffs, cl := faultNode(t, filepath.Join(t.TempDir(), "1"), 20*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "before"}); err != nil {
		t.Fatal(err)
	}

	ffs.SetCapacity(&vfs.DiskUsage{TotalBytes: 1 << 30, AvailBytes: 1 << 20})
	// The cached free space is read again within a second.
	var refused error
	var name string
	for i := 0; ; i++ {
		name = fmt.Sprintf("during%d", i)
		_, refused = cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: name})
		if status.Code(refused) == codes.ResourceExhausted {
			break
		}
		if refused != nil || i > 200 {
			t.Fatalf("CreateVolume %s on a full disk: %v after %d calls, want ResourceExhausted", name, refused, i+1)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("refused: %v", refused)
	if _, err := cl.Namespace.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "before"}); err != nil {
		t.Fatalf("read on a full disk: %v", err)
	}
	if _, err := cl.Namespace.GetVolume(ctx, &metapb.GetVolumeRequest{Name: name}); status.Code(err) != codes.NotFound {
		t.Fatalf("volume refused on a full disk: GetVolume = %v, want NotFound", err)
	}

	ffs.SetCapacity(nil)
	waitFor(t, 10*time.Second, "writes once space returned", func() bool {
		_, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "after"})
		return err == nil
	})
}

// faultNode starts a single meta node on a FaultFS in dir and a client of
// it (callTimeout per call), both closed at the test's end.
func faultNode(t *testing.T, dir string, callTimeout time.Duration) (*Server, *vfs.FaultFS, *metaclient.Client) {
	t.Helper()
	ffs := vfs.NewFaultFS(vfs.Default)
	s, err := New(Config{NodeID: 1, DataDir: dir, FS: ffs, TLS: nodeCreds(1), Admins: testAdmins, Peers: map[uint64]Peer{1: {}},
		TickInterval: 20 * time.Millisecond, ElectionTicks: 10,
		Namespace: namespace.Config{ServiceInterval: 50 * time.Millisecond}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	cl, err := metaclient.New(metaclient.Config{Addrs: []string{s.GRPCAddr()}, CallTimeout: callTimeout, DialOptions: clientDial()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return s, ffs, cl
}
