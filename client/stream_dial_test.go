package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/stream"
)

// countingReader yields data in reads of at most 256 KiB and counts what
// it delivered.
type countingReader struct {
	data []byte
	off  atomic.Int64
}

func (r *countingReader) Read(p []byte) (int, error) {
	off := r.off.Load()
	if off == int64(len(r.data)) {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), 256<<10)], r.data[off:])
	r.off.Add(int64(n))
	return n, nil
}

// TestV2ReadsWhileStreamOpens: a V2 write reads its segment on while its
// stream is being opened (the connection and handshakes of every hop),
// instead of stopping its reader until the chain answered. The first
// hop's connection watch (run inside stream.Dial, after the TLS
// handshake) holds the first stream open until the reader has delivered
// the whole segment, bounded by 10 s: with a write that opened the stream
// before reading on, the reader stays at the first chunk and the test
// fails on the bound. A second key's first dial is made to fail after the
// reader ran ahead: the segment is written again on a new stream and
// reads back intact. Real cluster (5 datanodes, TLS, records).
func TestV2ReadsWhileStreamOpens(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cl := startBucket(t, ctx, cluster.Config{Datanodes: 5, BlockSize: 16 << 20, ContainerSize: 512 << 20},
		Config{ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
			StreamTimeout: 15 * time.Second})
	if cl.streamTLS == nil {
		t.Fatal("the cluster's streams are not secured: the watch this test hooks is not called")
	}

	const size = 6<<20 + 12345 // one segment (8 MiB buffer), one block
	rnd := rand.New(rand.NewPCG(5, 6))
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(rnd.Uint32())
	}

	var (
		mu     sync.Mutex
		cur    *countingReader
		dials  int
		sawAt  []int64 // bytes read when each held dial was let go
		breakN = -1    // this dial's connection is closed in the watch
	)
	orig := cl.streamWatch
	cl.streamWatch = func(raw net.Conn, cs *tls.ConnectionState) func() {
		mu.Lock()
		r, n := cur, dials
		dials++
		brk := n == breakN
		mu.Unlock()
		if r != nil && (n == 0 || brk) {
			deadline := time.Now().Add(10 * time.Second)
			for r.off.Load() < int64(len(r.data)) && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			mu.Lock()
			sawAt = append(sawAt, r.off.Load())
			mu.Unlock()
		}
		if brk {
			raw.Close() // the header cannot be sent: the dial fails
		}
		if orig != nil {
			return orig(raw, cs)
		}
		return func() {}
	}

	put := func(key string) {
		t.Helper()
		r := &countingReader{data: data}
		mu.Lock()
		cur = r
		mu.Unlock()
		ki, err := cl.PutKey(ctx, "vol", "bkt", key, r, PutOptions{Pipeline: PipelineV2})
		if err != nil {
			t.Fatalf("put %s: %v", key, err)
		}
		if ki.Pipeline != "v2" || ki.Size != size {
			t.Fatalf("put %s: pipeline %q size %d", key, ki.Pipeline, ki.Size)
		}
		kr, err := cl.GetKey(ctx, "vol", "bkt", key)
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(kr)
		kr.Close()
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s read back %d bytes (err %v), differing", key, len(got), err)
		}
	}

	start := time.Now()
	put("held")
	mu.Lock()
	at := append([]int64(nil), sawAt...)
	mu.Unlock()
	if len(at) != 1 || at[0] != size {
		t.Fatalf("the reader had delivered %v of %d bytes when the first stream opened: the write did not read on while it opened", at, size)
	}
	t.Logf("held dial: whole segment read before the stream opened (%v)", time.Since(start))

	// The first dial of the next key fails after the reader ran ahead.
	// (Its stream would otherwise reuse the first key's connection, kept
	// by the client's pool, and dial nothing.)
	cl.streamPool.CloseIdle()
	mu.Lock()
	breakN, sawAt = dials, nil
	mu.Unlock()
	put("broken")
	mu.Lock()
	defer mu.Unlock()
	if len(sawAt) != 1 || sawAt[0] != size {
		t.Fatalf("broken dial: reader at %v of %d bytes when it failed", sawAt, size)
	}
	if dials < breakN+2 {
		t.Fatalf("%d dials: the failed stream was not opened again", dials)
	}
}

