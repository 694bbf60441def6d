package datanode

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// fillStore writes containers × blocks blocks of size bytes.
func fillStore(t *testing.T, s *storage.Store, containers, blocks, size int) {
	t.Helper()
	data := make([]byte, size)
	for cid := 1; cid <= containers; cid++ {
		if _, err := s.CreateContainer(storage.ContainerID(cid), storage.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		for lid := 1; lid <= blocks; lid++ {
			r := rand.New(rand.NewPCG(uint64(cid), uint64(lid)))
			for i := range data {
				data[i] = byte(r.Uint32())
			}
			bd := storage.BlockData{LocalID: storage.LocalID(lid), Length: int64(size), BCSID: uint64(lid)}
			const chunk = 1 << 20
			for off := 0; off < size; off += chunk {
				p := data[off:min(off+chunk, size)]
				sum := storage.DefaultChecksum.Compute(p)
				if err := s.WriteChunk(storage.ContainerID(cid), storage.LocalID(lid), int64(off), p, sum, false); err != nil {
					t.Fatal(err)
				}
				bd.Chunks = append(bd.Chunks, storage.ChunkInfo{Offset: int64(off), Length: int64(len(p)), Checksum: sum})
			}
			if err := s.PutBlock(storage.ContainerID(cid), bd); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func readCursor(t *testing.T, path string) ScrubCursor {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var c ScrubCursor
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestScrubberRateAndResume: the scrubber reads at its configured rate
// (within a tolerant bound), is stopped mid-pass, and after a "restart"
// (a new scrubber on the same cursor file) finishes the pass from where it
// stopped instead of starting over; with the pass done and the interval
// not elapsed, a third start does not scrub again.
func TestScrubberRateAndResume(t *testing.T) {
	dir := t.TempDir()
	st, err := storage.Open(storage.Options{Volumes: []string{filepath.Join(dir, "data")}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	const containers, blocks, size = 3, 4, 2 << 20
	const total = containers * blocks * size // 24 MiB
	fillStore(t, st, containers, blocks, size)
	const rate = 6 << 20 // a full pass takes 4 s
	cursor := filepath.Join(dir, scrubCursorFile)
	cfg := scrubConfig{store: st, fs: vfs.Default, path: cursor, rate: rate, interval: time.Hour, background: true, log: quietLog()}

	s1, err := newScrubber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	s1.start()
	for s1.bytes.Load() < total/2 {
		if time.Since(began) > 60*time.Second {
			t.Fatalf("scrubbed only %d bytes in 60 s", s1.bytes.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	s1.stop()
	elapsed := time.Since(began)
	done1 := s1.bytes.Load()
	// The bucket starts empty and allows a burst of at most 4 MiB, so
	// done1 bytes need at least (done1-burst)/rate.
	minT := time.Duration(float64(done1-4<<20) / rate * float64(time.Second))
	t.Logf("first run: %d bytes in %v (%.1f MiB/s, limit %d MiB/s)", done1, elapsed.Round(time.Millisecond), float64(done1)/elapsed.Seconds()/(1<<20), rate>>20)
	if elapsed < minT*9/10 {
		t.Fatalf("%d bytes in %v: faster than %d B/s allows (%v)", done1, elapsed, rate, minT)
	}
	if s1.passes.Load() != 0 || done1 >= total {
		t.Fatalf("stopped run finished the pass: %d bytes, %d passes", done1, s1.passes.Load())
	}
	c := readCursor(t, cursor)
	if c.PassStartedMs == 0 || c.Container == 0 {
		t.Fatalf("cursor after a stop mid-pass: %+v", c)
	}
	t.Logf("cursor at stop: %+v", c)

	// Restart: the pass resumes at the cursor.
	s2, err := newScrubber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	began = time.Now()
	s2.start()
	for s2.passes.Load() == 0 {
		if time.Since(began) > 60*time.Second {
			t.Fatalf("resumed pass not done in 60 s: %d bytes", s2.bytes.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	s2.stop()
	done2 := s2.lastPass.Load()
	t.Logf("resumed run: %d bytes in %v", done2, time.Since(began).Round(time.Millisecond))
	// The block in flight at the stop is verified again; nothing else.
	if done2 > total-done1+size || done1+done2 < total {
		t.Fatalf("resumed pass verified %d bytes after %d of %d: not a resume", done2, done1, total)
	}
	if s2.blocks.Load() == 0 {
		t.Fatal("no block verified")
	}
	c = readCursor(t, cursor)
	if c.PassStartedMs != 0 || c.Passes != 1 || c.LastPassDoneMs == 0 {
		t.Fatalf("cursor after the pass: %+v", c)
	}

	// The interval has not elapsed: a third start waits.
	s3, err := newScrubber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s3.start()
	time.Sleep(500 * time.Millisecond)
	s3.stop()
	if n := s3.bytes.Load(); n != 0 {
		t.Fatalf("a pass started before the interval elapsed (%d bytes)", n)
	}
	// Unthrottled, on request, it runs a whole pass at once.
	cfg.rate, cfg.background = 0, false
	s4, err := newScrubber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s4.start()
	defer s4.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := s4.scrub(ctx); err != nil {
		t.Fatal(err)
	}
	if n := s4.lastPass.Load(); n != total {
		t.Fatalf("requested pass verified %d of %d bytes", n, total)
	}
	if c := readCursor(t, cursor); c.Passes != 2 {
		t.Fatalf("cursor: %+v", c)
	}
}

// syncBuf is a log sink safe for concurrent writes.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestScrubberFindsFlippedBytesLocally: on one datanode (no cluster), a
// flipped byte, a missing file and a file turned unreadable are each
// found by a pass, counted by kind, their containers marked UNHEALTHY,
// reported (the finding callback) and logged through the datanode's
// logger, as is storage's own "container UNHEALTHY" line; intact
// containers are left alone and a second pass skips the UNHEALTHY ones.
func TestScrubberFindsFlippedBytesLocally(t *testing.T) {
	dir := t.TempDir()
	var logs syncBuf
	d, err := New(Config{DataDir: dir, MetaAddrs: []string{"127.0.0.1:1"}, TLS: pki.Insecure(),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	st := d.Store()
	fillStore(t, st, 5, 3, 1<<20)
	vol := filepath.Join(dir, "data")
	path := func(cid, lid int) string {
		return filepath.Join(vol, "basalt", "containers", fmt.Sprint(cid), fmt.Sprintf("%d.block", lid))
	}
	f, err := os.OpenFile(path(1, 2), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("flipped"), 300<<10)
	f.Close()
	if err := os.Remove(path(3, 1)); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path(4, 3)); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(path(4, 3), 0o755); err != nil { // reads fail with EISDIR
		t.Fatal(err)
	}
	var mu sync.Mutex
	var found []ScrubFinding
	sc, err := newScrubber(scrubConfig{store: st, fs: vfs.Default, path: filepath.Join(dir, scrubCursorFile), log: d.log,
		found: func(f ScrubFinding) { mu.Lock(); found = append(found, f); mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	sc.start()
	defer sc.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := sc.scrub(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	got := map[storage.ContainerID]string{}
	for _, f := range found {
		got[f.Container] = fmt.Sprintf("%d/%s", f.Block, f.Kind)
	}
	mu.Unlock()
	want := map[storage.ContainerID]string{1: "2/checksum", 3: "1/missing", 4: "3/unreadable"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("findings %v, want %v", got, want)
	}
	stt := sc.stats()
	if stt.Checksum != 1 || stt.Missing != 1 || stt.Unreadable != 1 {
		t.Fatalf("stats: %+v", stt)
	}
	for cid := storage.ContainerID(1); cid <= 5; cid++ {
		r, err := st.Container(cid)
		if err != nil {
			t.Fatal(err)
		}
		bad := want[cid] != ""
		if (r.State == storage.StateUnhealthy) != bad {
			t.Fatalf("container %d is %v", cid, r.State)
		}
	}
	for _, v := range st.Volumes() {
		if v.Failed {
			t.Fatalf("volume failed: %+v", v)
		}
	}
	for _, line := range []string{"storage: container 1 UNHEALTHY", "storage: container 3 UNHEALTHY", "scrubber: damaged replica", "kind=missing"} {
		if !strings.Contains(logs.String(), line) {
			t.Fatalf("log lacks %q:\n%s", line, logs.String())
		}
	}
	// A second pass skips the UNHEALTHY containers: 2 intact ones of 3 MiB.
	if err := sc.scrub(ctx); err != nil {
		t.Fatal(err)
	}
	if n := sc.lastPass.Load(); n != 2*3<<20 {
		t.Fatalf("second pass verified %d bytes, want %d", n, 2*3<<20)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(found) != 3 {
		t.Fatalf("second pass found again: %v", found)
	}
}

// TestVolumeCheckFailureIsLogged: a volume whose probe fails is FAILED,
// logged by storage and by the datanode, and counted.
func TestVolumeCheckFailureIsLogged(t *testing.T) {
	dir := t.TempDir()
	var logs syncBuf
	ffs := vfs.NewFaultFS(vfs.Default)
	d, err := New(Config{DataDir: dir, MetaAddrs: []string{"127.0.0.1:1"}, TLS: pki.Insecure(), FS: ffs,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if res := d.CheckVolumes(); len(res) != 1 || res[0].Failed {
		t.Fatalf("healthy volume: %+v", res)
	}
	ffs.SetInject(func(op, path string) error {
		if strings.HasPrefix(path, filepath.Join(dir, "data")) && (op == "open" || op == "create") {
			return syscall.EIO
		}
		return nil
	})
	if res := d.CheckVolumes(); len(res) != 1 || !res[0].NewlyFailed {
		t.Fatalf("volume with EIO: %+v", res)
	}
	if d.volChecksFailed.Load() != 1 || d.volChecksOK.Load() != 1 {
		t.Fatalf("checks ok %d failed %d", d.volChecksOK.Load(), d.volChecksFailed.Load())
	}
	for _, line := range []string{"FAILED: health check", "volume FAILED its health check"} {
		if !strings.Contains(logs.String(), line) {
			t.Fatalf("log lacks %q:\n%s", line, logs.String())
		}
	}
}
