package namespace

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// recordingRaft is fakeRaft that counts proposals and keeps each command
// (the log, to replay).
type recordingRaft struct {
	*fakeRaft
	mu   sync.Mutex
	cmds [][]byte
}

func (r *recordingRaft) Propose(ctx context.Context, cmd []byte) (any, error) {
	r.mu.Lock()
	r.cmds = append(r.cmds, bytes.Clone(cmd))
	r.mu.Unlock()
	return r.fakeRaft.Propose(ctx, cmd)
}

func (r *recordingRaft) proposals() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.cmds)
}

// countingBlocks counts AllocateBlocks calls and keeps the ExpectedBytes
// each block was allocated with (what SCM charges it by).
type countingBlocks struct {
	*fakeBlocks
	mu       sync.Mutex
	calls    int
	expected map[uint64]uint64 // block local ID → ExpectedBytes of its allocation
}

func (c *countingBlocks) AllocateBlocks(ctx context.Context, req *metapb.AllocateBlocksRequest) (*metapb.AllocateBlocksResponse, error) {
	c.mu.Lock()
	c.calls++
	c.mu.Unlock()
	resp, err := c.fakeBlocks.AllocateBlocks(ctx, req)
	if err == nil {
		c.mu.Lock()
		if c.expected == nil {
			c.expected = map[uint64]uint64{}
		}
		for _, b := range resp.Blocks {
			c.expected[b.GetId().GetLocalId()] = req.ExpectedBytes
		}
		c.mu.Unlock()
	}
	return resp, err
}

// charged is what SCM charges a block allocated with ExpectedBytes
// expected (scm.chargeFor, unexported there).
func charged(expected, blockSize uint64) uint64 {
	if expected == 0 || expected >= blockSize {
		return blockSize
	}
	return (expected + 4095) &^ 4095
}

// chargesOf returns the charge of each block of an open key.
func (c *countingBlocks) chargesOf(o *metapb.OpenKeyResponse) []uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []uint64
	for _, b := range o.GetBlocks() {
		out = append(out, charged(c.expected[b.GetId().GetLocalId()], o.GetBlockSize()))
	}
	return out
}

// TestOpenKeysChargePerKey: each block a batch opens is charged against
// its container what a single OpenKey of that key charges, whatever the
// other keys of the batch hint (before: one ExpectedBytes per group, the
// largest hint or a whole block if any key gave none, so 4 KiB keys
// batched with a 1 MiB key were each charged 1 MiB).
func TestOpenKeysChargePerKey(t *testing.T) {
	e, _, cb := batchEnv(t)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	hints := []uint64{4096, 1 << 20, 0, 5000, 4096, 100, 300 << 10, 1 << 20}
	var reqs []*metapb.OpenKeyRequest
	for i, h := range hints {
		reqs = append(reqs, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: fmt.Sprintf("k%d", i), SizeHint: h})
	}
	ro, err := e.s.OpenKeys(alice, &metapb.OpenKeysRequest{Requests: reqs})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range ro.Results {
		if r.Code != 0 {
			t.Fatalf("key %d: %s", i, r.Message)
		}
		single, err := e.s.OpenKey(alice, proto.Clone(reqs[i]).(*metapb.OpenKeyRequest))
		if err != nil {
			t.Fatal(err)
		}
		got, want := cb.chargesOf(r.Open), cb.chargesOf(single)
		if !slices.Equal(got, want) {
			t.Errorf("key %d (hint %d): blocks charged %v in the batch, %v by a single OpenKey", i, hints[i], got, want)
		}
	}
}

// batchEnv: volume "vol" of alice with her bucket "abkt" and bob's
// bucket "bbkt", key abkt/exists, and a recording Raft.
func batchEnv(t *testing.T) (*nsEnv, *recordingRaft, *countingBlocks) {
	e := newNS(t)
	rr := &recordingRaft{fakeRaft: &fakeRaft{st: e.st}}
	cb := &countingBlocks{fakeBlocks: e.fb}
	e.s.raft, e.s.blocks = rr, cb
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol", Owner: "alice"}); err != nil {
		t.Fatal(err)
	}
	for _, b := range []*metapb.CreateBucketRequest{{Volume: "vol", Name: "abkt", Owner: "alice"}, {Volume: "vol", Name: "bbkt", Owner: "bob"}} {
		if _, err := e.s.CreateBucket(e.ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	e.put(t, "vol", "abkt", "exists", 3)
	return e, rr, cb
}

func openCodes(r *metapb.OpenKeysResponse) []codes.Code {
	out := make([]codes.Code, len(r.Results))
	for i, x := range r.Results {
		out[i] = codes.Code(x.Code)
	}
	return out
}

func commitCodes(r *metapb.CommitKeysResponse) []codes.Code {
	out := make([]codes.Code, len(r.Results))
	for i, x := range r.Results {
		out[i] = codes.Code(x.Code)
	}
	return out
}

func sameCodes(t *testing.T, what string, got, want []codes.Code, msgs func(i int) string) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d results, want %d", what, len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%s: result %d: %v (%s), want %v", what, i, got[i], msgs(i), want[i])
		}
	}
}

