package namespace

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

type fakeRaft struct {
	mu  sync.Mutex
	st  *State
	idx uint64
}

func (f *fakeRaft) Propose(_ context.Context, cmd []byte) (any, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.idx++
	r := f.st.Apply([]store.Entry{{Index: f.idx, Cmd: cmd}})[0]
	if err, ok := r.(error); ok {
		return nil, err
	}
	return r, nil
}
func (f *fakeRaft) ReadBarrier(context.Context) error { return nil }
func (f *fakeRaft) IsLeader() bool                    { return true }

// fakeBlocks is a one-container SCM with three datanodes on two racks.
type fakeBlocks struct {
	mu      sync.Mutex
	next    uint64
	deleted map[uint64]bool
	freed   map[uint64]int // times each block was handed over
}

var fakeDNs = []*metapb.DatanodeDetails{
	{Id: 1, Location: "/dc1/r1"}, {Id: 2, Location: "/dc1/r2"}, {Id: 3, Location: "/dc2/r1"},
}

func (f *fakeBlocks) AllocateBlocks(_ context.Context, req *metapb.AllocateBlocksRequest) (*metapb.AllocateBlocksResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &metapb.AllocateBlocksResponse{BlockSize: 1 << 20}
	for range req.Count {
		f.next++
		resp.Blocks = append(resp.Blocks, &metapb.BlockLocation{Id: &metapb.BlockID{ContainerId: 7, LocalId: f.next}, PipelineId: 1000, Datanodes: fakeDNs})
	}
	return resp, nil
}

func (f *fakeBlocks) DeleteBlocks(_ context.Context, req *metapb.DeleteBlocksRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.deleted == nil {
		f.deleted = map[uint64]bool{}
		f.freed = map[uint64]int{}
	}
	for _, g := range req.Groups {
		for _, id := range g.LocalIds {
			f.deleted[id] = true
			f.freed[id]++
		}
	}
	return nil
}

func (f *fakeBlocks) Locate(id uint64) (*metapb.Container, []*metapb.DatanodeDetails) {
	if id != 7 {
		return nil, nil
	}
	return &metapb.Container{Id: 7, PipelineId: 1000, State: metapb.ContainerState_CONTAINER_OPEN}, fakeDNs
}

type nsEnv struct {
	s   *Service
	st  *State
	fb  *fakeBlocks
	ctx context.Context
	now time.Time
}

func newNS(t testing.TB) *nsEnv {
	t.Helper()
	st, err := Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	e := &nsEnv{st: st, fb: &fakeBlocks{}, ctx: context.Background(), now: time.Unix(1_700_000_000, 0)}
	e.s = NewService(Config{Now: func() time.Time { return e.now }, OpenKeyExpiry: time.Hour, ReclaimBatch: 3}, st, &fakeRaft{st: st}, e.fb)
	return e
}

func wantCode(t *testing.T, err error, c codes.Code, contains string) {
	t.Helper()
	if status.Code(err) != c || !strings.Contains(fmt.Sprint(err), contains) {
		t.Fatalf("got %v, want %v containing %q", err, c, contains)
	}
}

func (e *nsEnv) put(t testing.TB, vol, bkt, key string, size uint64) *metapb.KeyInfo {
	t.Helper()
	o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: vol, Bucket: bkt, Key: key})
	if err != nil {
		t.Fatalf("open %s: %v", key, err)
	}
	ki, err := e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: size}}})
	if err != nil {
		t.Fatalf("commit %s: %v", key, err)
	}
	return ki
}

