package meta_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/pki/enroll"
)

func waitUntil(t *testing.T, d time.Duration, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDatanodeJoinsWithBootstrapToken: a datanode with nothing but a
// bootstrap token gets its certificate, registers, and serves writes; then
// another datanode's certificate is revoked and this datanode (which
// learned the list) refuses it on its gRPC and stream ports, as meta does.
func TestDatanodeJoinsWithBootstrapToken(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cdir := t.TempDir()
	c, err := cluster.Start(ctx, cluster.Config{Dir: cdir, Datanodes: 3, HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	admin, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, CallTimeout: 20 * time.Second, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	var tok *metapb.CreateBootstrapTokenResponse
	waitUntil(t, 30*time.Second, "a bootstrap token (the CA recorded)", func() bool {
		tok, err = admin.Ca.CreateBootstrapToken(ctx, &metapb.CreateBootstrapTokenRequest{Role: "datanode"})
		return err == nil
	})

	// The new datanode: a token, no certificate files.
	dir := t.TempDir()
	creds, err := enroll.Bootstrap(ctx, []string{c.MetaAddr()}, tok.GetToken(), pki.RoleDatanode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "tls")); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("files appeared")
	}
	dn, err := datanode.New(datanode.Config{DataDir: dir, Location: "/dc1/rack2", TLS: creds, Hostname: "dn-token",
		MetaAddrs: []string{c.MetaAddr()}, ListenAddr: "127.0.0.1:0", RaftAddr: "127.0.0.1:0", StreamAddr: "127.0.0.1:0",
		TickInterval: 50 * time.Millisecond, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	if err := dn.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer dn.Close()
	agent := &enroll.Agent{Creds: creds, Addrs: []string{c.MetaAddr()}, Interval: 100 * time.Millisecond, Logger: log}
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	defer agent.Close()
	actx, acancel := context.WithCancel(ctx)
	defer acancel()
	go agent.Run(actx)

	// Writes reach it: with one of the provisioned datanodes gone, the
	// pipelines SCM makes next include the new one.
	if err := c.StopDatanode(0); err != nil {
		t.Fatal(err)
	}
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 10 * time.Second, WaitAllTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if _, err := cl.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, "vol", "bkt", client.BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("basalt"), 200<<10)
	i := 0
	waitUntil(t, 90*time.Second, "a write stored on the token datanode", func() bool {
		i++
		_, err := cl.PutKey(ctx, "vol", "bkt", fmt.Sprintf("k%d", i), bytes.NewReader(data), client.PutOptions{})
		return err == nil && (dn.ChunksWritten() > 0 || dn.SmallFiles() > 0)
	})
	r, err := cl.GetKey(ctx, "vol", "bkt", fmt.Sprintf("k%d", i))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	r.Close()
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %d bytes, %v", len(got), err)
	}

	// Revoke provisioned datanode 2's certificate.
	victim, err := victimCreds(c, cdir)
	if err != nil {
		t.Fatal(err)
	}
	info := func(cr *pki.Credentials) error {
		cc, err := grpc.NewClient(dn.Addr(), cr.GRPCDialOption(pki.RoleDatanode))
		if err != nil {
			return err
		}
		defer cc.Close()
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err = datanodepb.NewDatanodeClient(cc).Info(cctx, &datanodepb.InfoRequest{})
		return err
	}
	if err := info(victim); err != nil {
		t.Fatalf("before revocation: %v", err)
	}
	// A connection the victim opened before the revocation.
	pre, err := grpc.NewClient(dn.Addr(), victim.GRPCDialOption(pki.RoleDatanode))
	if err != nil {
		t.Fatal(err)
	}
	defer pre.Close()
	if _, err := datanodepb.NewDatanodeClient(pre).Info(ctx, &datanodepb.InfoRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Ca.RevokeCertificate(ctx, &metapb.RevokeCertificateRequest{Serial: pki.SerialString(victim.Leaf().SerialNumber)}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, "the token datanode's gRPC port to refuse the revoked certificate", func() bool {
		err := info(victim)
		return err != nil && status.Code(err) == codes.Unavailable
	})
	if err := info(c.ClientCredentials()); err != nil {
		t.Fatalf("an unrevoked client after the revocation: %v", err)
	}
	// The connection opened before was closed when the datanode learned
	// the revocation (its gRPC server watches connections: auth.go), so
	// a call on it reconnects and is refused at the handshake.
	if _, err := datanodepb.NewDatanodeClient(pre).Info(ctx, &datanodepb.InfoRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call on a connection opened before the revocation: %v, want Unavailable (closed, handshake refused)", err)
	}
	// Its stream port refuses it at the handshake.
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", dn.StreamAddr(), victim.ClientTLS(pki.RoleDatanode))
	if err == nil {
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			err = nil // the server took the handshake and waited for a header
		}
	}
	if err == nil {
		t.Fatal("the stream port accepted a revoked certificate")
	}
	// And so does meta.
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, CallTimeout: 5 * time.Second, MaxAttempts: 1,
		DialOptions: []grpc.DialOption{victim.GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	if _, err := mc.Scm.GetSafeMode(ctx, &metapb.GetSafeModeRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("meta with a revoked certificate: %v", err)
	}
}

// victimCreds are provisioned datanode 2's credentials (its TLS directory).
func victimCreds(c *cluster.Cluster, dir string) (*pki.Credentials, error) {
	uuid, err := datanode.StoredUUID(filepath.Join(dir, "dn2"))
	if err != nil || uuid == "" {
		return nil, fmt.Errorf("datanode 2's UUID: %q %v", uuid, err)
	}
	return c.Credentials(pki.Identity{Role: pki.RoleDatanode, ID: uuid})
}
