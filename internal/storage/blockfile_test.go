package storage

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

// TestOpenBlockFile: a committed block's file is passed read-only with its
// committed description; a block with uncommitted writes, a block of an
// UNHEALTHY container, a missing block and any block of the zoned backend
// (the suite's second run) are not.
func TestOpenBlockFile(t *testing.T) {
	s := openStore(t, Options{})
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 300_000)
	writeBlock(t, s, 1, 7, data, 100_000, DefaultChecksum, 1)
	if testBackend != nil {
		if _, _, err := s.OpenBlockFile(1, 7); s.PassesBlockFiles() || !errors.Is(err, ErrNoBlockFile) {
			t.Fatalf("zoned backend: passes files %v, open: %v", s.PassesBlockFiles(), err)
		}
		return
	}
	if !s.PassesBlockFiles() {
		t.Fatal("posix store does not pass block files")
	}
	f, bd, err := s.OpenBlockFile(1, 7)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(io.NewSectionReader(f, 0, bd.Length))
	if err != nil || !bytes.Equal(got, data) || bd.Length != int64(len(data)) || len(bd.Chunks) != 3 {
		t.Fatalf("file: %d bytes (%v), block %+v", len(got), err, bd)
	}
	if _, err := f.WriteAt([]byte{1}, 0); err == nil {
		t.Fatal("the passed file is writable")
	}
	f.Close()

	// Uncommitted writes on a block: not passed.
	p := blockBytes(1, 8, 4096)
	if err := s.WriteChunk(1, 8, 0, p, DefaultChecksum.Compute(p), true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.OpenBlockFile(1, 8); !errors.Is(err, ErrNoBlockFile) {
		t.Fatalf("open block: %v, want ErrNoBlockFile", err)
	}
	if _, _, err := s.OpenBlockFile(1, 99); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("missing block: %v, want ErrBlockNotFound", err)
	}
	if err := s.MarkUnhealthy(1, "test"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.OpenBlockFile(1, 7); !errors.Is(err, ErrNoBlockFile) {
		t.Fatalf("UNHEALTHY container: %v, want ErrNoBlockFile", err)
	}
}
