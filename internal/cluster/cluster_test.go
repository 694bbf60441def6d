package cluster

import (
	"bytes"
	"context"
	"io"
	"math/rand"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

func startCluster(t *testing.T, n int) *Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := Start(ctx, Config{Dir: t.TempDir(), Datanodes: n, HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 16 << 20, ContainerSize: 256 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	dnDial = c.DatanodeDialOption()
	return c
}

// dnDial authenticates dnClient to the datanodes of the cluster the test
// started last (tests here do not run in parallel).
var dnDial grpc.DialOption

func dnClient(t *testing.T, addr string) datanodepb.DatanodeClient {
	cc, err := grpc.NewClient(addr, dnDial,
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return datanodepb.NewDatanodeClient(cc)
}

// TestRawV1WriteAndRead drives the datanode protocol by hand: one block of
// three chunks through the pipeline leader, PutBlock waiting for all
// replicas, CommitKey, then reads from every replica.
func TestRawV1WriteAndRead(t *testing.T) {
	c := startCluster(t, 3)
	ctx := context.Background()
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	if _, err := mc.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := mc.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	ok, err := mc.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k", ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	blk := ok.GetBlocks()[0]
	wctx := blocktoken.WithToken(ctx, blk.GetToken()) // write token from OpenKey
	data := make([]byte, 10<<20+123)
	rand.New(rand.NewSource(1)).Read(data)
	bid := &datanodepb.BlockID{ContainerId: blk.GetId().GetContainerId(), LocalId: blk.GetId().GetLocalId()}

	// Find the leader by asking any member: NOT_LEADER says where to go.
	addr := blk.GetDatanodes()[0].GetDataAddr()
	var bd datanodepb.BlockData
	bd.Id = bid
	const chunk = 4 << 20
	for off := 0; off < len(data); off += chunk {
		end := min(off+chunk, len(data))
		sum := storage.DefaultChecksum.Compute(data[off:end])
		ci := &datanodepb.ChunkInfo{Offset: uint64(off), Length: uint64(end - off), Checksum: &datanodepb.ChecksumData{
			Type: datanodepb.ChecksumType(sum.Type), BytesPerChecksum: sum.BytesPerChecksum, Sums: sum.Sums}}
		for attempt := 0; ; attempt++ {
			_, err := dnClient(t, addr).WriteChunk(wctx, &datanodepb.WriteChunkRequest{PipelineId: blk.GetPipelineId(), Block: bid, Chunk: ci, Data: data[off:end]})
			if err == nil {
				break
			}
			if attempt > 200 {
				t.Fatalf("WriteChunk at %d: %v", off, err)
			}
			if leader := leaderHint(err); leader != "" {
				addr = leader
				continue
			}
			// No leader yet (the pipeline is electing): try the next member.
			time.Sleep(25 * time.Millisecond)
			addr = blk.GetDatanodes()[attempt%len(blk.GetDatanodes())].GetDataAddr()
		}
		bd.Chunks = append(bd.Chunks, ci)
		bd.Length += ci.Length
	}
	if _, err := dnClient(t, addr).PutBlock(wctx, &datanodepb.PutBlockRequest{PipelineId: blk.GetPipelineId(), Block: &bd, WaitAll: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := mc.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: ok.GetOpenId(), Blocks: []*metapb.KeyBlock{{Id: blk.GetId(), Length: bd.Length}}}); err != nil {
		t.Fatal(err)
	}
	ki, err := mc.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k", ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	if ki.GetSize() != uint64(len(data)) || len(ki.GetLocations()) != 1 || len(ki.GetLocations()[0].GetDatanodes()) != 3 {
		t.Fatalf("lookup: %v", ki)
	}
	// Every replica has the whole block (written through WriteData on each).
	for _, dn := range ki.GetLocations()[0].GetDatanodes() {
		st, err := dnClient(t, dn.GetDataAddr()).ReadBlock(blocktoken.WithToken(ctx, ki.GetLocations()[0].GetToken()), &datanodepb.ReadBlockRequest{Block: bid})
		if err != nil {
			t.Fatal(err)
		}
		var got []byte
		for {
			m, err := st.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("read from %d: %v", dn.GetId(), err)
			}
			got = append(got, m.GetData()...)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("replica %d returned %d bytes, differing", dn.GetId(), len(got))
		}
	}
}

func leaderHint(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if e, ok := d.(*datanodepb.Error); ok && e.GetKind() == datanodepb.Error_NOT_LEADER {
			return e.GetLeaderAddr()
		}
	}
	return ""
}
