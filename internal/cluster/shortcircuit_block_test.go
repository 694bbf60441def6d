package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/cluster"
)

// Short-circuit reads of any committed block (shortcircuit_block.go): the
// in-process datanodes all run on the test's host, so a client reads their
// block files itself.

func startSC(t testing.TB, off bool) (*cluster.Cluster, string) {
	t.Helper()
	// A short directory: a Unix socket's path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "scb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Datanodes: 3,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20, NoShortCircuit: off})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, dir
}

func scServed(c *cluster.Cluster) (served, denied, notAvail uint64) {
	for i := range 3 {
		s, d, n := c.Datanode(i).ShortCircuitBlockStats()
		served, denied, notAvail = served+s, denied+d, notAvail+n
	}
	return
}

// TestShortCircuitBlockRead: a key (several blocks) read by a client on
// the datanodes' host comes from the block files the datanodes pass over
// their sockets, right data; a ranged read too; and a forged or expired
// token gets no descriptor.
func TestShortCircuitBlockRead(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(21, 10<<20+12345) // three blocks of 4 MiB
	put(t, cl, "k", data)
	reader := newClient(t, c, "/dc1/rack1")
	if got := get(t, reader, "k"); !bytes.Equal(got, data) {
		t.Fatal("short-circuit read: wrong data")
	}
	st := reader.ShortCircuitBlockStats()
	served, _, _ := scServed(c)
	if st.Reads == 0 || st.Bytes != uint64(len(data)) || st.Opened < 3 || served < 3 || st.Fallbacks != 0 {
		t.Fatalf("client %+v, datanodes served %d: want every byte from block files (3 blocks)", st, served)
	}
	// A ranged read across a block boundary, not aligned to checksum
	// windows.
	r, err := reader.GetKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 300_001)
	if _, err := r.ReadAt(p, 4<<20-77_777); err != nil || !bytes.Equal(p, data[4<<20-77_777:][:len(p)]) {
		t.Fatalf("ranged read: %v", err)
	}
	r.Close()
	if st2 := reader.ShortCircuitBlockStats(); st2.Bytes != st.Bytes+uint64(len(p)) {
		t.Fatalf("ranged read: %+v after %+v", st2, st)
	}

	// Tokens are checked as ReadBlock checks them.
	b := blocksOf(t, cl, "k")[0]
	dn := b.Replicas[0]
	idx, _ := dnIndex(t, c, 3, dn.ID)
	sock := filepath.Join(dir, fmt.Sprintf("dn%d", idx+1), "short-circuit.sock")
	if err := client.FetchBlockFileForTest(sock, dn.ID, b.ContainerID, b.LocalID, b.Token); err != nil {
		t.Fatalf("genuine token: %v", err)
	}
	_, denied0, _ := scServed(c)
	if err := client.FetchBlockFileForTest(sock, dn.ID, b.ContainerID, b.LocalID, []byte("forged")); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("forged token: %v, want refused", err)
	}
	expired, err := c.Datanode(idx).TokenKeys().Issue(time.Now(), claimsExpired(t, b.Token))
	if err != nil {
		t.Fatal(err)
	}
	if err := client.FetchBlockFileForTest(sock, dn.ID, b.ContainerID, b.LocalID, expired); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("expired token: %v, want refused as expired", err)
	}
	// Another block's token.
	b2 := blocksOf(t, cl, "k")[1]
	if err := client.FetchBlockFileForTest(sock, dn.ID, b.ContainerID, b.LocalID, b2.Token); err == nil {
		t.Fatal("block 2's token passed block 1's file")
	}
	if _, denied, _ := scServed(c); denied != denied0+3 {
		t.Fatalf("denied %d, want %d", denied, denied0+3)
	}
	// The socket names the datanode that answers: a client does not take
	// it for another's.
	if err := client.FetchBlockFileForTest(sock, dn.ID+1000, b.ContainerID, b.LocalID, b.Token); err == nil {
		t.Fatal("a socket answered for another datanode")
	}
}

