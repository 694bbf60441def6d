package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
)

// The client-wide cache of local block files (client/shortcircuit_cache.go).

// scReadAll reads key k with a new reader of cl: WriteTo (the mapped path)
// or ReadAt (copies from the mapping).
func scReadAll(t *testing.T, cl *client.Client, k string, n int, writeTo bool) []byte {
	t.Helper()
	r, err := cl.GetKey(context.Background(), "vol", "bkt", k)
	if err != nil {
		t.Error(err)
		return nil
	}
	defer r.Close()
	if writeTo {
		var b bytes.Buffer
		if _, err := r.WriteTo(&b); err != nil {
			t.Error(err)
		}
		return b.Bytes()
	}
	p := make([]byte, n)
	if _, err := r.ReadAt(p, 0); err != nil && err != io.EOF {
		t.Error(err)
	}
	return p
}

// blockMappings counts the mappings of block files under dir in this
// process.
func blockMappings(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, dir) && strings.Contains(l, ".block") {
			n++
		}
	}
	return n
}

// TestShortCircuitCacheReuse: readers of one client after the first get
// the block files from the client's cache (the datanodes pass each file
// once), also many readers at once (run with -race); the data is right;
// closing the client unmaps every file. Without the cache each reader
// fetched and mapped every block again.
func TestShortCircuitCacheReuse(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(31, 10<<20+4321) // three blocks of 4 MiB
	put(t, cl, "k", data)
	reader, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(),
		Location: "/dc1/rack1", RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	served0, _, _ := scServed(c)
	for i := range 4 {
		if got := scReadAll(t, reader, "k", len(data), i%2 == 0); !bytes.Equal(got, data) {
			t.Fatalf("read %d: wrong data", i)
		}
	}
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if got := scReadAll(t, reader, "k", len(data), i%2 == 0); !bytes.Equal(got, data) {
				t.Errorf("concurrent read %d: wrong data", i)
			}
		}()
	}
	wg.Wait()
	st, cs := reader.ShortCircuitBlockStats(), reader.ShortCircuitCacheStats()
	served, _, _ := scServed(c)
	if st.Opened != 3 || served-served0 != 3 || cs.Files != 3 || cs.Hits < 27 || st.Fallbacks != 0 || st.Bytes != 10*uint64(len(data)) {
		t.Fatalf("10 readers: client %+v, cache %+v, datanodes passed %d files: want 3 files passed once, every byte from them",
			st, cs, served-served0)
	}
	if n := blockMappings(t, dir); n != 3 {
		t.Fatalf("%d block files mapped with 3 cached, want 3", n)
	}
	reader.Close()
	if n := blockMappings(t, dir); n != 0 {
		t.Fatalf("%d block files still mapped after Close", n)
	}
}

// TestShortCircuitCacheBounds: the cache keeps at most its number of
// files and mapped bytes (least recently used go first), and drops files
// unused for its idle time; what it drops is unmapped (no reader holds
// it).
func TestShortCircuitCacheBounds(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(32, 12<<20) // three blocks of 4 MiB
	put(t, cl, "k", data)

	byCount := newClient(t, c, "/dc1/rack1")
	byCount.SetShortCircuitCacheLimitsForTest(2, 0, time.Hour)
	if got := scReadAll(t, byCount, "k", len(data), true); !bytes.Equal(got, data) {
		t.Fatal("wrong data")
	}
	if cs := byCount.ShortCircuitCacheStats(); cs.Files != 2 || cs.Evicted != 1 || cs.MappedBytes != 8<<20 {
		t.Fatalf("at most 2 files: %+v", cs)
	}
	if n := blockMappings(t, dir); n != 2 {
		t.Fatalf("%d block files mapped, want the 2 cached", n)
	}
	byCount.Close()

	byBytes := newClient(t, c, "/dc1/rack1")
	byBytes.SetShortCircuitCacheLimitsForTest(100, 9<<20, time.Hour)
	if got := scReadAll(t, byBytes, "k", len(data), false); !bytes.Equal(got, data) {
		t.Fatal("wrong data")
	}
	if cs := byBytes.ShortCircuitCacheStats(); cs.Files != 2 || cs.MappedBytes > 9<<20 {
		t.Fatalf("at most 9 MiB mapped: %+v", cs)
	}
	byBytes.Close()

	idle := newClient(t, c, "/dc1/rack1")
	idle.SetShortCircuitCacheLimitsForTest(0, 0, 300*time.Millisecond)
	if got := scReadAll(t, idle, "k", len(data), true); !bytes.Equal(got, data) {
		t.Fatal("wrong data")
	}
	deadline := time.Now().Add(20 * time.Second)
	for idle.ShortCircuitCacheStats().Files != 0 || blockMappings(t, dir) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("idle files not dropped: %+v, %d mapped", idle.ShortCircuitCacheStats(), blockMappings(t, dir))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// And the next reader fetches them again.
	if got := scReadAll(t, idle, "k", len(data), true); !bytes.Equal(got, data) {
		t.Fatal("wrong data after expiry")
	}
	if st := idle.ShortCircuitBlockStats(); st.Opened != 6 {
		t.Fatalf("after expiry: %+v, want the 3 files fetched again", st)
	}
}

