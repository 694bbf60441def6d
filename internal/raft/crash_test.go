package raft

import (
	"bufio"
	"context"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// crashChildEnv makes the test binary act as the child of TestCrashRecovery.
const crashChildEnv = "BASALT_RAFT_CRASH_CHILD"

// TestCrashChild is the child: it proposes entries from several goroutines
// into 4 single-replica groups and prints each one once Propose returned
// (acknowledged), until it is killed.
func TestCrashChild(t *testing.T) {
	dir := os.Getenv(crashChildEnv)
	if dir == "" {
		t.Skip("only runs as the child of TestCrashRecovery")
	}
	h, err := NewHost(HostConfig{
		ID: 1, LogDirs: []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")},
		Transport: NewMemNetwork(1).Transport(1), TickInterval: 5 * time.Millisecond,
		CompactEvery: 1 << 30, // the test state machine is not durable: keep the whole log
	})
	if err != nil {
		t.Fatal(err)
	}
	var out sync.Mutex
	w := bufio.NewWriter(os.Stdout)
	var wg sync.WaitGroup
	for gid := uint64(1); gid <= 4; gid++ {
		g, err := h.AddGroup(GroupConfig{ID: gid, Peers: []uint64{1}, StateMachine: &kvSM{}})
		if err != nil {
			t.Fatal(err)
		}
		for !g.IsLeader() {
			time.Sleep(time.Millisecond)
		}
		for p := 0; p < 4; p++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					val := fmt.Sprintf("g%d-p%d-%d-%d", gid, p, os.Getpid(), i)
					res, err := g.Propose(context.Background(), []byte(val), nil)
					if err != nil {
						fmt.Fprintln(os.Stderr, "propose:", err)
						os.Exit(3)
					}
					out.Lock()
					fmt.Fprintf(w, "ACK %d %d %s\n", gid, res.Index, val)
					w.Flush()
					out.Unlock()
				}
			}()
		}
	}
	wg.Wait()
}

// TestCrashRecovery kills a child process that is writing entries at
// random moments and checks that a reopened log store returns every entry
// acknowledged before the kill.
func TestCrashRecovery(t *testing.T) {
	dir := t.TempDir()
	rnd := rand.New(rand.NewSource(time.Now().UnixNano()))
	acked := map[[2]uint64]string{} // (group, index) → value
	for round := 0; round < 4; round++ {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), crashChildEnv+"="+dir)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		lines := make(chan string, 1024)
		go func() {
			s := bufio.NewScanner(stdout)
			for s.Scan() {
				lines <- s.Text()
			}
			close(lines)
		}()
		// Once it acknowledges entries, let it write for a random while,
		// then kill it without warning. The while starts at its first
		// acknowledgement, not at its start: a loaded machine may take
		// longer than the whole while to start the process, open the
		// stores and elect the groups, and a child killed before it
		// acknowledged anything tests nothing.
		var kill <-chan time.Time
		started := time.After(60 * time.Second)
		n := 0
	read:
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					break read
				}
				if parseAck(t, l, acked) {
					if n == 0 {
						kill = time.After(time.Duration(rnd.Intn(400)) * time.Millisecond)
						started = nil
					}
					n++
				}
			case <-kill:
				cmd.Process.Signal(syscall.SIGKILL)
				kill = nil
			case <-started:
				cmd.Process.Signal(syscall.SIGKILL)
				started = nil
				t.Errorf("round %d: child acknowledged nothing in 60s; killed it", round)
			}
		}
		if err := cmd.Wait(); kill != nil || started != nil {
			// It ended before the kill: Propose failed (see its stderr).
			t.Fatalf("round %d: child exited by itself: %v", round, err)
		}
		if n == 0 {
			t.Fatalf("round %d: child acknowledged nothing", round)
		}
		t.Logf("round %d: %d entries acknowledged before SIGKILL", round, n)
		verifyStores(t, dir, acked)
	}
}

func parseAck(t *testing.T, l string, acked map[[2]uint64]string) bool {
	f := strings.Fields(l)
	if len(f) != 4 || f[0] != "ACK" {
		return false // test framework output
	}
	g, _ := strconv.ParseUint(f[1], 10, 64)
	i, _ := strconv.ParseUint(f[2], 10, 64)
	if prev, ok := acked[[2]uint64{g, i}]; ok && prev != f[3] {
		t.Fatalf("group %d index %d acknowledged twice: %q then %q", g, i, prev, f[3])
	}
	acked[[2]uint64{g, i}] = f[3]
	return true
}

// verifyStores checks every acknowledged entry twice: in the log stores as
// a restarted process finds them, and by restarting a host on them and
// letting the groups apply their logs again.
func verifyStores(t *testing.T, dir string, acked map[[2]uint64]string) {
	t.Helper()
	found := map[uint64]*groupLog{}
	var stores []*logStore
	for _, sub := range []string{"a", "b"} {
		s, err := openLogStore(filepath.Join(dir, sub), nil)
		if err != nil {
			t.Fatal(err)
		}
		stores = append(stores, s)
		ids, err := s.groupIDs()
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			gl, err := s.load(id)
			if err != nil {
				t.Fatal(err)
			}
			found[id] = gl
		}
	}
	last := map[uint64]uint64{}
	for key, val := range acked {
		gl, ok := found[key[0]]
		if !ok {
			t.Fatalf("group %d missing after crash", key[0])
		}
		ents, err := gl.Entries(key[1], key[1]+1, 1<<20)
		if err != nil {
			t.Fatalf("group %d: acknowledged entry %d lost: %v", key[0], key[1], err)
		}
		d, err := decodeEntryData(ents[0].GetData())
		if err != nil || string(d.meta) != val {
			t.Fatalf("group %d entry %d = %q (%v), acknowledged %q", key[0], key[1], d.meta, err, val)
		}
		last[key[0]] = max(last[key[0]], key[1])
	}
	for _, s := range stores {
		s.close()
	}

	h, err := NewHost(HostConfig{
		ID: 1, LogDirs: []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")},
		Transport: NewMemNetwork(1).Transport(1), TickInterval: 5 * time.Millisecond, CompactEvery: 1 << 30,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	sms := map[uint64]*kvSM{}
	for _, gid := range h.StoredGroups() {
		sms[gid] = &kvSM{}
		if _, err := h.AddGroup(GroupConfig{ID: gid, StateMachine: sms[gid]}); err != nil {
			t.Fatal(err)
		}
	}
	for gid, idx := range last {
		g, err := h.Group(gid)
		if err != nil {
			t.Fatal(err)
		}
		// A deadline, not a pace: replaying thousands of entries on a
		// loaded machine can take seconds.
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err = g.WaitApplied(ctx, idx)
		cancel()
		if err != nil {
			t.Fatalf("group %d after restart: %v", gid, err)
		}
	}
	for key, val := range acked {
		sm := sms[key[0]]
		sm.mu.Lock()
		okv := false
		for i, at := range sm.at {
			if at == key[1] {
				okv = sm.vals[i] == val
				break
			}
		}
		sm.mu.Unlock()
		if !okv {
			t.Fatalf("group %d: after restart entry %d is not the acknowledged %q", key[0], key[1], val)
		}
	}
}
