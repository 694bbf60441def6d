package zoned

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestBenchmarkBackends compares the zoned backend (on an emulated zonefs
// over a directory of BASALT_ZONED_BENCH, or on the real zonefs mount
// BASALT_ZONEFS with posix on BASALT_ZONED_BENCH) with the posix backend
// on the same disk, through a storage.Store: each stream writes blocks of
// 64 MiB in 4 MiB chunks with CRC32C (PutBlock syncs each block), then
// reads them back in 4 MiB pieces (verified). It prints MiB/s, medians of
// BENCH_RUNS (3) runs, for 1 and 8 streams, the share of device writes at
// the write pointer, and the cleaner's write amplification under a
// delete-heavy load. Command: see docs/BENCHMARKS.md ("Zoned backend").
func TestBenchmarkBackends(t *testing.T) {
	dir := os.Getenv("BASALT_ZONED_BENCH")
	if dir == "" {
		t.Skip("BASALT_ZONED_BENCH (a directory on the disk to measure) not set")
	}
	runs := 3
	if v, err := strconv.Atoi(os.Getenv("BENCH_RUNS")); err == nil && v > 0 {
		runs = v
	}
	total := int64(1 << 30)
	if v, err := strconv.ParseInt(os.Getenv("BENCH_BYTES"), 10, 64); err == nil && v > 0 {
		total = v
	}
	real := os.Getenv("BASALT_ZONEFS")
	stage, _ := strconv.Atoi(os.Getenv("BENCH_STAGE")) // 0: default
	streamSet := []int{1, 8}
	if v, err := strconv.Atoi(os.Getenv("BENCH_STREAMS")); err == nil && v > 0 {
		streamSet = []int{v}
	}
	backends := []string{"posix", "zoned"}
	if v := os.Getenv("BENCH_BACKEND"); v != "" {
		backends = []string{v}
	}
	type result struct{ w, r []float64 }
	res := map[string]*result{}
	var emuWrites, emuBytes int64
	for run := range runs {
		for _, backend := range backends {
			for _, streams := range streamSet {
				key := fmt.Sprintf("%s/%d", backend, streams)
				if res[key] == nil {
					res[key] = &result{}
				}
				vol := filepath.Join(dir, fmt.Sprintf("bench-%s-%d-%d", backend, streams, run))
				os.RemoveAll(vol)
				o := storage.Options{Volumes: []string{vol}, ContainerSize: total + 256<<20, MetaReserveBytes: -1}
				var emu *EmuFS
				if backend == "zoned" {
					o.NewBackend = func(fs vfs.FS, d string) (storage.BlockFiles, error) {
						root := filepath.Dir(d)
						if real != "" {
							return New(Config{Mount: real, MetaDir: filepath.Join(root, "zoned"), MetaFS: fs, StageBytes: stage})
						}
						var err error
						g := DevGeometry
						g.Zones = int(2*total/g.ZoneCap) + 12
						emu, err = NewEmuFS(fs, filepath.Join(root, "zonefs"), g)
						if err != nil {
							return nil, err
						}
						return New(Config{Mount: filepath.Join(root, "zonefs"), FS: emu, MetaDir: filepath.Join(root, "zoned"), MetaFS: fs, StageBytes: stage})
					}
				}
				w, r := benchStore(t, o, streams, total)
				res[key].w = append(res[key].w, w)
				res[key].r = append(res[key].r, r)
				if emu != nil {
					n, b := emu.DeviceWrites()
					emuWrites += n
					emuBytes += b
					if vs := emu.Violations(); len(vs) > 0 {
						t.Fatalf("zonefs rules violated: %q", vs)
					}
				}
				if err := os.RemoveAll(vol); err != nil {
					t.Fatal(err)
				}
				t.Logf("run %d %s: write %.0f MiB/s, read %.0f MiB/s", run, key, w, r)
			}
		}
	}
	med := func(v []float64) float64 {
		s := append([]float64(nil), v...)
		sort.Float64s(s)
		return s[len(s)/2]
	}
	if len(backends) < 2 || len(streamSet) < 2 {
		return
	}
	fmt.Printf("\n| streams | posix write | zoned write | zoned/posix | posix read | zoned read | zoned/posix |\n|---|---|---|---|---|---|---|\n")
	for _, st := range []int{1, 8} {
		p, z := res[fmt.Sprintf("posix/%d", st)], res[fmt.Sprintf("zoned/%d", st)]
		fmt.Printf("| %d | %.0f MiB/s | %.0f MiB/s | %.2f | %.0f MiB/s | %.0f MiB/s | %.2f |\n", st,
			med(p.w), med(z.w), med(z.w)/med(p.w), med(p.r), med(z.r), med(z.r)/med(p.r))
	}
	if real == "" {
		fmt.Printf("\nemulated device: %d writes (%d MiB), all at the write pointer (EmuFS refuses any other; 0 refused)\n", emuWrites, emuBytes>>20)
	}
	wa := cleanerWA(t, dir, real)
	fmt.Printf("cleaner write amplification (delete-heavy: 4x the volume written, 1 block in 8 kept): %.2f\n", wa)
}

func benchStore(t *testing.T, o storage.Options, streams int, total int64) (wMiBs, rMiBs float64) {
	s, err := storage.Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.CreateContainer(1, storage.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	const blockSize, chunk = 64 << 20, 4 << 20
	per := max(1, int(total/blockSize)/streams)
	src := data(42, blockSize)
	sums := make([]storage.ChecksumData, blockSize/chunk)
	for i := range sums {
		sums[i] = storage.DefaultChecksum.Compute(src[i*chunk : (i+1)*chunk])
	}
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	start := time.Now()
	for st := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				lid := storage.LocalID(st*1000 + i + 1)
				bd := storage.BlockData{LocalID: lid, Length: blockSize, BCSID: uint64(lid)}
				for c := range blockSize / chunk {
					if err := s.WriteChunk(1, lid, int64(c*chunk), src[c*chunk:(c+1)*chunk], sums[c], false); err != nil {
						errs <- err
						return
					}
					bd.Chunks = append(bd.Chunks, storage.ChunkInfo{Offset: int64(c * chunk), Length: chunk, Checksum: sums[c]})
				}
				if err := s.PutBlock(1, bd); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	wd := time.Since(start)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	bytesAll := float64(per*streams) * blockSize / (1 << 20)
	errs = make(chan error, streams)
	start = time.Now()
	for st := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				lid := storage.LocalID(st*1000 + i + 1)
				for c := range blockSize / chunk {
					p, err := s.ReadChunk(1, lid, int64(c*chunk), chunk)
					if err != nil {
						errs <- err
						return
					}
					if c == 0 && !bytes.Equal(p[:4096], src[:4096]) {
						errs <- fmt.Errorf("block %d reads back wrong", lid)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	rd := time.Since(start)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return bytesAll / wd.Seconds(), bytesAll / rd.Seconds()
}

// cleanerWA writes 4x an emulated volume's capacity (or, on a real
// zonefs, 4x three zones) keeping one block in eight, and returns
// (user + moved) / user bytes.
func cleanerWA(t *testing.T, dir, real string) float64 {
	g := Geometry{Zones: 32, ZoneSize: 16 << 20, ZoneCap: 16 << 20, MaxOpen: 14, MaxActive: 14, BlockSize: 4096}
	vdir := filepath.Join(dir, "bench-cleaner")
	defer os.RemoveAll(vdir)
	var b *Backend
	var err error
	capacity := int64(g.Zones) * g.ZoneCap
	if real != "" {
		b, err = New(Config{Mount: real, MetaDir: filepath.Join(vdir, "meta"), CleanerRate: -1})
		if err == nil {
			capacity = int64(b.g.Zones) * b.g.ZoneCap
		}
	} else {
		var emu *EmuFS
		if emu, err = NewEmuFS(vfs.Default, filepath.Join(vdir, "zonefs"), g); err == nil {
			b, err = New(Config{Mount: filepath.Join(vdir, "zonefs"), FS: emu, MetaDir: filepath.Join(vdir, "meta"), CleanerRate: -1})
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	b.CreateContainer(1)
	var lid storage.LocalID
	for written := int64(0); written < 4*capacity; {
		lid++
		p := data(uint64(lid), 1<<20+int(lid%7)*300_000)
		if err := writeBlock(t, b, 1, lid, p, 1<<20); err != nil {
			t.Fatalf("after %d MiB: %v (%+v)", written>>20, err, b.Stats())
		}
		written += int64(len(p))
		if old := lid - 1; old%8 != 0 {
			b.Remove(1, old)
			b.SyncContainer(1)
		}
	}
	st := b.Stats()
	t.Logf("cleaner: %+v", st)
	b.RemoveContainer(1)
	return st.WriteAmplification()
}