// TestShortCircuitCacheStaleFile: a cached block file the datanode no
// longer has (unlinked: its block deleted, or its file replaced, as an
// imported or re-replicated container does) is not used again: the next
// reader fetches the current file. And a cached mapping whose bytes no
// longer match their checksums is dropped and the range read correctly
// elsewhere, without the cache's stale mapping being taken for proof of
// a corrupt replica.
func TestShortCircuitCacheStaleFile(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(33, 3<<20) // one block
	put(t, cl, "k", data)
	reader := newClient(t, c, "/dc1/rack1")
	if got := scReadAll(t, reader, "k", len(data), true); !bytes.Equal(got, data) {
		t.Fatal("wrong data")
	}
	r, err := reader.GetKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	b := r.Info().Blocks[0]
	r.Close()
	// Replace the files (same bytes, new inodes): the old ones are
	// unlinked.
	for i := range 3 {
		path := blockFile(dir, i, b.ContainerID, b.LocalID)
		old, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path+".new", old, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".new", path); err != nil {
			t.Fatal(err)
		}
	}
	before := reader.ShortCircuitBlockStats()
	if got := scReadAll(t, reader, "k", len(data), false); !bytes.Equal(got, data) {
		t.Fatal("wrong data after the file was replaced")
	}
	st, cs := reader.ShortCircuitBlockStats(), reader.ShortCircuitCacheStats()
	if st.Opened != before.Opened+1 || cs.Invalidated != 1 || cs.Files != 1 {
		t.Fatalf("after the file was replaced: %+v, cache %+v: want the unlinked file dropped and the new one fetched", st, cs)
	}

	// Flip a byte of the cached file in place.
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	path := ""
	for i := range 3 {
		if p := blockFile(dir, i, b.ContainerID, b.LocalID); strings.Contains(string(maps), p+"\n") {
			path = p
		}
	}
	if path == "" {
		t.Fatal("no block file mapped")
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	one := []byte{0}
	if _, err := f.ReadAt(one, 1<<20+9); err != nil {
		t.Fatal(err)
	}
	one[0] ^= 0x20
	if _, err := f.WriteAt(one, 1<<20+9); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for i, writeTo := range []bool{true, false} {
		if got := scReadAll(t, reader, "k", len(data), writeTo); !bytes.Equal(got, data) {
			t.Fatalf("read %d with a damaged cached file: wrong data", i)
		}
	}
	if cs := reader.ShortCircuitCacheStats(); cs.Invalidated < 2 {
		t.Fatalf("damaged cached file: cache %+v, want it dropped", cs)
	}
}

// blockFDs counts this process's descriptors of block files under dir
// (deleted ones too).
func blockFDs(t *testing.T, dir string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.Contains(l, dir) && strings.Contains(l, ".block") {
			n++
		}
	}
	return n
}

