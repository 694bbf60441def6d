package storage

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"sync"
	"testing"
)

// Fuzz targets for every decoder that reads bytes from disk or from another
// datanode: block, chunk, container and counter records, keys, checksum
// metadata, and the export stream. Seeds live in testdata/fuzz (plain
// go test runs them); run one with, e.g.,
//
//	go test ./internal/storage -run '^$' -fuzz '^FuzzDecodeBlock$' -fuzztime 60s -fuzzminimizetime 5s
//
// (FuzzImport runs a store per input: without a short minimize time the
// fuzzer spends its minute shrinking the first new input.)

func seedBlock() BlockData {
	data := blockBytes(1, 1, 5000)
	bd := BlockData{LocalID: 3, Length: 5000, BCSID: 9}
	bd.Chunks = []ChunkInfo{
		{0, 4096, Checksum{ChecksumCRC32C, 1024}.Compute(data[:4096])},
		{4096, 904, Checksum{ChecksumSHA256, 512}.Compute(data[4096:])},
	}
	return bd
}

func FuzzDecodeBlock(f *testing.F) {
	bd := seedBlock()
	f.Add(encodeBlock(&bd))
	f.Add(encodeBlock(&BlockData{LocalID: 1}))
	f.Fuzz(func(t *testing.T, b []byte) {
		bd, err := decodeBlock(b)
		if err != nil {
			return
		}
		if err := checkChunks(&bd); err != nil {
			t.Fatalf("decoded block breaks its invariant: %v", err)
		}
		again, err := decodeBlock(encodeBlock(&bd))
		if err != nil || again.LocalID != bd.LocalID || again.Length != bd.Length || again.BCSID != bd.BCSID || len(again.Chunks) != len(bd.Chunks) {
			t.Fatalf("round trip: %+v -> %+v, %v", bd, again, err)
		}
		// What reads do with a record must be safe: verify a window of
		// each chunk (short data: the window math must hold).
		for _, ch := range bd.Chunks {
			n := min(ch.Length, 4096)
			ch.Checksum.verifyRange(make([]byte, n), 0)
		}
	})
}

func FuzzDecodeChunk(f *testing.F) {
	data := blockBytes(1, 2, 3000)
	f.Add(encodeChunk(3000, DefaultChecksum.Compute(data)))
	f.Add(encodeChunk(3000, Checksum{ChecksumSHA256, 512}.Compute(data)))
	f.Add(encodeChunk(1, ChecksumData{}))
	f.Add(encodeChunkRec(3000, DefaultChecksum.Compute(data), true))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, sum, small, err := decodeChunkRec(b)
		if err != nil {
			return
		}
		if n <= 0 || n > MaxChunkSize {
			t.Fatalf("decoded chunk length %d", n)
		}
		if err := ValidateChunk(0, n, sum); err != nil {
			t.Fatalf("decoded chunk fails validation: %v", err)
		}
		n2, sum2, small2, err := decodeChunkRec(encodeChunkRec(n, sum, small))
		if err != nil || n2 != n || !sum2.equal(sum) || small2 != small {
			t.Fatalf("round trip: %d %+v -> %d %+v, %v", n, sum, n2, sum2, err)
		}
		sum.Verify(make([]byte, min(n, 1<<16)))
	})
}

func FuzzContainerRecords(f *testing.F) {
	f.Add(containerRecord{State: StateClosed, MaxSize: 5 << 30}.encode())
	f.Add(counters{Used: 100, Blocks: 2, BCSID: 7}.encode())
	f.Add(makeKey(1, kindBlock, 2))
	f.Add(makeChunkKey(1, 2, 4096))
	f.Fuzz(func(t *testing.T, b []byte) {
		if r, err := decodeContainerRecord(b); err == nil {
			if r.State > StateUnhealthy || !bytes.Equal(r.encode(), b) {
				t.Fatalf("container record %x decoded as %+v", b, r)
			}
		}
		if c, err := decodeCounters(b); err == nil && !bytes.Equal(c.encode(), b) {
			t.Fatalf("counters %x decoded as %+v", b, c)
		}
		if cid, kind, id, ok := parseKey(b); ok && !bytes.Equal(makeKey(cid, kind, id), b) {
			t.Fatalf("key %x parsed as %d/%d/%d", b, cid, kind, id)
		}
		if cid, lid, off, ok := parseChunkKey(b); ok && !bytes.Equal(makeChunkKey(cid, lid, off), b) {
			t.Fatalf("chunk key %x parsed as %d/%d/%d", b, cid, lid, off)
		}
	})
}

