package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode"
)

// readPathCluster starts 3 real datanodes and writes a key of size bytes
// (blocks of 4 MiB, chunks of 1 MiB).
func readPathCluster(t *testing.T, ctx context.Context, size int) (*realCluster, *Client, []byte) {
	t.Helper()
	rc := startReal(t, ctx, 3)
	c, err := New(Config{MetaAddrs: []string{rc.meta.GRPCAddr()}, Credentials: rc.creds, Logger: quiet,
		Location: "/dc1/rack1", ChunkSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	data := randBytes(42, size)
	// Right after start-up the stream path may refuse a write until every
	// member knows its pipelines: retry until the deadline.
	for {
		_, err := c.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(data), PutOptions{})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	return rc, c, data
}

// TestReadRangesRealDatanodes: whole-key, ranged and unaligned reads
// through WriteRange, ReadAt and Read against real datanodes, which send
// unverified bytes (client_verifies) that the client decodes into its
// buffers (readSink).
func TestReadRangesRealDatanodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	_, c, data := readPathCluster(t, ctx, 10<<20+12345)
	size := int64(len(data))
	kr, err := c.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer kr.Close()
	if len(kr.Info().Blocks) < 3 {
		t.Fatalf("key has %d blocks, want 3 (4 MiB blocks)", len(kr.Info().Blocks))
	}
	for _, rg := range [][2]int64{
		{0, size}, {1, 100}, {4<<20 - 5, 10}, {4<<20 - 777, 3 << 20}, {1<<20 - 1, 2<<20 + 2},
		{size - 1, 1}, {size - 10, 100}, {8 << 20, size - 8<<20}, {12345, 0}, {size, 10},
	} {
		var out bytes.Buffer
		n, err := kr.WriteRange(&out, rg[0], rg[1])
		want := data[min(rg[0], size):min(rg[0]+rg[1], size)]
		if err != nil || n != int64(len(want)) || !bytes.Equal(out.Bytes(), want) {
			t.Fatalf("WriteRange(%d, %d) = %d, %v; content equal %v", rg[0], rg[1], n, err, bytes.Equal(out.Bytes(), want))
		}
		if rg[1] > 0 && rg[0] < size {
			p := make([]byte, min(rg[1], size-rg[0]))
			if _, err := kr.ReadAt(p, rg[0]); err != nil || !bytes.Equal(p, want) {
				t.Fatalf("ReadAt(%d, %d): %v", rg[0], len(p), err)
			}
		}
	}
	// Read in small steps after a seek, and WriteTo from the position.
	if _, err := kr.Seek(3<<20+17, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	small := make([]byte, 1000)
	if _, err := io.ReadFull(kr, small); err != nil || !bytes.Equal(small, data[3<<20+17:3<<20+1017]) {
		t.Fatalf("Read after Seek: %v", err)
	}
	var rest bytes.Buffer
	if n, err := kr.WriteTo(&rest); err != nil || n != size-(3<<20+1017) || !bytes.Equal(rest.Bytes(), data[3<<20+1017:]) {
		t.Fatalf("WriteTo after Read = %d, %v", n, err)
	}
}

// blockFile finds the block file of container cid, block lid under a
// datanode's volumes.
func blockFile(t *testing.T, d *datanode.Datanode, cid, lid uint64) string {
	t.Helper()
	var found string
	for _, v := range d.Store().Volumes() {
		filepath.WalkDir(v.Path, func(p string, e fs.DirEntry, err error) error {
			if err == nil && !e.IsDir() && e.Name() == fmt.Sprintf("%d.block", lid) && filepath.Base(filepath.Dir(p)) == fmt.Sprint(cid) {
				found = p
			}
			return nil
		})
	}
	if found == "" {
		t.Fatalf("no block file for %d/%d on datanode %d", cid, lid, d.ID())
	}
	return found
}

// TestReadDetectsFlippedByte: one byte flipped on disk in the replica the
// client reads first. The datanode no longer verifies for the client
// (client_verifies), so the client must find the bad window from the
// stored checksums, report that replica and read the block from another.
func TestReadDetectsFlippedByte(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	rc, c, data := readPathCluster(t, ctx, 6<<20)
	var mu sync.Mutex
	var reports []CorruptReport
	c.reportCorrupt = func(_ context.Context, r CorruptReport) error {
		mu.Lock()
		reports = append(reports, r)
		mu.Unlock()
		return nil
	}
	kr, err := c.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer kr.Close()
	// The replica this reader tries first for block 1.
	loc := kr.raw.Locations[1]
	cid, lid := loc.Id.GetContainerId(), loc.Id.GetLocalId()
	dnByID := func(id uint64) *datanode.Datanode {
		for _, d := range rc.dns {
			if d.ID() == id {
				return d
			}
		}
		t.Fatalf("no datanode %d", id)
		return nil
	}
	const at = 1<<20 + 4321
	flip := func(id uint64) {
		path := blockFile(t, dnByID(id), cid, lid)
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var one [1]byte
		if _, err := f.ReadAt(one[:], at); err != nil {
			t.Fatal(err)
		}
		one[0] ^= 0x40
		if _, err := f.WriteAt(one[:], at); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
	}
	first := loc.Datanodes[0].Id
	flip(first)
	var out bytes.Buffer
	if _, err := kr.WriteTo(&out); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), data) {
		t.Fatal("read returned the flipped byte: the client did not verify")
	}
	mu.Lock()
	if len(reports) != 1 || reports[0].DatanodeID != first || reports[0].LocalID != lid {
		t.Fatalf("corruption reports = %+v, want one for block %d on datanode %d", reports, lid, first)
	}
	mu.Unlock()
	// Every replica flipped: the read fails as corrupt, never returns the
	// bad bytes.
	for _, d := range loc.Datanodes[1:] {
		flip(d.Id)
	}
	kr2, err := c.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer kr2.Close()
	p := make([]byte, 100)
	_, err = kr2.ReadAt(p, int64(loc.Offset)+at-50)
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("read of a block corrupt on every replica: %v, want a corruption error", err)
	}
}

// stopAfter is a writer that runs stop once, after the first write.
type stopAfter struct {
	w    io.Writer
	once sync.Once
	stop func()
}

func (s *stopAfter) Write(p []byte) (int, error) {
	n, err := s.w.Write(p)
	s.once.Do(s.stop)
	return n, err
}

// TestReadReplicaDiesMidRead: the datanode every block is read from first
// stops while a read-ahead WriteRange is under way; the rest of the key
// comes from the other replicas, whole and in order.
func TestReadReplicaDiesMidRead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	rc, c, data := readPathCluster(t, ctx, 14<<20+99)
	st, err := c.StatKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	first := st.Blocks[0].Replicas[0].ID
	kr, err := c.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer kr.Close()
	var out bytes.Buffer
	w := &stopAfter{w: &out, stop: func() {
		for _, d := range rc.dns {
			if d.ID() == first {
				d.Close()
			}
		}
	}}
	n, err := kr.WriteRange(w, 0, int64(len(data)))
	if err != nil || n != int64(len(data)) || !bytes.Equal(out.Bytes(), data) {
		t.Fatalf("read with datanode %d stopped mid-read = %d, %v (content equal %v)", first, n, err, bytes.Equal(out.Bytes(), data))
	}
}
