package storage

import (
	"errors"
	"os"
	"testing"
)

// TestAbortBlock: a broken stream's data goes away (file removed for a new
// block, truncated to the committed length for an extension), committed
// data stays readable, and the slot and pending bytes are released.
func TestAbortBlock(t *testing.T) {
	posixOnly(t)
	dir := t.TempDir()
	s := openStore(t, Options{Volumes: []string{dir}, KeepUncommitted: true})
	mustCreate(t, s, 1)
	blockFile := func(lid LocalID) string { return s.volumes[0].files.(*Posix).path(1, lid) }

	// A new block: written through a stream, never committed.
	data := blockBytes(1, 5, 2<<20+17)
	w := s.OpenStream(1, 5, 0)
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(blockFile(5)); err != nil {
		t.Fatalf("block file before abort: %v", err)
	}
	if err := w.Abort(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(blockFile(5)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("block file after abort: %v, want it gone", err)
	}
	if _, err := s.GetBlock(1, 5); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("GetBlock after abort: %v", err)
	}
	if n := s.openBlocks.Load(); n != 0 {
		t.Fatalf("%d open blocks after abort", n)
	}
	if err := s.AbortBlock(1, 5); err != nil {
		t.Fatalf("second abort: %v", err)
	}
	// The block ID is usable again from offset 0.
	writeBlock(t, s, 1, 5, data[:1<<20], 1<<20, DefaultChecksum, 1)

	// An extension of a committed block: the extra bytes go, the rest stays.
	w = s.OpenStream(1, 5, 1<<20)
	if _, err := w.Write(data[1<<20:]); err != nil {
		t.Fatal(err)
	}
	if err := w.Abort(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(blockFile(5)); err != nil || fi.Size() != 1<<20 {
		t.Fatalf("block file after aborted extension: %v, %v; want %d bytes", fi, err, 1<<20)
	}
	checkBlock(t, s, 1, 5, data[:1<<20])
	c, _ := s.Container(1)
	if c.UsedBytes != 1<<20 {
		t.Fatalf("used %d after abort, want %d", c.UsedBytes, 1<<20)
	}
	if _, err := s.container("test", 1); err != nil {
		t.Fatal(err)
	}
	if p := s.containers[1].pending; p != 0 {
		t.Fatalf("pending %d after abort, want 0", p)
	}
	if err := s.AbortBlock(9, 1); !errors.Is(err, ErrContainerNotFound) {
		t.Fatalf("abort in unknown container: %v", err)
	}
}