// TestWriteBatchesPerKey: one OpenKeys call of alice mixing keys she may
// write, a key of bob's bucket, an invalid key and a missing bucket opens
// exactly the good ones (one SCM call for their blocks, one Raft entry);
// one CommitKeys call mixing good commits, a stale block list, a missing
// open key, a commit listed twice, a failed precondition and bob's open
// key commits exactly the good ones, again in one entry; what failed is
// left as it was (the stale commit's open key commits afterwards).
func TestWriteBatchesPerKey(t *testing.T) {
	e, rr, cb := batchEnv(t)
	// bob's own open key in his bucket (alice may not commit it).
	bob := WithCaller(e.ctx, Caller{User: "bob"})
	bo, err := e.s.OpenKey(bob, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bbkt", Key: "bobs"})
	if err != nil {
		t.Fatal(err)
	}
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	props, allocs := rr.proposals(), cb.calls
	ro, err := e.s.OpenKeys(alice, &metapb.OpenKeysRequest{Requests: []*metapb.OpenKeyRequest{
		{Volume: "vol", Bucket: "abkt", Key: "a", SizeHint: 4096},
		{Volume: "vol", Bucket: "abkt", Key: "b", SizeHint: 4096},
		{Volume: "vol", Bucket: "bbkt", Key: "x", SizeHint: 4096},
		{Volume: "vol", Bucket: "abkt", Key: "", SizeHint: 4096},
		{Volume: "vol", Bucket: "nobkt", Key: "y", SizeHint: 4096},
		nil,
		{Volume: "vol", Bucket: "abkt", Key: "c", SizeHint: 4096},
		{Volume: "vol", Bucket: "abkt", Key: "exists", SizeHint: 100},
	}})
	if err != nil {
		t.Fatal(err)
	}
	sameCodes(t, "OpenKeys", openCodes(ro), []codes.Code{codes.OK, codes.OK, codes.PermissionDenied, codes.InvalidArgument, codes.NotFound, codes.InvalidArgument, codes.OK, codes.OK},
		func(i int) string { return ro.Results[i].Message })
	if n := rr.proposals() - props; n != 1 {
		t.Fatalf("OpenKeys made %d proposals, want 1", n)
	}
	if n := cb.calls - allocs; n != 1 {
		t.Fatalf("OpenKeys made %d AllocateBlocks calls, want 1 (same replication, location, exclude list)", n)
	}
	ids := map[uint64]bool{}
	for _, i := range []int{0, 1, 6, 7} {
		o := ro.Results[i].Open
		if o == nil || len(o.Blocks) != 1 || ids[o.OpenId] {
			t.Fatalf("open %d: %v", i, o)
		}
		ids[o.OpenId] = true
		if _, err := e.st.OpenKey(o.OpenId); err != nil {
			t.Fatalf("open %d not recorded: %v", i, err)
		}
	}
	a, b, c, ex := ro.Results[0].Open, ro.Results[1].Open, ro.Results[6].Open, ro.Results[7].Open
	blk := func(o *metapb.OpenKeyResponse, n uint64) []*metapb.KeyBlock {
		return []*metapb.KeyBlock{{Id: o.Blocks[0].Id, Length: n}}
	}
	props = rr.proposals()
	rc, err := e.s.CommitKeys(alice, &metapb.CommitKeysRequest{Requests: []*metapb.CommitKeyRequest{
		{OpenId: a.OpenId, Blocks: blk(a, 10)},
		{OpenId: b.OpenId, Blocks: blk(c, 20)}, // c's block: not b's
		{OpenId: 999_999, Blocks: blk(a, 1)},
		{OpenId: ex.OpenId, Blocks: blk(ex, 5), Precondition: &metapb.KeyPrecondition{ExpectAbsent: true}},
		{OpenId: bo.OpenId, Blocks: blk(bo, 7)},
		{OpenId: c.OpenId, Blocks: blk(c, 30)},
		{OpenId: a.OpenId, Blocks: blk(a, 11)}, // a again: consumed above
	}})
	if err != nil {
		t.Fatal(err)
	}
	sameCodes(t, "CommitKeys", commitCodes(rc), []codes.Code{codes.OK, codes.InvalidArgument, codes.NotFound, codes.FailedPrecondition, codes.PermissionDenied, codes.OK, codes.NotFound},
		func(i int) string { return rc.Results[i].Message })
	if n := rr.proposals() - props; n != 1 {
		t.Fatalf("CommitKeys made %d proposals, want 1", n)
	}
	if rc.Results[0].Key.GetSize() != 10 || rc.Results[5].Key.GetSize() != 30 {
		t.Fatalf("committed sizes %d, %d; want 10, 30", rc.Results[0].Key.GetSize(), rc.Results[5].Key.GetSize())
	}
	if !strings.Contains(rc.Results[3].Message, "exists") || len(rc.Results[3].Status) == 0 {
		t.Fatalf("precondition failure: %q, status %d bytes", rc.Results[3].Message, len(rc.Results[3].Status))
	}
	for key, size := range map[string]uint64{"a": 10, "c": 30, "exists": 3} {
		ki, err := e.st.LookupKey("vol", "abkt", key)
		if err != nil || ki.Size != size {
			t.Fatalf("key %s: %v, size %d, want %d", key, err, ki.GetSize(), size)
		}
	}
	if _, err := e.st.LookupKey("vol", "abkt", "b"); err == nil {
		t.Fatal("b committed with another key's block")
	}
	// What failed is untouched: b's open key commits with its own block,
	// bob commits his own key.
	if _, err := e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: b.OpenId, Blocks: blk(b, 20)}); err != nil {
		t.Fatalf("b after the batch: %v", err)
	}
	if _, err := e.s.CommitKey(bob, &metapb.CommitKeyRequest{OpenId: bo.OpenId, Blocks: blk(bo, 7)}); err != nil {
		t.Fatalf("bob's key after the batch: %v", err)
	}
}

