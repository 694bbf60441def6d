package storage

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/basalt-store/basalt/internal/vfs"
)

func blockPath(vol string, cid ContainerID, lid LocalID) string {
	return filepath.Join(vol, "basalt", "containers", fmt.Sprint(uint64(cid)), fmt.Sprintf("%d.block", uint64(lid)))
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := []byte{0}
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x5a
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

func stateOf(t *testing.T, s *Store, cid ContainerID) State {
	t.Helper()
	r, err := s.Container(cid)
	if err != nil {
		t.Fatal(err)
	}
	return r.State
}

func volumeFailed(s *Store) bool {
	for _, v := range s.Volumes() {
		if v.Failed {
			return true
		}
	}
	return false
}

// TestVerifyBlockFindsFlippedByte: one flipped byte in the middle of a
// 9 MiB block (three chunks) is found at its window, the container is
// UNHEALTHY durably (after a reopen too), the volume stays healthy and a
// clean block of another container verifies and reads.
func TestVerifyBlockFindsFlippedByte(t *testing.T) {
	posixOnly(t) // edits posix block files; the zoned package tests its own corruption cases
	vol := t.TempDir()
	s := openStore(t, Options{Volumes: []string{vol}, DirectIO: DirectOff})
	mustCreate(t, s, 1)
	mustCreate(t, s, 2)
	data := blockBytes(1, 7, 9<<20)
	writeBlock(t, s, 1, 7, data, 4<<20, DefaultChecksum, 1)
	other := blockBytes(2, 1, 3<<20+17)
	writeBlock(t, s, 2, 1, other, 1<<20, DefaultChecksum, 1)

	var pieces []int64
	n, err := s.VerifyBlock(1, 7, VerifyOptions{Before: func(n int64) error { pieces = append(pieces, n); return nil }})
	if err != nil || n != int64(len(data)) {
		t.Fatalf("clean block: verified %d, err %v", n, err)
	}
	var sum int64
	for _, p := range pieces {
		if p > readPiece {
			t.Fatalf("read a piece of %d bytes > %d", p, readPiece)
		}
		sum += p
	}
	if sum != int64(len(data)) {
		t.Fatalf("Before saw %d bytes, block has %d", sum, len(data))
	}

	const bad = 5<<20 + 70000 // in the second chunk, window at 5 MiB + 64 KiB
	flipByte(t, blockPath(vol, 1, 7), bad)
	_, err = s.VerifyBlock(1, 7, VerifyOptions{})
	wantErr(t, err, ErrCorruption, "container 1", "block 7", fmt.Sprint(5<<20+64<<10))
	if !errors.Is(err, ErrChecksumMismatch) {
		t.Fatalf("want a checksum mismatch, got %v", err)
	}
	if st := stateOf(t, s, 1); st != StateUnhealthy {
		t.Fatalf("container 1 is %v after corruption was found", st)
	}
	if n, err := s.VerifyBlock(2, 1, VerifyOptions{}); err != nil || n != int64(len(other)) {
		t.Fatalf("other container: %d, %v", n, err)
	}
	checkBlock(t, s, 2, 1, other)
	if volumeFailed(s) {
		t.Fatal("volume failed by a corrupt block")
	}
	// Other blocks of the UNHEALTHY container stay readable for salvage.
	if _, err := s.ReadChunk(1, 7, 0, 4<<20); err != nil {
		t.Fatalf("clean range of the unhealthy container: %v", err)
	}
	s.Close()
	s2 := openStore(t, Options{Volumes: []string{vol}, DirectIO: DirectOff})
	if st := stateOf(t, s2, 1); st != StateUnhealthy {
		t.Fatalf("container 1 is %v after reopen", st)
	}
	if st := stateOf(t, s2, 2); st != StateOpen {
		t.Fatalf("container 2 is %v after reopen", st)
	}
}

// TestVerifyBlockTruncatedFile: a block file cut short is corrupt.
func TestVerifyBlockTruncatedFile(t *testing.T) {
	posixOnly(t) // edits posix block files; the zoned package tests its own corruption cases
	vol := t.TempDir()
	s := openStore(t, Options{Volumes: []string{vol}})
	mustCreate(t, s, 1)
	writeBlock(t, s, 1, 1, blockBytes(1, 1, 1<<20), 1<<20, DefaultChecksum, 1)
	if err := os.Truncate(blockPath(vol, 1, 1), 300<<10); err != nil {
		t.Fatal(err)
	}
	_, err := s.VerifyBlock(1, 1, VerifyOptions{})
	wantErr(t, err, ErrCorruption, "shorter")
	if st := stateOf(t, s, 1); st != StateUnhealthy || volumeFailed(s) {
		t.Fatalf("container %v, volume failed %v", st, volumeFailed(s))
	}
}

// TestMissingBlockFileFailsOnlyThatReplica: a committed block whose file
// is gone fails its container (UNHEALTHY, durably), on a read as on a
// verification; the volume stays healthy and every other container on it
// stays readable and writable. (Before, the read failed the volume.)
func TestMissingBlockFileFailsOnlyThatReplica(t *testing.T) {
	posixOnly(t) // edits posix block files; the zoned package tests its own corruption cases
	for _, how := range []string{"read", "verify"} {
		t.Run(how, func(t *testing.T) {
			vol := t.TempDir()
			s := openStore(t, Options{Volumes: []string{vol}})
			for cid := ContainerID(1); cid <= 3; cid++ {
				mustCreate(t, s, cid)
				writeBlock(t, s, cid, 1, blockBytes(cid, 1, 2<<20), 1<<20, DefaultChecksum, 1)
				writeBlock(t, s, cid, 2, blockBytes(cid, 2, 1<<20), 1<<20, DefaultChecksum, 2)
			}
			if err := os.Remove(blockPath(vol, 2, 1)); err != nil {
				t.Fatal(err)
			}
			var err error
			if how == "read" {
				_, err = s.ReadChunk(2, 1, 0, 4096)
			} else {
				_, err = s.VerifyBlock(2, 1, VerifyOptions{})
			}
			wantErr(t, err, ErrBlockFileMissing, "container 2", "block 1")
			if !errors.Is(err, ErrCorruption) {
				t.Fatalf("%v does not match ErrCorruption", err)
			}
			if volumeFailed(s) {
				t.Fatal("a missing block file failed the volume")
			}
			if st := stateOf(t, s, 2); st != StateUnhealthy {
				t.Fatalf("container 2 is %v", st)
			}
			for _, cid := range []ContainerID{1, 3} {
				checkBlock(t, s, cid, 1, blockBytes(cid, 1, 2<<20))
				if st := stateOf(t, s, cid); st != StateOpen {
					t.Fatalf("container %d is %v", cid, st)
				}
			}
			writeBlock(t, s, 3, 3, blockBytes(3, 3, 1<<20), 1<<20, DefaultChecksum, 3)
			checkBlock(t, s, 2, 2, blockBytes(2, 2, 1<<20)) // the rest of the replica, for salvage
			s.Close()
			s2 := openStore(t, Options{Volumes: []string{vol}})
			if st := stateOf(t, s2, 2); st != StateUnhealthy {
				t.Fatalf("container 2 is %v after reopen", st)
			}
			checkBlock(t, s2, 3, 3, blockBytes(3, 3, 1<<20))
		})
	}
}

// faultyFiles is the posix backend with errors injected into opening and
// reading block files (FaultFS only faults mutating calls).
type faultyFiles struct {
	BlockFiles
	mu             sync.Mutex
	openErr, rdErr error
	cid            ContainerID
	lid            LocalID
}

func (f *faultyFiles) set(openErr, rdErr error) {
	f.mu.Lock()
	f.openErr, f.rdErr = openErr, rdErr
	f.mu.Unlock()
}

func (f *faultyFiles) OpenReader(cid ContainerID, lid LocalID) (BlockReader, error) {
	f.mu.Lock()
	openErr, rdErr := f.openErr, f.rdErr
	f.mu.Unlock()
	if cid != f.cid || lid != f.lid {
		return f.BlockFiles.OpenReader(cid, lid)
	}
	if openErr != nil {
		return nil, &os.PathError{Op: "open", Path: "block", Err: openErr}
	}
	r, err := f.BlockFiles.OpenReader(cid, lid)
	if err != nil || rdErr == nil {
		return r, err
	}
	return faultyReader{r, rdErr}, nil
}

type faultyReader struct {
	BlockReader
	err error
}

func (r faultyReader) ReadAt(p []byte, off int64) (int, error) {
	return 0, &os.PathError{Op: "read", Path: "block", Err: r.err}
}

// TestUnreadableBlockFileFailsOnlyThatReplica: EIO reading one block file
// fails that container, not the volume, whether found by a read or a
// verification; EMFILE fails nothing. A block file that is a directory
// (EISDIR) is unreadable too.
func TestUnreadableBlockFileFailsOnlyThatReplica(t *testing.T) {
	vol := t.TempDir()
	var ff *faultyFiles
	s := openStore(t, Options{Volumes: []string{vol}, NewBackend: func(fs vfs.FS, dir string) (BlockFiles, error) {
		p, err := NewPosix(fs, dir, DirectAuto)
		ff = &faultyFiles{BlockFiles: p, cid: 1, lid: 1}
		return ff, err
	}})
	for cid := ContainerID(1); cid <= 3; cid++ {
		mustCreate(t, s, cid)
		writeBlock(t, s, cid, 1, blockBytes(cid, 1, 1<<20), 1<<20, DefaultChecksum, 1)
	}
	ff.set(unix.EMFILE, nil)
	_, err := s.VerifyBlock(1, 1, VerifyOptions{})
	wantErr(t, err, ErrTemporary)
	if _, rerr := s.ReadChunk(1, 1, 0, 100); !errors.Is(rerr, ErrTemporary) {
		t.Fatalf("read with EMFILE: %v", rerr)
	}
	if errors.Is(err, ErrCorruption) || stateOf(t, s, 1) != StateOpen {
		t.Fatalf("EMFILE: %v, container %v", err, stateOf(t, s, 1))
	}
	ff.set(nil, syscall.EIO)
	_, err = s.ReadChunk(1, 1, 0, 100)
	wantErr(t, err, ErrBlockUnreadable, "container 1")
	if !errors.Is(err, ErrCorruption) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("%v: want ErrCorruption and EIO", err)
	}
	_, err = s.VerifyBlock(1, 1, VerifyOptions{})
	wantErr(t, err, ErrBlockUnreadable, "container 1")
	if stateOf(t, s, 1) != StateUnhealthy || volumeFailed(s) {
		t.Fatalf("container %v, volume failed %v", stateOf(t, s, 1), volumeFailed(s))
	}
	checkBlock(t, s, 2, 1, blockBytes(2, 1, 1<<20))

	p := blockPath(vol, 3, 1)
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err = s.VerifyBlock(3, 1, VerifyOptions{})
	wantErr(t, err, ErrBlockUnreadable, "container 3")
	if stateOf(t, s, 3) != StateUnhealthy || volumeFailed(s) {
		t.Fatalf("container %v, volume failed %v", stateOf(t, s, 3), volumeFailed(s))
	}
	checkBlock(t, s, 2, 1, blockBytes(2, 1, 1<<20))
}