// TestV2OpensKeyWhileFirstChunkIsRead: with a size hint that says V2,
// PutKey (auto) opens the key once it has read the first chunk, while it
// reads the rest of the peek (which it reads to choose the path): the
// reader's Read after the first chunk waits, bounded by 10 s, for an
// OpenKey answered to this client. Every put opens its key exactly once:
// a body that ends after the first chunk but short of the threshold goes
// through V1 with the early open (the code before opened again and left
// the first open behind). A body that fails within the first chunk opens
// nothing: its failing Read waits up to 3 s for an OpenKey, which the code
// that opened before the first Read granted (5 such puts with a 1 GiB hint
// left 5 open keys and 80 blocks).
func TestV2OpensKeyWhileFirstChunkIsRead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var opens atomic.Int64
	count := grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err == nil && strings.Contains(method, "OpenKey") {
			opens.Add(1)
		}
		return err
	})
	cl := startBucket(t, ctx, cluster.Config{Datanodes: 3, BlockSize: 16 << 20, ContainerSize: 512 << 20},
		Config{ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
			DialOptions: []grpc.DialOption{count}})
	// ChunkSize 1 MiB, StreamThreshold 4 MiB (the default): the early
	// open starts once the first 1 MiB has been read, while the rest of
	// the peek is read; the reader below holds its next Read until then.
	const chunk = 1 << 20
	rnd := rand.New(rand.NewPCG(7, 8))
	for _, tc := range []struct {
		name      string
		size      int
		hint      int64
		wantEarly bool
		pipeline  string
	}{
		{"long", 6<<20 + 777, 6<<20 + 777, true, "v2"},
		// Ends after the first chunk, before the threshold: V1 with the
		// early open (the old code opened a second time and orphaned it).
		{"short-body", 2<<20 + 5, 6 << 20, true, "v1"},
		{"tiny-body", 1000, 6 << 20, false, "v1"},
		{"small-hint", 6 << 20, 1000, false, "v2"},
	} {
		data := make([]byte, tc.size)
		for i := range data {
			data[i] = byte(rnd.Uint32())
		}
		before := opens.Load()
		var waited time.Duration
		first := true
		r := readerFunc(func(p []byte) (int, error) {
			if first {
				first = false
				start := time.Now()
				for opens.Load() == before && time.Since(start) < 10*time.Second && tc.wantEarly {
					time.Sleep(2 * time.Millisecond)
				}
				waited = time.Since(start)
			}
			return 0, io.EOF
		})
		head := min(chunk, tc.size)
		cr := &countingReader{data: data[head:]}
		ki, err := cl.PutKey(ctx, "vol", "bkt", tc.name, io.MultiReader(bytes.NewReader(data[:head]), r, cr), PutOptions{SizeHint: tc.hint})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if ki.Pipeline != tc.pipeline || ki.Size != uint64(tc.size) {
			t.Fatalf("%s: pipeline %q size %d, want %q %d", tc.name, ki.Pipeline, ki.Size, tc.pipeline, tc.size)
		}
		if tc.wantEarly && waited >= 10*time.Second {
			t.Fatalf("%s: no OpenKey while the peek was read (waited %v)", tc.name, waited)
		}
		// A body of one chunk or less takes a reserved block: no OpenKey
		// (client/reserve.go).
		want := int64(1)
		if tc.size <= chunk {
			want = 0
		}
		if n := opens.Load() - before; n != want {
			t.Fatalf("%s: %d OpenKeys, want %d (none orphaned)", tc.name, n, want)
		}
		kr, err := cl.GetKey(ctx, "vol", "bkt", tc.name)
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(kr)
		kr.Close()
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: read back %d bytes (err %v), differing", tc.name, len(got), err)
		}
	}
	boom := errors.New("client went away")
	for _, at := range []int{0, chunk / 2} {
		before := opens.Load()
		r := readerFunc(func(p []byte) (int, error) {
			for start := time.Now(); opens.Load() == before && time.Since(start) < 3*time.Second; {
				time.Sleep(2 * time.Millisecond)
			}
			return 0, boom
		})
		name := fmt.Sprintf("failed-at-%d", at)
		_, err := cl.PutKey(ctx, "vol", "bkt", name, io.MultiReader(bytes.NewReader(make([]byte, at)), r), PutOptions{SizeHint: 1 << 30})
		if !errors.Is(err, boom) {
			t.Fatalf("%s: %v, want the reader's error", name, err)
		}
		if n := opens.Load() - before; n != 0 {
			t.Fatalf("%s: %d OpenKeys granted for a body that failed within its first chunk, want 0", name, n)
		}
		if _, err := cl.StatKey(ctx, "vol", "bkt", name); !errors.Is(err, ErrNotFound) {
			t.Fatalf("%s: lookup: %v, want not found", name, err)
		}
	}
}

