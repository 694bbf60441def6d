package store

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/vfs"
)

// TestOpenOnFullDisk: a store reopened on a disk with no byte left removes
// its ballast and opens (Pebble's open used to wait forever for a flush it
// could not write), with everything committed before intact; CheckSpace
// then refuses.
func TestOpenOnFullDisk(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{Capacity: 64 << 20})
	opts := Options{FS: fs, SyncInterval: -1, ReserveBytes: 4 << 20, BallastBytes: 4 << 20, CacheBytes: 1 << 20}
	s, err := Open("/meta/ns", opts)
	if err != nil {
		t.Fatal(err)
	}
	for i := uint64(1); i <= 100; i++ {
		b := s.NewBatch()
		if err := b.Set([]byte(fmt.Sprintf("k%03d", i)), make([]byte, 1000), nil); err != nil {
			t.Fatal(err)
		}
		if err := s.Commit(b, i); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CheckSpace(100); err != nil {
		t.Fatalf("CheckSpace on an empty disk: %v", err)
	}
	crashed := fs.Crash() // no Close: the WAL is replayed at Open
	s.Close()
	crashed.SetCapacity(crashed.Used())
	opts.FS = crashed
	done := make(chan error, 1)
	go func() {
		var err error
		s, err = Open("/meta/ns", opts)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Open on a full disk still blocked after 30s")
	}
	defer s.Close()
	if got := s.AppliedIndex(); got != 100 {
		t.Fatalf("applied index %d after reopening, want 100", got)
	}
	if ok, _ := vfs.Exists(crashed, "/meta/ns/emergency.ballast"); ok {
		t.Fatal("ballast kept on a full disk")
	}
	if err := s.CheckSpace(1); !errors.Is(err, ErrDiskFull) {
		t.Fatalf("CheckSpace on a full disk = %v, want ErrDiskFull", err)
	}
}
