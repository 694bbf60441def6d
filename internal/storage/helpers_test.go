package storage

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

func openStore(t testing.TB, o Options) *Store {
	t.Helper()
	if len(o.Volumes) == 0 {
		o.Volumes = []string{t.TempDir()}
	}
	if o.ContainerSize == 0 {
		o.ContainerSize = 1 << 30
	}
	s, err := Open(o)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// blockBytes is deterministic content for (container, block), so a reader
// in another process can check it.
func blockBytes(cid ContainerID, lid LocalID, n int) []byte {
	r := rand.New(rand.NewPCG(uint64(cid), uint64(lid)))
	p := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := range 8 {
			p[i+j] = byte(v >> (8 * j))
		}
	}
	for i := n &^ 7; i < n; i++ {
		p[i] = byte(r.Uint32())
	}
	return p
}

// writeBlock writes data in chunks of chunk bytes and commits it.
func writeBlock(t testing.TB, s *Store, cid ContainerID, lid LocalID, data []byte, chunk int, ck Checksum, bcsid uint64) BlockData {
	t.Helper()
	bd, err := tryWriteBlock(s, cid, lid, data, chunk, ck, bcsid)
	if err != nil {
		t.Fatalf("write block %d/%d: %v", cid, lid, err)
	}
	return bd
}

func tryWriteBlock(s *Store, cid ContainerID, lid LocalID, data []byte, chunk int, ck Checksum, bcsid uint64) (BlockData, error) {
	bd := BlockData{LocalID: lid, Length: int64(len(data)), BCSID: bcsid}
	for off := 0; off < len(data); off += chunk {
		p := data[off:min(off+chunk, len(data))]
		sum := ck.Compute(p)
		if err := s.WriteChunk(cid, lid, int64(off), p, sum, true); err != nil {
			return bd, err
		}
		bd.Chunks = append(bd.Chunks, ChunkInfo{Offset: int64(off), Length: int64(len(p)), Checksum: sum})
	}
	return bd, s.PutBlock(cid, bd)
}

func mustCreate(t testing.TB, s *Store, cid ContainerID) {
	t.Helper()
	if _, err := s.CreateContainer(cid, CreateOptions{}); err != nil {
		t.Fatalf("create %d: %v", cid, err)
	}
}

func checkBlock(t testing.TB, s *Store, cid ContainerID, lid LocalID, want []byte) {
	t.Helper()
	got, err := s.ReadChunk(cid, lid, 0, int64(len(want)))
	if err != nil {
		t.Fatalf("read %d/%d: %v", cid, lid, err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("read %d/%d: data differs", cid, lid)
	}
}

// wantErr checks the sentinel and that the message names the inputs.
func wantErr(t testing.TB, err, kind error, names ...string) {
	t.Helper()
	if !errors.Is(err, kind) {
		t.Fatalf("got error %v, want %v", err, kind)
	}
	var se *Error
	if !errors.As(err, &se) {
		t.Fatalf("error %v is not *storage.Error", err)
	}
	for _, n := range names {
		if !strings.Contains(err.Error(), n) {
			t.Fatalf("error %q does not name %q", err, n)
		}
	}
}

func itoa(v any) string { return fmt.Sprint(v) }

// setReserved changes ReservedBytes of an open store.
func setReserved(s *Store, n int64) {
	s.opts.ReservedBytes = n
	for _, v := range s.volumes {
		v.space.SetReserve(s.reserve())
	}
}