// TestShortCircuitCacheDeletedBlock: a cached block file its datanode
// deletes (unlinks) is closed and unmapped within the cache's tick (5 s),
// not after the idle time (an hour here), so the open descriptor does not
// keep the deleted block's disk space. Before, it stayed open until idle.
func TestShortCircuitCacheDeletedBlock(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(34, 6<<20) // two blocks
	put(t, cl, "k", data)
	reader := newClient(t, c, "/dc1/rack1")
	reader.SetShortCircuitCacheLimitsForTest(0, 0, time.Hour)
	if got := scReadAll(t, reader, "k", len(data), true); !bytes.Equal(got, data) {
		t.Fatal("wrong data")
	}
	if cs, fds := reader.ShortCircuitCacheStats(), blockFDs(t, dir); cs.Files != 2 || fds != 2 {
		t.Fatalf("cache %+v, %d block descriptors open; want 2 files cached", cs, fds)
	}
	r, err := reader.GetKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	info := r.Info()
	r.Close()
	// Delete the first block's replicas as a datanode deletes a block.
	b := info.Blocks[0]
	for i := range 3 {
		if err := os.Remove(blockFile(dir, i, b.ContainerID, b.LocalID)); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	for reader.ShortCircuitCacheStats().Files != 1 || blockFDs(t, dir) != 1 || blockMappings(t, dir) != 1 {
		if time.Since(start) > 30*time.Second {
			t.Fatalf("deleted block's file kept: cache %+v, %d descriptors, %d mappings",
				reader.ShortCircuitCacheStats(), blockFDs(t, dir), blockMappings(t, dir))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if cs := reader.ShortCircuitCacheStats(); cs.Invalidated != 1 || cs.Evicted != 0 {
		t.Fatalf("cache %+v: want the deleted file invalidated, nothing evicted", cs)
	}
	t.Logf("deleted block's file closed after %v", time.Since(start).Round(time.Millisecond))
}

// expiringTokenCluster starts 3 datanodes whose block tokens live 1.5 s,
// writes key vol/bkt/k (three blocks of random data from seed) as the
// admin, opens the bucket to others and returns the admin's client and
// alice's (a plain user, closed at the test's end) with the data.
func expiringTokenCluster(t *testing.T, ctx context.Context, prefix string, seed int64) (*cluster.Cluster, *client.Client, *client.Client, []byte) {
	t.Helper()
	dir, err := os.MkdirTemp("", prefix) // short: a socket path has at most 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: 3,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20, SecretKeys: scm.SecretKeyConfig{TokenLifetime: 1500 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	admin := newClient(t, c, "/dc1/rack1")
	makeBucket(t, admin, "vol", "bkt")
	data := randData(seed, 10<<20+99) // three blocks
	put(t, admin, "k", data)
	open := uint32(0o755)
	if _, err := admin.SetFileAttrs(ctx, "vol", "bkt", "", &metapb.FileAttrs{Permission: &open}); err != nil {
		t.Fatal(err)
	}
	creds, err := c.Credentials(pki.Identity{Role: pki.RoleClient, ID: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	alice, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: creds, Location: "/dc1/rack1",
		RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { alice.Close() })
	return c, admin, alice, data
}

// TestShortCircuitCacheExpiredToken: a reader whose tokens expired gets
// no block file from the client's cache: the datanode is asked over its
// socket and refuses the token, the reader looks the key up for fresh
// tokens and reads on from the cached files; once the user's read access
// is revoked, that lookup is refused and so is the read, as over gRPC.
// Before, the cache served any reader of the client whatever its token:
// the revoked user read on.
func TestShortCircuitCacheExpiredToken(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, admin, alice, data := expiringTokenCluster(t, ctx, "sct", 35)
	if got := scReadAll(t, alice, "k", len(data), false); !bytes.Equal(got, data) {
		t.Fatal("first read: wrong data")
	}
	st0 := alice.ShortCircuitBlockStats()
	if st0.Opened != 3 || st0.Bytes != uint64(len(data)) {
		t.Fatalf("first read: %+v, want 3 block files, every byte from them", st0)
	}
	// readAfterExpiry opens a reader, runs then, lets the reader's tokens
	// expire and reads.
	readAfterExpiry := func(then func()) ([]byte, error) {
		r, err := alice.GetKey(ctx, "vol", "bkt", "k")
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		then()
		time.Sleep(2 * time.Second) // past the tokens' expiry
		p := make([]byte, len(data))
		n, err := r.ReadAt(p, 0)
		if err == io.EOF && n == len(p) {
			err = nil
		}
		return p[:n], err
	}
	_, denied0, _ := scServed(c)
	cs0 := alice.ShortCircuitCacheStats()
	got, err := readAfterExpiry(func() {})
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read with expired tokens: %d bytes, %v", len(got), err)
	}
	_, denied1, _ := scServed(c)
	st1, cs1 := alice.ShortCircuitBlockStats(), alice.ShortCircuitCacheStats()
	if denied1 == denied0 || cs1.Rechecks == cs0.Rechecks || st1.Opened != st0.Opened || st1.Bytes != 2*uint64(len(data)) {
		t.Fatalf("read with expired tokens: datanodes refused %d tokens, client %+v, cache %+v: want the expired token refused "+
			"by a datanode, then every byte from the cached files with fresh tokens", denied1-denied0, st1, cs1)
	}

	// Alice opens a reader, then loses read access: once the reader's
	// tokens expired, its lookup for fresh ones is refused, and so is the
	// read (every replica refuses the expired token).
	got, err = readAfterExpiry(func() {
		closed := uint32(0o700)
		if _, err := admin.SetFileAttrs(ctx, "vol", "bkt", "", &metapb.FileAttrs{Permission: &closed}); err != nil {
			t.Fatal(err)
		}
	})
	if err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("read after the revoke, tokens expired: %d bytes, %v; want refused (token expired)", len(got), err)
	}
	if _, err := alice.GetKey(ctx, "vol", "bkt", "k"); !errors.Is(err, client.ErrPermissionDenied) {
		t.Fatalf("lookup after the revoke: %v, want permission denied", err)
	}
	if _, denied2, _ := scServed(c); denied2 == denied1 {
		t.Fatal("read after the revoke: no datanode refused the expired token")
	}
}

// TestShortCircuitHeldFileExpiredToken: a reader that already holds its
// block files checks their tokens' expiry on each read, as gRPC checks
// every ReadBlock. Once expired, the reader's current token goes through
// the client's check and the datanode's again: an expired one is refused,
// the reader refreshes and reads on from the same files; once the user's
// read access is revoked, the refresh is refused and so is the read.
// Before, the held files served the reader until Close: the revoked user
// read the whole key again (review rev17 finding 1).
func TestShortCircuitHeldFileExpiredToken(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, admin, alice, data := expiringTokenCluster(t, ctx, "sch", 36)
	r, err := alice.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	read := func() (int, error) {
		p := make([]byte, len(data))
		n, err := r.ReadAt(p, 0)
		if err == io.EOF && n == len(p) {
			err = nil
		}
		if err == nil && !bytes.Equal(p, data) {
			t.Fatal("wrong data")
		}
		return n, err
	}
	if n, err := read(); err != nil {
		t.Fatalf("first read: %d bytes, %v", n, err)
	}
	st0 := alice.ShortCircuitBlockStats()
	if st0.Opened != 3 || st0.Bytes != uint64(len(data)) {
		t.Fatalf("first read: %+v, want 3 block files, every byte from them", st0)
	}

	// The same reader after its tokens expired: refused by a datanode,
	// refreshed, then every byte from the same files.
	time.Sleep(2 * time.Second)
	_, denied0, _ := scServed(c)
	if n, err := read(); err != nil {
		t.Fatalf("read with expired tokens: %d bytes, %v", n, err)
	}
	_, denied1, _ := scServed(c)
	st1 := alice.ShortCircuitBlockStats()
	if denied1 == denied0 || st1.Opened != st0.Opened || st1.Bytes != 2*uint64(len(data)) {
		t.Fatalf("read with expired tokens: datanodes refused %d tokens, client %+v: want the expired token refused, "+
			"then every byte from the files already open", denied1-denied0, st1)
	}

	// Alice loses read access; once the reader's tokens expired, its
	// refresh is refused, and so is the read of the files it holds.
	closed := uint32(0o700)
	if _, err := admin.SetFileAttrs(ctx, "vol", "bkt", "", &metapb.FileAttrs{Permission: &closed}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if _, err := alice.GetKey(ctx, "vol", "bkt", "k"); !errors.Is(err, client.ErrPermissionDenied) {
		t.Fatalf("lookup after the revoke: %v, want permission denied", err)
	}
	st2 := alice.ShortCircuitBlockStats()
	n, err := read()
	st3 := alice.ShortCircuitBlockStats()
	if err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("the open reader after the revoke, tokens expired: %d bytes (%d short-circuit), %v; want refused (token expired)",
			n, st3.Bytes-st2.Bytes, err)
	}
	if _, denied2, _ := scServed(c); denied2 == denied1 {
		t.Fatal("read after the revoke: no datanode refused the expired token")
	}
	// WriteTo (the S3 GET path: mapPiece) holds the same files.
	var w bytes.Buffer
	if n, err := r.WriteTo(&w); err == nil {
		t.Fatalf("WriteTo of the open reader after the revoke: %d bytes, no error; want refused", n)
	}
}