// TestShortCircuitBlockCorrupt: a byte flipped in the block file of the
// replica read first is caught by the client's checksum check, and the
// read is served by another replica, which (its socket gone, as for a
// replica on another host) is read over gRPC.
func TestShortCircuitBlockCorrupt(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(22, 3<<20)
	put(t, cl, "k", data)
	reader := newClient(t, c, "/dc1/rack1")
	r, err := reader.GetKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b := r.Info().Blocks[0]
	first := b.Replicas[0].ID // readBlock's first choice
	for i := range 3 {
		if c.Datanode(i).ID() == first {
			continue
		}
		if err := os.Remove(filepath.Join(dir, fmt.Sprintf("dn%d", i+1), "short-circuit.sock")); err != nil {
			t.Fatal(err)
		}
	}
	fi, _ := dnIndex(t, c, 3, first)
	path := blockFile(dir, fi, b.ContainerID, b.LocalID)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	one := []byte{0}
	if _, err := f.ReadAt(one, 1<<20+5); err != nil {
		t.Fatal(err)
	}
	one[0] ^= 0x40
	if _, err := f.WriteAt(one, 1<<20+5); err != nil {
		t.Fatal(err)
	}
	f.Close()
	got := make([]byte, len(data))
	if _, err := r.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read with a corrupt local replica: %v", err)
	}
	st := reader.ShortCircuitBlockStats()
	if st.Opened != 1 || st.Fallbacks == 0 || st.Bytes != 0 {
		t.Fatalf("client %+v: want the local file opened, its checksum mismatch a fallback, nothing served from it", st)
	}
}

