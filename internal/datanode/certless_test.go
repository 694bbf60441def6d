package datanode_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/pki"
)

// TestCertlessCallerNeedsBlockToken: the gRPC port takes TLS connections
// without a client certificate (clients that authenticate to the
// metadata service with a user token), and on them serves only what a
// block token authorizes: a write with the block's token is taken, one
// without is refused, and the RPCs that carry no token (Info,
// ExportContainer) need a certificate.
func TestCertlessCallerNeedsBlockToken(t *testing.T) {
	e := startEnv(t)
	b := e.block()
	tc, err := pki.CAOnlyClientTLS(e.c.CA().CertPEM(), pki.RoleDatanode)
	if err != nil {
		t.Fatal(err)
	}
	var leader string
	for deadline := time.Now().Add(20 * time.Second); leader == "" && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for i := range e.c.Datanodes {
			if dn := e.c.Datanode(i); dn != nil && dn.IsPipelineLeader(b.GetPipelineId()) {
				leader = dn.Addr()
			}
		}
	}
	if leader == "" {
		t.Fatal("no pipeline leader in 20 s")
	}
	cc, err := grpc.NewClient(leader, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	dn := datanodepb.NewDatanodeClient(cc)
	ctx, cancel := context.WithTimeout(testCtx(t), callTimeout)
	defer cancel()

	if _, err := dn.Info(ctx, &datanodepb.InfoRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("Info without a certificate: %v, want Unauthenticated", err)
	}
	st, err := dn.ExportContainer(ctx, &datanodepb.ExportContainerRequest{ContainerId: b.GetId().GetContainerId()})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("ExportContainer without a certificate: %v, want Unauthenticated", err)
	}
	data := []byte("written without a certificate")
	id := &datanodepb.BlockID{ContainerId: b.GetId().GetContainerId(), LocalId: b.GetId().GetLocalId()}
	ci := &datanodepb.ChunkInfo{Offset: 0, Length: uint64(len(data))}
	req := &datanodepb.WriteChunkRequest{PipelineId: b.GetPipelineId(), Block: id, Chunk: ci, Data: data}
	if _, err := dn.WriteChunk(ctx, req); status.Code(err) != codes.PermissionDenied && status.Code(err) != codes.Unauthenticated {
		t.Fatalf("WriteChunk without a token: %v, want refused", err)
	}
	if _, err := dn.WriteChunk(blocktoken.WithToken(ctx, b.GetToken()), req); err != nil {
		t.Fatalf("WriteChunk with the block's token, without a certificate: %v", err)
	}
}