// TestWriteBatchBounds: too many keys or bytes in one call fail the call
// before anything is proposed; an entry over the bound (never proposed by
// this code) fails as a whole in apply, deterministically.
func TestWriteBatchBounds(t *testing.T) {
	e, rr, _ := batchEnv(t)
	props := rr.proposals()
	_, err := e.s.OpenKeys(e.ctx, &metapb.OpenKeysRequest{Requests: make([]*metapb.OpenKeyRequest, MaxWriteBatch+1)})
	wantCode(t, err, codes.InvalidArgument, "at most")
	_, err = e.s.CommitKeys(e.ctx, &metapb.CommitKeysRequest{Requests: make([]*metapb.CommitKeyRequest, MaxWriteBatch+1)})
	wantCode(t, err, codes.InvalidArgument, "at most")
	big := &metapb.CommitKeyRequest{OpenId: 1, Meta: &metapb.ObjectMeta{ContentType: strings.Repeat("x", 16<<10)}}
	reqs := make([]*metapb.CommitKeyRequest, 200)
	for i := range reqs {
		reqs[i] = big
	}
	_, err = e.s.CommitKeys(e.ctx, &metapb.CommitKeysRequest{Requests: reqs})
	wantCode(t, err, codes.InvalidArgument, "bytes")
	if n := rr.proposals() - props; n != 0 {
		t.Fatalf("%d proposals for refused batches", n)
	}
	cmd, _ := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_CommitKeys{CommitKeys: &metapb.CommitKeysOp{Commits: make([]*metapb.CommitKeyRequest, MaxWriteBatch+1)}}})
	if res, err := rr.Propose(e.ctx, cmd); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("oversized entry applied with %v, %v", res, err)
	}
}

