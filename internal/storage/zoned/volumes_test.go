package zoned

import (
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestVolumesSelectsBackends: zoned:<mount> volumes get a metadata
// directory under the datanode's data dir and the zoned backend (which
// refuses a directory that is not a zonefs mount); the others stay posix.
func TestVolumesSelectsBackends(t *testing.T) {
	meta := t.TempDir()
	plain := t.TempDir()
	notZonefs := t.TempDir()
	vols, nb := Volumes([]string{"zoned:" + notZonefs, plain}, filepath.Join(meta, "zoned"), storage.DirectAuto, nil)
	want := []string{filepath.Join(meta, "zoned", strings.ReplaceAll(strings.Trim(notZonefs, "/"), "/", "_")), plain}
	if !reflect.DeepEqual(vols, want) {
		t.Fatalf("volumes %q, want %q", vols, want)
	}
	bf, err := nb(vfs.Default, filepath.Join(plain, "basalt", "containers"))
	if _, ok := bf.(*storage.Posix); err != nil || !ok {
		t.Fatalf("plain volume: %T, %v; want posix", bf, err)
	}
	if _, err := nb(vfs.Default, filepath.Join(vols[0], "basalt", "containers")); err == nil || !strings.Contains(err.Error(), "not a zonefs mount") {
		t.Fatalf("zoned volume on a plain directory: %v, want a refusal naming zonefs", err)
	}
}
