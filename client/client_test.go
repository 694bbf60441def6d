package client

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Small sizes so that a test key spans several chunks, flushes and blocks.
const (
	tChunk = 64 << 10
	tBPC   = 4 << 10
	tBlock = 256 << 10
	tBuf   = 512 << 10
)

func testClient(t *testing.T, fc *fakeCluster, mod func(*Config)) *Client {
	t.Helper()
	cfg := Config{MetaAddrs: []string{fc.meta.GRPCAddr()}, Location: "/dc1/rack1", ChunkSize: tChunk, BytesPerChecksum: tBPC,
		MaxBufferBytes: tBuf, MaxInflightChunks: 4, WaitAllTimeout: 2 * time.Second, RPCTimeout: 5 * time.Second, Logger: quiet,
		Credentials: clientCreds()}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func setupBucket(t *testing.T, c *Client) {
	t.Helper()
	ctx := context.Background()
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		t.Fatal(err)
	}
}

// onlyReader hides other interfaces so PutKey sees a stream of unknown
// length.
type onlyReader struct{ r io.Reader }

func (o onlyReader) Read(p []byte) (int, error) { return o.r.Read(p) }

func getAll(t *testing.T, c *Client, key string) []byte {
	t.Helper()
	r, err := c.GetKey(context.Background(), "vol", "bkt", key)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var out bytes.Buffer
	if _, err := io.Copy(&out, r); err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	return out.Bytes()
}

