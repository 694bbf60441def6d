package zoned

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

// zonefsMagic is zonefs's super block and statfs magic ("ZOFS").
const zonefsMagic = 0x5a4f4653

// Geometry describes a zoned device as its zonefs mount shows it. Only the
// sequential-write-required zones (seq/0..Zones-1) hold block data.
type Geometry struct {
	Zones     int   // sequential zones (files under seq/)
	ZoneSize  int64 // bytes between zone starts
	ZoneCap   int64 // writable bytes per zone (≤ ZoneSize; ZNS may be less)
	MaxOpen   int   // device limit on open zones; 0: none
	MaxActive int   // device limit on active (open or closed) zones; 0: none
	BlockSize int   // logical block size: the unit of every write
}

func (g Geometry) validate() error {
	switch {
	case g.Zones <= 0:
		return errors.New("no sequential zones")
	case g.BlockSize <= 0 || g.BlockSize&(g.BlockSize-1) != 0 || g.BlockSize > 1<<16:
		return fmt.Errorf("logical block size %d", g.BlockSize)
	case g.ZoneCap <= 0 || g.ZoneCap%int64(g.align()) != 0:
		return fmt.Errorf("zone capacity %d is not a multiple of %d", g.ZoneCap, g.align())
	case g.ZoneSize < g.ZoneCap:
		return fmt.Errorf("zone size %d < capacity %d", g.ZoneSize, g.ZoneCap)
	case g.MaxOpen < 0 || g.MaxActive < 0:
		return errors.New("negative zone limit")
	}
	return nil
}

// align is the unit of writes and of buffer addresses: the logical block
// size, at least 4 KiB (a multiple of every smaller sector size, and what
// O_DIRECT wants of memory on the devices we target).
func (g Geometry) align() int { return max(g.BlockSize, 4096) }

// zoneLimit is the number of zones that may be written at once: the
// smaller device limit, or def when the device has none.
func (g Geometry) zoneLimit(def int) int {
	l := def
	if g.MaxOpen > 0 {
		l = min(l, g.MaxOpen)
	}
	if g.MaxActive > 0 {
		l = min(l, g.MaxActive)
	}
	return min(l, g.Zones)
}

// geometrySource is implemented by file systems that know the geometry of
// the zonefs they emulate (EmuFS).
type geometrySource interface {
	ZoneGeometry(mount string) (Geometry, bool)
}

// ReadGeometry reads the geometry of the zonefs mounted at mount: the zone
// count from seq/, the zone capacity from a zone file's allocated size
// (zonefs sets st_blocks to the capacity), and the zone size, open and
// active limits and logical block size from the device's sysfs queue
// directory, found through /proc/self/mountinfo.
func ReadGeometry(fs vfs.FS, mount string) (Geometry, error) {
	if gs, ok := fs.(geometrySource); ok {
		if g, ok := gs.ZoneGeometry(mount); ok {
			return g, g.validate()
		}
	}
	var g Geometry
	var st unix.Statfs_t
	if err := unix.Statfs(mount, &st); err != nil {
		return g, fmt.Errorf("zoned: statfs %s: %w", mount, err)
	}
	if st.Type != zonefsMagic {
		return g, fmt.Errorf("zoned: %s is not a zonefs mount (file system magic %#x)", mount, st.Type)
	}
	n, err := countZones(fs, filepath.Join(mount, "seq"))
	if err != nil {
		return g, err
	}
	g.Zones = n
	var zst unix.Stat_t
	if err := unix.Stat(filepath.Join(mount, "seq", "0"), &zst); err != nil {
		return g, fmt.Errorf("zoned: %w", err)
	}
	g.ZoneCap = zst.Blocks * 512
	dev, err := mountDevice(mount)
	if err != nil {
		return g, err
	}
	q := filepath.Join("/sys/dev/block", dev, "queue")
	read := func(name string) (int64, error) {
		b, err := os.ReadFile(filepath.Join(q, name))
		if err != nil {
			return 0, fmt.Errorf("zoned: %w", err)
		}
		return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	}
	if model, err := os.ReadFile(filepath.Join(q, "zoned")); err != nil || strings.TrimSpace(string(model)) == "none" {
		return g, fmt.Errorf("zoned: device %s of %s is not zoned", dev, mount)
	}
	chunk, err := read("chunk_sectors")
	if err != nil {
		return g, err
	}
	g.ZoneSize = chunk * 512
	lbs, err := read("logical_block_size")
	if err != nil {
		return g, err
	}
	g.BlockSize = int(lbs)
	if v, err := read("max_open_zones"); err == nil {
		g.MaxOpen = int(v)
	}
	if v, err := read("max_active_zones"); err == nil {
		g.MaxActive = int(v)
	}
	if g.ZoneCap == 0 || g.ZoneCap > g.ZoneSize {
		g.ZoneCap = g.ZoneSize
	}
	return g, g.validate()
}

func countZones(fs vfs.FS, dir string) (int, error) {
	names, err := fs.List(dir)
	if err != nil {
		return 0, fmt.Errorf("zoned: %w", err)
	}
	n := 0
	for _, name := range names {
		if _, err := strconv.Atoi(name); err == nil {
			n++
		}
	}
	// zonefs names zone files 0..n-1; make sure none is missing.
	for i := range n {
		if _, err := fs.Stat(filepath.Join(dir, strconv.Itoa(i))); err != nil {
			return 0, fmt.Errorf("zoned: zone file %d: %w", i, err)
		}
	}
	return n, nil
}

// mountDevice returns "major:minor" of the device mounted at mount.
func mountDevice(mount string) (string, error) {
	abs, err := filepath.Abs(mount)
	if err != nil {
		return "", err
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("zoned: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	dev := ""
	for sc.Scan() {
		// id parent major:minor root mountpoint ...
		fl := strings.Fields(sc.Text())
		if len(fl) >= 5 && filepath.Clean(fl[4]) == filepath.Clean(abs) {
			dev = fl[2] // the last matching mount wins, as in the kernel
		}
	}
	if dev == "" {
		return "", fmt.Errorf("zoned: %s not found in /proc/self/mountinfo", mount)
	}
	return dev, nil
}
