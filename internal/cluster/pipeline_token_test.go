package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
)

// pipelineOf is a pipeline as its members see it.
type pipelineOf struct {
	id      uint64
	leader  uint64
	members []uint64
}

// pipelinesWithLeaders lists the pipelines the datanodes are in whose
// leader is known.
func pipelinesWithLeaders(c *cluster.Cluster, n int) map[uint64]pipelineOf {
	out := map[uint64]pipelineOf{}
	for i := range n {
		d := c.Datanode(i)
		if d == nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		cc, err := grpc.NewClient(d.Addr(), c.DatanodeDialOption())
		if err != nil {
			cancel()
			continue
		}
		r, err := datanodepb.NewDatanodeClient(cc).Info(ctx, &datanodepb.InfoRequest{})
		cc.Close()
		cancel()
		if err != nil {
			continue
		}
		for _, p := range r.GetPipelines() {
			if p.GetLeader() != 0 && len(p.GetMembers()) == 3 {
				out[p.GetId()] = pipelineOf{id: p.GetId(), leader: p.GetLeader(), members: slices.Sorted(slices.Values(p.GetMembers()))}
			}
		}
	}
	return out
}

// TestWriteThroughAnotherPipelineRefused: a client with a valid write
// token for container c of pipeline P1 = {A,B,C} sends its writes through
// another pipeline P2 = {A,D,E} (through P2's leader, whichever it is):
// WriteChunk, PutBlock, PutSmallFile and the V2 stream header are all
// refused, c's blocks keep their BCSIDs on A, B and C, and no copy of c
// appears on D or E. Before write tokens named the pipeline, P2's log
// took them: on A, c's block got P2's (higher) index as BCSID, and D and
// E created c (stray copies), so that SCM later saw B and C as lagging.
func TestWriteThroughAnotherPipelineRefused(t *testing.T) {
	const n = 5
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: t.TempDir(), Datanodes: n, PipelineLimit: 2,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 16 << 20, ContainerSize: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rawDial = c.DatanodeDialOption()
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	dnByID := func(id uint64) *datanode.Datanode {
		for i := range n {
			if d := c.Datanode(i); d != nil && d.ID() == id {
				return d
			}
		}
		t.Fatalf("no datanode %d", id)
		return nil
	}

	// Any two pipelines of 3 among 5 datanodes share one: wait for two.
	var pipes map[uint64]pipelineOf
	deadline := time.Now().Add(90 * time.Second)
	for pipes = pipelinesWithLeaders(c, n); len(pipes) < 2; pipes = pipelinesWithLeaders(c, n) {
		if time.Now().After(deadline) {
			t.Fatalf("pipelines with leaders after 90s: %v, want 2", pipes)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// A block of P1 with the namespace's write token, written through P1.
	open, err := mc.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k", ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	l := open.GetBlocks()[0]
	claims, err := blocktoken.Decode(l.GetToken())
	if err != nil {
		t.Fatal(err)
	}
	p1, ok := pipes[l.GetPipelineId()]
	// SCM may have made a third pipeline ready since pipes was taken and
	// placed the block there: take the pipelines again until it shows.
	for !ok && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		pipes = pipelinesWithLeaders(c, n)
		p1, ok = pipes[l.GetPipelineId()]
	}
	if claims.Pipeline != l.GetPipelineId() || !ok {
		t.Fatalf("write token names pipeline %d, block is in pipeline %d (pipelines with leaders %v)", claims.Pipeline, l.GetPipelineId(), pipes)
	}
	cid, lid := l.GetId().GetContainerId(), l.GetId().GetLocalId()
	tctx := blocktoken.WithToken(ctx, l.GetToken())
	data := randData(11, 8192)
	if _, err := rawDN(t, dnByID(p1.leader).Addr()).PutSmallFile(tctx, smallReq(p1.id, cid, lid, data)); err != nil {
		t.Fatalf("write through the block's own pipeline %d: %v", p1.id, err)
	}
	bcsid := map[uint64]uint64{}
	for _, m := range p1.members {
		bd, err := dnByID(m).Store().GetBlock(storage.ContainerID(cid), storage.LocalID(lid))
		if err != nil {
			t.Fatalf("datanode %d of pipeline %d: block %d/%d: %v", m, p1.id, cid, lid, err)
		}
		bcsid[m] = bd.BCSID
	}

	// P2: another pipeline sharing a datanode with P1; preferably one led
	// by a shared datanode (then the leader holds c for P1, below).
	var p2 pipelineOf
	for _, p := range pipes {
		if p.id != p1.id && slices.ContainsFunc(p.members, func(m uint64) bool { return slices.Contains(p1.members, m) }) &&
			(p2.id == 0 || slices.Contains(p1.members, p.leader)) {
			p2 = p
		}
	}
	if p2.id == 0 {
		t.Fatalf("no pipeline shares a datanode with %v: %v", p1, pipes)
	}
	var others []uint64 // D, E: in P2, not in P1
	for _, m := range p2.members {
		if !slices.Contains(p1.members, m) {
			others = append(others, m)
		}
	}
	t.Logf("P1 %d %v (leader %d), P2 %d %v (leader %d), container %d", p1.id, p1.members, p1.leader, p2.id, p2.members, p2.leader, cid)

	// The P1 token through P2, to whichever member leads P2 now (leaders
	// may move: every member is asked, each must refuse, none may
	// redirect it into the log).
	refused := func(what string, err error) {
		t.Helper()
		st, _ := status.FromError(err)
		if st.Code() != codes.PermissionDenied && st.Code() != codes.FailedPrecondition && st.Code() != codes.Unavailable {
			t.Fatalf("%s: %v, want PERMISSION_DENIED or FAILED_PRECONDITION", what, err)
		}
		if st.Code() == codes.Unavailable && !strings.Contains(st.Message(), "leader") {
			t.Fatalf("%s: %v", what, err)
		}
	}
	sawLeader := false
	wc := &datanodepb.WriteChunkRequest{PipelineId: p2.id, Block: &datanodepb.BlockID{ContainerId: cid, LocalId: lid},
		Chunk: smallReq(p2.id, cid, lid, data).GetBlock().GetChunks()[0], Data: data}
	for _, m := range p2.members {
		d := dnByID(m)
		dn := rawDN(t, d.Addr())
		isLeader := d.IsPipelineLeader(p2.id)
		_, err := dn.WriteChunk(tctx, wc)
		refused(fmt.Sprintf("WriteChunk via datanode %d", m), err)
		_, err = dn.PutBlock(tctx, &datanodepb.PutBlockRequest{PipelineId: p2.id, WaitAll: true, WaitTimeoutMs: 5000, Block: smallReq(p2.id, cid, lid, data).GetBlock()})
		refused(fmt.Sprintf("PutBlock via datanode %d", m), err)
		_, err = dn.PutSmallFile(tctx, smallReq(p2.id, cid, lid, data))
		refused(fmt.Sprintf("PutSmallFile via datanode %d", m), err)
		if isLeader && d.IsPipelineLeader(p2.id) {
			sawLeader = true
			denied(t, fmt.Sprintf("PutBlock via P2's leader %d", m), err, datanodepb.Error_TOKEN_INVALID)
			if st, _ := status.FromError(err); !strings.Contains(st.Message(), fmt.Sprintf("through pipeline %d only", p1.id)) {
				t.Fatalf("refusal does not name the pipeline: %v", err)
			}
		}
	}
	if !sawLeader {
		t.Log("P2's leader moved during the calls; each member refused anyway")
	}
	// The V2 stream header, to each member of P2 as the first hop.
	for _, m := range p2.members {
		d := dnByID(m)
		route := []stream.Target{{ID: m, Addr: d.StreamAddr()}}
		var se *stream.Error
		_, err := stream.Dial(ctx, route, p2.id, stream.BlockID{Container: cid, Local: lid}, stream.Options{Token: l.GetToken(), TLS: c.ClientCredentials().ClientTLS(pki.RoleDatanode)})
		if !errors.As(err, &se) || se.Code != stream.CodePermissionDenied {
			t.Fatalf("stream header via datanode %d of pipeline %d: %v, want permission denied", m, p2.id, err)
		}
	}

	// A token that did name P2 (SCM never issues one for a container of
	// P1; minted here with the cluster's keys) is still refused by a
	// datanode that holds c for P1, when it leads P2: the container is
	// P1's there. (Sent only to the members P2 shares with P1: D or E,
	// which do not hold c, would take it; the token binding is what
	// stops that.)
	keys := dnByID(p1.members[0]).TokenKeys()
	minted, err := keys.Issue(time.Now(), blocktoken.Claims{Block: claims.Block, Modes: blocktoken.Read | blocktoken.Write,
		ExpiryUnixMs: time.Now().Add(time.Hour).UnixMilli(), Pipeline: p2.id})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range p2.members {
		if !slices.Contains(p1.members, m) {
			continue
		}
		d := dnByID(m)
		isLeader := d.IsPipelineLeader(p2.id)
		_, err := rawDN(t, d.Addr()).PutBlock(blocktoken.WithToken(ctx, minted), &datanodepb.PutBlockRequest{PipelineId: p2.id, Block: smallReq(p2.id, cid, lid, data).GetBlock()})
		switch st, _ := status.FromError(err); {
		case st.Code() == codes.FailedPrecondition && strings.Contains(st.Message(), fmt.Sprintf("belongs to pipeline %d", p1.id)):
			t.Logf("P2-naming token via datanode %d (P2 leader %v): refused: %s", m, isLeader, st.Message())
		case st.Code() == codes.Unavailable && !isLeader:
			t.Logf("P2-naming token via datanode %d: not P2's leader", m)
		default:
			t.Fatalf("PutBlock of P1's container with a P2-naming token via datanode %d (P2 leader %v): %v", m, isLeader, err)
		}
	}

	// Nothing moved: give any entry that got into P2's log time to apply,
	// then look.
	time.Sleep(time.Second)
	for _, m := range others {
		if _, err := dnByID(m).Store().Container(storage.ContainerID(cid)); !errors.Is(err, storage.ErrContainerNotFound) {
			t.Fatalf("datanode %d (pipeline %d only) has container %d of pipeline %d: %v", m, p2.id, cid, p1.id, err)
		}
	}
	for _, m := range p1.members {
		bd, err := dnByID(m).Store().GetBlock(storage.ContainerID(cid), storage.LocalID(lid))
		if err != nil || bd.BCSID != bcsid[m] {
			t.Fatalf("datanode %d: block %d/%d BCSID %d (%v), was %d", m, cid, lid, bd.BCSID, err, bcsid[m])
		}
		if rep, err := dnByID(m).Store().Container(storage.ContainerID(cid)); err != nil || rep.State != storage.StateOpen {
			t.Fatalf("datanode %d: container %d %+v %v, want OPEN", m, cid, rep, err)
		}
	}
}
