package client

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
)

// This file is a test cluster: a real single-node meta service and fake
// in-process datanodes that follow the datanode protocol (leaders answer
// writes, others NOT_LEADER; PutBlock with wait_all names lagging
// replicas) with hooks to inject failures. The fake verifies every chunk
// with internal/storage's checksum code, so the client's checksums are
// checked against the storage layer's verification.

type bkey struct{ c, l uint64 }

type fakeDN struct {
	datanodepb.UnimplementedDatanodeServer
	fc    *fakeCluster
	id    uint64
	loc   string
	addr  string
	lis   net.Listener
	srv   *grpc.Server
	creds *pki.Credentials

	mu      sync.Mutex
	down    bool
	lagging bool // PutBlock is not applied here (a slow follower)
	corrupt bool // reads return a flipped byte
	chunks  map[bkey]map[uint64][]byte
	blocks  map[bkey]*datanodepb.BlockData
	reads   int
}

type fakeCluster struct {
	t    *testing.T
	meta *meta.Server
	mc   *metaclient.Client

	mu        sync.Mutex
	dns       map[uint64]*fakeDN
	pipelines map[uint64][]uint64

	// Hooks, called on the leader before acting; a non-nil error is
	// returned to the client.
	onWriteChunk func(dn *fakeDN, req *datanodepb.WriteChunkRequest) error
	onPutBlock   func(dn *fakeDN, req *datanodepb.PutBlockRequest) error
	// onPutSmallFile is called first for a PutSmallFile, which then acts
	// as WriteChunk + PutBlock with wait_all (their hooks apply too).
	onPutSmallFile func(dn *fakeDN, req *datanodepb.PutSmallFileRequest) error
	// noSmallFile makes the datanodes answer PutSmallFile Unimplemented,
	// like datanodes that predate it.
	noSmallFile bool
	// smallFiles counts PutSmallFile calls that committed (alone or in
	// a PutSmallFiles).
	smallFiles int
	// smallBatches counts PutSmallFiles calls (each file of one acts as
	// its own PutSmallFile: hooks, counts and errors).
	smallBatches int
	// committed counts bytes committed by PutBlock on all replicas.
	committed map[bkey]uint64
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// testLog is a logger whose lines are kept and shown with t.Log only if
// the test failed, so a rare failure says what went wrong first. Lines
// written after the test ended (a background goroutine) are dropped, never
// passed to t.Log.
func testLog(t testing.TB) *slog.Logger {
	w := &tLogWriter{}
	t.Cleanup(func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if t.Failed() {
			for _, l := range w.lines {
				t.Log(l)
			}
		}
		w.lines, w.done = nil, true
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type tLogWriter struct {
	mu    sync.Mutex
	lines []string
	done  bool
}

func (w *tLogWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done && len(w.lines) < 10000 {
		w.lines = append(w.lines, strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

// testCA signs the certificates of the fake clusters: the meta node's,
// each fake datanode's and the clients'.
var testCA = sync.OnceValue(func() *pki.CA {
	ca, err := pki.NewCA("client test CA")
	if err != nil {
		panic(err)
	}
	return ca
})

func testCreds(role pki.Role, id string) *pki.Credentials {
	c, err := testCA().Issue(pki.Identity{Role: role, ID: id}, time.Hour)
	if err != nil {
		panic(err)
	}
	return c
}

// clientCreds are the test clients' certificate.
var clientCreds = sync.OnceValue(func() *pki.Credentials { return testCreds(pki.RoleClient, "test") })

func newFakeCluster(t *testing.T, nDN int, blockSize uint64) *fakeCluster {
	t.Helper()
	ms, err := meta.New(meta.Config{
		NodeID: 1, DataDir: filepath.Join(t.TempDir(), "meta"), TLS: testCreds(pki.RoleMeta, "1"), Admins: []string{"test"},
		TickInterval: 10 * time.Millisecond, ElectionTicks: 5,
		SCM:       scm.Config{LoopInterval: 20 * time.Millisecond, BlockSize: blockSize, SafeModeMinDatanodes: 1},
		Namespace: namespace.Config{ServiceInterval: 50 * time.Millisecond},
		Logger:    quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ms.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ms.Close() })
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{ms.GRPCAddr()}, CallTimeout: 10 * time.Second,
		DialOptions: []grpc.DialOption{clientCreds().GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mc.Close() })
	fc := &fakeCluster{t: t, meta: ms, mc: mc, dns: map[uint64]*fakeDN{}, pipelines: map[uint64][]uint64{}, committed: map[bkey]uint64{}}
	ctx := context.Background()
	for i := range nDN {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		uuid := fmt.Sprintf("fake-%d", i)
		dn := &fakeDN{fc: fc, lis: lis, addr: lis.Addr().String(), loc: fmt.Sprintf("/dc1/rack%d", i%2+1),
			chunks: map[bkey]map[uint64][]byte{}, blocks: map[bkey]*datanodepb.BlockData{}, creds: testCreds(pki.RoleDatanode, uuid)}
		// A datanode registers in its own name only.
		dmc, err := metaclient.New(metaclient.Config{Addrs: []string{ms.GRPCAddr()}, CallTimeout: 10 * time.Second,
			DialOptions: []grpc.DialOption{dn.creds.GRPCDialOption(pki.RoleMeta)}})
		if err != nil {
			t.Fatal(err)
		}
		r, err := dmc.Scm.RegisterDatanode(ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{
			Uuid: uuid, Hostname: "localhost", DataAddr: dn.addr, RaftAddr: dn.addr, Location: dn.loc},
			Volumes: []*metapb.VolumeReport{{Path: "/fake", CapacityBytes: 1 << 40}}})
		if err != nil {
			t.Fatal(err)
		}
		dmc.Close()
		dn.id = r.DatanodeId
		fc.dns[dn.id] = dn
		dn.start()
		t.Cleanup(dn.stop)
	}
	// Ready when every datanode is HEALTHY and SCM made the pipelines it
	// will (at least one per three datanodes).
	want := max(1, nDN/3)
	deadline := time.Now().Add(10 * time.Second)
	for {
		healthy := 0
		if r, err := mc.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{}); err == nil {
			for _, d := range r.Datanodes {
				if d.State == metapb.NodeState_HEALTHY {
					healthy++
				}
			}
		}
		pipes := 0
		if r, err := mc.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{}); err == nil {
			for _, p := range r.Pipelines {
				if p.State == metapb.PipelineState_PIPELINE_OPEN && len(p.Datanodes) == 3 {
					pipes++
				}
			}
		}
		conts, _ := mc.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		if healthy == nDN && pipes >= want && len(conts.GetContainers()) >= pipes {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("cluster not ready after 10s: %d/%d datanodes healthy, %d/%d pipelines", healthy, nDN, pipes, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fc
}

func (dn *fakeDN) start() {
	dn.srv = grpc.NewServer(dn.creds.GRPCServerOption(), grpc.MaxRecvMsgSize(64<<20))
	datanodepb.RegisterDatanodeServer(dn.srv, dn)
	lis := dn.lis
	go dn.srv.Serve(lis)
}

func (dn *fakeDN) stop() {
	dn.mu.Lock()
	dn.down = true
	dn.mu.Unlock()
	dn.srv.Stop()
}

func (dn *fakeDN) isDown() bool {
	dn.mu.Lock()
	defer dn.mu.Unlock()
	return dn.down
}

func (fc *fakeCluster) members(pid uint64) []uint64 {
	fc.mu.Lock()
	m, ok := fc.pipelines[pid]
	fc.mu.Unlock()
	if ok {
		return m
	}
	r, err := fc.mc.Scm.ListPipelines(context.Background(), &metapb.ListPipelinesRequest{})
	if err != nil {
		return nil
	}
	fc.mu.Lock()
	defer fc.mu.Unlock()
	for _, p := range r.Pipelines {
		fc.pipelines[p.Id] = p.Datanodes
	}
	return fc.pipelines[pid]
}

// leader is the first live member (an election moves it when one dies).
func (fc *fakeCluster) leader(pid uint64) *fakeDN {
	for _, id := range fc.members(pid) {
		if dn := fc.dns[id]; dn != nil && !dn.isDown() {
			return dn
		}
	}
	return nil
}

func dnErr(c codes.Code, e *datanodepb.Error, msg string) error {
	st, _ := status.New(c, msg).WithDetails(e)
	return st.Err()
}

func (dn *fakeDN) checkLeader(pid uint64) error {
	if len(dn.fc.members(pid)) == 0 {
		return dnErr(codes.NotFound, &datanodepb.Error{Kind: datanodepb.Error_PIPELINE_NOT_FOUND}, fmt.Sprintf("pipeline %d not found", pid))
	}
	l := dn.fc.leader(pid)
	if l != dn {
		e := &datanodepb.Error{Kind: datanodepb.Error_NOT_LEADER}
		if l != nil {
			e.LeaderId, e.LeaderAddr = l.id, l.addr
		}
		return dnErr(codes.Unavailable, e, fmt.Sprintf("datanode %d is not the leader of pipeline %d", dn.id, pid))
	}
	return nil
}

func (dn *fakeDN) WriteChunk(ctx context.Context, req *datanodepb.WriteChunkRequest) (*datanodepb.WriteChunkResponse, error) {
	if err := dn.checkLeader(req.PipelineId); err != nil {
		return nil, err
	}
	if h := dn.fc.onWriteChunk; h != nil {
		if err := h(dn, req); err != nil {
			return nil, err
		}
	}
	ck := req.Chunk.GetChecksum()
	sd := storage.ChecksumData{Type: storage.ChecksumType(ck.GetType()), BytesPerChecksum: ck.GetBytesPerChecksum(), Sums: ck.GetSums()}
	if ck.GetType() != datanodepb.ChecksumType_CHECKSUM_CRC32C || uint64(len(req.Data)) != req.Chunk.Length {
		return nil, dnErr(codes.InvalidArgument, &datanodepb.Error{Kind: datanodepb.Error_BAD_REQUEST}, "bad chunk")
	}
	if bad := sd.Verify(req.Data); bad >= 0 {
		return nil, dnErr(codes.DataLoss, &datanodepb.Error{Kind: datanodepb.Error_CHECKSUM_MISMATCH}, fmt.Sprintf("checksum mismatch at %d", bad))
	}
	k := bkey{req.Block.ContainerId, req.Block.LocalId}
	for _, id := range dn.fc.members(req.PipelineId) {
		m := dn.fc.dns[id]
		if m.isDown() {
			continue
		}
		m.mu.Lock()
		if m.chunks[k] == nil {
			m.chunks[k] = map[uint64][]byte{}
		}
		m.chunks[k][req.Chunk.Offset] = append([]byte(nil), req.Data...)
		m.mu.Unlock()
	}
	return &datanodepb.WriteChunkResponse{Index: 1}, nil
}

func (dn *fakeDN) PutBlock(ctx context.Context, req *datanodepb.PutBlockRequest) (*datanodepb.PutBlockResponse, error) {
	if err := dn.checkLeader(req.PipelineId); err != nil {
		return nil, err
	}
	if h := dn.fc.onPutBlock; h != nil {
		if err := h(dn, req); err != nil {
			return nil, err
		}
	}
	k := bkey{req.Block.Id.ContainerId, req.Block.Id.LocalId}
	var lagging []uint64
	for _, id := range dn.fc.members(req.PipelineId) {
		m := dn.fc.dns[id]
		m.mu.Lock()
		if m.down || m.lagging {
			lagging = append(lagging, id)
		} else {
			for _, c := range req.Block.Chunks {
				if _, ok := m.chunks[k][c.Offset]; !ok {
					m.mu.Unlock()
					return nil, dnErr(codes.FailedPrecondition, &datanodepb.Error{Kind: datanodepb.Error_BAD_REQUEST}, fmt.Sprintf("put block: chunk at %d not written", c.Offset))
				}
			}
			m.blocks[k] = req.Block
		}
		m.mu.Unlock()
	}
	if len(lagging) > 0 && req.WaitAll {
		return nil, dnErr(codes.DeadlineExceeded, &datanodepb.Error{Kind: datanodepb.Error_REPLICAS_LAG, Lagging: lagging}, fmt.Sprintf("replicas %v lag", lagging))
	}
	dn.fc.mu.Lock()
	dn.fc.committed[k] = req.Block.Length
	dn.fc.mu.Unlock()
	return &datanodepb.PutBlockResponse{Index: 2}, nil
}

func (dn *fakeDN) PutSmallFiles(ctx context.Context, req *datanodepb.PutSmallFilesRequest) (*datanodepb.PutSmallFilesResponse, error) {
	if dn.fc.noSmallFile {
		return dn.UnimplementedDatanodeServer.PutSmallFiles(ctx, req)
	}
	dn.fc.mu.Lock()
	dn.fc.smallBatches++
	dn.fc.mu.Unlock()
	resp := &datanodepb.PutSmallFilesResponse{}
	for _, f := range req.GetFiles() {
		r, err := dn.PutSmallFile(ctx, &datanodepb.PutSmallFileRequest{PipelineId: req.GetPipelineId(), Block: f.GetBlock(), Data: f.GetData(), WaitTimeoutMs: req.GetWaitTimeoutMs()})
		res := &datanodepb.SmallFileResult{Index: r.GetIndex()}
		if err != nil {
			st := status.Convert(err)
			res = &datanodepb.SmallFileResult{Code: uint32(st.Code()), Message: st.Message()}
			for _, d := range st.Details() {
				if e, ok := d.(*datanodepb.Error); ok {
					res.Error = e
				}
			}
		}
		resp.Results = append(resp.Results, res)
	}
	return resp, nil
}

func (dn *fakeDN) PutSmallFile(ctx context.Context, req *datanodepb.PutSmallFileRequest) (*datanodepb.PutSmallFileResponse, error) {
	if dn.fc.noSmallFile {
		return dn.UnimplementedDatanodeServer.PutSmallFile(ctx, req)
	}
	if err := dn.checkLeader(req.PipelineId); err != nil {
		return nil, err
	}
	if h := dn.fc.onPutSmallFile; h != nil {
		if err := h(dn, req); err != nil {
			return nil, err
		}
	}
	if len(req.Block.GetChunks()) != 1 || req.Block.Length != uint64(len(req.Data)) {
		return nil, dnErr(codes.InvalidArgument, &datanodepb.Error{Kind: datanodepb.Error_BAD_REQUEST}, "bad small file")
	}
	if _, err := dn.WriteChunk(ctx, &datanodepb.WriteChunkRequest{PipelineId: req.PipelineId, Block: req.Block.Id, Chunk: req.Block.Chunks[0], Data: req.Data}); err != nil {
		return nil, err
	}
	if _, err := dn.PutBlock(ctx, &datanodepb.PutBlockRequest{PipelineId: req.PipelineId, Block: req.Block, WaitAll: true}); err != nil {
		return nil, err
	}
	dn.fc.mu.Lock()
	dn.fc.smallFiles++
	dn.fc.mu.Unlock()
	return &datanodepb.PutSmallFileResponse{Index: 2}, nil
}

func (fc *fakeCluster) committedBytes() uint64 {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	var n uint64
	for _, v := range fc.committed {
		n += v
	}
	return n
}

func (dn *fakeDN) ReadBlock(req *datanodepb.ReadBlockRequest, st grpc.ServerStreamingServer[datanodepb.ReadBlockResponse]) error {
	k := bkey{req.Block.ContainerId, req.Block.LocalId}
	dn.mu.Lock()
	dn.reads++
	bd := dn.blocks[k]
	var data []byte
	if bd != nil {
		chunks := append([]*datanodepb.ChunkInfo(nil), bd.Chunks...)
		sort.Slice(chunks, func(i, j int) bool { return chunks[i].Offset < chunks[j].Offset })
		for _, c := range chunks {
			data = append(data, dn.chunks[k][c.Offset]...)
		}
	}
	corrupt := dn.corrupt
	dn.mu.Unlock()
	if bd == nil {
		return dnErr(codes.NotFound, &datanodepb.Error{Kind: datanodepb.Error_NO_SUCH_BLOCK}, fmt.Sprintf("block %v not found", k))
	}
	end := req.Offset + req.Length
	if req.Length == 0 {
		end = bd.Length
	}
	if end > uint64(len(data)) || req.Offset > end {
		return dnErr(codes.OutOfRange, &datanodepb.Error{Kind: datanodepb.Error_BAD_REQUEST}, "range beyond block")
	}
	out := append([]byte(nil), data[req.Offset:end]...)
	if corrupt && len(out) > 0 {
		out[len(out)/2] ^= 0xff
	}
	if err := st.Send(&datanodepb.ReadBlockResponse{Block: bd}); err != nil {
		return err
	}
	const piece = 100_000 // deliberately not a window multiple
	for off := 0; off < len(out); off += piece {
		if err := st.Send(&datanodepb.ReadBlockResponse{Offset: req.Offset + uint64(off), Data: out[off:min(off+piece, len(out))]}); err != nil {
			return err
		}
	}
	return nil
}
