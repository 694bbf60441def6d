package datanode_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/stream"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestLoggedSmallFilesSurvivePowerCutBeforeApply: real raft and the real
// datanode state machine, each datanode on its own crashable in-memory
// disk. A follower's apply is held (its volume syncs block) after it
// acknowledged the append of a PutSmallFiles batch whose data raft keeps
// in the log only; then the power goes on all three replicas at once. After
// the restart every file acknowledged before the cut, and every file of
// the batch the leader had applied (committed), reads back intact from
// every replica: the held follower gets the batch's data back from its own
// log.
func TestLoggedSmallFilesSurvivePowerCutBeforeApply(t *testing.T) {
	var mu sync.Mutex
	fss := []*vfs.MemFS{vfs.NewMem(vfs.MemOptions{}), vfs.NewMem(vfs.MemOptions{}), vfs.NewMem(vfs.MemOptions{})}
	dirs := make([]string, 3)
	e := startEnvWith(t, func(c *cluster.Config) {
		c.NoShortCircuit = true
		c.DatanodeConfig = func(i int, dc *datanode.Config) {
			mu.Lock()
			defer mu.Unlock()
			dc.FS = fss[i]
			dc.SmallDataInLog = true
			dirs[i] = dc.DataDir
		}
	})
	bs := e.samePipelineBlocks(10)
	pipeline := bs[0].GetPipelineId()
	datas := make([][]byte, len(bs))
	files := make([]*datanodepb.SmallFile, len(bs))
	for i, b := range bs {
		datas[i] = randBytes(4096, uint64(1300+i))
		files[i] = &datanodepb.SmallFile{Block: smallBlock(b, datas[i]), Data: datas[i], Token: tokenOf(bid(b))}
	}
	const acked = 4
	_, r := e.putSmallFiles(pipeline, files[:acked])
	for i, res := range r.GetResults() {
		if res.GetCode() != 0 {
			t.Fatalf("file %d: %v", i, res)
		}
	}
	leader := e.leaderOf(pipeline)
	held := -1
	for i := range e.c.Datanodes {
		if dn := e.c.Datanode(i); dn != leader && held < 0 {
			held = i
		}
	}
	heldDN := e.c.Datanode(held)
	st0, err := leader.PipelineStatus(pipeline)
	if err != nil {
		t.Fatal(err)
	}

	// Hold the follower's apply: its volume syncs (SyncCommitsFor) block.
	gate := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	defer release()
	volDir := filepath.Join(dirs[held], "data")
	fss[held].SetInject(func(op, path string) error {
		if op == "sync" && strings.HasPrefix(path, volDir) {
			<-gate
		}
		return nil
	})
	lc := dnClient(t, leader.Addr())
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		lc.PutSmallFiles(ctx, &datanodepb.PutSmallFilesRequest{
			PipelineId: pipeline, Files: files[acked:], WaitTimeoutMs: 50_000})
	}()
	// The leader applied the batch (so it is committed) and the held
	// follower acknowledged its append (durable in its log), but has not
	// applied it.
	var target uint64
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := leader.PipelineStatus(pipeline)
		if err != nil {
			t.Fatal(err)
		}
		if st.Applied >= st0.Applied+uint64(len(files)-acked) && st.Followers[heldDN.ID()].Match >= st.Applied {
			target = st.Applied
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("leader status %+v: batch not applied on the leader and appended on the held follower", st)
		}
		time.Sleep(5 * time.Millisecond)
	}
	hs, err := heldDN.PipelineStatus(pipeline)
	if err != nil {
		t.Fatal(err)
	}
	if hs.Applied >= target {
		t.Fatalf("held follower applied %d >= %d: its apply was not held", hs.Applied, target)
	}
	// Power cut on all three at once.
	imgs := make([]*vfs.MemFS, 3)
	for i := range fss {
		imgs[i] = fss[i].Crash()
	}
	release()
	for i := range imgs {
		e.c.StopDatanode(i)
	}
	mu.Lock()
	copy(fss, imgs)
	mu.Unlock()
	// The cluster helper issues a restarted datanode's certificate for the
	// identity it finds on the real disk: put it there.
	for i, img := range imgs {
		b, err := vfs.ReadFile(img, filepath.Join(dirs[i], "datanode.json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(dirs[i], 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dirs[i], "datanode.json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range imgs {
		if err := e.c.RestartDatanode(ctx, i); err != nil {
			t.Fatalf("restart datanode %d: %v", i+1, err)
		}
	}
	t.Logf("held follower dn%d applied %d, batch up to %d committed; power cut on all, restarted", held+1, hs.Applied, target)
	for i, b := range bs {
		for _, d := range b.GetDatanodes() {
			_, dn := e.byID(d.GetId())
			got, err := readWithin(t, dn.Addr(), bid(b), 30*time.Second)
			if err != nil {
				t.Fatalf("file %d on datanode %d after the restart: %v", i, d.GetId(), err)
			}
			if !bytes.Equal(got, datas[i]) {
				t.Fatalf("file %d on datanode %d reads back %d bytes, not its data", i, d.GetId(), len(got))
			}
		}
	}
}

// readWithin reads a whole block, retrying until it succeeds or d passes
// (a restarted replica may still be replaying its log).
func readWithin(t *testing.T, addr string, b stream.BlockID, d time.Duration) ([]byte, error) {
	deadline := time.Now().Add(d)
	for {
		got, err := tryRead(t, addr, b)
		if err == nil || time.Now().After(deadline) {
			return got, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func tryRead(t *testing.T, addr string, b stream.BlockID) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	st, err := dnClient(t, addr).ReadBlock(blocktoken.WithToken(ctx, tokenOf(b)), &datanodepb.ReadBlockRequest{
		Block: &datanodepb.BlockID{ContainerId: b.Container, LocalId: b.Local}})
	if err != nil {
		return nil, err
	}
	var got []byte
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return got, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read: %w", err)
		}
		got = append(got, m.GetData()...)
	}
}
