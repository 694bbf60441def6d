package datanode_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/pki"
)

// TestRevokedCallerGRPCConnClosed: a caller's open gRPC connection to a
// datanode is closed once its certificate is revoked there (the gRPC
// server's credentials Watch each connection), not only refused call by
// call.
func TestRevokedCallerGRPCConnClosed(t *testing.T) {
	creds := map[int]*pki.Credentials{}
	e := startEnvWith(t, func(cfg *cluster.Config) {
		if b, err := strconv.Atoi(os.Getenv("BASALT_TEST_PORT_BASE")); err == nil && b > 0 {
			cfg.BasePort = b + 500
		}
		cfg.DatanodeConfig = func(i int, dc *datanode.Config) { creds[i] = dc.TLS }
	})
	dn := e.c.Datanode(0)
	client := e.c.ClientCredentials()
	cc, err := grpc.NewClient(dn.Addr(), client.GRPCDialOption(pki.RoleDatanode))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(testCtx(t), callTimeout)
	defer cancel()
	if _, err := datanodepb.NewDatanodeClient(cc).Info(ctx, &datanodepb.InfoRequest{}); err != nil {
		t.Fatalf("Info with the client's certificate: %v", err)
	}
	ident := client.Identity.String()
	if n := creds[0].WatchedOf(ident); n < 1 {
		t.Fatalf("datanode 1 watches %d connection(s) of %s, want the gRPC one", n, ident)
	}
	creds[0].SetRevoked([]string{pki.SerialString(client.Leaf().SerialNumber)})
	deadline := time.Now().Add(5 * time.Second)
	for cc.GetState() == connectivity.Ready || creds[0].WatchedOf(ident) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the revocation: connection %v, %d watched", cc.GetState(), creds[0].WatchedOf(ident))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
