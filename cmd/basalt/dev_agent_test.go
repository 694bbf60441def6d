package main

import (
	"context"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// TestDevDatanodesRunCertAgents: basalt dev's in-process datanodes run
// the certificate agent as `basalt datanode` does, so they learn a
// revocation made through the metadata service (and would renew their
// certificates). Fails on the old code: dev started no agent, its
// datanodes never polled the revocations.
func TestDevDatanodesRunCertAgents(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	agents := &devCertAgents{}
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: 1, TickInterval: 50 * time.Millisecond,
		HeartbeatInterval: 200 * time.Millisecond, DatanodeConfig: agents.hook})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	defer agents.start(c.MetaAddr(), cluster.TLSDir(dir), slog.New(slog.DiscardHandler))()
	if len(agents.creds) != 1 {
		t.Fatalf("%d datanode credentials noted, want 1", len(agents.creds))
	}
	victim, err := c.Credentials(pki.Identity{Role: pki.RoleClient, ID: "victim"})
	if err != nil {
		t.Fatal(err)
	}
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, CallTimeout: 20 * time.Second,
		DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	if _, err := mc.Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: pki.SerialString(victim.Leaf().SerialNumber)}); err != nil {
		t.Fatal(err)
	}
	dn := agents.creds[0]
	deadline := time.Now().Add(30 * time.Second)
	for !dn.IsRevoked(victim.Leaf()) {
		if time.Now().After(deadline) {
			t.Fatal("the dev datanode did not learn the revocation in 30 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := pki.Load(filepath.Join(cluster.TLSDir(dir), "datanode-"+dn.Identity.ID)); err != nil {
		t.Fatalf("the agent's save directory is not the datanode's TLS directory: %v", err)
	}
}