// dump is every row of st, in order.
func dump(t *testing.T, st *State) string {
	var b strings.Builder
	err := st.Store().View(func(r pebble.Reader) error {
		it, err := r.NewIter(nil)
		if err != nil {
			return err
		}
		defer it.Close()
		for it.First(); it.Valid(); it.Next() {
			fmt.Fprintf(&b, "%x=%x\n", it.Key(), it.Value())
		}
		return it.Error()
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func resultString(r any) string {
	switch v := r.(type) {
	case []any:
		var parts []string
		for _, x := range v {
			parts = append(parts, resultString(x))
		}
		return "[" + strings.Join(parts, " | ") + "]"
	case proto.Message:
		return prototext.Format(v)
	default:
		return fmt.Sprint(v)
	}
}

// TestWriteBatchReplay: the log of a run of batched opens and commits
// (with refused keys, keys committed twice, a key overwritten within one
// entry) replayed on a fresh replica, in one Apply call and one entry per
// call, gives the same results and the same state, row for row.
func TestWriteBatchReplay(t *testing.T) {
	e, rr, _ := batchEnv(t)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	for round := range 4 {
		var reqs []*metapb.OpenKeyRequest
		for i := range 12 {
			bkt := "abkt"
			if i%5 == 4 {
				bkt = "bbkt" // refused
			}
			reqs = append(reqs, &metapb.OpenKeyRequest{Volume: "vol", Bucket: bkt, Key: fmt.Sprintf("k%d", (round*7+i)%15), SizeHint: 100})
		}
		ro, err := e.s.OpenKeys(alice, &metapb.OpenKeysRequest{Requests: reqs})
		if err != nil {
			t.Fatal(err)
		}
		var commits []*metapb.CommitKeyRequest
		for i, r := range ro.Results {
			if r.Open == nil {
				continue
			}
			c := &metapb.CommitKeyRequest{OpenId: r.Open.OpenId, Blocks: []*metapb.KeyBlock{{Id: r.Open.Blocks[0].Id, Length: uint64(round*100 + i)}}}
			commits = append(commits, c)
			if i%3 == 0 {
				commits = append(commits, c) // twice: the second fails
			}
			if i%4 == 1 {
				c.Precondition = &metapb.KeyPrecondition{ExpectAbsent: true}
			}
		}
		if _, err := e.s.CommitKeys(alice, &metapb.CommitKeysRequest{Requests: commits}); err != nil {
			t.Fatal(err)
		}
	}
	// The original results: apply the log again on fresh replicas.
	rr.mu.Lock()
	cmds := slicesClone(rr.cmds)
	rr.mu.Unlock()
	replay := func(oneApply bool) (string, []string) {
		st, err := Open(t.TempDir(), store.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var res []string
		if oneApply {
			var ents []store.Entry
			for i, c := range cmds {
				ents = append(ents, store.Entry{Index: uint64(i + 1), Cmd: c})
			}
			for _, r := range st.Apply(ents) {
				res = append(res, resultString(r))
			}
		} else {
			for i, c := range cmds {
				res = append(res, resultString(st.Apply([]store.Entry{{Index: uint64(i + 1), Cmd: c}})[0]))
			}
		}
		return dump(t, st), res
	}
	d1, r1 := replay(false)
	d2, r2 := replay(true)
	if d1 != d2 {
		t.Fatal("replay in one Apply call left another state than one entry per call")
	}
	if strings.Join(r1, "\n") != strings.Join(r2, "\n") {
		t.Fatalf("replays gave different results:\n%s\n----\n%s", strings.Join(r1, "\n"), strings.Join(r2, "\n"))
	}
	if !strings.Contains(strings.Join(r1, "\n"), "not found") || !strings.Contains(strings.Join(r1, "\n"), "size:") {
		t.Fatalf("the log has no failed and no committed keys:\n%s", strings.Join(r1, "\n"))
	}
	// And the replica that ran them holds the same rows as the replays
	// (batchEnv recorded every command from the first, at the same
	// indexes).
	if dump(t, e.st) != d1 {
		t.Fatal("the replayed state differs from the replica's that proposed the log")
	}
}

func slicesClone(in [][]byte) [][]byte {
	out := make([][]byte, len(in))
	copy(out, in)
	return out
}

// FuzzApplyWriteBatch: whatever OpenKeysOp or CommitKeysOp an entry
// carries (decoded from arbitrary bytes), apply returns results and
// never panics, and applying it twice on two replicas (one with the apply
// cache, one without) gives one state.
func FuzzApplyWriteBatch(f *testing.F) {
	seed := func(m proto.Message) { b, _ := proto.Marshal(m); f.Add(b, true); f.Add(b, false) }
	seed(&metapb.OpenKeysOp{Opens: []*metapb.OpenKeyOp{{Request: &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: "a"}, Blocks: []*metapb.BlockLocation{{Id: &metapb.BlockID{ContainerId: 7, LocalId: 1}}}}, nil, {}}})
	seed(&metapb.CommitKeysOp{Commits: []*metapb.CommitKeyRequest{{OpenId: 1, Blocks: []*metapb.KeyBlock{{Id: &metapb.BlockID{ContainerId: 7, LocalId: 1}, Length: 3}, {}}}, nil, {OpenId: 1, Part: &metapb.PartRef{UploadId: "u", PartNumber: 1}}}})
	f.Fuzz(func(t *testing.T, b []byte, open bool) {
		cmd := &metapb.NsCommand{NowUnixMs: 1}
		if open {
			op := &metapb.OpenKeysOp{}
			if proto.Unmarshal(b, op) != nil {
				return
			}
			cmd.Op = &metapb.NsCommand_OpenKeys{OpenKeys: op}
		} else {
			op := &metapb.CommitKeysOp{}
			if proto.Unmarshal(b, op) != nil {
				return
			}
			cmd.Op = &metapb.NsCommand_CommitKeys{CommitKeys: op}
		}
		enc, err := proto.Marshal(cmd)
		if err != nil {
			return
		}
		var dumps, results []string
		for i := range 2 {
			st, err := Open(t.TempDir(), store.Options{})
			if err != nil {
				t.Fatal(err)
			}
			st.applied.off = i == 1 // and with the apply cache as without
			setup, _ := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_CreateVolume{CreateVolume: &metapb.CreateVolumeRequest{Name: "vol"}}})
			setup2, _ := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_CreateBucket{CreateBucket: &metapb.CreateBucketRequest{Volume: "vol", Name: "abkt"}}})
			setup3, _ := proto.Marshal(&metapb.NsCommand{Op: &metapb.NsCommand_OpenKeys{OpenKeys: &metapb.OpenKeysOp{Opens: []*metapb.OpenKeyOp{{Request: &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: "a"}, Blocks: []*metapb.BlockLocation{{Id: &metapb.BlockID{ContainerId: 7, LocalId: 1}}}}}}}})
			st.Apply([]store.Entry{{Index: 1, Cmd: setup}, {Index: 2, Cmd: setup2}, {Index: 3, Cmd: setup3}})
			r := st.Apply([]store.Entry{{Index: 4, Cmd: enc}})
			dumps = append(dumps, dump(t, st))
			results = append(results, resultString(r[0]))
			st.Close()
		}
		if dumps[0] != dumps[1] {
			t.Fatal("two replicas applied one entry into different states")
		}
		if results[0] != results[1] {
			t.Fatalf("two replicas applied one entry with different results:\n%s\n----\n%s", results[0], results[1])
		}
	})
}

