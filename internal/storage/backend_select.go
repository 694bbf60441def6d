package storage

import (
	"io"

	"github.com/basalt-store/basalt/internal/vfs"
)

// Backend selection hook. A volume's block data goes through the backend
// Options.NewBackend builds (posix by default; the zoned backend of
// internal/storage/zoned for zonefs volumes, chosen per volume by the
// datanode's --volumes zoned:<mount>). A backend may also implement:
//   - SpaceReporter, when its capacity is not that of the file system under
//     the volume directory (a zoned volume keeps only its Pebble DB there):
//     volume placement and the reports to SCM then use its figures;
//   - io.Closer, to release what it holds (the zoned backend's own DB and
//     zone files) when the store closes.

// SpaceReporter reports a backend's own free and total bytes.
type SpaceReporter interface {
	DiskUsage() (avail, total int64, err error)
}

// testBackend, when set (only by tests, see backend_select_test.go),
// replaces posix as the default backend, so the storage suite runs on
// another backend too.
var testBackend func(fs vfs.FS, dir string) (BlockFiles, error)

func defaultBackend(mode DirectIO) func(fs vfs.FS, dir string) (BlockFiles, error) {
	if testBackend != nil {
		return testBackend
	}
	return func(fs vfs.FS, dir string) (BlockFiles, error) { return NewPosix(fs, dir, mode) }
}

func backendUsage(files BlockFiles) (avail, total int64, ok bool, err error) {
	r, ok := files.(SpaceReporter)
	if !ok {
		return 0, 0, false, nil
	}
	avail, total, err = r.DiskUsage()
	return avail, total, true, err
}

func closeBackend(files BlockFiles) error {
	if c, ok := files.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
