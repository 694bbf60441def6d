package meta

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

type cluster struct {
	t       *testing.T
	dir     string
	n       int
	servers map[uint64]*Server
	scmCfg  scm.Config
	tweak   func(*Config) // changes each server's Config (nil: none)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func newCluster(t *testing.T, n int, scmCfg scm.Config) *cluster {
	return newClusterWith(t, n, scmCfg, nil)
}

func newClusterWith(t *testing.T, n int, scmCfg scm.Config, tweak func(*Config)) *cluster {
	c := &cluster{t: t, dir: t.TempDir(), n: n, servers: map[uint64]*Server{}, scmCfg: scmCfg, tweak: tweak}
	for id := uint64(1); id <= uint64(n); id++ {
		c.servers[id] = c.newServer(id)
	}
	c.wire()
	for _, s := range c.servers {
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, s := range c.servers {
			s.Close()
		}
	})
	return c
}

func (c *cluster) newServer(id uint64) *Server {
	peers := map[uint64]Peer{}
	for p := uint64(1); p <= uint64(c.n); p++ {
		peers[p] = Peer{}
		if s := c.servers[p]; s != nil && p != id {
			peers[p] = Peer{RaftAddr: s.RaftAddr(), GRPCAddr: s.GRPCAddr()}
		}
	}
	cfg := Config{
		NodeID: id, DataDir: filepath.Join(c.dir, fmt.Sprint(id)), Peers: peers, TLS: nodeCreds(id), Admins: testAdmins, Groups: testGroups,
		TickInterval: 20 * time.Millisecond, ElectionTicks: 10,
		SCM:       c.scmCfg,
		Namespace: namespace.Config{ServiceInterval: 50 * time.Millisecond},
		Logger:    quiet,
	}
	if c.tweak != nil {
		c.tweak(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		c.t.Fatal(err)
	}
	return s
}

// wire tells every server every other's current addresses.
func (c *cluster) wire() {
	for _, s := range c.servers {
		for id, o := range c.servers {
			s.SetPeer(id, Peer{RaftAddr: o.RaftAddr(), GRPCAddr: o.GRPCAddr()})
		}
	}
}

func (c *cluster) addrs() []string {
	var a []string
	for id := uint64(1); id <= uint64(c.n); id++ {
		if s := c.servers[id]; s != nil {
			a = append(a, s.GRPCAddr())
		}
	}
	return a
}

func (c *cluster) client() *metaclient.Client {
	cl, err := metaclient.New(metaclient.Config{Addrs: c.addrs(), CallTimeout: 20 * time.Second, DialOptions: clientDial()})
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { cl.Close() })
	fleets.Store(cl, &fleet{addrs: c.addrs(), byID: map[uint64]*metaclient.Client{}})
	return cl
}

func (c *cluster) nsLeader() uint64 {
	for id, s := range c.servers {
		if s.nsGroup.IsLeader() {
			return id
		}
	}
	return 0
}

func waitFor(t *testing.T, d time.Duration, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// registerDatanodes registers n fake datanodes through the client.
func registerDatanodes(t *testing.T, cl *metaclient.Client, n int) []uint64 {
	ctx := context.Background()
	var ids []uint64
	for i := range n {
		uuid := fmt.Sprintf("uuid-%d", i)
		dc := dnClient(t, cl, uuid)
		r, err := dc.Scm.RegisterDatanode(ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{
			Uuid: uuid, DataAddr: fmt.Sprintf("127.0.0.1:%d", 9000+i), RaftAddr: fmt.Sprintf("127.0.0.1:%d", 9100+i),
			Location: fmt.Sprintf("/dc1/rack%d", i%2)}})
		if err != nil {
			t.Fatalf("register: %v", err)
		}
		ids = append(ids, r.DatanodeId)
		f, _ := fleets.Load(cl)
		f.(*fleet).mu.Lock()
		f.(*fleet).byID[r.DatanodeId] = dc
		f.(*fleet).mu.Unlock()
	}
	return ids
}

