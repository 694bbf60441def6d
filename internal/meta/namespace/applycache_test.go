package namespace

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// TestApplyCacheSmallPut: a small PUT's apply reads its bucket row (open
// and commit) and its open-key row (commit) from the apply cache, not
// from Pebble.
func TestApplyCacheSmallPut(t *testing.T) {
	e := newNS(t)
	if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		before := e.st.applied.hits
		e.put(t, "vol", "bkt", "k", uint64(i+1))
		if got := e.st.applied.hits - before; got != 3 {
			t.Fatalf("put %d: %d reads from the apply cache, want 3 (bucket at open and commit, open-key row at commit)", i, got)
		}
	}
	if n := len(e.st.applied.opens); n != 0 {
		t.Fatalf("%d open-key rows cached after their commits, want 0", n)
	}
}

// TestApplyCacheMatchesPebble runs what changes cached rows between the
// reads of a small PUT (a bucket's ACL and policy changed, a bucket
// deleted and re-created under its name while a key in it is open, an
// open key given another block, expired, committed twice), then replays
// the log on fresh replicas with the apply cache on and off: the results
// and the rows must be the same as the original's. A cache that missed
// one write returns another bucket ID, block list or open key than
// Pebble, and the results differ.
func TestApplyCacheMatchesPebble(t *testing.T) {
	e, rr, _ := batchEnv(t)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	open := func(bkt, key string) *metapb.OpenKeyResponse {
		t.Helper()
		o, err := e.s.OpenKey(e.ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: bkt, Key: key})
		must(err)
		return o
	}
	commit := func(o *metapb.OpenKeyResponse, ids ...*metapb.BlockID) error {
		var kb []*metapb.KeyBlock
		for _, id := range ids {
			kb = append(kb, &metapb.KeyBlock{Id: id, Length: 7})
		}
		_, err := e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: kb})
		return err
	}
	// A bucket re-created under its name while a key in it is open: the
	// commit must see the new bucket ID.
	o1 := open("bbkt", "x")
	_, err := e.s.DeleteBucket(e.ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "bbkt"})
	must(err)
	_, err = e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bbkt", Owner: "bob"})
	must(err)
	wantCode(t, commit(o1, o1.Blocks[0].Id), 5, "was deleted while key")
	// The bucket's row changed (ACL with WORLD, then public ACLs
	// blocked): a commit with a public ACL is refused only after.
	o2 := open("abkt", "y")
	_, err = e.s.SetPublicAccessBlock(alice, &metapb.PublicAccessBlockConfig{Volume: "vol", Bucket: "abkt", Config: &metapb.PublicAccessBlock{BlockPublicAcls: true}})
	must(err)
	_, err = e.s.CommitKey(e.ctx, &metapb.CommitKeyRequest{OpenId: o2.OpenId, Blocks: []*metapb.KeyBlock{{Id: o2.Blocks[0].Id, Length: 1}},
		Acls: []*metapb.Acl{{Type: metapb.AclType_ACL_WORLD, Rights: uint32(metapb.AclRight_ACL_READ)}}})
	wantCode(t, err, 7, "Block Public Access")
	// An open key given a second block commits with both.
	o3 := open("abkt", "z")
	ab, err := e.s.AllocateBlock(e.ctx, &metapb.AllocateBlockRequest{OpenId: o3.OpenId})
	must(err)
	must(commit(o3, o3.Blocks[0].Id, ab.Block.Id))
	wantCode(t, commit(o3, o3.Blocks[0].Id), 5, "not found")
	// An expired open key cannot commit.
	o4 := open("abkt", "w")
	e.now = e.now.Add(2 * time.Hour)
	must(e.s.RunOnce(e.ctx))
	wantCode(t, commit(o4, o4.Blocks[0].Id), 5, "not found")
	e.put(t, "vol", "abkt", "z", 9)

	rr.mu.Lock()
	cmds := slicesClone(rr.cmds)
	rr.mu.Unlock()
	replay := func(off, oneApply bool) (string, string) {
		st, err := Open(t.TempDir(), store.Options{})
		must(err)
		defer st.Close()
		st.applied.off = off
		var ents []store.Entry
		for i, c := range cmds {
			ents = append(ents, store.Entry{Index: uint64(i + 1), Cmd: c})
		}
		var res []string
		if oneApply {
			for _, r := range st.Apply(ents) {
				res = append(res, resultString(r))
			}
		} else {
			for _, en := range ents {
				res = append(res, resultString(st.Apply([]store.Entry{en})[0]))
			}
		}
		return dump(t, st), strings.Join(res, "\n")
	}
	dOff, rOff := replay(true, false)
	if dOff != dump(t, e.st) {
		t.Fatal("the replica's rows differ from a replay without the apply cache")
	}
	for _, one := range []bool{false, true} {
		d, r := replay(false, one)
		if d != dOff || r != rOff {
			t.Fatalf("replay with the apply cache (one Apply call: %v) differs from one without:\n%s\n----\n%s", one, r, rOff)
		}
	}
}