// TestShortCircuitMappedCorrupt: WriteTo, which verifies a mapped piece
// step by step as it writes it, with a byte flipped in the local replica:
// the steps before the bad window come from the mapping, the rest of the
// piece is read the ordinary way, which finds the replica corrupt and
// reads another (over gRPC: the others' sockets removed); the bytes are
// right.
func TestShortCircuitMappedCorrupt(t *testing.T) {
	c, dir := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(24, 3<<20)
	put(t, cl, "k", data)
	reader := newClient(t, c, "/dc1/rack1")
	r, err := reader.GetKey(context.Background(), "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b := r.Info().Blocks[0]
	first := b.Replicas[0].ID
	for i := range 3 {
		if c.Datanode(i).ID() != first {
			if err := os.Remove(filepath.Join(dir, fmt.Sprintf("dn%d", i+1), "short-circuit.sock")); err != nil {
				t.Fatal(err)
			}
		}
	}
	fi, _ := dnIndex(t, c, 3, first)
	f, err := os.OpenFile(blockFile(dir, fi, b.ContainerID, b.LocalID), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	one := []byte{0}
	if _, err := f.ReadAt(one, 1<<20+5); err != nil {
		t.Fatal(err)
	}
	one[0] ^= 0x40
	if _, err := f.WriteAt(one, 1<<20+5); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var buf bytes.Buffer
	if n, err := r.WriteTo(&buf); err != nil || n != int64(len(data)) || !bytes.Equal(buf.Bytes(), data) {
		t.Fatalf("WriteTo with a corrupt local replica: %d bytes, %v", n, err)
	}
	if st := reader.ShortCircuitBlockStats(); st.Mapped == 0 || st.Mapped > 1<<20+5 || st.Fallbacks == 0 {
		t.Fatalf("WriteTo with a corrupt local replica: %+v: want the steps before the bad window mapped, then a fallback", st)
	}
}

// TestShortCircuitBlockOff: datanodes without the socket register none;
// clients read over gRPC.
func TestShortCircuitBlockOff(t *testing.T) {
	c, dir := startSC(t, true)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(23, 5<<20)
	put(t, cl, "k", data)
	if got := get(t, cl, "k"); !bytes.Equal(got, data) {
		t.Fatal("wrong data")
	}
	if st := cl.ShortCircuitBlockStats(); st.Reads != 0 || st.Opened != 0 {
		t.Fatalf("client %+v with the sockets off", st)
	}
	if _, err := os.Stat(filepath.Join(dir, "dn1", "short-circuit.sock")); err == nil {
		t.Fatal("socket present with NoShortCircuit")
	}
}

// claimsExpired are tok's claims, expired a second ago.
func claimsExpired(t *testing.T, tok []byte) blocktoken.Claims {
	t.Helper()
	cl, err := blocktoken.Decode(tok)
	if err != nil {
		t.Fatal(err)
	}
	cl.ExpiryUnixMs = time.Now().Add(-time.Second).UnixMilli()
	return cl
}

// sendfileWriter is a client.FileSender that reads what it is asked to
// send from the file (as sendfile would) into buf.
type sendfileWriter struct {
	buf  bytes.Buffer
	sent int64
}

func (w *sendfileWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }

func (w *sendfileWriter) SendFile(f *os.File, n int64) (int64, error) {
	k, err := io.CopyN(&w.buf, f, n)
	w.sent += k
	return k, err
}

// TestShortCircuitMappedWriteRange: WriteRange (WriteTo, the S3 GET path)
// of a key whose blocks are all local passes every byte on from the
// mapped block files without a copy in user space (the regression check
// of the mapped read: Mapped == Bytes), to a plain writer from the
// mapping and to a FileSender as file ranges (sendfile), also for a range
// that starts and ends inside checksum windows. ReadAt, which copies into
// the caller's buffer, is served from the mapping too.
func TestShortCircuitMappedWriteRange(t *testing.T) {
	c, _ := startSC(t, false)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	data := randData(23, 10<<20+12345) // three blocks of 4 MiB
	put(t, cl, "k", data)
	reader := newClient(t, c, "/dc1/rack1")
	ctx := context.Background()
	r, err := reader.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var plain bytes.Buffer
	if n, err := r.WriteTo(&plain); err != nil || n != int64(len(data)) || !bytes.Equal(plain.Bytes(), data) {
		t.Fatalf("WriteTo: %d bytes, %v; equal %v", n, err, bytes.Equal(plain.Bytes(), data))
	}
	st := reader.ShortCircuitBlockStats()
	if st.Bytes != uint64(len(data)) || st.Mapped != st.Bytes || st.Sent != 0 || st.Fallbacks != 0 {
		t.Fatalf("WriteTo to a plain writer: %+v, want all %d bytes passed on from mappings", st, len(data))
	}
	sw := &sendfileWriter{}
	off, n := int64(4<<20-1000), int64(5<<20+77)
	if k, err := r.WriteRange(sw, off, n); err != nil || k != n || !bytes.Equal(sw.buf.Bytes(), data[off:off+n]) {
		t.Fatalf("WriteRange to a FileSender: %d bytes, %v", k, err)
	}
	st2 := reader.ShortCircuitBlockStats()
	if st2.Sent-st.Sent != uint64(n) || sw.sent != n || st2.Mapped-st.Mapped != uint64(n) {
		t.Fatalf("WriteRange to a FileSender: %+v after %+v, the writer sent %d: want all %d bytes sent", st2, st, sw.sent, n)
	}
	p := make([]byte, 300_001)
	if _, err := r.ReadAt(p, 8<<20-77_777); err != nil || !bytes.Equal(p, data[8<<20-77_777:][:len(p)]) {
		t.Fatalf("ranged read: %v", err)
	}
	if st3 := reader.ShortCircuitBlockStats(); st3.Bytes != st2.Bytes+uint64(len(p)) || st3.Mapped != st2.Mapped || st3.Opened != 3 {
		t.Fatalf("ReadAt: %+v after %+v", st3, st2)
	}
}
