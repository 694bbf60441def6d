package storage

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/vfs"
)

// openWithin opens a store, failing the test if Open has not returned
// within d (Pebble's open hangs forever on a full disk).
func openWithin(t *testing.T, o Options, d time.Duration) *Store {
	t.Helper()
	type res struct {
		s   *Store
		err error
	}
	ch := make(chan res, 1)
	go func() { s, err := Open(o); ch <- res{s, err} }()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatal(r.err)
		}
		t.Cleanup(func() { r.s.Close() })
		return r.s
	case <-time.After(d):
		t.Fatalf("Open on a full disk still blocked after %v", d)
		return nil
	}
}

// TestDiskFullHeadroom fills a volume with block data: writes are refused
// with ErrDiskFull before Pebble meets ENOSPC, so metadata writes (a state
// change, which used to panic in Pebble) still succeed and every
// acknowledged block stays intact. Then the disk fills up completely
// (another user of it) and the node restarts: Open removes the ballast and
// returns instead of hanging, the volume refuses writes and serves reads.
func TestDiskFullHeadroom(t *testing.T) {
	posixOnly(t) // the zones' free space is not the file system's
	fs := vfs.NewMem(vfs.MemOptions{Capacity: 40 << 20})
	var logs []string
	o := Options{Volumes: []string{"/vol"}, FS: fs, ContainerSize: 30 << 20, MetaReserveBytes: 4 << 20, BallastBytes: 4 << 20,
		KeepUncommitted: true, Logf: func(f string, a ...any) { logs = append(logs, fmt.Sprintf(f, a...)) }}
	s := openWithin(t, o, 30*time.Second)
	if o.BallastBytes > 0 && !s.volumes[0].space.HasBallast() {
		t.Fatal("no ballast on an empty disk")
	}
	for cid := ContainerID(1); cid <= 3; cid++ {
		mustCreate(t, s, cid)
	}
	var acked []LocalID // block lid is in container 1+lid%2
	var full error
	for lid := LocalID(1); lid < 200; lid++ {
		if _, err := tryWriteBlock(s, 1+ContainerID(lid%2), lid, blockBytes(1, lid, 1<<20), 256<<10, DefaultChecksum, uint64(lid)); err != nil {
			full = err
			break
		}
		acked = append(acked, lid)
	}
	if !errors.Is(full, ErrDiskFull) {
		t.Fatalf("filling the disk ended with %v, want ErrDiskFull", full)
	}
	if len(acked) < 20 {
		t.Fatalf("only %d MiB written before disk full", len(acked))
	}
	// Metadata still has room: these are synced Pebble writes.
	if err := s.MarkUnhealthy(3, "test"); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseContainer(1); err != nil {
		t.Fatal(err)
	}
	for _, lid := range acked {
		checkBlock(t, s, 1+ContainerID(lid%2), lid, blockBytes(1, lid, 1<<20))
	}

	// Crash, and let the disk fill to the last byte before the restart.
	crashed := fs.Crash()
	crashed.SetCapacity(crashed.Used())
	o.FS = crashed
	logs = nil
	s = openWithin(t, o, 30*time.Second)
	if s.volumes[0].space.HasBallast() {
		t.Fatal("ballast kept on a full disk")
	}
	removed := false
	for _, l := range logs {
		if contains(l, "removed the emergency ballast") {
			removed = true
		}
	}
	if !removed {
		t.Fatalf("ballast removal not logged: %q", logs)
	}
	// The ballast's room went to Pebble's reserve, not to block data.
	if v := s.Volumes()[0]; v.Failed || v.Available >= 1<<20 {
		t.Fatalf("volume after a full restart: %+v, want healthy with (nearly) nothing available", v)
	}
	if err := s.WriteChunk(2, 1000, 0, make([]byte, 64<<10), ChecksumData{}, false); !errors.Is(err, ErrDiskFull) {
		t.Fatalf("write on a full disk: %v, want ErrDiskFull", err)
	}
	for _, lid := range acked {
		checkBlock(t, s, 1+ContainerID(lid%2), lid, blockBytes(1, lid, 1<<20))
	}
	mustCreateErr := func() error { _, err := s.CreateContainer(4, CreateOptions{MaxSize: 1 << 20}); return err }
	if err := mustCreateErr(); !errors.Is(err, ErrNoVolume) {
		t.Fatalf("create on a full disk: %v, want ErrNoVolume", err)
	}
	// Space returns: the ballast comes back with the next report.
	crashed.SetCapacity(1 << 30)
	s.Volumes()
	if !s.volumes[0].space.HasBallast() {
		t.Fatal("ballast not recreated once space returned")
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}
