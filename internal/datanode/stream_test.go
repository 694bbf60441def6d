package datanode_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/stream"
)

// The cluster's default layout: datanodes 0 and 1 on /dc1/rack1, 2 on
// /dc1/rack2. A client on rack2 has datanode 2 as its nearest.
const clientLoc = "/dc1/rack2"

type env struct {
	t   testing.TB
	dir string // the cluster's: datanode i keeps its files in dir/dn<i+1>
	c   *cluster.Cluster
	mc  *metaclient.Client
	n   int // keys opened
}

func startEnv(t testing.TB) *env { return startEnvWith(t, nil) }

// startEnvWith starts the test cluster after configure (if not nil) had its
// say on the configuration.
func startEnvWith(t testing.TB, configure func(*cluster.Config)) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cfg := cluster.Config{Dir: t.TempDir(), Datanodes: 3, HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 256 << 20, ContainerSize: 8 << 30}
	if configure != nil {
		configure(&cfg)
	}
	forgetTokens()
	c, err := cluster.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	dnDial = c.DatanodeDialOption()
	streamTLS = c.ClientCredentials().ClientTLS(pki.RoleDatanode)
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mc.Close() })
	if _, err := mc.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := mc.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, dir: cfg.Dir, c: c, mc: mc}
}

// callTimeout bounds each call the test helpers make to the cluster, and
// testCtx a whole test's calls: a call that hangs fails its test with a
// message instead of using up go test's -timeout for the whole package
// (a datanode test once spent 20 minutes in a loop of OpenKey calls, and
// the goroutine dump was all the log said).
const callTimeout = 30 * time.Second

// testCtx is the context of a test's own calls: bounded, and canceled
// when the test ends.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// block opens a key and returns its first block (container, local ID,
// pipeline, replicas nearest to clientLoc first).
func (e *env) block() *metapb.BlockLocation {
	e.t.Helper()
	e.n++
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	ok, err := e.mc.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt",
		Key: fmt.Sprintf("k%d", e.n), ClientLocation: clientLoc})
	if err != nil {
		e.t.Fatalf("OpenKey k%d: %v", e.n, err)
	}
	rememberToken(ok.GetBlocks()[0])
	return ok.GetBlocks()[0]
}

func bid(b *metapb.BlockLocation) stream.BlockID {
	return stream.BlockID{Container: b.GetId().GetContainerId(), Local: b.GetId().GetLocalId()}
}

// byID finds a running datanode and its index in the cluster.
func (e *env) byID(id uint64) (int, *datanode.Datanode) {
	for i := range e.c.Datanodes {
		if dn := e.c.Datanode(i); dn != nil && dn.ID() == id {
			return i, dn
		}
	}
	e.t.Fatalf("no running datanode %d", id)
	return 0, nil
}

// dnDial authenticates dnClient to the datanodes of the cluster the test
// started last (tests here do not run in parallel).
var dnDial grpc.DialOption

// streamTLS authenticates V2 streams to the same cluster's datanodes.
var streamTLS *tls.Config

func dnClient(t testing.TB, addr string) datanodepb.DatanodeClient {
	cc, err := grpc.NewClient(addr, dnDial,
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)), grpc.WithUnaryInterceptor(withTokenOf))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return datanodepb.NewDatanodeClient(cc)
}

// putBlock commits through the pipeline's leader and waits for every
// replica: the one Raft entry of a V2 block.
func (e *env) putBlock(b *metapb.BlockLocation, bd *datanodepb.BlockData, closeContainer bool) {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var err error
		for i := range e.c.Datanodes {
			dn := e.c.Datanode(i)
			if dn == nil || !dn.IsPipelineLeader(b.GetPipelineId()) {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			_, err = dnClient(e.t, dn.Addr()).PutBlock(ctx, &datanodepb.PutBlockRequest{
				PipelineId: b.GetPipelineId(), Block: bd, WaitAll: true, WaitTimeoutMs: 10000, CloseContainer: closeContainer})
			cancel()
			if err == nil {
				return
			}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("PutBlock %v: no leader took it: %v", bd.GetId(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func readAll(t testing.TB, addr string, b stream.BlockID) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	st, err := dnClient(t, addr).ReadBlock(blocktoken.WithToken(ctx, tokenOf(b)), &datanodepb.ReadBlockRequest{
		Block: &datanodepb.BlockID{ContainerId: b.Container, LocalId: b.Local}})
	if err != nil {
		t.Fatal(err)
	}
	var got []byte
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return got
		}
		if err != nil {
			t.Fatalf("read %v from %s: %v", b, addr, err)
		}
		got = append(got, m.GetData()...)
	}
}

func info(t testing.TB, dn *datanode.Datanode) *datanodepb.InfoResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	r, err := dnClient(t, dn.Addr()).Info(ctx, &datanodepb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func randBytes(n int, seed uint64) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, 7))
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := range 8 {
			p[i+j] = byte(v >> (8 * j))
		}
	}
	for i := n &^ 7; i < n; i++ {
		p[i] = byte(r.Uint32())
	}
	return p
}