// TestOpenKeysBlocksBounded: a full OpenKeys call of keys whose size
// hints each ask for the most blocks up front allocates and answers at
// most MaxOpenKeysBlocks blocks, with a bounded number of SCM calls and an
// answer well under a client's 4 MiB receive limit; the keys first in the
// request get their blocks up front as OpenKey would, the others their
// first block only, and every key opens.
func TestOpenKeysBlocksBounded(t *testing.T) {
	e, _, cb := batchEnv(t)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	req := &metapb.OpenKeysRequest{}
	for i := range MaxWriteBatch {
		req.Requests = append(req.Requests, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: fmt.Sprintf("big%d", i), SizeHint: 64 << 20})
	}
	allocs := cb.calls
	resp, err := e.s.OpenKeys(alice, req)
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for i, r := range resp.Results {
		if r.Code != 0 {
			t.Fatalf("key %d: %s", i, r.Message)
		}
		n := len(r.Open.Blocks)
		total += n
		if n < 1 || n > MaxOpenBlocks {
			t.Fatalf("key %d: %d blocks", i, n)
		}
		if i == 0 && n != MaxOpenBlocks {
			t.Fatalf("the first key got %d blocks up front, want %d as OpenKey gives", n, MaxOpenBlocks)
		}
	}
	if total > MaxOpenKeysBlocks {
		t.Fatalf("one OpenKeys call allocated %d blocks, bound %d", total, MaxOpenKeysBlocks)
	}
	// First blocks: MaxWriteBatch/allocChunk calls; extras: at most
	// (MaxOpenKeysBlocks-MaxWriteBatch)/allocChunk, plus one per group
	// left partly filled by a key's blocks not fitting.
	if n, most := cb.calls-allocs, MaxWriteBatch/allocChunk+2*(MaxOpenKeysBlocks-MaxWriteBatch)/allocChunk; n > most {
		t.Fatalf("%d AllocateBlocks calls for one OpenKeys call, want at most %d", n, most)
	}
	if sz := proto.Size(resp); sz > maxOpenKeysAnswerBytes {
		t.Fatalf("OpenKeys answer of %d bytes, bound %d", sz, maxOpenKeysAnswerBytes)
	}
}