// TestV2HaltCancelsDial: a body that fails while its segment's stream is
// still being opened ends the put at once: halt cancels the dial's
// context. The dial is held (streamDial) until its context ends, bounded
// by 10 s, then dials for real; the reader fails once the dial began.
// Before, PutKey waited for the dial (here the 10 s bound; in real life
// up to the dial's deadlines).
func TestV2HaltCancelsDial(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cl := startBucket(t, ctx, cluster.Config{Datanodes: 3, BlockSize: 16 << 20, ContainerSize: 512 << 20},
		Config{ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	dialing := make(chan struct{}, 1)
	orig := streamDial
	defer func() { streamDial = orig }()
	streamDial = func(ctx context.Context, route []stream.Target, pipeline uint64, block stream.BlockID, opts stream.Options) (*stream.Writer, error) {
		dialing <- struct{}{}
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
		}
		return orig(ctx, route, pipeline, block, opts)
	}
	boom := errors.New("client went away")
	r := io.MultiReader(bytes.NewReader(make([]byte, 1<<20)), readerFunc(func([]byte) (int, error) {
		select {
		case <-dialing:
		case <-time.After(10 * time.Second):
			t.Error("no dial began within 10 s")
		}
		return 0, boom
	}))
	start := time.Now()
	_, err := cl.PutKey(ctx, "vol", "bkt", "k", r, PutOptions{Pipeline: PipelineV2})
	took := time.Since(start)
	if !errors.Is(err, boom) {
		t.Fatalf("put: %v, want the reader's error", err)
	}
	if took > 5*time.Second {
		t.Fatalf("put returned after %v: it waited for the held dial", took)
	}
	t.Logf("put failed after %v: %v", took, err)
}

// startBucket starts a real cluster (cc: Datanodes, BlockSize,
// ContainerSize; Dir and short heartbeat/tick intervals are filled in),
// waits until it is writable, and returns a client (cfg with the
// cluster's address and credentials, location /dc1/rack1) with volume
// "vol" and bucket "bkt" made. Both are closed when the test ends.
func startBucket(tb testing.TB, ctx context.Context, cc cluster.Config, cfg Config) *Client {
	tb.Helper()
	cc.Dir = tb.TempDir()
	cc.HeartbeatInterval, cc.TickInterval = 200*time.Millisecond, 50*time.Millisecond
	c, err := cluster.Start(ctx, cc)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	if err := c.WaitWritable(ctx); err != nil {
		tb.Fatal(err)
	}
	cfg.MetaAddrs, cfg.Credentials, cfg.Location = []string{c.MetaAddr()}, c.ClientCredentials(), "/dc1/rack1"
	cl, err := New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cl.Close() })
	if _, err := cl.CreateVolume(ctx, "vol", ""); err != nil {
		tb.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		tb.Fatal(err)
	}
	return cl
}