func TestVolumesAndBuckets(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	if _, err := e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol1", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	_, err := e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol1"})
	wantCode(t, err, codes.AlreadyExists, `"vol1"`)
	_, err = e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "V"})
	wantCode(t, err, codes.InvalidArgument, `"V"`)
	_, err = e.s.GetVolume(ctx, &metapb.GetVolumeRequest{Name: "nope"})
	wantCode(t, err, codes.NotFound, `"nope"`)
	_, err = e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "nope", Name: "bkt"})
	wantCode(t, err, codes.NotFound, `volume "nope"`)
	b, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bkt"})
	if err != nil || b.Layout != metapb.BucketLayout_OBJECT || b.Replication != metapb.Replication_THREE {
		t.Fatalf("bucket %v %v", b, err)
	}
	_, err = e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "bkt"})
	wantCode(t, err, codes.AlreadyExists, `"bkt"`)
	_, err = e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: "192.168.0.1"})
	wantCode(t, err, codes.InvalidArgument, "IP address")
	for i := range 5 {
		if _, err := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol1", Name: fmt.Sprintf("b%02d", i), Replication: metapb.Replication_ONE, Layout: metapb.BucketLayout_FS}); err != nil {
			t.Fatal(err)
		}
	}
	l, err := e.s.ListBuckets(ctx, &metapb.ListBucketsRequest{Volume: "vol1", Prefix: "b0", StartAfter: "b01", PageSize: 2})
	if err != nil || len(l.Buckets) != 2 || l.Buckets[0].Name != "b02" || !l.Truncated {
		t.Fatalf("list buckets: %v %v", l, err)
	}
	_, err = e.s.DeleteVolume(ctx, &metapb.DeleteVolumeRequest{Name: "vol1"})
	wantCode(t, err, codes.FailedPrecondition, "not empty")
	e.put(t, "vol1", "bkt", "k", 1)
	_, err = e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol1", Name: "bkt"})
	wantCode(t, err, codes.FailedPrecondition, `first entry: "k"`)
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol1", Bucket: "bkt", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol1", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s.GetBucket(ctx, &metapb.GetBucketRequest{Volume: "vol1", Name: "bkt"})
	wantCode(t, err, codes.NotFound, `bucket "bkt"`)
	vl, err := e.s.ListVolumes(ctx, &metapb.ListVolumesRequest{})
	if err != nil || len(vl.Volumes) != 1 || vl.Volumes[0].Owner != "alice" {
		t.Fatalf("volumes %v %v", vl, err)
	}
}

func TestKeyLifecycle(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	_, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: strings.Repeat("k", 1025)})
	wantCode(t, err, codes.InvalidArgument, "1025 bytes")
	_, err = e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "nob", Key: "k"})
	wantCode(t, err, codes.NotFound, `bucket "nob"`)

	// Open with a size hint gets several blocks; commit two of three with
	// lengths; the third goes to deletion.
	o, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "a/b", SizeHint: 2 << 20, ClientLocation: "/dc2/r1"})
	if err != nil || len(o.Blocks) != 3 {
		t.Fatalf("open: %v %v", o, err)
	}
	extra, err := e.s.AllocateBlock(ctx, &metapb.AllocateBlockRequest{OpenId: o.OpenId})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 99, LocalId: 1}, Length: 1}}})
	wantCode(t, err, codes.InvalidArgument, "was not allocated")
	ki, err := e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: 1 << 20}, {Id: extra.Block.Id, Length: 5}}})
	if err != nil || ki.Size != 1<<20+5 {
		t.Fatalf("commit: %v %v", ki, err)
	}
	_, err = e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId})
	wantCode(t, err, codes.NotFound, "already committed")

	// Lookup: offsets, lengths and nearest-first replicas in one call.
	got, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "a/b", ClientLocation: "/dc1/r2"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Locations) != 2 || got.Locations[1].Offset != 1<<20 || got.Locations[1].Length != 5 || got.ChecksumType != metapb.ChecksumType_CRC32C || got.BytesPerChecksum != 64<<10 {
		t.Fatalf("lookup: %v", got)
	}
	if d := got.Locations[0].Datanodes; d[0].Id != 2 || d[1].Id != 1 || d[2].Id != 3 {
		t.Fatalf("replicas not nearest-first from /dc1/r2: %v", d)
	}
	// Overwrite: the old key's blocks go to deletion.
	e.put(t, "vol", "bkt", "a/b", 10)
	// Rename and its errors.
	_, err = e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "bkt", Key: "zz", NewKey: "y"})
	wantCode(t, err, codes.NotFound, `"zz"`)
	e.put(t, "vol", "bkt", "c", 1)
	_, err = e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "bkt", Key: "a/b", NewKey: "c"})
	wantCode(t, err, codes.AlreadyExists, `"c"`)
	if _, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "bkt", Key: "a/b", NewKey: "d"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "d"}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "a/b"})
	wantCode(t, err, codes.NotFound, `"a/b"`)
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "d"}); err != nil {
		t.Fatal(err)
	}
	// Expire an open key that is never committed.
	o2, _ := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "never"})
	e.now = e.now.Add(2 * time.Hour)
	if err := e.s.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o2.OpenId})
	wantCode(t, err, codes.NotFound, "expired")
	if err := e.s.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	// Every block but the live key "c"'s went to SCM for deletion: the
	// uncommitted third block, the overwritten and deleted keys' blocks,
	// the expired key's.
	live, _ := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: "c"})
	for id := uint64(1); id <= e.fb.next; id++ {
		if id == live.Blocks[0].Id.LocalId {
			if e.fb.deleted[id] {
				t.Fatalf("live block %d deleted", id)
			}
			continue
		}
		if !e.fb.deleted[id] {
			t.Errorf("block %d not handed to SCM for deletion", id)
		}
	}
	if rows, _ := e.st.DeletedRows(10); len(rows) != 0 {
		t.Fatalf("deleted rows left after purge: %d", len(rows))
	}
}

