package storage

import (
	"errors"
	"os"
	"testing"
)

// TestRecoverUnhealthy: RecoverUnhealthy brings an UNHEALTHY container
// back CLOSED with its committed blocks verified and the data beyond them
// (a chunk of a block never committed) discarded, durably across a
// reopen; it refuses a container that is not UNHEALTHY, keeps it
// UNHEALTHY when the caller's last check or a block's verification fails
// (naming the block), and a closed container takes no writes.
func TestRecoverUnhealthy(t *testing.T) {
	posixOnly(t) // edits posix block files
	vol := t.TempDir()
	o := Options{Volumes: []string{vol}, ContainerSize: 1 << 30, DirectIO: DirectOff}
	s := openStore(t, o)
	mustCreate(t, s, 1)
	mustCreate(t, s, 2)
	b1, b2 := blockBytes(1, 1, 300<<10), blockBytes(1, 2, 200<<10)
	writeBlock(t, s, 1, 1, b1, 64<<10, DefaultChecksum, 5)
	writeBlock(t, s, 1, 2, b2, 64<<10, DefaultChecksum, 6)
	writeBlock(t, s, 2, 1, b1, 64<<10, DefaultChecksum, 5)
	// A chunk of block 3 that was never committed (its entry failed).
	p := blockBytes(1, 3, 64<<10)
	if err := s.WriteChunk(1, 3, 0, p, DefaultChecksum.Compute(p), true); err != nil {
		t.Fatal(err)
	}
	if _, err := s.RecoverUnhealthy(1, VerifyOptions{}, nil); !errors.Is(err, ErrContainerNotOpen) {
		t.Fatalf("recover an OPEN container: %v, want refused", err)
	}
	for _, cid := range []ContainerID{1, 2} {
		if err := s.MarkUnhealthy(cid, "test: apply bug"); err != nil {
			t.Fatal(err)
		}
	}
	boom := errors.New("still in a pipeline")
	if _, err := s.RecoverUnhealthy(1, VerifyOptions{}, func() error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("a failing last check: %v", err)
	}
	if r, _ := s.Container(1); r.State != StateUnhealthy {
		t.Fatalf("after a failed check: %v, want UNHEALTHY", r.State)
	}
	flipByte(t, blockPath(vol, 2, 1), 70<<10)
	if _, err := s.RecoverUnhealthy(2, VerifyOptions{}, nil); !errors.Is(err, ErrCorruption) {
		t.Fatalf("recover a damaged container: %v, want corruption", err)
	} else {
		wantErr(t, err, ErrCorruption, "container 2", "block 1")
	}
	if r, _ := s.Container(2); r.State != StateUnhealthy {
		t.Fatalf("damaged container after recover: %v, want UNHEALTHY", r.State)
	}
	st, err := s.RecoverUnhealthy(1, VerifyOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st.Blocks != 2 || st.Bytes != int64(len(b1)+len(b2)) {
		t.Fatalf("verified %+v", st)
	}
	check := func(s *Store) {
		t.Helper()
		r, err := s.Container(1)
		if err != nil || r.State != StateClosed || r.BCSID != 6 || r.BlockCount != 2 {
			t.Fatalf("recovered container: %+v %v, want CLOSED, BCSID 6, 2 blocks", r, err)
		}
		checkBlock(t, s, 1, 1, b1)
		checkBlock(t, s, 1, 2, b2)
		if ok, _ := s.HasChunk(1, 3, 0, int64(len(p))); ok {
			t.Fatal("the uncommitted chunk of block 3 is still held")
		}
		if _, err := os.Stat(blockPath(vol, 1, 3)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("block 3's file: %v, want removed", err)
		}
		if err := s.WriteChunk(1, 4, 0, p, DefaultChecksum.Compute(p), true); !errors.Is(err, ErrContainerNotOpen) {
			t.Fatalf("write into the recovered container: %v, want refused", err)
		}
	}
	check(s)
	if _, err := s.RecoverUnhealthy(1, VerifyOptions{}, nil); !errors.Is(err, ErrContainerNotOpen) {
		t.Fatalf("recover again: %v, want refused (CLOSED)", err)
	}
	s.Close()
	check(openStore(t, o))
}
