package storage

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const crashEnv = "BASALT_STORAGE_CRASH_CHILD"

// crashChild runs in the re-executed test binary: it writes blocks forever
// (mixing committed blocks with uncommitted ones) and prints each block ID
// after its PutBlock returns, until the parent kills it.
func crashChild(dir string, start LocalID) {
	s, err := Open(Options{Volumes: []string{dir}, ContainerSize: 8 << 30})
	if err != nil {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	if _, err := s.CreateContainer(1, CreateOptions{}); err != nil && !errors.Is(err, ErrContainerExists) {
		fmt.Println("ERR", err)
		os.Exit(2)
	}
	r := rand.New(rand.NewPCG(uint64(start), uint64(time.Now().UnixNano())))
	out := bufio.NewWriter(os.Stdout)
	for lid := start; ; lid++ {
		n := 1 + r.IntN(3<<20)
		data := blockBytes(1, lid, n)
		// An uncommitted block that must never become visible.
		junk := blockBytes(2, lid, 1+r.IntN(1<<20))
		if err := s.WriteChunk(1, lid+1<<40, 0, junk, ChecksumData{}, false); err != nil {
			fmt.Println("ERR", err)
			os.Exit(2)
		}
		if _, err := tryWriteBlock(s, 1, lid, data, 256<<10, DefaultChecksum, uint64(lid)); err != nil {
			fmt.Println("ERR", err)
			os.Exit(2)
		}
		fmt.Fprintf(out, "C %d %d\n", lid, n)
		out.Flush()
	}
}

func TestMain(m *testing.M) {
	if dir := os.Getenv(crashEnv); dir != "" {
		useSuiteBackend()
		start, _ := strconv.ParseUint(os.Getenv(crashEnv+"_START"), 10, 64)
		crashChild(dir, LocalID(start))
		return
	}
	os.Exit(runSuites(m))
}

// TestCrashRecovery kills a writer with SIGKILL at random points and checks
// that every block it reported committed verifies, that nothing it did not
// commit is visible, and that its half-written files are cleaned up.
func TestCrashRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("re-execs the test binary")
	}
	dir := t.TempDir()
	committed := map[LocalID]int{}
	next := LocalID(1)
	r := rand.New(rand.NewPCG(42, uint64(time.Now().UnixNano())))
	const rounds = 6
	for round := range rounds {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCrashRecovery$")
		cmd.Env = append(os.Environ(), crashEnv+"="+dir, crashEnv+"_START="+strconv.FormatUint(uint64(next), 10))
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(150+r.IntN(400)) * time.Millisecond)
		cmd.Process.Signal(syscall.SIGKILL)
		err := cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
			t.Fatalf("round %d: child was not killed (%v): %s %s", round, err, stdout.String(), stderr.String())
		}
		reported := 0
		for _, line := range strings.Split(stdout.String(), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 {
				continue
			}
			if f[0] != "C" || len(f) != 3 {
				t.Fatalf("round %d: child said %q; stderr %s", round, line, stderr.String())
			}
			lid, _ := strconv.ParseUint(f[1], 10, 64)
			n, _ := strconv.Atoi(f[2])
			committed[LocalID(lid)] = n
			reported++
			next = max(next, LocalID(lid)+1)
		}

		s, err := Open(Options{Volumes: []string{dir}, ContainerSize: 8 << 30})
		if err != nil {
			t.Fatalf("round %d: reopen: %v", round, err)
		}
		for lid, n := range committed {
			checkBlock(t, s, 1, lid, blockBytes(1, lid, n))
		}
		// Only reported blocks, plus the one in flight at the kill (its
		// PutBlock may have landed before the print), may be visible.
		visible, err := s.ListBlocks(1, 0, 1<<20)
		if errors.Is(err, ErrContainerNotFound) && len(committed) == 0 {
			s.Close() // killed before it created the container
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, bd := range visible {
			if _, ok := committed[bd.LocalID]; ok {
				continue
			}
			if bd.LocalID != next {
				t.Fatalf("round %d: block %d visible but never committed (next was %d)", round, bd.LocalID, next)
			}
			checkBlock(t, s, 1, bd.LocalID, blockBytes(1, bd.LocalID, int(bd.Length)))
			committed[bd.LocalID] = int(bd.Length)
			next++
		}
		rep, _ := s.Container(1)
		if rep.BlockCount != int64(len(committed)) {
			t.Fatalf("round %d: %d blocks counted, %d committed", round, rep.BlockCount, len(committed))
		}
		s.Close()
		// Files left: exactly the committed blocks, at their lengths.
		if onBackend() != "posix" {
			t.Logf("round %d: %d blocks reported, %d committed in total", round, reported, len(committed))
			continue
		}
		ents, err := os.ReadDir(filepath.Join(dir, "basalt/containers/1"))
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) != len(committed) {
			t.Fatalf("round %d: %d files for %d committed blocks", round, len(ents), len(committed))
		}
		for _, e := range ents {
			lid, _ := strconv.ParseUint(strings.TrimSuffix(e.Name(), ".block"), 10, 64)
			fi, _ := e.Info()
			if n, ok := committed[LocalID(lid)]; !ok || int64(n) != fi.Size() {
				t.Fatalf("round %d: leftover file %s (%d bytes)", round, e.Name(), fi.Size())
			}
		}
		t.Logf("round %d: %d blocks reported, %d committed in total", round, reported, len(committed))
		next++ // the child starts past the block that may have been in flight
	}
	if len(committed) < rounds {
		t.Fatalf("only %d blocks committed in %d rounds: the test exercised nothing", len(committed), rounds)
	}
}