// TestApplyCacheRestore: a replica that cached a bucket row, then installs
// a snapshot where the bucket was deleted and re-created (another ID),
// writes its next keys into the snapshot's bucket.
func TestApplyCacheRestore(t *testing.T) {
	a, b := newNS(t), newNS(t)
	for _, e := range []*nsEnv{a, b} {
		if _, err := e.s.CreateVolume(e.ctx, &metapb.CreateVolumeRequest{Name: "vol"}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.s.CreateBucket(e.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
			t.Fatal(err)
		}
		e.put(t, "vol", "bkt", "k", 1) // b caches the bucket row
	}
	if _, err := a.s.DeleteKey(a.ctx, &metapb.DeleteKeyRequest{Volume: "vol", Bucket: "bkt", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.s.DeleteBucket(a.ctx, &metapb.DeleteBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.s.CreateBucket(a.ctx, &metapb.CreateBucketRequest{Volume: "vol", Name: "bkt"}); err != nil {
		t.Fatal(err)
	}
	idx, rc, err := a.st.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(rc); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if err := b.st.Restore(idx, &buf); err != nil {
		t.Fatal(err)
	}
	b.s.raft.(*fakeRaft).idx = idx
	b.put(t, "vol", "bkt", "new", 4)
	b.wantSize(t, "bkt", "new", 4, "after restore")
	b.wantMissing(t, "bkt", "k", "after restore")
}

// TestOpenEntriesCarryIDs: the log entries of OpenKey, OpenKeys and
// AllocateBlock record the blocks' IDs, not their locations (the
// replicas' addresses), nor what only steered the allocation (size hint,
// client location, exclude list); the keys still commit with their blocks.
func TestOpenEntriesCarryIDs(t *testing.T) {
	e, rr, _ := batchEnv(t)
	alice := WithCaller(e.ctx, Caller{User: "alice"})
	req := &metapb.OpenKeyRequest{Volume: "vol", Bucket: "abkt", Key: "one", SizeHint: 3 << 20, ClientLocation: "/dc1/r1",
		Exclude: &metapb.ExcludeList{Datanodes: []uint64{99}}}
	o, err := e.s.OpenKey(alice, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(o.Blocks) < 2 || len(o.Blocks[0].Datanodes) == 0 {
		t.Fatalf("open answered %d blocks (first with %d datanodes), want several with locations", len(o.Blocks), len(o.Blocks[0].Datanodes))
	}
	ab, err := e.s.AllocateBlock(alice, &metapb.AllocateBlockRequest{OpenId: o.OpenId})
	if err != nil {
		t.Fatal(err)
	}
	req2 := proto.Clone(req).(*metapb.OpenKeyRequest)
	req2.Key = "two"
	ro, err := e.s.OpenKeys(alice, &metapb.OpenKeysRequest{Requests: []*metapb.OpenKeyRequest{req2}})
	if err != nil || ro.Results[0].Open == nil {
		t.Fatalf("OpenKeys: %v %v", err, ro)
	}
	n := 0
	checkOpen := func(op *metapb.OpenKeyOp) {
		n++
		r := op.Request
		if r.SizeHint != 0 || r.ClientLocation != "" || r.Exclude != nil || r.Volume != "vol" || r.Replication == metapb.Replication_REPLICATION_UNSPECIFIED {
			t.Fatalf("open entry's request: %v", r)
		}
		for _, b := range op.Blocks {
			if b.Id == nil || !proto.Equal(b, &metapb.BlockLocation{Id: b.Id}) {
				t.Fatalf("open entry's block: %v, want its ID only", b)
			}
		}
	}
	rr.mu.Lock()
	for _, c := range rr.cmds {
		cmd := &metapb.NsCommand{}
		if err := proto.Unmarshal(c, cmd); err != nil {
			t.Fatal(err)
		}
		switch op := cmd.Op.(type) {
		case *metapb.NsCommand_OpenKey:
			checkOpen(op.OpenKey)
		case *metapb.NsCommand_OpenKeys:
			for _, o := range op.OpenKeys.Opens {
				checkOpen(o)
			}
		case *metapb.NsCommand_AddBlock:
			n++
			if !proto.Equal(op.AddBlock.Block, &metapb.BlockLocation{Id: ab.Block.Id}) {
				t.Fatalf("AddBlock entry's block: %v, want its ID only", op.AddBlock.Block)
			}
		}
	}
	rr.mu.Unlock()
	if n < 4 {
		t.Fatalf("%d open and add-block entries seen, want 4", n)
	}
	var kb []*metapb.KeyBlock
	for _, b := range append(o.Blocks, ab.Block) {
		kb = append(kb, &metapb.KeyBlock{Id: b.Id, Length: 1})
	}
	if _, err := e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: o.OpenId, Blocks: kb}); err != nil {
		t.Fatal(err)
	}
	o2 := ro.Results[0].Open
	if _, err := e.s.CommitKey(alice, &metapb.CommitKeyRequest{OpenId: o2.OpenId, Blocks: []*metapb.KeyBlock{{Id: o2.Blocks[0].Id, Length: 1}}}); err != nil {
		t.Fatal(err)
	}
}

// The apply cache is bounded in bytes, not rows: open-key rows with long
// names and many blocks (a review measured 90 MiB of heap for 64 Ki rows
// of 1 KiB names under a count bound) stay within their table's bound,
// the count stays exact through overwrites and deletes, and a row too
// large to share the table is not cached at all.
func TestApplyCacheBoundedBytes(t *testing.T) {
	var c applyCache
	sum := func() int {
		n := 0
		for k, v := range c.opens {
			n += applyCacheEntryBytes(k, v)
		}
		return n
	}
	name := strings.Repeat("n", 1024)
	val := make([]byte, 1500)
	peak := 0
	for i := range 200_000 {
		k := append(append([]byte(nil), pfxOpen...), fmt.Sprintf("%s/%d", name, i)...)
		c.set(k, val)
		if i%3 == 0 { // overwritten (AddBlock) and sometimes deleted (commit)
			c.set(k, make([]byte, 2000))
		}
		if i%5 == 0 {
			c.del(k)
		}
		if c.obytes > maxApplyCachedOpenBytes {
			t.Fatalf("after %d rows: %d bytes cached, bound %d", i, c.obytes, maxApplyCachedOpenBytes)
		}
		peak = max(peak, c.obytes)
		if i%9973 == 0 {
			if got := sum(); got != c.obytes {
				t.Fatalf("after %d rows: counted %d bytes, the table holds %d", i, c.obytes, got)
			}
		}
	}
	if peak < maxApplyCachedOpenBytes/2 {
		t.Fatalf("peak %d bytes: the table never filled (bound %d)", peak, maxApplyCachedOpenBytes)
	}
	big := append(append([]byte(nil), pfxOpen...), "big"...)
	c.set(big, make([]byte, maxApplyCachedOpenBytes/8))
	if _, ok := c.get(big); ok {
		t.Fatal("a row of an eighth of the bound was cached")
	}
	if got := sum(); got != c.obytes {
		t.Fatalf("counted %d bytes, the table holds %d", c.obytes, got)
	}
	// A bucket row that grows past the bound replaces its cached copy by
	// nothing (a stale smaller row must not stay).
	bk := append(append([]byte(nil), pfxBucket...), "v\x00b"...)
	c.set(bk, []byte("small"))
	c.set(bk, make([]byte, maxApplyCachedBucketBytes/8))
	if v, ok := c.get(bk); ok {
		t.Fatalf("bucket row: stale or oversized copy cached (%d bytes)", len(v))
	}
	c.reset()
	if c.obytes != 0 || c.bbytes != 0 {
		t.Fatalf("reset left %d/%d bytes counted", c.obytes, c.bbytes)
	}
}
