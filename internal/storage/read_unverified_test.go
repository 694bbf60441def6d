package storage

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"
)

// TestReadAtUnverified: the client's read (ReadAtUnverified) returns the
// stored bytes of any range, aligned to windows or not, without checking
// them: a flipped byte comes back as is (the client verifies from the
// stored checksums), while ReadAt of the same range still fails. Range
// checks and missing blocks fail as with ReadAt.
func TestReadAtUnverified(t *testing.T) {
	posixOnly(t)
	dir := t.TempDir()
	s := openStore(t, Options{Volumes: []string{dir}})
	mustCreate(t, s, 3)
	data := blockBytes(3, 4, 9<<20+777)
	writeBlock(t, s, 3, 4, data, 1<<20, DefaultChecksum, 1)
	r := rand.New(rand.NewPCG(5, 6))
	for range 40 {
		off := r.IntN(len(data))
		n := 1 + r.IntN(len(data)-off)
		p := AlignedBuffer(n)
		if _, err := s.ReadAtUnverified(3, 4, p, int64(off)); err != nil || !bytes.Equal(p, data[off:off+n]) {
			t.Fatalf("ReadAtUnverified(%d, %d): %v", off, n, err)
		}
	}
	const at = 5<<20 + 3
	flipByte(t, blockPath(dir, 3, 4), at)
	p := AlignedBuffer(8 << 20)
	if _, err := s.ReadAt(3, 4, p, 1<<20); !errors.Is(err, ErrCorruption) {
		t.Fatalf("verified read of the flipped byte: %v", err)
	}
	if _, err := s.ReadAtUnverified(3, 4, p, 1<<20); err != nil {
		t.Fatal(err)
	}
	if d := p[at-1<<20] ^ data[at]; d != 0x5a || !bytes.Equal(p[:at-1<<20], data[1<<20:at]) {
		t.Fatalf("unverified read: flipped byte differs by %#x", d)
	}
	if _, err := s.ReadAtUnverified(3, 4, p, int64(len(data))-10); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("read past the end: %v", err)
	}
	if _, err := s.ReadAtUnverified(3, 5, p[:10], 0); !errors.Is(err, ErrBlockNotFound) {
		t.Fatalf("missing block: %v", err)
	}
}