func TestFsBucket(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "fsb", Layout: metapb.BucketLayout_FS})
	ref := func(p string) *metapb.GetFileStatusRequest {
		return &metapb.GetFileStatusRequest{Volume: "vol", Bucket: "fsb", Path: p}
	}
	if _, err := e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "a/b/c"}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"a", "a/b", "a/b/c"} {
		if st, err := e.s.GetFileStatus(ctx, ref(p)); err != nil || !st.IsDir {
			t.Fatalf("stat %s: %v %v", p, st, err)
		}
	}
	// Files: create with implicit parents; 10 files in a/b/c.
	for i := range 10 {
		e.put(t, "vol", "fsb", fmt.Sprintf("a/b/c/f%d", i), 1)
	}
	e.put(t, "vol", "fsb", "x/y/file", 3)
	_, err := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fsb", Key: "/abs"})
	wantCode(t, err, codes.InvalidArgument, `"/abs"`)
	_, err = e.s.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: "vol", Bucket: "fsb", Path: "x/y/file/sub"})
	wantCode(t, err, codes.FailedPrecondition, `"x/y/file" is a file`)
	o, _ := e.s.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a/b"})
	_, err = e.s.CommitKey(ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId})
	wantCode(t, err, codes.FailedPrecondition, "is a directory")

	l, err := e.s.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb", Path: "a/b/c", StartAfter: "f3", PageSize: 4})
	if err != nil || len(l.Entries) != 4 || l.Entries[0].Path != "a/b/c/f4" || !l.Truncated {
		t.Fatalf("list status: %v %v", l, err)
	}
	root, _ := e.s.ListStatus(ctx, &metapb.ListStatusRequest{Volume: "vol", Bucket: "fsb"})
	if len(root.Entries) != 2 || root.Entries[0].Path != "a" || root.Entries[1].Path != "x" {
		t.Fatalf("root listing %v", root)
	}
	// Atomic directory rename: children follow.
	_, err = e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a/b", NewKey: "a/b/c/inside"})
	wantCode(t, err, codes.InvalidArgument, "into itself")
	_, err = e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a/b", NewKey: "nodir/b"})
	wantCode(t, err, codes.NotFound, `"nodir"`)
	if _, err := e.s.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a/b", NewKey: "x/moved"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "fsb", Key: "x/moved/c/f7"}); err != nil {
		t.Fatalf("child after dir rename: %v", err)
	}
	_, err = e.s.GetFileStatus(ctx, ref("a/b"))
	wantCode(t, err, codes.NotFound, `"a/b"`)
	// Delete: non-empty needs recursive; recursive is one command, the
	// children are reclaimed in bounded steps in the background.
	_, err = e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "x"})
	wantCode(t, err, codes.FailedPrecondition, "not empty")
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "x", Recursive: true}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s.GetFileStatus(ctx, ref("x/moved/c/f1"))
	wantCode(t, err, codes.NotFound, `"x"`)
	for range 20 {
		if err := e.s.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if p, _ := e.st.PendingDirs(10); len(p) != 0 {
		t.Fatalf("pending dirs left: %v", p)
	}
	if len(e.fb.deleted) != 11 {
		t.Fatalf("%d blocks reclaimed, want the 11 files' blocks", len(e.fb.deleted))
	}
	// Only "a" remains, and the bucket is not empty until it goes.
	_, err = e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "fsb"})
	wantCode(t, err, codes.FailedPrecondition, "not empty")
	if _, err := e.s.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "fsb", Key: "a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.DeleteBucket(ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "fsb"}); err != nil {
		t.Fatal(err)
	}
}

