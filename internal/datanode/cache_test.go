package datanode

import (
	"bufio"
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
)

// cacheTestDir is where the cache tier's tests put their cache directory:
// $BASALT_CACHE_DIR (make test-pmem sets it to a directory on a DAX
// mount) or a temporary directory. With BASALT_REQUIRE_DAX=1 the tests
// fail unless it is on a file system mounted with dax.
func cacheTestDir(t *testing.T) string {
	t.Helper()
	base := os.Getenv("BASALT_CACHE_DIR")
	if base == "" {
		return t.TempDir()
	}
	dir, err := os.MkdirTemp(base, "cache-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	mnt, opts := mountOf(dir)
	dax := hasOpt(opts, "dax") || hasOpt(opts, "dax=always")
	t.Logf("cache directory %s on %s (%s), dax: %v", dir, mnt, opts, dax)
	if os.Getenv("BASALT_REQUIRE_DAX") == "1" && !dax {
		t.Fatalf("%s is not on a dax mount (%s %s)", dir, mnt, opts)
	}
	return dir
}

// mountOf returns the mount point and options of the file system holding
// path (the longest mount point that prefixes it, from /proc/mounts).
func mountOf(path string) (mnt, opts string) {
	f, err := os.Open("/proc/mounts")
	if err != nil {
		return "", ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fs := strings.Fields(s.Text())
		if len(fs) < 4 {
			continue
		}
		m := fs[1]
		if (path == m || strings.HasPrefix(path, strings.TrimSuffix(m, "/")+"/")) && len(m) >= len(mnt) {
			mnt, opts = m, fs[3]
		}
	}
	return mnt, opts
}

func hasOpt(opts, o string) bool {
	for _, x := range strings.Split(opts, ",") {
		if x == o {
			return true
		}
	}
	return false
}

// waitCachedLocal polls until the cache holds n blocks.
func waitCachedLocal(t *testing.T, bc *blockCache, n int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		bc.mu.Lock()
		got := len(bc.entries)
		bc.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d blocks cached after 2 minutes", got, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestCacheTierPersistent: blocks cached into a cache directory are
// mapped copies of the data disk's blocks; after a "restart" (the tier
// closed and opened again on the same directory) every block is recovered
// without a copy and verified in the background; a cache file cut short
// is refused at load, and one with flipped bytes is dropped by the
// background verification and never served. On a DAX mount (make
// test-pmem) it also maps a cache file with MAP_SYNC, which only DAX
// allows.
func TestCacheTierPersistent(t *testing.T) {
	dir := t.TempDir()
	st, err := storage.Open(storage.Options{Volumes: []string{filepath.Join(dir, "data")}, ContainerSize: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	const containers, blocks, size = 2, 3, 3<<20 + 12345
	fillStore(t, st, containers, blocks, size)
	cdir := cacheTestDir(t)
	capacity := int64(containers*blocks*size + 1<<20)

	bc, err := openCache([]string{cdir}, capacity, st, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	var ids []*metapb.BlockID
	for c := 1; c <= containers; c++ {
		for l := 1; l <= blocks; l++ {
			ids = append(ids, &metapb.BlockID{ContainerId: uint64(c), LocalId: uint64(l)})
		}
	}
	began := time.Now()
	bc.request(ids)
	waitCachedLocal(t, bc, len(ids))
	t.Logf("cached %d blocks (%d MiB) in %v", len(ids), len(ids)*size>>20, time.Since(began).Round(time.Millisecond))
	want := make([]byte, size)
	check := func(bc *blockCache) {
		t.Helper()
		for _, id := range ids {
			e := bc.get(id.ContainerId, id.LocalId)
			if e == nil {
				t.Fatalf("block %v not cached", id)
			}
			if _, err := st.ReadAt(storage.ContainerID(id.ContainerId), storage.LocalID(id.LocalId), want, 0); err != nil {
				e.mu.RUnlock()
				t.Fatal(err)
			}
			same := bytes.Equal(e.data, want)
			e.mu.RUnlock()
			if !same {
				t.Fatalf("block %v: the cached copy differs from the data disk's", id)
			}
		}
	}
	check(bc)
	if s := bc.stats(); s.Blocks != uint64(len(ids)) || s.UsedBytes != uint64(len(ids)*size) || bc.copied.Load() != uint64(len(ids)) {
		t.Fatalf("stats %+v, copied %d", s, bc.copied.Load())
	}
	if _, opts := mountOf(cdir); hasOpt(opts, "dax") || hasOpt(opts, "dax=always") {
		f, err := os.Open(bc.blockPath(0, cacheKey{1, 1}) + ".blk")
		if err != nil {
			t.Fatal(err)
		}
		m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ, unix.MAP_SHARED_VALIDATE|unix.MAP_SYNC)
		f.Close()
		if err != nil {
			t.Fatalf("MAP_SYNC mapping of a cache file on a dax mount: %v", err)
		}
		unix.Munmap(m)
		t.Logf("a cache file maps with MAP_SHARED_VALIDATE|MAP_SYNC: the mapping is the persistent memory itself")
	}
	bc.close()

	// Restart: everything recovered, nothing copied.
	began = time.Now()
	bc, err = openCache([]string{cdir}, capacity, st, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("recovered %d blocks in %v", bc.recovered.Load(), time.Since(began).Round(time.Microsecond))
	if bc.recovered.Load() != uint64(len(ids)) || bc.copied.Load() != 0 {
		t.Fatalf("after restart: %d recovered, %d copied; want %d, 0", bc.recovered.Load(), bc.copied.Load(), len(ids))
	}
	check(bc)
	deadline := time.Now().Add(time.Minute)
	for _, id := range ids {
		k := cacheKey{id.ContainerId, id.LocalId}
		for {
			bc.mu.Lock()
			e := bc.entries[k]
			bc.mu.Unlock()
			if e != nil && e.verified.Load() {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("block %v not verified in the background within a minute", id)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	bc.close()

	// Damage two cache files: one cut short (refused at load), one with
	// flipped bytes (dropped by the background verification).
	short, flipped := bc.blockPath(0, cacheKey{1, 2})+".blk", bc.blockPath(0, cacheKey{2, 3})+".blk"
	if err := os.Truncate(short, size-1); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(flipped, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{0xde, 0xad, 0xbe, 0xef}, 2<<20+17); err != nil {
		t.Fatal(err)
	}
	f.Sync()
	f.Close()
	bc, err = openCache([]string{cdir}, capacity, st, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	defer bc.close()
	if got := bc.recovered.Load(); got != uint64(len(ids)-1) {
		t.Fatalf("recovered %d blocks, want %d (the short file refused at load)", got, len(ids)-1)
	}
	if _, err := os.Stat(short); !os.IsNotExist(err) {
		t.Fatalf("the short cache file is still there: %v", err)
	}
	deadline = time.Now().Add(time.Minute)
	for bc.dropped.Load() < 1 {
		if time.Now().After(deadline) {
			t.Fatal("the flipped cache file was not dropped within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if e := bc.get(2, 3); e != nil {
		e.mu.RUnlock()
		t.Fatal("the corrupt block is still served from the cache")
	}
	// SCM sends the cache command again: both come back, copied anew.
	bc.request(ids)
	waitCachedLocal(t, bc, len(ids))
	check(bc)
	if bc.copied.Load() != 2 {
		t.Fatalf("re-cached %d blocks, want 2", bc.copied.Load())
	}
}

// TestCacheRecoveryTime measures start-up recovery of a large cache
// directory (docs/BENCHMARKS.md, "Cache"): how long openCache takes to
// find, check and map BASALT_CACHE_RECOVERY_MB of cached 32 MiB blocks
// (written directly as cache files), how long the first read of a block
// then takes, and how long the background verification of all of them
// takes. Off by default:
//
//	BASALT_CACHE_RECOVERY_MB=4096 BASALT_CACHE_DIR=/dev/shm \
//	  go test -count=1 -v -run TestCacheRecoveryTime ./internal/datanode/
func TestCacheRecoveryTime(t *testing.T) {
	mb, _ := strconv.Atoi(os.Getenv("BASALT_CACHE_RECOVERY_MB"))
	if mb <= 0 {
		t.Skip("set BASALT_CACHE_RECOVERY_MB to run")
	}
	const blockSize, chunk = 32 << 20, 1 << 20
	n := mb / 32
	cdir := cacheTestDir(t)
	data := make([]byte, blockSize)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	bd := storage.BlockData{Length: blockSize}
	for off := 0; off < blockSize; off += chunk {
		bd.Chunks = append(bd.Chunks, storage.ChunkInfo{Offset: int64(off), Length: chunk, Checksum: storage.DefaultChecksum.Compute(data[off : off+chunk])})
	}
	bc := &blockCache{dirs: []*cacheDir{{path: cdir}}}
	for i := range n {
		k := cacheKey{uint64(1 + i/16), uint64(1 + i%16)}
		base := bc.blockPath(0, k)
		if err := os.MkdirAll(filepath.Dir(base), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(base+".blk", data, 0o644); err != nil {
			t.Fatal(err)
		}
		b := bd
		b.LocalID = storage.LocalID(k.l)
		rec := cacheRecord{Container: k.c, Block: b}
		rec.CRC = rec.sum()
		js, _ := json.Marshal(rec)
		if err := os.WriteFile(base+".rec", js, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	began := time.Now()
	bc, err := openCache([]string{cdir}, int64(n)*blockSize, nil, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	defer bc.close()
	opened := time.Since(began)
	e := bc.get(1, 1)
	if e == nil {
		t.Fatal("block 1/1 not recovered")
	}
	buf := make([]byte, 1<<20)
	ok := e.verified.Load() || verifyMapped(e.bd, e.data, 0, int64(len(buf)))
	copy(buf, e.data)
	e.mu.RUnlock()
	first := time.Since(began)
	if !ok || !bytes.Equal(buf, data[:len(buf)]) {
		t.Fatal("the first read of a recovered block is wrong")
	}
	for _, e := range bc.entries {
		for !e.verified.Load() {
			if time.Since(began) > 10*time.Minute {
				t.Fatal("background verification not done in 10 minutes")
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	verified := time.Since(began)
	began = time.Now()
	bc.close()
	t.Logf("%d MiB (%d blocks of 32 MiB): recovered in %v, first 1 MiB read (verified) at %v, every block verified at %v; close (unmapping) took %v",
		n*32, bc.recovered.Load(), opened.Round(time.Millisecond), first.Round(time.Millisecond), verified.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
}
