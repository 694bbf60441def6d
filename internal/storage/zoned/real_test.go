package zoned

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestRealZonefs runs the backend on a real zonefs mount named by
// BASALT_ZONEFS (scripts/test-zoned-vm.sh does, in a QEMU guest with a
// zoned null_blk device): geometry from sysfs, parallel streams, restart
// with the tails reloaded, deletes and the cleaner, the zones left empty.
// Every write the kernel took was at its zone's write pointer: zonefs
// fails any other with EINVAL.
func TestRealZonefs(t *testing.T) {
	mount := os.Getenv("BASALT_ZONEFS")
	if mount == "" {
		t.Skip("BASALT_ZONEFS (a zonefs mount) not set; see make test-zoned-vm")
	}
	g, err := ReadGeometry(vfs.Default, mount)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("geometry of %s: %+v", mount, g)
	meta := t.TempDir()
	cfg := Config{Mount: mount, MetaDir: filepath.Join(meta, "zoned"), CleanerRate: -1, Logf: t.Logf,
		LowZones: g.Zones, CleanLive: 0.9}
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { b.Close() }()
	if err := b.CreateContainer(1); err != nil {
		t.Fatal(err)
	}
	// Four streams of odd-sized blocks.
	want := map[storage.LocalID][]byte{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	fail := make(chan error, 4)
	for s := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 6 {
				lid := storage.LocalID(s*100 + i)
				p := data(uint64(lid), 3<<20+s*4099+i*777)
				if err := writeBlock(t, b, 1, lid, p, 1<<20+13); err != nil {
					fail <- err
					return
				}
				mu.Lock()
				want[lid] = p
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(fail)
	for err := range fail {
		t.Fatal(err)
	}
	for lid, p := range want {
		checkRead(t, b, 1, lid, p)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if b, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	for lid, p := range want {
		checkRead(t, b, 1, lid, p)
	}
	t.Logf("after restart: %d blocks read back", len(want))
	// Fill several zones with one stream, delete 7 blocks in 8, and let
	// the cleaner (told to want every zone empty) move the rest.
	rng := rand.New(rand.NewPCG(1, 2))
	lid := storage.LocalID(10000)
	total := int64(0)
	for total < 3*g.ZoneCap {
		lid++
		p := data(uint64(lid), 1<<20+rng.IntN(4<<20))
		if err := writeBlock(t, b, 1, lid, p, 1<<20); err != nil {
			t.Fatal(err)
		}
		total += int64(len(p))
		if lid%8 != 0 {
			if err := b.Remove(1, lid); err != nil {
				t.Fatal(err)
			}
		} else {
			want[lid] = p
		}
	}
	b.SyncContainer(1)
	deadline := time.Now().Add(3 * time.Minute)
	for b.Stats().Cleaned < 2 && time.Now().Before(deadline) {
		b.kickCleaner()
		time.Sleep(200 * time.Millisecond)
	}
	st := b.Stats()
	t.Logf("cleaner: %+v, write amplification %.2f", st, st.WriteAmplification())
	if st.Cleaned < 2 || st.Resets < 2 {
		t.Fatalf("the cleaner emptied %d zones and %d were reset", st.Cleaned, st.Resets)
	}
	for lid, p := range want {
		checkRead(t, b, 1, lid, p)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if b, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	for lid, p := range want {
		checkRead(t, b, 1, lid, p)
	}
	t.Logf("after the cleaner and a restart: %d blocks read back", len(want))
	// Remove everything: every zone is reset, as the device shows.
	if err := b.RemoveContainer(1); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		b.kickCleaner()
		time.Sleep(100 * time.Millisecond)
		busy := 0
		for i := range g.Zones {
			fi, err := os.Stat(filepath.Join(mount, "seq", itoa(i)))
			if err != nil {
				t.Fatal(err)
			}
			if fi.Size() > 0 {
				busy++
			}
		}
		if busy == 0 {
			return
		}
	}
	t.Fatal("zones still written after every block was removed")
}

func itoa(i int) string { return strconv.Itoa(i) }