// TestVerifyRacingDeleteIsNoFinding: blocks and containers deleted while
// the verifier runs are not reported damaged.
func TestVerifyRacingDeleteIsNoFinding(t *testing.T) {
	s := openStore(t, Options{})
	const n = 40
	for cid := ContainerID(1); cid <= 2; cid++ {
		mustCreate(t, s, cid)
		for lid := LocalID(1); lid <= n; lid++ {
			writeBlock(t, s, cid, lid, blockBytes(cid, lid, 256<<10), 256<<10, DefaultChecksum, uint64(lid))
		}
	}
	if err := s.CloseContainer(2); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for lid := LocalID(1); lid <= n; lid++ {
			if err := s.DeleteBlocks(1, []LocalID{lid}); err != nil {
				t.Error(err)
				return
			}
		}
		if err := s.DeleteContainer(2, false); err != nil {
			t.Error(err)
		}
	}()
	for round := 0; round < 50; round++ {
		for cid := ContainerID(1); cid <= 2; cid++ {
			for lid := LocalID(1); lid <= n; lid++ {
				_, err := s.VerifyBlock(cid, lid, VerifyOptions{})
				if err != nil && !errors.Is(err, ErrBlockNotFound) && !errors.Is(err, ErrContainerNotFound) {
					t.Fatalf("verify %d/%d racing a delete: %v", cid, lid, err)
				}
			}
		}
	}
	wg.Wait()
	if st := stateOf(t, s, 1); st != StateOpen {
		t.Fatalf("container 1 is %v", st)
	}
}

