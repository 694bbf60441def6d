package cluster

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/stream"
)

// The attacks of issue 13 on the internal ports of a real cluster, each
// from a process on the same network: without a certificate, with one from
// another CA, and with a valid certificate of the wrong role or identity.

func issue(t *testing.T, ca *pki.CA, role pki.Role, id string) *pki.Credentials {
	t.Helper()
	c, err := ca.Issue(pki.Identity{Role: role, ID: id}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// badDials are the ways in that must all fail: plaintext, a certificate
// from another CA, and TLS without a client certificate.
func badDials(t *testing.T, c *Cluster) map[string]grpc.DialOption {
	other, err := pki.NewCA("attacker CA")
	if err != nil {
		t.Fatal(err)
	}
	noCert := c.ClientCredentials().ClientTLS()
	noCert.GetClientCertificate = nil // ClientTLS reads the current certificate at each handshake
	return map[string]grpc.DialOption{
		"plaintext":             grpc.WithTransportCredentials(insecure.NewCredentials()),
		"wrong CA":              issue(t, other, pki.RoleClient, "cli").GRPCDialOption(),
		"no client certificate": grpc.WithTransportCredentials(credentials.NewTLS(noCert)),
	}
}

func metaAs(t *testing.T, c *Cluster, opt grpc.DialOption) *metaclient.Client {
	t.Helper()
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, CallTimeout: 3 * time.Second, DialOptions: []grpc.DialOption{opt}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mc.Close() })
	return mc
}

func TestInternalPortsRequireCertificates(t *testing.T) {
	c := startCluster(t, 3)
	ctx := context.Background()
	dn := c.Datanode(0)
	for name, opt := range badDials(t, c) {
		t.Run("meta gRPC "+name, func(t *testing.T) {
			mc := metaAs(t, c, opt)
			if _, err := mc.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "stolen"}); err == nil {
				t.Fatal("volume created")
			}
			if _, err := mc.Scm.DeleteBlocks(ctx, &metapb.DeleteBlocksRequest{}); err == nil {
				t.Fatal("DeleteBlocks accepted")
			}
		})
		t.Run("datanode gRPC "+name, func(t *testing.T) {
			cc, err := grpc.NewClient(dn.Addr(), opt)
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			if _, err := datanodepb.NewDatanodeClient(cc).Info(cctx, &datanodepb.InfoRequest{}); err == nil {
				t.Fatal("datanode answered")
			}
		})
	}
	// The raft ports of the meta node and a datanode: a forged heartbeat
	// in plaintext (what crashed a node on the old code) is not even read.
	for _, addr := range []string{c.Meta.RaftAddr(), dn.RaftAddr()} {
		raw, err := net.DialTimeout("tcp", addr, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		raw.SetDeadline(time.Now().Add(10 * time.Second))
		hello := append([]byte("BSLT\x01"), binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, 99), 1)...)
		raw.Write(hello)
		if _, err := io.ReadAll(raw); err != nil && !errors.Is(err, io.EOF) {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("raft port %s kept a plaintext connection open", addr)
			}
		}
		raw.Close()
	}
	// The stream port.
	for name, cfg := range map[string]*tls.Config{"plaintext": nil, "wrong CA": func() *tls.Config {
		other, _ := pki.NewCA("x")
		return issue(t, other, pki.RoleClient, "x").ClientTLS()
	}()} {
		_, err := stream.Dial(ctx, []stream.Target{{ID: dn.ID(), Addr: dn.StreamAddr()}}, 1, stream.BlockID{Container: 1, Local: 1}, stream.Options{TLS: cfg, Timeout: 3 * time.Second})
		if err == nil {
			t.Fatalf("stream port accepted a %s stream", name)
		}
	}
	if err := c.WaitWritable(ctx); err != nil {
		t.Fatalf("cluster after the attacks: %v", err)
	}
}