func TestPutGetRoundTrip(t *testing.T) {
	fc := newFakeCluster(t, 6, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	ctx := context.Background()
	sizes := []int{0, 1, tBPC - 1, tBPC + 1, tChunk, tChunk + 7, tBlock, tBlock + 1, 3*tBlock + tChunk/3}
	for i, n := range sizes {
		data := randBytes(uint64(i), n)
		key := fmt.Sprintf("k/%d", n)
		ki, err := c.PutKey(ctx, "vol", "bkt", key, onlyReader{bytes.NewReader(data)}, PutOptions{})
		if err != nil {
			t.Fatalf("put %d bytes: %v", n, err)
		}
		if ki.Size != uint64(n) {
			t.Fatalf("put %d bytes: size %d", n, ki.Size)
		}
		if want := (n + tBlock - 1) / tBlock; len(ki.Blocks) != want {
			t.Fatalf("put %d bytes: %d blocks, want %d", n, len(ki.Blocks), want)
		}
		if got := getAll(t, c, key); !bytes.Equal(got, data) {
			t.Fatalf("get %d bytes: got %d bytes, content differs", n, len(got))
		}
	}
	// Random ranges through ReadAt and Seek+Read.
	data := randBytes(99, 3*tBlock+12345)
	if _, err := c.PutKey(ctx, "vol", "bkt", "big", bytes.NewReader(data), PutOptions{SizeHint: int64(len(data))}); err != nil {
		t.Fatal(err)
	}
	r, err := c.GetKey(ctx, "vol", "bkt", "big")
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 50 {
		off := rng.IntN(len(data))
		n := rng.IntN(min(len(data)-off, 2*tBlock)) + 1
		p := make([]byte, n)
		if got, err := r.ReadAt(p, int64(off)); err != nil && !(err == io.EOF && off+n == len(data)) || got != n {
			t.Fatalf("ReadAt(%d, %d) = %d, %v", n, off, got, err)
		}
		if !bytes.Equal(p, data[off:off+n]) {
			t.Fatalf("ReadAt(%d, %d): content differs", n, off)
		}
		if _, err := r.Seek(int64(off), io.SeekStart); err != nil {
			t.Fatal(err)
		}
		q := make([]byte, min(n, 1000))
		if _, err := io.ReadFull(r, q); err != nil || !bytes.Equal(q, data[off:off+len(q)]) {
			t.Fatalf("Seek(%d)+Read: %v", off, err)
		}
	}
	if n, err := r.ReadAt(make([]byte, 10), int64(len(data))); n != 0 || err != io.EOF {
		t.Fatalf("ReadAt at end = %d, %v; want 0, EOF", n, err)
	}
	// Overwrite replaces atomically.
	if _, err := c.PutKey(ctx, "vol", "bkt", "big", bytes.NewReader([]byte("small")), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := getAll(t, c, "big"); string(got) != "small" {
		t.Fatalf("after overwrite: %q", got)
	}
}

func TestNamesAndErrors(t *testing.T) {
	fc := newFakeCluster(t, 3, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	ctx := context.Background()
	_, err := c.CreateVolume(ctx, "vol", "")
	if !errors.Is(err, ErrExists) || !bytes.Contains([]byte(err.Error()), []byte(`"vol"`)) {
		t.Fatalf("create existing volume: %v", err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "Bad_Name", BucketOptions{}); !errors.Is(err, ErrInvalidName) || !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad bucket name: %v", err)
	}
	if _, err := c.BucketInfo(ctx, "vol", "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing bucket: %v", err)
	}
	if _, err := c.GetKey(ctx, "vol", "bkt", "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing key: %v", err)
	}
	if _, err := c.PutKey(ctx, "vol", "nope", "k", bytes.NewReader(nil), PutOptions{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("put to missing bucket: %v", err)
	}
	// What is missing, typed (from the namespace's error details).
	for _, tc := range []struct {
		what       string
		err        error
		want, not1 error
	}{
		{"get from a missing volume", errOf(c.GetKey(ctx, "novol", "bkt", "k")), ErrVolumeNotFound, ErrBucketNotFound},
		{"get from a missing bucket", errOf(c.GetKey(ctx, "vol", "nope", "k")), ErrBucketNotFound, ErrKeyNotFound},
		{"get a missing key", errOf(c.GetKey(ctx, "vol", "bkt", "nope")), ErrKeyNotFound, ErrBucketNotFound},
		{"stat a missing key", errOf(c.StatKey(ctx, "vol", "bkt", "nope")), ErrKeyNotFound, ErrBucketNotFound},
		{"head a missing key", errOf(c.HeadKey(ctx, "vol", "bkt", "nope")), ErrKeyNotFound, ErrBucketNotFound},
		{"head in a missing bucket", errOf(c.HeadKey(ctx, "vol", "nope", "k")), ErrBucketNotFound, ErrKeyNotFound},
		{"put to a missing bucket", errOf(c.PutKey(ctx, "vol", "nope", "k", bytes.NewReader(nil), PutOptions{})), ErrBucketNotFound, ErrKeyNotFound},
		{"info of a missing bucket", errOf(c.BucketInfo(ctx, "vol", "nope")), ErrBucketNotFound, ErrVolumeNotFound},
	} {
		if !errors.Is(tc.err, tc.want) || !errors.Is(tc.err, ErrNotFound) || errors.Is(tc.err, tc.not1) {
			t.Errorf("%s: %v: want %v (and ErrNotFound), not %v", tc.what, tc.err, tc.want, tc.not1)
		}
	}
	if err := c.DeleteVolume(ctx, "vol"); !errors.Is(err, ErrNotEmpty) {
		t.Fatalf("delete non-empty volume: %v", err)
	}
	// Listing, iterator, rename, delete.
	for _, k := range []string{"a/1", "a/2", "b/1", "c"} {
		if _, err := c.PutKey(ctx, "vol", "bkt", k, bytes.NewReader([]byte(k)), PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for e, err := range c.Keys(ctx, "vol", "bkt", ListKeysOptions{Delimiter: "/", PageSize: 1}) {
		if err != nil {
			t.Fatal(err)
		}
		if e.Key != nil {
			got = append(got, e.Key.Name)
		} else {
			got = append(got, e.Prefix)
		}
	}
	if want := []string{"a/", "b/", "c"}; !slices.Equal(got, want) {
		t.Fatalf("list with delimiter: %v, want %v", got, want)
	}
	if err := c.RenameKey(ctx, "vol", "bkt", "c", "a/1"); !errors.Is(err, ErrExists) {
		t.Fatalf("rename onto existing: %v", err)
	}
	if err := c.RenameKey(ctx, "vol", "bkt", "c", "d"); err != nil {
		t.Fatal(err)
	}
	if string(getAll(t, c, "d")) != "c" {
		t.Fatal("renamed key content")
	}
	if err := c.DeleteKey(ctx, "vol", "bkt", "d", false); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StatKey(ctx, "vol", "bkt", "d"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("stat deleted key: %v", err)
	}
}

// TestLeaderDiesMidWrite stops the pipeline leader after a few chunks: the
// writer excludes it, gets a block elsewhere, rewrites what was not
// committed, and the key reads back intact.
func TestLeaderDiesMidWrite(t *testing.T) {
	fc := newFakeCluster(t, 6, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	var n atomic.Int32
	var victim atomic.Uint64
	fc.onWriteChunk = func(dn *fakeDN, req *datanodepb.WriteChunkRequest) error {
		if n.Add(1) == 6 && victim.Load() == 0 {
			victim.Store(dn.id)
			go dn.stop()
			return status.Error(codes.Unavailable, "leader going down")
		}
		return nil
	}
	data := randBytes(7, 2*tBlock+tChunk/2)
	ki, err := c.PutKey(context.Background(), "vol", "bkt", "k", bytes.NewReader(data), PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if victim.Load() == 0 {
		t.Fatal("no datanode was stopped")
	}
	if !bytes.Equal(getAll(t, c, "k"), data) {
		t.Fatal("content differs after leader failure")
	}
	// Blocks after the failure avoid the dead datanode; the block that
	// failed is kept at its committed length (possibly 0: then dropped).
	var total uint64
	for _, b := range ki.Blocks {
		total += b.Length
	}
	if total != uint64(len(data)) {
		t.Fatalf("blocks hold %d bytes, want %d", total, len(data))
	}
	st, _ := c.StatKey(context.Background(), "vol", "bkt", "k")
	last := st.Blocks[len(st.Blocks)-1]
	for _, r := range last.Replicas {
		if r.ID == victim.Load() {
			t.Fatalf("last block %+v is on the stopped datanode %d", last, victim.Load())
		}
	}
}

// TestContainerClosedAndLagging: CONTAINER_NOT_OPEN excludes the
// container; REPLICAS_LAG excludes the laggard and the pipeline; a block
// committed on some replicas only is not extended.
func TestContainerClosedAndLagging(t *testing.T) {
	fc := newFakeCluster(t, 6, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	var closed atomic.Uint64
	fc.onWriteChunk = func(dn *fakeDN, req *datanodepb.WriteChunkRequest) error {
		if closed.CompareAndSwap(0, req.Block.ContainerId) || closed.Load() == req.Block.ContainerId {
			return dnErr(codes.FailedPrecondition, &datanodepb.Error{Kind: datanodepb.Error_CONTAINER_NOT_OPEN}, "container closing")
		}
		return nil
	}
	var lagOnce sync.Once
	var laggard atomic.Uint64
	fc.onPutBlock = func(dn *fakeDN, req *datanodepb.PutBlockRequest) error {
		lagOnce.Do(func() {
			m := fc.members(req.PipelineId)
			d := fc.dns[m[len(m)-1]]
			d.mu.Lock()
			d.lagging = true
			d.mu.Unlock()
			laggard.Store(d.id)
		})
		return nil
	}
	data := randBytes(8, tBlock+3*tChunk)
	ki, err := c.PutKey(context.Background(), "vol", "bkt", "k", bytes.NewReader(data), PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range ki.Blocks {
		if b.ContainerID == closed.Load() {
			t.Fatalf("block in the closed container %d: %+v", closed.Load(), ki.Blocks)
		}
	}
	fc.dns[laggard.Load()].mu.Lock()
	fc.dns[laggard.Load()].lagging = false
	fc.dns[laggard.Load()].mu.Unlock()
	if !bytes.Equal(getAll(t, c, "k"), data) {
		t.Fatal("content differs")
	}
}

func TestRetriesExhausted(t *testing.T) {
	fc := newFakeCluster(t, 6, tBlock)
	c := testClient(t, fc, func(c *Config) { c.MaxBlockRetries = 2 })
	setupBucket(t, c)
	var calls atomic.Int32
	fc.onWriteChunk = func(*fakeDN, *datanodepb.WriteChunkRequest) error {
		calls.Add(1)
		return dnErr(codes.Internal, &datanodepb.Error{Kind: datanodepb.Error_IO_ERROR}, "disk on fire")
	}
	_, err := c.PutKey(context.Background(), "vol", "bkt", "k", bytes.NewReader(randBytes(1, tChunk)), PutOptions{})
	var ce *Error
	if err == nil {
		t.Fatal("put succeeded")
	}
	// Either the retries ran out, or the allocator ran out of pipelines
	// outside the exclude list first; both must say why.
	if !errors.Is(err, ErrWriteFailed) && !errors.Is(err, ErrPrecondition) || !errors.As(err, &ce) {
		t.Fatalf("err = %v", err)
	}
	if !bytes.Contains([]byte(err.Error()), []byte("disk on fire")) && !bytes.Contains([]byte(err.Error()), []byte("exclud")) {
		t.Fatalf("error does not explain: %v", err)
	}
	if _, err := c.StatKey(context.Background(), "vol", "bkt", "k"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("failed put left a key: %v", err)
	}
}

// TestBufferBound: the data read from the caller but not committed on all
// replicas never exceeds MaxBufferBytes (plus the chunk being filled).
func TestBufferBound(t *testing.T) {
	fc := newFakeCluster(t, 3, 4*tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	fc.onPutBlock = func(*fakeDN, *datanodepb.PutBlockRequest) error {
		time.Sleep(5 * time.Millisecond) // slow commits: the writer must wait
		return nil
	}
	data := randBytes(3, 3*tBlock)
	var consumed int64
	var worst int64
	r := readerFunc(func(p []byte) (int, error) {
		ahead := consumed - int64(fc.committedBytes())
		worst = max(worst, ahead)
		if ahead > tBuf+tChunk {
			return 0, fmt.Errorf("%d bytes read but not committed, bound is %d", ahead, tBuf)
		}
		if consumed >= int64(len(data)) {
			return 0, io.EOF
		}
		n := copy(p, data[consumed:])
		consumed += int64(n)
		return n, nil
	})
	if _, err := c.PutKey(context.Background(), "vol", "bkt", "k", r, PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if worst < tChunk {
		t.Fatalf("writer never ran ahead (worst %d): the test did not test the bound", worst)
	}
	if !bytes.Equal(getAll(t, c, "k"), data) {
		t.Fatal("content differs")
	}
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }

// TestReadFailover: the nearest replica is corrupt, another is down; the
// read succeeds from the third and the corrupt one is reported.
func TestReadFailover(t *testing.T) {
	fc := newFakeCluster(t, 3, tBlock)
	c := testClient(t, fc, nil)
	var mu sync.Mutex
	var reports []CorruptReport
	c.reportCorrupt = func(_ context.Context, r CorruptReport) error {
		mu.Lock()
		reports = append(reports, r)
		mu.Unlock()
		return nil
	}
	setupBucket(t, c)
	data := randBytes(5, tBlock/2)
	if _, err := c.PutKey(context.Background(), "vol", "bkt", "k", bytes.NewReader(data), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	st, err := c.StatKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	reps := st.Blocks[0].Replicas
	if len(reps) != 3 || reps[0].Location != "/dc1/rack1" {
		t.Fatalf("replicas not ordered by distance from /dc1/rack1: %+v", reps)
	}
	// HeadKey: the same metadata and blocks, without replicas.
	hd, err := c.HeadKey(context.Background(), "vol", "bkt", "k")
	if err != nil || hd.Size != st.Size || hd.ObjectID != st.ObjectID || len(hd.Blocks) != len(st.Blocks) ||
		hd.Blocks[0].LocalID != st.Blocks[0].LocalID || len(hd.Blocks[0].Replicas) != 0 {
		t.Fatalf("HeadKey = %+v, %v; StatKey = %+v", hd, err, st)
	}
	bad := fc.dns[reps[0].ID]
	bad.mu.Lock()
	bad.corrupt = true
	bad.mu.Unlock()
	fc.dns[reps[1].ID].stop()
	if got := getAll(t, c, "k"); !bytes.Equal(got, data) {
		t.Fatal("content differs")
	}
	mu.Lock()
	if len(reports) != 1 || reports[0].DatanodeID != reps[0].ID {
		t.Fatalf("reports = %+v, want one for datanode %d", reports, reps[0].ID)
	}
	mu.Unlock()
	// All replicas corrupt or down: a clear error.
	last := fc.dns[reps[2].ID]
	last.mu.Lock()
	last.corrupt = true
	last.mu.Unlock()
	r, err := c.GetKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	_, err = io.Copy(io.Discard, r)
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("all 3 replicas failed")) {
		t.Fatalf("read with no good replica: %v", err)
	}
}

func TestConcurrentPuts(t *testing.T) {
	fc := newFakeCluster(t, 6, tBlock)
	c := testClient(t, fc, nil)
	setupBucket(t, c)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	sums := make([][32]byte, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			data := randBytes(uint64(100+i), tBlock+i*tChunk/3)
			sums[i] = sha256.Sum256(data)
			if _, err := c.PutKey(context.Background(), "vol", "bkt", fmt.Sprint("c", i), bytes.NewReader(data), PutOptions{}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i := range 8 {
		if sha256.Sum256(getAll(t, c, fmt.Sprint("c", i))) != sums[i] {
			t.Fatalf("key c%d differs", i)
		}
	}
}

var _ = metapb.Replication_ONE

func errOf[T any](_ T, err error) error { return err }

func TestOutOfSpaceIsItsOwnError(t *testing.T) {
	err := FromRPC("put key /v/b/k", status.Error(codes.ResourceExhausted, "allocate blocks: out of space: no THREE pipeline has room"))
	if !errors.Is(err, ErrNoSpace) || !errors.Is(err, ErrLimit) {
		t.Fatalf("%v: want ErrNoSpace (an ErrLimit)", err)
	}
	if err := FromRPC("x", status.Error(codes.ResourceExhausted, "too many blocks")); errors.Is(err, ErrNoSpace) || !errors.Is(err, ErrLimit) {
		t.Fatalf("%v: want ErrLimit only", err)
	}
}