// FuzzChecksum: checksum metadata arrives from clients and peers; checking
// data against any of it must never panic or hang, and metadata that
// validates must verify the data it was computed from.
func FuzzChecksum(f *testing.F) {
	f.Add(uint8(ChecksumCRC32C), uint32(512), []byte{1, 2, 3, 4}, []byte("hello"))
	f.Add(uint8(ChecksumSHA256), uint32(0), []byte{}, []byte("hello"))
	f.Add(uint8(ChecksumCRC32C), uint32(65536), []byte{}, []byte{})
	f.Fuzz(func(t *testing.T, typ uint8, bpc uint32, sums, data []byte) {
		d := ChecksumData{Type: ChecksumType(typ), BytesPerChecksum: bpc, Sums: sums}
		d.Verify(data)
		if len(data) == 0 {
			return
		}
		if err := ValidateChunk(0, int64(len(data)), d); err != nil {
			return
		}
		if d.Type == ChecksumNone {
			return
		}
		good := Checksum{d.Type, int(bpc)}.Compute(data)
		if good.Verify(data) != -1 {
			t.Fatalf("computed checksums of type %v window %d fail their own data", d.Type, bpc)
		}
	})
}

var (
	fuzzStoreOnce sync.Once
	fuzzStore     *Store
	fuzzStoreErr  error
)

// FuzzImport feeds export streams to Import on an in-memory volume: a bad
// stream is ErrBadExport (or another refusal) and leaves nothing; a stream
// that imports yields counters that match its blocks, and every block reads
// back verified. The input is the stream without its SHA-256 trailer, which
// the target appends, so mutations reach the checks behind the hash.
func FuzzImport(f *testing.F) {
	seed := seedExport(f)
	f.Add(seed[:len(seed)-sha256.Size])
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzStoreOnce.Do(func() {
			fuzzStore, fuzzStoreErr = Open(Options{Volumes: []string{"/vol"}, FS: newCrashFS(), ContainerSize: 1 << 30})
		})
		if fuzzStoreErr != nil {
			t.Fatal(fuzzStoreErr)
		}
		s := fuzzStore
		// A fresh container ID per input, so every input is parsed fully.
		b = bytes.Clone(b)
		if len(b) >= 16 {
			binary.BigEndian.PutUint64(b[8:], uint64(len(s.ListContainers())+1000))
		}
		sum := sha256.Sum256(b)
		b = append(b, sum[:]...)
		before := len(s.ListContainers())
		rep, err := s.Import(bytes.NewReader(b))
		if err != nil {
			if errors.Is(err, ErrContainerExists) {
				return
			}
			if n := len(s.ListContainers()); n != before {
				t.Fatalf("failed import (%v) left %d containers, had %d", err, n, before)
			}
			return
		}
		blocks, err := s.ListBlocks(rep.ID, 0, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		var used int64
		for _, bd := range blocks {
			used += bd.Length
			if bd.Length > 0 {
				if _, err := s.ReadChunk(rep.ID, bd.LocalID, 0, bd.Length); err != nil {
					t.Fatalf("imported block %d does not read back: %v", bd.LocalID, err)
				}
			}
		}
		if int64(len(blocks)) != rep.BlockCount || used != rep.UsedBytes || rep.State != StateClosed {
			t.Fatalf("import reported %+v, holds %d blocks of %d bytes", rep, len(blocks), used)
		}
	})
}

// seedExport is the export of a small CLOSED container: two blocks with
// CRC32C and SHA-256 windows and an empty one.
func seedExport(tb testing.TB) []byte {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: newCrashFS(), ContainerSize: 1 << 30})
	if err != nil {
		tb.Fatal(err)
	}
	defer s.Close()
	if _, err := s.CreateContainer(7, CreateOptions{}); err != nil {
		tb.Fatal(err)
	}
	bd := seedBlock()
	data := blockBytes(1, 1, 5000)
	for _, ch := range bd.Chunks {
		if err := s.WriteChunk(7, bd.LocalID, ch.Offset, data[ch.Offset:ch.Offset+ch.Length], ch.Checksum, true); err != nil {
			tb.Fatal(err)
		}
	}
	if err := s.PutBlock(7, bd); err != nil {
		tb.Fatal(err)
	}
	if err := s.PutBlock(7, BlockData{LocalID: 4, BCSID: 10}); err != nil {
		tb.Fatal(err)
	}
	if err := s.CloseContainer(7); err != nil {
		tb.Fatal(err)
	}
	var buf bytes.Buffer
	if err := s.Export(7, &buf); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

// TestImportRefusesRepeatedBlock: an export stream naming one block twice
// used to import with the block counted twice (counters 2 blocks, one
// record); block IDs must strictly increase, as Export writes them.
func TestImportRefusesRepeatedBlock(t *testing.T) {
	data := blockBytes(1, 1, 5000)
	bd := seedBlock()
	rec := encodeBlock(&bd)
	var body []byte
	body = append(body, exportMagic...)
	for _, v := range []uint64{9, 1 << 30, bd.BCSID, 2, 2 * uint64(bd.Length)} {
		body = binary.BigEndian.AppendUint64(body, v)
	}
	for range 2 {
		body = binary.BigEndian.AppendUint32(body, uint32(len(rec)))
		body = append(body, rec...)
		body = append(body, data...)
	}
	sum := sha256.Sum256(body)
	s := openStore(t, Options{})
	_, err := s.Import(bytes.NewReader(append(body, sum[:]...)))
	wantErr(t, err, ErrBadExport, "container 9", "block 3")
	if len(s.ListContainers()) != 0 {
		t.Fatal("refused import left a container")
	}
}
