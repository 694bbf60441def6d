package datanode

import (
	"io"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestCopyRefusedIntoOwnPipelinesContainer: a datanode still running the
// pipeline a container was written through never imports that container,
// even if its log apply lags and has not created it here yet: the import
// would collide with the log's writes ("container N: import in
// progress"), fail them and leave the replica UNHEALTHY (seen in the
// multi-raft benchmark with slow disks). It refuses the copy and reports
// the failure, so SCM picks another target. A copy of a container of a
// pipeline it does not run starts as before.
func TestCopyRefusedIntoOwnPipelinesContainer(t *testing.T) {
	r := openReplica(t, t.TempDir()) // runs pipeline 1000; container 7 not created yet
	defer r.store.Close()
	// A source that accepts connections and never answers: a copy that
	// starts stays in flight until the datanode stops.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var conns atomic.Int32
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			held = append(held, c)
		}
	}()
	d := &Datanode{store: r.store, log: slog.New(slog.NewTextHandler(io.Discard, nil)), stopc: make(chan struct{}),
		sms: map[uint64]*containerSM{1000: r.sm}, pipelines: map[uint64]*metapb.Pipeline{1000: {Id: 1000}},
		peers: map[uint64]*metapb.DatanodeDetails{}, peerConns: map[string]*grpc.ClientConn{}}
	d.ident.ID = 3
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			close(d.stopc)
			d.wg.Wait()
			d.closePeerConns()
		}
	}
	defer stop()
	src := []*metapb.DatanodeDetails{{Id: 1, DataAddr: ln.Addr().String()}}

	if err := d.replicateContainer(&metapb.ReplicateContainerCommand{ContainerId: 7, PipelineId: 1000, Sources: src}); err != nil {
		t.Fatal(err)
	}
	if n := d.CopiesInFlight(); n != 0 {
		t.Fatalf("copy of container 7 started on a datanode running its pipeline 1000 (%d in flight)", n)
	}
	req := &metapb.HeartbeatRequest{}
	d.takeCopyFailures(req)
	if len(req.CopyFailures) != 1 || req.CopyFailures[0].ContainerId != 7 || !strings.Contains(req.CopyFailures[0].Message, "pipeline 1000") {
		t.Fatalf("copy failures %v: want container 7 refused (pipeline 1000)", req.CopyFailures)
	}
	if _, err := r.store.Container(7); err == nil {
		t.Fatal("container 7 exists here")
	}

	// Control: a container of a pipeline this datanode does not run is
	// copied (the copy starts and dials the source).
	if err := d.replicateContainer(&metapb.ReplicateContainerCommand{ContainerId: 8, PipelineId: 2000, Sources: src}); err != nil {
		t.Fatal(err)
	}
	if n := d.CopiesInFlight(); n != 1 {
		t.Fatalf("copy of container 8 (pipeline 2000) not started: %d in flight", n)
	}
	for deadline := time.Now().Add(20 * time.Second); conns.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the copy of container 8 never dialed its source")
		}
	}
	stop()
	if n := d.CopiesInFlight(); n != 0 {
		t.Fatalf("%d copies in flight after stop", n)
	}
}