func TestSingleNodeEndToEnd(t *testing.T) {
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, SafeModeMinDatanodes: 3})
	cl := c.client()
	ctx := context.Background()
	waitFor(t, 5*time.Second, "leader", func() bool { return c.nsLeader() != 0 && c.servers[1].scmGroup.IsLeader() })

	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	// Safe mode: no blocks before 3 datanodes reported.
	_, err := cl.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("open in safe mode: %v, want FailedPrecondition", err)
	}
	ids := registerDatanodes(t, cl, 3)
	waitFor(t, 5*time.Second, "pipelines and containers", func() bool {
		r, err := cl.Scm.ListContainers(ctx, &metapb.ListContainersRequest{})
		return err == nil && len(r.Containers) >= 12
	})
	o, err := cl.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "dir/k", ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 42}}}); err != nil {
		t.Fatal(err)
	}
	ki, err := cl.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "dir/k", ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	if ki.Size != 42 || len(ki.Locations) != 1 || len(ki.Locations[0].Datanodes) != 3 || ki.Locations[0].Datanodes[0].Location != "/dc1/rack1" {
		t.Fatalf("lookup: %v", ki)
	}
	_, err = cl.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "nope"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("missing key: %v", err)
	}
	// Heartbeat carries commands back: create-pipeline for its pipelines.
	hb, err := dnScm(t, cl, ids[0]).Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: ids[0]})
	if err != nil || len(hb.Commands) == 0 {
		t.Fatalf("heartbeat: %v %v", hb, err)
	}
	// Delete goes through namespace → SCM → datanode heartbeat commands.
	if _, err := cl.Namespace.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "dir/k"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "delete-blocks command", func() bool {
		hb, err := dnScm(t, cl, ki.Locations[0].Datanodes[0].Id).Heartbeat(ctx, &metapb.HeartbeatRequest{DatanodeId: ki.Locations[0].Datanodes[0].Id})
		if err != nil {
			return false
		}
		for _, c := range hb.Commands {
			if d := c.GetDeleteBlocks(); d != nil && d.LocalIds[0] == ki.Blocks[0].Id.LocalId {
				return true
			}
		}
		return false
	})
	if h := c.servers[1].Handler(); h == nil {
		t.Fatal("no metrics handler")
	}
}

// TestFailover kills the namespace leader during a stream of creates: every
// acknowledged create must survive and writes must resume within 5s.
func TestFailover(t *testing.T) {
	c := newCluster(t, 3, scm.Config{LoopInterval: 50 * time.Millisecond})
	cl := c.client()
	ctx := context.Background()
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	acked := map[string]bool{}
	var lastAck time.Time
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				name := fmt.Sprintf("b-%d-%d", w, i)
				_, err := cl.Namespace.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: name})
				if err == nil || status.Code(err) == codes.AlreadyExists {
					// AlreadyExists: a retried create whose first try won.
					mu.Lock()
					acked[name] = true
					lastAck = time.Now()
					mu.Unlock()
				}
			}
		}()
	}
	waitFor(t, 10*time.Second, "some creates", func() bool { mu.Lock(); defer mu.Unlock(); return len(acked) > 50 })
	old := c.nsLeader()
	killed := time.Now()
	c.servers[old].Close()
	delete(c.servers, old)
	waitFor(t, 5*time.Second, "writes to resume after killing the leader", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return lastAck.After(killed.Add(100 * time.Millisecond))
	})
	resumed := time.Since(killed)
	close(stop)
	wg.Wait()
	t.Logf("leader %d killed; writes resumed within %v; %d creates acknowledged", old, resumed, len(acked))
	for name := range acked {
		if _, err := cl.Namespace.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol", Name: name}); err != nil {
			t.Fatalf("acknowledged bucket %s lost: %v", name, err)
		}
	}
	// Restart the killed node with its data: it catches up.
	c.servers[old] = c.newServer(old)
	c.wire()
	if err := c.servers[old].Start(); err != nil {
		t.Fatal(err)
	}
	want := c.servers[c.nsLeader()].nsGroup.Status().Commit
	waitFor(t, 10*time.Second, "restarted node to catch up", func() bool {
		return c.servers[old].nsGroup.Status().Applied >= want
	})
	n := 0
	for name := range acked {
		if _, err := c.servers[old].nsState.GetBucket("vol", name); err == nil {
			n++
		}
	}
	if n != len(acked) {
		t.Fatalf("restarted node has %d of %d buckets", n, len(acked))
	}
}