// TestForgedNodeIdentityRefused: a valid certificate does not let its
// holder act as another node, or beyond its role.
func TestForgedNodeIdentityRefused(t *testing.T) {
	c := startCluster(t, 3)
	ctx := context.Background()
	mine := metaAs(t, c, c.MetaDialOption())
	dns, err := mine.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	victim := dns.Datanodes[0].GetDetails()
	forged := &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{Id: victim.GetId(), Uuid: victim.GetUuid(),
		DataAddr: "127.0.0.1:1", RaftAddr: "127.0.0.1:2", StreamAddr: "127.0.0.1:3", Location: victim.GetLocation()}}
	evilDN := metaAs(t, c, issue(t, c.CA(), pki.RoleDatanode, "evil").GRPCDialOption(pki.RoleMeta))
	client := mine
	for name, mc := range map[string]*metaclient.Client{"client": client, "another datanode": evilDN} {
		if _, err := mc.Scm.RegisterDatanode(ctx, forged); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("RegisterDatanode with datanode %d's UUID by a %s certificate: %v, want PermissionDenied", victim.GetId(), name, err)
		}
		if _, err := mc.Scm.Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: victim.GetId()}); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("heartbeat of datanode %d by a %s certificate: %v, want PermissionDenied", victim.GetId(), name, err)
		}
		if _, err := mc.Scm.DeleteBlocks(ctx, &metapb.DeleteBlocksRequest{}); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("DeleteBlocks by a %s certificate: %v, want PermissionDenied", name, err)
		}
	}
	if _, err := evilDN.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "dnvol"}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("namespace call by a datanode certificate: %v, want PermissionDenied", err)
	}
	after, err := mine.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range after.Datanodes {
		if d.GetDetails().GetId() == victim.GetId() && d.GetDetails().GetDataAddr() != victim.GetDataAddr() {
			t.Fatalf("datanode %d's address changed to %s", victim.GetId(), d.GetDetails().GetDataAddr())
		}
	}
	// Clients and meta nodes cannot pull a whole container out of a
	// datanode (replication is between datanodes).
	cc, err := grpc.NewClient(c.Datanode(0).Addr(), c.DatanodeDialOption())
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	st, err := datanodepb.NewDatanodeClient(cc).ExportContainer(ctx, &datanodepb.ExportContainerRequest{ContainerId: 1})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("ExportContainer by a client: %v, want PermissionDenied", err)
	}
}

// TestStreamRouteOnlyToRegisteredDatanodes: a stream header naming an
// address SCM did not register for that datanode is refused; the datanode
// never connects there.
func TestStreamRouteOnlyToRegisteredDatanodes(t *testing.T) {
	c := startCluster(t, 3)
	evil, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer evil.Close()
	var dialed atomic.Int64
	go func() {
		for {
			cn, err := evil.Accept()
			if err != nil {
				return
			}
			dialed.Add(1)
			cn.Close()
		}
	}()
	// A pipeline of the cluster, so the route passes the membership check
	// and only the address is wrong.
	mc := metaAs(t, c, c.MetaDialOption())
	pl, err := mc.Scm.ListPipelines(context.Background(), &metapb.ListPipelinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var p *metapb.Pipeline
	for _, x := range pl.Pipelines {
		if len(x.Datanodes) == 3 && x.State == metapb.PipelineState_PIPELINE_OPEN {
			p = x
		}
	}
	if p == nil {
		t.Fatal("no open pipeline of 3")
	}
	var first *stream.Target
	for i := range 3 {
		if dn := c.Datanode(i); dn.ID() == p.Datanodes[0] {
			first = &stream.Target{ID: dn.ID(), Addr: dn.StreamAddr()}
		}
	}
	route := []stream.Target{*first, {ID: p.Datanodes[1], Addr: evil.Addr().String()}}
	_, err = stream.Dial(context.Background(), route, p.Id, stream.BlockID{Container: 1, Local: 77},
		stream.Options{TLS: c.ClientCredentials().ClientTLS(pki.RoleDatanode), Timeout: 5 * time.Second})
	var se *stream.Error
	if !errors.As(err, &se) || se.Code != stream.CodeBadHeader {
		t.Fatalf("route through an unregistered address: %v, want a bad-header refusal", err)
	}
	if n := dialed.Load(); n != 0 {
		t.Fatalf("a datanode connected to the attacker's address %d times", n)
	}
}
