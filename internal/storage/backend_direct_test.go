package storage

import (
	"bytes"
	"os"
	"testing"

	"github.com/basalt-store/basalt/internal/vfs"
)

// TestSmallWriteOpensOnce: a block written with one small chunk opens its
// file once (page cache); the O_DIRECT descriptor is opened at the first
// large aligned write, and both kinds of write read back.
func TestSmallWriteOpensOnce(t *testing.T) {
	p, err := NewPosix(vfs.Default, t.TempDir(), DirectAuto)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.CreateContainer(1); err != nil {
		t.Fatal(err)
	}
	bw, err := p.OpenWriter(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer bw.Close()
	w := bw.(*posixWriter)
	small := blockBytes(1, 1, 4<<10)
	if _, err := w.WriteAt(small, 0); err != nil {
		t.Fatal(err)
	}
	if w.direct != nil {
		t.Fatal("a 4 KiB write opened an O_DIRECT descriptor")
	}
	large := AlignedBuffer(1 << 20)
	copy(large, blockBytes(1, 2, 1<<20))
	if _, err := w.WriteAt(large, 4<<10); err != nil {
		t.Fatal(err)
	}
	if w.direct == nil && !p.noDirect.Load() {
		t.Fatal("a 1 MiB aligned write did not use O_DIRECT")
	}
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(p.path(1, 1))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, append(append([]byte(nil), small...), large...)) {
		t.Fatal("file differs from what was written")
	}
}