// hasBlockData reports whether a datanode's storage holds any data for the
// block: the posix backend's file, committed or not.
func hasBlockData(dn *datanode.Datanode, b stream.BlockID) bool {
	for _, v := range dn.Store().Volumes() {
		_, err := os.Stat(filepath.Join(v.Path, "basalt", "containers", strconv.FormatUint(b.Container, 10), strconv.FormatUint(b.Local, 10)+".block"))
		if err == nil {
			return true
		}
	}
	return false
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStreamWriteThroughCluster: the V2 path end to end on a real
// cluster: stream to the nearest datanode, chain to the others, one
// PutBlock with wait_all, read back from every replica.
func TestStreamWriteThroughCluster(t *testing.T) {
	e := startEnv(t)
	ctx := testCtx(t)
	nearest := e.c.Datanode(2) // the one on the client's rack
	before := map[uint64]*datanodepb.InfoResponse{}
	for i := range 3 {
		before[e.c.Datanode(i).ID()] = info(t, e.c.Datanode(i))
	}
	var lastBlock *metapb.BlockLocation
	var lastBD *datanodepb.BlockData
	sizes := []int{1, 1<<20 - 1, 1<<20 + 1, 6<<20 + 4097}
	total := 0
	for i, size := range sizes {
		b := e.block()
		route, err := stream.Route(b.GetDatanodes(), clientLoc)
		if err != nil {
			t.Fatal(err)
		}
		if route[0].ID != nearest.ID() {
			t.Fatalf("route %v does not start at the nearest datanode %d", route, nearest.ID())
		}
		data := randBytes(size, uint64(i))
		w, err := stream.Dial(ctx, route, b.GetPipelineId(), bid(b), stream.Options{TLS: streamTLS, Token: b.GetToken()})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(data); err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		length, chunks, err := w.Close()
		if err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		bd := stream.BlockData(bid(b), length, chunks)
		e.putBlock(b, bd, false)
		for _, dn := range b.GetDatanodes() {
			if got := readAll(t, dn.GetDataAddr(), bid(b)); !bytes.Equal(got, data) {
				t.Fatalf("size %d: replica %d returned %d bytes, not what was streamed", size, dn.GetId(), len(got))
			}
		}
		total += size
		lastBlock, lastBD = b, bd
	}
	// The route started at the nearest datanode every time: only it
	// counted first hops; the others saw the streams from datanodes.
	for i := range 3 {
		dn := e.c.Datanode(i)
		r, b0 := info(t, dn), before[dn.ID()]
		first, down := r.GetStreamsFirstHop()-b0.GetStreamsFirstHop(), r.GetStreamsDownstream()-b0.GetStreamsDownstream()
		wantFirst, wantDown := uint64(0), uint64(len(sizes))
		if dn == nearest {
			wantFirst, wantDown = uint64(len(sizes)), 0
		}
		if first != wantFirst || down != wantDown || r.GetStreamBytesReceived()-b0.GetStreamBytesReceived() != uint64(total) {
			t.Fatalf("datanode %d (%s): first hop %d downstream %d bytes %d; want %d, %d, %d", dn.ID(), r.GetLocation(),
				first, down, r.GetStreamBytesReceived(), wantFirst, wantDown, total)
		}
	}

	// Refusals name the datanode and the reason.
	b := e.block()
	route, _ := stream.Route(b.GetDatanodes(), clientLoc)
	var se *stream.Error
	// (The namespace's token names the block's pipeline, so it is refused
	// for any other; a token naming the unknown one reaches the check.)
	if _, err := stream.Dial(ctx, route, 987654, bid(b), stream.Options{TLS: streamTLS, Token: b.GetToken()}); !errors.As(err, &se) || se.Code != stream.CodePermissionDenied || se.Datanode != route[0].ID {
		t.Fatalf("unknown pipeline with the block's token: %v", err)
	}
	if _, err := stream.Dial(ctx, route, 987654, bid(b), stream.Options{TLS: streamTLS, Token: e.mint(bid(b), 987654)}); !errors.As(err, &se) || se.Code != stream.CodeNotInPipeline || se.Datanode != route[0].ID {
		t.Fatalf("unknown pipeline: %v", err)
	}
	rememberToken(b)
	bad := append([]stream.Target{route[0]}, stream.Target{ID: 4242, Addr: route[1].Addr})
	if _, err := stream.Dial(ctx, bad, b.GetPipelineId(), bid(b), stream.Options{TLS: streamTLS, Token: b.GetToken()}); !errors.As(err, &se) || se.Code != stream.CodeBadHeader {
		t.Fatalf("route through a non-member: %v", err)
	}
	// A committed block cannot be streamed again from 0.
	if _, err := stream.Dial(ctx, route, lastBlock.GetPipelineId(), bid(lastBlock), stream.Options{TLS: streamTLS, Token: lastBlock.GetToken()}); !errors.As(err, &se) || se.Code != stream.CodeBlockCommitted {
		t.Fatalf("committed block: %v", err)
	}
	// Close the container through the log (PutBlock again with
	// close_container), then stream a new block into it.
	e.putBlock(lastBlock, lastBD, true)
	closed := stream.BlockID{Container: bid(lastBlock).Container, Local: bid(lastBlock).Local + 1000}
	if _, err := stream.Dial(ctx, route, lastBlock.GetPipelineId(), closed, stream.Options{TLS: streamTLS, Token: e.mint(closed, lastBlock.GetPipelineId())}); !errors.As(err, &se) || se.Code != stream.CodeContainerNotOpen {
		t.Fatalf("closed container: %v", err)
	}
	t.Logf("closed container: %v", se)
}

// TestStreamDatanodeStops stops the datanode at each position of the
// route mid-stream: the Writer's error names it and the surviving
// datanodes keep no data of the block.
func TestStreamDatanodeStops(t *testing.T) {
	e := startEnv(t)
	ctx := testCtx(t)
	data := randBytes(1<<20, 9)
	for pos, name := range []string{"first", "middle", "last"} {
		t.Run(name, func(t *testing.T) {
			b := e.block()
			route, err := stream.Route(b.GetDatanodes(), clientLoc)
			if err != nil {
				t.Fatal(err)
			}
			// The addresses SCM has may predate a restart: ask the
			// datanodes themselves.
			for i := range route {
				_, dn := e.byID(route[i].ID)
				route[i].Addr = dn.StreamAddr()
			}
			w, err := stream.Dial(ctx, route, b.GetPipelineId(), bid(b), stream.Options{TLS: streamTLS, Window: 4, Token: b.GetToken()})
			if err != nil {
				t.Fatal(err)
			}
			for range 4 {
				if _, err := w.Write(data); err != nil {
					t.Fatal(err)
				}
			}
			for _, r := range route {
				_, dn := e.byID(r.ID)
				waitFor(t, 10*time.Second, "data on every datanode", func() bool { return hasBlockData(dn, bid(b)) })
			}
			idx, _ := e.byID(route[pos].ID)
			if err := e.c.StopDatanode(idx); err != nil {
				t.Fatal(err)
			}
			var werr error
			for i := 0; i < 64 && werr == nil; i++ {
				_, werr = w.Write(data)
			}
			if werr == nil {
				_, _, werr = w.Close()
			} else {
				w.Abort()
			}
			var se *stream.Error
			if !errors.As(werr, &se) || se.Datanode != route[pos].ID {
				t.Fatalf("error %v, want one naming datanode %d", werr, route[pos].ID)
			}
			t.Logf("%s stopped: %v", name, werr)
			for i, r := range route {
				if i == pos {
					continue
				}
				_, dn := e.byID(r.ID)
				waitFor(t, 10*time.Second, "survivor to discard the block", func() bool {
					return !hasBlockData(dn, bid(b)) && dn.StreamStats().Active == 0
				})
			}
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			if err := e.c.RestartDatanode(rctx, idx); err != nil {
				t.Fatal(err)
			}
		})
	}
}