// TestRestartKeepsState stops a whole 1-node service and reopens it.
func TestRestartKeepsState(t *testing.T) {
	c := newCluster(t, 1, scm.Config{})
	cl := c.client()
	ctx := context.Background()
	if _, err := cl.Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "keep"}); err != nil {
		t.Fatal(err)
	}
	ids := registerDatanodes(t, cl, 1)
	c.servers[1].Close()
	c.servers[1] = c.newServer(1)
	c.wire()
	if err := c.servers[1].Start(); err != nil {
		t.Fatal(err)
	}
	cl2 := c.client()
	if _, err := cl2.Namespace.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "keep"}); err != nil {
		t.Fatalf("volume lost in restart: %v", err)
	}
	r, err := dnClient(t, cl2, "uuid-0").Scm.RegisterDatanode(ctx, &metapb.RegisterDatanodeRequest{Details: &metapb.DatanodeDetails{Uuid: "uuid-0", DataAddr: "a:1", RaftAddr: "a:2"}})
	if err != nil || r.DatanodeId != ids[0] {
		t.Fatalf("datanode id after restart: %v %v, want %d", r, err, ids[0])
	}
}

// TestDatanodeLoss: heartbeats stop → STALE → DEAD → its pipelines close.
func TestDatanodeLoss(t *testing.T) {
	// SCM decides a datanode's state in its background tick, and a tick
	// that proposes (pipelines, containers) takes a few fsyncs: on a
	// loaded machine, hundreds of milliseconds. The STALE window
	// (DeadInterval - StaleInterval) is therefore seconds wide, so that at
	// least one tick and one poll fall inside it.
	c := newCluster(t, 1, scm.Config{LoopInterval: 20 * time.Millisecond, HeartbeatInterval: 50 * time.Millisecond,
		StaleInterval: 300 * time.Millisecond, DeadInterval: 3 * time.Second, SafeModeMinDatanodes: 4, PipelineLimit: 2})
	cl := c.client()
	ctx := context.Background()
	ids := registerDatanodes(t, cl, 4)
	// Every datanode heartbeats until the pipelines exist; only then does
	// ids[0] fall silent, so its STALE window starts now, not at its
	// registration (however long the pipelines took).
	var silent atomic.Bool
	stopHB := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			for _, id := range ids {
				if id == ids[0] && silent.Load() {
					continue
				}
				hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				dnScm(t, cl, id).Heartbeat(hctx, &metapb.HeartbeatRequest{DatanodeId: id})
				cancel()
			}
			select {
			case <-stopHB:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	defer func() { close(stopHB); wg.Wait() }()
	waitFor(t, 10*time.Second, "pipelines", func() bool {
		r, err := cl.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
		return err == nil && len(r.Pipelines) >= 6
	})
	silent.Store(true)
	state := func() metapb.NodeState {
		r, err := cl.Scm.ListDatanodes(ctx, &metapb.ListDatanodesRequest{})
		if err != nil {
			return 0
		}
		for _, d := range r.Datanodes {
			if d.Details.Id == ids[0] {
				return d.State
			}
		}
		return 0
	}
	waitFor(t, 10*time.Second, "STALE", func() bool { return state() == metapb.NodeState_STALE })
	waitFor(t, 15*time.Second, "DEAD", func() bool { return state() == metapb.NodeState_DEAD })
	waitFor(t, 10*time.Second, "its pipelines closed", func() bool {
		r, err := cl.Scm.ListPipelines(ctx, &metapb.ListPipelinesRequest{})
		if err != nil {
			return false
		}
		for _, p := range r.Pipelines {
			for _, d := range p.Datanodes {
				if d == ids[0] && p.State == metapb.PipelineState_PIPELINE_OPEN {
					return false
				}
			}
		}
		return true
	})
}
