package client

import (
	"bytes"
	"context"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
)

// TestSmallBatchBufferHeld: a writer whose context ends while its file's
// PutSmallFiles call has not yet marshalled the request returns and
// releases its pooled buffer; the buffer must not go back to the free list
// (where the next PutKey reads into it) before the call is done with it.
// An interceptor holds the call before marshalling until the writer
// returned and the free list of the writer's buffer size was drawn from
// and overwritten, then checks the file's bytes. One P, so that the free
// list hands back what was just put (the race detector drops some puts:
// several rounds). Run it with -race too.
func TestSmallBatchBufferHeld(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cl, err := cluster.Start(ctx, cluster.Config{Dir: t.TempDir(), Datanodes: 3,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.WaitWritable(ctx); err != nil {
		t.Fatal(err)
	}
	const threshold = 64<<10 + 17 // a buffer size of this test's own
	var (
		mu      sync.Mutex
		trapped bool
		want    byte
	)
	entered, proceed, checked := make(chan struct{}), make(chan struct{}), make(chan string)
	trap := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		mu.Lock()
		armed := trapped && strings.HasSuffix(method, "/PutSmallFiles")
		trapped = trapped && !armed
		w := want
		mu.Unlock()
		if armed {
			entered <- struct{}{}
			<-proceed
			// What marshalling the request reads.
			msg := ""
			for _, f := range req.(*datanodepb.PutSmallFilesRequest).GetFiles() {
				if !bytes.Equal(f.GetData(), bytes.Repeat([]byte{w}, len(f.GetData()))) {
					msg = "the file's data changed under the call: its buffer was recycled"
				}
			}
			checked <- msg
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	c, err := New(Config{MetaAddrs: []string{cl.MetaAddr()}, Credentials: cl.ClientCredentials(),
		Location: "/dc1/rack1", StreamThreshold: threshold,
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(trap)}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutKey(ctx, "vol", "bkt", "warm", bytes.NewReader([]byte("x")), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	fl, _ := freeLists.Load(threshold)
	for round := range 12 {
		w := byte(0x10 + round)
		mu.Lock()
		trapped, want = true, w
		mu.Unlock()
		wctx, wcancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			_, err := c.PutKey(wctx, "vol", "bkt", "k", bytes.NewReader(bytes.Repeat([]byte{w}, 4096)), PutOptions{})
			done <- err
		}()
		select {
		case <-entered:
		case err := <-done:
			t.Fatalf("round %d: the put ended before its PutSmallFiles call: %v", round, err)
		case <-ctx.Done():
			t.Fatal("no PutSmallFiles call")
		}
		wcancel()
		if err := <-done; err == nil {
			t.Fatalf("round %d: the put succeeded though its context ended before the call", round)
		}
		// The next writers' buffers, read into.
		var got []*[]byte
		for range 4 {
			b := fl.(*sync.Pool).Get().(*[]byte)
			for i := range *b {
				(*b)[i] = 0xEE
			}
			got = append(got, b)
		}
		for _, b := range got {
			fl.(*sync.Pool).Put(b)
		}
		proceed <- struct{}{}
		if msg := <-checked; msg != "" {
			t.Fatalf("round %d: %s", round, msg)
		}
		wcancel()
	}
}