// TestCheckVolumes: a healthy volume passes; a volume whose directory
// refuses new files fails (and only it); a probe that hangs fails its
// volume after the timeout; a full disk is not a failure.
func TestCheckVolumes(t *testing.T) {
	v1, v2 := t.TempDir(), t.TempDir()
	ffs := vfs.NewFaultFS(vfs.Default)
	s := openStore(t, Options{Volumes: []string{v1, v2}, FS: ffs})
	var mu sync.Mutex
	inject := map[string]func() error{}
	ffs.SetInject(func(op, path string) error {
		mu.Lock()
		f := inject[op]
		mu.Unlock()
		if f != nil && strings.HasPrefix(path, v2) {
			return f()
		}
		return nil
	})
	set := func(op string, f func() error) { mu.Lock(); inject[op] = f; mu.Unlock() }
	for _, r := range s.CheckVolumes(5 * time.Second) {
		if r.Failed || r.Err != nil {
			t.Fatalf("healthy volume %s: %+v", r.Path, r)
		}
	}
	set("write", func() error { return unix.ENOSPC })
	for _, r := range s.CheckVolumes(5 * time.Second) {
		if r.Failed {
			t.Fatalf("full volume %s failed: %+v", r.Path, r)
		}
	}
	set("write", nil)
	release := make(chan struct{})
	set("sync", func() error { <-release; return nil })
	start := time.Now()
	res := s.CheckVolumes(300 * time.Millisecond)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("check took %v with a 300ms timeout", took)
	}
	if res[0].Failed || !res[1].Failed || !res[1].NewlyFailed || !strings.Contains(res[1].Err.Error(), "did not finish") {
		t.Fatalf("hung probe: %+v", res)
	}
	close(release)
	vs := s.Volumes()
	if vs[0].Failed || !vs[1].Failed {
		t.Fatalf("volumes: %+v", vs)
	}
	// The failed volume stays failed; the other keeps passing.
	res = s.CheckVolumes(5 * time.Second)
	if res[0].Failed || !res[1].Failed || res[1].NewlyFailed {
		t.Fatalf("second check: %+v", res)
	}

	// A volume that refuses to create files fails at once.
	v3 := t.TempDir()
	ffs3 := vfs.NewFaultFS(vfs.Default)
	s3 := openStore(t, Options{Volumes: []string{v3}, FS: ffs3})
	mustCreate(t, s3, 9)
	ffs3.SetInject(func(op, path string) error {
		if op == "create" || op == "open" {
			return syscall.EIO
		}
		return nil
	})
	res = s3.CheckVolumes(5 * time.Second)
	if !res[0].Failed || !res[0].NewlyFailed || !errors.Is(res[0].Err, syscall.EIO) {
		t.Fatalf("EIO volume: %+v", res)
	}
	if r, err := s3.Container(9); err != nil || r.State != StateUnhealthy {
		t.Fatalf("container on a failed volume: %+v %v", r, err)
	}
}
