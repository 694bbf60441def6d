package storage_test

import (
	"fmt"
	"path/filepath"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/storage/zoned"
	"github.com/basalt-store/basalt/internal/vfs"
)

// The storage suite runs a second time on the zoned backend over an
// emulated zonefs (zoned.EmuFS) beside each volume's DB, on the same FS, so
// crash tests on the in-memory FS crash the zones too. EmuFS fails any
// call that breaks a zonefs rule; the run fails if one was recorded.
func init() {
	storage.RegisterSuiteBackend("zoned", func(fs vfs.FS, dir string) (storage.BlockFiles, error) {
		vol := filepath.Dir(dir) // <volume>/basalt
		g := zoned.Geometry{Zones: 160, ZoneSize: 64 << 20, ZoneCap: 64 << 20, MaxOpen: 6, MaxActive: 8, BlockSize: 4096}
		emu, err := zoned.NewEmuFS(fs, filepath.Join(vol, "zonefs"), g)
		if err != nil {
			return nil, err
		}
		return zoned.New(zoned.Config{Mount: filepath.Join(vol, "zonefs"), FS: emu, MetaDir: filepath.Join(vol, "zoned-meta"), MetaFS: fs, StageBytes: 256 << 10})
	}, func() error {
		if n := zoned.Violations.Load(); n > 0 {
			return fmt.Errorf("%d zonefs rule violations", n)
		}
		return nil
	})
}
