package datanode_test

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/stream"
	"github.com/basalt-store/basalt/internal/vfs"
)

// slowJoinFS delays the datanode's first read under its pipelines
// directory (joining its first pipeline) by delay.
type slowJoinFS struct {
	vfs.FS
	dir   string
	delay time.Duration
	once  sync.Once
}

func (f *slowJoinFS) Open(name string, opts ...pvfs.OpenOption) (pvfs.File, error) {
	if strings.HasPrefix(name, f.dir) {
		f.once.Do(func() { time.Sleep(f.delay) })
	}
	return f.FS.Open(name, opts...)
}

// TestStreamWaitsForPipelineJoin: the first hop (datanode 2, nearest to
// the client) joins the cluster's pipeline 1 s after the others elected
// its leader, as a member that hears of it a heartbeat later does. A
// stream opened at once waits for the join (up to two heartbeats) and
// succeeds; the old datanode refused it "not in pipeline". A pipeline
// the datanode left is refused at once, as closed.
func TestStreamWaitsForPipelineJoin(t *testing.T) {
	e := startEnvWith(t, func(c *cluster.Config) {
		c.HeartbeatInterval = time.Second // waits up to 2 s
		c.DatanodeConfig = func(i int, dc *datanode.Config) {
			if i == 2 {
				fs := dc.FS
				if fs == nil {
					fs = vfs.Default
				}
				dc.FS = &slowJoinFS{FS: fs, dir: filepath.Join(dc.DataDir, "pipelines") + string(filepath.Separator), delay: time.Second}
			}
		}
	})
	ctx := testCtx(t)
	b := e.block()
	route, err := stream.Route(b.GetDatanodes(), clientLoc)
	if err != nil {
		t.Fatal(err)
	}
	if route[0].ID != e.c.Datanode(2).ID() {
		t.Fatalf("route %v does not start at datanode %d", route, e.c.Datanode(2).ID())
	}
	data := randBytes(100<<10, 7)
	w, err := stream.Dial(ctx, route, b.GetPipelineId(), bid(b), stream.Options{TLS: streamTLS, Token: b.GetToken()})
	if err != nil {
		t.Fatalf("stream opened right after the cluster started: %v", err)
	}
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	length, chunks, err := w.Close()
	if err != nil {
		t.Fatal(err)
	}
	e.putBlock(b, stream.BlockData(bid(b), length, chunks), false)
	for _, dn := range b.GetDatanodes() {
		if got := readAll(t, dn.GetDataAddr(), bid(b)); !bytes.Equal(got, data) {
			t.Fatalf("replica %d returned %d bytes, not what was streamed", dn.GetId(), len(got))
		}
	}

	// Datanode 2 leaves the pipeline: a stream for it is refused as
	// closed, without waiting for a join.
	if err := e.c.Datanode(2).Execute(&metapb.DatanodeCommand{Command: &metapb.DatanodeCommand_ClosePipeline{
		ClosePipeline: &metapb.ClosePipelineCommand{PipelineId: b.GetPipelineId()}}}); err != nil {
		t.Fatal(err)
	}
	b2 := e.block()
	if b2.GetPipelineId() != b.GetPipelineId() {
		t.Skipf("second block in pipeline %d, not %d", b2.GetPipelineId(), b.GetPipelineId())
	}
	route2, _ := stream.Route(b2.GetDatanodes(), clientLoc)
	var se *stream.Error
	if _, err := stream.Dial(ctx, route2, b2.GetPipelineId(), bid(b2), stream.Options{TLS: streamTLS, Token: b2.GetToken()}); !errors.As(err, &se) ||
		se.Code != stream.CodeNotInPipeline || !strings.Contains(se.Reason, "(closed)") {
		t.Fatalf("stream for a pipeline the datanode left: %v", err)
	}
}