// modelList is the specification of ListKeys: every key with the prefix
// becomes either itself or its common prefix; entries strictly after
// start_after, in order, first page_size of them.
func modelList(keys []string, prefix, startAfter, delim string, limit int) (entries []string, truncated bool) {
	set := map[string]bool{}
	for _, k := range keys {
		if !strings.HasPrefix(k, prefix) {
			continue
		}
		e := k
		if delim != "" {
			if i := strings.Index(k[len(prefix):], delim); i >= 0 {
				e = k[:len(prefix)+i+len(delim)] + "\x00cp"
			}
		}
		set[e] = true
	}
	var all []string
	for e := range set {
		if strings.TrimSuffix(e, "\x00cp") > startAfter {
			all = append(all, e)
		}
	}
	sort.Slice(all, func(i, j int) bool {
		return strings.TrimSuffix(all[i], "\x00cp") < strings.TrimSuffix(all[j], "\x00cp")
	})
	if len(all) > limit {
		return all[:limit], true
	}
	return all, false
}

func TestListKeysMatchesModel(t *testing.T) {
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "other"})
	rng := rand.New(rand.NewPCG(9, 9))
	alphabet := []string{"a", "b", "/", "-", "é", "z", "//"}
	randStr := func(n int) string {
		var sb strings.Builder
		for range n {
			sb.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		return sb.String()
	}
	var keys []string
	seen := map[string]bool{}
	for len(keys) < 400 {
		k := randStr(1 + rng.IntN(6))
		if !seen[k] {
			seen[k] = true
			keys = append(keys, k)
			e.put(t, "vol", "bkt", k, 1)
		}
	}
	e.put(t, "vol", "other", "a", 1) // another bucket must never leak in
	for trial := range 1500 {
		prefix := ""
		if rng.IntN(3) > 0 {
			prefix = randStr(rng.IntN(3))
		}
		start := ""
		if rng.IntN(2) == 0 {
			start = randStr(rng.IntN(4))
		}
		delim := []string{"", "/", "-", "b/"}[rng.IntN(4)]
		limit := 1 + rng.IntN(30)
		// Walk all pages and compare each with the model.
		for page := 0; ; page++ {
			resp, err := e.s.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "bkt", Prefix: prefix, StartAfter: start, Delimiter: delim, PageSize: uint32(limit)})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			ki, ci := 0, 0
			for ki < len(resp.Keys) || ci < len(resp.CommonPrefixes) {
				if ci >= len(resp.CommonPrefixes) || ki < len(resp.Keys) && resp.Keys[ki].Name < resp.CommonPrefixes[ci] {
					got = append(got, resp.Keys[ki].Name)
					ki++
				} else {
					got = append(got, resp.CommonPrefixes[ci]+"\x00cp")
					ci++
				}
			}
			want, trunc := modelList(keys, prefix, start, delim, limit)
			if !slices.Equal(got, want) || trunc != resp.Truncated {
				t.Fatalf("trial %d page %d prefix=%q start=%q delim=%q limit=%d:\n got %q trunc=%v\nwant %q trunc=%v", trial, page, prefix, start, delim, limit, got, resp.Truncated, want, trunc)
			}
			if !resp.Truncated {
				break
			}
			start = resp.NextStartAfter
		}
	}
}

// TestListKeysLargeBucket shows a page costs a seek, not a scan: listing
// the top level of a bucket with many keys under few prefixes is fast.
func TestListKeysLargeBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("large")
	}
	e := newNS(t)
	ctx := e.ctx
	e.s.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol"})
	b, _ := e.s.CreateBucket(ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"})
	// Write 200k keys straight into Pebble (through one big batch) to keep
	// the test fast; the layout is the one commit writes.
	batch := e.st.st.NewBatch()
	for i := range 200000 {
		k := fmt.Sprintf("dir%02d/file%07d", i%10, i)
		v, _ := proto.Marshal(&metapb.KeyInfo{Volume: "vol", Bucket: "bkt", Name: k})
		if err := batch.Set(objKey(b.Id, k), v, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.st.st.Commit(batch, 1<<40); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	resp, err := e.s.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "bkt", Delimiter: "/"})
	if err != nil || len(resp.CommonPrefixes) != 10 {
		t.Fatalf("%v %v", resp, err)
	}
	if d := time.Since(start); d > 200*time.Millisecond {
		t.Fatalf("delimiter listing over 200k keys took %v", d)
	}
	resp, err = e.s.ListKeys(ctx, &metapb.ListKeysRequest{Volume: "vol", Bucket: "bkt", Prefix: "dir05/", StartAfter: "dir05/file0100005", PageSize: 3})
	if err != nil || len(resp.Keys) != 3 || resp.Keys[0].Name != "dir05/file0100015" {
		t.Fatalf("%v %v", resp, err)
	}
}
