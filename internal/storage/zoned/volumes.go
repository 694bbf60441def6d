package zoned

import (
	"path/filepath"
	"strings"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// VolumePrefix marks a datanode volume spec as a zonefs mount:
// "zoned:/mnt/zonefs0".
const VolumePrefix = "zoned:"

// Volumes turns datanode volume specs into the store's volumes and the
// backend-selection hook (storage.Options.NewBackend). A spec
// "zoned:<mount>" is the zonefs mounted there; zonefs holds only zone
// files, so the volume's directory (its storage Pebble DB and the zoned
// extent map) is metaRoot/<mount with / as _>, on a regular file system.
// Other specs are posix directories. logf may be nil.
func Volumes(specs []string, metaRoot string, mode storage.DirectIO, logf func(string, ...any)) ([]string, func(fs vfs.FS, dir string) (storage.BlockFiles, error)) {
	mounts := map[string]string{} // volume directory → zonefs mount
	var vols []string
	for _, s := range specs {
		m, ok := strings.CutPrefix(s, VolumePrefix)
		if !ok {
			vols = append(vols, s)
			continue
		}
		m = filepath.Clean(m)
		v := filepath.Join(metaRoot, strings.ReplaceAll(strings.Trim(m, "/"), "/", "_"))
		mounts[v] = m
		vols = append(vols, v)
	}
	return vols, func(fs vfs.FS, dir string) (storage.BlockFiles, error) {
		root := filepath.Dir(dir) // <volume>/basalt
		m, ok := mounts[filepath.Dir(root)]
		if !ok {
			return storage.NewPosix(fs, dir, mode)
		}
		return New(Config{Mount: m, FS: vfs.Default, MetaDir: filepath.Join(root, "zoned"), MetaFS: fs, Logf: logf})
	}
}

// DevGeometry is the emulated device of `basalt dev --zoned` and of the
// benchmarks: 64 zones of 256 MiB (16 GiB, sparse), 14 open and active
// zones as on common ZNS SSDs, 4 KiB blocks.
var DevGeometry = Geometry{Zones: 64, ZoneSize: 256 << 20, ZoneCap: 256 << 20, MaxOpen: 14, MaxActive: 14, BlockSize: 4096}

// Emulated returns a backend-selection hook that puts every volume's block
// data on an emulated zonefs (EmuFS, geometry g) in <volume>/basalt/zonefs,
// for machines without a zoned device.
func Emulated(g Geometry, tune func(*Config)) func(fs vfs.FS, dir string) (storage.BlockFiles, error) {
	return func(fs vfs.FS, dir string) (storage.BlockFiles, error) {
		root := filepath.Dir(dir)
		mount := filepath.Join(root, "zonefs")
		emu, err := NewEmuFS(fs, mount, g)
		if err != nil {
			return nil, err
		}
		cfg := Config{Mount: mount, FS: emu, MetaDir: filepath.Join(root, "zoned"), MetaFS: fs}
		if tune != nil {
			tune(&cfg)
		}
		return New(cfg)
	}
}
