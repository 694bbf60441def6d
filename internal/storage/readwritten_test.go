package storage

import (
	"bytes"
	"errors"
	"testing"
)

func TestReadWrittenServesUncommittedData(t *testing.T) {
	dir := t.TempDir()
	s := openStore(t, Options{Volumes: []string{dir}, KeepUncommitted: true})
	mustCreate(t, s, 1)
	data := blockBytes(1, 7, 3<<20)
	sum := DefaultChecksum.Compute(data[1<<20:])
	if err := s.WriteChunk(1, 7, 0, data[:1<<20], DefaultChecksum.Compute(data[:1<<20]), true); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteChunk(1, 7, 1<<20, data[1<<20:], sum, true); err != nil {
		t.Fatal(err)
	}
	got, err := s.ReadWritten(1, 7, 1<<20, 2<<20, sum)
	if err != nil || !bytes.Equal(got, data[1<<20:]) {
		t.Fatalf("ReadWritten of an uncommitted chunk: %v", err)
	}
	// A committed read refuses the uncommitted block.
	if _, err := s.ReadChunk(1, 7, 0, 10); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("ReadChunk of uncommitted block: %v", err)
	}
	// Wrong checksums are caught, missing data is ErrBlockNotFound.
	bad := DefaultChecksum.Compute(bytes.Repeat([]byte{1}, 2<<20))
	if _, err := s.ReadWritten(1, 7, 1<<20, 2<<20, bad); !errors.Is(err, ErrCorruption) {
		t.Fatalf("mismatch: %v", err)
	}
	if _, err := s.ReadWritten(1, 8, 0, 1<<20, DefaultChecksum.Compute(data[:1<<20])); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("missing block: %v", err)
	}
	if _, err := s.ReadWritten(1, 7, 2<<20, 2<<20, ChecksumData{}); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("short data: %v", err)
	}
	// After a restart with KeepUncommitted the data is still there.
	s.Close()
	s = openStore(t, Options{Volumes: []string{dir}, KeepUncommitted: true})
	got, err = s.ReadWritten(1, 7, 1<<20, 2<<20, sum)
	if err != nil || !bytes.Equal(got, data[1<<20:]) {
		t.Fatalf("ReadWritten after restart: %v", err)
	}
}
